//! The webhook's HTTPS server: one accept loop that bounds what a client can make the webhook
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

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::Router;
use http_body_util::BodyExt as _;
use hyper::body::{Body as HttpBody, Incoming};
use hyper::service::Service as _;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use kube::core::admission::AdmissionReview;
use kube::core::DynamicObject;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::admission;

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;

/// What the webhook holds with no request at all: runtime, TLS and Kubernetes clients, and the
/// FencedLease cache (without managedFields). An estimate with room: a debug build with a few
/// leases measured 32 MiB; the controller, which caches leases and pods, measured 57.6 MiB
/// with 10,000 leases.
const BASELINE_BYTES: usize = 40 * MIB;
/// rustls state per connection, at most: the handshake message being reassembled (64 KiB),
/// decrypted plaintext not yet read (16 KiB), encrypted output (64 KiB), and keys.
const TLS_STATE_BYTES: usize = 160 * KIB;
/// HTTP/2 framing per connection: read and write frame buffers, HPACK tables.
const CODEC_BYTES: usize = 64 * KIB;
/// One answer in flight beyond the byte budget: an AdmissionReview response is built before
/// its size is known. Once built, it takes from the budget what its request's body did not
/// ([`answer_within`]) and holds it until sent: a /mutate patch for an ordinary pod is ~7 KiB,
/// ~1.4 KB more for each container beyond two, ~350 KB for a pod of
/// [`super::inject::MAX_APP_CONTAINERS`] containers.
const ANSWER_BYTES: usize = 16 * KIB;
/// One request's task and service future.
const TASK_BYTES: usize = 8 * KIB;

/// Everything the HTTPS server bounds, defined once. The defaults fit the chart's 128 MiB:
///
/// One connection can make the webhook hold at most ([`Limits::connection_bytes`]):
/// - kernel receive queue, 2 x `socket_receive_buffer_bytes` (Linux doubles SO_RCVBUF for its
///   bookkeeping; socket memory is charged to the pod's cgroup): 2 x 32 KiB = 64 KiB;
/// - TLS state, 160 KiB; HTTP/2 framing, 64 KiB;
/// - per stream (`max_concurrent_streams` = 4): its request bytes received but not yet read
///   (its receive window, 32 KiB), its headers (16 KiB), its answer (16 KiB) and its task
///   (8 KiB): 4 x 72 KiB = 288 KiB;
///
/// together 576 KiB; HTTP/1 holds less (one request at a time, headers within 16 KiB).
///
/// Worst case ([`Limits::worst_case_bytes`]), with every bound reached at once:
/// - baseline (runtime, clients, the lease cache): 40 MiB, an estimate with room;
/// - 64 connections x 576 KiB = 36 MiB;
/// - 56 connections waiting for a slot, each its kernel receive queue and its task: 56 x 72
///   KiB = 3.9 MiB;
/// - request bodies and answers: the 16 MiB budget (an answer larger than its body takes the
///   difference, [`answer_within`], and holds it until sent), and as much again for judging
///   bodies (the guard of [`read_body_bounded`] is held until the answer is sent) = 32 MiB. The parsers keep
///   to that by building only what they judge and skipping the rest as they read it: one
///   8 MiB body, whatever it holds, grows the peak RSS by at most ~12 MiB, the body included
///   (`tests/webhook_memory.rs`, `bench/webhook_memory.py`; it was ~100 MiB for tiny labels
///   at /validate, 265 MiB for empty arrays and gigabytes for empty containers at /mutate);
///
/// = 111.9 MiB, which leaves 16 MiB of the 128 MiB limit for what this does not see (the
/// [`HEADROOM_BYTES`] the tests insist on).
#[derive(Clone, Debug)]
pub struct Limits {
    /// Connections served at once. The API server calls a webhook registered by a Service (as
    /// the chart does) over HTTP/1.1, one connection per admission in flight, keeping up to 25
    /// idle; one registered by a URL over HTTP/2, on one connection (both as the webhook
    /// benchmarks measured with `fencedlease_webhook_connections_accepted`).
    pub max_connections: usize,
    /// Connections from one IP address at once: an API server's admissions in flight at this
    /// replica, beyond which its calls wait; and what one pod can take, so that it cannot take
    /// every slot from the API server.
    pub max_connections_per_peer: usize,
    /// How long a connection beyond either bound waits for a slot (before its TLS handshake)
    /// before it is closed unserved. Longer than the chart's default webhook timeouts (5 s):
    /// the API server dials a connection for an admission that finds none idle, and if one
    /// frees first it sends the admission there; a dial we close unserved fails only an
    /// admission still waiting for it, and none waits longer than its timeout. Not longer than
    /// the API server's own TLS handshake timeout (Go's 10 s, from the dial's connect, so our
    /// wait counts): by then it has given the dial up, and with a `timeoutSeconds` of 10 or
    /// more an admission waiting that long for a dial fails whatever the webhook does.
    pub slot_wait: Duration,
    /// Connections waiting for a slot at once; beyond them a connection is closed at once.
    pub max_waiting: usize,
    /// Connections of one IP address waiting at once, so that one pod cannot take every place
    /// in the queue from the API server.
    pub max_waiting_per_peer: usize,
    /// A TLS handshake not finished by then is dropped.
    pub tls_handshake_timeout: Duration,
    /// HTTP/1: a request whose headers have not all arrived this long after its first byte
    /// closes the connection. One exception: a request pipelined behind another (its first
    /// bytes arriving while that one is in flight, which the API server never does) is bounded
    /// by `idle_timeout` instead, since its bytes cannot be told from the body of the first.
    pub header_read_timeout: Duration,
    /// A connection with no request in flight for this long is told to finish. Longer than the
    /// API server's 90 s for an idle connection (Go's `IdleConnTimeout`), so that the API server
    /// closes an idle one first: a close of ours could cross a request it sends at that moment,
    /// which it would not send again (a POST) and would count as a failed call.
    pub idle_timeout: Duration,
    /// No connection lives longer: it is told to finish, however busy.
    pub max_connection_age: Duration,
    /// How long a connection that was told to finish (idle, too old, shutdown) may take to
    /// answer what it has in flight before it is dropped.
    pub shutdown_grace: Duration,
    /// HTTP/2 streams (requests) in flight on one connection.
    pub max_concurrent_streams: u32,
    /// Headers of one request: HTTP/2 header list size; HTTP/1 read buffer (which the
    /// headers must fit). At least 8 KiB (hyper's minimum for HTTP/1).
    pub max_header_bytes: u32,
    /// HTTP/2 receive window of a stream: what a client may send on it before the server
    /// reads it. The connection's window is that of all its streams together, so that streams
    /// waiting for body budget cannot use up the window of the one being read.
    pub h2_stream_window_bytes: u32,
    /// SO_RCVBUF of every accepted socket: what the kernel queues before the server reads it.
    pub socket_receive_buffer_bytes: u32,
    /// HTTP/2: a ping on a connection at this interval...
    pub h2_keep_alive_interval: Duration,
    /// ...and no answer to it within this closes the connection (a vanished peer).
    pub h2_keep_alive_timeout: Duration,
    /// The largest request body read (an AdmissionReview holds the object twice).
    pub max_body_bytes: usize,
    /// Request body bytes all requests together may buffer.
    pub body_budget_bytes: usize,
    /// A request body must have arrived whole this long after its reading began (within it,
    /// waiting for budget too).
    pub body_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 64,
            max_connections_per_peer: 48,
            slot_wait: Duration::from_secs(10),
            max_waiting: 56,
            max_waiting_per_peer: 48,
            tls_handshake_timeout: Duration::from_secs(5),
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(120),
            max_connection_age: Duration::from_secs(600),
            shutdown_grace: Duration::from_secs(10),
            max_concurrent_streams: 4,
            max_header_bytes: 16 * 1024,
            h2_stream_window_bytes: 32 * 1024,
            socket_receive_buffer_bytes: 32 * 1024,
            h2_keep_alive_interval: Duration::from_secs(20),
            h2_keep_alive_timeout: Duration::from_secs(10),
            max_body_bytes: admission::MAX_BODY_BYTES,
            body_budget_bytes: 2 * admission::MAX_BODY_BYTES,
            body_timeout: Duration::from_secs(5),
        }
    }
}

impl Limits {
    /// The most one connection can make the webhook hold, request bodies aside (see [`Limits`]).
    pub(super) fn connection_bytes(&self) -> usize {
        let per_stream = self.h2_stream_window_bytes as usize
            + self.max_header_bytes as usize
            + ANSWER_BYTES
            + TASK_BYTES;
        2 * self.socket_receive_buffer_bytes as usize
            + TLS_STATE_BYTES
            + CODEC_BYTES
            + self.max_concurrent_streams as usize * per_stream
    }

    /// The HTTP/2 receive window of a connection: the sum of its streams' windows.
    fn h2_connection_window_bytes(&self) -> u32 {
        self.h2_stream_window_bytes
            .saturating_mul(self.max_concurrent_streams.max(1))
    }

    /// The most the webhook can hold with every bound reached at once (see [`Limits`]).
    pub(super) fn worst_case_bytes(&self) -> usize {
        BASELINE_BYTES
            + self.max_connections * self.connection_bytes()
            + self.max_waiting * (2 * self.socket_receive_buffer_bytes as usize + TASK_BYTES)
            + 2 * self.body_budget_bytes
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProtocolLabel {
    protocol: &'static str,
}

/// What the server's bounds did, for Prometheus. `reason` is one of a fixed set of words.
#[derive(Clone, Debug, Default)]
pub struct ServerMetrics {
    open: Gauge,
    accepted: Family<ProtocolLabel, Counter>,
    refused: Family<ReasonLabel, Counter>,
    closed: Family<ReasonLabel, Counter>,
    buffered: Gauge,
    bodies_refused: Family<ReasonLabel, Counter>,
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

    fn closed(&self, reason: &'static str) {
        self.closed.get_or_create(&ReasonLabel { reason }).inc();
    }

    fn accepted(&self, h2: bool) {
        let protocol = if h2 { "h2" } else { "http1" };
        self.accepted
            .get_or_create(&ProtocolLabel { protocol })
            .inc();
    }

    fn refused(&self, reason: &'static str) {
        self.refused.get_or_create(&ReasonLabel { reason }).inc();
    }
}

/// Why a request body was not read; answered with [`BodyError::review`].
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("the body is larger than {max} bytes, the most this webhook reads")]
    TooLarge { max: usize },
    #[error("the body could not be read ({0}); send it again")]
    Broken(String),
    #[error("the webhook is already buffering as many request bytes as it may ({budget}); retry shortly")]
    NoBudget { budget: usize },
    #[error("the body did not arrive within {0:?}; send it faster")]
    TooSlow(Duration),
}

impl BodyError {
    /// The refusing AdmissionReview to answer with.
    pub fn review(&self) -> AdmissionReview<DynamicObject> {
        admission::unreadable(&self.to_string())
    }

    fn label(&self) -> &'static str {
        match self {
            BodyError::TooLarge { .. } => "too_large",
            BodyError::Broken(_) => "broken",
            BodyError::NoBudget { .. } => "no_budget",
            BodyError::TooSlow(_) => "too_slow",
        }
    }
}

/// The bytes all request bodies together may buffer ([`Limits::body_budget_bytes`]), shared
/// by every request; read bodies with [`read_body_bounded`].
#[derive(Clone, Debug)]
pub struct BodyBudget {
    bytes: Arc<Semaphore>,
    total: usize,
    max_body: usize,
    timeout: Duration,
    metrics: ServerMetrics,
}

impl BodyBudget {
    pub fn new(limits: &Limits, metrics: &ServerMetrics) -> BodyBudget {
        let total = limits.body_budget_bytes.min(Semaphore::MAX_PERMITS);
        BodyBudget {
            bytes: Arc::new(Semaphore::new(total)),
            total,
            max_body: limits.max_body_bytes,
            timeout: limits.body_timeout,
            metrics: metrics.clone(),
        }
    }

    /// Bytes of the budget not held by any request now.
    #[cfg(test)]
    fn available(&self) -> usize {
        self.bytes.available_permits()
    }

    /// Takes `bytes` of the budget, waiting until `deadline`.
    async fn take(&self, bytes: usize, deadline: Instant) -> Result<Held, BodyError> {
        let no_budget = BodyError::NoBudget { budget: self.total };
        let n = match u32::try_from(bytes) {
            Ok(n) if bytes <= self.total => n,
            _ => return Err(no_budget), // more than it could ever get
        };
        match tokio::time::timeout_at(deadline, self.bytes.clone().acquire_many_owned(n)).await {
            Ok(Ok(permit)) => {
                self.metrics.buffered.inc_by(i64::from(n));
                Ok(Held {
                    permit,
                    gauge: self.metrics.buffered.clone(),
                })
            }
            Ok(Err(_)) | Err(_) => Err(no_budget),
        }
    }
}

/// A part of the budget, given back when dropped.
#[derive(Debug)]
struct Held {
    permit: OwnedSemaphorePermit,
    gauge: Gauge,
}

impl Drop for Held {
    fn drop(&mut self) {
        let n = i64::try_from(self.permit.num_permits()).unwrap_or(i64::MAX);
        self.gauge.dec_by(n);
    }
}

/// The budget a read body holds; drop it when the judgement of the body is done, or hand it
/// to the answer ([`answer_within`]).
#[derive(Debug)]
pub struct BudgetGuard(Vec<Held>);

impl BudgetGuard {
    /// Bytes of the budget held (the body buffer's capacity, and what an answer added).
    pub(super) fn bytes(&self) -> usize {
        self.0.iter().map(|h| h.permit.num_permits()).sum()
    }
}

/// The answer to a request whose body holds `guard`: the guard grows to the answer's size
/// (taking the difference from the budget, waiting as a body would) and stays held until the
/// answer has been handed to the connection, so that answers count in the byte budget like
/// bodies. A /mutate answer can be ~25 times its request (a small pod with many containers
/// gets a patch per container). `Err` when no budget came in time: answer the refusal instead.
pub(super) async fn answer_within(
    answer: Vec<u8>,
    mut guard: BudgetGuard,
    budget: &BodyBudget,
) -> Result<GuardedAnswer, BodyError> {
    let more = answer.len().saturating_sub(guard.bytes());
    if more > 0 {
        let held = budget.take(more, Instant::now() + budget.timeout).await?;
        guard.0.push(held);
    }
    Ok(GuardedAnswer {
        data: Some(Bytes::from(answer)),
        _guard: guard,
    })
}

/// A response body that gives its budget back once it has been sent (or dropped).
#[derive(Debug)]
pub(super) struct GuardedAnswer {
    data: Option<Bytes>,
    _guard: BudgetGuard,
}

impl HttpBody for GuardedAnswer {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Ready(self.data.take().map(|d| Ok(hyper::body::Frame::data(d))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        let n = self.data.as_ref().map_or(0, Bytes::len);
        hyper::body::SizeHint::with_exact(n as u64)
    }
}

/// Reads a request body whole, within [`Limits::max_body_bytes`] and
/// [`Limits::body_timeout`], having first taken from the shared budget all the body may
/// become (its Content-Length, or the cap). The guard holds that budget: keep it until the
/// judgement of the body is done. Refusals ([`BodyError::review`]) say what to do next.
pub async fn read_body_bounded<B>(
    body: B,
    budget: &BodyBudget,
) -> Result<(Bytes, BudgetGuard), BodyError>
where
    B: HttpBody<Data = Bytes>,
    B::Error: std::fmt::Display,
{
    let read = read_within(body, budget).await;
    if let Err(e) = &read {
        debug!(error = %e, "refused a request body");
        budget
            .metrics
            .bodies_refused
            .get_or_create(&ReasonLabel { reason: e.label() })
            .inc();
    }
    read
}

async fn read_within<B>(body: B, budget: &BodyBudget) -> Result<(Bytes, BudgetGuard), BodyError>
where
    B: HttpBody<Data = Bytes>,
    B::Error: std::fmt::Display,
{
    let max = budget.max_body;
    if body.size_hint().lower() > max as u64 {
        return Err(BodyError::TooLarge { max });
    }
    // All the body may become (its declared length, or the cap) is taken from the budget at
    // once, before any of it is read: a request never holds part of the budget while it waits
    // for more. Taken frame by frame, requests holding part of their bodies waited on each
    // other until all their deadlines passed (32 bodies of 400 KiB on a 1 MiB budget: none
    // read). Until it has budget, the client waits on flow control (HTTP/2) or TCP (HTTP/1);
    // capacity not yet filled costs budget, not memory.
    let ceiling = body
        .size_hint()
        .exact()
        .and_then(|d| usize::try_from(d).ok())
        .map_or(max, |d| d.min(max));
    let deadline = Instant::now() + budget.timeout;
    let held = budget.take(ceiling, deadline).await?;
    let mut buf: Vec<u8> = Vec::with_capacity(ceiling);
    let mut body = std::pin::pin!(body);
    loop {
        let data = match tokio::time::timeout_at(deadline, body.as_mut().frame()).await {
            Err(_) => return Err(BodyError::TooSlow(budget.timeout)),
            Ok(None) => break,
            Ok(Some(Err(e))) => return Err(BodyError::Broken(e.to_string())),
            Ok(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) => data,
                Err(_) => continue, // trailers: not part of the review
            },
        };
        let need = buf.len() + data.len();
        if need > max {
            return Err(BodyError::TooLarge { max });
        }
        if need > ceiling {
            return Err(BodyError::Broken(format!(
                "it is longer than the {ceiling} bytes it declared"
            )));
        }
        buf.extend_from_slice(&data);
    }
    Ok((Bytes::from(buf), BudgetGuard(vec![held])))
}

/// Why the server ends a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    Idle,
    HeaderTimeout,
    MaxAge,
    Shutdown,
}

impl End {
    fn label(self) -> &'static str {
        match self {
            End::Idle => "idle",
            End::HeaderTimeout => "header_timeout",
            End::MaxAge => "max_age",
            End::Shutdown => "shutdown",
        }
    }
}

/// Completes once no request has been in flight for `timeout` (`busy` counts them).
async fn idle(busy: &mut watch::Receiver<usize>, timeout: Duration) {
    loop {
        if *busy.borrow_and_update() == 0 {
            match tokio::time::timeout(timeout, busy.changed()).await {
                Err(_) => return,
                Ok(Ok(())) => {}
                Ok(Err(_)) => std::future::pending::<()>().await, // the connection is gone
            }
        } else if busy.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Completes once a request's first bytes (`arrived`, set by [`Noted`]) are
/// `timeout` old and its headers are still not complete (no request in flight).
async fn unfinished_headers(mut arrived: watch::Receiver<Option<Instant>>, timeout: Duration) {
    loop {
        let first = *arrived.borrow_and_update();
        let changed = match first {
            Some(at) => tokio::select! {
                biased;
                changed = arrived.changed() => changed,
                _ = tokio::time::sleep_until(at + timeout) => return,
            },
            None => arrived.changed().await,
        };
        if changed.is_err() {
            std::future::pending::<()>().await; // the connection is gone
        }
    }
}

/// When (and why) the server ends a connection that began at `born`; `arrived` is for HTTP/1
/// (a request's first bytes, for the header timeout).
async fn until_end(
    mut busy: watch::Receiver<usize>,
    arrived: Option<watch::Receiver<Option<Instant>>>,
    stop: CancellationToken,
    limits: &Limits,
    born: Instant,
) -> End {
    let headers = async {
        match arrived {
            Some(a) => unfinished_headers(a, limits.header_read_timeout).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = idle(&mut busy, limits.idle_timeout) => End::Idle,
        () = headers => End::HeaderTimeout,
        _ = tokio::time::sleep_until(born + limits.max_connection_age) => End::MaxAge,
        () = stop.cancelled() => End::Shutdown,
    }
}

/// Counts a request in flight on its connection while it lives.
struct Busy(Arc<watch::Sender<usize>>);

impl Busy {
    /// A request began: its headers are complete, so no header deadline runs.
    fn enter(busy: &Arc<watch::Sender<usize>>, arrived: &watch::Sender<Option<Instant>>) -> Busy {
        busy.send_modify(|n| *n += 1);
        arrived.send_if_modified(|at| at.take().is_some());
        Busy(busy.clone())
    }
}

/// A connection's stream that notes when bytes arrive while no request is in flight: the first
/// bytes of a request, from which its headers must be complete within the header timeout. (hyper's
/// own HTTP/1 header timeout also runs while a keep-alive connection waits for its next request,
/// which closed idle connections the API server was about to use.)
struct Noted<T> {
    inner: T,
    busy: Arc<watch::Sender<usize>>,
    arrived: Arc<watch::Sender<Option<Instant>>>,
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Noted<T> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before && *self.busy.borrow() == 0 {
            self.arrived.send_if_modified(|at| {
                let first = at.is_none();
                if first {
                    *at = Some(Instant::now());
                }
                first
            });
        }
        polled
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Noted<T> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// The connection slots of each peer address: a semaphore per address, so that a slot given
/// back goes to the connection that has waited longest (tokio's semaphore is fair, and a new
/// connection's `try_acquire` cannot take a slot a waiting one was given).
#[derive(Clone, Debug)]
struct PeerSlots {
    max: usize,
    peers: Arc<Mutex<HashMap<IpAddr, Arc<Semaphore>>>>,
}

/// A peer's slot, given back when dropped.
struct PeerSlot {
    permit: Option<OwnedSemaphorePermit>,
    ip: IpAddr,
    slots: PeerSlots,
}

impl PeerSlots {
    fn new(max: usize) -> PeerSlots {
        PeerSlots {
            max,
            peers: Arc::default(),
        }
    }

    /// The semaphore of `ip`, made on first use.
    fn of(&self, ip: IpAddr) -> (IpAddr, Arc<Semaphore>) {
        let ip = ip.to_canonical(); // an IPv4 peer on a dual-stack socket is still that peer
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        let max = self.max.min(Semaphore::MAX_PERMITS);
        let sem = peers
            .entry(ip)
            .or_insert_with(|| Arc::new(Semaphore::new(max)));
        (ip, sem.clone())
    }

    fn slot(&self, ip: IpAddr, permit: OwnedSemaphorePermit) -> PeerSlot {
        PeerSlot {
            permit: Some(permit),
            ip,
            slots: self.clone(),
        }
    }

    /// A slot for `ip` now, if one is free and no connection of `ip` waits for one.
    fn take(&self, ip: IpAddr) -> Option<PeerSlot> {
        let (ip, sem) = self.of(ip);
        let permit = sem.clone().try_acquire_owned().ok();
        let slot = permit.map(|p| self.slot(ip, p));
        if slot.is_none() {
            self.forget_if_unused(ip, sem);
        }
        slot
    }

    /// A slot for `ip`, waiting (in turn) for one to be given back until `deadline`.
    async fn take_by(&self, ip: IpAddr, deadline: Instant) -> Option<PeerSlot> {
        let (ip, sem) = self.of(ip);
        let permit = tokio::time::timeout_at(deadline, sem.clone().acquire_owned()).await;
        match permit {
            Ok(Ok(p)) => Some(self.slot(ip, p)),
            _ => {
                self.forget_if_unused(ip, sem);
                None
            }
        }
    }

    /// Drops `ip`'s semaphore from the map once nobody holds or waits for a slot of it, so
    /// that the map holds only addresses with connections.
    fn forget_if_unused(&self, ip: IpAddr, sem: Arc<Semaphore>) {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        // Two references: the map's and `sem`; a waiter holds a third while it waits.
        if sem.available_permits() == self.max.min(Semaphore::MAX_PERMITS)
            && Arc::strong_count(&sem) == 2
        {
            peers.remove(&ip);
        }
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        // The semaphore outlives the permit: take it before the permit goes.
        let sem = self.permit.as_ref().map(|p| p.semaphore().clone());
        drop(self.permit.take());
        if let Some(sem) = sem {
            self.slots.forget_if_unused(self.ip, sem);
        }
    }
}

/// Where a connection gets its slots: the server's and its peer's.
#[derive(Clone)]
struct Gate {
    slots: Arc<Semaphore>,
    peers: PeerSlots,
    wait: Duration,
    open: Gauge,
}

impl Gate {
    /// Both slots at once, if both are free.
    fn now(&self, ip: IpAddr) -> Option<Slot> {
        let peer = self.peers.take(ip)?;
        let server = self.slots.clone().try_acquire_owned().ok()?;
        Some(self.slot(server, peer))
    }

    /// Both slots, waiting up to [`Limits::slot_wait`] (the peer's first), or the bound that
    /// stayed full; `Err("shutdown")` if the server stops meanwhile.
    async fn by(&self, ip: IpAddr, stop: &CancellationToken) -> Result<Slot, &'static str> {
        let deadline = Instant::now() + self.wait;
        let take = async {
            let peer = self.peers.take_by(ip, deadline).await.ok_or("peer_full")?;
            let server = tokio::time::timeout_at(deadline, self.slots.clone().acquire_owned())
                .await
                .map_err(|_| "server_full")?
                .map_err(|_| "shutdown")?;
            Ok(self.slot(server, peer))
        };
        tokio::select! {
            biased;
            _ = stop.cancelled() => Err("shutdown"),
            taken = take => taken,
        }
    }

    fn slot(&self, server: OwnedSemaphorePermit, peer: PeerSlot) -> Slot {
        self.open.inc();
        Slot {
            _server: server,
            _peer: peer,
            open: self.open.clone(),
        }
    }
}

/// What one connection holds of the server's capacity, given back when dropped.
struct Slot {
    _server: OwnedSemaphorePermit,
    _peer: PeerSlot,
    open: Gauge,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.open.dec();
    }
}

/// What every connection task shares.
struct Ctx {
    acceptor: tokio_rustls::TlsAcceptor,
    app: Router,
    h1: auto::Builder<TokioExecutor>,
    h2: auto::Builder<TokioExecutor>,
    limits: Limits,
    metrics: ServerMetrics,
}

/// The HTTP server of one protocol, with every bound of `limits` that hyper enforces.
fn http_builder(limits: &Limits, h2: bool) -> auto::Builder<TokioExecutor> {
    let mut b = auto::Builder::new(TokioExecutor::new());
    b.http1()
        .timer(TokioTimer::new())
        // Ours, from a request's first byte (`Noted`): hyper's runs on idle connections too.
        .header_read_timeout(None)
        .max_buf_size((limits.max_header_bytes as usize).max(8 * KIB))
        .keep_alive(true);
    b.http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.max_concurrent_streams)
        .max_header_list_size(limits.max_header_bytes)
        .initial_stream_window_size(limits.h2_stream_window_bytes)
        .initial_connection_window_size(limits.h2_connection_window_bytes())
        .adaptive_window(false)
        .keep_alive_interval(limits.h2_keep_alive_interval)
        .keep_alive_timeout(limits.h2_keep_alive_timeout);
    // Chosen by ALPN, not by sniffing the first bytes: a client that says nothing after the
    // handshake then meets the idle timeout.
    if h2 {
        b.http2_only()
    } else {
        b.http1_only()
    }
}

/// Serves one accepted connection within the limits; `slot` is given back when it ends.
async fn connection(
    tcp: TcpStream,
    peer: SocketAddr,
    ctx: Arc<Ctx>,
    stop: CancellationToken,
    slot: Slot,
) {
    let _slot = slot;
    if stop.is_cancelled() {
        return ctx.metrics.closed("shutdown"); // admitted after waiting, as the server stops
    }
    let born = Instant::now();
    let limits = &ctx.limits;
    let tls =
        match tokio::time::timeout(limits.tls_handshake_timeout, ctx.acceptor.accept(tcp)).await {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => {
                debug!(%peer, error = %e, "TLS handshake failed");
                return ctx.metrics.closed("tls_failed");
            }
            Err(_) => return ctx.metrics.closed("tls_timeout"),
        };
    let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2".as_slice());
    ctx.metrics.accepted(h2);
    let (busy_tx, busy_rx) = watch::channel(0usize);
    let busy = Arc::new(busy_tx);
    // HTTP/1: every request's headers, the first's too, are due within the header timeout of
    // its first byte. Until then a new connection is idle, as one between requests is: the API
    // server keeps a connection it dialled and did not need (a dial that lost the race to a
    // connection freed meanwhile) idle in its pool, and a close of ours could cross the first
    // request it sends on it, which it would not retry on a connection never used.
    let (arrived_tx, arrived_rx) = watch::channel(None);
    let arrived = Arc::new(arrived_tx);
    let io = Noted {
        inner: tls,
        busy: busy.clone(),
        arrived: arrived.clone(),
    };
    let app = TowerToHyperService::new(ctx.app.clone());
    let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let busy = Busy::enter(&busy, &arrived);
        let answer = app.call(req);
        async move {
            let answered = answer.await;
            drop(busy);
            answered
        }
    });
    let builder = if h2 { &ctx.h2 } else { &ctx.h1 };
    let conn = builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(conn);
    let arrived = (!h2).then_some(arrived_rx);
    let end = tokio::select! {
        done = conn.as_mut() => return ended(&ctx.metrics, peer, done),
        end = until_end(busy_rx, arrived, stop, limits, born) => end,
    };
    debug!(%peer, reason = end.label(), "ending the connection");
    ctx.metrics.closed(end.label());
    if matches!(end, End::HeaderTimeout) {
        return; // no request in flight: dropped at once (hyper would wait out the grace)
    }
    conn.as_mut().graceful_shutdown();
    match tokio::time::timeout(limits.shutdown_grace, conn).await {
        Ok(done) => ended(&ctx.metrics, peer, done),
        Err(_) => ctx.metrics.closed("grace_expired"),
    }
}

/// Notes how a connection ended by itself.
fn ended(
    metrics: &ServerMetrics,
    peer: SocketAddr,
    done: Result<(), Box<dyn std::error::Error + Send + Sync>>,
) {
    if let Err(e) = done {
        if e.downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_timeout)
        {
            metrics.closed("header_timeout");
        }
        debug!(%peer, error = %e, "connection ended with an error");
    }
}

/// The places in the queue for a slot: [`Limits::max_waiting`] in all,
/// [`Limits::max_waiting_per_peer`] for one address.
#[derive(Clone)]
struct Queue {
    all: Arc<Semaphore>,
    peers: PeerSlots,
}

/// A place in the queue, given back when dropped.
struct Place {
    _all: OwnedSemaphorePermit,
    _peer: PeerSlot,
}

impl Queue {
    fn new(limits: &Limits) -> Queue {
        let all = limits.max_waiting.min(Semaphore::MAX_PERMITS);
        Queue {
            all: Arc::new(Semaphore::new(all)),
            peers: PeerSlots::new(limits.max_waiting_per_peer),
        }
    }

    /// A place for a connection of `ip`, if its address and the queue have room.
    fn place(&self, ip: IpAddr) -> Option<Place> {
        let peer = self.peers.take(ip)?;
        let all = self.all.clone().try_acquire_owned().ok()?;
        Some(Place {
            _all: all,
            _peer: peer,
        })
    }
}

/// Serves an accepted connection: at once if both its slots are free; else, if the queue has a
/// place for it, once they are within [`Limits::slot_wait`]; else it is closed.
fn admit(
    tcp: TcpStream,
    peer: SocketAddr,
    gate: &Gate,
    queue: &Queue,
    ctx: &Arc<Ctx>,
    stop: CancellationToken,
) {
    if let Some(slot) = gate.now(peer.ip()) {
        tokio::spawn(connection(tcp, peer, ctx.clone(), stop, slot));
        return;
    }
    let Some(place) = queue.place(peer.ip()) else {
        return ctx.metrics.refused("queue_full"); // dropping the connection closes it
    };
    let (gate, ctx) = (gate.clone(), ctx.clone());
    tokio::spawn(async move {
        let slot = gate.by(peer.ip(), &stop).await;
        drop(place);
        match slot {
            Ok(slot) => connection(tcp, peer, ctx, stop, slot).await,
            Err(reason) => ctx.metrics.refused(reason),
        }
    });
}

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
    let queue = Queue::new(&limits);
    let ctx = Arc::new(Ctx {
        acceptor: tokio_rustls::TlsAcceptor::from(tls),
        app,
        h1: http_builder(&limits, false),
        h2: http_builder(&limits, true),
        limits,
        metrics,
    });
    let connections = CancellationToken::new();
    tokio::pin!(stop);
    loop {
        let (tcp, peer) = tokio::select! {
            _ = &mut stop => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // The API server waits on every answer: no Nagle delay on a reply that goes out in
        // more than one write (HTTP/2 headers and data frames).
        if let Err(e) = tcp.set_nodelay(true) {
            debug!(%peer, error = %e, "could not set TCP_NODELAY");
        }
        admit(tcp, peer, &gate, &queue, &ctx, connections.clone());
    }
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
    use std::pin::Pin;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::{Context, Poll};

    use futures::StreamExt as _;
    use http_body_util::{Full, StreamBody};
    use hyper::body::Frame;

    use super::*;

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

    /// The memory limit of the webhook container in the chart (`webhook.resources.limits.memory`).
    const CHART_MEMORY_LIMIT_BYTES: usize = 128 * MIB;
    /// Room left for what the arithmetic does not see (allocator fragmentation, logging, metrics).
    const HEADROOM_BYTES: usize = 16 * MIB;

    #[test]
    fn the_defaults_fit_the_charts_memory_limit_with_room() {
        let l = Limits::default();
        assert!(
            l.worst_case_bytes() + HEADROOM_BYTES <= CHART_MEMORY_LIMIT_BYTES,
            "worst case {} MiB",
            l.worst_case_bytes() / MIB
        );
        // Two bodies of the largest size can be read at once.
        assert!(l.body_budget_bytes >= 2 * l.max_body_bytes);
        // The chart's limit is the one this arithmetic is for.
        let values: serde_json::Value =
            serde_yaml_ng::from_str(include_str!("../../charts/fencedlease/values.yaml"))
                .expect("values.yaml");
        assert_eq!(values["webhook"]["resources"]["limits"]["memory"], "128Mi");
        assert_eq!(CHART_MEMORY_LIMIT_BYTES, 128 * MIB);
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

    #[tokio::test]
    async fn a_slot_given_back_goes_to_the_connection_waiting_for_it() {
        let peers = PeerSlots::new(1);
        let a: IpAddr = "10.0.0.1".parse().expect("ip");
        let held = peers.take(a).expect("a slot");
        let deadline = Instant::now() + Duration::from_secs(5);
        let waiter = tokio::spawn({
            let peers = peers.clone();
            async move { peers.take_by(a, deadline).await.is_some() }
        });
        tokio::time::sleep(Duration::from_millis(50)).await; // the waiter queues
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

    /// Whether `elapsed` is `expected`, give or take a busy machine.
    fn about(elapsed: Duration, expected: Duration) -> bool {
        elapsed >= expected && elapsed < expected + Duration::from_secs(1)
    }

    #[tokio::test]
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

    #[tokio::test]
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

    #[tokio::test]
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
            started.elapsed() >= Duration::from_millis(200),
            "it waited its turn first"
        );
        drop(hog);
        assert_eq!(budget.available(), MIB, "nothing is kept after a refusal");
    }
}
