//! `fencedlease webhook`: the admission webhook that makes the API server refuse writes to
//! protected objects that carry a stale (or missing, malformed, forged) fencing token.
//!
//! It answers from a watch cache of FencedLeases and confirms with a fresh read before any
//! refusal a lagging cache could explain. It is never on the path of FencedLease renewals:
//! its configuration lists only the protected resource types.

pub mod admission;
pub mod inject;
pub mod server;
pub mod tls;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use base64::Engine as _;
use futures::StreamExt;
use kube::core::admission::AdmissionReview;
use kube::core::DynamicObject;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::api::FencedLease;
use crate::fencing::LeaseView;
use crate::metrics::HealthState;
use admission::{Judgement, Parsed, MAX_BODY_BYTES};
use tls::{CertFiles, ReloadingCert};

/// How long a confirming read of a lease may take before the webhook refuses (fail closed).
const FRESH_READ_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, clap::Args)]
pub struct WebhookArgs {
    /// Address of the HTTPS admission server (the API server calls /validate here).
    #[arg(
        long,
        env = "FENCEDLEASE_WEBHOOK_ADDR",
        default_value = "127.0.0.1:8443"
    )]
    pub listen: SocketAddr,
    /// PEM serving certificate (chain). Reloaded when it changes.
    #[arg(long, env = "FENCEDLEASE_TLS_CERT")]
    pub tls_cert: PathBuf,
    /// PEM private key. Reloaded when it changes.
    #[arg(long, env = "FENCEDLEASE_TLS_KEY")]
    pub tls_key: PathBuf,
    /// How often to check the certificate files for changes, in seconds.
    #[arg(long, default_value_t = 2)]
    pub tls_reload_seconds: u64,
    /// Address of the plain-HTTP /metrics, /livez and /readyz server.
    #[arg(
        long,
        env = "FENCEDLEASE_METRICS_ADDR",
        default_value = "127.0.0.1:9091"
    )]
    pub metrics_addr: SocketAddr,
    /// Image of the injected sidecar (served at /mutate).
    #[arg(
        long,
        env = "FENCEDLEASE_SIDECAR_IMAGE",
        default_value = "fencedlease:0.1.0"
    )]
    pub sidecar_image: String,
    /// imagePullPolicy of the injected sidecar.
    #[arg(long, default_value = "IfNotPresent", value_parser = ["Always", "IfNotPresent", "Never"])]
    pub sidecar_image_pull_policy: String,
}

#[derive(Debug, clap::Args)]
pub struct CertsArgs {
    /// Folder to write ca.crt, ca.key, tls.crt and tls.key into.
    #[arg(long)]
    pub out: PathBuf,
    /// DNS names or IP addresses the serving certificate is for (repeat the flag).
    #[arg(long = "host", required = true)]
    pub hosts: Vec<String>,
    /// Re-issue the serving certificate with the CA already in --out (a rotation).
    #[arg(long)]
    pub reuse_ca: bool,
}

/// `fencedlease certs`: a local CA and serving certificate; prints the caBundle.
pub fn certs(args: CertsArgs) -> anyhow::Result<std::process::ExitCode> {
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let ca = if args.reuse_ca {
        let c = std::fs::read_to_string(args.out.join("ca.crt"))
            .context("--reuse-ca: reading ca.crt")?;
        let k = std::fs::read_to_string(args.out.join("ca.key"))
            .context("--reuse-ca: reading ca.key")?;
        Some((c, k))
    } else {
        None
    };
    let g = tls::generate(
        &args.hosts,
        ca.as_ref().map(|(c, k)| (c.as_str(), k.as_str())),
    )?;
    tls::write_atomic(&args.out.join("ca.crt"), &g.ca_cert)?;
    tls::write_atomic(&args.out.join("ca.key"), &g.ca_key)?;
    tls::write_atomic(&args.out.join("tls.key"), &g.key)?;
    tls::write_atomic(&args.out.join("tls.crt"), &g.cert)?;
    println!(
        "{}",
        base64::engine::general_purpose::STANDARD.encode(g.ca_cert.as_bytes())
    );
    Ok(std::process::ExitCode::SUCCESS)
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

/// The webhook's metrics. `result` is one of a fixed set of words.
struct WebhookMetrics {
    admissions: Family<ResultLabel, Counter>,
    injections: Family<ResultLabel, Counter>,
    seconds: Histogram,
    fresh_reads: Counter,
}

impl WebhookMetrics {
    fn register(r: &mut Registry) -> WebhookMetrics {
        let m = WebhookMetrics {
            admissions: Family::default(),
            injections: Family::default(),
            seconds: Histogram::new(exponential_buckets(0.000005, 2.0, 20)),
            fresh_reads: Counter::default(),
        };
        r.register(
            "fencedlease_webhook_admissions",
            "Admission decisions: allowed, denied_stale, denied_missing, denied_malformed, denied_future, denied_free, denied_no_lease, warned, passed, invalid, error",
            m.admissions.clone(),
        );
        r.register(
            "fencedlease_webhook_injections",
            "Pod admissions at /mutate: injected, skipped, refused (bad annotations), invalid",
            m.injections.clone(),
        );
        r.register(
            "fencedlease_webhook_admission_seconds",
            "Time to decide one admission request, inside the server",
            m.seconds.clone(),
        );
        r.register(
            "fencedlease_webhook_fresh_reads",
            "Reads of a lease made to confirm a refusal a lagging cache could explain",
            m.fresh_reads.clone(),
        );
        m
    }
}

struct Shared {
    client: Client,
    inject: inject::InjectConfig,
    store: Store<FencedLease>,
    metrics: WebhookMetrics,
    ready: Arc<AtomicBool>,
}

fn view(l: &FencedLease) -> Option<LeaseView> {
    Some(LeaseView {
        uid: l.metadata.uid.clone()?,
        generation: l.metadata.generation?,
        holder: l.holder().map(str::to_string),
    })
}

impl Shared {
    /// Decides one protected write: from the cache, confirmed by a fresh read when needed.
    async fn judge(
        &self,
        j: &Judgement,
    ) -> (kube::core::admission::AdmissionResponse, &'static str) {
        let key = ObjectRef::<FencedLease>::new(&j.lease_name).within(&j.namespace);
        let cached = self.store.get(&key).and_then(|l| view(&l));
        let w = j.attempt();
        match crate::fencing::decide(&w, cached.as_ref()) {
            crate::fencing::Verdict::Allow => (j.response.clone(), "allowed"),
            crate::fencing::Verdict::Refuse(r) if !r.may_be_cache_lag() => admission::refuse(j, &r),
            crate::fencing::Verdict::Refuse(_) => {
                self.metrics.fresh_reads.inc();
                let api: Api<FencedLease> = Api::namespaced(self.client.clone(), &j.namespace);
                match tokio::time::timeout(FRESH_READ_TIMEOUT, api.get_opt(&j.lease_name)).await {
                    Ok(Ok(fresh)) => admission::respond(j, fresh.as_ref().and_then(view).as_ref()),
                    Ok(Err(e)) => admission::unconfirmed(j, &e.to_string()),
                    Err(_) => admission::unconfirmed(j, "the read timed out"),
                }
            }
        }
    }
}

fn review_response(review: &impl serde::Serialize) -> Response {
    match serde_json::to_vec(review) {
        Ok(body) => (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(_) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","response":{"uid":"","allowed":false,"status":{"message":"fencedlease: internal encoding error"}}}"#.to_vec(),
        )
            .into_response(),
    }
}

/// Reads a request body up to the cap, or the refusing review to answer with.
async fn read_body(body: Body) -> Result<axum::body::Bytes, AdmissionReview<DynamicObject>> {
    axum::body::to_bytes(body, MAX_BODY_BYTES)
        .await
        .map_err(|_| {
            admission::unreadable(&format!(
                "the body is larger than {MAX_BODY_BYTES} bytes or broken"
            ))
        })
}

async fn validate(State(s): State<Arc<Shared>>, body: Body) -> Response {
    let started = Instant::now();
    let (review, label) = match read_body(body).await {
        Err(review) => (review, "invalid"),
        Ok(bytes) => match admission::parse(&bytes) {
            Parsed::Invalid(review) => (*review, "invalid"),
            Parsed::Pass(resp, why) => {
                debug!(why, "not a protected write");
                (resp.into_review(), "passed")
            }
            Parsed::Judge(j) => {
                let (resp, label) = s.judge(&j).await;
                if !resp.allowed {
                    info!(
                        lease = %j.lease_name, ns = %j.namespace, result = label,
                        token = j.token.as_deref().unwrap_or(""), "refused a write"
                    );
                }
                (resp.into_review(), label)
            }
        },
    };
    s.metrics.seconds.observe(started.elapsed().as_secs_f64());
    s.metrics
        .admissions
        .get_or_create(&ResultLabel { result: label })
        .inc();
    review_response(&review)
}

async fn mutate(State(s): State<Arc<Shared>>, body: Body) -> Response {
    let started = Instant::now();
    let (review, label) = match read_body(body).await {
        Err(review) => (review, "invalid"),
        Ok(bytes) => inject::review(&bytes, &s.inject),
    };
    s.metrics.seconds.observe(started.elapsed().as_secs_f64());
    s.metrics
        .injections
        .get_or_create(&ResultLabel { result: label })
        .inc();
    review_response(&review)
}

async fn readyz(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    if s.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "lease cache not synced")
    }
}

/// Loads the serving certificate, waiting for the files to appear: with self-managed
/// certificates the active controller writes the Secret that kubelet then mounts.
async fn wait_for_certificate(
    files: &CertFiles,
) -> anyhow::Result<(rustls::sign::CertifiedKey, Vec<u8>)> {
    let started = Instant::now();
    let mut next_log = Duration::ZERO;
    loop {
        match tls::load(files) {
            Ok(loaded) => return Ok(loaded),
            Err(tls::TlsError::Read { path, source })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                if started.elapsed() >= next_log {
                    info!(path = %path.display(), "waiting for the certificate files to appear");
                    next_log += Duration::from_secs(10);
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(anyhow::Error::new(e).context("loading the serving certificate")),
        }
    }
}

pub async fn run(args: WebhookArgs) -> anyhow::Result<std::process::ExitCode> {
    let files = CertFiles {
        cert: args.tls_cert.clone(),
        key: args.tls_key.clone(),
    };
    let (first, fingerprint) = wait_for_certificate(&files).await?;
    let cert = ReloadingCert::new(first);
    let tls_config =
        Arc::new(tls::server_config(cert.clone()).context("building the TLS configuration")?);
    tokio::spawn(cert.watch(
        files,
        fingerprint,
        Duration::from_secs(args.tls_reload_seconds.max(1)),
    ));

    let client = Client::try_default()
        .await
        .context("connecting to Kubernetes (set KUBECONFIG or run in a pod)")?;
    let version = client
        .apiserver_version()
        .await
        .context("asking the API server for its version")?;
    let native_sidecars = inject::supports_native_sidecars(&version.major, &version.minor);
    info!(version = %version.git_version, native_sidecars, "injecting sidecars as {}",
        if native_sidecars { "native sidecars (init containers that keep running)" } else { "ordinary containers" });
    let (store, writer) = reflector::store::<FencedLease>();
    let leases: Api<FencedLease> = Api::all(client.clone());
    let reflect = reflector::reflector(
        writer,
        // managedFields are most of a cached lease's size and never read here.
        watcher(leases, watcher::Config::default().any_semantic())
            .modify(|l: &mut FencedLease| l.metadata.managed_fields = None),
    )
    .default_backoff()
    .for_each(|ev| async move {
        if let Err(e) = ev {
            warn!(error = %e, "watching FencedLeases failed; retrying");
        }
    });
    tokio::spawn(reflect);

    let mut registry = Registry::default();
    let metrics = WebhookMetrics::register(&mut registry);
    let server_metrics = server::ServerMetrics::register(&mut registry);
    let ready = Arc::new(AtomicBool::new(false));
    let shared = Arc::new(Shared {
        client,
        inject: inject::InjectConfig {
            image: args.sidecar_image.clone(),
            image_pull_policy: args.sidecar_image_pull_policy.clone(),
            native_sidecars,
        },
        store: store.clone(),
        metrics,
        ready: ready.clone(),
    });
    {
        let ready = ready.clone();
        tokio::spawn(async move {
            if store.wait_until_ready().await.is_ok() {
                ready.store(true, Ordering::Relaxed);
                info!("lease cache synced: ready");
            }
        });
    }

    let (stop_tx, stop_rx) = watch::channel(false);
    let health = HealthState {
        registry: Arc::new(registry),
        ready: ready.clone(),
    };
    let metrics_server = tokio::spawn(crate::metrics::serve(
        args.metrics_addr,
        health,
        crate::until_stopped(stop_rx.clone()),
    ));

    let app = Router::new()
        .route("/validate", post(validate))
        .route("/mutate", post(mutate))
        .route("/livez", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(shared);
    server::serve_until_signalled(
        args.listen,
        tls_config,
        app,
        server::Limits::default(),
        server_metrics,
    )
    .await?;
    info!("shutting down");
    ready.store(false, Ordering::Relaxed);
    let _ = stop_tx.send(true);
    if let Ok(Err(e)) = metrics_server.await {
        warn!(error = %e, "the metrics server failed");
    }
    Ok(std::process::ExitCode::SUCCESS)
}
