//! The FencedLease's status conditions: what each one says, and merging them with what is
//! stored so that an unchanged condition keeps its transition time. Pure.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;

use super::reconcile::Cause;
use crate::api::{Condition, FencedLease};
use crate::controller::holder::Death;

pub(super) fn condition(
    type_: &str,
    status: bool,
    reason: &str,
    message: String,
    generation: Option<i64>,
) -> Condition {
    Condition {
        type_: type_.into(),
        status: if status { "True" } else { "False" }.into(),
        reason: reason.into(),
        message,
        last_transition_time: Time(jiff::Timestamp::now()),
        observed_generation: generation,
    }
}

/// Merges desired conditions into current ones, keeping lastTransitionTime when the status
/// did not change. Returns the merged list.
pub(super) fn merge_conditions(current: &[Condition], desired: Vec<Condition>) -> Vec<Condition> {
    desired
        .into_iter()
        .map(|mut d| {
            if let Some(c) = current.iter().find(|c| c.type_ == d.type_) {
                if c.status == d.status {
                    d.last_transition_time = c.last_transition_time.clone();
                }
            }
            d
        })
        .collect()
}

pub(super) fn same_conditions(a: &[Condition], b: &[Condition]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.type_ == y.type_
                && x.status == y.status
                && x.reason == y.reason
                && x.message == y.message
        })
}

pub(super) fn desired_conditions(
    lease: &FencedLease,
    revoked: Option<Cause>,
    fenced: Option<Condition>,
) -> Vec<Condition> {
    let mut conds = holding_conditions(lease, revoked);
    conds.push(handover_condition(lease));
    conds.extend(fenced);
    conds
}

/// The reason of a False `Fenced` condition (and of its Warning Event).
pub(super) const NOT_FENCED: &str = "NamespaceNotFenced";

/// The `Fenced` condition, False, for a lease in a namespace the fencing leaves out, where the
/// API server never asks the webhook or the policy about a write, so the lease's token guards
/// nothing. Elsewhere no condition: the controller cannot tell that a namespace *is* fenced
/// (fencing.namespaceSelector may leave it out too; `kubectl fencedlease check` probes that).
pub(super) fn fenced_condition(
    lease: &FencedLease,
    unfenced: Option<&std::collections::BTreeSet<String>>,
) -> Option<Condition> {
    let ns = lease.namespace().unwrap_or_default();
    unfenced?.contains(&ns).then(|| {
        condition(
            "Fenced",
            false,
            NOT_FENCED,
            format!("namespace {ns} is left out of fencing (the chart's fencing.excludeNamespaces, or the release's own namespace): writes to objects labelled for this lease there are never judged, so its token guards nothing; move the lease and its objects to a fenced namespace"),
            lease.metadata.generation,
        )
    })
}

/// Explains a requested handover, including one to a preferred holder that never comes.
pub(super) fn handover_condition(lease: &FencedLease) -> Condition {
    let g = lease.metadata.generation;
    let d = lease.spec.lease_duration_seconds;
    match (
        lease
            .spec
            .preferred_holder
            .as_deref()
            .filter(|p| !p.is_empty()),
        lease.holder(),
    ) {
        (Some(p), Some(h)) if p != h => condition(
            "HandoverPending",
            true,
            "StepDownRequested",
            format!("{h} steps down for {p}"),
            g,
        ),
        (Some(p), None) => condition(
            "HandoverPending",
            true,
            "WaitingForPreferredHolder",
            format!(
                "{p} has the first chance; if it does not acquire within {d}s, any candidate may"
            ),
            g,
        ),
        _ => condition(
            "HandoverPending",
            false,
            "None",
            "no handover requested".into(),
            g,
        ),
    }
}

pub(super) fn holding_conditions(lease: &FencedLease, revoked: Option<Cause>) -> Vec<Condition> {
    let g = lease.metadata.generation;
    let token = lease.token().unwrap_or_default();
    match lease.holder() {
        Some(h) => vec![
            condition(
                "Held",
                true,
                "Acquired",
                format!("held by {h} with token {token}"),
                g,
            ),
            condition(
                "Expired",
                false,
                "Renewing",
                "the holder renews in time".into(),
                g,
            ),
            condition("Released", false, "Held", format!("held by {h}"), g),
        ],
        None => {
            // Revoked by this replica, or (after a restart) recorded as revoked at this very
            // generation: a later release or acquisition moves the generation on.
            match revoked.or_else(|| recorded_revocation(lease)) {
                Some(Cause::HolderDead(death)) => vec![
                    condition(
                        "Held",
                        false,
                        death.reason(),
                        format!("{}: revoked, token now {token}", death.summary()),
                        g,
                    ),
                    condition(
                        "Expired",
                        false,
                        "HolderDead",
                        "the holder was known dead and revoked before its lease ran out".into(),
                        g,
                    ),
                    condition("Released", true, "Revoked", "the lease is free".into(), g),
                ],
                Some(Cause::Expired) => vec![
                    condition(
                        "Held",
                        false,
                        "Revoked",
                        format!("the holder stopped renewing; token now {token}"),
                        g,
                    ),
                    condition(
                        "Expired",
                        true,
                        "NotRenewed",
                        "the holder did not renew within the lease duration and was revoked".into(),
                        g,
                    ),
                    condition("Released", true, "Revoked", "the lease is free".into(), g),
                ],
                None => vec![
                    condition("Held", false, "Free", "nobody holds the lease".into(), g),
                    condition("Expired", false, "Free", "the lease is free".into(), g),
                    condition("Released", true, "Free", "the lease is free".into(), g),
                ],
            }
        }
    }
}

/// A revocation the status records at the lease's generation (written by an earlier term or
/// replica): `Expired=True`, or `Held=False` with a holder-death reason.
pub(super) fn recorded_revocation(lease: &FencedLease) -> Option<Cause> {
    let g = lease.metadata.generation;
    let conditions = &lease.status.as_ref()?.conditions;
    let at_g = |type_: &str| {
        conditions
            .iter()
            .find(|c| c.type_ == type_ && c.observed_generation == g)
    };
    if at_g("Expired").is_some_and(|c| c.status == "True") {
        return Some(Cause::Expired);
    }
    at_g("Held")
        .filter(|c| c.status == "False")
        .and_then(|c| Death::from_reason(&c.reason))
        .map(Cause::HolderDead)
}
