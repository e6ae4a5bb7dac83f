//! The webhook's HTTPS server: the runtime's accept loop with a gate that bounds what a client can make the webhook
//! hold (connections, time, bytes), so that a flood from any pod can neither push it past its
//! memory limit nor stop it answering the API server.
//!
//! - Connections: at most [`Limits::max_connections`] at once and
//!   [`Limits::max_connections_per_peer`] from one IP address. A connection beyond either waits
//!   up to [`Limits::slot_wait`] for a slot (at most [`Limits::max_waiting`] wait at once,
//!   [`Limits::max_waiting_per_peer`] of one address), and is closed unserved if none frees: the
//!   API server calls a webhook registered by a Service (as the chart registers it) over
//!   HTTP/1.1, one connection per admission in flight, so a burst must become a wait, not failed
//!   writes (a dial it sees closed fails the call that waits for it).
//! - Time: a TLS handshake, a request's headers, a request's body, an idle connection and any
//!   connection at all each have a deadline; at the last two the connection is told to finish
//!   (HTTP/2 GOAWAY, HTTP/1 close after the answer) and is dropped after a grace period.
//! - Bytes: the protocol is chosen by ALPN (`h2`, else HTTP/1.1); HTTP/2 streams, header sizes
//!   and receive windows are capped; and request bodies are read with [`read_body_bounded`],
//!   which first takes all a body may become from one byte budget shared by all requests.

mod body;
mod conn;
mod gate;
mod limits;
mod metrics;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::runtime::accept::accept_until;
pub(super) use body::answer_within;
pub use body::{read_body_bounded, BodyBudget, BodyError, BudgetGuard};
use conn::{http_builder, Ctx};
use gate::{admit, Gate, PeerSlots, Queue};
pub use limits::Limits;
use limits::MIB;
pub use metrics::ServerMetrics;

/// Binds the HTTPS listener, every accepted socket with the receive buffer of `limits`.
pub fn bind(addr: SocketAddr, limits: &Limits) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.set_recv_buffer_size(limits.socket_receive_buffer_bytes)?;
    socket.bind(addr)?;
    socket.listen(1024)
}

/// Serves `app` over TLS on `listener` within `limits` until `stop` completes; then tells every
/// connection to finish and waits for them (at most the handshake timeout and the grace).
pub async fn serve(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    app: Router,
    limits: Limits,
    metrics: ServerMetrics,
    stop: impl Future<Output = ()>,
) {
    let max = limits.max_connections.min(Semaphore::MAX_PERMITS);
    let slots = Arc::new(Semaphore::new(max));
    let gate = Gate {
        slots: slots.clone(),
        peers: PeerSlots::new(limits.max_connections_per_peer),
        wait: limits.slot_wait,
        open: metrics.open.clone(),
    };
    let queue = Queue::new(&limits, metrics.waiting.clone());
    let ctx = Arc::new(Ctx {
        acceptor: tokio_rustls::TlsAcceptor::from(tls),
        app,
        h1: http_builder(&limits, false),
        h2: http_builder(&limits, true),
        limits,
        metrics,
    });
    let connections = CancellationToken::new();
    accept_until(&listener, "webhook", stop, |tcp, peer| {
        admit(tcp, peer, &gate, &queue, &ctx, connections.clone());
        std::future::ready(())
    })
    .await;
    drop(listener);
    let open = max - slots.available_permits();
    info!(open, "stopped accepting; finishing the open connections");
    connections.cancel();
    let all = u32::try_from(max).unwrap_or(u32::MAX);
    let wait = ctx
        .limits
        .tls_handshake_timeout
        .max(ctx.limits.shutdown_grace);
    if tokio::time::timeout(wait, slots.acquire_many(all))
        .await
        .is_err()
    {
        let left = max - slots.available_permits();
        warn!(left, "connections still open at shutdown are dropped");
    }
}

#[derive(Debug, thiserror::Error)]
pub(super) enum ServeError {
    #[error("binding {addr}: {source} (is another process listening there?)")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// Binds `addr` and serves `app` within `limits` until `stop` is cancelled (the runtime
/// cancels it on SIGTERM or SIGINT).
pub(super) async fn serve_until(
    addr: SocketAddr,
    tls: Arc<rustls::ServerConfig>,
    app: Router,
    limits: Limits,
    metrics: ServerMetrics,
    stop: CancellationToken,
) -> Result<(), ServeError> {
    let listener = bind(addr, &limits).map_err(|source| ServeError::Bind { addr, source })?;
    info!(
        %addr,
        max_connections = limits.max_connections,
        worst_case_mib = limits.worst_case_bytes() / MIB,
        "serving admission reviews over HTTPS at /validate"
    );
    serve(listener, tls, app, limits, metrics, stop.cancelled_owned()).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;
    use std::pin::Pin;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::{Context, Poll};
    use std::time::Duration;

    use axum::body::Bytes;
    use futures::StreamExt as _;
    use http_body_util::BodyExt as _;
    use http_body_util::{Full, StreamBody};
    use hyper::body::Body as HttpBody;
    use hyper::body::Frame;
    use tokio::time::Instant;

    use super::*;
    use super::{body::*, gate::*, limits::*, metrics::*};

    type Frames = Pin<Box<dyn futures::Stream<Item = Result<Frame<Bytes>, String>> + Send>>;

    /// A body of `frames` frames of `size` bytes, one every `every`, declaring its length or not.
    fn trickle(frames: usize, size: usize, every: Duration, declare: bool) -> Sized_ {
        let stream: Frames = Box::pin(futures::stream::iter(0..frames).then(move |_| async move {
            tokio::time::sleep(every).await;
            Ok(Frame::data(Bytes::from(vec![b'x'; size])))
        }));
        Sized_ {
            inner: StreamBody::new(stream),
            declared: declare.then_some((frames * size) as u64),
        }
    }

    /// A stream body with a declared length (as hyper gives one for a Content-Length).
    struct Sized_ {
        inner: StreamBody<Frames>,
        declared: Option<u64>,
    }

    impl HttpBody for Sized_ {
        type Data = Bytes;
        type Error = String;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, String>>> {
            Pin::new(&mut self.inner).poll_frame(cx)
        }
        fn size_hint(&self) -> hyper::body::SizeHint {
            self.declared.map_or_else(
                hyper::body::SizeHint::default,
                hyper::body::SizeHint::with_exact,
            )
        }
    }

    /// Bytes taken off bodies and not yet given back, and the most there ever were.
    #[derive(Default)]
    struct Meter {
        now: AtomicUsize,
        peak: AtomicUsize,
    }

    /// A body that adds every byte taken from it to a meter (and to its own tally).
    struct Counted<B> {
        inner: B,
        meter: Arc<Meter>,
        tally: Arc<AtomicUsize>,
    }

    impl<B: HttpBody<Data = Bytes> + Unpin> HttpBody for Counted<B> {
        type Data = Bytes;
        type Error = B::Error;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
            let polled = Pin::new(&mut self.inner).poll_frame(cx);
            if let Poll::Ready(Some(Ok(f))) = &polled {
                let n = f.data_ref().map_or(0, Bytes::len);
                self.tally.fetch_add(n, Ordering::SeqCst);
                let now = self.meter.now.fetch_add(n, Ordering::SeqCst) + n;
                self.meter.peak.fetch_max(now, Ordering::SeqCst);
            }
            polled
        }
        fn size_hint(&self) -> hyper::body::SizeHint {
            self.inner.size_hint()
        }
    }

    fn limits(budget: usize, max_body: usize, timeout: Duration) -> Limits {
        Limits {
            body_budget_bytes: budget,
            max_body_bytes: max_body,
            body_timeout: timeout,
            ..Limits::default()
        }
    }

    /// A Kubernetes memory quantity in the binary units the chart uses ("128Mi", "1Gi").
    fn quantity_bytes(q: &str) -> usize {
        let (n, unit) = q.split_at(q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len()));
        let n: usize = n
            .parse()
            .unwrap_or_else(|_| panic!("not a quantity: {q:?}"));
        match unit {
            "Ki" => n << 10,
            "Mi" => n << 20,
            "Gi" => n << 30,
            other => panic!("unit {other:?} of {q:?}: give the chart's limit in Ki, Mi or Gi"),
        }
    }
    /// Room left for what the arithmetic does not see (allocator fragmentation, logging, metrics).
    const HEADROOM_BYTES: usize = 16 * MIB;

    #[test]
    fn the_defaults_fit_the_charts_memory_limit_with_room() {
        let l = Limits::default();
        // The memory limit of the webhook container in the chart.
        let values: serde_json::Value =
            serde_yaml_ng::from_str(include_str!("../../../charts/fencedlease/values.yaml"))
                .expect("values.yaml");
        let limit = values["webhook"]["resources"]["limits"]["memory"]
            .as_str()
            .expect("webhook.resources.limits.memory");
        assert!(
            l.worst_case_bytes() + HEADROOM_BYTES <= quantity_bytes(limit),
            "worst case {} MiB (+{} MiB of headroom) does not fit the chart's limit {limit}",
            l.worst_case_bytes() / MIB,
            HEADROOM_BYTES / MIB
        );
        assert_eq!(quantity_bytes("128Mi"), 128 * MIB);
        // Two bodies of the largest size can be read at once.
        assert!(l.body_budget_bytes >= 2 * l.max_body_bytes);
        // A waiting dial outlasts the admission it was made for, by default, and not the API
        // server's TLS handshake timeout (see `slot_wait`).
        for hook in ["fencing", "injection"] {
            let timeout = values[hook]["timeoutSeconds"]
                .as_u64()
                .expect("timeoutSeconds");
            assert!(l.slot_wait > Duration::from_secs(timeout), "{hook}");
        }
        assert!(l.slot_wait <= Duration::from_secs(10));
        assert!(l.max_waiting_per_peer < l.max_waiting);
    }

    #[test]
    fn each_peer_address_gets_its_own_slots() {
        let peers = PeerSlots::new(2);
        let a: IpAddr = "10.0.0.1".parse().expect("ip");
        let a6: IpAddr = "::ffff:10.0.0.1".parse().expect("ip");
        let b: IpAddr = "10.0.0.2".parse().expect("ip");
        let first = peers.take(a).expect("a slot");
        let second = peers.take(a6).expect("a slot"); // the same peer, seen over IPv6
        assert!(peers.take(a).is_none(), "a third connection from one peer");
        assert!(peers.take(b).is_some(), "another peer");
        drop(first);
        assert!(peers.take(a).is_some(), "a slot given back");
        drop(second);
        assert!(peers.peers.lock().expect("lock").is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_slot_given_back_goes_to_the_connection_waiting_for_it() {
        let peers = PeerSlots::new(1);
        let a: IpAddr = "10.0.0.1".parse().expect("ip");
        let held = peers.take(a).expect("a slot");
        let deadline = Instant::now() + Duration::from_secs(5);
        let waiter = tokio::spawn({
            let peers = peers.clone();
            async move { peers.take_by(a, deadline).await.is_some() }
        });
        // Paused time: this sleep ends only once every other task waits, the waiter in the
        // queue.
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(held);
        // A new connection from the same address does not jump the queue.
        assert!(
            peers.take(a).is_none(),
            "a newcomer took the slot a waiter was owed"
        );
        assert!(waiter.await.expect("waiter"), "the waiter got no slot");
        assert!(peers.peers.lock().expect("lock").is_empty());
    }

    #[tokio::test]
    async fn a_body_is_read_whole_within_its_declared_length() {
        let budget = BodyBudget::new(&Limits::default(), &ServerMetrics::default());
        let body = Full::new(Bytes::from_static(b"{\"kind\":\"AdmissionReview\"}"));
        let (bytes, first) = read_body_bounded(body, &budget).await.expect("read");
        assert_eq!(&bytes[..], b"{\"kind\":\"AdmissionReview\"}");
        assert_eq!(first.bytes(), bytes.len());
        let (bytes, guard) = read_body_bounded(trickle(100, 1000, Duration::ZERO, false), &budget)
            .await
            .expect("read");
        assert_eq!(bytes.len(), 100_000);
        // No length declared: it took all a body may be, once it began to arrive.
        assert_eq!(guard.bytes(), Limits::default().max_body_bytes);
        drop((guard, first));
        assert_eq!(budget.available(), Limits::default().body_budget_bytes);
    }

    #[tokio::test]
    async fn too_large_bodies_are_refused_declared_or_not() {
        let budget = BodyBudget::new(
            &limits(MIB, 64 * KIB, Duration::from_secs(5)),
            &ServerMetrics::default(),
        );
        let declared = read_body_bounded(trickle(65, KIB, Duration::ZERO, true), &budget).await;
        assert!(matches!(declared, Err(BodyError::TooLarge { max }) if max == 64 * KIB));
        let streamed = read_body_bounded(trickle(65, KIB, Duration::ZERO, false), &budget).await;
        assert!(matches!(streamed, Err(BodyError::TooLarge { .. })));
        let fits = read_body_bounded(trickle(64, KIB, Duration::ZERO, false), &budget).await;
        assert_eq!(fits.expect("64 KiB fits").0.len(), 64 * KIB);
        assert_eq!(budget.available(), MIB);
    }

    /// Whether `elapsed` is `expected`. The tests that call it run on paused time (tokio's
    /// test clock, which jumps to the next timer whenever every task waits), so the timing is
    /// the code's own, exact and the same on a busy machine; within a millisecond for the
    /// rounding of timer wheels.
    fn about(elapsed: Duration, expected: Duration) -> bool {
        elapsed >= expected && elapsed <= expected + Duration::from_millis(1)
    }

    #[tokio::test(start_paused = true)]
    async fn a_trickled_body_is_refused_when_its_time_is_up() {
        let metrics = ServerMetrics::default();
        let timeout = Duration::from_millis(300);
        let budget = BodyBudget::new(&limits(MIB, 64 * KIB, timeout), &metrics);
        let started = Instant::now();
        let slow =
            read_body_bounded(trickle(60, 1, Duration::from_millis(50), true), &budget).await;
        assert!(matches!(slow, Err(BodyError::TooSlow(_))), "{slow:?}");
        assert!(about(started.elapsed(), timeout), "{:?}", started.elapsed());
        assert_eq!(budget.available(), MIB);
        let review = slow.expect_err("an error").review();
        let resp = review.response.expect("a response");
        assert!(!resp.allowed);
        assert!(
            resp.result.message.contains("did not arrive within 300ms"),
            "{}",
            resp.result.message
        );
        assert_eq!(
            metrics
                .bodies_refused
                .get_or_create(&ReasonLabel { reason: "too_slow" })
                .get(),
            1
        );
        assert_eq!(metrics.buffered.get(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_cannot_get_budget_is_refused_at_its_deadline() {
        let timeout = Duration::from_millis(300);
        let budget = BodyBudget::new(
            &limits(64 * KIB, 32 * KIB, timeout),
            &ServerMetrics::default(),
        );
        let mut held = Vec::new();
        for _ in 0..4 {
            let body = trickle(16, KIB, Duration::ZERO, true);
            held.push(read_body_bounded(body, &budget).await.expect("16 KiB").1);
        }
        assert_eq!(budget.available(), 0);
        let started = Instant::now();
        let starved = read_body_bounded(trickle(1, KIB, Duration::ZERO, true), &budget).await;
        assert!(
            matches!(starved, Err(BodyError::NoBudget { .. })),
            "{starved:?}"
        );
        assert!(about(started.elapsed(), timeout), "{:?}", started.elapsed());
        held.pop();
        let fed = read_body_bounded(trickle(1, KIB, Duration::ZERO, true), &budget).await;
        assert_eq!(fed.expect("budget given back").0.len(), KIB);
    }

    /// One request of the parallel test: reads, holds its body a while, gives it all back.
    async fn judge(body: Sized_, budget: BodyBudget, meter: Arc<Meter>) -> Result<(), BodyError> {
        let tally = Arc::new(AtomicUsize::new(0));
        let counted = Counted {
            inner: body,
            meter: meter.clone(),
            tally: tally.clone(),
        };
        let read = read_body_bounded(counted, &budget).await;
        if let Ok((_bytes, _guard)) = &read {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // No await between the budget given back and the meter: exact on this one thread.
        meter
            .now
            .fetch_sub(tally.load(Ordering::SeqCst), Ordering::SeqCst);
        read.map(|_| ())
    }

    /// Reads `n` bodies of 400 KiB (16 KiB frames) at once on a 1 MiB budget; returns how
    /// many were read and the most bytes taken off them at once.
    async fn read_in_parallel(n: usize, declare: bool) -> (usize, usize) {
        let budget = BodyBudget::new(
            &limits(MIB, 512 * KIB, Duration::from_secs(5)),
            &ServerMetrics::default(),
        );
        let meter = Arc::new(Meter::default());
        let reads: Vec<_> = (0..n)
            .map(|_| {
                let body = trickle(25, 16 * KIB, Duration::from_millis(1), declare);
                tokio::spawn(judge(body, budget.clone(), meter.clone()))
            })
            .collect();
        let mut ok = 0;
        for r in reads {
            match r.await.expect("join") {
                Ok(()) => ok += 1,
                Err(BodyError::NoBudget { .. } | BodyError::TooSlow(_)) => {}
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(budget.available(), MIB, "budget not given back");
        assert_eq!(meter.now.load(Ordering::SeqCst), 0);
        (ok, meter.peak.load(Ordering::SeqCst))
    }

    #[tokio::test]
    async fn parallel_bodies_never_take_more_bytes_than_the_budget() {
        // As the API server sends them: with a Content-Length. All are read, in turn.
        let (ok, peak) = read_in_parallel(32, true).await;
        assert!(
            peak <= MIB,
            "{peak} bytes taken at once, over the 1 MiB budget"
        );
        assert!(
            peak > MIB / 2,
            "the test did not press on the budget: peak {peak}"
        );
        assert_eq!(ok, 32, "bodies with a declared length wait their turn");
        // Without: each takes the cap (512 KiB) before reading, so two are read at a time.
        let (ok, peak) = read_in_parallel(8, false).await;
        assert!(
            peak <= MIB,
            "{peak} bytes taken at once, over the 1 MiB budget"
        );
        assert_eq!(ok, 8, "bodies of unknown length wait their turn too");
    }

    #[tokio::test]
    async fn an_answer_larger_than_its_body_takes_the_difference_until_it_is_sent() {
        let budget = BodyBudget::new(
            &limits(MIB, 512 * KIB, Duration::from_millis(200)),
            &ServerMetrics::default(),
        );
        let (_, guard) = read_body_bounded(trickle(1, KIB, Duration::ZERO, true), &budget)
            .await
            .expect("read");
        assert_eq!(budget.available(), MIB - KIB);
        // A 350 KiB patch for a 1 KiB pod: the answer holds its own size, not the body's.
        let answer = answer_within(vec![b'x'; 350 * KIB], guard, &budget)
            .await
            .expect("budget for the answer");
        assert_eq!(budget.available(), MIB - 350 * KIB);
        let mut body = Box::pin(answer);
        let frame = body.as_mut().frame().await.expect("a frame").expect("data");
        assert_eq!(frame.into_data().map(|d| d.len()).ok(), Some(350 * KIB));
        assert!(body.as_mut().frame().await.is_none());
        drop(body);
        assert_eq!(budget.available(), MIB, "the answer gave its budget back");
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_that_cannot_get_budget_in_time_is_refused() {
        let budget = BodyBudget::new(
            &limits(MIB, 512 * KIB, Duration::from_millis(200)),
            &ServerMetrics::default(),
        );
        let (_, small) = read_body_bounded(trickle(1, KIB, Duration::ZERO, true), &budget)
            .await
            .expect("read");
        let (_, hog) = read_body_bounded(trickle(1, 512 * KIB, Duration::ZERO, true), &budget)
            .await
            .expect("read");
        let started = Instant::now();
        let refused = answer_within(vec![b'x'; 600 * KIB], small, &budget).await;
        assert!(
            matches!(refused, Err(BodyError::NoBudget { .. })),
            "{refused:?}"
        );
        assert!(
            about(started.elapsed(), Duration::from_millis(200)),
            "it waited its turn first: {:?}",
            started.elapsed()
        );
        drop(hog);
        assert_eq!(budget.available(), MIB, "nothing is kept after a refusal");
    }
}
