//! The Go client library (clients/go) against two real `fencedlease sidecar` processes, the
//! real API server and the real fencing webhook: this test starts them and runs
//! `go test -run Integration` in clients/go with their addresses, and serves the Go test's one
//! request to SIGKILL a sidecar. What the Go test checks is listed at the top of
//! clients/go/integration_test.go. Go (1.24 or later) must be on PATH: without it the test
//! fails, it does not skip.

use fencedlease_testkit as common;

use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
use common::procs::scratch_dir;
use common::sidecars::{sidecar, Sidecar};
use common::webhook::Webhook;
use common::{client, ensure_crd, kubectl, repo_root, TestNamespace};
use nix::sys::signal::Signal;
use nix::unistd::Pid;

const LEASE: &str = "db";
/// Compiling the Go test on a busy 2-core machine included.
const GO_TEST_TIMEOUT: Duration = Duration::from_secs(300);

/// The API server's address, CA file and bearer token file, from the test kubeconfig (the
/// Go test uses the standard library only, so it cannot read a kubeconfig).
struct KubeAccess {
    server: String,
    ca: PathBuf,
    token: PathBuf,
}

fn kube_access(dir: &Path) -> KubeAccess {
    let (ok, out, err) = kubectl(&["config", "view", "--minify", "--raw", "-o", "json"]);
    assert!(ok, "kubectl config view: {err}");
    let kc: serde_json::Value = serde_json::from_str(&out).expect("kubeconfig JSON");
    let cluster = &kc["clusters"][0]["cluster"];
    let server = cluster["server"]
        .as_str()
        .expect("a server in the kubeconfig");
    let ca = base64::engine::general_purpose::STANDARD
        .decode(
            cluster["certificate-authority-data"]
                .as_str()
                .expect("certificate-authority-data in the kubeconfig (hack/cluster.sh writes it)"),
        )
        .expect("base64 CA");
    let token = kc["users"][0]["user"]["token"]
        .as_str()
        .expect("a bearer token in the kubeconfig (hack/cluster.sh writes one)");
    let (ca_file, token_file) = (dir.join("kube-ca.crt"), dir.join("kube-token"));
    std::fs::write(&ca_file, ca).expect("write the CA");
    std::fs::write(&token_file, token).expect("write the token");
    KubeAccess {
        server: server.to_string(),
        ca: ca_file,
        token: token_file,
    }
}

/// `go test`, in a process group of its own so that the test binary it starts goes with it.
struct GoTest(Child);

impl Drop for GoTest {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let pgid = Pid::from_raw(i32::try_from(self.0.id()).expect("pid fits i32"));
            let _ = nix::sys::signal::killpg(pgid, Signal::SIGKILL);
            let _ = self.0.wait();
        }
    }
}

#[tokio::test]
async fn the_go_client_library_works_against_real_sidecars_and_the_webhook() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "client-go").await;
    let dir = scratch_dir("client-go");
    let _wh = Webhook::start(&client, &dir, &ns.name).await;
    let cars = [
        sidecar(&dir, &ns.name, LEASE, "pod-a", &[]),
        sidecar(&dir, &ns.name, LEASE, "pod-b", &[]),
    ];
    let access = kube_access(&dir);
    let control = dir.join("control");
    std::fs::create_dir_all(&control).expect("mkdir control");
    let log_path = dir.join("go-test.log");
    let log = std::fs::File::create(&log_path).expect("create the go test log");
    let join = |f: fn(&Sidecar) -> String| cars.iter().map(f).collect::<Vec<_>>().join(",");
    let path = |p: &Path| p.to_str().expect("utf-8").to_string();
    let mut go = GoTest(
        Command::new("go")
            .args([
                "test",
                "-count=1",
                "-timeout=240s",
                "-v",
                "-run",
                "Integration",
                "./...",
            ])
            .current_dir(repo_root().join("clients/go"))
            // Never a skip: the Go test fails when a variable is missing.
            .env("FENCEDLEASE_IT_REQUIRED", "1")
            .env("FENCEDLEASE_IT_URLS", join(|c| c.url.clone()))
            .env(
                "FENCEDLEASE_IT_TOKEN_DIRS",
                join(|c| c.token_dir.to_str().expect("utf-8").to_string()),
            )
            .env("FENCEDLEASE_IT_NAMESPACE", &ns.name)
            .env("FENCEDLEASE_IT_LEASE", LEASE)
            .env("FENCEDLEASE_IT_KUBE_SERVER", &access.server)
            .env("FENCEDLEASE_IT_KUBE_CA", path(&access.ca))
            .env("FENCEDLEASE_IT_KUBE_TOKEN", path(&access.token))
            .env("FENCEDLEASE_IT_CONTROL", path(&control))
            // The module has no dependencies: nothing may be downloaded, not even a toolchain.
            .env("GOTOOLCHAIN", "local")
            .env("GOPROXY", "off")
            .env("GOFLAGS", "-mod=readonly")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup log"))
            .stderr(log)
            .process_group(0)
            .spawn()
            .expect("running `go test` (Go 1.24 or later must be on PATH: https://go.dev/dl)"),
    );
    // Serve the Go test's request to kill a sidecar while it runs.
    let deadline = Instant::now() + GO_TEST_TIMEOUT;
    let mut killed = Vec::new();
    let status = loop {
        if let Some(status) = go.0.try_wait().expect("waiting for go test") {
            break status;
        }
        let output = || std::fs::read_to_string(&log_path).unwrap_or_default();
        assert!(
            Instant::now() < deadline,
            "go test did not finish within {GO_TEST_TIMEOUT:?}:\n{}",
            output()
        );
        let request = control.join("kill");
        if let Ok(url) = std::fs::read_to_string(&request) {
            std::fs::remove_file(&request).expect("remove the kill request");
            let car = cars
                .iter()
                .find(|c| c.url == url.trim())
                .unwrap_or_else(|| {
                    panic!("the Go test asked to kill {url:?}, not a sidecar of this test")
                });
            car.proc.signal(Signal::SIGKILL);
            killed.push(car.proc.name.clone());
            std::fs::write(control.join("killed"), &car.proc.name).expect("acknowledge the kill");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let output = std::fs::read_to_string(&log_path).unwrap_or_default();
    eprintln!("{output}");
    let sidecar_logs: String = cars
        .iter()
        .map(|c| format!("--- {} ---\n{}\n", c.proc.name, c.proc.log_tail()))
        .collect();
    assert!(
        status.success(),
        "go test -run Integration failed ({status}):\n{output}\n{sidecar_logs}"
    );
    // A pass must be the integration test passing, not skipping or matching nothing.
    assert!(
        output.contains("--- PASS: TestIntegrationAgainstRealSidecars")
            && !output.contains("--- SKIP")
            && !output.contains("no tests to run"),
        "the Go integration test did not run:\n{output}"
    );
    assert_eq!(killed.len(), 1, "kill requests served: {killed:?}");
}
