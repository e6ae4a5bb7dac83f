//! The admin endpoints every role serves: `/livez`, `/readyz` (from a [`Readiness`]) and
//! `/metrics` (OpenMetrics text), plus the small bounded HTTP/1 server that serves them on their
//! own port. The routes are generic over the router's state, so a role can also merge them into
//! a router of its own (the webhook's HTTPS port, the sidecar's loopback API).
//!
//! Also here: the renewal gauge that every elected role exports ([`RenewalGauge`]).

use std::future::Future;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::accept::accept_until;
use crate::lease::elector::LeaderState;

/// The content type of `/metrics`.
pub(crate) const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Whether a role is ready: `Ok` or the reason it is not (the body of a 503 on `/readyz`).
#[derive(Clone)]
pub(crate) struct Readiness(Arc<dyn Fn() -> Result<(), &'static str> + Send + Sync>);

impl Readiness {
    /// Readiness decided by `check` at each request.
    pub(crate) fn from_fn(
        check: impl Fn() -> Result<(), &'static str> + Send + Sync + 'static,
    ) -> Self {
        Readiness(Arc::new(check))
    }

    pub(crate) fn check(&self) -> Result<(), &'static str> {
        (self.0)()
    }
}

impl std::fmt::Debug for Readiness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Readiness").field(&self.check()).finish()
    }
}

/// `/livez` and `/readyz`.
pub(crate) fn health_routes<S: Clone + Send + Sync + 'static>(ready: Readiness) -> Router<S> {
    Router::new()
        .route("/livez", get(live))
        .route("/readyz", get(move || readyz(ready.clone())))
}

/// `/healthz`, the sidecar's name for `/livez` that pods injected before keep probing.
pub(crate) fn healthz_alias<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new().route("/healthz", get(live))
}

/// `/metrics`: `registry` as OpenMetrics text.
pub(crate) fn metrics_route<S: Clone + Send + Sync + 'static>(
    registry: Arc<Registry>,
) -> Router<S> {
    Router::new().route("/metrics", get(move || metrics(registry.clone())))
}

async fn live() -> &'static str {
    "ok"
}

async fn readyz(ready: Readiness) -> (StatusCode, &'static str) {
    match ready.check() {
        Ok(()) => (StatusCode::OK, "ok"),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why),
    }
}

async fn metrics(registry: Arc<Registry>) -> Response {
    encode(&registry)
}

/// `registry` as an OpenMetrics answer (500 if it cannot be encoded).
pub(crate) fn encode(registry: &Registry) -> Response {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, registry) {
        Ok(()) => ([(header::CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE)], body).into_response(),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            "encoding metrics failed\n",
        )
            .into_response(),
    }
}

/// What a client of an admin server can make it hold.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Connections served at once; more are closed at once (a probe or a scrape is one each).
    pub max_connections: usize,
    /// A connection that has not sent its request headers by then is closed.
    pub header_timeout: Duration,
    /// No connection lives longer (one request each: no keep-alive).
    pub request_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 32,
            header_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
        }
    }
}

/// Serves `router` on `listener` (HTTP/1, one request per connection) within `limits` until
/// `stop` completes. Connections still open then finish within `limits.request_timeout`.
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    limits: Limits,
    stop: impl Future<Output = ()>,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(
        limits
            .max_connections
            .min(tokio::sync::Semaphore::MAX_PERMITS),
    ));
    accept_until(&listener, "admin", stop, |tcp, _| {
        // Full: dropping the connection closes it (a probe or a scrape retries).
        if let Ok(slot) = slots.clone().try_acquire_owned() {
            let service = hyper_util::service::TowerToHyperService::new(router.clone());
            tokio::spawn(async move {
                let _slot = slot;
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(limits.header_timeout)
                    .keep_alive(false)
                    .serve_connection(hyper_util::rt::TokioIo::new(tcp), service);
                let _ = tokio::time::timeout(limits.request_timeout, conn).await;
            });
        }
        std::future::ready(())
    })
    .await;
}

/// A gauge of Unix time in seconds.
pub(crate) type TimestampGauge = Gauge<f64, AtomicU64>;

/// Did the elector's state move from `prev` to `next` by a renewal (or an acquisition)? Each
/// successful renewal publishes a new validity, so a Leading state whose validity differs from
/// the previous one is a renewal that succeeded.
pub(crate) fn is_renewal(prev: &LeaderState, next: &LeaderState) -> bool {
    match (prev, next) {
        (
            LeaderState::Leading {
                valid_until: a,
                token: t,
                tenure: n,
            },
            LeaderState::Leading {
                valid_until: b,
                token: u,
                tenure: m,
            },
        ) => a != b || t != u || n != m,
        (_, LeaderState::Leading { .. }) => true,
        _ => false,
    }
}

/// `<role>_last_renewal_timestamp_seconds`: the Unix time of the latest successful
/// acquisition or renewal of this process's lease (0 until the first). The alert "a leader
/// stopped renewing" is `time() - this > lease duration` on a process that still leads.
#[derive(Clone, Debug, Default)]
pub(crate) struct RenewalGauge(TimestampGauge);

impl RenewalGauge {
    #[cfg(feature = "operator")]
    pub(crate) fn register(registry: &mut Registry, name: &str) -> RenewalGauge {
        let g = RenewalGauge::default();
        g.register_in(registry, name);
        g
    }

    /// Registers this gauge (also) in `registry`, as `name`.
    pub(crate) fn register_in(&self, registry: &mut Registry, name: &str) {
        registry.register(
            name,
            "Unix time of this process's latest successful acquisition or renewal of its lease (0: none yet)",
            self.0.clone(),
        );
    }

    /// Follows an elector's state until its channel closes.
    pub(crate) fn follow(self, mut state: tokio::sync::watch::Receiver<LeaderState>) {
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

/// Plain-TCP HTTP helpers for the unit tests of this server and of the servers built on it.
#[cfg(test)]
pub(crate) mod testing {
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Reads until the server closes the connection (or `within` passes: then None).
    pub(crate) async fn closed_within(
        s: &mut tokio::net::TcpStream,
        within: Duration,
    ) -> Option<Vec<u8>> {
        let mut buf = Vec::new();
        tokio::time::timeout(within, s.read_to_end(&mut buf))
            .await
            .ok()
            .map(|_| buf)
    }

    /// GET `path` on a new connection; the whole answer, once the server has closed it.
    pub(crate) async fn get(addr: std::net::SocketAddr, path: &str) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
            .await
            .expect("write");
        let answer = closed_within(&mut s, Duration::from_secs(5))
            .await
            .expect("the connection closed after the answer");
        String::from_utf8_lossy(&answer).into_owned()
    }
}

#[cfg(all(test, feature = "operator"))]
mod tests {
    use super::testing::{closed_within, get};
    use super::*;
    use crate::lease::rules::FencingToken;
    use crate::runtime::admin_port::{bind, router, ReadyFlag};
    use prometheus_client::metrics::counter::Counter;
    use std::net::SocketAddr;
    use tokio::time::Instant;
    use tokio_util::sync::CancellationToken;

    fn leading(token: i64, until: Instant) -> LeaderState {
        LeaderState::Leading {
            token: FencingToken {
                lease_uid: "u".into(),
                generation: token,
            },
            valid_until: until,
            tenure: 1,
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

    /// An admin server on a free loopback port with `limits`; its address, its stop, and the
    /// task that serves it (done once the listener is closed).
    async fn admin(
        limits: Limits,
        ready: Readiness,
    ) -> (SocketAddr, CancellationToken, tokio::task::JoinHandle<()>) {
        let l = bind("127.0.0.1:0".parse().expect("address"))
            .await
            .expect("bind");
        let addr = l.local_addr().expect("address");
        let mut registry = Registry::default();
        let c: Counter = Counter::default();
        c.inc();
        registry.register("test_things", "Things", c);
        let app = router(ready, Arc::new(registry)).merge(healthz_alias());
        let stop = CancellationToken::new();
        let task = tokio::spawn(serve(l, app, limits, stop.clone().cancelled_owned()));
        (addr, stop, task)
    }

    #[tokio::test]
    async fn readyz_follows_the_readiness_handle_and_livez_always_answers() {
        let flag = ReadyFlag::default();
        let (addr, _stop, _) = admin(Limits::default(), flag.readiness()).await;
        let answer = get(addr, "/readyz").await;
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        assert!(answer.ends_with("not ready"), "{answer}");
        flag.set(true);
        let answer = get(addr, "/readyz").await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        flag.set(false);
        assert!(get(addr, "/readyz").await.starts_with("HTTP/1.1 503"));
        for path in ["/livez", "/healthz"] {
            let answer = get(addr, path).await;
            assert!(answer.starts_with("HTTP/1.1 200"), "{path}: {answer}");
        }
        assert!(get(addr, "/nothing").await.starts_with("HTTP/1.1 404"));
    }

    #[tokio::test]
    async fn a_readiness_closure_gives_its_reason() {
        let ready = Readiness::from_fn(|| Err("lease cache not synced"));
        let (addr, _stop, _) = admin(Limits::default(), ready).await;
        let answer = get(addr, "/readyz").await;
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        assert!(answer.ends_with("lease cache not synced"), "{answer}");
    }

    #[tokio::test]
    async fn metrics_are_openmetrics_text() {
        let (addr, _stop, _) = admin(Limits::default(), ReadyFlag::default().readiness()).await;
        let answer = get(addr, "/metrics").await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        let wanted = format!("content-type: {OPENMETRICS_CONTENT_TYPE}\r\n");
        assert!(answer.to_lowercase().contains(&wanted), "{answer}");
        assert!(answer.contains("test_things_total 1"), "{answer}");
        assert!(answer.ends_with("# EOF\n"), "{answer}");
    }

    #[tokio::test]
    async fn idle_and_surplus_connections_are_closed_and_stop_ends_the_server() {
        // A connection lives an hour at most: one closed sooner was closed by the header
        // timeout. The waits below are only bounds on the events awaited.
        let limits = Limits {
            max_connections: 1,
            header_timeout: Duration::from_millis(300),
            request_timeout: Duration::from_secs(3600),
        };
        let (addr, stop, task) = admin(limits, ReadyFlag::default().readiness()).await;
        // A client that never sends its headers holds the one slot until the header timeout.
        // The server accepts in the order connections were made, so it takes the slot before
        // the surplus connection below is accepted.
        let mut idle = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let mut surplus = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let closed = closed_within(&mut surplus, Duration::from_secs(60)).await;
        assert_eq!(
            closed,
            Some(Vec::new()),
            "the surplus connection is closed unanswered"
        );
        assert_eq!(
            closed_within(&mut idle, Duration::from_secs(60)).await,
            Some(Vec::new()),
            "the idle connection is closed by the header timeout, unanswered"
        );
        // The slot is free again.
        assert!(get(addr, "/livez").await.starts_with("HTTP/1.1 200"));
        stop.cancel();
        task.await.expect("the server's task");
        let refused = tokio::net::TcpStream::connect(addr).await;
        assert!(refused.is_err(), "the listener is closed once stopped");
    }
}
