//! One reconcile of one FencedLease: revoke an expired or dead holder, move the leader label,
//! keep the policy binding, write status. `reconcile` hands each step to a small method of
//! `LeaseReconcile`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{EventType, Recorder, Reporter};
use kube::{Api, Client, ResourceExt};
use tokio::time::Instant;
use tracing::{debug, info, instrument, warn};

use super::conditions::{
    desired_conditions, fenced_condition, merge_conditions, same_conditions, NOT_FENCED,
};
use super::error::Error;
use super::events::{publish, publish_event, LeaseEvent};
use super::metrics::{ControllerMetrics, ResultLabel};
use crate::api::{lease_of, LEADER_ROLE};
use crate::api::{Condition, FencedLease, FIELD_MANAGER, ROLE_LABEL};
use crate::controller::holder::{holder_death, may_revoke_again, Death, HolderPod};
use crate::controller::pods::{pod_state, PodIndex};
use crate::lease::elector::{activity_of, observer_duration};
use crate::lease::rules::{
    controller_decision, lease_seconds, ControllerAction, Mono, Observation,
};
use crate::lease::Revocation;

/// What the controller remembers of a lease between reconciliations.
#[derive(Clone, Debug)]
pub(super) struct Seen {
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
pub(super) enum Cause {
    /// The holder did not renew within the lease duration.
    Expired,
    /// The holder was known dead before its lease ran out.
    HolderDead(Death),
}

/// State handed to `reconcile` and `error_policy`.
pub(crate) struct Context {
    pub(super) client: Client,
    pub(super) recorder: Recorder,
    pub(super) metrics: ControllerMetrics,
    pub(super) origin: Instant,
    pub(super) seen: Mutex<HashMap<String, Seen>>,
    /// Pods that belong to leases, fed by a watch of pods (see `crate::controller::pods`).
    pub(super) pods: Mutex<PodIndex>,
    /// The namespaces the fencing leaves out, when known (`--unfenced-namespace`).
    pub(super) unfenced: Option<std::collections::BTreeSet<String>>,
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
            unfenced: None,
        }
    }

    /// Knows which namespaces the fencing leaves out (none given: it does not know).
    pub(crate) fn with_unfenced(mut self, namespaces: &[String]) -> Context {
        self.unfenced = (!namespaces.is_empty()).then(|| namespaces.iter().cloned().collect());
        self
    }
}

pub(super) fn key(lease: &FencedLease) -> String {
    format!(
        "{}/{}/{}",
        lease.namespace().unwrap_or_default(),
        lease.name_any(),
        lease.metadata.uid.as_deref().unwrap_or_default()
    )
}

/// How soon a lease whose leader label could not be moved is looked at again (absent other
/// changes). Revocation and status never wait for the label.
pub(super) const LABEL_RETRY: Duration = Duration::from_secs(5);

/// How soon a revocation that lost a race (the lease changed meanwhile) is looked at again.
pub(super) const REVOKE_RACE_RETRY: Duration = Duration::from_millis(50);

#[instrument(skip_all, fields(lease = %lease.name_any(), ns = ?lease.namespace()))]
pub(crate) async fn reconcile(lease: Arc<FencedLease>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    let outcome = match LeaseReconcile::new(&lease, &ctx) {
        Ok(mut r) => run_steps(&mut r).await,
        Err(e) => Outcome {
            next: Err(e),
            label: Ok(()),
        },
    };
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
pub(super) enum Next {
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
pub(super) trait Steps {
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
pub(super) struct Outcome {
    next: Result<Next, Error>,
    label: Result<(), Error>,
}

/// Revocation and status first, then Events, then the label; each runs whatever the others
/// came to.
pub(super) async fn run_steps(steps: &mut impl Steps) -> Outcome {
    let next = steps.expiry().await;
    steps.announce().await;
    let label = steps.label().await;
    Outcome { next, label }
}

impl Outcome {
    /// The reconciles metric's result: the expiry part's error, else the label's, else ok.
    pub(super) fn metric_label(&self) -> &'static str {
        match (&self.next, &self.label) {
            (Err(e), _) | (Ok(_), Err(e)) => e.metric_label(),
            (Ok(_), Ok(())) => "ok",
        }
    }

    /// What the runtime gets: the expiry part's error (so `error_policy` retries it), else its
    /// next look, brought forward to retry a label that failed (already reported).
    pub(super) fn into_result(self) -> Result<Action, Error> {
        let next = self.next?;
        Ok(match self.label {
            Ok(()) => next.action(),
            Err(_) => next.within(LABEL_RETRY).action(),
        })
    }
}

/// What the controller's memory said about a lease when a reconciliation began.
pub(super) struct Observed {
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
pub(super) fn remember(ctx: &Context, key: &str, lease: &FencedLease, mono: Mono) -> Observed {
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

/// Notes a handover asked for (`spec.preferredHolder`) as the watch delivers it, before any
/// reconcile runs: reconciles of one lease coalesce, so a reconcile may see the holder before the
/// ask and the preferred holder after it (ask, release, acquire within milliseconds) and would
/// otherwise call the handover an acquisition. An ask is forgotten when a version without one
/// names another holder (the ask was withdrawn, or someone else acquired): the preferred holder
/// taking the lease later is then an acquisition. Only a lease this controller has looked at
/// before is noted (without a previous look there is no change to name); the next look that sees
/// a new holder reads it, as it reads a preferredHolder it saw itself.
pub(super) fn note_asked(ctx: &Context, lease: &FencedLease) {
    let asked = lease
        .spec
        .preferred_holder
        .as_deref()
        .filter(|p| !p.is_empty());
    let holder = lease.holder();
    let mut seen = ctx.seen.lock().unwrap_or_else(|p| p.into_inner());
    let Some(s) = seen.get_mut(&key(lease)) else {
        return;
    };
    match (asked, holder) {
        (Some(asked), _) => s.preferred = Some(asked.to_string()),
        (None, Some(h)) if s.preferred.as_deref() != Some(h) => s.preferred = None,
        _ => {}
    }
}

/// One reconciliation of one lease.
pub(super) struct LeaseReconcile<'a> {
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
                LeaseEvent::Revoked,
            ),
            Cause::HolderDead(death) => (
                death.reason(),
                format!(
                    "{}: revoked without waiting out the lease, token now {token}",
                    death.note(holder)
                ),
                LeaseEvent::RevokedHolderDead,
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
            debug!(%holder, "revoked for its death less than a lease duration ago: waited out this time");
            return Ok(None);
        }
        let lease_name = self.lease.name_any();
        let known = {
            let index = self.ctx.pods.lock().unwrap_or_else(|p| p.into_inner());
            index.holder_pod(&self.ns, &lease_name, holder)
        };
        if holder_death(self.lease, known).is_none() {
            debug!(%holder, ?known, "the holder gives no sign of death (or the lease opts out): waited out");
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
pub(super) fn holder_change(
    prev: Option<&str>,
    holder: Option<&str>,
    handover: bool,
    token: i64,
) -> (&'static str, String, LeaseEvent) {
    match (prev, holder) {
        (_, Some(h)) if handover => (
            "HandedOver",
            format!("{h}, the preferred holder, took the lease over with token {token}"),
            LeaseEvent::HandedOver,
        ),
        (Some(p), Some(h)) => (
            "Acquired",
            format!("{h} took the lease over from {p} with token {token}"),
            LeaseEvent::Acquired,
        ),
        (None, Some(h)) => (
            "Acquired",
            format!("{h} acquired the lease with token {token}"),
            LeaseEvent::Acquired,
        ),
        (Some(p), None) => (
            "Released",
            format!("{p} no longer holds the lease; token now {token}"),
            LeaseEvent::Released,
        ),
        (None, None) => (
            "Released",
            "the lease is free".to_string(),
            LeaseEvent::Released,
        ),
    }
}

/// Moves the `fencedlease.io/role: leader` label to the holder's pod, if the holder is a pod of
/// this lease (annotated `fencedlease.io/lease: <lease>`): the old holder's label comes off
/// first, so that two pods never carry it at once. Decided from the pod index; a request is made
/// only for a label that has to change. Until the index has listed every pod it does nothing
/// (the complete list then brings every lease with pods back here).
pub(super) async fn move_leader_label(
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
pub(super) async fn write_status(
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
