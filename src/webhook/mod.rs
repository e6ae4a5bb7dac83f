//! `fencedlease webhook`: the admission webhook that makes the API server refuse writes to
//! protected objects that carry a stale (or missing, malformed, forged) fencing token.
//!
//! Every Allow rests on a read of the lease made after the request arrived (a read without a
//! resourceVersion, which the API server serves from etcd with a quorum read): a watch cache
//! can lag by seconds, or for minutes when a watch dies silently, and an Allow from it would let
//! a replaced holder's token through. Concurrent writes share such reads, but only ever a read
//! sent after each of them arrived ([`coalesce`]). The watch cache only refuses early the
//! writes whose token is already below a generation the lease has reached. When the API server
//! cannot be read the webhook refuses (503) and turns unready. It is never on the path of
//! FencedLease renewals: its configuration lists only the protected resource types.

pub mod admission;
mod coalesce;
pub mod decision;
pub mod fence;
pub mod inject;
pub mod server;
pub mod subresources;

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
use axum::routing::post;
use axum::Router;
use base64::Engine as _;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
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
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::api::{FencedLease, MODE_ANNOTATION};
use crate::runtime::args::{AdminArgs, Tailor, Tailored};
use crate::runtime::tls::{self, CertFiles, ReloadingCert};
use crate::webhook::fence::{Exemptions, LeaseView, Mode, Verdict, DEFAULT_EXEMPT_USERS};
use admission::{AutoscalerCheck, Judgement, ParentCheck, Parsed, ScaleTarget};
use coalesce::Coalescer;
use decision::{Answer, Outcome};

/// How long a read of a lease (or of a scaled object, or a namespace) may take before the
/// webhook refuses the write (fail closed).
const FRESH_READ_TIMEOUT: Duration = Duration::from_secs(2);
/// The bounds of a coalesced fresh read ([`coalesce`]). Each read is bounded by
/// `FRESH_READ_TIMEOUT` in [`timed_read`], which records its outcome; the coalescer's own bound
/// is a backstop a little later. A write waits at most for the read in flight when it arrived,
/// then for its own: twice `FRESH_READ_TIMEOUT`, after which it is refused (fail closed).
const COALESCED_READ_BOUNDS: coalesce::Bounds = coalesce::Bounds {
    read_timeout: FRESH_READ_TIMEOUT.saturating_add(Duration::from_millis(500)),
    max_wait: FRESH_READ_TIMEOUT.saturating_mul(2),
};
/// How long the webhook may take to decide a protected write, counted from when it began
/// judging it: no more than a write waits for its lease's read (`COALESCED_READ_BOUNDS`), so
/// that a refusal's read of the namespace's mode, after a slow read of the lease, cannot push
/// the answer past the API server's timeout (the chart's 5 s) and lose the webhook's message.
pub const DECISION_BUDGET: Duration = COALESCED_READ_BOUNDS.max_wait;
/// How long one successful read from the API server keeps the webhook ready; a failed read
/// makes it unready at once.
const API_HEALTH_WINDOW: Duration = Duration::from_secs(5);
/// How often the webhook reads from the API server to know it still can, when no write asks.
const API_PROBE_INTERVAL: Duration = Duration::from_secs(2);
/// The buckets of `fencedlease_webhook_fresh_read_seconds`: from 50 us up by a quarter, 49 of
/// them, the last at about 2.3 s, above `FRESH_READ_TIMEOUT`. Fine enough to tell a read's
/// share of the milliseconds a write waits.
const FRESH_READ_BUCKETS: (f64, f64, u16) = (0.000_05, 1.25, 49);

/// The webhook's admin server listens on 9091 unless told otherwise (the controller's on 9090).
#[derive(Debug, Clone)]
pub struct WebhookAdmin;

impl Tailor for WebhookAdmin {
    fn tailor(cmd: clap::Command) -> clap::Command {
        cmd.mut_arg("metrics_addr", |a| {
            a.default_value("127.0.0.1:9091").required(false)
        })
    }
}

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
    /// After SIGTERM, how many seconds the webhook keeps answering (reporting not ready)
    /// before it closes its listener: the moment the API server takes to stop sending to a
    /// terminating pod. With 0, writes judged in that moment fail ("connection refused") during
    /// every rolling update. Keep it below the pod's terminationGracePeriodSeconds minus 10.
    #[arg(long, env = "FENCEDLEASE_SHUTDOWN_DELAY_SECONDS", default_value_t = 5)]
    pub shutdown_delay_seconds: u64,
    #[command(flatten)]
    pub admin: Tailored<AdminArgs, WebhookAdmin>,
    /// Image of the injected sidecar (served at /mutate).
    #[arg(
        long,
        env = "FENCEDLEASE_SIDECAR_IMAGE",
        default_value = concat!("fencedlease:", env!("CARGO_PKG_VERSION"))
    )]
    pub sidecar_image: String,
    /// imagePullPolicy of the injected sidecar.
    #[arg(long, default_value = "IfNotPresent", value_parser = ["Always", "IfNotPresent", "Never"])]
    pub sidecar_image_pull_policy: String,
    /// `resources` of the injected sidecar, as JSON: requests and/or limits of cpu and memory.
    /// Default: requests 10m CPU and 16Mi, limits 200m CPU and 64Mi. A CPU limit can throttle
    /// renewals on a busy node. Pods override entries with fencedlease.io/sidecar-cpu-request,
    /// -memory-request, -cpu-limit and -memory-limit (a quantity, or `none`).
    #[arg(long, value_parser = inject::parse_resources)]
    pub sidecar_resources: Option<serde_json::Value>,
    /// runAsUser of the injected sidecar, or `none` to leave it to the pod (as OpenShift's
    /// restricted SCC wants). The sidecar runs as non-root either way.
    #[arg(long, default_value = "65532", value_parser = parse_run_as_user)]
    pub sidecar_run_as_user: RunAsUser,
    /// Log format of the injected sidecar.
    #[arg(long, value_enum, default_value_t)]
    pub sidecar_log_format: crate::runtime::logging::LogFormat,
    /// A user allowed to update protected objects without a token as long as it leaves their
    /// fencing label and annotations alone (repeat the flag). Given at least once, the list
    /// replaces the default: kube-controller-manager and its controllers' ServiceAccounts in
    /// kube-system. Exact names; ServiceAccounts outside kube-system are refused.
    #[arg(long = "exempt-user")]
    pub exempt_users: Vec<String>,
    /// A group whose members are exempt likewise (repeat the flag; default none). Groups that
    /// hold all users or ServiceAccounts are refused.
    #[arg(long = "exempt-group")]
    pub exempt_groups: Vec<String>,
    /// For benchmarks: every write sends a fresh read of its own instead of sharing the next
    /// one with the writes waiting beside it. As safe, and more reads.
    #[arg(long, hide = true)]
    pub no_shared_reads: bool,
}

/// `--sidecar-run-as-user`: a UID, or none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunAsUser(pub Option<i64>);

fn parse_run_as_user(s: &str) -> Result<RunAsUser, String> {
    if s == "none" {
        return Ok(RunAsUser(None));
    }
    match s.parse::<i64>() {
        Ok(uid) if uid > 0 => Ok(RunAsUser(Some(uid))),
        _ => Err("a UID above 0 (the sidecar runs as non-root), or none".into()),
    }
}

impl WebhookArgs {
    /// Whether concurrent writes share fresh reads (`--no-shared-reads`).
    fn sharing(&self) -> coalesce::Sharing {
        if self.no_shared_reads {
            coalesce::Sharing::PerRequest
        } else {
            coalesce::Sharing::Coalesce
        }
    }

    /// The exemptions, checked.
    pub(crate) fn exemptions(&self) -> Result<Exemptions, crate::webhook::fence::ExemptionError> {
        let users = if self.exempt_users.is_empty() {
            DEFAULT_EXEMPT_USERS.iter().map(|u| u.to_string()).collect()
        } else {
            self.exempt_users.clone()
        };
        Exemptions::new(users, self.exempt_groups.clone())
    }
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
pub(crate) fn certs(args: CertsArgs) -> anyhow::Result<std::process::ExitCode> {
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

/// What a fresh read read: `lease`, `namespace` (its fencing mode) or `scaled` (the object
/// behind a /scale write).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ObjectLabel {
    object: &'static str,
}

type ReadSeconds = Family<ObjectLabel, Histogram, fn() -> Histogram>;

/// The values of the `object` label of `fencedlease_webhook_fresh_read_seconds`: a lease, a
/// namespace (its fencing mode), the object behind a /scale write.
const READ_LEASE: &str = "lease";
const READ_NAMESPACE: &str = "namespace";
const READ_SCALED: &str = "scaled";
const READ_OBJECTS: [&str; 3] = [READ_LEASE, READ_NAMESPACE, READ_SCALED];

fn read_histogram() -> Histogram {
    let (start, factor, n) = FRESH_READ_BUCKETS;
    Histogram::new(exponential_buckets(start, factor, n))
}

/// The webhook's metrics. `result` is one of a fixed set of words.
struct WebhookMetrics {
    admissions: Family<ResultLabel, Counter>,
    injections: Family<ResultLabel, Counter>,
    seconds: Histogram,
    fresh_reads: Counter,
    fresh_reads_shared: Counter,
    fresh_read_seconds: ReadSeconds,
    cache_lag_caught: Counter,
}

impl WebhookMetrics {
    fn register(r: &mut Registry) -> WebhookMetrics {
        let m = WebhookMetrics {
            admissions: Family::default(),
            injections: Family::default(),
            seconds: Histogram::new(exponential_buckets(0.000005, 2.0, 20)),
            fresh_reads: Counter::default(),
            fresh_reads_shared: Counter::default(),
            fresh_read_seconds: Family::new_with_constructor(read_histogram),
            cache_lag_caught: Counter::default(),
        };
        r.register(
            "fencedlease_webhook_admissions",
            "Admission decisions: allowed, denied_stale, denied_missing, denied_malformed, denied_not_presented, denied_unannounced_delete, denied_future, denied_free, denied_no_lease, denied_scale, denied_binding, warned, passed, exempt, invalid, error",
            m.admissions.clone(),
        );
        r.register(
            "fencedlease_webhook_injections",
            "Pod admissions at /mutate: injected, skipped, refused (bad annotations, hostNetwork pods), invalid",
            m.injections.clone(),
        );
        r.register(
            "fencedlease_webhook_admission_seconds",
            "Time to decide one admission request, inside the server",
            m.seconds.clone(),
        );
        r.register(
            "fencedlease_webhook_fresh_reads",
            "Reads from the API server made to decide writes: the lease before every allow and before a refusal a lagging cache could explain, the namespace's mode before a refusal, the object behind a /scale write. Concurrent writes needing the same lease or namespace share one read sent after all of them arrived",
            m.fresh_reads.clone(),
        );
        r.register(
            "fencedlease_webhook_fresh_reads_shared",
            "Fresh reads of a lease or namespace that a write needed and got from a read shared with other writes (sent after each of them arrived); a refused write can count twice, for its lease and its namespace",
            m.fresh_reads_shared.clone(),
        );
        r.register(
            "fencedlease_webhook_fresh_read_seconds",
            "Time of one fresh read from the API server, by what it read: lease, namespace (its fencing mode), scaled (the object behind a /scale write); a read that fails or times out (2 s) counts too",
            m.fresh_read_seconds.clone(),
        );
        r.register(
            "fencedlease_webhook_cache_lag_caught",
            "Writes that the lease cache would have allowed and a fresh read refused: the cache lagged behind the lease",
            m.cache_lag_caught.clone(),
        );
        // Every series of a bounded label, from 0 at the start (rate() and absent() then work
        // before the first admission).
        for o in Outcome::ALL {
            drop(
                m.admissions
                    .get_or_create(&ResultLabel { result: o.label() }),
            );
        }
        for object in READ_OBJECTS {
            m.read_seconds(object);
        }
        m
    }

    /// The histogram of fresh reads of `object`.
    fn read_seconds(&self, object: &'static str) -> Histogram {
        self.fresh_read_seconds
            .get_or_create(&ObjectLabel { object })
            .clone()
    }
}

struct Shared {
    client: Client,
    inject: inject::InjectConfig,
    store: Store<FencedLease>,
    metrics: WebhookMetrics,
    exemptions: Exemptions,
    health: Arc<ApiHealth>,
    fresh: FreshReads,
    /// The bytes all request bodies together may buffer.
    budget: server::BodyBudget,
}

fn view(l: &FencedLease) -> Option<LeaseView> {
    Some(LeaseView {
        uid: l.metadata.uid.clone()?,
        generation: l.metadata.generation?,
        holder: l.holder().map(str::to_string),
        deleting: l.metadata.deletion_timestamp.is_some(),
    })
}

/// Whether the webhook can read from the API server now: ready means the lease cache has
/// synced and a read succeeded within `API_HEALTH_WINDOW` with none failing since.
struct ApiHealth {
    started: Instant,
    synced: AtomicBool,
    ok_until_ms: std::sync::atomic::AtomicU64,
    ready: Arc<AtomicBool>,
}

impl ApiHealth {
    fn new(ready: Arc<AtomicBool>) -> ApiHealth {
        ApiHealth {
            started: Instant::now(),
            synced: AtomicBool::new(false),
            ok_until_ms: Default::default(),
            ready,
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Records the outcome of a read and updates readiness.
    fn record(&self, ok: bool) {
        let until = if ok {
            self.now_ms()
                .saturating_add(API_HEALTH_WINDOW.as_millis() as u64)
        } else {
            0
        };
        self.ok_until_ms.store(until, Ordering::Relaxed);
        self.refresh();
    }

    fn refresh(&self) {
        let fresh = self.now_ms() < self.ok_until_ms.load(Ordering::Relaxed);
        let ready = fresh && self.synced.load(Ordering::Relaxed);
        if self.ready.swap(ready, Ordering::Relaxed) != ready {
            if ready {
                info!("lease cache synced and the API server readable: ready");
            } else {
                warn!("cannot read from the API server: unready, refusing protected writes");
            }
        }
    }
}

/// The fresh reads of leases and namespaces, each coalesced per key ([`coalesce`]): a write is
/// only ever decided on a read sent after the write arrived, but concurrent writes waiting for
/// the same lease (or namespace) share the next such read.
struct FreshReads {
    /// What the webhook knows of a lease, by namespace and name (None: no such lease).
    leases: Coalescer<(String, String), Option<LeaseView>>,
    /// The fencing mode of a namespace, by name.
    modes: Coalescer<String, Mode>,
}

impl FreshReads {
    fn new(
        client: &Client,
        health: &Arc<ApiHealth>,
        metrics: &WebhookMetrics,
        sharing: coalesce::Sharing,
    ) -> FreshReads {
        let counters = coalesce::Counters {
            reads: metrics.fresh_reads.clone(),
            shared: metrics.fresh_reads_shared.clone(),
        };
        let (c, h, t) = (
            client.clone(),
            health.clone(),
            metrics.read_seconds(READ_LEASE),
        );
        let leases = Coalescer::new(
            move |(ns, name): (String, String)| {
                let (api, h) = (Api::<FencedLease>::namespaced(c.clone(), &ns), h.clone());
                let t = t.clone();
                async move {
                    Ok(timed_read(&h, Some(&t), api.get_opt(&name))
                        .await?
                        .as_ref()
                        .and_then(view))
                }
            },
            COALESCED_READ_BOUNDS,
            counters.clone(),
            sharing,
        );
        let (c, h, t) = (
            client.clone(),
            health.clone(),
            metrics.read_seconds(READ_NAMESPACE),
        );
        let modes = Coalescer::new(
            move |ns: String| {
                let (api, h) = (Api::<Namespace>::all(c.clone()), h.clone());
                let t = t.clone();
                async move {
                    Ok(namespace_mode(
                        timed_read(&h, Some(&t), api.get_metadata_opt(&ns)).await?,
                    ))
                }
            },
            COALESCED_READ_BOUNDS,
            counters,
            sharing,
        );
        FreshReads { leases, modes }
    }
}

/// The fencing mode a namespace's annotation asks for (a namespace that is not there: enforce).
fn namespace_mode(ns: Option<kube::core::PartialObjectMeta<Namespace>>) -> Mode {
    Mode::from_annotation(
        ns.as_ref()
            .and_then(|n| n.metadata.annotations.as_ref())
            .and_then(|a| a.get(MODE_ANNOTATION))
            .map(String::as_str),
    )
}

/// What is left of `budget` after `spent`: never negative; at least a little, so that a read
/// that answers at once (a coalesced read delivered) is still taken.
fn time_left(budget: Duration, spent: Duration) -> Duration {
    budget.saturating_sub(spent).max(Duration::from_millis(1))
}

/// Runs `read` with the fresh-read timeout, recording the outcome in `health` and, when given,
/// its time in `seconds`.
async fn timed_read<T>(
    health: &ApiHealth,
    seconds: Option<&Histogram>,
    read: impl std::future::Future<Output = Result<T, kube::Error>>,
) -> Result<T, String> {
    let start = Instant::now();
    let out = match tokio::time::timeout(FRESH_READ_TIMEOUT, read).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {FRESH_READ_TIMEOUT:?}")),
    };
    if let Some(h) = seconds {
        h.observe(start.elapsed().as_secs_f64());
    }
    health.record(out.is_ok());
    out
}

impl Shared {
    /// Decides one protected write. The cache may refuse a token already below a generation
    /// the lease reached; everything else, every Allow above all, is decided on a fresh read.
    async fn judge(&self, j: &Judgement) -> Answer {
        let began = Instant::now();
        let key = ObjectRef::<FencedLease>::new(&j.lease_name).within(&j.namespace);
        let cached = self.store.get(&key).and_then(|l| view(&l));
        let from_cache = j.verdict(cached.as_ref());
        if let Verdict::Refuse(r) = &from_cache {
            if !r.may_be_cache_lag() {
                return self.refuse(j, &from_cache, began).await;
            }
        }
        let key = (j.namespace.clone(), j.lease_name.clone());
        let fresh = match self.fresh.leases.read(key).await {
            Ok(l) => l,
            Err(detail) => {
                let what = format!("FencedLease {}/{}", j.namespace, j.lease_name);
                return admission::unconfirmed(&j.response, &what, &detail);
            }
        };
        let verdict = j.verdict(fresh.as_ref());
        if verdict == Verdict::Allow {
            // The namespace's mode matters only to a refusal: no read for it.
            return admission::answer(j, &verdict, Mode::Enforce);
        }
        if from_cache == Verdict::Allow {
            self.metrics.cache_lag_caught.inc();
            info!(lease = %j.lease_name, ns = %j.namespace, "the lease cache lagged: it would have allowed a write the fresh read refuses");
        }
        self.refuse(j, &verdict, began).await
    }

    /// Refuses, unless the namespace is annotated for warn mode (read fresh, coalesced). A
    /// namespace that cannot be read within what is left of `DECISION_BUDGET` since `began`
    /// enforces (fail closed).
    async fn refuse(&self, j: &Judgement, refusal: &Verdict, began: Instant) -> Answer {
        let left = time_left(DECISION_BUDGET, began.elapsed());
        let mode = match tokio::time::timeout(left, self.fresh.modes.read(j.namespace.clone()))
            .await
        {
            Ok(Ok(mode)) => mode,
            Ok(Err(e)) => {
                debug!(ns = %j.namespace, error = %e, "namespace unreadable: enforcing");
                Mode::Enforce
            }
            Err(_) => {
                debug!(ns = %j.namespace, budget = ?DECISION_BUDGET, "no time left to read the namespace's mode: enforcing");
                Mode::Enforce
            }
        };
        admission::answer(j, refusal, mode)
    }

    /// A /scale write or a binding: refused when the object it acts on carries the lease label.
    async fn scale(&self, c: &ParentCheck) -> Answer {
        self.metrics.fresh_reads.inc();
        let api_version = if c.group.is_empty() {
            c.version.clone()
        } else {
            format!("{}/{}", c.group, c.version)
        };
        let ar = kube::core::ApiResource {
            group: c.group.clone(),
            version: c.version.clone(),
            api_version,
            kind: String::new(),
            plural: c.resource.clone(),
        };
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), &c.namespace, &ar);
        let seconds = self.metrics.read_seconds(READ_SCALED);
        match timed_read(&self.health, Some(&seconds), api.get_metadata_opt(&c.name)).await {
            Ok(obj) => match obj
                .as_ref()
                .and_then(|o| o.metadata.labels.as_ref())
                .and_then(|l| l.get(crate::api::LEASE_LABEL).filter(|v| !v.is_empty()))
            {
                Some(lease) => Answer::new(c.refuse(lease), Outcome::Denied(c.via.denial())),
                None => Answer::new(c.response.clone(), Outcome::Passed),
            },
            Err(detail) => {
                let what = format!("{} {}/{}", c.resource, c.namespace, c.name);
                admission::unconfirmed(&c.response, &what, &detail)
            }
        }
    }

    /// The lease that protects an autoscaler's target, if any. The target is found by its group
    /// and kind in whatever version the API server serves (as the autoscaler controller finds
    /// it: the version in `scaleTargetRef.apiVersion` does not matter to it). A kind the API
    /// server does not serve cannot be scaled; a target that does not exist, or of a type the
    /// webhook may not read (the chart grants `get` on every fenced type), is not protected (a
    /// README residual). Any other failure to read is an error (fail closed).
    async fn target_lease(&self, ns: &str, t: &ScaleTarget) -> Result<Option<String>, String> {
        let group = t
            .api_version
            .split_once('/')
            .map_or("", |(g, _)| g)
            .to_string();
        let not_ours =
            |e: &kube::Error| matches!(e, kube::Error::Api(s) if matches!(s.code, 403 | 404));
        let seconds = self.metrics.read_seconds(READ_SCALED);
        self.metrics.fresh_reads.inc();
        let read = async {
            let served = match kube::discovery::group(&self.client, &group).await {
                Ok(g) => g.recommended_kind(&t.kind),
                Err(e) if not_ours(&e) || matches!(e, kube::Error::Discovery(_)) => None,
                Err(e) => return Err(e),
            };
            let Some((ar, _)) = served else {
                return Ok(None);
            };
            let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), ns, &ar);
            match api.get_metadata_opt(&t.name).await {
                Err(e) if not_ours(&e) => Ok(None),
                other => other,
            }
        };
        let obj = timed_read(&self.health, Some(&seconds), read).await?;
        Ok(obj
            .and_then(|o| o.metadata.labels)
            .and_then(|mut l| l.remove(crate::api::LEASE_LABEL))
            .filter(|v| !v.is_empty()))
    }

    /// A write to an autoscaler: judged by the lease of each target that is protected (the
    /// autoscaler's exempt /scale writes would act for whoever may edit it); else passed.
    async fn autoscaler(&self, c: &mut AutoscalerCheck) -> Answer {
        let ns = c.judgement.namespace.clone();
        if let Some(own) = c.own_lease.clone() {
            c.judgement.lease_name = own;
            let answer = self.judge(&c.judgement).await;
            if !answer.allowed() {
                return answer;
            }
        }
        for t in &c.targets {
            let lease = match self.target_lease(&ns, t).await {
                Ok(Some(lease)) => lease,
                Ok(None) => continue,
                Err(detail) => {
                    let what = format!("{} {ns}/{}, the autoscaler's target", t.kind, t.name);
                    return admission::unconfirmed(&c.judgement.response, &what, &detail);
                }
            };
            c.judgement.lease_name = lease;
            c.judgement.acts_on = Some(format!("{} {ns}/{}", t.kind, t.name));
            let answer = self.judge(&c.judgement).await;
            if !answer.allowed() {
                return answer;
            }
        }
        Answer::new(c.judgement.response.clone(), Outcome::Passed)
    }

    /// Reads from the API server every `API_PROBE_INTERVAL`, so that readiness follows
    /// whether the webhook can read even when no write comes.
    async fn probe_api(self: Arc<Self>) {
        let api: Api<FencedLease> = Api::all(self.client.clone());
        let one = kube::api::ListParams::default().limit(1);
        loop {
            let _ = timed_read(&self.health, None, api.list_metadata(&one)).await;
            tokio::time::sleep(API_PROBE_INTERVAL).await;
            self.health.refresh();
        }
    }
}

/// The refusal of a body that was not read whole, with `Connection: close`: what is left of it
/// would otherwise arrive after the answer, as if it began the connection's next request.
fn unread_body_response(e: &server::BodyError) -> Response {
    let mut r = review_response(&e.review());
    r.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    r
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

impl Shared {
    /// Parses and decides one review body at /validate.
    async fn validate_body(&self, bytes: &[u8]) -> (AdmissionReview<DynamicObject>, Outcome) {
        let answer = match admission::parse(bytes, &self.exemptions) {
            Parsed::Invalid(review) => return (*review, Outcome::Invalid),
            Parsed::Pass(resp, why) => {
                debug!(why, "not a protected write");
                let outcome = if why == "exempt" {
                    Outcome::Exempt
                } else {
                    Outcome::Passed
                };
                Answer::new(*resp, outcome)
            }
            Parsed::Parent(c) => {
                let answer = self.scale(&c).await;
                if !answer.allowed() {
                    info!(ns = %c.namespace, name = %c.name, resource = %c.resource, via = c.via.path(), result = answer.outcome.label(), "refused a write through a subresource");
                }
                answer
            }
            Parsed::Autoscaler(mut c) => {
                let answer = self.autoscaler(&mut c).await;
                if !answer.allowed() {
                    info!(ns = %c.judgement.namespace, lease = %c.judgement.lease_name, result = answer.outcome.label(), "refused a write to an autoscaler of a protected object");
                }
                answer
            }
            Parsed::Judge(j) => {
                let answer = self.judge(&j).await;
                if !answer.allowed() {
                    info!(
                        lease = %j.lease_name, ns = %j.namespace, result = answer.outcome.label(),
                        token = j.stamp.token.as_deref().unwrap_or(""), "refused a write"
                    );
                }
                answer
            }
        };
        let outcome = answer.outcome;
        (answer.into_review(), outcome)
    }
}

async fn validate(State(s): State<Arc<Shared>>, body: Body) -> Response {
    let started = Instant::now();
    // The guard keeps the body's bytes counted in the shared budget until the answer is sent.
    let (answer, outcome) = match server::read_body_bounded(body, &s.budget).await {
        Err(e) => (unread_body_response(&e), Outcome::Invalid),
        Ok((bytes, guard)) => {
            let (review, outcome) = s.validate_body(&bytes).await;
            drop(bytes);
            (guarded_response(&review, guard, &s.budget).await, outcome)
        }
    };
    s.metrics.seconds.observe(started.elapsed().as_secs_f64());
    s.metrics
        .admissions
        .get_or_create(&ResultLabel {
            result: outcome.label(),
        })
        .inc();
    answer
}

async fn mutate(State(s): State<Arc<Shared>>, body: Body) -> Response {
    let started = Instant::now();
    let (answer, label) = match server::read_body_bounded(body, &s.budget).await {
        Err(e) => (unread_body_response(&e), "invalid"),
        Ok((bytes, guard)) => {
            let (review, label) = inject::review(&bytes, &s.inject);
            drop(bytes);
            (guarded_response(&review, guard, &s.budget).await, label)
        }
    };
    s.metrics.seconds.observe(started.elapsed().as_secs_f64());
    s.metrics
        .injections
        .get_or_create(&ResultLabel { result: label })
        .inc();
    answer
}

/// The answer to a read body, counted in the byte budget until sent
/// ([`server::answer_within`]); the budget's refusal instead when the answer cannot get it.
async fn guarded_response(
    review: &AdmissionReview<DynamicObject>,
    guard: server::BudgetGuard,
    budget: &server::BodyBudget,
) -> Response {
    let Ok(bytes) = serde_json::to_vec(review) else {
        return review_response(review);
    };
    match server::answer_within(bytes, guard, budget).await {
        Ok(body) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            Body::new(body),
        )
            .into_response(),
        Err(e) => {
            let mut refusal = e.review();
            if let (Some(r), Some(req)) = (refusal.response.as_mut(), review.response.as_ref()) {
                r.uid.clone_from(&req.uid);
            }
            review_response(&refusal)
        }
    }
}

/// Ready once the lease cache has synced and the API server was readable within
/// `API_HEALTH_WINDOW` (see [`ApiHealth`]).
fn readiness(
    shared: &Arc<Shared>,
    stopping: tokio_util::sync::CancellationToken,
) -> crate::runtime::admin::Readiness {
    let s = shared.clone();
    crate::runtime::admin::Readiness::from_fn(move || {
        s.health.refresh();
        if stopping.is_cancelled() {
            Err("shutting down: still answering until the listener closes")
        } else if s.health.ready.load(Ordering::Relaxed) {
            Ok(())
        } else if !s.health.synced.load(Ordering::Relaxed) {
            Err("lease cache not synced")
        } else {
            Err("cannot read from the API server: protected writes are refused")
        }
    })
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

pub(crate) async fn run(args: WebhookArgs) -> anyhow::Result<std::process::ExitCode> {
    let exemptions = args
        .exemptions()
        .context("checking --exempt-user and --exempt-group")?;
    let (tls_config, cert) = start_tls(&args).await?;
    // After the certificate: until it is there, SIGTERM ends the process at once.
    let mut rt = crate::runtime::Runtime::start().await?;
    let client = rt.client().clone();
    let native_sidecars = native_sidecars(&client).await?;
    let store = start_lease_cache(&client);

    let registry = rt.registry();
    let metrics = WebhookMetrics::register(registry);
    registry.register(
        "fencedlease_webhook_certificate_expiry_timestamp_seconds",
        "When the serving certificate in use expires, in seconds since the Unix epoch (0: unreadable)",
        cert.not_after_gauge(),
    );
    let server_metrics = server::ServerMetrics::register(registry);
    let limits = server::Limits::default();
    let budget = server::BodyBudget::new(&limits, &server_metrics);
    let ready = Arc::new(AtomicBool::new(false));
    let health = Arc::new(ApiHealth::new(ready.clone()));
    let fresh = FreshReads::new(&client, &health, &metrics, args.sharing());
    let shared = Arc::new(Shared {
        client,
        inject: inject_config(&args, native_sidecars),
        store: store.clone(),
        metrics,
        exemptions,
        health,
        fresh,
        budget,
    });
    start_readiness(&shared, store);

    let stop = rt.shutdown().clone();
    let readiness = readiness(&shared, stop.clone());
    // The listeners outlive the signal by --shutdown-delay-seconds (see its doc), the admin
    // port's too: /readyz says "shutting down" meanwhile, and the metrics cover the delay.
    let close =
        crate::runtime::cancelled_after(&stop, Duration::from_secs(args.shutdown_delay_seconds));
    rt.serve_admin_until(&args.admin, readiness.clone(), close.clone());
    let app = Router::new()
        .route("/validate", post(validate))
        .route("/mutate", post(mutate))
        .merge(crate::runtime::admin::health_routes(readiness))
        .with_state(shared);
    let served =
        server::serve_until(args.listen, tls_config, app, limits, server_metrics, close).await;
    info!("shutting down");
    rt.finish().await;
    served?;
    Ok(std::process::ExitCode::SUCCESS)
}

/// Waits for the serving certificate, then keeps reloading it when its files change. Returns
/// the TLS configuration that serves it and the certificate (for its expiry metric).
async fn start_tls(
    args: &WebhookArgs,
) -> anyhow::Result<(Arc<rustls::ServerConfig>, Arc<ReloadingCert>)> {
    let files = CertFiles {
        cert: args.tls_cert.clone(),
        key: args.tls_key.clone(),
    };
    let (first, fingerprint) = wait_for_certificate(&files).await?;
    let cert = ReloadingCert::new(first);
    let tls_config =
        Arc::new(tls::server_config(cert.clone()).context("building the TLS configuration")?);
    tokio::spawn(cert.clone().watch(
        files,
        fingerprint,
        Duration::from_secs(args.tls_reload_seconds.max(1)),
    ));
    Ok((tls_config, cert))
}

/// Whether the API server runs native sidecars (asks for its version, and logs the answer).
async fn native_sidecars(client: &Client) -> anyhow::Result<bool> {
    let version = client
        .apiserver_version()
        .await
        .context("asking the API server for its version")?;
    let native_sidecars = inject::supports_native_sidecars(&version.major, &version.minor);
    info!(version = %version.git_version, native_sidecars, "injecting sidecars as {}",
        if native_sidecars { "native sidecars (init containers that keep running)" } else { "ordinary containers" });
    Ok(native_sidecars)
}

/// Starts the watch that fills the cache of FencedLeases (without their managedFields).
fn start_lease_cache(client: &Client) -> Store<FencedLease> {
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
    store
}

/// What the injector puts in the pods, from the flags.
fn inject_config(args: &WebhookArgs, native_sidecars: bool) -> inject::InjectConfig {
    inject::InjectConfig {
        image: args.sidecar_image.clone(),
        image_pull_policy: args.sidecar_image_pull_policy.clone(),
        native_sidecars,
        resources: args
            .sidecar_resources
            .clone()
            .unwrap_or_else(inject::default_resources),
        run_as_user: args.sidecar_run_as_user.0,
        log_format: args.sidecar_log_format,
    }
}

/// Readiness: marks the lease cache synced once it is, and keeps reading from the API server
/// to know it still can.
fn start_readiness(shared: &Arc<Shared>, store: Store<FencedLease>) {
    {
        let shared = shared.clone();
        tokio::spawn(async move {
            if store.wait_until_ready().await.is_ok() {
                shared.health.synced.store(true, Ordering::Relaxed);
                shared.health.refresh();
                info!("lease cache synced");
            }
        });
    }
    tokio::spawn(shared.clone().probe_api());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_left_is_what_remains_of_the_budget_and_never_nothing() {
        let ms = Duration::from_millis;
        for (budget, spent, left) in [
            (4000, 0, 4000),
            (4000, 1500, 2500),
            (4000, 3999, 1),
            (4000, 4000, 1),
            (4000, 9000, 1),
        ] {
            assert_eq!(
                time_left(ms(budget), ms(spent)),
                ms(left),
                "{budget} {spent}"
            );
        }
    }
}
