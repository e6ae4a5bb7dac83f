//! `fencedlease sidecar`: campaigns for a lease beside an app and hands the app the fencing
//! token over a loopback HTTP API and a file, so that apps in any language get fenced leader
//! election.

mod memtrim;
mod proxy;
pub mod proxy_tls;
mod secret;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::Stream;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::lease::clock;
use crate::lease::elector::{Elector, ElectorHandle, LeaderState};
use crate::probe::{check_health, parse_http_url, HttpUrl};
use crate::runtime::args::{ElectionArgs, Tailor, Tailored};
use crate::sidecar::secret::ApiSecret;

/// The default port of the loopback API (`--listen 127.0.0.1:PORT`).
pub(crate) use crate::api::SIDECAR_PORT as DEFAULT_PORT;
/// The default folder of the token files (`--token-dir`); the injector mounts the token
/// volume there.
pub(crate) use crate::api::TOKEN_DIR;

/// The sidecar's election flags read the pod's own variables (the downward API's POD_NAMESPACE
/// and POD_NAME, which the injection sets).
#[derive(Debug, Clone)]
pub struct SidecarFlags;

impl Tailor for SidecarFlags {
    fn tailor(cmd: clap::Command) -> clap::Command {
        cmd.mut_arg("lease", |a| {
            a.env("FENCEDLEASE_LEASE")
                .help("Name of the FencedLease to campaign for (same namespace as the pod)")
        })
        .mut_arg("namespace", |a| a.env("POD_NAMESPACE"))
        .mut_arg("identity", |a| {
            a.env("POD_NAME")
                .help("Identity of this candidate: the pod's name")
        })
        .mut_arg("lease_duration", |a| a.env("FENCEDLEASE_LEASE_DURATION"))
    }
}

#[derive(Debug, clap::Args)]
pub struct SidecarArgs {
    #[command(flatten)]
    pub election: Tailored<ElectionArgs, SidecarFlags>,
    /// Loopback address of the sidecar API (/v1/status, /v1/token, /v1/watch, /v1/release).
    #[arg(long, env = "FENCEDLEASE_LISTEN",
          default_value_t = SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, DEFAULT_PORT)))]
    pub listen: SocketAddr,
    /// Folder for the token files: `token` and `lease-uid` exist only while leading. Any left
    /// by an earlier run are removed first at start-up; if that fails, the sidecar does not start.
    /// Also holds the pod's API secret (`api-secret`) and, with the proxy, its certificate and
    /// kubeconfig, readable by whoever can read the folder: in a pod, an emptyDir of the pod
    /// alone; elsewhere, a folder only the app's user can read.
    #[arg(
        long,
        env = "FENCEDLEASE_TOKEN_DIR",
        default_value = TOKEN_DIR
    )]
    pub token_dir: PathBuf,
    /// Make /readyz answer 200 only while this pod leads (a Service then routes to the leader).
    #[arg(long, env = "FENCEDLEASE_READY_ONLY_WHEN_LEADER")]
    pub ready_only_when_leader: bool,
    /// http:// URL of the app's health endpoint: lead only while it answers 2xx in time.
    #[arg(long, env = "FENCEDLEASE_APP_HEALTH_URL")]
    pub app_health_url: Option<String>,
    /// Consecutive failed health checks after which the lease is released.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub app_health_failures: u32,
    /// Serve a Kubernetes API proxy on this loopback address: writes get the token added, and
    /// are refused while this pod does not lead. Off unless set.
    #[arg(long, env = "FENCEDLEASE_PROXY_LISTEN")]
    pub proxy_listen: Option<SocketAddr>,
    /// Let the proxy send writes without a pin in every tenure, also after the lease was lost
    /// and acquired again before the app acknowledged the new tenure. Off: such writes are
    /// refused, because one the app decided before the loss would go out under the new token.
    #[arg(long, env = "FENCEDLEASE_PROXY_ALLOW_UNACKNOWLEDGED")]
    pub proxy_allow_unacknowledged: bool,
    /// Also serve /healthz, /readyz and /metrics (without the token; no status, no token API)
    /// on this address, for kubelet's HTTP probes and Prometheus. Unlike an exec probe, an HTTP probe of a frozen pod times out and
    /// fails, so a frozen leader turns unready. Off unless set; the injector sets [::]:PORT+2
    /// (IPv4 and IPv6; IPv4 alone where the pod has no IPv6).
    #[arg(long, env = "FENCEDLEASE_PROBE_LISTEN")]
    pub probe_listen: Option<SocketAddr>,
    /// Seconds between health checks (each may take at most this long).
    #[arg(long, default_value_t = 1.0)]
    pub app_health_interval_seconds: f64,
    /// Keep the memory that only start-up used. By default, once the sidecar has run for a
    /// while it gives back its resident pages of code and read-only data (Linux; the pages
    /// that it uses afterwards come back from the page cache), so that each pod holds about
    /// what the steady state uses.
    #[arg(long, env = "FENCEDLEASE_KEEP_STARTUP_MEMORY")]
    pub keep_startup_memory: bool,
}

/// The JSON of `/v1/status` and of each `/v1/watch` event.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Status {
    pub lease: String,
    pub namespace: String,
    pub identity: String,
    pub leading: bool,
    /// The fencing token while leading.
    pub token: Option<i64>,
    /// The lease's UID, to send with the token (fencedlease.io/lease-uid).
    #[serde(rename = "leaseUID")]
    pub lease_uid: Option<String>,
    /// The current holder as far as this sidecar knows.
    pub holder: Option<String>,
    /// While leading: milliseconds until leadership ends unless renewed.
    pub time_left_ms: Option<u64>,
    pub app_healthy: bool,
}

struct Shared {
    lease: String,
    namespace: String,
    identity: String,
    handle: ElectorHandle,
    ready_only_when_leader: bool,
    app_healthy: AtomicBool,
    /// Everything, for the loopback API's /metrics.
    registry: Arc<Registry>,
    /// Everything but the token, for the probe endpoint's /metrics (reachable on the pod IP).
    public_registry: Arc<Registry>,
    /// The tenure the app last acknowledged (the proxy's gate after a loss).
    acknowledged: crate::sidecar::proxy::Acknowledged,
}

impl Shared {
    fn status(&self, state: &LeaderState) -> Status {
        let now = clock::now();
        let (leading, token, uid, holder, left) = match state {
            LeaderState::Leading {
                token, valid_until, ..
            } if now < *valid_until => (
                true,
                Some(token.generation),
                Some(token.lease_uid.clone()),
                Some(self.identity.clone()),
                Some(u64::try_from((*valid_until - now).as_millis()).unwrap_or(u64::MAX)),
            ),
            LeaderState::Following { holder, .. } => (false, None, None, holder.clone(), None),
            _ => (false, None, None, None, None),
        };
        Status {
            lease: self.lease.clone(),
            namespace: self.namespace.clone(),
            identity: self.identity.clone(),
            leading,
            token,
            lease_uid: uid,
            holder,
            time_left_ms: left,
            app_healthy: self.app_healthy.load(Ordering::Relaxed),
        }
    }

    fn current(&self) -> Status {
        let state = self.handle.state.borrow().clone();
        self.status(&state)
    }
}

async fn status(State(s): State<Arc<Shared>>) -> Json<Status> {
    Json(s.current())
}

async fn token(State(s): State<Arc<Shared>>) -> Response {
    let st = s.current();
    match (st.token, st.lease_uid) {
        (Some(token), Some(uid)) => {
            Json(serde_json::json!({"token": token, "leaseUID": uid})).into_response()
        }
        _ => (
            StatusCode::CONFLICT,
            Json(serde_json::json!({
                "error": "not leading",
                "holder": st.holder,
            })),
        )
            .into_response(),
    }
}

/// The body of `POST /v1/acknowledge`: the token the app knows it leads with.
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Acknowledgement {
    token: i64,
    #[serde(default)]
    lease_uid: Option<String>,
}

/// The app shows it knows the tenure it leads in (after a loss, the proxy sends its unpinned
/// writes only from then on): 200 if `token` (and `leaseUID`, if sent) is the current tenure's,
/// 409 with the reason if not.
async fn acknowledge(
    State(s): State<Arc<Shared>>,
    body: Result<Json<Acknowledgement>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let Ok(Json(ack)) = body else {
        let msg = r#"send JSON {"token": N} (and optionally "leaseUID") with the token the app leads with"#;
        return (
            StatusCode::BAD_REQUEST,
            Json(serde_json::json!({"error": msg})),
        )
            .into_response();
    };
    let now = crate::sidecar::proxy::leading_now(&s.handle.state.borrow());
    match now {
        Some((t, tenure))
            if t.generation == ack.token
                && ack.lease_uid.as_ref().is_none_or(|u| *u == t.lease_uid) =>
        {
            s.acknowledged.set(tenure);
            Json(serde_json::json!({"acknowledged": t.generation, "tenure": tenure}))
                .into_response()
        }
        other => {
            let now = other.map_or("this pod does not lead".to_string(), |(t, _)| {
                format!("this pod leads with token {t}")
            });
            let msg = format!("token {} is not the current tenure's: {now}; read the token again (GET /v1/token) and decide under it", ack.token);
            (
                StatusCode::CONFLICT,
                Json(serde_json::json!({"error": msg})),
            )
                .into_response()
        }
    }
}

async fn release(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    s.handle.request_release();
    (
        StatusCode::ACCEPTED,
        Json(serde_json::json!({"releasing": true})),
    )
}

/// Ready once the lease's state is known or, with --ready-only-when-leader, while leading.
fn readiness(s: &Arc<Shared>) -> crate::runtime::admin::Readiness {
    let s = s.clone();
    crate::runtime::admin::Readiness::from_fn(move || {
        let st = s.current();
        let known = !matches!(*s.handle.state.borrow(), LeaderState::Unknown);
        if (s.ready_only_when_leader && st.leading) || (!s.ready_only_when_leader && known) {
            Ok(())
        } else if s.ready_only_when_leader {
            Err("not leading")
        } else {
            Err("lease state not known yet")
        }
    })
}

/// The sidecar's gauges and counters, registered in both registries (the token only in the
/// loopback one).
struct SidecarGauges {
    leading: Gauge<i64>,
    token: Gauge<i64>,
    health_failures: Counter,
    renewals: crate::runtime::admin::RenewalGauge,
}

/// The loopback registry, the probe endpoint's registry and the metrics in them. Every series
/// carries the lease's name (`lease`): one value per sidecar, so bounded.
fn sidecar_metrics(lease: &str) -> (Registry, Registry, SidecarGauges) {
    let label = || {
        std::iter::once((
            std::borrow::Cow::Borrowed("lease"),
            std::borrow::Cow::Owned(lease.to_string()),
        ))
    };
    let mut all = Registry::with_labels(label());
    let mut public = Registry::with_labels(label());
    let g = SidecarGauges {
        leading: Gauge::default(),
        token: Gauge::default(),
        health_failures: Counter::default(),
        renewals: crate::runtime::admin::RenewalGauge::default(),
    };
    for r in [&mut all, &mut public] {
        r.register(
            "fencedlease_sidecar_leading",
            "1 while this pod leads",
            g.leading.clone(),
        );
        r.register(
            "fencedlease_sidecar_app_health_failures",
            "Failed app health checks",
            g.health_failures.clone(),
        );
        g.renewals
            .register_in(r, "fencedlease_sidecar_last_renewal_timestamp_seconds");
    }
    all.register(
        "fencedlease_sidecar_token",
        "The fencing token while leading, else 0",
        g.token.clone(),
    );
    (all, public, g)
}

/// Server-Sent Events: the current status at once, then one event per change, including the
/// moment leadership runs out without a renewal.
async fn watch_sse(
    State(s): State<Arc<Shared>>,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let rx = s.handle.state.clone();
    let stream = futures::stream::unfold((s, rx, None::<Status>), |(s, mut rx, last)| async move {
        loop {
            let state = rx.borrow_and_update().clone();
            let st = s.status(&state);
            // Time left shrinks continuously; it is not a change worth an event.
            let unchanged = last.as_ref().is_some_and(|l| {
                Status {
                    time_left_ms: None,
                    ..l.clone()
                } == Status {
                    time_left_ms: None,
                    ..st.clone()
                }
            });
            if !unchanged {
                let data = serde_json::to_string(&st).unwrap_or_else(|_| "{}".into());
                let ev = SseEvent::default().event("status").data(data);
                return Some((Ok(ev), (s, rx, Some(st))));
            }
            let deadline = match &state {
                LeaderState::Leading { valid_until, .. } if clock::now() < *valid_until => {
                    *valid_until
                }
                _ => clock::now() + Duration::from_secs(3600),
            };
            tokio::select! {
                r = rx.changed() => if r.is_err() { return None },
                () = tokio::time::sleep_until(clock::timer_for(deadline)) => {}
            }
        }
    });
    Sse::new(stream).keep_alive(KeepAlive::default())
}

/// Keeps `token` and `lease-uid` in `dir` while leading (written atomically), removed otherwise.
async fn token_files(dir: PathBuf, mut rx: watch::Receiver<LeaderState>, stop: CancellationToken) {
    let mut written: Option<(i64, String)> = None;
    loop {
        let state = rx.borrow_and_update().clone();
        let now = clock::now();
        let want = state
            .leading_token(now)
            .map(|t| (t.generation, t.lease_uid.clone()));
        let mut retry_at = None;
        if want != written {
            let res = match &want {
                Some((token, uid)) => write_token_files(&dir, *token, uid),
                None => remove_token_files(&dir),
            };
            match res {
                Ok(()) => written = want,
                Err(e) => {
                    warn!(error = %e, dir = %dir.display(), "updating the token files failed; retrying");
                    retry_at = Some(now + TOKEN_FILES_RETRY);
                }
            }
        }
        let deadline = match &state {
            LeaderState::Leading { valid_until, .. } if now < *valid_until => *valid_until,
            _ => now + Duration::from_secs(3600),
        };
        let deadline = retry_at.map_or(deadline, |r| r.min(deadline));
        tokio::select! {
            r = rx.changed() => if r.is_err() { break },
            () = tokio::time::sleep_until(clock::timer_for(deadline)) => {}
            () = stop.cancelled() => break,
        }
    }
    if let Err(e) = remove_token_files(&dir) {
        warn!(error = %e, "removing the token files failed");
    }
}

/// The files in the token dir while leading: the token, and the lease UID to send with it.
const TOKEN_FILES: [&str; 2] = ["token", "lease-uid"];
/// Each is written to a file with this extension first, then renamed over it.
const TMP_EXTENSION: &str = "tmp";
/// How soon to try again when updating the token files failed.
const TOKEN_FILES_RETRY: Duration = Duration::from_millis(250);

fn write_atomic(path: &Path, content: &str) -> std::io::Result<()> {
    let tmp = path.with_extension(TMP_EXTENSION);
    std::fs::write(&tmp, content)?;
    std::fs::rename(&tmp, path)
}

/// A file the sidecar leaves in its token directory once it has led, and never removes: the
/// directory outlives a restart of the sidecar's container (an emptyDir), so a restarted
/// sidecar knows that the app may hold writes decided under an earlier run's tenure, and its
/// API proxy does not take its own first tenure for the app's first ([`crate::sidecar::proxy`]).
pub(crate) const LED_MARKER: &str = "led-before";

fn write_token_files(dir: &Path, token: i64, uid: &str) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let marker = dir.join(LED_MARKER);
    if !marker.exists() {
        std::fs::write(&marker, "")?;
    }
    // lease-uid first: a reader that sees the token finds the matching uid already there.
    write_atomic(&dir.join("lease-uid"), &format!("{uid}\n"))?;
    write_atomic(&dir.join("token"), &format!("{token}\n"))
}

fn remove_token_files(dir: &Path) -> std::io::Result<()> {
    for f in TOKEN_FILES {
        remove_if_present(&dir.join(f))?;
    }
    Ok(())
}

fn remove_if_present(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// A token file left by an earlier run that could not be removed at start-up.
#[derive(Debug, thiserror::Error)]
#[error(
    "removing {path}, left by an earlier run of the sidecar, failed: {source}. The app could \
     take it for leadership, so the sidecar does not start: make the token dir writable by the \
     sidecar (or remove the file), then restart it"
)]
pub(crate) struct StaleTokenFile {
    path: PathBuf,
    source: std::io::Error,
}

/// Removes the token files (and half-written ones) that an earlier run left behind: after a
/// crash, an OOM kill or a liveness restart they are still in the token dir, an emptyDir the
/// app shares, and would tell the app it leads. Runs first at start-up, before anything else
/// can fail.
pub(crate) fn clear_stale_token_files(dir: &Path) -> Result<(), StaleTokenFile> {
    for f in TOKEN_FILES {
        let file = dir.join(f);
        for path in [file.with_extension(TMP_EXTENSION), file] {
            remove_if_present(&path).map_err(|source| StaleTokenFile { path, source })?;
        }
    }
    Ok(())
}

async fn health_loop(
    url: HttpUrl,
    every: Duration,
    failures_allowed: u32,
    shared: Arc<Shared>,
    failures_metric: Counter,
) {
    let mut failures = 0u32;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if check_health(&url, every).await {
            if failures >= failures_allowed {
                info!("the app answers again: campaigning");
            }
            failures = 0;
            shared.app_healthy.store(true, Ordering::Relaxed);
            shared.handle.set_eligible(true);
        } else {
            failures = failures.saturating_add(1);
            failures_metric.inc();
            if failures == failures_allowed {
                warn!(
                    failures,
                    "the app does not answer its health check: giving up the lease"
                );
                shared.app_healthy.store(false, Ordering::Relaxed);
                shared.handle.set_eligible(false);
            }
        }
    }
}

/// Binds the probe endpoint. `[::]:PORT` (what the injector asks for) is bound dual-stack,
/// taking IPv4 and IPv6 connections whatever the pod's `net.ipv6.bindv6only`; in a pod without
/// IPv6 that fails, and `0.0.0.0:PORT` is used instead. Other addresses are bound as given.
async fn bind_probe_listener(addr: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    if addr.ip() != std::net::Ipv6Addr::UNSPECIFIED {
        return tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding the probe endpoint on {addr}"));
    }
    match dual_stack_listener(addr).and_then(tokio::net::TcpListener::from_std) {
        Ok(l) => Ok(l),
        Err(e) => {
            let v4 = SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, addr.port()));
            info!(error = %e, %v4, "no IPv6 here: the probe endpoint listens on IPv4 only");
            tokio::net::TcpListener::bind(v4)
                .await
                .with_context(|| format!("binding the probe endpoint on {addr} and on {v4}"))
        }
    }
}

/// /healthz (the alias of /livez that injected pods probe), /livez and /readyz: served on the
/// loopback API and, with the public /metrics, on the probe endpoint.
fn probe_routes<S: Clone + Send + Sync + 'static>(shared: &Arc<Shared>) -> Router<S> {
    crate::runtime::admin::health_routes(readiness(shared))
        .merge(crate::runtime::admin::healthz_alias())
}

/// An IPv6 listening socket that also accepts IPv4 (IPV6_V6ONLY off), non-blocking for tokio.
fn dual_stack_listener(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::IPV6, Type::STREAM, Some(Protocol::TCP))?;
    socket.set_only_v6(false)?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}

pub(crate) async fn run(args: SidecarArgs) -> anyhow::Result<std::process::ExitCode> {
    // First of all: until this sidecar leads, no token file may say that it does.
    clear_stale_token_files(&args.token_dir)?;
    let led_before = args.token_dir.join(LED_MARKER).exists();
    let health_url = check_args(&args)?;
    let secret = Arc::new(ApiSecret::load_or_create(&args.token_dir)?);
    let identity = args.election.identity_or_default();
    let rt = crate::runtime::Runtime::start().await?;
    let (elector, handle) = rt.candidate(&args.election, &identity)?;
    let (shared, gauges) = shared_state(&args, identity, &handle);
    let stop = rt.shutdown();
    let background = Background::start(&args, &rt, elector, &shared, gauges, health_url);
    let servers =
        Servers::start(&args, rt.client().clone(), shared, stop, led_before, secret).await?;
    if !args.keep_startup_memory {
        tokio::spawn(trim_after_startup(stop.clone()));
    }
    stop.cancelled().await;
    info!("releasing the lease");
    background.join().await;
    servers.join().await;
    Ok(std::process::ExitCode::SUCCESS)
}

/// How long after start the sidecar gives back the memory that only start-up used: by then
/// it has read its configuration, connected and campaigned at least once.
const STARTUP_TRIM_AFTER: Duration = Duration::from_secs(10);

/// Gives back start-up's pages (crate::sidecar::memtrim) once, `STARTUP_TRIM_AFTER` after start.
async fn trim_after_startup(stop: CancellationToken) {
    tokio::select! {
        _ = stop.cancelled() => return,
        _ = tokio::time::sleep(STARTUP_TRIM_AFTER) => {}
    }
    match tokio::task::spawn_blocking(crate::sidecar::memtrim::trim_startup_pages).await {
        Ok(Ok(t)) => info!(
            regions = t.regions,
            kib = t.kib,
            failed = t.failed,
            "gave back the memory that only start-up used"
        ),
        Ok(Err(e)) => debug!(error = %e, reason = e.metric_label(), "start-up memory kept"),
        Err(e) => debug!(error = %e, "start-up memory kept"),
    }
}

/// Refuses flags that would expose the token or the pod's credentials, or check the app too
/// often; returns the parsed app health URL.
fn check_args(args: &SidecarArgs) -> anyhow::Result<Option<HttpUrl>> {
    if !args.listen.ip().is_loopback() {
        anyhow::bail!(
            "--listen {} is not a loopback address: the sidecar API hands out the token and must stay inside the pod (use 127.0.0.1)",
            args.listen
        );
    }
    if let Some(p) = args.proxy_listen.filter(|p| !p.ip().is_loopback()) {
        anyhow::bail!("--proxy-listen {p} is not a loopback address: the proxy acts with the pod's credentials and must stay inside the pod");
    }
    if !args.app_health_interval_seconds.is_finite() || args.app_health_interval_seconds < 0.05 {
        anyhow::bail!("--app-health-interval-seconds must be at least 0.05");
    }
    args.app_health_url
        .as_deref()
        .map(parse_http_url)
        .transpose()
        .context("--app-health-url")
}

/// The metrics registries and what the HTTP handlers share; the gauges that the background
/// tasks set.
fn shared_state(
    args: &SidecarArgs,
    identity: String,
    handle: &ElectorHandle,
) -> (Arc<Shared>, SidecarGauges) {
    let (registry, public_registry, gauges) = sidecar_metrics(&args.election.lease);
    let shared = Arc::new(Shared {
        lease: args.election.lease.clone(),
        namespace: args.election.namespace.clone(),
        identity,
        handle: handle.clone(),
        ready_only_when_leader: args.ready_only_when_leader,
        app_healthy: AtomicBool::new(true),
        registry: Arc::new(registry),
        public_registry: Arc::new(public_registry),
        acknowledged: crate::sidecar::proxy::Acknowledged::default(),
    });
    (shared, gauges)
}

/// The tasks that run beside the servers until the stop signal: the elector, the token
/// files, and the metrics and app health check (these end with the process).
struct Background {
    elector: crate::runtime::ElectorTask,
    files: tokio::task::JoinHandle<()>,
}

impl Background {
    fn start(
        args: &SidecarArgs,
        rt: &crate::runtime::Runtime,
        elector: Elector,
        shared: &Arc<Shared>,
        gauges: SidecarGauges,
        health_url: Option<HttpUrl>,
    ) -> Self {
        let SidecarGauges {
            leading,
            token,
            health_failures,
            renewals,
        } = gauges;
        let state = shared.handle.state.clone();
        renewals.follow(state.clone());
        let elector = rt.spawn_elector(elector);
        let files = tokio::spawn(token_files(
            args.token_dir.clone(),
            state.clone(),
            rt.shutdown().clone(),
        ));
        tokio::spawn(follow_leadership(state, leading, token));
        if let Some(url) = health_url {
            let every = Duration::from_secs_f64(args.app_health_interval_seconds);
            tokio::spawn(health_loop(
                url,
                every,
                args.app_health_failures,
                shared.clone(),
                health_failures,
            ));
        }
        Background { elector, files }
    }

    /// Once shutdown has come: waits for the token files to go, then stops the elector
    /// (which releases the lease).
    async fn join(self) {
        let _ = self.files.await;
        self.elector.stop_and_warn().await;
    }
}

/// Metrics follow the state: `leading` and `token` while leading, 0 otherwise.
async fn follow_leadership(
    mut rx: watch::Receiver<LeaderState>,
    leading: Gauge<i64>,
    token_gauge: Gauge<i64>,
) {
    loop {
        let st = rx.borrow_and_update().clone();
        match st.leading_token(clock::now()) {
            Some(t) => {
                leading.set(1);
                token_gauge.set(t.generation);
            }
            None => {
                leading.set(0);
                token_gauge.set(0);
            }
        }
        if rx.changed().await.is_err() {
            break;
        }
    }
}

type ServerTask = tokio::task::JoinHandle<std::io::Result<()>>;

/// The sidecar's listening servers: the loopback API, and the proxy and the probe endpoint
/// when asked for.
struct Servers {
    api: ServerTask,
    proxy: Option<ServerTask>,
    probes: Option<ServerTask>,
}

impl Servers {
    /// Binds and serves each until `stop_rx`; a failure to bind ends the sidecar.
    async fn start(
        args: &SidecarArgs,
        client: kube::Client,
        shared: Arc<Shared>,
        stop: &CancellationToken,
        led_before: bool,
        secret: Arc<ApiSecret>,
    ) -> anyhow::Result<Self> {
        // The probe endpoint's /metrics: what a Prometheus on the pod network may scrape. The
        // token is left out: it grants nothing by itself (a write still needs RBAC rights to the
        // object, and whoever may read the FencedLease reads its generation), but nothing there
        // needs it.
        let probes = args.probe_listen.map(|addr| {
            let router = probe_routes(&shared).merge(crate::runtime::admin::metrics_route(
                shared.public_registry.clone(),
            ));
            (addr, router)
        });
        let cfg = crate::sidecar::proxy::ProxyConfig {
            state: shared.handle.state.clone(),
            lease: args.election.lease.clone(),
            namespace: args.election.namespace.clone(),
            acknowledged: shared.acknowledged.clone(),
            allow_unacknowledged: args.proxy_allow_unacknowledged,
            led_before,
            secret: secret.clone(),
        };
        let api = serve_api(args, shared, secret, stop.clone()).await?;
        let proxy = match args.proxy_listen {
            Some(addr) => Some(serve_proxy(addr, args, client, cfg, stop.clone()).await?),
            None => None,
        };
        // The probe endpoint is bound last: a native sidecar's startup probe reads it, and the app
        // starts once it answers, by when every other endpoint listens.
        let probes = match probes {
            Some((addr, router)) => Some(serve_probe_endpoint(addr, router, stop.clone()).await?),
            None => None,
        };
        Ok(Servers { api, proxy, probes })
    }

    /// Waits for each server to finish its graceful shutdown.
    async fn join(self) {
        let _ = self.api.await;
        for task in [self.proxy, self.probes].into_iter().flatten() {
            let _ = task.await;
        }
    }
}

/// The loopback API: the token, the status, their changes, the release and the metrics, for
/// requests with the pod's secret ([`crate::sidecar::secret`]); the probes for anyone.
async fn serve_api(
    args: &SidecarArgs,
    shared: Arc<Shared>,
    secret: Arc<ApiSecret>,
    stop: CancellationToken,
) -> anyhow::Result<ServerTask> {
    let app = Router::new()
        .route("/v1/status", get(status))
        .route("/v1/token", get(token))
        .route("/v1/watch", get(watch_sse))
        .route("/v1/release", post(release))
        .route("/v1/acknowledge", post(acknowledge))
        .merge(crate::runtime::admin::metrics_route(
            shared.registry.clone(),
        ))
        .route_layer(axum::middleware::from_fn_with_state(
            secret,
            crate::sidecar::secret::require,
        ))
        .merge(probe_routes(&shared))
        .with_state(shared);
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    info!(addr = %args.listen, lease = %args.election.lease, "sidecar API listening");
    Ok(tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(stop.cancelled_owned())
            .await
    }))
}

/// The Kubernetes API proxy on `addr` (see [`crate::sidecar::proxy`]), over TLS with the certificate
/// kept in the token dir, and the kubeconfig that points the app at it
/// ([`crate::sidecar::proxy_tls`]).
async fn serve_proxy(
    addr: SocketAddr,
    args: &SidecarArgs,
    client: kube::Client,
    cfg: crate::sidecar::proxy::ProxyConfig,
    stop: CancellationToken,
) -> anyhow::Result<ServerTask> {
    let tls = crate::sidecar::proxy_tls::load_or_create(&args.token_dir)?;
    let router = crate::sidecar::proxy::router(client, cfg);
    let l = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the proxy on {addr}"))?;
    let addr = l.local_addr().unwrap_or(addr);
    crate::sidecar::proxy_tls::write_kubeconfig(&args.token_dir, addr, &args.election.namespace)?;
    info!(%addr, kubeconfig = %args.token_dir.join(crate::api::PROXY_KUBECONFIG_FILE).display(),
          "Kubernetes API proxy listening (TLS)");
    Ok(tokio::spawn(crate::sidecar::proxy_tls::serve(
        l, router, tls, stop,
    )))
}

/// The probe endpoint on `addr`, within the default [`crate::runtime::admin::Limits`].
async fn serve_probe_endpoint(
    addr: SocketAddr,
    router: Router,
    stop: CancellationToken,
) -> anyhow::Result<ServerTask> {
    let l = bind_probe_listener(addr).await?;
    let addr = l.local_addr().unwrap_or(addr);
    info!(%addr, "probe endpoint (/healthz, /readyz, /metrics without the token) listening");
    let limits = crate::runtime::admin::Limits::default();
    Ok(tokio::spawn(async move {
        crate::runtime::admin::serve(l, router, limits, stop.cancelled_owned()).await;
        Ok(())
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::admin::testing::closed_within;

    /// A probe endpoint with `limits` on a free loopback port; returns its address.
    async fn probe_endpoint(limits: crate::runtime::admin::Limits) -> SocketAddr {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("address");
        let router = Router::new().route("/healthz", get(|| async { "ok" }));
        tokio::spawn(crate::runtime::admin::serve(
            l,
            router,
            limits,
            std::future::pending(),
        ));
        addr
    }

    #[tokio::test]
    async fn the_probe_endpoint_answers_and_closes_idle_and_surplus_connections() {
        let limits = crate::runtime::admin::Limits {
            max_connections: 1,
            header_timeout: Duration::from_millis(300),
            request_timeout: Duration::from_secs(5),
        };
        let addr = probe_endpoint(limits).await;
        // A probe: one request, an answer, the connection closed.
        let answer = crate::runtime::admin::testing::get(addr, "/healthz").await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("ok"), "{answer}");
        // A peer that connects and says nothing holds the only slot until the header timeout;
        // a second connection meanwhile is closed at once, unanswered.
        let mut idle = tokio::net::TcpStream::connect(addr).await.expect("connect");
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut surplus = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let refused = closed_within(&mut surplus, Duration::from_millis(200)).await;
        assert_eq!(refused.as_deref(), Some(&b""[..]), "surplus connection");
        // Closed by the header timeout (300 ms), well before the connection timeout (5 s).
        let dropped = closed_within(&mut idle, Duration::from_secs(2)).await;
        assert!(
            dropped.is_some(),
            "the idle connection was not closed by the header timeout"
        );
        // The slot is free again.
        let answer = crate::runtime::admin::testing::get(addr, "/healthz").await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }

    #[tokio::test]
    async fn the_probe_endpoint_takes_ipv4_when_asked_for_any_address() {
        // kubelet on an IPv4 pod network connects to the pod's IPv4 address: `[::]` must take
        // it (dual stack, whatever net.ipv6.bindv6only says), or be replaced by 0.0.0.0 where
        // the pod has no IPv6.
        let any: SocketAddr = "[::]:0".parse().expect("address");
        let l = bind_probe_listener(any).await.expect("bind");
        let port = l.local_addr().expect("local address").port();
        let accept = tokio::spawn(async move { l.accept().await.map(|_| ()) });
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("an IPv4 connection to the probe endpoint");
        accept.await.expect("join").expect("accept");
    }

    #[test]
    fn the_listen_and_token_dir_defaults_are_the_injectors() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: SidecarArgs,
        }
        let cli =
            <Cli as clap::Parser>::try_parse_from(["sidecar", "--lease", "l"]).expect("parse");
        assert_eq!(cli.args.listen.to_string(), "127.0.0.1:8787");
        assert_eq!(cli.args.token_dir, Path::new("/var/run/fencedlease"));
    }

    #[test]
    fn stale_token_files_are_cleared_at_start_and_nothing_else() {
        let dir = std::env::temp_dir().join(format!("fl-stale-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        for f in [
            "token",
            "lease-uid",
            "token.tmp",
            "lease-uid.tmp",
            "app-file",
        ] {
            std::fs::write(dir.join(f), "41\n").expect("write");
        }
        clear_stale_token_files(&dir).expect("clear");
        let mut left: Vec<String> = std::fs::read_dir(&dir)
            .expect("read dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["app-file"], "only the sidecar's own files go");
        clear_stale_token_files(&dir).expect("nothing to clear is fine");
        clear_stale_token_files(&dir.join("absent")).expect("no token dir yet is fine");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_stale_token_file_that_cannot_be_removed_stops_the_start_with_a_clear_error() {
        let dir = std::env::temp_dir().join(format!("fl-stuck-{}", std::process::id()));
        // A non-empty directory in the token file's place: remove_file fails even for root.
        std::fs::create_dir_all(dir.join("token").join("x")).expect("dir");
        let err = clear_stale_token_files(&dir).expect_err("must refuse to start");
        let text = err.to_string();
        assert!(
            text.contains(&dir.join("token").display().to_string()),
            "{text}"
        );
        assert!(text.contains("earlier run"), "{text}");
        assert!(text.contains("make the token dir writable"), "{text}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn token_files_appear_and_vanish() {
        let dir = std::env::temp_dir().join(format!("fl-token-{}", std::process::id()));
        write_token_files(&dir, 7, "u-1").expect("write");
        assert_eq!(
            std::fs::read_to_string(dir.join("token")).expect("token"),
            "7\n"
        );
        assert_eq!(
            std::fs::read_to_string(dir.join("lease-uid")).expect("uid"),
            "u-1\n"
        );
        remove_token_files(&dir).expect("remove");
        assert!(!dir.join("token").exists() && !dir.join("lease-uid").exists());
        remove_token_files(&dir).expect("removing twice is fine");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
