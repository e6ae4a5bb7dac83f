//! The election protocol's Kubernetes I/O: watches one FencedLease, acquires, renews and
//! releases it with resourceVersion preconditions, and publishes the outcome on a
//! `tokio::sync::watch` channel. All decisions come from [`super::rules`].

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::PostParams;
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client};
use tokio::sync::{watch, Notify};
use tokio::time::{sleep_until, timeout, Instant};
use tracing::{debug, info, instrument, warn};

use super::clock;
use super::rules::{
    candidate_decision, holder_decision, holder_view, lease_seconds, observer_lease_duration,
    recorded_seconds, Activity, CandidateAction, FencingToken, HeldFacts, HolderAction, Mono,
    Observation, Tenure, TenureEnd, TenureOwner, Timing,
};
use crate::api::{
    FencedLease, FencedLeaseSpec, INCARNATION_ANNOTATION, MAX_LEASE_DURATION_SECONDS,
};

/// How long to wait before retrying after a write failed for a reason other than a conflict.
const RETRY_BACKOFF: Duration = Duration::from_millis(250);
/// How long a release may take on shutdown.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(2);
/// The tracing target of the elector's timeline, for telling where a takeover's time went: a
/// DEBUG event when this participant's observation of the lease restarts (`observed`: a change
/// of holder, token or renewal reached it, the moment its expiry countdown starts from), and
/// one per answer to an acquiring write and to a renewal, with wall-clock times in
/// microseconds since the Unix epoch (the holder's `status.renewTime` is on the same clock
/// when both run on one machine). A few events per renewal interval; off unless a filter
/// enables it, e.g. `RUST_LOG=warn,fencedlease_elector::timeline=debug`.
const TIMELINE: &str = "fencedlease_elector::timeline";

/// Why an elector could not be made, or stopped campaigning.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// [`ElectorConfig::timing_override`] breaks a relation the safety argument needs (see
    /// [`Timing::validate`]), or its lease duration is longer than the CRD allows.
    #[error("invalid timing: {0}")]
    Timing(String),
    /// The watch stream on the FencedLease ended (kube's watcher retries errors by itself, so
    /// this is not expected).
    #[error("the watch on the FencedLease ended unexpectedly")]
    WatchEnded,
    /// The elector's task panicked (a bug: please report it).
    #[error("the elector's task panicked")]
    Panicked,
}

impl Error {
    /// A bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Timing(_) => "timing",
            Error::WatchEnded => "watch_ended",
            Error::Panicked => "panicked",
        }
    }
}

/// What this participant knows about its own leadership.
#[derive(Clone, Debug, PartialEq)]
pub enum LeaderState {
    /// Not known yet (starting, or the lease does not exist).
    Unknown,
    /// Someone else holds the lease, or nobody does.
    Following {
        /// The current holder, if any (as last seen).
        holder: Option<String>,
        /// The lease's current token (`metadata.generation`), as last seen.
        token: Option<i64>,
    },
    /// This participant holds the lease with this token, until `valid_until` at the latest
    /// unless a renewal succeeds first.
    Leading {
        /// The token to present with every protected write.
        token: FencingToken,
        /// When leadership ends unless a renewal succeeds first: a safety margin before any
        /// other participant could take over. On the clock of [`clock::now`] (CLOCK_BOOTTIME:
        /// time in suspend counts); check it before acting (see [`LeaderState::leading_token`]).
        valid_until: Instant,
        /// Which of this participant's tenures: 1 for its first acquisition, one more for each
        /// later one. It stays the same while a tenure lasts, through spec edits that move the
        /// token on, so a change of it means the lease was lost and acquired again.
        tenure: u64,
    },
}

impl LeaderState {
    /// The token if this participant leads *at `now`*, which comes from [`clock::now`] (not
    /// `Instant::now()`: a suspend must count). Checking the deadline here means that a reader
    /// who was paused, or whose machine slept, never acts on a claim that ran out meanwhile.
    pub fn leading_token(&self, now: Instant) -> Option<&FencingToken> {
        match self {
            LeaderState::Leading {
                token, valid_until, ..
            } if now < *valid_until => Some(token),
            _ => None,
        }
    }
}

/// Which lease to campaign for, and as whom.
#[derive(Clone, Debug)]
pub struct ElectorConfig {
    /// The namespace of the FencedLease.
    pub namespace: String,
    /// The name of the FencedLease.
    pub lease: String,
    /// This participant's identity, unique among the candidates (a pod name, say): it is
    /// written to `spec.holderIdentity` while this participant holds the lease.
    pub identity: String,
    /// Create the FencedLease with this `leaseDurationSeconds` when it does not exist.
    pub create_with_duration: Option<i32>,
    /// The owner a created FencedLease gets (so that it is garbage-collected with it).
    pub create_owner: Option<OwnerReference>,
    /// Use this timing instead of the one derived from `spec.leaseDurationSeconds`.
    pub timing_override: Option<Timing>,
}

impl ElectorConfig {
    /// Campaign for the FencedLease `lease` in `namespace` as `identity`. The lease is not
    /// created (set [`ElectorConfig::create_with_duration`] for that) and the timing follows
    /// its `spec.leaseDurationSeconds`.
    pub fn new(
        namespace: impl Into<String>,
        lease: impl Into<String>,
        identity: impl Into<String>,
    ) -> ElectorConfig {
        ElectorConfig {
            namespace: namespace.into(),
            lease: lease.into(),
            identity: identity.into(),
            create_with_duration: None,
            create_owner: None,
            timing_override: None,
        }
    }
}

/// The handle a user of the elector keeps: the state channel and a way to step down.
#[derive(Clone, Debug)]
pub struct ElectorHandle {
    /// This participant's leadership, updated on every change (and set to
    /// [`LeaderState::Unknown`] when [`Elector::run`] returns). Clone it to watch it from
    /// several tasks.
    pub state: watch::Receiver<LeaderState>,
    release: Arc<Notify>,
    eligible: Arc<watch::Sender<bool>>,
}

impl ElectorHandle {
    /// Asks the elector to release the lease if it holds it; it then stays out of the running
    /// for one lease duration so that another candidate takes over.
    pub fn request_release(&self) {
        self.release.notify_one();
    }

    /// Marks this participant (in)eligible to lead, say while the app it fronts is unhealthy.
    /// An ineligible holder releases the lease at once; an ineligible candidate does not
    /// acquire. Participants start eligible.
    pub fn set_eligible(&self, eligible: bool) {
        self.eligible.send_if_modified(|cur| {
            let changed = *cur != eligible;
            *cur = eligible;
            changed
        });
    }
}

/// One participant in the election for one FencedLease.
pub struct Elector {
    api: Api<FencedLease>,
    cfg: ElectorConfig,
    /// This process's incarnation: new for every elector, written with each acquisition.
    incarnation: String,
    origin: Instant,
    state: watch::Sender<LeaderState>,
    release: Arc<Notify>,
    eligible: watch::Receiver<bool>,
    latest: Option<FencedLease>,
    /// The lease exists but is being deleted (it waits for a finalizer): nobody may create it
    /// again until it is gone, so no create is tried until the watch says it is.
    terminating: bool,
    obs: Option<Observation>,
    tenure: Option<(Tenure, String)>,
    /// How many tenures this participant has had (see [`LeaderState::Leading`]).
    tenures: u64,
    retry_at: Option<Instant>,
    hold_off_until: Option<Instant>,
    last_renew_wall: Option<jiff::Timestamp>,
    last_create_attempt: Option<Instant>,
    /// The watch has listed at least once (so "no object" means the lease does not exist).
    listed: bool,
    /// Creating was refused by RBAC once already (said once, then quietly retried).
    create_forbidden: bool,
}

impl Elector {
    /// An elector for `cfg`, and the handle to follow and steer it. Nothing happens until
    /// [`Elector::run`] is awaited (or spawned). Fails only on an invalid
    /// [`ElectorConfig::timing_override`].
    pub fn new(client: Client, cfg: ElectorConfig) -> Result<(Elector, ElectorHandle), Error> {
        if let Some(t) = &cfg.timing_override {
            t.validate().map_err(Error::Timing)?;
            if recorded_seconds(t.lease_duration) > MAX_LEASE_DURATION_SECONDS {
                return Err(Error::Timing(format!(
                    "the lease duration ({:?}) must be at most {MAX_LEASE_DURATION_SECONDS} s",
                    t.lease_duration
                )));
            }
        }
        let (tx, rx) = watch::channel(LeaderState::Unknown);
        let release = Arc::new(Notify::new());
        let (eligible_tx, eligible_rx) = watch::channel(true);
        let elector = Elector {
            api: Api::namespaced(client, &cfg.namespace),
            cfg,
            incarnation: new_incarnation(),
            origin: clock::now(),
            state: tx,
            release: release.clone(),
            eligible: eligible_rx,
            latest: None,
            terminating: false,
            obs: None,
            tenure: None,
            tenures: 0,
            retry_at: None,
            hold_off_until: None,
            last_renew_wall: None,
            last_create_attempt: None,
            listed: false,
            create_forbidden: false,
        };
        Ok((
            elector,
            ElectorHandle {
                state: rx,
                release,
                eligible: Arc::new(eligible_tx),
            },
        ))
    }

    fn mono(&self, at: Instant) -> Mono {
        at.saturating_duration_since(self.origin)
    }

    fn instant(&self, m: Mono) -> Instant {
        self.origin + m
    }

    fn timing(&self, lease: &FencedLease) -> Timing {
        self.cfg
            .timing_override
            .unwrap_or_else(|| Timing::for_lease_seconds(lease.spec.lease_duration_seconds))
    }

    fn me(&self) -> &str {
        &self.cfg.identity
    }

    /// Whether `lease` is still the tenure acquired on `uid`, and with which token.
    fn still_ours(&self, lease: &FencedLease, uid: &str, token: i64) -> Result<i64, TenureEnd> {
        let own = TenureOwner {
            identity: self.me(),
            incarnation: &self.incarnation,
            lease_uid: uid,
        };
        let facts = HeldFacts {
            uid: lease.metadata.uid.as_deref(),
            holder: lease.holder(),
            incarnation: lease.holder_incarnation(),
            generation: lease.token(),
        };
        holder_view(&own, token, &facts)
    }

    /// Campaigns until `shutdown` completes, then releases the lease if it holds it.
    #[instrument(skip_all, fields(lease = %self.cfg.lease, ns = %self.cfg.namespace, identity = %self.cfg.identity))]
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
        let config =
            watcher::Config::default().fields(&format!("metadata.name={}", self.cfg.lease));
        let mut stream = watcher(self.api.clone(), config).default_backoff().boxed();
        let release = self.release.clone();
        let mut eligible = self.eligible.clone();
        let mut eligible_open = true;
        tokio::pin!(shutdown);
        let mut listed_any = false;
        let mut resumes = clock::Resumes::new();
        loop {
            let deadline = self.step().await;
            tokio::select! {
                biased;
                () = &mut shutdown => {
                    self.release("shutdown").await;
                    self.publish(LeaderState::Unknown);
                    return Ok(());
                }
                r = eligible.changed(), if eligible_open => {
                    // Err: every handle is gone, so nobody can change eligibility any more.
                    eligible_open = r.is_ok();
                }
                () = release.notified() => {
                    if self.tenure.is_some() {
                        let hold = self.latest.as_ref().map(|l| self.timing(l).lease_duration)
                            .unwrap_or(Duration::from_secs(15));
                        self.release("requested").await;
                        self.hold_off_until = Some(clock::now() + hold);
                    }
                }
                ev = stream.next() => match ev {
                    Some(Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o))) => {
                        listed_any = true;
                        self.saw(Some(o));
                    }
                    Some(Ok(watcher::Event::Delete(_))) => self.saw(None),
                    Some(Ok(watcher::Event::Init)) => listed_any = false,
                    Some(Ok(watcher::Event::InitDone)) => {
                        self.listed = true;
                        if !listed_any {
                            self.saw(None);
                        }
                    }
                    Some(Err(e)) => warn!(error = %e, "watching the FencedLease failed; retrying"),
                    None => return Err(Error::WatchEnded),
                },
                () = sleep_until(clock::timer_for(deadline)) => {}
                // A timer armed before a suspend fires late: look again on resuming.
                () = resumes.next() => {}
            }
        }
    }

    /// Takes in a newer view of the lease (from the watch or from a write's answer).
    fn saw(&mut self, obj: Option<FencedLease>) {
        let now = self.mono(clock::now());
        // A lease being deleted (it waits for a finalizer: in policy mode, until the controller
        // has dropped it from the lease index) is gone for the election: its holder stops, and
        // nobody acquires it. Its deletion raised its generation, so no token it handed out
        // still passes the fence, and the fence refuses every write it would judge.
        self.terminating = obj
            .as_ref()
            .is_some_and(|o| o.metadata.deletion_timestamp.is_some());
        let Some(obj) = obj.filter(|o| o.metadata.deletion_timestamp.is_none()) else {
            self.latest = None;
            self.obs = None;
            return;
        };
        if let Some(cur) = &self.latest {
            if cur.metadata.uid == obj.metadata.uid && rv_num(&obj) < rv_num(cur) {
                return; // an older event than what a write already told us
            }
        }
        let obs = Observation::observe(self.obs.as_ref(), activity_of(&obj), now);
        if self.obs.as_ref() != Some(&obs) {
            debug!(
                target: TIMELINE,
                at_us = wall_us(),
                holder = obs.activity.holder.as_deref().unwrap_or(""),
                token = obs.activity.generation,
                renew_us = renew_us(&obj),
                "observed"
            );
        }
        self.obs = Some(obs);
        self.latest = Some(obj);
    }

    fn publish(&self, state: LeaderState) {
        self.state.send_if_modified(|cur| {
            if *cur == state {
                false
            } else {
                *cur = state;
                true
            }
        });
    }

    /// Announces leadership, once a renewal has recorded the tenure's duration (before that
    /// the holder claims nothing: see [`Tenure::recorded`]).
    fn publish_leading(&self) {
        if let Some((tenure, uid)) = self.tenure.as_ref().filter(|(t, _)| t.recorded) {
            self.publish(LeaderState::Leading {
                token: FencingToken {
                    lease_uid: uid.clone(),
                    generation: tenure.token,
                },
                valid_until: self.instant(tenure.valid_until()),
                tenure: self.tenures,
            });
        }
    }

    fn lose(&mut self, why: &str) {
        if let Some((tenure, _)) = self.tenure.take() {
            warn!(token = tenure.token, why, "stopped leading");
        }
        let (holder, token) = match &self.latest {
            Some(l) => (l.holder().map(str::to_string), l.token()),
            None => (None, None),
        };
        self.publish(LeaderState::Following { holder, token });
    }

    /// Decides and acts once; returns when to look again (absent new events).
    async fn step(&mut self) -> Instant {
        let now = clock::now();
        let idle = now + Duration::from_secs(3600);
        let Some(lease) = self.latest.clone() else {
            if self.tenure.is_some() {
                self.lose("the FencedLease was deleted (or is being deleted)");
            } else if !matches!(*self.state.borrow(), LeaderState::Unknown) {
                self.publish(LeaderState::Unknown);
            }
            if self.terminating {
                return idle; // the watch's Delete brings the next step
            }
            return self.maybe_create(now).await.unwrap_or(idle);
        };
        let retry_at = self.retry_at.filter(|r| *r > now);
        let eligible = *self.eligible.borrow();
        if !eligible && self.tenure.is_some() {
            self.release("no longer eligible (the app is unhealthy)")
                .await;
            return now;
        }

        match self.tenure.clone() {
            Some((tenure, uid)) => self.holder_step(lease, tenure, uid, retry_at, now).await,
            None => self
                .candidate_step(lease, retry_at, eligible, now)
                .await
                .unwrap_or(idle),
        }
    }

    /// The holder's step: renews, hands over, or stops leading.
    async fn holder_step(
        &mut self,
        lease: FencedLease,
        tenure: Tenure,
        uid: String,
        retry_at: Option<Instant>,
        now: Instant,
    ) -> Instant {
        // A spec edit (say, of the duration) of our own tenure moves the token on and our old
        // one will be refused, so the new one is adopted; anything else ends the tenure.
        let token = match self.still_ours(&lease, &uid, tenure.token) {
            Ok(token) => token,
            Err(end) => {
                self.lose(end.describe());
                return now;
            }
        };
        let timing = self.timing(&lease);
        // A shorter duration in the spec shortens our validity at once; a longer one applies
        // from the renewal that records it in status.
        let tenure = Tenure {
            token,
            ..tenure.seeing(timing)
        };
        if self.tenure.as_ref().map(|(t, _)| t) != Some(&tenure) {
            self.tenure = Some((tenure, uid));
            self.publish_leading();
        }
        let preferred = lease.spec.preferred_holder.clone();
        if preferred
            .as_deref()
            .is_some_and(|p| !p.is_empty() && p != self.me())
            && tenure.is_valid(self.mono(now))
        {
            info!(preferred = ?preferred, "handing over to the preferred holder");
            self.release("handover").await;
            return now;
        }
        if let Some(r) = retry_at {
            return r.min(self.instant(tenure.valid_until()));
        }
        let decision = holder_decision(
            self.me(),
            &tenure,
            preferred.as_deref(),
            &timing,
            self.mono(now),
        );
        match decision {
            HolderAction::Lost => {
                self.lose("validity ended without a successful renewal");
                now
            }
            HolderAction::StepDown => {
                info!(preferred = ?preferred, "handing over to the preferred holder");
                self.release("handover").await;
                now
            }
            HolderAction::Renew { budget } => {
                self.renew(lease, tenure, budget, timing).await;
                now
            }
            HolderAction::WaitUntil(m) => self.instant(m),
        }
    }

    /// A candidate's step: acquires the lease when the rules say so. None: nothing to wait for.
    async fn candidate_step(
        &mut self,
        lease: FencedLease,
        retry_at: Option<Instant>,
        eligible: bool,
        now: Instant,
    ) -> Option<Instant> {
        let obs = self.obs.clone()?;
        self.publish(LeaderState::Following {
            holder: lease.holder().map(str::to_string),
            token: lease.token(),
        });
        if let Some(h) = self.hold_off_until.filter(|h| *h > now) {
            return Some(h);
        }
        if let Some(r) = retry_at {
            return Some(r);
        }
        if !eligible {
            if lease.holder().is_none() {
                info!(
                    lease = %self.cfg.lease,
                    "the lease is free, and this participant is not eligible (say, its app is unhealthy): not acquiring it"
                );
            }
            return None;
        }
        let timing = self.timing(&lease);
        let wait = observer_duration(&lease, timing.lease_duration);
        let preferred = lease.spec.preferred_holder.as_deref();
        match candidate_decision(self.me(), &obs, preferred, wait, self.mono(now)) {
            CandidateAction::Acquire => {
                self.acquire(lease, timing).await;
                Some(now)
            }
            CandidateAction::WaitUntil(m) => Some(self.instant(m)),
        }
    }

    async fn maybe_create(&mut self, now: Instant) -> Option<Instant> {
        let duration = self.cfg.create_with_duration?;
        if !self.listed {
            return None; // the first list may still bring the lease
        }
        if self
            .last_create_attempt
            .is_some_and(|t| now < t + Duration::from_secs(1))
        {
            return self.last_create_attempt.map(|t| t + Duration::from_secs(1));
        }
        self.last_create_attempt = Some(now);
        let mut spec = FencedLeaseSpec::free();
        spec.lease_duration_seconds = duration;
        let mut lease = FencedLease::new(&self.cfg.lease, spec);
        lease.metadata.owner_references = self.cfg.create_owner.clone().map(|o| vec![o]);
        match self.api.create(&PostParams::default(), &lease).await {
            Ok(created) => {
                info!("created the FencedLease");
                self.saw(Some(created));
            }
            Err(kube::Error::Api(s)) if s.code == 409 => debug!("the FencedLease exists already"),
            Err(kube::Error::Api(s)) if s.code == 403 => {
                if !self.create_forbidden {
                    warn!("the FencedLease does not exist and this identity may not create it: waiting for it to be created");
                    self.create_forbidden = true;
                }
            }
            Err(e) => warn!(error = %e, "creating the FencedLease failed; retrying"),
        }
        Some(now + Duration::from_secs(1))
    }

    /// Re-reads the lease after a conflict.
    async fn refresh(&mut self, budget: Duration) {
        match timeout(budget, self.api.get_opt(&self.cfg.lease)).await {
            Ok(Ok(obj)) => self.saw(obj),
            Ok(Err(e)) => {
                warn!(error = %e, "re-reading the FencedLease failed");
                self.retry_at = Some(clock::now() + RETRY_BACKOFF);
            }
            Err(_) => self.retry_at = Some(clock::now() + RETRY_BACKOFF),
        }
    }

    async fn acquire(&mut self, lease: FencedLease, timing: Timing) {
        if lease.holder() == Some(self.me()) {
            // The lease still names us from an earlier tenure (lost state, or validity that ran
            // out while the API server was away). Writing our name again would change nothing:
            // no new generation, no event for the others. Clear it first (a new token, seen by
            // everyone); the next step acquires the free lease like any candidate.
            self.clear_stale_self(lease, timing).await;
            return;
        }
        let before = lease.token().unwrap_or_default();
        let mut desired = lease.clone();
        desired.spec.holder_identity = Some(self.cfg.identity.clone());
        desired
            .metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(INCARNATION_ANNOTATION.into(), self.incarnation.clone());
        // The preferred holder had its chance (or is us): clear it so nobody steps down again.
        desired.spec.preferred_holder = None;
        let sent = clock::now();
        let sent_us = wall_us();
        let res = timeout(
            timing.lease_duration,
            self.api
                .replace(&self.cfg.lease, &PostParams::default(), &desired),
        )
        .await;
        debug!(
            target: TIMELINE,
            sent_us,
            answered_us = wall_us(),
            outcome = answer_label(&res),
            "acquire answered"
        );
        match res {
            Ok(Ok(acquired)) => {
                let (Some(token), Some(uid)) = (acquired.token(), acquired.metadata.uid.clone())
                else {
                    warn!("the API server answered without generation or uid");
                    self.retry_at = Some(clock::now() + RETRY_BACKOFF);
                    return;
                };
                if token <= before {
                    // Not an acquisition: the token must move on every change of holder.
                    warn!(
                        token,
                        before, "the acquiring write did not raise the generation; not leading"
                    );
                    self.saw(Some(acquired));
                    self.retry_at = Some(clock::now() + RETRY_BACKOFF);
                    return;
                }
                let tenure = Tenure::acquired(token, self.mono(sent), timing);
                self.tenure = Some((tenure, uid));
                self.tenures += 1;
                self.saw(Some(acquired.clone()));
                info!(
                    token,
                    "acquired the lease; leading once a renewal records its duration"
                );
                if let Some(budget) = tenure.request_budget(self.mono(clock::now())) {
                    self.renew(acquired, tenure, budget, timing).await;
                }
            }
            Ok(Err(kube::Error::Api(s))) if s.code == 409 => {
                debug!("acquire lost a race; re-reading");
                self.refresh(timing.lease_duration).await;
            }
            Ok(Err(kube::Error::Api(s))) if s.code == 404 => self.saw(None),
            Ok(Err(e)) => {
                warn!(error = %e, "acquiring failed; retrying");
                self.retry_at = Some(clock::now() + RETRY_BACKOFF);
            }
            Err(_) => {
                warn!("acquiring timed out; retrying");
                self.retry_at = Some(clock::now() + RETRY_BACKOFF);
            }
        }
    }

    /// Clears a holder field that names us although we hold no tenure.
    async fn clear_stale_self(&mut self, lease: FencedLease, timing: Timing) {
        let mut desired = lease;
        desired.clear_holder();
        match timeout(
            timing.lease_duration,
            self.api
                .replace(&self.cfg.lease, &PostParams::default(), &desired),
        )
        .await
        {
            Ok(Ok(cleared)) => {
                info!(
                    token = cleared.token(),
                    "cleared a stale claim of ours before acquiring"
                );
                self.saw(Some(cleared));
            }
            Ok(Err(kube::Error::Api(s))) if s.code == 409 => {
                self.refresh(timing.lease_duration).await
            }
            Ok(Err(kube::Error::Api(s))) if s.code == 404 => self.saw(None),
            Ok(Err(e)) => {
                warn!(error = %e, "clearing a stale claim failed; retrying");
                self.retry_at = Some(clock::now() + RETRY_BACKOFF);
            }
            Err(_) => self.retry_at = Some(clock::now() + RETRY_BACKOFF),
        }
    }

    /// A renewal: a status write with the lease's resourceVersion as precondition, bounded by
    /// the time left, counted from when it was sent. It records `timing`'s duration in status,
    /// and validity counts with that timing from the send once it succeeds.
    async fn renew(
        &mut self,
        lease: FencedLease,
        tenure: Tenure,
        budget: Duration,
        timing: Timing,
    ) {
        let first = !tenure.recorded;
        let now_wall = jiff::Timestamp::now();
        let wall = match self.last_renew_wall {
            Some(prev) if now_wall <= prev => prev + jiff::SignedDuration::from_micros(1),
            _ => now_wall,
        };
        let mut desired = lease;
        let status = desired.status.get_or_insert_with(Default::default);
        if first || status.holder_identity.as_deref() != Some(self.cfg.identity.as_str()) {
            status.acquire_time = Some(MicroTime(wall));
            // Counted by the new holder under the same precondition, so never twice.
            if status
                .holder_identity
                .as_deref()
                .is_some_and(|h| !h.is_empty() && h != self.cfg.identity)
            {
                status.lease_transitions += 1;
            }
        }
        status.holder_identity = Some(self.cfg.identity.clone());
        status.token = Some(tenure.token);
        status.renew_time = Some(MicroTime(wall));
        status.lease_duration_seconds = Some(recorded_seconds(timing.lease_duration));
        let sent = clock::now();
        let sent_us = wall_us();
        let res = timeout(
            budget,
            self.api
                .replace_status(&self.cfg.lease, &PostParams::default(), &desired),
        )
        .await;
        debug!(
            target: TIMELINE,
            renew_us = wall.as_microsecond(),
            first,
            sent_us,
            answered_us = wall_us(),
            outcome = answer_label(&res),
            "renewal answered"
        );
        match res {
            Ok(Ok(renewed)) => {
                self.last_renew_wall = Some(wall);
                if let Some((t, uid)) = self.tenure.take() {
                    self.tenure = Some((t.renewed(self.mono(sent), timing), uid));
                }
                self.saw(Some(renewed));
                self.publish_leading();
            }
            Ok(Err(kube::Error::Api(s))) if s.code == 409 => {
                // Someone else wrote (the controller's status, a new holder, a spec edit):
                // re-read; the next step sees whether the lease is still ours.
                self.refresh(budget).await;
            }
            Ok(Err(kube::Error::Api(s))) if s.code == 404 => {
                self.saw(None);
            }
            Ok(Err(e)) => {
                warn!(error = %e, "renewal failed; retrying");
                self.retry_at = Some(clock::now() + RETRY_BACKOFF);
            }
            Err(_) => warn!(?budget, "renewal took longer than the time left"),
        }
    }

    /// Clears the holder (a new token) if we hold the lease. Leadership ends before the write.
    async fn release(&mut self, why: &str) {
        let Some((tenure, uid)) = self.tenure.take() else {
            return;
        };
        self.publish(LeaderState::Following {
            holder: None,
            token: None,
        });
        let deadline = clock::now() + RELEASE_TIMEOUT;
        for _ in 0..5 {
            let Some(lease) = self.latest.clone() else {
                return;
            };
            if self.still_ours(&lease, &uid, tenure.token).is_err() {
                return; // not ours any more (another process's, perhaps): nothing to release
            }
            let mut desired = lease;
            desired.clear_holder();
            let left = deadline.saturating_duration_since(clock::now());
            match timeout(
                left,
                self.api
                    .replace(&self.cfg.lease, &PostParams::default(), &desired),
            )
            .await
            {
                Ok(Ok(released)) => {
                    info!(token = tenure.token, why, "released the lease");
                    self.saw(Some(released));
                    return;
                }
                Ok(Err(kube::Error::Api(s))) if s.code == 409 => self.refresh(left).await,
                Ok(Err(e)) => {
                    warn!(error = %e, "releasing failed; the lease will expire instead");
                    return;
                }
                Err(_) => {
                    warn!("releasing timed out; the lease will expire instead");
                    return;
                }
            }
        }
    }
}

/// A new process incarnation: the process id, the start time and 64 bits from the standard
/// library's randomly keyed hasher, so that two electors never share one (even a pod's PID 1
/// restarted in the same second).
fn new_incarnation() -> String {
    use std::hash::BuildHasher;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let pid = std::process::id();
    let salt = std::collections::hash_map::RandomState::new().hash_one((pid, nanos));
    format!("{pid}-{:x}-{salt:016x}", nanos % (1 << 48))
}

/// The parts of a lease whose change counts as activity.
pub fn activity_of(lease: &FencedLease) -> Activity {
    Activity {
        uid: lease.metadata.uid.clone().unwrap_or_default(),
        generation: lease.metadata.generation.unwrap_or_default(),
        holder: lease.holder().map(str::to_string),
        renew_marker: lease
            .status
            .as_ref()
            .and_then(|s| s.renew_time.as_ref())
            .map(|t| t.0.to_string()),
    }
}

/// How long an observer whose own duration is `own` (the spec's, unless overridden) waits
/// without activity before this lease counts as expired: see
/// [`observer_lease_duration`].
pub fn observer_duration(lease: &FencedLease, own: Duration) -> Duration {
    observer_lease_duration(
        own,
        lease.holder_lease_duration_seconds().map(lease_seconds),
    )
}

/// Now on the wall clock, in microseconds since the Unix epoch: the timeline's unit.
fn wall_us() -> i64 {
    jiff::Timestamp::now().as_microsecond()
}

/// `status.renewTime` in microseconds since the Unix epoch (0: none).
fn renew_us(lease: &FencedLease) -> i64 {
    lease
        .status
        .as_ref()
        .and_then(|s| s.renew_time.as_ref())
        .map_or(0, |t| t.0.as_microsecond())
}

/// How a write's answer came out, for the timeline.
fn answer_label<T>(
    res: &Result<Result<T, kube::Error>, tokio::time::error::Elapsed>,
) -> &'static str {
    match res {
        Ok(Ok(_)) => "ok",
        Ok(Err(kube::Error::Api(s))) if s.code == 409 => "conflict",
        Ok(Err(kube::Error::Api(s))) if s.code == 404 => "not_found",
        Ok(Err(_)) => "error",
        Err(_) => "timed_out",
    }
}

fn rv_num(obj: &FencedLease) -> u64 {
    obj.metadata
        .resource_version
        .as_deref()
        .and_then(|rv| rv.parse().ok())
        .unwrap_or(0)
}

/// Reconcile sequences against an in-process fake API server: each test sets up what the
/// elector believes and what the server holds, steps the elector, and checks both the requests
/// it sent and what it published. The real-server tests (tests/elector_crate.rs,
/// tests/election.rs) stay beside these; these drive orders a real cluster rarely shows.
#[cfg(test)]
mod sequences {
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    use kube::api::ObjectMeta;

    use super::*;

    const NS: &str = "ns";
    const NAME: &str = "job";
    const ME: &str = "web-0";

    /// The fake server: answers GET of the lease with `lease`, a status write with 409
    /// Conflict, a spec write by storing and answering the object sent (its generation and
    /// resourceVersion moved on); records every request as "METHOD path".
    #[derive(Default)]
    struct Server {
        lease: Mutex<Option<FencedLease>>,
        requests: Mutex<Vec<String>>,
    }

    fn status(code: u16, reason: &str) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "status": "Failure",
            "message": reason, "reason": reason, "code": code,
        }))
        .unwrap_or_default()
    }

    impl Server {
        fn answer(&self, method: &str, path: &str, body: &[u8]) -> (u16, Vec<u8>) {
            self.requests
                .lock()
                .unwrap()
                .push(format!("{method} {path}"));
            let lease = self.lease.lock().unwrap().clone();
            match (method, path.ends_with("/status"), lease) {
                ("GET", false, Some(l)) => (200, serde_json::to_vec(&l).unwrap_or_default()),
                ("GET", false, None) => (404, status(404, "NotFound")),
                ("PUT", true, _) => (409, status(409, "Conflict")),
                ("PUT", false, _) => {
                    let mut sent: FencedLease = serde_json::from_slice(body).unwrap();
                    sent.metadata.resource_version = Some("99".into());
                    sent.metadata.generation = sent.metadata.generation.map(|g| g + 1);
                    *self.lease.lock().unwrap() = Some(sent.clone());
                    (200, serde_json::to_vec(&sent).unwrap_or_default())
                }
                _ => (500, status(500, "InternalError")),
            }
        }

        fn requests(&self) -> Vec<String> {
            self.requests.lock().unwrap().clone()
        }
    }

    fn client(server: Arc<Server>) -> Client {
        let svc = tower::service_fn(move |req: http::Request<kube::client::Body>| {
            let server = server.clone();
            async move {
                let method = req.method().to_string();
                let path = req.uri().path().to_string();
                let body = req.into_body().collect_bytes().await.unwrap_or_default();
                let (code, bytes) = server.answer(&method, &path, &body);
                http::Response::builder()
                    .status(code)
                    .body(kube::client::Body::from(bytes))
            }
        });
        Client::new(svc, NS)
    }

    /// The lease as the server holds it: held by `ME` with `incarnation`, token `generation`.
    fn lease(generation: i64, incarnation: &str, rv: &str) -> FencedLease {
        let mut spec = FencedLeaseSpec::free();
        spec.holder_identity = Some(ME.into());
        spec.lease_duration_seconds = 10;
        let mut l = FencedLease::new(NAME, spec);
        l.metadata = ObjectMeta {
            name: Some(NAME.into()),
            namespace: Some(NS.into()),
            uid: Some("u1".into()),
            generation: Some(generation),
            resource_version: Some(rv.into()),
            annotations: Some(BTreeMap::from([(
                INCARNATION_ANNOTATION.to_string(),
                incarnation.to_string(),
            )])),
            ..ObjectMeta::default()
        };
        l
    }

    /// An elector of identity `ME` that holds `held` (token 3, its own incarnation), renewed 4 s
    /// ago under a 10 s lease: still valid for 4 s, its next renewal due now.
    fn holder(server: &Arc<Server>) -> (Elector, ElectorHandle, FencedLease) {
        let (mut e, h) =
            Elector::new(client(server.clone()), ElectorConfig::new(NS, NAME, ME)).unwrap();
        // (Not before the machine's boot: a fresh VM may be younger than 100 s.)
        e.origin = clock::now()
            .checked_sub(Duration::from_secs(100))
            .unwrap_or(e.origin);
        let held = lease(3, &e.incarnation.clone(), "10");
        let timing = Timing::for_lease_seconds(10);
        let sent = e.mono(clock::now()).saturating_sub(Duration::from_secs(4));
        let tenure = Tenure::acquired(3, sent, timing).renewed(sent, timing);
        e.saw(Some(held.clone()));
        e.tenure = Some((tenure, "u1".into()));
        e.publish_leading();
        (e, h, held)
    }

    fn following(token: i64) -> LeaderState {
        LeaderState::Following {
            holder: Some(ME.into()),
            token: Some(token),
        }
    }

    const LEASE_PATH: &str = "/apis/fencedlease.io/v1alpha1/namespaces/ns/fencedleases/job";

    #[tokio::test]
    async fn a_holder_that_learns_of_its_identity_s_new_tenure_through_a_conflict_stops() {
        let server = Arc::new(Server::default());
        let (mut a, handle, _) = holder(&server);
        // Meanwhile the lease was revoked (token 4) and a new process of the same identity
        // acquired it (token 5); this holder saw neither on its watch.
        *server.lease.lock().unwrap() = Some(lease(5, "newcomer", "20"));
        a.step().await; // the renewal meets 409, and the re-read brings the newcomer's tenure
        a.step().await;
        assert_eq!(
            server.requests(),
            [
                format!("PUT {LEASE_PATH}/status"),
                format!("GET {LEASE_PATH}")
            ]
        );
        assert_eq!(
            *handle.state.borrow(),
            following(5),
            "not the newcomer's token"
        );
        assert!(a.tenure.is_none());
    }

    #[tokio::test]
    async fn a_holder_that_re_lists_the_newcomer_s_tenure_stops() {
        let server = Arc::new(Server::default());
        let (mut a, handle, _) = holder(&server);
        a.saw(Some(lease(5, "newcomer", "20")));
        a.step().await;
        assert_eq!(*handle.state.borrow(), following(5));
        assert_eq!(server.requests(), Vec::<String>::new());
    }

    #[tokio::test]
    async fn a_holder_shutting_down_never_releases_the_newcomer_s_tenure() {
        let server = Arc::new(Server::default());
        let (mut a, _handle, _) = holder(&server);
        a.saw(Some(lease(5, "newcomer", "20")));
        a.release("shutdown").await;
        assert_eq!(
            server.requests(),
            Vec::<String>::new(),
            "no write clears it"
        );
    }

    #[tokio::test]
    async fn a_release_leaves_no_incarnation_behind() {
        let server = Arc::new(Server::default());
        let (mut a, _handle, _) = holder(&server);
        a.release("shutdown").await;
        let freed = server
            .lease
            .lock()
            .unwrap()
            .clone()
            .expect("the release's write");
        assert_eq!(freed.holder(), None);
        assert_eq!(
            freed.holder_incarnation(),
            None,
            "a later holder inherits none"
        );
    }

    #[tokio::test]
    async fn a_spec_edit_of_its_own_tenure_is_adopted() {
        let server = Arc::new(Server::default());
        let (mut a, handle, held) = holder(&server);
        let mut edited = lease(4, &a.incarnation.clone(), "11");
        edited.spec = held.spec;
        *server.lease.lock().unwrap() = Some(edited.clone());
        a.saw(Some(edited));
        a.step().await;
        let state = handle.state.borrow().clone();
        match state {
            LeaderState::Leading { token, .. } => assert_eq!(token.generation, 4),
            other => panic!("want leading with token 4, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn every_acquisition_writes_this_process_s_incarnation() {
        let server = Arc::new(Server::default());
        let (mut b, _handle) = Elector::new(
            client(server.clone()),
            ElectorConfig::new(NS, NAME, "web-1"),
        )
        .unwrap();
        let mut free = lease(6, "someone-else", "30");
        free.spec.holder_identity = None;
        b.acquire(free, Timing::for_lease_seconds(10)).await;
        let held = b.latest.clone().expect("the acquiring write's answer");
        assert_eq!(held.holder_incarnation(), Some(b.incarnation.as_str()));
        assert_ne!(new_incarnation(), new_incarnation(), "one per elector");
    }
}
