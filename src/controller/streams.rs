//! The watch streams that drive reconciles: the leases, and the pods that campaign for them.

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client};
use tracing::warn;

use super::reconcile::{note_asked, Context};
use crate::api::FencedLease;

/// FencedLeases as the controller caches them: without managedFields, which are most of a
/// lease's size in memory and never read here. (A replace made from a cached lease keeps the
/// server's managedFields: an update without them leaves them as they are.) Every version the
/// watch delivers passes `note_asked`, so a handover asked for is known even when the reconciles
/// of the lease coalesce past it.
pub(super) fn lease_stream(
    client: &Client,
    namespace: Option<&str>,
    writer: reflector::store::Writer<FencedLease>,
    ctx: Arc<Context>,
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
        .inspect(move |lease| {
            if let Ok(lease) = lease {
                note_asked(&ctx, lease);
            }
        })
}

/// Reconcile requests for the leases whose pods changed, from one watch of pods that also keeps
/// `ctx.pods` current.
pub(super) fn pod_triggers(
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
