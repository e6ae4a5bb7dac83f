//! The election rules as pure functions over an injected clock: no I/O, no wall time.
//!
//! Two views of one lease:
//! - a **candidate** (anyone not holding it) counts expiry from the moment *it observed* the
//!   last change of the lease (acquisition, renewal or release), on its own monotonic clock.
//!   It never compares timestamps written by other machines.
//! - the **holder** counts its validity from the moment it *sent* its last successful write,
//!   and stops claiming leadership a safety margin before any candidate could see the lease as
//!   expired. Since the send precedes every candidate's observation of that write, the holder's
//!   claim ends at least `safety_margin` before anyone may take over, as long as the clocks'
//!   rates differ by less than `safety_margin / lease_duration`.

use std::time::Duration;

/// A point on a monotonic clock, as an offset from an arbitrary origin. Production code maps
/// `tokio::time::Instant` onto it; tests use any numbers they like.
pub type Mono = Duration;

/// How a participant times the lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timing {
    /// How long a lease stays valid without a renewal (`spec.leaseDurationSeconds`).
    pub lease_duration: Duration,
    /// How often the holder renews.
    pub renew_interval: Duration,
    /// How long before the lease could expire for others the holder stops claiming it.
    pub safety_margin: Duration,
}

impl Timing {
    /// The defaults for a lease duration: renew every third of it; a safety margin of a fifth,
    /// kept between 50 ms and 2 s.
    pub fn for_lease(lease_duration: Duration) -> Timing {
        let margin = (lease_duration / 5).clamp(Duration::from_millis(50), Duration::from_secs(2));
        Timing {
            lease_duration,
            renew_interval: lease_duration / 3,
            safety_margin: margin.min(lease_duration / 2),
        }
    }

    /// Timing from `spec.leaseDurationSeconds` (values below 1 are treated as 1).
    pub fn for_lease_seconds(seconds: i32) -> Timing {
        Timing::for_lease(Duration::from_secs(
            u64::try_from(seconds.max(1)).unwrap_or(1),
        ))
    }

    /// Checks the relations the safety argument needs.
    pub fn validate(&self) -> Result<(), String> {
        if self.lease_duration.is_zero() {
            return Err("the lease duration must be positive".into());
        }
        if self.safety_margin >= self.lease_duration {
            return Err(format!(
                "the safety margin ({:?}) must be shorter than the lease ({:?})",
                self.safety_margin, self.lease_duration
            ));
        }
        if self.renew_interval.is_zero()
            || self.renew_interval + self.safety_margin >= self.lease_duration
        {
            return Err(format!(
                "the renew interval ({:?}) plus the safety margin ({:?}) must be shorter than the lease ({:?})",
                self.renew_interval, self.safety_margin, self.lease_duration
            ));
        }
        Ok(())
    }
}

/// The parts of a lease whose change counts as activity: a new holder, a release, a renewal
/// (the holder's `status.renewTime`, which it keeps strictly increasing) or a new object.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Activity {
    pub uid: String,
    pub generation: i64,
    pub holder: Option<String>,
    pub renew_marker: Option<String>,
}

/// A candidate's (or the controller's) memory of a lease: its last activity and when it saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observation {
    pub activity: Activity,
    pub observed_at: Mono,
}

impl Observation {
    /// Records what was seen at `now`; the clock restarts only when the activity changed.
    pub fn observe(previous: Option<&Observation>, activity: Activity, now: Mono) -> Observation {
        match previous {
            Some(prev) if prev.activity == activity => prev.clone(),
            _ => Observation {
                activity,
                observed_at: now,
            },
        }
    }

    /// When the lease expires for this observer, unless it sees more activity first.
    pub fn expires_at(&self, lease_duration: Duration) -> Mono {
        self.observed_at + lease_duration
    }

    pub fn is_expired(&self, lease_duration: Duration, now: Mono) -> bool {
        now >= self.expires_at(lease_duration)
    }
}

/// What a candidate should do about a lease it does not hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CandidateAction {
    /// Try to acquire it now (with a resourceVersion precondition).
    Acquire,
    /// Nothing until this moment (unless the lease changes first); then decide again.
    WaitUntil(Mono),
}

/// The candidate's decision. `me` is its identity; `preferred` is `spec.preferredHolder`.
///
/// - a free lease is taken at once, except that while another candidate is preferred,
///   everyone else waits one lease duration from the release to give it the first chance;
/// - a held lease is taken when it expired by this candidate's own observation;
/// - a lease held by `me` (say, after a restart that lost the in-memory state) is treated like
///   any other held lease: only the expiry rule may make a holder of it again, with a new token.
pub fn candidate_decision(
    me: &str,
    obs: &Observation,
    preferred: Option<&str>,
    lease_duration: Duration,
    now: Mono,
) -> CandidateAction {
    let preferred = preferred.filter(|p| !p.is_empty());
    match obs.activity.holder.as_deref().filter(|h| !h.is_empty()) {
        None => match preferred {
            Some(p) if p != me && !obs.is_expired(lease_duration, now) => {
                CandidateAction::WaitUntil(obs.expires_at(lease_duration))
            }
            _ => CandidateAction::Acquire,
        },
        Some(_) if obs.is_expired(lease_duration, now) => CandidateAction::Acquire,
        Some(_) => CandidateAction::WaitUntil(obs.expires_at(lease_duration)),
    }
}

/// The holder's view: valid from the moment it sent its last successful write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tenure {
    /// The fencing token: `metadata.generation` of the acquiring write.
    pub token: i64,
    /// When the last successful acquisition or renewal was *sent*.
    pub last_sent: Mono,
}

impl Tenure {
    /// The moment this holder stops claiming leadership unless a renewal succeeds first.
    pub fn valid_until(&self, timing: &Timing) -> Mono {
        self.last_sent + timing.lease_duration.saturating_sub(timing.safety_margin)
    }

    pub fn is_valid(&self, timing: &Timing, now: Mono) -> bool {
        now < self.valid_until(timing)
    }

    /// When the next renewal is due.
    pub fn renew_at(&self, timing: &Timing) -> Mono {
        self.last_sent + timing.renew_interval
    }

    /// How long a renewal sent at `now` may take: never past the end of validity, so that a
    /// hung request cannot keep a stale leader alive. None when validity already ended.
    pub fn request_budget(&self, timing: &Timing, now: Mono) -> Option<Duration> {
        let left = self.valid_until(timing).checked_sub(now)?;
        (!left.is_zero()).then_some(left)
    }

    /// A renewal sent at `sent` succeeded: validity counts from `sent`, never moving backwards.
    pub fn renewed(self, sent: Mono) -> Tenure {
        Tenure {
            token: self.token,
            last_sent: self.last_sent.max(sent),
        }
    }
}

/// What the holder should do next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HolderAction {
    /// Validity ran out: stop claiming leadership now (and campaign again).
    Lost,
    /// Someone else is preferred: release the lease so that they get it.
    StepDown,
    /// Renew now, with a request that may take at most this long.
    Renew { budget: Duration },
    /// Nothing until this moment.
    WaitUntil(Mono),
}

pub fn holder_decision(
    me: &str,
    tenure: &Tenure,
    preferred: Option<&str>,
    timing: &Timing,
    now: Mono,
) -> HolderAction {
    let Some(budget) = tenure.request_budget(timing, now) else {
        return HolderAction::Lost;
    };
    if preferred.is_some_and(|p| !p.is_empty() && p != me) {
        return HolderAction::StepDown;
    }
    if now >= tenure.renew_at(timing) {
        HolderAction::Renew { budget }
    } else {
        HolderAction::WaitUntil(tenure.renew_at(timing).min(tenure.valid_until(timing)))
    }
}

/// What the controller should do about a lease it watches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ControllerAction {
    /// Nobody holds it.
    Free,
    /// Held and not yet expired by the controller's observation; look again at this moment.
    HeldUntil(Mono),
    /// The holder has not renewed for a lease duration: clear it (with a precondition) so the
    /// token moves on and a paused holder is fenced off even if no candidate is waiting.
    Revoke,
}

pub fn controller_decision(
    obs: &Observation,
    lease_duration: Duration,
    now: Mono,
) -> ControllerAction {
    match obs.activity.holder.as_deref().filter(|h| !h.is_empty()) {
        None => ControllerAction::Free,
        Some(_) if obs.is_expired(lease_duration, now) => ControllerAction::Revoke,
        Some(_) => ControllerAction::HeldUntil(obs.expires_at(lease_duration)),
    }
}

/// A fencing token that keeps its meaning across a deleted and re-created lease:
/// `metadata.generation` restarts at 1 on a new object, but the object's UID is new too, so the
/// pair is never handed out twice. Within one UID, generations only increase.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FencingToken {
    pub lease_uid: String,
    pub generation: i64,
}

impl std::fmt::Display for FencingToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (lease uid {})", self.generation, self.lease_uid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const S: Duration = Duration::from_secs(1);
    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }
    fn act(holder: Option<&str>, generation: i64, marker: &str) -> Activity {
        Activity {
            uid: "u1".into(),
            generation,
            holder: holder.map(str::to_string),
            renew_marker: Some(marker.into()),
        }
    }

    #[test]
    fn default_timing_is_valid_for_every_allowed_duration() {
        for secs in 1..=3600 {
            let t = Timing::for_lease_seconds(secs);
            t.validate().unwrap_or_else(|e| panic!("{secs}s: {e}"));
            assert_eq!(t.renew_interval, t.lease_duration / 3);
        }
        assert_eq!(Timing::for_lease_seconds(15).safety_margin, 2 * S);
        assert_eq!(Timing::for_lease_seconds(1).safety_margin, ms(200));
        assert_eq!(
            Timing::for_lease_seconds(0).lease_duration,
            S,
            "clamped to 1 s"
        );
        assert_eq!(
            Timing::for_lease_seconds(-7).lease_duration,
            S,
            "clamped to 1 s"
        );
    }

    #[test]
    fn invalid_timings_are_refused() {
        let mut t = Timing::for_lease(10 * S);
        t.safety_margin = 10 * S;
        assert!(t.validate().is_err());
        let mut t = Timing::for_lease(10 * S);
        t.renew_interval = 9 * S;
        assert!(t.validate().is_err());
        let mut t = Timing::for_lease(10 * S);
        t.renew_interval = Duration::ZERO;
        assert!(t.validate().is_err());
        assert!(Timing::for_lease(Duration::ZERO).validate().is_err());
    }

    #[test]
    fn observation_clock_restarts_only_on_change() {
        let a = Observation::observe(None, act(Some("a"), 2, "r1"), 5 * S);
        assert_eq!(a.observed_at, 5 * S);
        let same = Observation::observe(Some(&a), act(Some("a"), 2, "r1"), 9 * S);
        assert_eq!(
            same.observed_at,
            5 * S,
            "an unchanged lease does not look renewed"
        );
        let renewed = Observation::observe(Some(&a), act(Some("a"), 2, "r2"), 9 * S);
        assert_eq!(renewed.observed_at, 9 * S);
        let new_holder = Observation::observe(Some(&a), act(Some("b"), 3, "r2"), 10 * S);
        assert_eq!(new_holder.observed_at, 10 * S);
        let mut recreated = act(Some("a"), 2, "r1");
        recreated.uid = "u2".into();
        assert_eq!(
            Observation::observe(Some(&a), recreated, 11 * S).observed_at,
            11 * S
        );
    }

    #[test]
    fn candidate_takes_a_free_lease_at_once() {
        let obs = Observation::observe(None, act(None, 3, "r"), Duration::ZERO);
        assert_eq!(
            candidate_decision("b", &obs, None, 10 * S, Duration::ZERO),
            CandidateAction::Acquire
        );
        let empty = Observation::observe(None, act(Some(""), 3, "r"), Duration::ZERO);
        assert_eq!(
            candidate_decision("b", &empty, None, 10 * S, Duration::ZERO),
            CandidateAction::Acquire
        );
        // An empty preferredHolder means none.
        assert_eq!(
            candidate_decision("b", &obs, Some(""), 10 * S, Duration::ZERO),
            CandidateAction::Acquire
        );
    }

    #[test]
    fn candidate_waits_for_expiry_by_its_own_observation() {
        let obs = Observation::observe(None, act(Some("a"), 2, "r"), 100 * S);
        assert_eq!(
            candidate_decision("b", &obs, None, 10 * S, 100 * S),
            CandidateAction::WaitUntil(110 * S)
        );
        assert_eq!(
            candidate_decision("b", &obs, None, 10 * S, 110 * S - ms(1)),
            CandidateAction::WaitUntil(110 * S)
        );
        assert_eq!(
            candidate_decision("b", &obs, None, 10 * S, 110 * S),
            CandidateAction::Acquire
        );
        // A lease naming ourselves (state lost in a restart) still waits for expiry.
        assert_eq!(
            candidate_decision("a", &obs, None, 10 * S, 105 * S),
            CandidateAction::WaitUntil(110 * S)
        );
    }

    #[test]
    fn preferred_candidate_gets_the_first_chance() {
        let released = Observation::observe(None, act(None, 4, "r"), 50 * S);
        assert_eq!(
            candidate_decision("b", &released, Some("c"), 10 * S, 50 * S),
            CandidateAction::WaitUntil(60 * S)
        );
        assert_eq!(
            candidate_decision("c", &released, Some("c"), 10 * S, 50 * S),
            CandidateAction::Acquire
        );
        // If the preferred one never comes, the others take it after a lease duration.
        assert_eq!(
            candidate_decision("b", &released, Some("c"), 10 * S, 60 * S),
            CandidateAction::Acquire
        );
    }

    #[test]
    fn holder_renews_on_schedule_and_loses_when_validity_ends() {
        let t = Timing::for_lease(15 * S); // renew 5 s, margin 2 s
        let tenure = Tenure {
            token: 7,
            last_sent: 100 * S,
        };
        assert_eq!(tenure.valid_until(&t), 113 * S);
        assert_eq!(
            holder_decision("a", &tenure, None, &t, 101 * S),
            HolderAction::WaitUntil(105 * S)
        );
        assert_eq!(
            holder_decision("a", &tenure, None, &t, 105 * S),
            HolderAction::Renew { budget: 8 * S }
        );
        assert_eq!(
            holder_decision("a", &tenure, None, &t, 113 * S - ms(1)),
            HolderAction::Renew { budget: ms(1) }
        );
        assert_eq!(
            holder_decision("a", &tenure, None, &t, 113 * S),
            HolderAction::Lost
        );
        assert_eq!(
            holder_decision("a", &tenure, None, &t, 500 * S),
            HolderAction::Lost
        );
        assert!(tenure.is_valid(&t, 112 * S));
        assert!(!tenure.is_valid(&t, 113 * S));
    }

    #[test]
    fn holder_steps_down_for_a_preferred_candidate_but_not_for_itself() {
        let t = Timing::for_lease(15 * S);
        let tenure = Tenure {
            token: 7,
            last_sent: Duration::ZERO,
        };
        assert_eq!(
            holder_decision("a", &tenure, Some("b"), &t, S),
            HolderAction::StepDown
        );
        assert_eq!(
            holder_decision("a", &tenure, Some("a"), &t, S),
            HolderAction::WaitUntil(5 * S)
        );
        assert_eq!(
            holder_decision("a", &tenure, Some(""), &t, S),
            HolderAction::WaitUntil(5 * S)
        );
        // An expired holder is lost even when asked to step down: it must not write.
        assert_eq!(
            holder_decision("a", &tenure, Some("b"), &t, 13 * S),
            HolderAction::Lost
        );
    }

    #[test]
    fn a_renewal_slower_than_the_time_left_cannot_extend_validity_backwards() {
        let t = Timing::for_lease(15 * S);
        let tenure = Tenure {
            token: 7,
            last_sent: 100 * S,
        };
        // A renewal sent at 105 s that answers at 120 s: validity counts from the send.
        let after = tenure.renewed(105 * S);
        assert_eq!(after.valid_until(&t), 118 * S);
        assert!(
            !after.is_valid(&t, 120 * S),
            "the slow answer arrived after validity ended"
        );
        // An answer to an older request never moves validity backwards.
        assert_eq!(after.renewed(101 * S).last_sent, 105 * S);
        // The request budget is exactly the time left.
        assert_eq!(tenure.request_budget(&t, 110 * S), Some(3 * S));
        assert_eq!(tenure.request_budget(&t, 113 * S), None);
    }

    #[test]
    fn clock_jumps_of_the_wall_clock_do_not_matter() {
        // The rules take only monotonic readings: a wall-clock jump is simply not an input.
        // A candidate that restarts (a new monotonic origin) starts a fresh, full wait.
        let obs = Observation::observe(None, act(Some("a"), 2, "r"), Duration::ZERO);
        assert_eq!(
            candidate_decision("b", &obs, None, 10 * S, Duration::ZERO),
            CandidateAction::WaitUntil(10 * S)
        );
    }

    #[test]
    fn controller_revokes_only_after_a_full_lease_without_activity() {
        let obs = Observation::observe(None, act(Some("a"), 2, "r"), 10 * S);
        assert_eq!(
            controller_decision(&obs, 15 * S, 10 * S),
            ControllerAction::HeldUntil(25 * S)
        );
        assert_eq!(
            controller_decision(&obs, 15 * S, 25 * S),
            ControllerAction::Revoke
        );
        let free = Observation::observe(None, act(None, 3, "r"), 10 * S);
        assert_eq!(
            controller_decision(&free, 15 * S, 99 * S),
            ControllerAction::Free
        );
    }

    proptest! {
        /// The safety argument: for any renewal history, any delays between a write and its
        /// observation, and any observer clock rate within the margin's tolerance, the holder
        /// stops claiming leadership before an observer (candidate or controller) may act.
        #[test]
        fn holder_claim_ends_before_any_observer_may_take_over(
            lease_ms in 1_000u64..60_000,
            gaps in proptest::collection::vec(0u64..30_000, 1..20),
            delays in proptest::collection::vec(0u64..5_000, 20),
            rate_pct in 0u64..100,
        ) {
            let t = Timing::for_lease(ms(lease_ms));
            let d = t.lease_duration.as_secs_f64();
            let m = t.safety_margin.as_secs_f64();
            // Observer clock rate r (observer seconds per real second), 1 <= r < d/(d-m).
            let r_max = d / (d - m);
            let r = 1.0 + (r_max - 1.0) * (rate_pct as f64 / 100.0) * 0.99;
            // Real time = holder's clock. Successful writes sent at cumulative gaps.
            let mut sent = 0.0f64;
            let mut tenure: Option<Tenure> = None;
            let mut obs: Option<Observation> = None;
            for (i, gap) in gaps.iter().enumerate() {
                let next_sent = sent + *gap as f64 / 1000.0;
                // Between the previous write and this one, check the claim ends in time.
                if let (Some(te), Some(o)) = (tenure, obs.as_ref()) {
                    let claim_end_real = te.valid_until(&t).as_secs_f64();
                    let observer_expiry_real = o.expires_at(t.lease_duration).as_secs_f64() / r;
                    // Only meaningful if the observer would expire before the next write.
                    if observer_expiry_real < next_sent {
                        prop_assert!(claim_end_real < observer_expiry_real,
                            "claim ends {claim_end_real}, observer may act at {observer_expiry_real}");
                    }
                }
                sent = next_sent;
                let seen = sent + delays[i] as f64 / 1000.0;
                let sent_d = Duration::from_secs_f64(sent);
                tenure = Some(match tenure {
                    None => Tenure { token: 1, last_sent: sent_d },
                    Some(te) => te.renewed(sent_d),
                });
                obs = Some(Observation::observe(
                    obs.as_ref(),
                    act(Some("a"), 1, &format!("r{i}")),
                    Duration::from_secs_f64(seen * r),
                ));
                // A candidate acting at its own expiry never finds the holder still valid.
                let o = obs.as_ref().expect("just set");
                let acts_at_real = o.expires_at(t.lease_duration).as_secs_f64() / r;
                let te = tenure.expect("just set");
                prop_assert!(!te.is_valid(&t, Duration::from_secs_f64(acts_at_real)));
            }
        }
    }
}
