//! Prometheus metrics with bounded label values only (never object names or error text),
//! and the small HTTP server that serves them with `/livez` and `/readyz`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventLabel {
    pub event: &'static str,
}

/// The controller's metrics.
pub struct ControllerMetrics {
    pub reconciles: Family<ResultLabel, Counter>,
    pub reconcile_seconds: Histogram,
    pub lease_events: Family<EventLabel, Counter>,
    pub leading: Gauge,
}

impl ControllerMetrics {
    pub fn register(registry: &mut Registry) -> ControllerMetrics {
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

/// Shared state of the health and metrics server.
#[derive(Clone)]
pub struct HealthState {
    pub registry: Arc<Registry>,
    pub ready: Arc<AtomicBool>,
}

/// Serves `/metrics`, `/livez` and `/readyz` until `shutdown` completes.
pub async fn serve(
    addr: SocketAddr,
    state: HealthState,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/livez", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(%addr, "serving /metrics, /livez and /readyz");
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

async fn metrics(State(s): State<HealthState>) -> impl IntoResponse {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &s.registry) {
        Ok(()) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        ),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            "encoding metrics failed\n".to_string(),
        ),
    }
}

async fn readyz(State(s): State<HealthState>) -> impl IntoResponse {
    if s.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready")
    }
}
