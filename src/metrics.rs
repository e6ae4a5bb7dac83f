//! Prometheus metrics with bounded label values only (never object names or error text),
//! and the small HTTP server that serves them with `/livez` and `/readyz`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

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

use crate::lease::elector::LeaderState;

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

/// A gauge of Unix time in seconds.
pub type TimestampGauge = Gauge<f64, AtomicU64>;

/// Did the elector's state move from `prev` to `next` by a renewal (or an acquisition)? Each
/// successful renewal publishes a new validity, so a Leading state whose validity differs from
/// the previous one is a renewal that succeeded.
pub fn is_renewal(prev: &LeaderState, next: &LeaderState) -> bool {
    match (prev, next) {
        (
            LeaderState::Leading {
                valid_until: a,
                token: t,
            },
            LeaderState::Leading {
                valid_until: b,
                token: u,
            },
        ) => a != b || t != u,
        (_, LeaderState::Leading { .. }) => true,
        _ => false,
    }
}

/// `<role>_last_renewal_timestamp_seconds`: the Unix time of the latest successful
/// acquisition or renewal of this process's lease (0 until the first). The alert "a leader
/// stopped renewing" is `time() - this > lease duration` on a process that still leads.
#[derive(Clone, Debug, Default)]
pub struct RenewalGauge(TimestampGauge);

impl RenewalGauge {
    pub fn register(registry: &mut Registry, name: &str) -> RenewalGauge {
        let g = RenewalGauge::default();
        g.register_in(registry, name);
        g
    }

    /// Registers this gauge (also) in `registry`, as `name`.
    pub fn register_in(&self, registry: &mut Registry, name: &str) {
        registry.register(
            name,
            "Unix time of this process's latest successful acquisition or renewal of its lease (0: none yet)",
            self.0.clone(),
        );
    }

    /// Follows an elector's state until its channel closes.
    pub fn follow(self, mut state: tokio::sync::watch::Receiver<LeaderState>) {
        tokio::spawn(async move {
            let mut prev = LeaderState::Unknown;
            loop {
                let next = state.borrow_and_update().clone();
                if is_renewal(&prev, &next) {
                    let now = SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .unwrap_or_default();
                    self.0.set(now.as_secs_f64());
                }
                prev = next;
                if state.changed().await.is_err() {
                    break;
                }
            }
        });
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::rules::FencingToken;
    use tokio::time::{Duration, Instant};

    fn leading(token: i64, until: Instant) -> LeaderState {
        LeaderState::Leading {
            token: FencingToken {
                lease_uid: "u".into(),
                generation: token,
            },
            valid_until: until,
        }
    }

    #[test]
    fn a_renewal_is_a_new_validity_or_a_new_term() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(2);
        let follow = LeaderState::Following {
            holder: Some("b".into()),
            token: Some(3),
        };
        let cases = [
            (LeaderState::Unknown, leading(1, t0), true, "acquired"),
            (follow.clone(), leading(4, t0), true, "took over"),
            (leading(4, t0), leading(4, t1), true, "renewed"),
            (leading(4, t0), leading(5, t0), true, "a new term"),
            (
                leading(4, t0),
                leading(4, t0),
                false,
                "the same state again",
            ),
            (leading(4, t0), follow.clone(), false, "lost"),
            (LeaderState::Unknown, follow, false, "following"),
        ];
        for (prev, next, want, what) in cases {
            assert_eq!(is_renewal(&prev, &next), want, "{what}");
        }
    }
}
