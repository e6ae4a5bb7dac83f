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
//!
//! The duration itself may change while the lease is held. The holder records in status the
//! duration of each renewal and counts validity with it (a shorter one it sees applies at
//! once, a longer one from the renewal that records it); observers wait for the longer of the
//! spec's and the recorded one ([`observer_lease_duration`]). So a holder that never sees an
//! edit still stops before anyone takes over.

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
        Timing::for_lease(lease_seconds(seconds))
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
    /// `metadata.uid` (a re-created lease is a new object).
    pub uid: String,
    /// `metadata.generation`, the token.
    pub generation: i64,
    /// `spec.holderIdentity`, empty counted as none.
    pub holder: Option<String>,
    /// `status.renewTime`, as written.
    pub renew_marker: Option<String>,
}

/// A candidate's (or the controller's) memory of a lease: its last activity and when it saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observation {
    /// The last activity seen.
    pub activity: Activity,
    /// When this observer first saw it, on its own monotonic clock.
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

    /// Whether the lease expired for this observer at `now`: no new activity for
    /// `lease_duration` since it saw the last one.
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

/// How long an observer (a candidate or the controller) waits without seeing activity before a
/// held lease counts as expired: the longer of the spec's duration and the one the holder
/// recorded with its last renewal (`status.leaseDurationSeconds`, None while the status is not
/// the current holder's). A holder cut off from the API server never learns that the spec was
/// shortened and acts on the duration it renewed under; waiting for the longer of the two
/// covers it, and a longer spec makes observers wait longer at once, which is safe.
pub fn observer_lease_duration(spec: Duration, holder_recorded: Option<Duration>) -> Duration {
    holder_recorded.map_or(spec, |recorded| recorded.max(spec))
}

/// `spec.leaseDurationSeconds` or `status.leaseDurationSeconds` as a duration (values below 1
/// count as 1).
pub fn lease_seconds(seconds: i32) -> Duration {
    Duration::from_secs(u64::try_from(seconds.max(1)).unwrap_or(1))
}

/// The whole seconds a holder records for the duration it acts on: rounded up, so that the
/// record is never shorter than what the holder uses.
pub fn recorded_seconds(d: Duration) -> i32 {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    i32::try_from(secs.max(1)).unwrap_or(i32::MAX)
}

/// The holder's view: valid from the moment it sent its last successful write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tenure {
    /// The fencing token: `metadata.generation` of the acquiring write.
    pub token: i64,
    /// When the last successful acquisition or renewal was *sent*.
    pub last_sent: Mono,
    /// The timing validity counts with: that of the last successful renewal (whose duration it
    /// recorded in status), shortened at once to any shorter one the holder sees. A longer one
    /// applies only from the renewal that records it, because observers may not have seen it
    /// before.
    pub timing: Timing,
    /// A renewal of this tenure recorded `timing`'s duration in status. Until then the holder
    /// claims nothing: the acquiring write cannot record it, and a spec edit could shorten what
    /// observers wait for without the holder learning of it.
    pub recorded: bool,
}

impl Tenure {
    /// A tenure whose acquiring write was sent at `sent`. It claims leadership only once a
    /// renewal has recorded its duration (see [`Tenure::renewed`]).
    pub fn acquired(token: i64, sent: Mono, timing: Timing) -> Tenure {
        Tenure {
            token,
            last_sent: sent,
            timing,
            recorded: false,
        }
    }

    /// The moment this holder's validity ends unless a renewal succeeds first.
    pub fn valid_until(&self) -> Mono {
        self.last_sent
            + self
                .timing
                .lease_duration
                .saturating_sub(self.timing.safety_margin)
    }

    /// Whether requests of this tenure may still be sent.
    pub fn is_valid(&self, now: Mono) -> bool {
        now < self.valid_until()
    }

    /// Whether the holder may act as leader at `now`.
    pub fn claims(&self, now: Mono) -> bool {
        self.recorded && self.is_valid(now)
    }

    /// When the next renewal is due.
    pub fn renew_at(&self) -> Mono {
        self.last_sent + self.timing.renew_interval
    }

    /// How long a renewal sent at `now` may take: never past the end of validity, so that a
    /// hung request cannot keep a stale leader alive. None when validity already ended.
    pub fn request_budget(&self, now: Mono) -> Option<Duration> {
        let left = self.valid_until().checked_sub(now)?;
        (!left.is_zero()).then_some(left)
    }

    /// The holder saw the lease with `current` timing (from the spec). A shorter duration
    /// shortens validity at once: the next renewal records it, and if that renewal reaches the
    /// API server but its answer is lost, observers count the shorter duration from it while
    /// the holder still counts from the renewal before. A longer one waits for a renewal.
    pub fn seeing(self, current: Timing) -> Tenure {
        if current.lease_duration < self.timing.lease_duration {
            Tenure {
                timing: current,
                ..self
            }
        } else {
            self
        }
    }

    /// A renewal sent at `sent`, recording `timing`'s duration, succeeded: validity counts from
    /// `sent` with that timing, never moving backwards.
    pub fn renewed(self, sent: Mono, timing: Timing) -> Tenure {
        if sent < self.last_sent {
            return self;
        }
        Tenure {
            token: self.token,
            last_sent: sent,
            timing,
            recorded: true,
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
    Renew {
        /// How long the renewal request may take: never past the end of validity.
        budget: Duration,
    },
    /// Nothing until this moment.
    WaitUntil(Mono),
}

/// The holder's decision. `current` is the timing of the lease as the holder sees it now;
/// `tenure` should already have seen it ([`Tenure::seeing`]; applied here again, harmlessly).
/// A renewal is due on schedule, and at once while no renewal recorded this tenure's duration
/// or the recorded duration differs from the current one.
pub fn holder_decision(
    me: &str,
    tenure: &Tenure,
    preferred: Option<&str>,
    current: &Timing,
    now: Mono,
) -> HolderAction {
    let tenure = tenure.seeing(*current);
    let Some(budget) = tenure.request_budget(now) else {
        return HolderAction::Lost;
    };
    if preferred.is_some_and(|p| !p.is_empty() && p != me) {
        return HolderAction::StepDown;
    }
    if !tenure.recorded || tenure.timing != *current || now >= tenure.renew_at() {
        HolderAction::Renew { budget }
    } else {
        HolderAction::WaitUntil(tenure.renew_at().min(tenure.valid_until()))
    }
}

/// Who holds a tenure: the identity written to `spec.holderIdentity`, and the process that
/// acquired it. Two processes may share an identity (a StatefulSet pod re-created under its
/// name, `campaign`'s HOSTNAME-PID when the command is PID 1), but never an incarnation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TenureOwner<'a> {
    /// This participant's identity.
    pub identity: &'a str,
    /// This process's incarnation, written with the acquiring write.
    pub incarnation: &'a str,
    /// The `metadata.uid` of the lease the tenure was acquired on.
    pub lease_uid: &'a str,
}

/// The parts of a lease a holder reads to decide whether the tenure is still its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldFacts<'a> {
    /// `metadata.uid`.
    pub uid: Option<&'a str>,
    /// `spec.holderIdentity`, empty counted as none.
    pub holder: Option<&'a str>,
    /// The incarnation written with the holder (the `fencedlease.io/holder-incarnation`
    /// annotation).
    pub incarnation: Option<&'a str>,
    /// `metadata.generation`, the token.
    pub generation: Option<i64>,
}

/// Why a holder saw that its tenure ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TenureEnd {
    /// The lease was deleted and created again: a new object, whose tokens start over.
    Recreated,
    /// The lease names another holder, or none.
    HolderChanged,
    /// The lease names this identity, but another process acquired it (after a revocation or
    /// a release this process did not see): its token is not ours to adopt.
    OtherIncarnation,
}

impl TenureEnd {
    /// For people: why leadership stopped.
    pub fn describe(self) -> &'static str {
        match self {
            TenureEnd::Recreated => "the FencedLease was re-created",
            TenureEnd::HolderChanged => "another writer changed the holder",
            TenureEnd::OtherIncarnation => {
                "another process of this identity acquired the lease (a new incarnation)"
            }
        }
    }
}

/// A holder's reading of the lease: the tenure goes on with this token (a higher generation
/// of the same tenure is a spec edit, say of the duration, and is adopted), or it ended.
///
/// A higher generation is adopted only while the lease names this very process: a revocation
/// followed by a re-acquisition under the same identity also raises the generation and leaves
/// the holder field as it was, and the process that learns of it late (through a conflict's
/// re-read, or a re-list) must stop, not take the newcomer's token.
pub fn holder_view(
    own: &TenureOwner<'_>,
    token: i64,
    lease: &HeldFacts<'_>,
) -> Result<i64, TenureEnd> {
    if lease.uid != Some(own.lease_uid) {
        return Err(TenureEnd::Recreated);
    }
    if lease.holder.filter(|h| !h.is_empty()) != Some(own.identity) {
        return Err(TenureEnd::HolderChanged);
    }
    if lease.incarnation != Some(own.incarnation) {
        return Err(TenureEnd::OtherIncarnation);
    }
    Ok(lease.generation.map_or(token, |g| g.max(token)))
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

/// The controller's decision about a lease it watches, from its own observation of the lease's
/// activity: free, held until a moment, or expired (revoke it).
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
    /// The lease's `metadata.uid`.
    pub lease_uid: String,
    /// The lease's `metadata.generation` the holder's acquisition produced (or a later one, if
    /// the spec was edited while it held the lease).
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
    /// A tenure acquired and renewed (its duration recorded) at `sent`.
    fn held(token: i64, sent: Mono, t: Timing) -> Tenure {
        Tenure::acquired(token, sent, t).renewed(sent, t)
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
        let tenure = held(7, 100 * S, t);
        assert_eq!(tenure.valid_until(), 113 * S);
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
        assert!(tenure.claims(112 * S));
        assert!(!tenure.claims(113 * S));
    }

    #[test]
    fn a_tenure_is_one_process_s_and_only_its_own_spec_edits_are_adopted() {
        let own = TenureOwner {
            identity: "web-0",
            incarnation: "p1",
            lease_uid: "u1",
        };
        let facts = |uid, holder, inc, generation| HeldFacts {
            uid: Some(uid),
            holder,
            incarnation: inc,
            generation: Some(generation),
        };
        let ours = Some("web-0");
        #[rustfmt::skip]
        let table: [(&str, HeldFacts, Result<i64, TenureEnd>); 9] = [
            ("unchanged", facts("u1", ours, Some("p1"), 7), Ok(7)),
            ("a spec edit of our tenure is adopted", facts("u1", ours, Some("p1"), 8), Ok(8)),
            ("an older read never lowers the token", facts("u1", ours, Some("p1"), 6), Ok(7)),
            ("revoked, re-acquired by a new process of this identity",
                facts("u1", ours, Some("p2"), 9), Err(TenureEnd::OtherIncarnation)),
            ("the same, the newcomer's token equal to ours",
                facts("u1", ours, Some("p2"), 7), Err(TenureEnd::OtherIncarnation)),
            ("a lease naming us with no incarnation (written by an older version)",
                facts("u1", ours, None, 9), Err(TenureEnd::OtherIncarnation)),
            ("another holder", facts("u1", Some("web-1"), Some("p1"), 8), Err(TenureEnd::HolderChanged)),
            ("released", facts("u1", Some(""), Some("p1"), 8), Err(TenureEnd::HolderChanged)),
            ("re-created", facts("u2", ours, Some("p1"), 1), Err(TenureEnd::Recreated)),
        ];
        for (what, lease, want) in table {
            assert_eq!(holder_view(&own, 7, &lease), want, "{what}");
        }
    }

    #[test]
    fn holder_steps_down_for_a_preferred_candidate_but_not_for_itself() {
        let t = Timing::for_lease(15 * S);
        let tenure = held(7, Duration::ZERO, t);
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
        let tenure = held(7, 100 * S, t);
        // A renewal sent at 105 s that answers at 120 s: validity counts from the send.
        let after = tenure.renewed(105 * S, t);
        assert_eq!(after.valid_until(), 118 * S);
        assert!(
            !after.claims(120 * S),
            "the slow answer arrived after validity ended"
        );
        // An answer to an older request never moves validity backwards.
        assert_eq!(after.renewed(101 * S, t).last_sent, 105 * S);
        // The request budget is exactly the time left.
        assert_eq!(tenure.request_budget(110 * S), Some(3 * S));
        assert_eq!(tenure.request_budget(113 * S), None);
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

    #[test]
    fn observers_wait_for_the_longer_of_spec_and_recorded_duration() {
        // (spec, recorded by the holder) -> what observers wait for
        let table = [
            (10 * S, None, 10 * S),
            (10 * S, Some(10 * S), 10 * S),
            (2 * S, Some(10 * S), 10 * S), // cut while held: the holder may not know
            (10 * S, Some(2 * S), 10 * S), // raised: waiting longer is safe at once
        ];
        for (spec, recorded, want) in table {
            assert_eq!(
                observer_lease_duration(spec, recorded),
                want,
                "{spec:?} {recorded:?}"
            );
        }
        assert_eq!(recorded_seconds(10 * S), 10);
        assert_eq!(recorded_seconds(ms(1500)), 2, "rounded up, never shorter");
        assert_eq!(recorded_seconds(ms(1)), 1);
        assert_eq!(recorded_seconds(Duration::ZERO), 1);
        assert_eq!(lease_seconds(0), S);
        assert_eq!(lease_seconds(7), 7 * S);
    }

    #[test]
    fn a_new_tenure_claims_nothing_until_a_renewal_records_its_duration() {
        let t = Timing::for_lease(10 * S);
        let acquired = Tenure::acquired(4, 100 * S, t);
        assert!(acquired.is_valid(101 * S), "it may still send requests");
        assert!(!acquired.claims(101 * S), "but does not lead yet");
        // Its first renewal is due at once, bounded by the acquisition's validity.
        assert_eq!(
            holder_decision("a", &acquired, None, &t, 101 * S),
            HolderAction::Renew { budget: 7 * S }
        );
        let recorded = acquired.renewed(101 * S, t);
        assert!(recorded.claims(101 * S));
        assert_eq!(recorded.valid_until(), 109 * S);
    }

    #[test]
    fn the_holder_shortens_at_once_and_lengthens_only_by_a_renewal() {
        let long = Timing::for_lease(10 * S); // margin 2 s, renew every 3.33 s
        let short = Timing::for_lease(2 * S); // margin 400 ms
        let tenure = held(4, 100 * S, long);
        assert_eq!(tenure.valid_until(), 108 * S);
        // Cut to 2 s: validity ends 1.6 s after the last renewal, and a renewal is due now.
        let cut = tenure.seeing(short);
        assert_eq!(cut.valid_until(), 100 * S + ms(1600));
        assert_eq!(
            holder_decision("a", &tenure, None, &short, 101 * S),
            HolderAction::Renew { budget: ms(600) },
            "the decision applies the cut too"
        );
        assert_eq!(
            holder_decision("a", &tenure, None, &short, 102 * S),
            HolderAction::Lost,
            "past the shortened validity"
        );
        // Raised to 10 s: validity stays until a renewal records the longer duration.
        let low = held(4, 100 * S, short);
        assert_eq!(low.seeing(long), low);
        assert_eq!(
            holder_decision("a", &low, None, &long, 100 * S + ms(100)),
            HolderAction::Renew { budget: ms(1500) }
        );
        let raised = low.renewed(100 * S + ms(100), long);
        assert_eq!(raised.valid_until(), 108 * S + ms(100));
        assert_eq!(
            holder_decision("a", &raised, None, &long, 101 * S),
            HolderAction::WaitUntil(raised.renew_at())
        );
    }

    #[derive(Clone, Copy, Debug)]
    enum Outcome {
        /// Applied by the API server, and the holder got the answer.
        Confirmed,
        /// Not applied (a conflict, an error).
        Refused,
        /// Applied, but the answer never reached the holder (a timeout).
        Ambiguous,
    }

    #[derive(Clone, Copy, Debug)]
    enum Op {
        /// Someone sets spec.leaseDurationSeconds to this.
        Edit(u64),
        /// The holder renews (if it still may), recording the duration it sees.
        Renew(Outcome),
        /// The holder stops for good: it sends and sees nothing more.
        Freeze,
    }

    /// One step of a replay: (ms since the previous step, what happens, ms until a candidate
    /// sees the write, ms until the holder sees the edit).
    type Step = (u64, Op, u64, u64);

    /// The lease as the API server stores it, reduced to what the rules read.
    #[derive(Clone, Debug)]
    struct Stored {
        spec_secs: u64,
        recorded_secs: Option<u64>,
        generation: i64,
        renewals: u32,
    }

    /// One holder acquires a lease of `d0` seconds at 0; then `steps` happen.
    /// A candidate sees every write in order and takes over at its own expiry when no later
    /// write came first (else its resourceVersion precondition fails). Returns an error if it
    /// would take over while the holder still claims leadership.
    fn replay(d0: u64, steps: &[Step]) -> Result<(), String> {
        let timing = |secs: u64| Timing::for_lease(Duration::from_secs(secs));
        let mut stored = Stored {
            spec_secs: d0,
            recorded_secs: None,
            generation: 2,
            renewals: 0,
        };
        // (applied at, what was stored, candidate's delay)
        let mut writes = vec![(Duration::ZERO, stored.clone(), 0)];
        let mut tenure = Tenure::acquired(2, Duration::ZERO, timing(d0));
        let mut history = vec![(Duration::ZERO, tenure)];
        let mut unseen: Vec<(Mono, u64)> = Vec::new(); // edits the holder has yet to see
        let mut holder_secs = d0;
        let (mut frozen, mut lost) = (false, false);
        let mut now = Duration::ZERO;
        for &(gap, op, cand_delay, holder_delay) in steps {
            now += ms(gap);
            if !frozen && !lost {
                unseen.retain(|&(at, secs)| {
                    let seen = at <= now;
                    if seen {
                        holder_secs = secs;
                    }
                    !seen
                });
                tenure = tenure.seeing(timing(holder_secs));
                lost = !tenure.is_valid(now);
                history.push((now, tenure));
            }
            match op {
                Op::Edit(secs) => {
                    stored.spec_secs = secs;
                    stored.generation += 1;
                    writes.push((now, stored.clone(), cand_delay));
                    let after = unseen.last().map_or(now, |&(at, _)| at.max(now));
                    unseen.push((after + ms(holder_delay), secs));
                }
                Op::Renew(outcome) if !frozen && !lost => {
                    // A renewal from a stale view fails its resourceVersion precondition.
                    let outcome = if unseen.is_empty() {
                        outcome
                    } else {
                        Outcome::Refused
                    };
                    if !matches!(outcome, Outcome::Refused) {
                        stored.recorded_secs = Some(holder_secs);
                        stored.renewals += 1;
                        writes.push((now, stored.clone(), cand_delay));
                    }
                    if matches!(outcome, Outcome::Confirmed) {
                        tenure = tenure.renewed(now, timing(holder_secs));
                        history.push((now, tenure));
                    }
                }
                Op::Renew(_) => {}
                Op::Freeze => frozen = true,
            }
        }
        check_candidate(&writes, &history)
    }

    /// A candidate that sees `writes` (applied at, what was stored, its delay in seeing it)
    /// in order: an error if it would take over while `history` says the holder claims.
    fn check_candidate(
        writes: &[(Duration, Stored, u64)],
        history: &[(Duration, Tenure)],
    ) -> Result<(), String> {
        let mut obs: Option<Observation> = None;
        let mut seen_at = Duration::ZERO;
        for (k, (applied, w, delay)) in writes.iter().enumerate() {
            seen_at = seen_at.max(*applied + ms(*delay));
            let activity = act(Some("a"), w.generation, &w.renewals.to_string());
            let o = Observation::observe(obs.as_ref(), activity, seen_at);
            let wait = observer_lease_duration(
                Duration::from_secs(w.spec_secs),
                w.recorded_secs.map(Duration::from_secs),
            );
            let acts_at = o.expires_at(wait);
            let current = writes.get(k + 1).is_none_or(|(next, _, _)| *next > acts_at);
            let holder = history.iter().rev().find(|(at, _)| *at <= acts_at);
            if let Some((_, t)) = holder.filter(|(_, t)| current && t.claims(acts_at)) {
                return Err(format!(
                    "a candidate takes over at {acts_at:?} (write {k}: {w:?}, waited {wait:?}) \
                     while the holder claims until {:?}: {t:?}",
                    t.valid_until()
                ));
            }
            obs = Some(o);
        }
        Ok(())
    }

    #[test]
    fn changing_the_duration_while_held_never_lets_a_candidate_in_early() {
        use Op::*;
        use Outcome::*;
        let cases: &[(&str, u64, Vec<Step>)] = &[
            (
                "cut to 2 s while the holder is frozen",
                10,
                vec![
                    (0, Renew(Confirmed), 0, 0),
                    (500, Freeze, 0, 0),
                    (500, Edit(2), 0, 0),
                ],
            ),
            (
                "cut right after the acquisition, before the first renewal",
                10,
                vec![(0, Freeze, 0, 0), (100, Edit(2), 0, 0)],
            ),
            (
                "cut seen, its renewal applied but unanswered",
                10,
                vec![
                    (0, Renew(Confirmed), 0, 0),
                    (1000, Edit(2), 0, 0),
                    (100, Renew(Ambiguous), 0, 0),
                    (0, Freeze, 0, 0),
                ],
            ),
            (
                "raised to 10 s, seen late by a candidate",
                2,
                vec![
                    (0, Renew(Confirmed), 0, 0),
                    (100, Edit(10), 3000, 0),
                    (100, Renew(Confirmed), 0, 0),
                    (0, Freeze, 0, 0),
                ],
            ),
        ];
        for (what, d0, steps) in cases {
            replay(*d0, steps).unwrap_or_else(|e| panic!("{what}: {e}"));
        }
    }

    fn op_strategy() -> impl Strategy<Value = Op> {
        let outcome = prop_oneof![
            Just(Outcome::Confirmed),
            Just(Outcome::Refused),
            Just(Outcome::Ambiguous)
        ];
        prop_oneof![
            2 => (1u64..=20).prop_map(Op::Edit),
            6 => outcome.prop_map(Op::Renew),
            1 => Just(Op::Freeze),
        ]
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
                    let claim_end_real = te.valid_until().as_secs_f64();
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
                    None => held(1, sent_d, t),
                    Some(te) => te.renewed(sent_d, t),
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
                prop_assert!(!te.claims(Duration::from_secs_f64(acts_at_real)));
            }
        }

        /// For any sequence of duration edits, renewals (answered, refused, or applied with
        /// the answer lost), delays in seeing them, and a holder that may freeze at any point,
        /// a candidate never deems the lease expired before the holder stops acting.
        #[test]
        fn duration_edits_never_let_a_candidate_in_before_the_holder_stops(
            d0 in 1u64..=20,
            steps in proptest::collection::vec(
                (0u64..6_000, op_strategy(), 0u64..3_000, 0u64..3_000), 1..30),
        ) {
            if let Err(e) = replay(d0, &steps) {
                prop_assert!(false, "{}", e);
            }
        }
    }
}
