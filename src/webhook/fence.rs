//! The fencing rule as a pure function: may a write that presents a token land on a protected
//! object? No I/O here: the webhook supplies the lease (from its cache or a fresh read).

use crate::api::{
    DELETE_INTENT_ANNOTATION, LEASE_LABEL, LEASE_UID_ANNOTATION, TOKEN_ANNOTATION,
    WRITE_ID_ANNOTATION,
};
use crate::stamp::{parse_token, TokenError};
use crate::webhook::decision::Denial;

/// What the webhook knows of the lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseView {
    pub uid: String,
    /// `metadata.generation`: the current token.
    pub generation: i64,
    pub holder: Option<String>,
    /// `metadata.deletionTimestamp` is set: the lease waits for a finalizer (policy mode's
    /// controller holds it until the lease index no longer lists it). It fences no write.
    pub deleting: bool,
}

/// Enforce (refuse bad writes) or warn (let them through with a warning).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Enforce,
    Warn,
}

impl Mode {
    /// From the mode annotation of the object's Namespace (never of the object: its writers
    /// must not choose how they are judged); anything but `warn` enforces (fail closed).
    pub(super) fn from_annotation(v: Option<&str>) -> Mode {
        match v {
            Some("warn") => Mode::Warn,
            _ => Mode::Enforce,
        }
    }
}

/// The fencing metadata an object carries: what a writer stamps on every write.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stamp<'a> {
    /// The `fencedlease.io/token` annotation.
    pub token: Option<&'a str>,
    /// The `fencedlease.io/lease-uid` annotation.
    pub lease_uid: Option<&'a str>,
    /// The `fencedlease.io/write-id` annotation: new on every write, so that a write which does
    /// not stamp (kubectl label, a code path that forgets) cannot pass with the token an
    /// earlier write left on the object.
    pub write_id: Option<&'a str>,
    /// The `fencedlease.io/delete-intent` annotation: the write id of the write that announced
    /// a delete (see [`WriteAttempt::deleting`]).
    pub delete_intent: Option<&'a str>,
}

/// A write to judge.
#[derive(Clone, Debug)]
pub struct WriteAttempt<'a> {
    pub lease_name: &'a str,
    pub namespace: &'a str,
    /// The stamp on the object as it would be stored.
    pub stamp: Stamp<'a>,
    /// On update, the stamp of the stored object. A token counts as presented by this write
    /// only if the write also sets a write id other than this one.
    pub previous: Option<Stamp<'a>>,
    /// A delete: `stamp` is then the stored object's, and the delete lands only if the last
    /// write announced it (its delete intent is its own write id) under the current token. A
    /// delete carries no object of its own, so the holder announces it first in a fenced update.
    pub deleting: bool,
}

/// Why a write is refused. Each has its own message and metric label.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    MissingToken,
    MissingLeaseUid,
    MalformedToken(TokenError),
    /// An update whose write id is absent or the stored one: its token was inherited.
    NotPresented,
    /// A delete the object's last write did not announce.
    DeleteNotAnnounced,
    NoLease,
    /// The lease is being deleted: it fences no write.
    LeaseDeleting {
        current: i64,
    },
    LeaseFree {
        current: i64,
    },
    OtherLeaseIncarnation {
        current_uid: String,
    },
    Stale {
        presented: i64,
        current: i64,
        holder: Option<String>,
    },
    Future {
        presented: i64,
        current: i64,
        holder: Option<String>,
    },
}

impl Refusal {
    /// A bounded label for metrics.
    pub(super) fn denial(&self) -> Denial {
        match self {
            Refusal::MissingToken | Refusal::MissingLeaseUid => Denial::Missing,
            Refusal::MalformedToken(_) => Denial::Malformed,
            Refusal::NotPresented => Denial::NotPresented,
            Refusal::DeleteNotAnnounced => Denial::UnannouncedDelete,
            Refusal::NoLease | Refusal::LeaseDeleting { .. } => Denial::NoLease,
            Refusal::LeaseFree { .. } => Denial::Free,
            Refusal::OtherLeaseIncarnation { .. } | Refusal::Stale { .. } => Denial::Stale,
            Refusal::Future { .. } => Denial::Future,
        }
    }

    /// Could a view of the lease that lags behind explain this refusal? Then it is decided
    /// again on a fresh read. The others hold whatever the lease is now: a token below a
    /// generation the lease has reached stays below it (generations never go down within one
    /// lease uid), and what the write itself lacks no read can supply.
    pub(super) fn may_be_cache_lag(&self) -> bool {
        matches!(
            self,
            Refusal::NoLease
                | Refusal::LeaseFree { .. }
                | Refusal::OtherLeaseIncarnation { .. }
                | Refusal::Future { .. }
        )
    }

    /// The message a person reads in kubectl's error: the lease, what was presented, what is
    /// current, and what to do.
    pub(super) fn message(&self, w: &WriteAttempt<'_>) -> String {
        let lease = format!("FencedLease {}/{}", w.namespace, w.lease_name);
        let presented = w.stamp.token.unwrap_or("none");
        match self {
            Refusal::MissingToken => format!(
                "fencedlease: this object is protected by {lease} (label {LEASE_LABEL}); every write must carry the holder's token in annotation {TOKEN_ANNOTATION}, the lease uid in {LEASE_UID_ANNOTATION} and a new {WRITE_ID_ANNOTATION}"
            ),
            Refusal::MissingLeaseUid => format!(
                "fencedlease: the write presents token {presented} for {lease} but no {LEASE_UID_ANNOTATION} annotation; add the lease uid (FENCEDLEASE_LEASE_UID) so that a token of a deleted lease cannot pass"
            ),
            Refusal::MalformedToken(e) => format!(
                "fencedlease: annotation {TOKEN_ANNOTATION}={presented:?} is not a fencing token: {e}; use the decimal token of {lease} exactly as handed out"
            ),
            Refusal::NotPresented => format!(
                "fencedlease: this update of an object protected by {lease} does not present a token of its own: annotation {WRITE_ID_ANNOTATION} is {}, so token {presented} was left by an earlier write; set {TOKEN_ANNOTATION}, {LEASE_UID_ANNOTATION} and a new {WRITE_ID_ANNOTATION} (any value not used before, e.g. a UUID) in the write itself (kubectl label/annotate/edit and tools that do not stamp are refused here by design)",
                match w.stamp.write_id {
                    Some(id) if !id.is_empty() => format!("unchanged ({id:?})"),
                    _ => "absent".to_string(),
                }
            ),
            Refusal::DeleteNotAnnounced => format!(
                "fencedlease: this object is protected by {lease}, and its last write did not announce a delete: annotation {DELETE_INTENT_ANNOTATION} is {}; the holder deletes in two steps under its current token: a fenced update that sets {DELETE_INTENT_ANNOTATION} to that same update's new {WRITE_ID_ANNOTATION} (with {TOKEN_ANNOTATION} and {LEASE_UID_ANNOTATION}), then the delete (the sidecar's API proxy and the fencedlease clients do both)",
                match w.stamp.delete_intent.filter(|i| !i.is_empty()) {
                    None => "absent".to_string(),
                    Some(i) => format!(
                        "{i:?}, not the last write's id {:?}",
                        w.stamp.write_id.unwrap_or("")
                    ),
                }
            ),
            Refusal::NoLease => format!(
                "fencedlease: this object is protected by {lease}, which does not exist; create it (or fix label {LEASE_LABEL}: it names a lease in the object's own namespace)"
            ),
            Refusal::LeaseDeleting { current } => format!(
                "fencedlease: {lease} is being deleted (current token {current}): a lease being deleted fences no write; once it is gone, create it again and have its holder acquire it"
            ),
            Refusal::LeaseFree { current } => format!(
                "fencedlease: stale token {presented}: {lease} is free (nobody holds it; current token {current}); acquire the lease before writing"
            ),
            Refusal::OtherLeaseIncarnation { current_uid } => format!(
                "fencedlease: stale token {presented}: it belongs to an earlier {lease} (uid {}), which was deleted; the lease now has uid {current_uid}",
                w.stamp.lease_uid.unwrap_or("none")
            ),
            Refusal::Stale { presented, current, holder } => format!(
                "fencedlease: stale token {presented}: {lease} has moved on to token {current}, held by {}; this writer was replaced and must stop",
                holder.as_deref().unwrap_or("nobody")
            ),
            Refusal::Future { presented, current, holder } => format!(
                "fencedlease: token {presented} is ahead of {lease}, whose current token is {current} (held by {}); it was not handed out",
                holder.as_deref().unwrap_or("nobody")
            ),
        }
    }
}

/// The verdict on one write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Allow,
    Refuse(Refusal),
}

/// Checks what the write itself must carry, before any lease is consulted.
fn check_presented<'a>(w: &WriteAttempt<'a>) -> Result<(i64, &'a str), Refusal> {
    use Refusal::*;
    // A delete's stamp is the stored object's: first, whether its last write announced it.
    if w.deleting {
        match (w.stamp.delete_intent, w.stamp.write_id) {
            (Some(intent), Some(id)) if !id.is_empty() && intent == id => {}
            _ => return Err(DeleteNotAnnounced),
        }
    }
    let raw = w.stamp.token.ok_or(MissingToken)?;
    let presented = parse_token(raw).map_err(MalformedToken)?;
    let uid = w
        .stamp
        .lease_uid
        .filter(|u| !u.is_empty())
        .ok_or(MissingLeaseUid)?;
    if let Some(prev) = &w.previous {
        match w.stamp.write_id.filter(|id| !id.is_empty()) {
            Some(id) if Some(id) != prev.write_id => {}
            _ => return Err(NotPresented),
        }
    }
    Ok((presented, uid))
}

/// The fencing rule. `lease` is None when the lease does not exist (as far as the caller
/// knows). A delete is judged on the stamp of the stored object, which must announce it (see
/// [`WriteAttempt::deleting`]). A write is allowed only if it presents, itself, the current generation of the
/// lease's current incarnation while someone holds it. Given a view of the lease read after
/// the write arrived, that also means the write's token is at least every token the lease
/// ever handed out, so no object can be moved back to an older holder's token; tokens that
/// were never handed out (stored while the namespace was in warn mode) count for nothing.
///
/// The rule's second copy is the policy's CEL, charts/fencedlease/templates/fencing-policy.yaml
/// (policy mode): the same order of checks and the same messages. Change both together;
/// tests/common/stories.rs plays the same stale-writer stories against each
/// (tests/webhook.rs, tests/fencing_policy.rs).
pub fn decide(w: &WriteAttempt<'_>, lease: Option<&LeaseView>) -> Verdict {
    use Refusal::*;
    let (presented, uid) = match check_presented(w) {
        Ok(p) => p,
        Err(r) => return Verdict::Refuse(r),
    };
    let Some(lease) = lease else {
        return Verdict::Refuse(NoLease);
    };
    if lease.uid != uid {
        return Verdict::Refuse(OtherLeaseIncarnation {
            current_uid: lease.uid.clone(),
        });
    }
    let holder = lease.holder.clone().filter(|h| !h.is_empty());
    let current = lease.generation;
    if lease.deleting {
        return Verdict::Refuse(LeaseDeleting { current });
    }
    if presented < current {
        return Verdict::Refuse(Stale {
            presented,
            current,
            holder,
        });
    }
    if presented > current {
        return Verdict::Refuse(Future {
            presented,
            current,
            holder,
        });
    }
    if holder.is_none() {
        return Verdict::Refuse(LeaseFree { current });
    }
    Verdict::Allow
}

/// Writers trusted to change protected objects without a token, as long as they leave the
/// fencing metadata alone: Kubernetes' own controllers (revision annotations, finalizers,
/// ownerReferences, status, /scale from the HPA). Exact names only.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Exemptions {
    users: Vec<String>,
    groups: Vec<String>,
}

/// The identities of kube-controller-manager that write to objects users protect: its own
/// user, and the ServiceAccounts its controllers use with --use-service-account-credentials.
pub const DEFAULT_EXEMPT_USERS: &[&str] = &[
    "system:kube-controller-manager",
    // Binds pods to nodes (pods/binding): a protected pod is bound by the scheduler alone.
    "system:kube-scheduler",
    "system:serviceaccount:kube-system:deployment-controller",
    "system:serviceaccount:kube-system:statefulset-controller",
    "system:serviceaccount:kube-system:replicaset-controller",
    "system:serviceaccount:kube-system:daemon-set-controller",
    "system:serviceaccount:kube-system:job-controller",
    "system:serviceaccount:kube-system:cronjob-controller",
    "system:serviceaccount:kube-system:generic-garbage-collector",
    "system:serviceaccount:kube-system:horizontal-pod-autoscaler",
    // Deleters: a deleted Namespace's contents, finished Jobs' and dead nodes' pods.
    "system:serviceaccount:kube-system:namespace-controller",
    "system:serviceaccount:kube-system:ttl-after-finished-controller",
    "system:serviceaccount:kube-system:pod-garbage-collector",
    // Evict the pods of a dead node (1.29 and later; before, the node controller did).
    "system:serviceaccount:kube-system:taint-eviction-controller",
    "system:serviceaccount:kube-system:node-controller",
];

/// Why an exemption is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ExemptionError {
    #[error("exempt writer {0:?}: names must be exact (no wildcards, no empty names)")]
    NotExact(String),
    #[error("exempt group {0:?} takes in ordinary users or workloads' ServiceAccounts; name the controllers' own users instead")]
    BroadGroup(String),
    #[error("exempt user {0:?} is a ServiceAccount outside kube-system, which a workload could run as; only kube-system's controllers can be exempt")]
    WorkloadServiceAccount(String),
    #[error("exempt {0} {1:?} is {2}: its writes would pass unfenced; remove it and name Kubernetes' own controllers instead")]
    Unsafe(&'static str, String, &'static str),
}

/// Why an identity may never be exempt, if it is one of those: requests without credentials,
/// and the kubelets' identities (whoever runs a pod with a node's credentials could write as it).
fn unsafe_identity(kind: &str, name: &str) -> Option<&'static str> {
    match (kind, name) {
        ("user", "system:anonymous") => Some("the user of every request without credentials"),
        ("user", n) if n.starts_with("system:node:") => {
            Some("a kubelet's identity, which anyone holding that node's credentials can use")
        }
        ("group", "system:unauthenticated") => {
            Some("the group of every request without credentials")
        }
        ("group", "system:nodes") => Some("the group of every kubelet"),
        _ => None,
    }
}

impl Exemptions {
    /// Checks that no workload's identity can qualify: exact names, no group that holds
    /// ServiceAccounts or all users, no ServiceAccount outside kube-system, no anonymous or
    /// node identity.
    pub fn new(users: Vec<String>, groups: Vec<String>) -> Result<Exemptions, ExemptionError> {
        let exact = |n: &String| !n.is_empty() && !n.contains('*') && n.trim() == n;
        for u in &users {
            if !exact(u) {
                return Err(ExemptionError::NotExact(u.clone()));
            }
            if let Some(why) = unsafe_identity("user", u) {
                return Err(ExemptionError::Unsafe("user", u.clone(), why));
            }
            if let Some(rest) = u.strip_prefix("system:serviceaccount:") {
                if !rest.starts_with("kube-system:") {
                    return Err(ExemptionError::WorkloadServiceAccount(u.clone()));
                }
            }
        }
        for g in &groups {
            if !exact(g) {
                return Err(ExemptionError::NotExact(g.clone()));
            }
            if let Some(why) = unsafe_identity("group", g) {
                return Err(ExemptionError::Unsafe("group", g.clone(), why));
            }
            let broad = matches!(
                g.as_str(),
                "system:authenticated" | "system:unauthenticated" | "system:serviceaccounts"
            ) || g.starts_with("system:serviceaccounts:");
            if broad {
                return Err(ExemptionError::BroadGroup(g.clone()));
            }
        }
        Ok(Exemptions { users, groups })
    }

    /// Is this writer exempt?
    pub(crate) fn covers(&self, username: &str, groups: &[String]) -> bool {
        self.users.iter().any(|u| u == username) || groups.iter().any(|g| self.groups.contains(g))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn lease(generation: i64, holder: Option<&str>) -> LeaseView {
        LeaseView {
            uid: "u1".into(),
            generation,
            holder: holder.map(str::to_string),
            deleting: false,
        }
    }
    fn stamp<'a>(token: Option<&'a str>, uid: Option<&'a str>, id: Option<&'a str>) -> Stamp<'a> {
        Stamp {
            token,
            lease_uid: uid,
            write_id: id,
            delete_intent: None,
        }
    }
    fn attempt<'a>(token: Option<&'a str>, uid: Option<&'a str>) -> WriteAttempt<'a> {
        WriteAttempt {
            lease_name: "inventory",
            namespace: "shop",
            stamp: stamp(token, uid, None),
            previous: None,
            deleting: false,
        }
    }
    fn update<'a>(new: Stamp<'a>, old: Stamp<'a>) -> WriteAttempt<'a> {
        WriteAttempt {
            lease_name: "inventory",
            namespace: "shop",
            stamp: new,
            previous: Some(old),
            deleting: false,
        }
    }

    #[test]
    fn token_parsing_is_strict() {
        let table: &[(&str, Result<i64, TokenError>)] = &[
            ("1", Ok(1)),
            ("42", Ok(42)),
            ("9223372036854775807", Ok(i64::MAX)),
            ("", Err(TokenError::Empty)),
            ("0", Err(TokenError::Zero)),
            ("-3", Err(TokenError::Negative)),
            ("-", Err(TokenError::NotANumber)),
            ("+3", Err(TokenError::Padded)),
            ("03", Err(TokenError::Padded)),
            (" 3", Err(TokenError::Padded)),
            ("3 ", Err(TokenError::Padded)),
            ("3\n", Err(TokenError::Padded)),
            ("3.0", Err(TokenError::NotANumber)),
            ("1e3", Err(TokenError::NotANumber)),
            ("0x10", Err(TokenError::Padded)),
            ("abc", Err(TokenError::NotANumber)),
            ("٣", Err(TokenError::NotANumber)),
            ("9223372036854775808", Err(TokenError::TooLarge)),
            ("99999999999999999999999", Err(TokenError::TooLarge)),
        ];
        for (s, want) in table {
            assert_eq!(&parse_token(s), want, "{s:?}");
        }
    }

    #[test]
    fn the_rule_table() {
        let cur = lease(5, Some("b"));
        let free = lease(5, None);
        let blank = lease(5, Some(""));
        let doomed = LeaseView {
            deleting: true,
            ..lease(5, Some("b"))
        };
        let cases: Vec<(WriteAttempt<'_>, Option<&LeaseView>, Verdict)> = vec![
            (attempt(Some("5"), Some("u1")), Some(&cur), Verdict::Allow),
            // A lease being deleted fences nothing, even its holder's current token; another
            // incarnation's token is told so first.
            (
                attempt(Some("5"), Some("u1")),
                Some(&doomed),
                Verdict::Refuse(Refusal::LeaseDeleting { current: 5 }),
            ),
            (
                attempt(Some("5"), Some("u0")),
                Some(&doomed),
                Verdict::Refuse(Refusal::OtherLeaseIncarnation {
                    current_uid: "u1".into(),
                }),
            ),
            (
                attempt(None, Some("u1")),
                Some(&cur),
                Verdict::Refuse(Refusal::MissingToken),
            ),
            (
                attempt(Some("5"), None),
                Some(&cur),
                Verdict::Refuse(Refusal::MissingLeaseUid),
            ),
            (
                attempt(Some("5"), Some("")),
                Some(&cur),
                Verdict::Refuse(Refusal::MissingLeaseUid),
            ),
            (
                attempt(Some("x"), Some("u1")),
                Some(&cur),
                Verdict::Refuse(Refusal::MalformedToken(TokenError::NotANumber)),
            ),
            (
                attempt(Some("5"), Some("u1")),
                None,
                Verdict::Refuse(Refusal::NoLease),
            ),
            (
                attempt(Some("4"), Some("u1")),
                Some(&cur),
                Verdict::Refuse(Refusal::Stale {
                    presented: 4,
                    current: 5,
                    holder: Some("b".into()),
                }),
            ),
            (
                attempt(Some("6"), Some("u1")),
                Some(&cur),
                Verdict::Refuse(Refusal::Future {
                    presented: 6,
                    current: 5,
                    holder: Some("b".into()),
                }),
            ),
            (
                attempt(Some("5"), Some("u0")),
                Some(&cur),
                Verdict::Refuse(Refusal::OtherLeaseIncarnation {
                    current_uid: "u1".into(),
                }),
            ),
            (
                attempt(Some("5"), Some("u1")),
                Some(&free),
                Verdict::Refuse(Refusal::LeaseFree { current: 5 }),
            ),
            (
                attempt(Some("5"), Some("u1")),
                Some(&blank),
                Verdict::Refuse(Refusal::LeaseFree { current: 5 }),
            ),
        ];
        for (w, l, want) in cases {
            assert_eq!(decide(&w, l), want, "{w:?} {l:?}");
        }
    }

    #[test]
    fn an_update_must_present_its_token_with_a_new_write_id() {
        let cur = lease(5, Some("b"));
        let old = stamp(Some("5"), Some("u1"), Some("w1"));
        let table = [
            // kubectl label, a forgotten stamp: the stored token and write id are inherited.
            (stamp(Some("5"), Some("u1"), Some("w1")), false),
            // A write id that is absent or empty presents nothing either.
            (stamp(Some("5"), Some("u1"), None), false),
            (stamp(Some("5"), Some("u1"), Some("")), false),
            // A new write id with the current token: presented.
            (stamp(Some("5"), Some("u1"), Some("w2")), true),
        ];
        for (new, allowed) in table {
            let want = if allowed {
                Verdict::Allow
            } else {
                Verdict::Refuse(Refusal::NotPresented)
            };
            assert_eq!(decide(&update(new, old), Some(&cur)), want, "{new:?}");
        }
        // A stored object without any write id (written before write ids): a new one counts.
        let bare = stamp(Some("5"), Some("u1"), None);
        assert_eq!(
            decide(
                &update(stamp(Some("5"), Some("u1"), Some("w")), bare),
                Some(&cur)
            ),
            Verdict::Allow
        );
    }

    #[test]
    fn a_delete_lands_only_as_announced_by_the_last_write_under_the_current_token() {
        use Refusal::*;
        // The stored object: (token, write id, delete intent); the lease is at 5, held.
        let stored = |token: Option<&'static str>, id, intent| Stamp {
            delete_intent: intent,
            ..stamp(token, Some("u1"), id)
        };
        let deleting = |s: Stamp<'static>| WriteAttempt {
            lease_name: "inventory",
            namespace: "shop",
            stamp: s,
            previous: None,
            deleting: true,
        };
        #[rustfmt::skip]
        let table: [(Stamp<'static>, Option<Refusal>); 8] = [
            // The holder announced it under the current token: the delete lands.
            (stored(Some("5"), Some("w9"), Some("w9")), None),
            // Never announced, or announced by an earlier write that a later one (the new
            // holder's) followed: the intent is not the last write's id.
            (stored(Some("5"), Some("w9"), None), Some(DeleteNotAnnounced)),
            (stored(Some("5"), Some("w9"), Some("w8")), Some(DeleteNotAnnounced)),
            (stored(Some("5"), None, Some("w9")), Some(DeleteNotAnnounced)),
            (stored(Some("5"), Some(""), Some("")), Some(DeleteNotAnnounced)),
            // Announced by a holder that has been replaced since (the lease moved on to 5).
            (stored(Some("4"), Some("w9"), Some("w9")),
             Some(Stale { presented: 4, current: 5, holder: Some("b".into()) })),
            // Written with no token at all (created while the object was not protected).
            (stored(None, Some("w9"), Some("w9")), Some(MissingToken)),
            (Stamp { lease_uid: None, ..stored(Some("5"), Some("w9"), Some("w9")) }, Some(MissingLeaseUid)),
        ];
        let cur = lease(5, Some("b"));
        for (s, want) in table {
            let want = want.map_or(Verdict::Allow, Verdict::Refuse);
            assert_eq!(decide(&deleting(s), Some(&cur)), want, "{s:?}");
        }
        // Announced under the current token, but nobody holds the lease now: refused.
        let s = stored(Some("5"), Some("w9"), Some("w9"));
        assert_eq!(
            decide(&deleting(s), Some(&lease(5, None))),
            Verdict::Refuse(LeaseFree { current: 5 })
        );
        // An update is never judged on its intent.
        let announced = stored(Some("5"), Some("w9"), Some("w1"));
        let old = stamp(Some("5"), Some("u1"), Some("w1"));
        assert_eq!(decide(&update(announced, old), Some(&cur)), Verdict::Allow);
    }

    #[test]
    fn stored_tokens_count_for_nothing_but_the_lease_decides() {
        let cur = lease(5, Some("b"));
        // A forged high token stored in warn mode does not lock out the holder (hole 7).
        let forged = stamp(Some("900"), Some("u1"), Some("w1"));
        assert_eq!(
            decide(
                &update(stamp(Some("5"), Some("u1"), Some("w2")), forged),
                Some(&cur)
            ),
            Verdict::Allow
        );
        // A token of a newer lease incarnation on the object cannot be overwritten by the
        // older incarnation's holder: the lease (read after the write arrived) names the uid.
        let newer = stamp(Some("1"), Some("u2"), Some("w1"));
        let u2 = LeaseView {
            uid: "u2".into(),
            generation: 1,
            holder: Some("c".into()),
            deleting: false,
        };
        assert_eq!(
            decide(
                &update(stamp(Some("5"), Some("u1"), Some("w2")), newer),
                Some(&u2)
            ),
            Verdict::Refuse(Refusal::OtherLeaseIncarnation {
                current_uid: "u2".into()
            })
        );
    }

    #[test]
    fn only_cache_explainable_refusals_are_rechecked() {
        assert!(Refusal::Future {
            presented: 2,
            current: 1,
            holder: None
        }
        .may_be_cache_lag());
        assert!(Refusal::NoLease.may_be_cache_lag());
        assert!(!Refusal::Stale {
            presented: 1,
            current: 2,
            holder: None
        }
        .may_be_cache_lag());
        assert!(!Refusal::MissingToken.may_be_cache_lag());
        assert!(!Refusal::NotPresented.may_be_cache_lag());
    }

    #[test]
    fn messages_name_the_lease_and_the_tokens_and_what_to_do() {
        let w = attempt(Some("4"), Some("u1"));
        let m = Refusal::Stale {
            presented: 4,
            current: 5,
            holder: Some("pod-b".into()),
        }
        .message(&w);
        assert!(
            m.contains("shop/inventory")
                && m.contains('4')
                && m.contains('5')
                && m.contains("pod-b"),
            "{m}"
        );
        let w = update(
            stamp(Some("4"), Some("u1"), Some("w1")),
            stamp(Some("4"), Some("u1"), Some("w1")),
        );
        let m = Refusal::NotPresented.message(&w);
        assert!(
            m.contains(WRITE_ID_ANNOTATION) && m.contains("unchanged"),
            "{m}"
        );
        assert_eq!(Mode::from_annotation(Some("warn")), Mode::Warn);
        assert_eq!(Mode::from_annotation(Some("WARN")), Mode::Enforce);
        assert_eq!(Mode::from_annotation(None), Mode::Enforce);
    }

    #[test]
    fn exemptions_take_exact_controller_names_only() {
        let users = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let ok = Exemptions::new(users(DEFAULT_EXEMPT_USERS), vec![]).expect("defaults");
        assert!(ok.covers(
            "system:serviceaccount:kube-system:generic-garbage-collector",
            &[]
        ));
        assert!(!ok.covers("system:serviceaccount:shop:generic-garbage-collector", &[]));
        assert!(!ok.covers(
            "alice",
            &users(&["system:authenticated", "system:serviceaccounts"])
        ));
        let table: &[(&[&str], &[&str], Option<ExemptionError>)] = &[
            (
                &["system:serviceaccount:shop:app"],
                &[],
                Some(ExemptionError::WorkloadServiceAccount(
                    "system:serviceaccount:shop:app".into(),
                )),
            ),
            (
                &["system:serviceaccount:*"],
                &[],
                Some(ExemptionError::NotExact("system:serviceaccount:*".into())),
            ),
            (&[""], &[], Some(ExemptionError::NotExact("".into()))),
            (
                &[],
                &["system:serviceaccounts"],
                Some(ExemptionError::BroadGroup("system:serviceaccounts".into())),
            ),
            (
                &[],
                &["system:serviceaccounts:shop"],
                Some(ExemptionError::BroadGroup(
                    "system:serviceaccounts:shop".into(),
                )),
            ),
            (
                &[],
                &["system:authenticated"],
                Some(ExemptionError::BroadGroup("system:authenticated".into())),
            ),
            (
                &["system:anonymous"],
                &[],
                Some(ExemptionError::Unsafe(
                    "user",
                    "system:anonymous".into(),
                    "the user of every request without credentials",
                )),
            ),
            (
                &["system:node:node-1"],
                &[],
                Some(ExemptionError::Unsafe(
                    "user",
                    "system:node:node-1".into(),
                    "a kubelet's identity, which anyone holding that node's credentials can use",
                )),
            ),
            (
                &[],
                &["system:unauthenticated"],
                Some(ExemptionError::Unsafe(
                    "group",
                    "system:unauthenticated".into(),
                    "the group of every request without credentials",
                )),
            ),
            (
                &[],
                &["system:nodes"],
                Some(ExemptionError::Unsafe(
                    "group",
                    "system:nodes".into(),
                    "the group of every kubelet",
                )),
            ),
            (&["system:nodelet"], &[], None),
            (&[], &["ops-controllers"], None),
        ];
        for (u, g, want) in table {
            let got = Exemptions::new(users(u), users(g)).err();
            assert_eq!(&got, want, "{u:?} {g:?}");
        }
        let g = Exemptions::new(vec![], users(&["ops-controllers"])).expect("group");
        assert!(g.covers("bot", &users(&["x", "ops-controllers"])));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(
            std::env::var("FL_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
        ))]
        #[test]
        fn parse_never_panics_and_round_trips(s in "\\PC{0,30}") {
            if let Ok(n) = parse_token(&s) {
                prop_assert_eq!(n.to_string(), s);
            }
        }

        /// The promise, as a property: allowed exactly when the write itself presents the
        /// current generation of the current incarnation of a held lease; whatever the stored
        /// object carries (any token, any uid) never lets a write through nor locks one out.
        #[test]
        fn only_the_current_token_presented_by_the_write_is_allowed(
            presented in 1i64..20, generation in 1i64..20, held in any::<bool>(),
            same_uid in any::<bool>(), stored in proptest::option::of(1i64..2000),
            stored_uid in proptest::option::of(prop_oneof!["u0", "u1", "u2"]),
            new_id in proptest::option::of("[a-c]{0,2}"), old_id in proptest::option::of("[a-c]{0,2}"),
            is_update in any::<bool>(),
        ) {
            let t = presented.to_string();
            let st = stored.map(|s| s.to_string());
            let w = WriteAttempt {
                lease_name: "l", namespace: "n",
                stamp: stamp(Some(&t), Some(if same_uid { "u1" } else { "u0" }), new_id.as_deref()),
                previous: is_update.then(|| stamp(st.as_deref(), stored_uid.as_deref(), old_id.as_deref())),
                deleting: false,
            };
            let l = lease(generation, held.then_some("h"));
            let v = decide(&w, Some(&l));
            let fresh_id = new_id.as_deref().is_some_and(|n| !n.is_empty() && Some(n) != old_id.as_deref());
            let want_allow = presented == generation && held && same_uid && (!is_update || fresh_id);
            prop_assert_eq!(v == Verdict::Allow, want_allow, "{:?}", v);
        }
    }
}
