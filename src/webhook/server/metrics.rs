//! The server's metrics: connections refused, closed and open, by bounded reason and protocol.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ReasonLabel {
    pub(super) reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ProtocolLabel {
    protocol: &'static str,
}

/// What the server's bounds did, for Prometheus. `reason` is one of a fixed set of words.
#[derive(Clone, Debug, Default)]
pub struct ServerMetrics {
    pub(super) open: Gauge,
    pub(super) waiting: Gauge,
    accepted: Family<ProtocolLabel, Counter>,
    refused: Family<ReasonLabel, Counter>,
    closed: Family<ReasonLabel, Counter>,
    pub(super) buffered: Gauge,
    pub(super) bodies_refused: Family<ReasonLabel, Counter>,
}

impl ServerMetrics {
    pub fn register(r: &mut Registry) -> ServerMetrics {
        let m = ServerMetrics::default();
        r.register(
            "fencedlease_webhook_connections_open",
            "HTTPS connections being served",
            m.open.clone(),
        );
        r.register(
            "fencedlease_webhook_connections_waiting",
            "Connections accepted and waiting for a slot (at most the server's max waiting)",
            m.waiting.clone(),
        );
        r.register(
            "fencedlease_webhook_connections_accepted",
            "Connections whose TLS handshake completed, by the protocol ALPN chose: h2 or http1",
            m.accepted.clone(),
        );
        r.register(
            "fencedlease_webhook_connections_refused",
            "Connections closed unserved: server_full or peer_full (no slot freed within the slot wait: max connections reached, max connections from that address), queue_full (closed at once: as many wait as may, in all or from that address), shutdown (the server stopped while it waited)",
            m.refused.clone(),
        );
        r.register(
            "fencedlease_webhook_connections_closed",
            "Connections the server ended by a bound: tls_timeout, tls_failed, header_timeout, idle, max_age, shutdown; and grace_expired when one of those was then dropped with requests still in flight",
            m.closed.clone(),
        );
        r.register(
            "fencedlease_webhook_body_bytes_held",
            "Bytes of the request body budget held now by bodies being read or judged (at most the budget)",
            m.buffered.clone(),
        );
        r.register(
            "fencedlease_webhook_bodies_refused",
            "Request bodies refused: too_large, broken, no_budget (the budget stayed spent), too_slow",
            m.bodies_refused.clone(),
        );
        m
    }

    pub(super) fn closed(&self, reason: &'static str) {
        self.closed.get_or_create(&ReasonLabel { reason }).inc();
    }

    pub(super) fn accepted(&self, h2: bool) {
        let protocol = if h2 { "h2" } else { "http1" };
        self.accepted
            .get_or_create(&ProtocolLabel { protocol })
            .inc();
    }

    pub(super) fn refused(&self, reason: &'static str) {
        self.refused.get_or_create(&ReasonLabel { reason }).inc();
    }
}
