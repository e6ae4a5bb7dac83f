//! Stamping protected writes: the label and annotations that the fencedlease webhook (or the
//! ValidatingAdmissionPolicy of its policy mode) reads to decide whether a write may land.
//!
//! A protected object carries the label [`LEASE_LABEL`] naming its FencedLease, and every write
//! to it presents the writer's token ([`TOKEN_ANNOTATION`], [`LEASE_UID_ANNOTATION`]) and a
//! write id the object has never carried before ([`WRITE_ID_ANNOTATION`]). The write id is what
//! tells a write that presents token 6 from one that merely leaves the stored token 6 in place:
//! an update whose write id is missing or unchanged is refused.

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::lease::rules::FencingToken;

pub use crate::api::{
    DELETE_INTENT_ANNOTATION, LEASE_LABEL, LEASE_UID_ANNOTATION, TOKEN_ANNOTATION,
    WRITE_ID_ANNOTATION,
};

/// Stamps `meta` for a write under `token`: sets the [`LEASE_LABEL`] to `lease` and the token,
/// lease UID and write id annotations, leaving every other label and annotation as it was.
/// `write_id` must be new for every write to the object (a UUID, or the token, the process id
/// and a timestamp).
///
/// ```
/// use fencedlease_elector::{stamp::stamp, FencingToken};
/// use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
///
/// let token = FencingToken { lease_uid: "0b6f-e1".into(), generation: 6 };
/// let mut meta = ObjectMeta::default();
/// stamp(&mut meta, "inventory", &token, "6-4711-1");
/// let annotations = meta.annotations.unwrap_or_default();
/// assert_eq!(annotations["fencedlease.io/token"], "6");
/// assert_eq!(annotations["fencedlease.io/lease-uid"], "0b6f-e1");
/// assert_eq!(meta.labels.unwrap_or_default()["fencedlease.io/lease"], "inventory");
/// ```
pub fn stamp(meta: &mut ObjectMeta, lease: &str, token: &FencingToken, write_id: &str) {
    meta.labels
        .get_or_insert_with(BTreeMap::new)
        .insert(LEASE_LABEL.to_string(), lease.to_string());
    let annotations = meta.annotations.get_or_insert_with(BTreeMap::new);
    annotations.insert(TOKEN_ANNOTATION.to_string(), token.generation.to_string());
    annotations.insert(LEASE_UID_ANNOTATION.to_string(), token.lease_uid.clone());
    annotations.insert(WRITE_ID_ANNOTATION.to_string(), write_id.to_string());
}

/// Stamps `meta` like [`stamp`] and announces a delete: [`DELETE_INTENT_ANNOTATION`] set to
/// `write_id`. A protected object is deleted in two steps, both under the current token: send
/// the object (or a merge patch of just these annotations) stamped by this function as an
/// update, then delete it. The webhook lets the delete through only while the stored object's
/// last write announced it and that write's token is still the lease's.
///
/// ```
/// use fencedlease_elector::{stamp::announce_delete, FencingToken};
/// use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
///
/// let token = FencingToken { lease_uid: "0b6f-e1".into(), generation: 6 };
/// let mut meta = ObjectMeta::default();
/// announce_delete(&mut meta, "inventory", &token, "6-4711-2");
/// let annotations = meta.annotations.unwrap_or_default();
/// assert_eq!(annotations["fencedlease.io/delete-intent"], "6-4711-2");
/// assert_eq!(annotations["fencedlease.io/write-id"], "6-4711-2");
/// ```
pub fn announce_delete(meta: &mut ObjectMeta, lease: &str, token: &FencingToken, write_id: &str) {
    stamp(meta, lease, token, write_id);
    meta.annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(DELETE_INTENT_ANNOTATION.to_string(), write_id.to_string());
}

/// The HTTP status and reason of every fencing refusal, from the webhook, the policy and the
/// sidecar's API proxy alike: 403 Forbidden. Not 409 Conflict: Kubernetes clients read a
/// conflict as "re-read the object and try again" (`kubectl scale` retries one for minutes,
/// client-go's `RetryOnConflict` and kube-rs programs likewise), and a replaced leader must be
/// told once to stop, not invited to retry with the same stale token.
pub const REFUSAL_CODE: u16 = 403;
/// See [`REFUSAL_CODE`].
pub const REFUSAL_REASON: &str = "Forbidden";

/// Why a token string (annotation [`TOKEN_ANNOTATION`] or the `fencedlease-token` header) is
/// not a token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenError {
    /// The string is empty.
    Empty,
    /// Something other than decimal digits.
    NotANumber,
    /// A sign, spaces or leading zeros.
    Padded,
    /// A negative number.
    Negative,
    /// Larger than a 64-bit generation can be.
    TooLarge,
    /// Zero: tokens start at 1.
    Zero,
}

impl fmt::Display for TokenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TokenError::Empty => "it is empty",
            TokenError::NotANumber => "it is not a decimal number",
            TokenError::Padded => "it has a sign, spaces or leading zeros",
            TokenError::Negative => "it is negative",
            TokenError::TooLarge => "it is larger than a 64-bit generation can be",
            TokenError::Zero => "tokens start at 1",
        })
    }
}

/// Parses a token strictly: a canonical positive decimal that fits an int64, nothing else.
pub fn parse_token(s: &str) -> Result<i64, TokenError> {
    if s.is_empty() {
        return Err(TokenError::Empty);
    }
    if s.starts_with('-') && s.len() > 1 && s[1..].bytes().all(|b| b.is_ascii_digit()) {
        return Err(TokenError::Negative);
    }
    if s.trim() != s || s.starts_with('+') || (s.len() > 1 && s.starts_with('0')) {
        return Err(TokenError::Padded);
    }
    if !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(TokenError::NotANumber);
    }
    let n: i64 = s.parse().map_err(|_| TokenError::TooLarge)?;
    if n == 0 {
        return Err(TokenError::Zero);
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamping_keeps_other_labels_and_annotations_and_replaces_an_old_stamp() {
        let mut meta = ObjectMeta {
            labels: Some(BTreeMap::from([("app".to_string(), "db".to_string())])),
            annotations: Some(BTreeMap::from([
                ("note".to_string(), "kept".to_string()),
                (TOKEN_ANNOTATION.to_string(), "5".to_string()),
                (WRITE_ID_ANNOTATION.to_string(), "old".to_string()),
            ])),
            ..ObjectMeta::default()
        };
        let token = FencingToken {
            lease_uid: "uid-1".into(),
            generation: 6,
        };
        stamp(&mut meta, "inventory", &token, "new");
        let labels = meta.labels.unwrap_or_default();
        assert_eq!(labels.get("app").map(String::as_str), Some("db"));
        assert_eq!(
            labels.get(LEASE_LABEL).map(String::as_str),
            Some("inventory")
        );
        let a = meta.annotations.unwrap_or_default();
        assert_eq!(a.get("note").map(String::as_str), Some("kept"));
        assert_eq!(a.get(TOKEN_ANNOTATION).map(String::as_str), Some("6"));
        assert_eq!(
            a.get(LEASE_UID_ANNOTATION).map(String::as_str),
            Some("uid-1")
        );
        assert_eq!(a.get(WRITE_ID_ANNOTATION).map(String::as_str), Some("new"));
    }
}
