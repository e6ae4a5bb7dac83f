//! When the controller *knows* a lease's holder is dead, so that it can revoke the lease at once
//! instead of waiting it out.
//!
//! A holder is known dead only when its identity names a pod of the lease (a pod in the lease's
//! namespace annotated `fencedlease.io/lease: <lease>`) and Kubernetes says that no process of
//! that pod can still be renewing: the pod is gone, its phase is terminal, or the container that
//! campaigns has stopped or restarted since the holder acquired. Anything less certain (a pod
//! that is merely not Ready, a pod being deleted gracefully, a holder that is no pod of the
//! lease, an index that has not listed every pod yet) is not death: the lease is waited out.
//!
//! Revoking early is safe even when the verdict is wrong and the old process still runs: the
//! revocation moves the fencing token on, so every write the old process makes afterwards
//! carries a stale token. Being conservative here only avoids needless takeovers.
//!
//! Pure (no I/O, no clock): the controller feeds it what the pod index and the lease say.

use std::time::Duration;

use jiff::{SignedDuration, Timestamp};

use crate::api::FencedLease;
use crate::lease::rules::Mono;

/// What the index keeps of the container that campaigns (the injected sidecar, or the
/// container that `fencedlease.io/campaign-container` names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Campaigner {
    /// Running since `since` (`state.running.startedAt`, one-second resolution).
    Running { since: Timestamp },
    /// Not running now, and its last run ended at `finished` (`state.terminated`, or
    /// `lastState.terminated` while it waits to restart).
    Stopped { finished: Timestamp },
    /// Not started yet, or the kubelet has not reported it.
    Unknown,
}

/// What the index knows of one pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PodState {
    /// Its phase is Failed or Succeeded: its containers never run again.
    pub finished: Option<Finished>,
    /// `metadata.deletionTimestamp` is set: it is being deleted gracefully.
    pub deleting: bool,
    /// Its campaigning container, if the pod has one the kubelet reported.
    pub campaigner: Campaigner,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Finished {
    Failed,
    Succeeded,
}

/// What the controller knows of the pod that a lease's holder identity names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HolderPod {
    /// The pod index has not completed its first list: it knows nothing yet.
    Unknown,
    /// No pod of this lease has that name, and none was seen deleted: the holder may be
    /// anything (a process outside the cluster, a pod deleted before this controller started).
    NotAPod,
    /// A pod of this lease with that name was deleted, and none has appeared since.
    Gone,
    /// A pod of this lease with that name exists.
    Present(PodState),
}

/// Why the controller knows the holder is dead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Death {
    PodGone,
    PodFinished(Finished),
    ContainerTerminated,
    ContainerRestarted,
}

/// startedAt and finishedAt have one-second resolution (and the pod's clock, the same node's
/// as the holder's acquireTime): a time counts as after acquireTime only when it is later by
/// more than this, whether the kubelet's time was truncated or rounded.
pub const RESOLUTION: SignedDuration = SignedDuration::from_secs(1);

impl Death {
    /// The Event reason.
    pub(super) fn reason(self) -> &'static str {
        match self {
            Death::PodGone => "HolderPodGone",
            Death::PodFinished(_) => "HolderPodFinished",
            Death::ContainerTerminated => "HolderContainerTerminated",
            Death::ContainerRestarted => "HolderContainerRestarted",
        }
    }

    /// The death whose Event reason is `reason` (to recognise a recorded revocation).
    pub(super) fn from_reason(reason: &str) -> Option<Death> {
        [
            Death::PodGone,
            Death::PodFinished(Finished::Failed),
            Death::ContainerTerminated,
            Death::ContainerRestarted,
        ]
        .into_iter()
        .find(|d| d.reason() == reason)
    }

    /// What happened, without naming the pod (for the lease's conditions).
    pub(super) fn summary(self) -> &'static str {
        match self {
            Death::PodGone => "the holder's pod was deleted",
            Death::PodFinished(_) => "the holder's pod failed or completed",
            Death::ContainerTerminated => "the holder's campaigning container terminated",
            Death::ContainerRestarted => "the holder's campaigning container restarted",
        }
    }

    /// One sentence on what happened to `holder`'s pod, for Events.
    pub(super) fn note(self, holder: &str) -> String {
        match self {
            Death::PodGone => format!("the holder's pod {holder} was deleted"),
            Death::PodFinished(Finished::Failed) => {
                format!("the holder's pod {holder} failed (phase Failed)")
            }
            Death::PodFinished(Finished::Succeeded) => {
                format!("the holder's pod {holder} completed (phase Succeeded)")
            }
            Death::ContainerTerminated => {
                format!("the container that campaigns in the holder's pod {holder} terminated")
            }
            Death::ContainerRestarted => format!(
                "the container that campaigns in the holder's pod {holder} restarted after it \
                 acquired"
            ),
        }
    }
}

/// When the current holder acquired, if the status says so for this very tenure: the status
/// names the holder of the spec and carries the current token. Between an acquisition and the
/// new holder's first renewal the status still describes the previous tenure (perhaps of the
/// same identity, before a restart), and after a spec edit (duration, preferredHolder) the token
/// no longer equals the generation: then it is not known, and no container-based death is.
pub fn tenure_start(lease: &FencedLease) -> Option<Timestamp> {
    let holder = lease.holder()?;
    let status = lease.status.as_ref()?;
    let current = status.holder_identity.as_deref() == Some(holder)
        && status.token.is_some()
        && status.token == lease.metadata.generation;
    current
        .then(|| status.acquire_time.as_ref().map(|t| t.0))
        .flatten()
}

/// Whether `at` is surely later than `acquired`, given the one-second resolution of `at`.
fn surely_after(at: Timestamp, acquired: Timestamp) -> bool {
    at.checked_sub(RESOLUTION).is_ok_and(|at| at > acquired)
}

/// The rule: is the holder known dead? `opted_in` is the lease's `spec.revokeOnHolderDeath`,
/// `acquired` its [`tenure_start`].
pub(super) fn death(opted_in: bool, acquired: Option<Timestamp>, pod: HolderPod) -> Option<Death> {
    if !opted_in {
        return None;
    }
    let pod = match pod {
        HolderPod::Unknown | HolderPod::NotAPod => return None,
        HolderPod::Gone => return Some(Death::PodGone),
        HolderPod::Present(pod) => pod,
    };
    // Being deleted gracefully: the sidecar is told to stop and releases by itself, and if it
    // cannot, the pod's disappearance says so.
    if pod.deleting {
        return None;
    }
    if let Some(f) = pod.finished {
        return Some(Death::PodFinished(f));
    }
    // A container's times only say something about the tenure they can be compared with: a
    // status that lags behind a restarted container that acquired again must not revoke it.
    let acquired = acquired?;
    match pod.campaigner {
        Campaigner::Stopped { finished } if surely_after(finished, acquired) => {
            Some(Death::ContainerTerminated)
        }
        Campaigner::Running { since } if surely_after(since, acquired) => {
            Some(Death::ContainerRestarted)
        }
        _ => None,
    }
}

/// Whether a death verdict may revoke `holder` at `now`, when this controller last revoked
/// `last` = (identity, when) of this lease for a death: once per lease duration per identity. A
/// process still running under a dead pod's name (a zombie that can reach the API server, or
/// another process given that identity) acquires again after the revocation; revoking it again
/// at once would trade writes with it as fast as both can go. After one early revocation it is
/// waited out like any holder.
pub(super) fn may_revoke_again(
    last: Option<(&str, Mono)>,
    holder: &str,
    now: Mono,
    lease_duration: Duration,
) -> bool {
    match last {
        Some((h, at)) if h == holder => now >= at + lease_duration,
        _ => true,
    }
}

/// [`death`] for a lease that is held; `None` for a free lease.
pub(super) fn holder_death(lease: &FencedLease, pod: HolderPod) -> Option<Death> {
    lease.holder()?;
    death(lease.spec.revoke_on_holder_death, tenure_start(lease), pod)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{FencedLeaseSpec, FencedLeaseStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
    use proptest::prelude::*;

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + s).expect("in range")
    }

    fn ms(s: i64, millis: i64) -> Timestamp {
        Timestamp::from_millisecond((1_800_000_000 + s) * 1000 + millis).expect("in range")
    }

    fn pod(campaigner: Campaigner) -> PodState {
        PodState {
            finished: None,
            deleting: false,
            campaigner,
        }
    }

    const RUN: Campaigner = Campaigner::Unknown;

    #[test]
    fn only_what_kubernetes_says_for_sure_is_death() {
        let acquired = Some(ms(100, 400));
        let running = |s| Campaigner::Running { since: t(s) };
        let stopped = |s| Campaigner::Stopped { finished: t(s) };
        let finished = |f| PodState {
            finished: Some(f),
            ..pod(RUN)
        };
        let deleting = |c| PodState {
            deleting: true,
            ..pod(c)
        };
        use HolderPod::*;
        // (opted in, acquired, what the index knows) -> death
        let table = [
            (true, acquired, Gone, Some(Death::PodGone)),
            (true, None, Gone, Some(Death::PodGone)),
            (
                true,
                acquired,
                Present(finished(Finished::Failed)),
                Some(Death::PodFinished(Finished::Failed)),
            ),
            (
                true,
                None,
                Present(finished(Finished::Succeeded)),
                Some(Death::PodFinished(Finished::Succeeded)),
            ),
            (
                true,
                acquired,
                Present(pod(stopped(200))),
                Some(Death::ContainerTerminated),
            ),
            (
                true,
                acquired,
                Present(pod(running(200))),
                Some(Death::ContainerRestarted),
            ),
            // The container that acquired is still the one running.
            (true, acquired, Present(pod(running(50))), None),
            // Within the resolution of startedAt: perhaps the same run.
            (true, acquired, Present(pod(running(101))), None),
            (true, acquired, Present(pod(running(100))), None),
            (true, acquired, Present(pod(stopped(101))), None),
            // It stopped before this tenure began: a status that lags behind a new run.
            (true, acquired, Present(pod(stopped(50))), None),
            (true, acquired, Present(pod(Campaigner::Unknown)), None),
            // The tenure's start is unknown: no container-based verdict.
            (true, None, Present(pod(running(200))), None),
            (true, None, Present(pod(stopped(200))), None),
            // Being deleted gracefully: its sidecar releases.
            (true, acquired, Present(deleting(stopped(200))), None),
            (
                true,
                acquired,
                Present(PodState {
                    finished: Some(Finished::Failed),
                    deleting: true,
                    campaigner: RUN,
                }),
                None,
            ),
        ];
        for (opted_in, acquired, known, want) in table {
            assert_eq!(
                death(opted_in, acquired, known),
                want,
                "{opted_in} {acquired:?} {known:?}"
            );
        }
    }

    #[test]
    fn nothing_known_or_opted_out_is_never_death() {
        let acquired = Some(ms(100, 400));
        let finished = PodState {
            finished: Some(Finished::Failed),
            ..pod(RUN)
        };
        let running = pod(Campaigner::Running { since: t(200) });
        use HolderPod::*;
        // Not a pod of the lease, or nothing known yet.
        assert_eq!(death(true, acquired, NotAPod), None);
        assert_eq!(death(true, acquired, Unknown), None);
        // Opted out: the lease is the only clock.
        for known in [Gone, Present(finished), Present(running)] {
            assert_eq!(death(false, acquired, known), None, "{known:?}");
        }
    }

    fn lease(
        holder: Option<&str>,
        status_holder: &str,
        token: i64,
        generation: i64,
    ) -> FencedLease {
        let mut spec = FencedLeaseSpec::free();
        spec.holder_identity = holder.map(str::to_string);
        let mut lease = FencedLease::new("db", spec);
        lease.metadata.generation = Some(generation);
        lease.status = Some(FencedLeaseStatus {
            holder_identity: Some(status_holder.into()),
            token: Some(token),
            acquire_time: Some(MicroTime(t(100))),
            ..FencedLeaseStatus::default()
        });
        lease
    }

    #[test]
    fn the_tenure_start_is_known_only_from_the_current_tenures_status() {
        // (spec holder, status holder, status token, generation) -> acquireTime used
        let table = [
            (Some("a"), "a", 4, 4, Some(t(100))),
            // Acquired, not yet renewed: the status is the previous holder's.
            (Some("b"), "a", 4, 5, None),
            // The same identity acquired again (a restarted container): the status is the old
            // tenure's until the first renewal.
            (Some("a"), "a", 4, 6, None),
            // A spec edit moved the generation on: not known any more.
            (Some("a"), "a", 4, 5, None),
            (None, "a", 4, 5, None),
        ];
        for (holder, status_holder, token, generation, want) in table {
            let l = lease(holder, status_holder, token, generation);
            assert_eq!(
                tenure_start(&l),
                want,
                "{holder:?} {status_holder} {token} {generation}"
            );
        }
    }

    #[test]
    fn a_free_or_opted_out_lease_has_no_dead_holder() {
        let mut l = lease(None, "a", 4, 4);
        assert_eq!(holder_death(&l, HolderPod::Gone), None);
        l.spec.holder_identity = Some("a".into());
        assert_eq!(holder_death(&l, HolderPod::Gone), Some(Death::PodGone));
        l.spec.revoke_on_holder_death = false;
        assert_eq!(holder_death(&l, HolderPod::Gone), None);
    }

    #[test]
    fn reasons_name_their_death() {
        for d in [
            Death::PodGone,
            Death::ContainerTerminated,
            Death::ContainerRestarted,
            Death::PodFinished(Finished::Failed),
        ] {
            assert_eq!(Death::from_reason(d.reason()), Some(d));
            assert!(d.note("pod-a").contains("pod-a"));
        }
        assert_eq!(Death::from_reason("Revoked"), None);
    }

    #[test]
    fn a_dead_identity_is_revoked_early_at_most_once_per_lease_duration() {
        let s = Duration::from_secs;
        let lease = s(15);
        // (last death revocation, holder, now) -> may revoke early
        let table = [
            (None, "a", s(100), true),
            (Some(("a", s(100))), "a", s(101), false),
            (Some(("a", s(100))), "a", s(114), false),
            (Some(("a", s(100))), "a", s(115), true),
            (Some(("a", s(100))), "b", s(101), true),
        ];
        for (last, holder, now, want) in table {
            assert_eq!(
                may_revoke_again(last, holder, now, lease),
                want,
                "{last:?} {holder} {now:?}"
            );
        }
    }

    proptest! {
        /// A container run that began no later than the acquisition (the run that acquired,
        /// or an earlier one) is never taken for a restart, whatever the kubelet did to its
        /// start time within the resolution (truncated or rounded).
        #[test]
        fn the_run_that_acquired_is_never_taken_for_a_restart(
            start_ms in 0i64..100_000, after_ms in 0i64..100_000, shift_ms in -999i64..1000,
        ) {
            let started = Timestamp::from_millisecond(1_800_000_000_000 + start_ms).unwrap();
            let acquired = started + SignedDuration::from_millis(after_ms);
            let reported = started + SignedDuration::from_millis(shift_ms);
            let known = HolderPod::Present(pod(Campaigner::Running { since: reported }));
            prop_assert_eq!(death(true, Some(acquired), known), None);
            // And a run that stopped before the acquisition is no termination of this tenure.
            let stopped = HolderPod::Present(pod(Campaigner::Stopped { finished: reported }));
            prop_assert_eq!(death(true, Some(acquired), stopped), None);
        }
    }
}
