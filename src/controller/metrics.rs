//! The controller's metrics: reconcile results, Events sent, renewal age. Labels take
//! bounded values only.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

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
    /// Policy mode only: 1 while the chart's fencing binding is there as the chart renders it.
    pub fencing_binding_intact: Option<Gauge>,
}

impl ControllerMetrics {
    pub(crate) fn register(registry: &mut Registry) -> ControllerMetrics {
        let m = ControllerMetrics {
            reconciles: Family::default(),
            reconcile_seconds: Histogram::new(exponential_buckets(0.0005, 2.0, 14)),
            lease_events: Family::default(),
            leading: Gauge::default(),
            fencing_binding_intact: None,
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
        // Every event, and a successful reconcile, counted from 0: their series exist from the
        // start. (The error classes appear with their first error.)
        for e in super::events::LeaseEvent::ALL {
            drop(
                m.lease_events
                    .get_or_create(&EventLabel { event: e.label() }),
            );
        }
        drop(m.reconciles.get_or_create(&ResultLabel { result: "ok" }));
        m
    }

    /// Policy mode: registers `fencedlease_controller_fencing_binding_intact`.
    pub(crate) fn register_policy(&mut self, registry: &mut Registry) {
        let g = Gauge::default();
        registry.register(
            "fencedlease_controller_fencing_binding_intact",
            "Policy mode, on the active controller: 1 while the chart's fencing binding exists as the chart renders it, 0 when it is missing or changed (then no lease is fenced in policy mode; helm upgrade restores it)",
            g.clone(),
        );
        self.fencing_binding_intact = Some(g);
    }
}
