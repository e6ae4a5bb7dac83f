//! A kopf operator fenced in a few lines (issue 35): two "pods", each a real `fencedlease
//! sidecar` with its API proxy and the kopf sample (clients/python/examples/kopf_operator.py:
//! kopf runs only while its pod leads, `fencedlease.aio.run_while_leading`, and logs in through
//! the proxy), against the real API server and the real fencing webhook. The source objects
//! are protected too, so kopf's own patches of them (its record of what it handled) must be
//! stamped to land. The leading pod freezes in a copy; past its lease the other pod's kopf
//! starts and its copy lands; resumed, the old pod's write is refused and the copy keeps the
//! new leader's data; reconciles start only in a pod's own tenure.
//!
//! kopf comes from the Python package registry into a cached virtual environment
//! (`hack/kopf.sh`, run here; once, then it takes a moment).

use fencedlease_testkit as common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::procs::{scratch_dir, Proc};
use common::samples::{event_of, events, t};
use common::sidecars::{sidecar, Sidecar};
use common::webhook::{free_port, Webhook};
use common::{client, ensure_crd, eventually, repo_root, TestNamespace};
use fencedlease::stamp::{LEASE_LABEL, REFUSAL_CODE};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use nix::sys::signal::Signal;
use serde_json::json;

const LEASE: &str = "sample";
const SOURCE_LABEL: &str = "sample.fencedlease.io/source";

/// The Python with kopf, from `hack/kopf.sh` (which installs it once).
fn kopf_python() -> PathBuf {
    let out = Command::new(repo_root().join("hack/kopf.sh"))
        .output()
        .expect("run hack/kopf.sh");
    assert!(
        out.status.success(),
        "hack/kopf.sh: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// One pod: its sidecar (with the API proxy) and the kopf sample beside it.
struct Pod {
    car: Sidecar,
    kopf: Proc,
    stall: PathBuf,
}

fn pod(python: &Path, dir: &Path, ns: &str, identity: &str) -> Pod {
    let proxy = format!("127.0.0.1:{}", free_port());
    let car = sidecar(dir, ns, LEASE, identity, &["--proxy-listen", &proxy]);
    let events = dir.join(format!("{identity}-kopf.events"));
    let log = dir.join(format!("{identity}-kopf.log"));
    let stall = dir.join(format!("{identity}.stall"));
    let secret = car.token_dir.join(fencedlease::api::API_SECRET_FILE);
    let child = Command::new(python)
        .arg(repo_root().join("clients/python/examples/kopf_operator.py"))
        .env("SAMPLE_NAMESPACE", ns)
        .env("SAMPLE_LEASE", LEASE)
        .env("SAMPLE_IDENTITY", identity)
        .env("FENCEDLEASE_URL", &car.url)
        .env("FENCEDLEASE_TOKEN_DIR", &car.token_dir)
        .env("FENCEDLEASE_API_SECRET_FILE", secret)
        .env("FENCEDLEASE_SAMPLE_STALL_FILE", &stall)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&events).expect("events file"))
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("start the kopf sample");
    let kopf = Proc {
        name: format!("{identity}-kopf"),
        child,
        events,
        log,
    };
    Pod { car, kopf, stall }
}

/// kubectl through a pod's API proxy (its writes stamped by the proxy); stdin as given.
fn kubectl_via(p: &Pod, args: &[&str], stdin: &str) {
    use std::io::Write as _;
    let mut child = Command::new("kubectl")
        .args(["--kubeconfig", &p.car.proxy_kubeconfig()])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kubectl");
    if let Some(mut input) = child.stdin.take() {
        input.write_all(stdin.as_bytes()).expect("kubectl's stdin");
    }
    let out = child.wait_with_output().expect("kubectl");
    assert!(
        out.status.success(),
        "kubectl {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn source(value: &str) -> String {
    json!({"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"name": "src", "labels": {SOURCE_LABEL: "yes", LEASE_LABEL: LEASE}},
           "data": {"value": value}})
    .to_string()
}

#[tokio::test]
async fn kopf_runs_only_while_leading_and_a_frozen_pods_write_is_refused() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "kopf").await;
    let dir = scratch_dir("adoption-kopf");
    let _webhook = Webhook::start(&client, &dir, &ns.name).await;
    let python = kopf_python();
    let pods = [
        pod(&python, &dir, &ns.name, "pod-a"),
        pod(&python, &dir, &ns.name, "pod-b"),
    ];
    // Whichever pod leads runs kopf; the protected source is written through its proxy.
    let leader = eventually(Duration::from_secs(60), "a pod's kopf to lead", || async {
        pods.iter()
            .position(|p| events(&p.kopf).iter().any(|e| e["event"] == "leading"))
    })
    .await;
    let (old, new) = (&pods[leader], &pods[1 - leader]);
    kubectl_via(old, &["apply", "--server-side", "-f", "-"], &source("1"));
    event_of(&old.kopf, "wrote", |e| e["value"] == "1").await;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    // kopf's own patch of the protected source (what it handled) landed: stamped by the proxy.
    eventually(
        Duration::from_secs(30),
        "kopf's record on the source",
        || async {
            let src = cms.get("src").await.ok()?;
            let annotations = src.metadata.annotations?;
            annotations
                .keys()
                .any(|k| k.starts_with("kopf.zalando.org/"))
                .then_some(())
        },
    )
    .await;

    // The leader freezes in its next copy, its sidecar with it (the whole pod).
    std::fs::write(&old.stall, b"").expect("stall file");
    kubectl_via(
        old,
        &[
            "patch",
            "configmap",
            "src",
            "--type",
            "merge",
            "-p",
            r#"{"data":{"value":"2"}}"#,
        ],
        "",
    );
    event_of(&old.kopf, "stalling", |_| true).await;
    old.car.proc.signal(Signal::SIGSTOP);
    // Past its lease the other pod leads, its kopf starts, and its copy of "2" lands.
    let led = event_of(&new.kopf, "leading", |_| true).await;
    event_of(&new.kopf, "wrote", |e| e["value"] == "2").await;
    let by = |cm: ConfigMap| cm.data.unwrap_or_default().get("by").cloned();
    assert_eq!(
        by(cms.get("src-copy").await.expect("the copy")).as_deref(),
        Some(new.car.identity.as_str())
    );
    // The old pod resumes: its sidecar learns it lost, then its kopf's write is refused.
    old.car.proc.signal(Signal::SIGCONT);
    eventually(
        Duration::from_secs(30),
        "the old sidecar to follow",
        || async { old.car.status().filter(|s| s["leading"] == false) },
    )
    .await;
    old.kopf.signal(Signal::SIGCONT);
    let late = event_of(&old.kopf, "late-answer", |_| true).await;
    assert_eq!(late["status"], u64::from(REFUSAL_CODE), "{late}");
    assert_eq!(
        by(cms.get("src-copy").await.expect("the copy")).as_deref(),
        Some(new.car.identity.as_str()),
        "the stale write did not land"
    );
    // Reconciles start only in a pod's own tenure.
    let starts = |p: &Proc| -> Vec<u64> {
        events(p)
            .iter()
            .filter(|e| e["event"] == "reconcile-start")
            .map(t)
            .collect()
    };
    assert!(
        starts(&old.kopf).iter().all(|&s| s < t(&led)),
        "the old pod's kopf started a reconcile in the new one's tenure: {:?}",
        events(&old.kopf)
    );
    assert!(
        starts(&new.kopf).iter().all(|&s| s > t(&led)),
        "{:?}",
        events(&new.kopf)
    );
}
