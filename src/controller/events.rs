//! Kubernetes Events about a lease: sent once per change, counted by reason.

use kube::runtime::events::{Event, EventType};
use kube::Resource;
use tracing::warn;

use super::error::bounded_note;
use super::metrics::EventLabel;
use super::reconcile::Context;
use crate::api::FencedLease;

/// A change of a lease that the controller counts, by the `event` label of
/// `fencedlease_lease_events_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum LeaseEvent {
    /// Someone took the lease (from nobody, or from another holder).
    Acquired,
    /// The preferred holder took the lease over (a handover).
    HandedOver,
    /// The holder gave the lease up.
    Released,
    /// The controller revoked a lease its holder stopped renewing.
    Revoked,
    /// The controller revoked a lease whose holder is known dead.
    RevokedHolderDead,
}

impl LeaseEvent {
    /// Every event: the controller counts each from 0 at its start.
    pub(super) const ALL: [LeaseEvent; 5] = [
        LeaseEvent::Acquired,
        LeaseEvent::HandedOver,
        LeaseEvent::Released,
        LeaseEvent::Revoked,
        LeaseEvent::RevokedHolderDead,
    ];

    pub(super) fn label(self) -> &'static str {
        match self {
            LeaseEvent::Acquired => "acquired",
            LeaseEvent::HandedOver => "handover",
            LeaseEvent::Released => "released",
            LeaseEvent::Revoked => "revoked",
            LeaseEvent::RevokedHolderDead => "revoked_holder_dead",
        }
    }
}

/// Publishes an Event about a lease change and counts it in `fencedlease_lease_events`.
pub(super) async fn publish(
    ctx: &Context,
    lease: &FencedLease,
    type_: EventType,
    reason: &str,
    note: String,
    event: LeaseEvent,
) {
    ctx.metrics
        .lease_events
        .get_or_create(&EventLabel {
            event: event.label(),
        })
        .inc();
    publish_event(ctx, lease, type_, reason, note).await;
}

/// Publishes an Event on the lease; a failure is logged, never returned.
pub(super) async fn publish_event(
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
