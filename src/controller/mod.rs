//! `fencedlease controller`: keeps every FencedLease's status true, revokes expired leases,
//! and emits Events. It is not on the critical path: candidates fail over without it.

pub mod certs;
pub mod holder;
mod owners;
pub(crate) mod pods;
pub mod policy;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, Resource, ResourceExt};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, instrument, warn};

use crate::runtime::admin::RenewalGauge;
use crate::runtime::admin_port::{AdminServer, ReadyFlag};
use crate::runtime::Runtime;

use crate::api::{lease_of, LEADER_ROLE};
use crate::api::{Condition, FencedLease, FIELD_MANAGER, ROLE_LABEL};
use crate::controller::holder::{holder_death, may_revoke_again, Death, HolderPod};
use crate::controller::pods::{pod_state, PodIndex};
use crate::lease::elector::{activity_of, observer_duration, Elector, ElectorConfig, LeaderState};
use crate::lease::rules::{
    controller_decision, lease_seconds, ControllerAction, FencingToken, Mono, Observation,
};
use crate::lease::Revocation;

#[derive(Debug, clap::Args)]
pub struct ControllerArgs {
    /// Address of the /metrics, /livez and /readyz server.
    #[arg(
        long,
        env = "FENCEDLEASE_METRICS_ADDR",
        default_value = "127.0.0.1:9090"
    )]
    pub metrics_addr: SocketAddr,
    /// Namespace of the FencedLease that elects the active controller replica.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub election_namespace: String,
    /// Name of that FencedLease.
    #[arg(long, default_value = "fencedlease-controller")]
    pub election_lease: String,
    /// A Service in the election namespace that owns the election FencedLease, so that
    /// uninstalling the operator removes the lease with it (the chart passes its webhook
    /// Service). Needs `get` on that Service.
    #[arg(long)]
    pub election_owner_service: Option<String>,
    /// Identity of this replica (default: hostname and process id).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Watch only this namespace (default: all namespaces).
    #[arg(long)]
    pub namespace: Option<String>,
    /// Self-managed webhook certificates: keep this TLS Secret (in the election namespace)
    /// issued and renewed for the webhook Service. Only the active replica writes it.
    #[arg(long, requires = "webhook_service")]
    pub webhook_cert_secret: Option<String>,
    /// The webhook's Service name (its DNS names go into the certificate).
    #[arg(long, requires = "webhook_cert_secret")]
    pub webhook_service: Option<String>,
    /// Webhook configurations (validating or mutating) whose caBundle to keep in step.
    #[arg(long, value_delimiter = ',')]
    pub webhook_configurations: Vec<String>,
    /// At most this many leases are reconciled at once. Bounds memory and the burst of
    /// requests after a restart with many leases; expiries are still noticed on time because a
    /// reconcile makes at most a few requests.
    #[arg(long, env = "FENCEDLEASE_CONCURRENCY", default_value_t = 16,
          value_parser = clap::value_parser!(u16).range(1..))]
    pub concurrency: u16,
    /// Policy mode: keep one ValidatingAdmissionPolicyBinding of this ValidatingAdmissionPolicy
    /// (the chart's fencing policy) per FencedLease, so that the API server itself refuses
    /// stale writes to the lease's protected objects. Needs Kubernetes 1.30 or later: the
    /// controller refuses to start without the API or the policy.
    #[arg(long, value_name = "POLICY")]
    pub fencing_policy: Option<String>,
    /// Policy mode: how often, in seconds, the active controller removes the bindings of
    /// deleted FencedLeases and restores missing or changed ones.
    #[arg(long, default_value_t = 30, requires = "fencing_policy",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub fencing_policy_sweep_seconds: u64,
    /// A namespace the fencing leaves out (the chart passes fencing.excludeNamespaces and, by
    /// default, its own): FencedLeases there get the condition Fenced=False and a Warning
    /// Event, since their tokens guard nothing. Repeat for each; none given: no Fenced
    /// condition at all (the controller cannot tell).
    #[arg(long = "unfenced-namespace", value_name = "NAMESPACE")]
    pub unfenced_namespaces: Vec<String>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ResultLabel {
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct EventLabel {
    pub event: &'static str,
}

/// The controller's metrics.
pub(crate) struct ControllerMetrics {
    pub reconciles: Family<ResultLabel, Counter>,
    pub reconcile_seconds: Histogram,
    pub lease_events: Family<EventLabel, Counter>,
    pub leading: Gauge,
}

impl ControllerMetrics {
    pub(crate) fn register(registry: &mut Registry) -> ControllerMetrics {
        let m = ControllerMetrics {
            reconciles: Family::default(),
            reconcile_seconds: Histogram::new(exponential_buckets(0.0005, 2.0, 14)),
            lease_events: Family::default(),
            leading: Gauge::default(),
        };
        registry.register(
            "fencedlease_controller_reconciles",
            "Reconciliations by result (ok, or an error class)",
            m.reconciles.clone(),
        );
        registry.register(
            "fencedlease_controller_reconcile_seconds",
            "Time spent in one reconciliation",
            m.reconcile_seconds.clone(),
        );
        registry.register(
            "fencedlease_lease_events",
            "Lease changes the controller observed: acquired, released, revoked, handover",
            m.lease_events.clone(),
        );
        registry.register(
            "fencedlease_controller_leading",
            "1 while this replica is the active controller",
            m.leading.clone(),
        );
        m
    }
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("the object has no namespace")]
    NoNamespace,
    #[error(
        "moving the fencedlease.io/role label of pod {pod}: {} (the controller needs patch on \
         pods in that namespace)",
        short(source)
    )]
    LeaderLabel {
        pod: String,
        #[source]
        source: kube::Error,
    },
    #[error(
        "reading pod {pod}, whose holder looks dead, before revoking: {} (the controller needs \
         list on pods in that namespace)",
        short(source)
    )]
    HolderPod {
        pod: String,
        #[source]
        source: kube::Error,
    },
}

/// A Kubernetes error in a sentence: an API error's message, without its whole Status.
fn short(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => format!("{} ({})", s.message, s.code),
        e => e.to_string(),
    }
}

/// The longest Event note the API server accepts (events.k8s.io/v1), in bytes.
const MAX_EVENT_NOTE: usize = 1024;

/// `note` cut to what an Event may hold, on a character boundary.
fn bounded_note(mut note: String) -> String {
    if note.len() > MAX_EVENT_NOTE {
        let mut end = MAX_EVENT_NOTE - '…'.len_utf8();
        while !note.is_char_boundary(end) {
            end -= 1;
        }
        note.truncate(end);
        note.push('…');
    }
    note
}

impl Error {
    pub(crate) fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube(kube::Error::Api(s)) if s.code == 409 => "conflict",
            Error::Kube(kube::Error::Api(_)) => "api",
            Error::Kube(_) => "client",
            Error::NoNamespace => "no_namespace",
            Error::LeaderLabel { .. } => "leader_label",
            Error::HolderPod { .. } => "holder_pod",
        }
    }
}

/// What the controller remembers of a lease between reconciliations.
#[derive(Clone, Debug)]
struct Seen {
    obs: Observation,
    holder: Option<String>,
    /// The preferredHolder last seen (the acquiring write clears it).
    preferred: Option<String>,
    /// The generation this controller's revocation produced, if it revoked this lease.
    revoked_generation: Option<i64>,
    /// Why it revoked.
    revoked_for: Cause,
    /// The holder this controller last revoked for a death, and when.
    dead_revoked: Option<(String, Mono)>,
    /// The leader label could not be moved the last time.
    label_failing: bool,
}

/// Why the controller revoked a lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cause {
    /// The holder did not renew within the lease duration.
    Expired,
    /// The holder was known dead before its lease ran out.
    HolderDead(Death),
}

/// State handed to `reconcile` and `error_policy`.
pub(crate) struct Context {
    pub client: Client,
    pub recorder: Recorder,
    pub metrics: ControllerMetrics,
    origin: Instant,
    seen: Mutex<HashMap<String, Seen>>,
    /// Pods that belong to leases, fed by a watch of pods (see `crate::controller::pods`).
    pods: Mutex<PodIndex>,
    /// Policy mode: the fencing policy's bindings, one per lease.
    bindings: Option<Arc<crate::controller::policy::Bindings>>,
    /// The namespaces the fencing leaves out, when known (`--unfenced-namespace`).
    unfenced: Option<std::collections::BTreeSet<String>>,
}

impl Context {
    pub(crate) fn new(client: Client, metrics: ControllerMetrics, identity: &str) -> Context {
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: FIELD_MANAGER.into(),
                instance: Some(identity.to_string()),
            },
        );
        Context {
            client,
            recorder,
            metrics,
            origin: crate::lease::clock::now(),
            seen: Mutex::new(HashMap::new()),
            pods: Mutex::new(PodIndex::default()),
            bindings: None,
            unfenced: None,
        }
    }

    /// Knows which namespaces the fencing leaves out (none given: it does not know).
    pub(crate) fn with_unfenced(mut self, namespaces: &[String]) -> Context {
        self.unfenced = (!namespaces.is_empty()).then(|| namespaces.iter().cloned().collect());
        self
    }

    /// Keeps the fencing policy's bindings too (policy mode).
    pub(crate) fn with_bindings(
        mut self,
        bindings: Option<Arc<crate::controller::policy::Bindings>>,
    ) -> Context {
        self.bindings = bindings;
        self
    }
}

fn key(lease: &FencedLease) -> String {
    format!(
        "{}/{}/{}",
        lease.namespace().unwrap_or_default(),
        lease.name_any(),
        lease.metadata.uid.as_deref().unwrap_or_default()
    )
}

fn condition(
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
fn merge_conditions(current: &[Condition], desired: Vec<Condition>) -> Vec<Condition> {
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

fn same_conditions(a: &[Condition], b: &[Condition]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.type_ == y.type_
                && x.status == y.status
                && x.reason == y.reason
                && x.message == y.message
        })
}

/// How soon a lease whose leader label could not be moved is looked at again (absent other
/// changes). Revocation and status never wait for the label.
const LABEL_RETRY: Duration = Duration::from_secs(5);
/// How soon a lease whose fencing binding could not be applied is looked at again.
const BINDING_RETRY: Duration = Duration::from_secs(2);
/// How soon a revocation that lost a race (the lease changed meanwhile) is looked at again.
const REVOKE_RACE_RETRY: Duration = Duration::from_millis(50);

#[instrument(skip_all, fields(lease = %lease.name_any(), ns = ?lease.namespace()))]
pub(crate) async fn reconcile(lease: Arc<FencedLease>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    let mut outcome = match LeaseReconcile::new(&lease, &ctx) {
        Ok(mut r) => run_steps(&mut r).await,
        Err(e) => Outcome {
            next: Err(e),
            label: Ok(()),
        },
    };
    // Policy mode: the lease's binding, after the steps (it never holds up a revocation).
    if let (Some(b), Some(ns)) = (&ctx.bindings, lease.namespace()) {
        if let Err(e) = b.ensure(&ns, &lease.name_any()).await {
            warn!(error = %short(&e), "could not apply the lease's fencing binding; retrying");
            outcome.next = outcome.next.map(|n| n.within(BINDING_RETRY));
        }
    }
    ctx.metrics
        .reconcile_seconds
        .observe(started.elapsed().as_secs_f64());
    ctx.metrics
        .reconciles
        .get_or_create(&ResultLabel {
            result: outcome.metric_label(),
        })
        .inc();
    outcome.into_result()
}

/// When to look at a lease again, absent changes: the pure form of [`Action`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Next {
    Requeue(Duration),
    AwaitChange,
}

impl Next {
    /// The same, but no later than `at_most` from now.
    fn within(self, at_most: Duration) -> Next {
        match self {
            Next::Requeue(d) => Next::Requeue(d.min(at_most)),
            Next::AwaitChange => Next::Requeue(at_most),
        }
    }

    fn action(self) -> Action {
        match self {
            Next::Requeue(d) => Action::requeue(d),
            Next::AwaitChange => Action::await_change(),
        }
    }
}

/// The parts of one reconciliation, which [`run_steps`] takes in a fixed order.
trait Steps {
    /// Revokes an expired lease and writes the status: the part that fences, so it goes first.
    async fn expiry(&mut self) -> Result<Next, Error>;
    /// Events for a change of holder that someone else made.
    async fn announce(&mut self);
    /// Moves the leader label between pods; it reports its own failure.
    async fn label(&mut self) -> Result<(), Error>;
}

/// What a reconciliation came to: the expiry part's result and the label's, kept apart so
/// that a label that cannot be moved never hides or holds up a revocation.
#[derive(Debug)]
struct Outcome {
    next: Result<Next, Error>,
    label: Result<(), Error>,
}

/// Revocation and status first, then Events, then the label; each runs whatever the others
/// came to.
async fn run_steps(steps: &mut impl Steps) -> Outcome {
    let next = steps.expiry().await;
    steps.announce().await;
    let label = steps.label().await;
    Outcome { next, label }
}

impl Outcome {
    /// The reconciles metric's result: the expiry part's error, else the label's, else ok.
    fn metric_label(&self) -> &'static str {
        match (&self.next, &self.label) {
            (Err(e), _) | (Ok(_), Err(e)) => e.metric_label(),
            (Ok(_), Ok(())) => "ok",
        }
    }

    /// What the runtime gets: the expiry part's error (so `error_policy` retries it), else its
    /// next look, brought forward to retry a label that failed (already reported).
    fn into_result(self) -> Result<Action, Error> {
        let next = self.next?;
        Ok(match self.label {
            Ok(()) => next.action(),
            Err(_) => next.within(LABEL_RETRY).action(),
        })
    }
}

/// What the controller's memory said about a lease when a reconciliation began.
struct Observed {
    obs: Observation,
    /// The holder and preferredHolder of the previous look, if there was one.
    previous: Option<(Option<String>, Option<String>)>,
    /// The generation this controller's revocation produced, if it revoked this lease.
    revoked_generation: Option<i64>,
    revoked_for: Cause,
    dead_revoked: Option<(String, Mono)>,
    /// The leader label could not be moved at the previous look.
    label_failing: bool,
}

/// Records this look at `lease` in the controller's memory; returns what it knew.
fn remember(ctx: &Context, key: &str, lease: &FencedLease, mono: Mono) -> Observed {
    let holder = lease.holder().map(str::to_string);
    let mut seen = ctx.seen.lock().unwrap_or_else(|p| p.into_inner());
    let prev = seen.get(key).cloned();
    let obs = Observation::observe(prev.as_ref().map(|s| &s.obs), activity_of(lease), mono);
    // Kept until someone acquires: the acquiring write clears it.
    let preferred = lease.spec.preferred_holder.clone().or_else(|| {
        prev.as_ref()
            .filter(|p| p.holder == holder)
            .and_then(|p| p.preferred.clone())
    });
    let revoked_generation = prev.as_ref().and_then(|p| p.revoked_generation);
    let revoked_for = prev.as_ref().map_or(Cause::Expired, |p| p.revoked_for);
    let dead_revoked = prev.as_ref().and_then(|p| p.dead_revoked.clone());
    let label_failing = prev.as_ref().is_some_and(|p| p.label_failing);
    seen.insert(
        key.to_string(),
        Seen {
            obs: obs.clone(),
            holder,
            preferred,
            revoked_generation,
            revoked_for,
            dead_revoked: dead_revoked.clone(),
            label_failing,
        },
    );
    Observed {
        obs,
        previous: prev.map(|p| (p.holder, p.preferred)),
        revoked_generation,
        revoked_for,
        dead_revoked,
        label_failing,
    }
}

/// One reconciliation of one lease.
struct LeaseReconcile<'a> {
    lease: &'a FencedLease,
    ctx: &'a Context,
    api: Api<FencedLease>,
    ns: String,
    key: String,
    mono: Mono,
    seen: Observed,
}

impl<'a> LeaseReconcile<'a> {
    fn fenced(&self) -> Option<Condition> {
        fenced_condition(self.lease, self.ctx.unfenced.as_ref())
    }

    /// A Warning Event when the lease's namespace is left out of fencing, once: when its
    /// status does not say so yet.
    async fn warn_unfenced(&self) {
        let Some(c) = self.fenced().filter(|c| c.status == "False") else {
            return;
        };
        let said = self.lease.status.as_ref().is_some_and(|s| {
            s.conditions
                .iter()
                .any(|x| x.type_ == c.type_ && x.status == c.status)
        });
        if !said {
            warn!(lease = %self.lease.name_any(), ns = %self.ns, "a FencedLease in a namespace the fencing leaves out");
            publish_event(
                self.ctx,
                self.lease,
                EventType::Warning,
                NOT_FENCED,
                c.message,
            )
            .await;
        }
    }

    fn new(lease: &'a FencedLease, ctx: &'a Context) -> Result<Self, Error> {
        let ns = lease.namespace().ok_or(Error::NoNamespace)?;
        let mono = crate::lease::clock::now().saturating_duration_since(ctx.origin);
        let key = key(lease);
        let seen = remember(ctx, &key, lease, mono);
        Ok(LeaseReconcile {
            api: Api::namespaced(ctx.client.clone(), &ns),
            lease,
            ctx,
            ns,
            key,
            mono,
            seen,
        })
    }

    fn update_seen(&self, f: impl FnOnce(&mut Seen)) {
        let mut seen = self.ctx.seen.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = seen.get_mut(&self.key) {
            f(s);
        }
    }

    /// Clears the holder of an expired lease, or of one whose holder is known dead (with the
    /// resourceVersion precondition), so the token moves on and a paused holder is fenced off
    /// even if no candidate is waiting.
    async fn revoke(&self, cause: Cause, lease_duration: Duration) -> Result<Next, Error> {
        let old = self.lease.spec.holder_identity.clone();
        let revoked = match crate::lease::revoke(&self.api, self.lease).await? {
            Revocation::Revoked(revoked) => *revoked,
            // The lease changed meanwhile (a renewal came in): look again with fresh data.
            Revocation::Raced => return Ok(Next::Requeue(REVOKE_RACE_RETRY)),
        };
        let holder = old.as_deref().unwrap_or("the holder");
        let token = revoked.token().unwrap_or_default();
        let (reason, note, event) = match cause {
            Cause::Expired => (
                "Revoked",
                format!(
                    "{holder} did not renew for {}s: revoked, token now {token}",
                    lease_duration.as_secs()
                ),
                "revoked",
            ),
            Cause::HolderDead(death) => (
                death.reason(),
                format!(
                    "{}: revoked without waiting out the lease, token now {token}",
                    death.note(holder)
                ),
                "revoked_holder_dead",
            ),
        };
        info!(%note, "revoked a lease");
        let mono = self.mono;
        self.update_seen(|s| {
            s.revoked_generation = revoked.metadata.generation;
            s.revoked_for = cause;
            if let (Cause::HolderDead(_), Some(h)) = (cause, old.clone()) {
                s.dead_revoked = Some((h, mono));
            }
        });
        let fenced = fenced_condition(&revoked, self.ctx.unfenced.as_ref());
        let status = write_status(&self.api, &revoked, Some(cause), fenced).await;
        publish(
            self.ctx,
            self.lease,
            EventType::Warning,
            reason,
            note,
            event,
        )
        .await;
        status.map(|()| Next::AwaitChange)
    }

    /// Whether the holder is known dead: first from the pod index, then, since a revocation
    /// cannot be taken back, confirmed with a fresh read of the pod (a LIST by name, which the
    /// watch's rights already allow). A pod of that name that exists now (a new incarnation)
    /// or that the index saw late in a new life is not revoked; a lease that changed since it
    /// was read is refused by the revocation's precondition.
    async fn known_death(&self, lease_duration: Duration) -> Result<Option<Death>, Error> {
        let Some(holder) = self.lease.holder() else {
            return Ok(None);
        };
        let last = self
            .seen
            .dead_revoked
            .as_ref()
            .map(|(h, at)| (h.as_str(), *at));
        if !may_revoke_again(last, holder, self.mono, lease_duration) {
            return Ok(None);
        }
        let lease_name = self.lease.name_any();
        let known = {
            let index = self.ctx.pods.lock().unwrap_or_else(|p| p.into_inner());
            index.holder_pod(&self.ns, &lease_name, holder)
        };
        if holder_death(self.lease, known).is_none() {
            return Ok(None);
        }
        let pods: Api<Pod> = Api::namespaced(self.ctx.client.clone(), &self.ns);
        let by_name = ListParams::default().fields(&format!("metadata.name={holder}"));
        let listed = pods
            .list(&by_name)
            .await
            .map_err(|source| Error::HolderPod {
                pod: holder.to_string(),
                source,
            })?;
        let fresh = match listed.items.first() {
            // The index knew it as a pod of this lease: now it is gone.
            None => HolderPod::Gone,
            Some(pod) if lease_of(&pod.metadata) == Some(lease_name.as_str()) => {
                HolderPod::Present(pod_state(pod))
            }
            Some(_) => HolderPod::NotAPod,
        };
        let death = holder_death(self.lease, fresh);
        if death.is_none() {
            debug!(%holder, ?known, ?fresh, "the holder looked dead, but a fresh read says otherwise");
        }
        Ok(death)
    }
}

impl Steps for LeaseReconcile<'_> {
    async fn expiry(&mut self) -> Result<Next, Error> {
        let lease = self.lease;
        // The longer of the spec's duration and the one the holder renewed under.
        let wait = observer_duration(lease, lease_seconds(lease.spec.lease_duration_seconds));
        match controller_decision(&self.seen.obs, wait, self.mono) {
            ControllerAction::Revoke => self.revoke(Cause::Expired, wait).await,
            ControllerAction::HeldUntil(at) => {
                if let Some(death) = self.known_death(wait).await? {
                    return self.revoke(Cause::HolderDead(death), wait).await;
                }
                write_status(&self.api, lease, None, self.fenced()).await?;
                Ok(Next::Requeue(
                    at.saturating_sub(self.mono) + Duration::from_millis(1),
                ))
            }
            ControllerAction::Free => {
                let revoked = self.seen.revoked_generation.is_some()
                    && self.seen.revoked_generation == lease.metadata.generation;
                let cause = revoked.then_some(self.seen.revoked_for);
                write_status(&self.api, lease, cause, self.fenced()).await?;
                Ok(Next::AwaitChange)
            }
        }
    }

    async fn announce(&mut self) {
        self.warn_unfenced().await;
        let Some((prev_holder, prev_preferred)) = &self.seen.previous else {
            return;
        };
        let holder = self.lease.holder();
        // A revocation by this controller already has its own Event.
        let revoked_here = self
            .seen
            .revoked_generation
            .is_some_and(|g| Some(g) == self.lease.metadata.generation);
        if prev_holder.as_deref() == holder || revoked_here {
            return;
        }
        let token = self.lease.token().unwrap_or_default();
        let handover = holder.is_some() && prev_preferred.as_deref() == holder;
        let (reason, note, event) = holder_change(prev_holder.as_deref(), holder, handover, token);
        publish(self.ctx, self.lease, EventType::Normal, reason, note, event).await;
    }

    async fn label(&mut self) -> Result<(), Error> {
        let name = self.lease.name_any();
        let res = move_leader_label(self.ctx, &self.ns, &name, self.lease.holder()).await;
        let was_failing = self.seen.label_failing;
        self.update_seen(|s| s.label_failing = res.is_err());
        match &res {
            // Said once when it starts failing (log and Event), counted every time.
            Err(e) if !was_failing => {
                let label = e.metric_label();
                warn!(error = %e, metric_label = label, "could not move the leader label; revocation and status go on");
                let (ctx, lease) = (self.ctx, self.lease);
                let note = e.to_string();
                publish_event(ctx, lease, EventType::Warning, "LeaderLabelFailed", note).await;
            }
            Err(e) => debug!(error = %e, "the leader label still cannot be moved"),
            Ok(()) if was_failing => info!("the leader label is right again"),
            Ok(()) => {}
        }
        res
    }
}

/// The Event for a change of holder: (reason, note, metrics event).
fn holder_change(
    prev: Option<&str>,
    holder: Option<&str>,
    handover: bool,
    token: i64,
) -> (&'static str, String, &'static str) {
    match (prev, holder) {
        (_, Some(h)) if handover => (
            "HandedOver",
            format!("{h}, the preferred holder, took the lease over with token {token}"),
            "handover",
        ),
        (Some(p), Some(h)) => (
            "Acquired",
            format!("{h} took the lease over from {p} with token {token}"),
            "acquired",
        ),
        (None, Some(h)) => (
            "Acquired",
            format!("{h} acquired the lease with token {token}"),
            "acquired",
        ),
        (Some(p), None) => (
            "Released",
            format!("{p} no longer holds the lease; token now {token}"),
            "released",
        ),
        (None, None) => ("Released", "the lease is free".to_string(), "released"),
    }
}

/// Moves the `fencedlease.io/role: leader` label to the holder's pod, if the holder is a pod of
/// this lease (annotated `fencedlease.io/lease: <lease>`): the old holder's label comes off
/// first, so that two pods never carry it at once. Decided from the pod index; a request is made
/// only for a label that has to change. Until the index has listed every pod it does nothing
/// (the complete list then brings every lease with pods back here).
async fn move_leader_label(
    ctx: &Context,
    ns: &str,
    lease: &str,
    holder: Option<&str>,
) -> Result<(), Error> {
    let plan = {
        let index = ctx.pods.lock().unwrap_or_else(|p| p.into_inner());
        index.plan(ns, lease, holder)
    };
    let Some(plan) = plan.filter(|p| !p.is_empty()) else {
        return Ok(());
    };
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    // The old holders' label comes off first.
    let changes = plan.unlabel.iter().map(|name| (name, None));
    for (name, value) in changes.chain(plan.label.iter().map(|name| (name, Some(LEADER_ROLE)))) {
        let patch = serde_json::json!({"metadata": {"labels": {ROLE_LABEL: value}}});
        match pods
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {} // the pod is gone already
            Err(source) => {
                return Err(Error::LeaderLabel {
                    pod: name.clone(),
                    source,
                })
            }
        }
    }
    Ok(())
}

/// Writes the controller-owned parts of the status when they differ: observedGeneration,
/// conditions and expiryTime. A merge patch of only those fields, so holders' renewals and the
/// controller never overwrite each other's fields.
async fn write_status(
    api: &Api<FencedLease>,
    lease: &FencedLease,
    revoked: Option<Cause>,
    fenced: Option<Condition>,
) -> Result<(), Error> {
    let status = lease.status.clone().unwrap_or_default();
    let generation = lease.metadata.generation;
    let desired = desired_conditions(lease, revoked, fenced);
    let merged = merge_conditions(&status.conditions, desired);
    let lease_duration = observer_duration(lease, lease_seconds(lease.spec.lease_duration_seconds));
    let expiry = lease.holder().map(|_| {
        Time(
            jiff::Timestamp::now()
                .checked_add(lease_duration)
                .unwrap_or_else(|_| jiff::Timestamp::now()),
        )
    });
    // The holder writes holderIdentity, token and leaseDurationSeconds; when nobody holds the
    // lease, nobody else would clear them, so the controller does.
    let free = lease.holder().is_none();
    let stale_holder_fields = free
        && (status.holder_identity.is_some()
            || status.token.is_some()
            || status.lease_duration_seconds.is_some());
    let unchanged = status.observed_generation == generation
        && same_conditions(&status.conditions, &merged)
        && status.expiry_time.is_some() == expiry.is_some()
        && !stale_holder_fields;
    if unchanged {
        return Ok(());
    }
    // With the resourceVersion it was computed from: if a holder wrote meanwhile, the patch
    // fails with 409 and the reconcile runs again on fresh data.
    let mut patch = serde_json::json!({
        "metadata": {"resourceVersion": lease.metadata.resource_version},
        "status": {
            "observedGeneration": generation,
            "conditions": merged,
            "expiryTime": expiry,
        }
    });
    if free {
        patch["status"]["holderIdentity"] = serde_json::Value::Null;
        patch["status"]["token"] = serde_json::Value::Null;
        patch["status"]["leaseDurationSeconds"] = serde_json::Value::Null;
    }
    match api
        .patch_status(
            &lease.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

fn desired_conditions(
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
const NOT_FENCED: &str = "NamespaceNotFenced";

/// The `Fenced` condition, False, for a lease in a namespace the fencing leaves out, where the
/// API server never asks the webhook or the policy about a write, so the lease's token guards
/// nothing. Elsewhere no condition: the controller cannot tell that a namespace *is* fenced
/// (fencing.namespaceSelector may leave it out too; `kubectl fencedlease check` probes that).
fn fenced_condition(
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
fn handover_condition(lease: &FencedLease) -> Condition {
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

fn holding_conditions(lease: &FencedLease, revoked: Option<Cause>) -> Vec<Condition> {
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
fn recorded_revocation(lease: &FencedLease) -> Option<Cause> {
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

/// Publishes an Event about a lease change and counts it in `fencedlease_lease_events`.
async fn publish(
    ctx: &Context,
    lease: &FencedLease,
    type_: EventType,
    reason: &str,
    note: String,
    event: &'static str,
) {
    ctx.metrics
        .lease_events
        .get_or_create(&EventLabel { event })
        .inc();
    publish_event(ctx, lease, type_, reason, note).await;
}

/// Publishes an Event on the lease; a failure is logged, never returned.
async fn publish_event(
    ctx: &Context,
    lease: &FencedLease,
    type_: EventType,
    reason: &str,
    note: String,
) {
    // The Recorder folds events with the same (reason, action, object) into one series that
    // keeps the first note; every change of holder is a distinct fact, so the token goes into
    // the action.
    let ev = Event {
        type_,
        reason: reason.into(),
        note: Some(bounded_note(note)),
        action: format!("{reason}Token{}", lease.token().unwrap_or_default()),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&ev, &lease.object_ref(&())).await {
        warn!(error = %e, "publishing an Event failed");
    }
}

/// FencedLeases as the controller caches them: without managedFields, which are most of a
/// lease's size in memory and never read here. (A replace made from a cached lease keeps the
/// server's managedFields: an update without them leaves them as they are.)
fn lease_stream(
    client: &Client,
    namespace: Option<&str>,
    writer: reflector::store::Writer<FencedLease>,
) -> impl futures::Stream<Item = Result<FencedLease, watcher::Error>> + Send + 'static {
    let api: Api<FencedLease> = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    watcher(api, watcher::Config::default().any_semantic())
        .default_backoff()
        .modify(|l: &mut FencedLease| l.metadata.managed_fields = None)
        .reflect(writer)
        .applied_objects()
}

/// Reconcile requests for the leases whose pods changed, from one watch of pods that also keeps
/// `ctx.pods` current.
fn pod_triggers(
    client: &Client,
    namespace: Option<&str>,
    ctx: Arc<Context>,
) -> impl futures::Stream<Item = ObjectRef<FencedLease>> + Send + 'static {
    // Whole pods, since the index reads their status too; each is slimmed to what the index
    // reads as it arrives.
    let api: Api<Pod> = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    watcher(api, watcher::Config::default().any_semantic())
        .default_backoff()
        .modify(crate::controller::pods::slim)
        .filter_map(move |event| {
            let ctx = ctx.clone();
            async move {
                match event {
                    Ok(event) => {
                        let leases = ctx
                            .pods
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .apply(&event);
                        Some(futures::stream::iter(leases.into_iter().map(
                            |(ns, name)| ObjectRef::<FencedLease>::new(&name).within(&ns),
                        )))
                    }
                    Err(e) => {
                        warn!(error = %e, "watching pods failed; retrying");
                        None
                    }
                }
            }
        })
        .flatten()
}

pub(crate) fn error_policy(_lease: Arc<FencedLease>, error: &Error, _ctx: Arc<Context>) -> Action {
    match error {
        Error::Kube(kube::Error::Api(s)) if s.code == 409 => {
            Action::requeue(Duration::from_millis(50))
        }
        _ => {
            warn!(%error, "reconcile failed");
            Action::requeue(Duration::from_secs(1))
        }
    }
}

fn cert_config(args: &ControllerArgs) -> Option<crate::controller::certs::CertConfig> {
    Some(crate::controller::certs::CertConfig {
        namespace: args.election_namespace.clone(),
        secret: args.webhook_cert_secret.clone()?,
        service: args.webhook_service.clone()?,
        configurations: args.webhook_configurations.clone(),
    })
}

/// Keeps the webhook certificate and caBundles current while this replica is active.
async fn keep_certificates(client: Client, cfg: crate::controller::certs::CertConfig) {
    loop {
        let wait = match crate::controller::certs::reconcile(&client, &cfg).await {
            Ok(_) => Duration::from_secs(60),
            Err(e) => {
                warn!(error = %e, kind = e.metric_label(), "keeping the webhook certificate failed; retrying");
                Duration::from_secs(2)
            }
        };
        tokio::time::sleep(wait).await;
    }
}

/// Gives an election lease created without an owner (by an earlier version) its owner. A
/// metadata change: the generation, so the token, stays.
async fn adopt_election_lease(
    client: &Client,
    namespace: &str,
    name: &str,
    owner: &OwnerReference,
) {
    let api: Api<FencedLease> = Api::namespaced(client.clone(), namespace);
    match api.get_opt(name).await {
        Ok(Some(lease))
            if lease
                .metadata
                .owner_references
                .as_ref()
                .is_none_or(|o| o.is_empty()) =>
        {
            let patch = serde_json::json!({"metadata": {"ownerReferences": [owner]}});
            match api
                .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {
                    info!(lease = name, service = %owner.name, "the election FencedLease is now owned by the Service")
                }
                Err(e) => {
                    warn!(lease = name, error = %e, "could not give the election FencedLease its owner")
                }
            }
        }
        Ok(_) => {}
        Err(e) => warn!(lease = name, error = %e, "could not read the election FencedLease"),
    }
}

/// Policy mode, while this replica is active: every `period`, removes the bindings of leases
/// that are gone and restores missing or changed ones (see [`crate::controller::policy::Bindings::sweep`]).
async fn sweep_bindings(bindings: Arc<crate::controller::policy::Bindings>, period: Duration) {
    loop {
        if let Err(e) = bindings.sweep().await {
            warn!(error = %short(&e), "sweeping the fencing bindings failed; retrying");
        }
        tokio::time::sleep(period).await;
    }
}

/// Runs the controller: campaigns for the controller lease and reconciles while active.
pub(crate) async fn run(args: ControllerArgs) -> anyhow::Result<std::process::ExitCode> {
    let identity = args
        .identity
        .clone()
        .unwrap_or_else(crate::runtime::identity::default_identity);
    let rt = Runtime::start().await?;
    let client = rt.client().clone();
    if let Some(policy) = &args.fencing_policy {
        crate::controller::policy::require_policy(&client, policy).await?;
    }
    // The metrics server starts first, before the elector.
    let ready = ReadyFlag::default();
    let (admin, metrics, renewals) = start_admin(&args, &ready, rt.shutdown());
    let owner = election_owner(&client, &args).await;
    let (elector, handle) = Elector::new(
        client.clone(),
        ElectorConfig {
            namespace: args.election_namespace.clone(),
            lease: args.election_lease.clone(),
            identity: identity.clone(),
            create_with_duration: Some(crate::api::DEFAULT_LEASE_DURATION_SECONDS),
            create_owner: owner.clone(),
            timing_override: None,
        },
    )?;
    renewals.follow(handle.state.clone());
    let elector = rt.spawn_elector(elector);
    let bindings = args.fencing_policy.clone().map(|p| {
        Arc::new(crate::controller::policy::Bindings::new(
            client.clone(),
            p,
            args.namespace.clone(),
        ))
    });
    let ctx = Arc::new(
        Context::new(client.clone(), metrics, &identity)
            .with_bindings(bindings)
            .with_unfenced(&args.unfenced_namespaces),
    );
    ready.set(true);
    let active = Active {
        args: &args,
        client: &client,
        ctx: &ctx,
        owner: owner.as_ref(),
        shutdown: rt.shutdown(),
    };
    let mut state = handle.state.clone();
    while let Some(term) = active.next_term(&mut state).await {
        if term.lead(&mut state).await == TermEnd::Stopped {
            break;
        }
        warn!("lost the controller lease: standing by");
    }
    info!("shutting down");
    ready.set(false);
    rt.shutdown().cancel();
    elector.stop_and_warn().await;
    admin.join().await;
    Ok(std::process::ExitCode::SUCCESS)
}

/// Registers the controller's metrics and serves them with /livez and /readyz (`ready`) until
/// `shutdown`.
fn start_admin(
    args: &ControllerArgs,
    ready: &ReadyFlag,
    shutdown: &CancellationToken,
) -> (AdminServer, ControllerMetrics, RenewalGauge) {
    let mut registry = Registry::default();
    let metrics = ControllerMetrics::register(&mut registry);
    let renewals = RenewalGauge::register(
        &mut registry,
        "fencedlease_controller_last_renewal_timestamp_seconds",
    );
    let server = AdminServer::start(
        args.metrics_addr,
        ready.readiness(),
        Arc::new(registry),
        shutdown.clone(),
    );
    (server, metrics, renewals)
}

/// The Service meant to own the election FencedLease (--election-owner-service), when it can
/// be read; otherwise a warning, and none.
async fn election_owner(client: &Client, args: &ControllerArgs) -> Option<OwnerReference> {
    let service = args.election_owner_service.as_ref()?;
    match crate::controller::owners::service_owner(client, &args.election_namespace, service).await
    {
        Ok(Some(owner)) => Some(owner),
        Ok(None) => {
            warn!(%service, "the Service meant to own the election FencedLease does not exist: the lease will outlive the operator");
            None
        }
        Err(e) => {
            warn!(%service, error = %e, "cannot read the Service meant to own the election FencedLease (it needs get on that Service): the lease will outlive the operator");
            None
        }
    }
}

/// How a term as the active controller ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TermEnd {
    /// Leadership ended, by news from the elector or by its deadline: stand by.
    Lost,
    /// The controller was told to stop (or its reconciler ended): shut down.
    Stopped,
}

/// What a term ends on, as far as the elector's state says: None while it leads, else the end.
fn term_end_of(state: &LeaderState, now: Instant) -> Option<TermEnd> {
    state.leading_token(now).is_none().then_some(TermEnd::Lost)
}

/// What every term as the active controller needs.
struct Active<'a> {
    args: &'a ControllerArgs,
    client: &'a Client,
    ctx: &'a Arc<Context>,
    owner: Option<&'a OwnerReference>,
    shutdown: &'a CancellationToken,
}

/// One term as the active controller: from the moment this replica leads with `token`.
struct Term<'a> {
    active: &'a Active<'a>,
    token: FencingToken,
}

impl<'a> Active<'a> {
    /// Waits until this replica leads; None on shutdown or when the elector is gone.
    async fn next_term(&'a self, state: &mut watch::Receiver<LeaderState>) -> Option<Term<'a>> {
        loop {
            let s = state.borrow_and_update().clone();
            if let Some(token) = s.leading_token(crate::lease::clock::now()) {
                info!(
                    token = token.generation,
                    "this replica is the active controller"
                );
                return Some(Term {
                    active: self,
                    token: token.clone(),
                });
            }
            tokio::select! {
                r = state.changed() => if r.is_err() { return None },
                () = self.shutdown.cancelled() => return None,
            }
        }
    }
}

impl Term<'_> {
    /// Reconciles (and keeps the bindings and certificates) until the term ends.
    async fn lead(&self, state: &mut watch::Receiver<LeaderState>) -> TermEnd {
        let Active {
            args, client, ctx, ..
        } = *self.active;
        ctx.metrics.leading.set(1);
        if let Some(owner) = self.active.owner {
            adopt_election_lease(
                client,
                &args.election_namespace,
                &args.election_lease,
                owner,
            )
            .await;
        }
        // A fresh cache and pod index for every term: what an earlier term saw may be old.
        *ctx.pods.lock().unwrap_or_else(|p| p.into_inner()) = PodIndex::default();
        let (reader, writer) = reflector::store::<FencedLease>();
        let sweep_task = ctx.bindings.clone().map(|b| {
            let period = Duration::from_secs(args.fencing_policy_sweep_seconds);
            tokio::spawn(sweep_bindings(b, period))
        });
        let namespace = args.namespace.as_deref();
        let controller = Controller::for_stream(lease_stream(client, namespace, writer), reader)
            .reconcile_on(pod_triggers(client, namespace, ctx.clone()))
            .with_config(controller::Config::default().concurrency(args.concurrency))
            .graceful_shutdown_on(self.active.shutdown.clone().cancelled_owned())
            .run(reconcile, error_policy, ctx.clone())
            .for_each(|res| async move {
                if let Err(e) = res {
                    tracing::debug!(error = %e, "reconcile error");
                }
            });
        let certs_task =
            cert_config(args).map(|cfg| tokio::spawn(keep_certificates(client.clone(), cfg)));
        let ended = self.ended(state, controller).await;
        debug!(token = self.token.generation, ?ended, "the term ended");
        ctx.metrics.leading.set(0);
        for t in [certs_task, sweep_task].into_iter().flatten() {
            t.abort();
        }
        ended
    }

    /// Runs `controller` until leadership is lost, by event or by deadline, or until it stops
    /// or shutdown comes.
    async fn ended(
        &self,
        state: &mut watch::Receiver<LeaderState>,
        controller: impl std::future::Future<Output = ()>,
    ) -> TermEnd {
        tokio::pin!(controller);
        loop {
            let s = state.borrow().clone();
            if let Some(end) = term_end_of(&s, crate::lease::clock::now()) {
                return end;
            }
            let LeaderState::Leading { valid_until, .. } = s else {
                return TermEnd::Lost;
            };
            tokio::select! {
                () = &mut controller => return TermEnd::Stopped,
                r = state.changed() => if r.is_err() { return TermEnd::Lost },
                () = tokio::time::sleep_until(crate::lease::clock::timer_for(valid_until)) => {}
                () = self.active.shutdown.cancelled() => return TermEnd::Stopped,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_in_a_namespace_left_out_of_fencing_is_said_to_be_unfenced() {
        let mut lease = FencedLease::new("db", crate::api::FencedLeaseSpec::free());
        lease.metadata.namespace = Some("kube-system".into());
        lease.metadata.generation = Some(3);
        let out: std::collections::BTreeSet<String> =
            ["kube-system", "fencedlease"].map(String::from).into();
        let c = fenced_condition(&lease, Some(&out)).expect("known");
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", NOT_FENCED)
        );
        assert!(
            c.message
                .contains("namespace kube-system is left out of fencing"),
            "{}",
            c.message
        );
        assert_eq!(c.observed_generation, Some(3));
        // Elsewhere no claim: the namespace selector may leave it out too.
        lease.metadata.namespace = Some("shop".into());
        assert!(fenced_condition(&lease, Some(&out)).is_none());
        // Not told which namespaces are left out: no claim either way.
        assert!(fenced_condition(&lease, None).is_none());
        assert!(desired_conditions(&lease, None, None)
            .iter()
            .all(|c| c.type_ != "Fenced"));
    }

    #[test]
    fn a_term_ends_when_leadership_does_by_news_or_by_deadline() {
        let now = Instant::now();
        let leading = |until| LeaderState::Leading {
            token: FencingToken {
                lease_uid: "u".into(),
                generation: 3,
            },
            valid_until: until,
            tenure: 1,
        };
        assert_eq!(
            term_end_of(&leading(now + Duration::from_secs(1)), now),
            None
        );
        assert_eq!(term_end_of(&leading(now), now), Some(TermEnd::Lost));
        let following = LeaderState::Following {
            holder: Some("b".into()),
            token: Some(4),
        };
        assert_eq!(term_end_of(&following, now), Some(TermEnd::Lost));
        assert_eq!(term_end_of(&LeaderState::Unknown, now), Some(TermEnd::Lost));
    }

    /// Steps that record the order they run in and answer what they were told to.
    struct Recorded {
        ran: Vec<&'static str>,
        expiry: Option<Result<Next, Error>>,
        label: Option<Result<(), Error>>,
    }

    impl Recorded {
        fn new(expiry: Result<Next, Error>, label: Result<(), Error>) -> Recorded {
            Recorded {
                ran: Vec::new(),
                expiry: Some(expiry),
                label: Some(label),
            }
        }
    }

    impl Steps for Recorded {
        async fn expiry(&mut self) -> Result<Next, Error> {
            self.ran.push("expiry");
            self.expiry.take().unwrap_or(Ok(Next::AwaitChange))
        }
        async fn announce(&mut self) {
            self.ran.push("announce");
        }
        async fn label(&mut self) -> Result<(), Error> {
            self.ran.push("label");
            self.label.take().unwrap_or(Ok(()))
        }
    }

    fn label_forbidden() -> Error {
        let status = serde_json::from_value(serde_json::json!({
            "code": 403, "reason": "Forbidden",
            "message": "pods \"pod-a\" is forbidden: cannot patch resource \"pods\""
        }))
        .expect("a Status");
        Error::LeaderLabel {
            pod: "pod-a".into(),
            source: kube::Error::Api(Box::new(status)),
        }
    }

    fn run(expiry: Result<Next, Error>, label: Result<(), Error>) -> (Vec<&'static str>, Outcome) {
        let mut steps = Recorded::new(expiry, label);
        let outcome = futures::executor::block_on(run_steps(&mut steps));
        (steps.ran, outcome)
    }

    #[test]
    fn revocation_and_status_come_first_and_a_failing_label_holds_up_nothing() {
        let (ran, outcome) = run(Ok(Next::AwaitChange), Err(label_forbidden()));
        assert_eq!(ran, ["expiry", "announce", "label"]);
        assert_eq!(outcome.metric_label(), "leader_label");
        // Not an error for the runtime: the expiry part succeeded; the label is retried soon.
        assert_eq!(
            outcome.into_result().expect("not an error"),
            Action::requeue(LABEL_RETRY)
        );
        // The label is still tried when the expiry part failed, and that error is what counts.
        let (ran, outcome) = run(Err(Error::NoNamespace), Err(label_forbidden()));
        assert_eq!(ran, ["expiry", "announce", "label"]);
        assert_eq!(outcome.metric_label(), "no_namespace");
        assert!(matches!(outcome.into_result(), Err(Error::NoNamespace)));
    }

    #[test]
    fn a_failed_label_only_brings_the_next_look_forward() {
        let ms = Duration::from_millis;
        // (expiry's next look, label ok) -> what the runtime gets
        let table = [
            (Next::AwaitChange, true, Action::await_change()),
            (Next::AwaitChange, false, Action::requeue(LABEL_RETRY)),
            (Next::Requeue(ms(200)), false, Action::requeue(ms(200))),
            (
                Next::Requeue(ms(60_000)),
                false,
                Action::requeue(LABEL_RETRY),
            ),
            (Next::Requeue(ms(60_000)), true, Action::requeue(ms(60_000))),
        ];
        for (next, label_ok, want) in table {
            let label = if label_ok {
                Ok(())
            } else {
                Err(label_forbidden())
            };
            let (_, outcome) = run(Ok(next), label);
            let want_label = if label_ok { "ok" } else { "leader_label" };
            assert_eq!(outcome.metric_label(), want_label, "{next:?}");
            assert_eq!(outcome.into_result().expect("ok"), want, "{next:?}");
        }
    }

    #[test]
    fn a_label_error_says_what_to_do_in_a_sentence() {
        let text = label_forbidden().to_string();
        assert_eq!(
            text,
            "moving the fencedlease.io/role label of pod pod-a: pods \"pod-a\" is forbidden: \
             cannot patch resource \"pods\" (403) (the controller needs patch on pods in that \
             namespace)"
        );
    }

    #[test]
    fn event_notes_fit_what_the_api_server_accepts() {
        assert_eq!(bounded_note("short".into()), "short");
        let exact = "x".repeat(MAX_EVENT_NOTE);
        assert_eq!(bounded_note(exact.clone()), exact);
        for filler in ["y", "é", "名"] {
            let cut = bounded_note(filler.repeat(2000));
            assert!(cut.len() <= MAX_EVENT_NOTE, "{filler}: {}", cut.len());
            assert!(cut.ends_with('…'));
        }
    }

    #[test]
    fn a_revocation_is_recognised_from_the_status_it_wrote() {
        use crate::controller::holder::Finished;
        for cause in [
            Cause::Expired,
            Cause::HolderDead(Death::PodGone),
            Cause::HolderDead(Death::PodFinished(Finished::Failed)),
            Cause::HolderDead(Death::ContainerTerminated),
            Cause::HolderDead(Death::ContainerRestarted),
        ] {
            let mut lease = FencedLease::new("db", crate::api::FencedLeaseSpec::free());
            lease.metadata.generation = Some(7);
            let conditions = holding_conditions(&lease, Some(cause));
            let held = conditions.iter().find(|c| c.type_ == "Held");
            assert!(held.is_some_and(|c| c.status == "False"), "{cause:?}");
            lease.status = Some(crate::api::FencedLeaseStatus {
                conditions,
                ..Default::default()
            });
            // After a restart (no memory), the same conditions again.
            assert_eq!(recorded_revocation(&lease), Some(cause));
            // A later generation (a new holder came and went) is no longer revoked.
            lease.metadata.generation = Some(8);
            assert_eq!(recorded_revocation(&lease), None, "{cause:?}");
        }
    }

    #[test]
    fn holder_changes_have_the_right_event() {
        let table = [
            (
                Some("a"),
                Some("b"),
                false,
                "Acquired",
                "b took the lease over from a with token 5",
            ),
            (
                None,
                Some("b"),
                false,
                "Acquired",
                "b acquired the lease with token 5",
            ),
            (
                Some("a"),
                Some("b"),
                true,
                "HandedOver",
                "b, the preferred holder, took the lease over with token 5",
            ),
            (
                Some("a"),
                None,
                false,
                "Released",
                "a no longer holds the lease; token now 5",
            ),
        ];
        for (prev, holder, handover, reason, note) in table {
            let (r, n, _) = holder_change(prev, holder, handover, 5);
            assert_eq!((r, n.as_str()), (reason, note));
        }
    }
}
