//! `fencedlease controller`: keeps every FencedLease's status true, revokes expired leases,
//! and emits Events. It is not on the critical path: candidates fail over without it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
use kube::api::{Patch, PatchParams, PostParams};
use kube::core::PartialObjectMeta;
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, Resource, ResourceExt};
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{info, instrument, warn};

use crate::api::{Condition, FencedLease};
use crate::lease::elector::{activity_of, observer_duration, Elector, ElectorConfig, LeaderState};
use crate::lease::rules::{controller_decision, lease_seconds, ControllerAction, Observation};
use crate::metrics::{ControllerMetrics, EventLabel, HealthState, ResultLabel};
use crate::pods::{PodIndex, ROLE_LABEL};

pub const FIELD_MANAGER: &str = "fencedlease-controller";

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
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("the object has no namespace")]
    NoNamespace,
}

impl Error {
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube(kube::Error::Api(s)) if s.code == 409 => "conflict",
            Error::Kube(kube::Error::Api(_)) => "api",
            Error::Kube(_) => "client",
            Error::NoNamespace => "no_namespace",
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
}

/// State handed to `reconcile` and `error_policy`.
pub struct Context {
    pub client: Client,
    pub recorder: Recorder,
    pub metrics: ControllerMetrics,
    origin: Instant,
    seen: Mutex<HashMap<String, Seen>>,
    /// Pods that belong to leases, fed by a metadata watch (see `crate::pods`).
    pods: Mutex<PodIndex>,
}

impl Context {
    pub fn new(client: Client, metrics: ControllerMetrics, identity: &str) -> Context {
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
            origin: Instant::now(),
            seen: Mutex::new(HashMap::new()),
            pods: Mutex::new(PodIndex::default()),
        }
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

#[instrument(skip_all, fields(lease = %lease.name_any(), ns = ?lease.namespace()))]
pub async fn reconcile(lease: Arc<FencedLease>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    let res = reconcile_inner(&lease, &ctx).await;
    ctx.metrics
        .reconcile_seconds
        .observe(started.elapsed().as_secs_f64());
    let label = match &res {
        Ok(_) => "ok",
        Err(e) => e.metric_label(),
    };
    ctx.metrics
        .reconciles
        .get_or_create(&ResultLabel { result: label })
        .inc();
    res
}

async fn reconcile_inner(lease: &FencedLease, ctx: &Context) -> Result<Action, Error> {
    let ns = lease.namespace().ok_or(Error::NoNamespace)?;
    let api: Api<FencedLease> = Api::namespaced(ctx.client.clone(), &ns);
    let now = Instant::now();
    let mono = now.saturating_duration_since(ctx.origin);
    // The longer of the spec's duration and the one the holder renewed under.
    let lease_duration = observer_duration(lease, lease_seconds(lease.spec.lease_duration_seconds));
    let holder = lease.holder().map(str::to_string);
    let k = key(lease);

    // Observe, and note changes of holder for Events.
    let previous = {
        let mut seen = ctx.seen.lock().unwrap_or_else(|p| p.into_inner());
        let prev = seen.get(&k).cloned();
        let obs = Observation::observe(prev.as_ref().map(|s| &s.obs), activity_of(lease), mono);
        seen.insert(
            k.clone(),
            Seen {
                obs: obs.clone(),
                holder: holder.clone(),
                // Kept until someone acquires: the acquiring write clears it.
                preferred: lease.spec.preferred_holder.clone().or_else(|| {
                    prev.as_ref()
                        .filter(|p| p.holder == holder)
                        .and_then(|p| p.preferred.clone())
                }),
                revoked_generation: prev.as_ref().and_then(|p| p.revoked_generation),
            },
        );
        prev.map(|p| (p.holder, p.preferred, obs))
    };
    // Level-triggered: costs no request unless a label is wrong.
    move_leader_label(ctx, &ns, &lease.name_any(), holder.as_deref()).await?;
    let revoked_here = {
        let seen = ctx.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.get(&k)
            .and_then(|s| s.revoked_generation)
            .is_some_and(|g| Some(g) == lease.metadata.generation)
    };
    if let Some((prev_holder, prev_preferred, _)) = &previous {
        // A revocation already has its own Event.
        if *prev_holder != holder && !revoked_here {
            let token = lease.token().unwrap_or_default();
            let handover = holder.is_some() && *prev_preferred == holder;
            let (reason, note, event) = match (prev_holder, &holder) {
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
            };
            publish(ctx, lease, EventType::Normal, reason, note, event).await;
        }
    }
    let obs = {
        let seen = ctx.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.get(&k).map(|s| s.obs.clone())
    };
    let revoked_generation = {
        let seen = ctx.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.get(&k).and_then(|s| s.revoked_generation)
    };
    let Some(obs) = obs else {
        return Ok(Action::requeue(Duration::from_secs(60)));
    };

    match controller_decision(&obs, lease_duration, mono) {
        ControllerAction::Revoke => {
            let mut desired = lease.clone();
            let old = desired.spec.holder_identity.take();
            match api
                .replace(&lease.name_any(), &PostParams::default(), &desired)
                .await
            {
                Ok(revoked) => {
                    let note = format!(
                        "{} did not renew for {}s: revoked, token now {}",
                        old.as_deref().unwrap_or("the holder"),
                        lease_duration.as_secs(),
                        revoked.token().unwrap_or_default()
                    );
                    info!(%note, "revoked an expired lease");
                    publish(ctx, lease, EventType::Warning, "Revoked", note, "revoked").await;
                    if let Some(s) = ctx
                        .seen
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get_mut(&k)
                    {
                        s.revoked_generation = revoked.metadata.generation;
                    }
                    write_status(&api, &revoked, true).await?;
                    Ok(Action::await_change())
                }
                // The lease changed meanwhile (a renewal came in): look again with fresh data.
                Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => {
                    Ok(Action::requeue(Duration::from_millis(50)))
                }
                Err(e) => Err(e.into()),
            }
        }
        ControllerAction::HeldUntil(at) => {
            write_status(&api, lease, false).await?;
            Ok(Action::requeue(
                at.saturating_sub(mono) + Duration::from_millis(1),
            ))
        }
        ControllerAction::Free => {
            let revoked =
                revoked_generation.is_some() && revoked_generation == lease.metadata.generation;
            write_status(&api, lease, revoked).await?;
            Ok(Action::await_change())
        }
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
    for (name, value) in changes.chain(plan.label.iter().map(|name| (name, Some("leader")))) {
        let patch = serde_json::json!({"metadata": {"labels": {ROLE_LABEL: value}}});
        match pods
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {} // the pod is gone already
            Err(e) => return Err(e.into()),
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
    revoked: bool,
) -> Result<(), Error> {
    let status = lease.status.clone().unwrap_or_default();
    let generation = lease.metadata.generation;
    let desired = desired_conditions(lease, revoked);
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

fn desired_conditions(lease: &FencedLease, revoked: bool) -> Vec<Condition> {
    let mut conds = holding_conditions(lease, revoked);
    conds.push(handover_condition(lease));
    conds
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

fn holding_conditions(lease: &FencedLease, revoked: bool) -> Vec<Condition> {
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
            let recorded = lease
                .status
                .as_ref()
                .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Expired"))
                .is_some_and(|c| c.status == "True" && c.observed_generation == g);
            if revoked || recorded {
                vec![
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
                ]
            } else {
                vec![
                    condition("Held", false, "Free", "nobody holds the lease".into(), g),
                    condition("Expired", false, "Free", "the lease is free".into(), g),
                    condition("Released", true, "Free", "the lease is free".into(), g),
                ]
            }
        }
    }
}

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
    // The Recorder folds events with the same (reason, action, object) into one series that
    // keeps the first note; every change of holder is a distinct fact, so the token goes into
    // the action.
    let ev = Event {
        type_,
        reason: reason.into(),
        note: Some(note),
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

/// Reconcile requests for the leases whose pods changed, from one metadata-only watch of pods
/// that also keeps `ctx.pods` current.
fn pod_triggers(
    client: &Client,
    namespace: Option<&str>,
    ctx: Arc<Context>,
) -> impl futures::Stream<Item = ObjectRef<FencedLease>> + Send + 'static {
    // Metadata only: what the index reads, not the pods' specs and statuses.
    let api: Api<PartialObjectMeta<Pod>> = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    watcher(api, watcher::Config::default().any_semantic())
        .default_backoff()
        .modify(crate::pods::slim)
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

pub fn error_policy(_lease: Arc<FencedLease>, error: &Error, _ctx: Arc<Context>) -> Action {
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

fn cert_config(args: &ControllerArgs) -> Option<crate::certs::CertConfig> {
    Some(crate::certs::CertConfig {
        namespace: args.election_namespace.clone(),
        secret: args.webhook_cert_secret.clone()?,
        service: args.webhook_service.clone()?,
        configurations: args.webhook_configurations.clone(),
    })
}

/// Keeps the webhook certificate and caBundles current while this replica is active.
async fn keep_certificates(client: Client, cfg: crate::certs::CertConfig) {
    loop {
        let wait = match crate::certs::reconcile(&client, &cfg).await {
            Ok(_) => Duration::from_secs(60),
            Err(e) => {
                warn!(error = %e, "keeping the webhook certificate failed; retrying");
                Duration::from_secs(2)
            }
        };
        tokio::time::sleep(wait).await;
    }
}

/// An owner reference to the Service `name` in `namespace`, if it exists: the webhook Service
/// owns what the operator creates at run time (the certificate Secret, the election lease), so
/// that uninstalling removes those too.
pub async fn service_owner(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<Option<OwnerReference>, kube::Error> {
    let services: Api<Service> = Api::namespaced(client.clone(), namespace);
    Ok(services.get_opt(name).await?.and_then(|svc| {
        svc.metadata.uid.map(|uid| OwnerReference {
            api_version: "v1".into(),
            kind: "Service".into(),
            name: name.to_string(),
            uid,
            ..OwnerReference::default()
        })
    }))
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

/// Runs the controller: campaigns for the controller lease and reconciles while active.
pub async fn run(args: ControllerArgs) -> anyhow::Result<std::process::ExitCode> {
    let identity = args
        .identity
        .clone()
        .unwrap_or_else(crate::campaign::default_identity);
    let client = Client::try_default()
        .await
        .context("connecting to Kubernetes (set KUBECONFIG or run in a pod)")?;
    let mut registry = Registry::default();
    let metrics = ControllerMetrics::register(&mut registry);
    let ready = Arc::new(AtomicBool::new(false));
    let (stop_tx, stop_rx) = watch::channel(false);

    let health = HealthState {
        registry: Arc::new(registry),
        ready: ready.clone(),
    };
    let server = tokio::spawn(crate::metrics::serve(
        args.metrics_addr,
        health,
        crate::until_stopped(stop_rx.clone()),
    ));

    let owner = match &args.election_owner_service {
        Some(service) => match service_owner(&client, &args.election_namespace, service).await {
            Ok(Some(owner)) => Some(owner),
            Ok(None) => {
                warn!(%service, "the Service meant to own the election FencedLease does not exist: the lease will outlive the operator");
                None
            }
            Err(e) => {
                warn!(%service, error = %e, "cannot read the Service meant to own the election FencedLease (it needs get on that Service): the lease will outlive the operator");
                None
            }
        },
        None => None,
    };
    let (elector, handle) = Elector::new(
        client.clone(),
        ElectorConfig {
            namespace: args.election_namespace.clone(),
            lease: args.election_lease.clone(),
            identity: identity.clone(),
            create_with_duration: Some(15),
            create_owner: owner.clone(),
            timing_override: None,
        },
    )?;
    let elector_task = tokio::spawn(elector.run(crate::until_stopped(stop_rx.clone())));
    let ctx = Arc::new(Context::new(client.clone(), metrics, &identity));
    ready.store(true, Ordering::Relaxed);

    let mut state = handle.state.clone();
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    loop {
        // Wait until this replica leads.
        let leading = loop {
            let s = state.borrow_and_update().clone();
            if let Some(token) = s.leading_token(Instant::now()) {
                break Some(token.clone());
            }
            tokio::select! {
                r = state.changed() => if r.is_err() { break None },
                _ = sigterm.recv() => break None,
                _ = tokio::signal::ctrl_c() => break None,
            }
        };
        let Some(token) = leading else { break };
        info!(
            token = token.generation,
            "this replica is the active controller"
        );
        ctx.metrics.leading.set(1);
        if let Some(owner) = &owner {
            adopt_election_lease(
                &client,
                &args.election_namespace,
                &args.election_lease,
                owner,
            )
            .await;
        }
        // A fresh cache and pod index for every term: what an earlier term saw may be old.
        *ctx.pods.lock().unwrap_or_else(|p| p.into_inner()) = PodIndex::default();
        let (reader, writer) = reflector::store::<FencedLease>();
        let namespace = args.namespace.as_deref();
        let controller = Controller::for_stream(lease_stream(&client, namespace, writer), reader)
            .reconcile_on(pod_triggers(&client, namespace, ctx.clone()))
            .with_config(controller::Config::default().concurrency(args.concurrency))
            .shutdown_on_signal()
            .run(reconcile, error_policy, ctx.clone())
            .for_each(|res| async move {
                if let Err(e) = res {
                    tracing::debug!(error = %e, "reconcile error");
                }
            });
        tokio::pin!(controller);
        let certs_task =
            cert_config(&args).map(|cfg| tokio::spawn(keep_certificates(client.clone(), cfg)));
        // Run until leadership is lost, by event or by deadline.
        let outcome = loop {
            let s = state.borrow().clone();
            let deadline = match &s {
                LeaderState::Leading { valid_until, .. } => *valid_until,
                _ => break "lost",
            };
            tokio::select! {
                () = &mut controller => break "stopped",
                r = state.changed() => if r.is_err() { break "lost" },
                () = tokio::time::sleep_until(deadline) => {
                    if state.borrow().leading_token(Instant::now()).is_none() { break "lost" }
                }
                _ = sigterm.recv() => break "stopped",
            }
        };
        ctx.metrics.leading.set(0);
        if let Some(t) = certs_task {
            t.abort();
        }
        if outcome == "stopped" {
            break;
        }
        warn!("lost the controller lease: standing by");
    }
    info!("shutting down");
    ready.store(false, Ordering::Relaxed);
    let _ = stop_tx.send(true);
    if let Ok(Err(e)) = elector_task.await {
        warn!(error = %e, "the elector ended with an error");
    }
    match server.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => warn!(error = %e, "the metrics server failed"),
        Err(e) => warn!(error = %e, "the metrics server task failed"),
    }
    Ok(std::process::ExitCode::SUCCESS)
}
