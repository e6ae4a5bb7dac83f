//! One connection: TLS, HTTP/1.1 or HTTP/2 with hyper's bounds, and our own timeouts for
//! headers, idleness and age, through the stream wrapper `Noted`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper::service::Service as _;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::gate::Slot;
use super::limits::{Limits, KIB};
use super::metrics::ServerMetrics;

/// Why the server ends a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum End {
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
pub(super) async fn idle(busy: &mut watch::Receiver<usize>, timeout: Duration) {
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
pub(super) async fn unfinished_headers(
    mut arrived: watch::Receiver<Option<Instant>>,
    timeout: Duration,
) {
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
pub(super) async fn until_end(
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
pub(super) struct Busy(Arc<watch::Sender<usize>>);

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
pub(super) struct Noted<T> {
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

/// What every connection task shares.
pub(super) struct Ctx {
    pub(super) acceptor: tokio_rustls::TlsAcceptor,
    pub(super) app: Router,
    pub(super) h1: auto::Builder<TokioExecutor>,
    pub(super) h2: auto::Builder<TokioExecutor>,
    pub(super) limits: Limits,
    pub(super) metrics: ServerMetrics,
}

/// The HTTP server of one protocol, with every bound of `limits` that hyper enforces.
pub(super) fn http_builder(limits: &Limits, h2: bool) -> auto::Builder<TokioExecutor> {
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
pub(super) async fn connection(
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
pub(super) fn ended(
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
