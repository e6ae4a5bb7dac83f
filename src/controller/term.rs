//! The controller's own election: only the replica that leads reconciles, for as long as its
//! term lasts.

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::runtime::controller::{self, Controller};
use kube::runtime::reflector;
use kube::Client;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use super::args::ControllerArgs;
use super::reconcile::{error_policy, reconcile, Context};
use super::streams::{lease_stream, pod_triggers};
use super::{adopt_election_lease, cert_config, keep_certificates, keep_policy_mode};
use crate::api::FencedLease;
use crate::controller::pods::PodIndex;
use crate::lease::elector::LeaderState;
use crate::lease::rules::FencingToken;

/// How a term as the active controller ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum TermEnd {
    /// Leadership ended, by news from the elector or by its deadline: stand by.
    Lost,
    /// The controller was told to stop (or its reconciler ended): shut down.
    Stopped,
}

/// What a term ends on, as far as the elector's state says: None while it leads, else the end.
pub(super) fn term_end_of(state: &LeaderState, now: Instant) -> Option<TermEnd> {
    state.leading_token(now).is_none().then_some(TermEnd::Lost)
}

/// What every term as the active controller needs.
pub(super) struct Active<'a> {
    pub(super) args: &'a ControllerArgs,
    pub(super) client: &'a Client,
    pub(super) ctx: &'a Arc<Context>,
    pub(super) owner: Option<&'a OwnerReference>,
    pub(super) shutdown: &'a CancellationToken,
}

/// One term as the active controller: from the moment this replica leads with `token`.
pub(super) struct Term<'a> {
    active: &'a Active<'a>,
    token: FencingToken,
}

impl<'a> Active<'a> {
    /// Waits until this replica leads; None on shutdown or when the elector is gone.
    pub(super) async fn next_term(
        &'a self,
        state: &mut watch::Receiver<LeaderState>,
    ) -> Option<Term<'a>> {
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
    /// Reconciles (and keeps the certificates) until the term ends.
    pub(super) async fn lead(&self, state: &mut watch::Receiver<LeaderState>) -> TermEnd {
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
        let policy_task = args.fencing_policy.clone().map(|p| {
            let intact = ctx.metrics.fencing_binding_intact.clone();
            let period = std::time::Duration::from_secs(args.fencing_policy_check_seconds);
            tokio::spawn(keep_policy_mode(client.clone(), p, intact, period))
        });
        // Policy mode keeps the lease index; webhook mode takes its finalizer off the leases.
        let role = match args.fencing_policy {
            Some(_) => super::index::Role::Keep,
            None => super::index::Role::Release,
        };
        let scope = super::index::Scope {
            namespace: args.namespace.clone(),
            role,
            own_lease: (args.election_namespace.clone(), args.election_lease.clone()),
        };
        let index_task = Some(tokio::spawn(super::index::keep_index(
            client.clone(),
            scope,
        )));
        let namespace = args.namespace.as_deref();
        let controller =
            Controller::for_stream(lease_stream(client, namespace, writer, ctx.clone()), reader)
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
        for t in [certs_task, policy_task, index_task].into_iter().flatten() {
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
