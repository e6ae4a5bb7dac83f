//! The webhook's answer to one write at /validate, typed: the response the API server gets and
//! the [`Outcome`] it counts as. Every path of `Shared::validate_body` ends in an [`Answer`], and
//! an outcome's metric label is spelled only in [`Outcome::label`]. The protected-write path
//! (`Judgement::verdict`, then `admission::answer`) is the one benches/webhook_decision.rs
//! measures.

use kube::core::admission::{AdmissionResponse, AdmissionReview};
use kube::core::DynamicObject;

/// Why a write was refused, as the `result` label names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Denial {
    /// No token or no lease uid was presented.
    Missing,
    /// The token was not a number.
    Malformed,
    /// An update kept the stored write id: the token was not presented by this write.
    NotPresented,
    /// A delete whose object did not announce it under the current token.
    UnannouncedDelete,
    /// The lease does not exist, or is being deleted.
    NoLease,
    /// Nobody holds the lease.
    Free,
    /// The token is older than the lease's, or from another incarnation of the lease.
    Stale,
    /// The token is newer than any the lease handed out.
    Future,
    /// A /scale write to a protected object.
    Scale,
    /// A binding of a protected pod.
    Binding,
}

/// How one admission request at /validate ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A protected write that the lease allows.
    Allowed,
    /// Not a protected write (nothing to judge).
    Passed,
    /// A write by an exempt writer (Kubernetes' own controllers).
    Exempt,
    /// Refused by the rule but allowed with a warning: the namespace is in warn mode.
    Warned,
    /// Refused.
    Denied(Denial),
    /// Refused because what the decision needs could not be read (fail closed, 503).
    Unconfirmed,
    /// The request could not be read as an AdmissionReview.
    Invalid,
}

impl Outcome {
    /// Every outcome: the webhook counts each from 0 at its start, so that every `result`
    /// series exists (and `rate()` works) before its first admission.
    pub const ALL: [Outcome; 16] = [
        Outcome::Allowed,
        Outcome::Passed,
        Outcome::Exempt,
        Outcome::Warned,
        Outcome::Unconfirmed,
        Outcome::Invalid,
        Outcome::Denied(Denial::Missing),
        Outcome::Denied(Denial::Malformed),
        Outcome::Denied(Denial::NotPresented),
        Outcome::Denied(Denial::UnannouncedDelete),
        Outcome::Denied(Denial::NoLease),
        Outcome::Denied(Denial::Free),
        Outcome::Denied(Denial::Stale),
        Outcome::Denied(Denial::Future),
        Outcome::Denied(Denial::Scale),
        Outcome::Denied(Denial::Binding),
    ];

    /// The `result` label of `fencedlease_webhook_admissions_total` and of the logs.
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Allowed => "allowed",
            Outcome::Passed => "passed",
            Outcome::Exempt => "exempt",
            Outcome::Warned => "warned",
            Outcome::Unconfirmed => "error",
            Outcome::Invalid => "invalid",
            Outcome::Denied(d) => match d {
                Denial::Missing => "denied_missing",
                Denial::Malformed => "denied_malformed",
                Denial::NotPresented => "denied_not_presented",
                Denial::UnannouncedDelete => "denied_unannounced_delete",
                Denial::NoLease => "denied_no_lease",
                Denial::Free => "denied_free",
                Denial::Stale => "denied_stale",
                Denial::Future => "denied_future",
                Denial::Scale => "denied_scale",
                Denial::Binding => "denied_binding",
            },
        }
    }
}

/// What the webhook answers to one write: the response, and the outcome it counts as.
#[derive(Debug)]
pub struct Answer {
    pub response: AdmissionResponse,
    pub outcome: Outcome,
}

impl Answer {
    pub(super) fn new(response: AdmissionResponse, outcome: Outcome) -> Answer {
        Answer { response, outcome }
    }

    /// The review to send back.
    pub fn into_review(self) -> AdmissionReview<DynamicObject> {
        self.response.into_review()
    }

    /// Whether the write goes through (refused writes and unconfirmed ones do not).
    pub fn allowed(&self) -> bool {
        self.response.allowed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_outcome_has_its_own_label() {
        let labels: Vec<&str> = Outcome::ALL.into_iter().map(Outcome::label).collect();
        let unique: std::collections::BTreeSet<&str> = labels.iter().copied().collect();
        assert_eq!(unique.len(), labels.len(), "{labels:?}");
        assert!(labels
            .iter()
            .all(|l| l.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')));
    }
}
