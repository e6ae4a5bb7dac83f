//! Shared harness for the integration tests: they run against a real kube-apiserver.
//!
//! The cluster is found through `$KUBECONFIG`, else `hack/cluster.sh`'s default kubeconfig.
//! When none answers, the test fails (never skips) and says how to start one.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{DeleteParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};

pub mod apiproxy;
pub mod containerd;
pub mod fencing;
pub mod handover;
pub mod helm;
pub mod node;
pub mod operator;
pub mod policy;
pub mod procs;
pub mod release;
pub mod samples;
pub mod sidecars;
pub mod stories;
pub mod webhook;
pub mod writers;

pub const DEFAULT_KUBECONFIG: &str = "/tmp/fencedlease-cluster/kubeconfig";

/// The repository's root (this crate lives in tests/common).
pub fn repo_root() -> &'static Path {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        let here = Path::new(env!("CARGO_MANIFEST_DIR"));
        here.ancestors().nth(2).unwrap_or(here).to_path_buf()
    })
}

/// An example program of the workspace that cargo built beside the running test
/// (target/<profile>/examples/NAME): `cargo test --workspace --all-targets` (hack/test.sh)
/// builds them all; alone, `cargo build -p fencedlease-elector --examples` first.
pub fn example_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the running test's path");
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .expect("a test binary lives in target/<profile>/deps")
        .join("examples")
        .join(name);
    assert!(
        bin.is_file(),
        "no example {name} at {}: build it with `cargo build -p fencedlease-elector --examples` \
         (hack/test.sh builds every target), then rerun",
        bin.display()
    );
    bin
}

/// The `fencedlease` binary the tests run: `$FENCEDLEASE_BIN` if set, else the one cargo built
/// beside the running test (a test is target/<profile>/deps/<name>-<hash>, the binary
/// target/<profile>/fencedlease; cargo builds a package's binaries before its integration tests).
/// `CARGO_BIN_EXE_fencedlease` is not available here: cargo sets it only for the package's own
/// test targets.
pub fn fencedlease_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os("FENCEDLEASE_BIN") {
        return PathBuf::from(bin);
    }
    let exe = std::env::current_exe().expect("the running test's path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("a test binary lives in target/<profile>/deps");
    let bin = profile_dir.join("fencedlease");
    assert!(
        bin.is_file(),
        "no fencedlease binary at {}: run the tests with `cargo test` (which builds it) \
         or set FENCEDLEASE_BIN",
        bin.display()
    );
    bin
}

pub fn kubeconfig_path() -> PathBuf {
    std::env::var_os("KUBECONFIG")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_KUBECONFIG))
}

fn how_to_start() -> String {
    format!(
        "no Kubernetes API server reachable through {}.\n\
         Start the local one with `hack/cluster.sh up` (it builds Kubernetes on first use), then\n\
         `export KUBECONFIG={DEFAULT_KUBECONFIG}`; or run everything with `hack/test.sh`.",
        kubeconfig_path().display()
    )
}

/// A client for the test cluster. Panics, saying how to start the cluster, when it is absent.
pub async fn client() -> Client {
    client_impersonating(None).await
}

/// A client that acts as `user` (the admin impersonates it; RBAC applies as to `user`).
pub async fn client_as(user: &str) -> Client {
    client_impersonating(Some(user)).await
}

/// A client from another kubeconfig of the test cluster's (say, one through an
/// [`apiproxy::ApiProxy`]).
pub async fn client_from(path: &Path) -> Client {
    client_of(path, None).await
}

async fn client_impersonating(user: Option<&str>) -> Client {
    client_of(&kubeconfig_path(), user).await
}

async fn client_of(path: &Path, user: Option<&str>) -> Client {
    let kc = Kubeconfig::read_from(path)
        .unwrap_or_else(|e| panic!("{}\n(reading {}: {e})", how_to_start(), path.display()));
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .unwrap_or_else(|e| panic!("{}\n(kubeconfig: {e})", how_to_start()));
    // Tests see what the server answered: kube's default client retries 429/503/504 up to 15
    // times with backoff, which would turn a fail-closed 503 into minutes of waiting.
    let mut config = config;
    config.default_retry = false;
    config.auth_info.impersonate = user.map(str::to_string);
    let client = Client::try_from(config).expect("building a kube client from a valid config");
    if let Err(e) = client.apiserver_version().await {
        panic!("{}\n(asking the server's version: {e})", how_to_start());
    }
    client
}

/// Runs `program` against the test cluster (KUBECONFIG set); returns (success, stdout, stderr).
/// Panics with `missing` when it cannot be started.
pub fn run_against_cluster(
    program: impl AsRef<std::ffi::OsStr>,
    args: &[&str],
    missing: &str,
) -> (bool, String, String) {
    let out = Command::new(program)
        .env("KUBECONFIG", kubeconfig_path())
        .args(args)
        .output()
        .expect(missing);
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs kubectl against the test cluster; returns (success, stdout, stderr).
pub fn kubectl(args: &[&str]) -> (bool, String, String) {
    run_against_cluster(
        "kubectl",
        args,
        "kubectl must be installed (it is on these machines: /usr/bin/kubectl)",
    )
}

/// The test server's minor version, asked once per test binary with kubectl (for code that is
/// not async; see [`server_minor`]).
pub fn server_minor_blocking() -> u32 {
    static MINOR: OnceLock<u32> = OnceLock::new();
    *MINOR.get_or_init(|| {
        let (ok, out, err) = kubectl(&["version", "-o", "json"]);
        assert!(ok, "{}\n(kubectl version: {err})", how_to_start());
        let v: serde_json::Value = serde_json::from_str(&out).expect("kubectl version JSON");
        let minor = v["serverVersion"]["minor"].as_str().unwrap_or_default();
        minor
            .trim_end_matches('+')
            .parse()
            .unwrap_or_else(|e| panic!("API server minor version {minor:?}: {e}"))
    })
}

/// The committed CRD file the test server takes: with validation rules from 1.25, else the one
/// in crds/pre-1.25/.
pub fn crd_file() -> PathBuf {
    repo_root().join(fencedlease::crdgen::crd_path_for(server_minor_blocking()))
}

/// Installs the committed CRD the server takes ([`crd_file`]) once per test binary
/// (server-side apply) and waits until it is Established. Synchronous, so that it does not
/// depend on any one test's runtime.
pub fn ensure_crd() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        let crd = crd_file();
        let crd = crd.to_str().expect("utf-8 path");
        let (ok, _, err) = kubectl(&[
            "apply",
            "--server-side",
            "--force-conflicts",
            "--field-manager=fencedlease-tests",
            "-f",
            crd,
        ]);
        assert!(ok, "installing the CRD with kubectl failed: {err}");
        let (ok, _, err) = kubectl(&[
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd/fencedleases.fencedlease.io",
        ]);
        assert!(ok, "the CRD did not become Established: {err}");
    });
}

/// A namespace of the test's own, deleted when the value is dropped (in the background).
pub struct TestNamespace {
    pub name: String,
}

impl TestNamespace {
    pub async fn new(client: &Client, prefix: &str) -> TestNamespace {
        let suffix: u32 = rand_u32();
        let name = format!("{prefix}-{suffix:08x}");
        let ns: Namespace = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "labels": {"fencedlease.io/test": "true", "fencedlease.io/test-ns": name}}
        }))
        .expect("namespace literal");
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .unwrap_or_else(|e| panic!("creating namespace {name}: {e}"));
        wait_service_account(client, &name, "default").await;
        TestNamespace { name }
    }
}

/// Waits until pods may use ServiceAccount `name`: the ServiceAccount admission plugin refuses
/// them until it exists (the controller-manager makes `default`) and, before 1.24, until the
/// token controller has made its token Secret. (From 1.24 tokens are projected, no Secret.)
pub async fn wait_service_account(client: &Client, ns: &str, name: &str) {
    let token_secrets = server_minor(client).await < 24;
    let sas: Api<k8s_openapi::api::core::v1::ServiceAccount> = Api::namespaced(client.clone(), ns);
    let what = format!(
        "ServiceAccount {ns}/{name}{}",
        if token_secrets {
            " and its token Secret (made by kube-controller-manager)"
        } else {
            ""
        }
    );
    eventually(Duration::from_secs(30), &what, || async {
        let sa = sas.get_opt(name).await.ok().flatten()?;
        let has_secret = sa.secrets.as_ref().is_some_and(|s| !s.is_empty());
        (has_secret || !token_secrets).then_some(())
    })
    .await;
}

/// The Kubernetes Events (events.k8s.io/v1) of a namespace, empty when they cannot be listed.
pub async fn k8s_events(client: &Client, ns: &str) -> Vec<k8s_openapi::api::events::v1::Event> {
    Api::namespaced(client.clone(), ns)
        .list(&Default::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
}

/// The API server's minor version (20 for v1.20.2, 37 for v1.37.2).
pub async fn server_minor(client: &Client) -> u32 {
    let v = client
        .apiserver_version()
        .await
        .unwrap_or_else(|e| panic!("asking the API server for its version: {e}"));
    v.minor
        .trim_end_matches('+')
        .parse()
        .unwrap_or_else(|e| panic!("API server minor version {:?}: {e}", v.minor))
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        // Best effort and non-blocking: kubectl returns once deletion has started.
        let _ = kubectl(&["delete", "namespace", &self.name, "--wait=false"]);
    }
}

/// The value of the first sample of metric `name` in a Prometheus text page (0 when absent).
pub fn metric_value(page: &str, name: &str) -> f64 {
    page.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// A value for `fencedlease.io/write-id` that this test process never used before.
pub fn new_write_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "test-{}-{:08x}-{}",
        std::process::id(),
        rand_u32(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A random-enough number for unique names, without a dependency.
pub fn rand_u32() -> u32 {
    use std::collections::hash_map::RandomState;
    use std::hash::{BuildHasher, Hasher};
    let mut h = RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    h.finish() as u32
}

/// What one look of [`eventually`] found: done with a value, or not yet. `Option` says only
/// whether it is done; `Result` says what it saw when not (`Err(state)`), and the last state seen
/// is in the timeout's message.
pub trait Progress {
    type Done;
    /// Ok when done; else the state seen, if the look described it.
    fn progress(self) -> Result<Self::Done, Option<String>>;
}

impl<T> Progress for Option<T> {
    type Done = T;
    fn progress(self) -> Result<T, Option<String>> {
        self.ok_or(None)
    }
}

impl<T, S: std::fmt::Display> Progress for Result<T, S> {
    type Done = T;
    fn progress(self) -> Result<T, Option<String>> {
        self.map_err(|state| Some(state.to_string()))
    }
}

/// How often [`eventually`] and [`try_eventually`] look.
pub const POLL_INTERVAL: Duration = Duration::from_millis(50);

/// Polls `f` every [`POLL_INTERVAL`] until it returns Ok; after `timeout`, the last state `f`
/// returned in its Err (for callers that handle a timeout themselves).
pub async fn try_eventually<T, S, F, Fut>(timeout: Duration, mut f: F) -> Result<T, S>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, S>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let last = match f().await {
            Ok(v) => return Ok(v),
            Err(state) => state,
        };
        if tokio::time::Instant::now() >= deadline {
            return Err(last);
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// Polls `f` every [`POLL_INTERVAL`] until it is done (`Some`, or `Ok`); after `timeout`, panics
/// with `what` and the last state `f` described (its `Err`).
pub async fn eventually<F, Fut>(
    timeout: Duration,
    what: &str,
    mut f: F,
) -> <Fut::Output as Progress>::Done
where
    F: FnMut() -> Fut,
    Fut: std::future::Future,
    Fut::Output: Progress,
{
    match try_eventually(timeout, || {
        let look = f();
        async move { look.await.progress() }
    })
    .await
    {
        Ok(v) => v,
        Err(None) => panic!("timed out after {timeout:?} waiting for: {what}"),
        Err(Some(last)) => {
            panic!("timed out after {timeout:?} waiting for: {what}\nlast state: {last}")
        }
    }
}

/// Deletes a namespaced object, ignoring "not found".
pub async fn delete_ignore_missing<K>(api: &Api<K>, name: &str)
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => {}
        Err(e) => panic!("deleting {name}: {e}"),
    }
}
