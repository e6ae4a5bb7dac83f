//! Every bound of the HTTPS server, in one struct, and the memory they add up to at worst.

use std::time::Duration;

use crate::webhook::admission;

pub(super) const KIB: usize = 1024;

pub(super) const MIB: usize = 1024 * KIB;

/// What the webhook holds with no request at all: runtime, TLS and Kubernetes clients, and the
/// FencedLease cache (without managedFields). An estimate with room: a debug build with a few
/// leases measured 32 MiB; the controller, which caches leases and pods, measured 57.6 MiB
/// with 10,000 leases.
pub(super) const BASELINE_BYTES: usize = 40 * MIB;

/// rustls state per connection, at most: the handshake message being reassembled (64 KiB),
/// decrypted plaintext not yet read (16 KiB), encrypted output (64 KiB), and keys.
pub(super) const TLS_STATE_BYTES: usize = 160 * KIB;

/// HTTP/2 framing per connection: read and write frame buffers, HPACK tables.
pub(super) const CODEC_BYTES: usize = 64 * KIB;

/// One answer in flight beyond the byte budget: an AdmissionReview response is built before
/// its size is known. Once built, it takes from the budget what its request's body did not
/// ([`answer_within`]) and holds it until sent: a /mutate patch for an ordinary pod is ~7 KiB,
/// ~1.4 KB more for each container beyond two, ~350 KB for a pod of
/// [`super::inject::MAX_APP_CONTAINERS`] containers.
pub(super) const ANSWER_BYTES: usize = 16 * KIB;

/// One request's task and service future.
pub(super) const TASK_BYTES: usize = 8 * KIB;

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
    fn connection_bytes(&self) -> usize {
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
    pub(super) fn h2_connection_window_bytes(&self) -> u32 {
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
