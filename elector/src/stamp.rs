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

/// The merge patch that announces a delete under `token`: the token, the lease uid, a new write
/// id, and the delete intent set to that same id (what [`announce_delete`] sets on an
/// `ObjectMeta`, for clients that patch raw JSON: the stamping client and the sidecar's proxy).
///
/// ```
/// use fencedlease_elector::{stamp::delete_announcement, FencingToken};
///
/// let token = FencingToken { lease_uid: "0b6f-e1".into(), generation: 6 };
/// let patch = delete_announcement(&token);
/// let a = &patch["metadata"]["annotations"];
/// assert_eq!(a["fencedlease.io/token"], "6");
/// assert_eq!(a["fencedlease.io/delete-intent"], a["fencedlease.io/write-id"]);
/// ```
pub fn delete_announcement(token: &FencingToken) -> serde_json::Value {
    let id = new_write_id(token);
    serde_json::json!({"metadata": {"annotations": {
        TOKEN_ANNOTATION: token.generation.to_string(),
        LEASE_UID_ANNOTATION: token.lease_uid,
        WRITE_ID_ANNOTATION: id,
        DELETE_INTENT_ANNOTATION: id,
    }}})
}

/// A write id never used before by this process: the token's generation, the process id, when
/// the process first asked, and a counter. It only has to differ from the one stored on the
/// object (it proves that this write stamped the token itself).
pub fn new_write_id(token: &FencingToken) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    static START: OnceLock<i128> = OnceLock::new();
    let start = START.get_or_init(|| jiff::Timestamp::now().as_nanosecond());
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!(
        "{}-{}-{:x}-{n}",
        token.generation,
        std::process::id(),
        start
    )
}

/// How a request body is written, by its `Content-Type` (parameters ignored): what
/// [`stamp_body`] does with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyKind {
    /// A whole object (`application/json`, a create or an update), a merge patch or a
    /// strategic merge patch: the token goes into `metadata.annotations`, made if missing.
    Object,
    /// A server-side apply (`application/apply-patch+yaml`): the same, in the applied
    /// configuration, so that this field manager owns the stamp it sends. Only JSON is read
    /// (what kube-rs and client-go send; YAML is refused with a clear error). Apply with
    /// force: the write id changes with every write, so after another manager's stamped
    /// update an apply that does not force conflicts on the three annotations.
    Apply,
    /// A JSON patch (`application/json-patch+json`): three `add` operations are appended, one
    /// per annotation. They need `metadata.annotations` to exist, as it does on every
    /// protected object (its create presented a token); on an object without annotations the
    /// API server refuses the patch, and nothing is written.
    JsonPatch,
}

impl BodyKind {
    /// The kind of a write's body by its content type; `None` for a body this crate does not
    /// stamp (protobuf, CBOR).
    pub fn of(content_type: &str) -> Option<BodyKind> {
        let ct = content_type.split(';').next().unwrap_or("").trim();
        match ct {
            ""
            | "application/json"
            | "application/merge-patch+json"
            | "application/strategic-merge-patch+json" => Some(BodyKind::Object),
            "application/apply-patch+yaml" | "application/apply-patch+json" => {
                Some(BodyKind::Apply)
            }
            "application/json-patch+json" => Some(BodyKind::JsonPatch),
            _ => None,
        }
    }
}

/// Why a body could not be stamped. Nothing is sent then.
#[derive(Debug, thiserror::Error)]
pub enum StampError {
    /// The body is not JSON (an apply patch in YAML, say).
    #[error("the body is not JSON ({0}); send it as JSON so that the token can be stamped on it")]
    NotJson(String),
    /// The body is JSON of the wrong shape.
    #[error("the body is not {0}")]
    Shape(&'static str),
}

/// Stamps a write's body: the [`TOKEN_ANNOTATION`], [`LEASE_UID_ANNOTATION`] and
/// [`WRITE_ID_ANNOTATION`] of `token` and `write_id`, as [`BodyKind`] says. Other labels and
/// annotations are left as they are (so is the [`LEASE_LABEL`]: the object, or the applied
/// configuration, names its lease itself).
///
/// ```
/// use fencedlease_elector::stamp::{stamp_body, BodyKind};
/// use fencedlease_elector::FencingToken;
///
/// let token = FencingToken { lease_uid: "0b6f-e1".into(), generation: 6 };
/// let patch = br#"[{"op":"replace","path":"/data/x","value":"1"}]"#;
/// let stamped = stamp_body(BodyKind::JsonPatch, patch, &token, "6-1").unwrap();
/// let ops: serde_json::Value = serde_json::from_slice(&stamped).unwrap();
/// assert_eq!(ops[1]["path"], "/metadata/annotations/fencedlease.io~1token");
/// assert_eq!(ops[1]["value"], "6");
/// ```
pub fn stamp_body(
    kind: BodyKind,
    body: &[u8],
    token: &FencingToken,
    write_id: &str,
) -> Result<Vec<u8>, StampError> {
    let mut v: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| StampError::NotJson(e.to_string()))?;
    let stamp = [
        (TOKEN_ANNOTATION, token.generation.to_string()),
        (LEASE_UID_ANNOTATION, token.lease_uid.clone()),
        (WRITE_ID_ANNOTATION, write_id.to_string()),
    ];
    match kind {
        BodyKind::Object | BodyKind::Apply => {
            let annotations = annotations_of(&mut v)?;
            for (k, val) in stamp {
                annotations.insert(k.to_string(), serde_json::Value::String(val));
            }
        }
        BodyKind::JsonPatch => {
            let ops = v
                .as_array_mut()
                .ok_or(StampError::Shape("a JSON patch (an array of operations)"))?;
            for (k, val) in stamp {
                let path = format!(
                    "/metadata/annotations/{}",
                    k.replace('~', "~0").replace('/', "~1")
                );
                ops.push(serde_json::json!({"op": "add", "path": path, "value": val}));
            }
        }
    }
    serde_json::to_vec(&v).map_err(|e| StampError::NotJson(e.to_string()))
}

/// `metadata.annotations` of a JSON object body, made if missing or null.
fn annotations_of(
    v: &mut serde_json::Value,
) -> Result<&mut serde_json::Map<String, serde_json::Value>, StampError> {
    let obj = v
        .as_object_mut()
        .ok_or(StampError::Shape("a JSON object"))?;
    let meta = obj
        .entry("metadata")
        .or_insert_with(|| serde_json::json!({}));
    let meta = meta
        .as_object_mut()
        .ok_or(StampError::Shape("an object whose metadata is an object"))?;
    let ann = meta
        .entry("annotations")
        .or_insert_with(|| serde_json::json!({}));
    if ann.is_null() {
        *ann = serde_json::json!({});
    }
    ann.as_object_mut().ok_or(StampError::Shape(
        "an object whose metadata.annotations is an object",
    ))
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

    fn token() -> FencingToken {
        FencingToken {
            lease_uid: "u-1".into(),
            generation: 7,
        }
    }

    #[test]
    fn each_body_kind_is_stamped_and_keeps_what_it_had() {
        let cases: [(&str, &[u8]); 4] = [
            (
                "application/json",
                br#"{"kind":"ConfigMap","metadata":{"name":"a","annotations":{"x":"1"}}}"#,
            ),
            (
                "application/merge-patch+json",
                br#"{"metadata":{"annotations":null},"data":{"k":"v"}}"#,
            ),
            (
                "application/strategic-merge-patch+json; charset=utf-8",
                br#"{"data":{"k":"v"}}"#,
            ),
            (
                "application/apply-patch+yaml",
                br#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"a"}}"#,
            ),
        ];
        for (ct, body) in cases {
            let kind = BodyKind::of(ct).expect(ct);
            let out: serde_json::Value =
                serde_json::from_slice(&stamp_body(kind, body, &token(), "w-1").expect(ct))
                    .expect("JSON");
            let ann = &out["metadata"]["annotations"];
            assert_eq!(ann[TOKEN_ANNOTATION], "7", "{ct}");
            assert_eq!(ann[LEASE_UID_ANNOTATION], "u-1", "{ct}");
            assert_eq!(ann[WRITE_ID_ANNOTATION], "w-1", "{ct}");
            let before: serde_json::Value = serde_json::from_slice(body).expect("JSON");
            if let Some(x) = before["metadata"]["annotations"].get("x") {
                assert_eq!(&ann["x"], x, "{ct}: other annotations stay");
            }
            if let Some(d) = before.get("data") {
                assert_eq!(&out["data"], d, "{ct}: the rest stays");
            }
        }
    }

    #[test]
    fn a_json_patch_gets_three_adds_after_its_own_operations() {
        let body = br#"[{"op":"remove","path":"/data/a~1b"}]"#;
        let out: serde_json::Value = serde_json::from_slice(
            &stamp_body(BodyKind::JsonPatch, body, &token(), "w-2").expect("stamp"),
        )
        .expect("JSON");
        let ops = out.as_array().expect("array");
        assert_eq!(ops.len(), 4);
        assert_eq!(ops[0]["op"], "remove");
        let paths: Vec<&str> = ops[1..].iter().filter_map(|o| o["path"].as_str()).collect();
        assert_eq!(
            paths,
            [
                "/metadata/annotations/fencedlease.io~1token",
                "/metadata/annotations/fencedlease.io~1lease-uid",
                "/metadata/annotations/fencedlease.io~1write-id"
            ]
        );
        assert!(ops[1..].iter().all(|o| o["op"] == "add"));
    }

    #[test]
    fn bodies_that_cannot_be_stamped_are_refused_with_a_reason() {
        let t = token();
        let yaml = b"apiVersion: v1\nkind: ConfigMap\n";
        assert!(matches!(
            stamp_body(BodyKind::Apply, yaml, &t, "w"),
            Err(StampError::NotJson(_))
        ));
        assert!(matches!(
            stamp_body(BodyKind::Object, b"[1]", &t, "w"),
            Err(StampError::Shape(_))
        ));
        assert!(matches!(
            stamp_body(BodyKind::JsonPatch, b"{}", &t, "w"),
            Err(StampError::Shape(_))
        ));
        assert!(matches!(
            stamp_body(
                BodyKind::Object,
                br#"{"metadata":{"annotations":[1]}}"#,
                &t,
                "w"
            ),
            Err(StampError::Shape(_))
        ));
        assert_eq!(BodyKind::of("application/vnd.kubernetes.protobuf"), None);
        assert_eq!(
            BodyKind::of("application/json-patch+json"),
            Some(BodyKind::JsonPatch)
        );
    }

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
