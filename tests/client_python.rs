//! The Python client (`clients/python`) against real `fencedlease sidecar` processes, the real
//! API server and the real fencing webhook.
//!
//! This side starts two sidecars (pod-a, then pod-b once pod-a leads) and the webhook, reads
//! the lease from the API server, and runs the Python integration module
//! (`clients/python/integration/test_sidecar.py`) with `python3 -m unittest`, passing it the
//! sidecars' URLs and token dirs, the lease's generation and UID, and the annotation keys of
//! `elector/src/api.rs`. When the Python side asks (a file `kill` in the sync dir naming a
//! sidecar), this side SIGKILLs that sidecar. The test passes when Python exits 0 and the
//! token Python saw last is the lease's generation on the API server.

use fencedlease_testkit as common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::procs::scratch_dir;
use common::sidecars::sidecar;
use common::webhook::Webhook;
use common::{client, ensure_crd, eventually, kubeconfig_path, repo_root, TestNamespace};
use fencedlease::api::FencedLease;
use fencedlease::api::{LEASE_LABEL, LEASE_UID_ANNOTATION, TOKEN_ANNOTATION, WRITE_ID_ANNOTATION};
use kube::Api;
use nix::sys::signal::Signal;
use serde_json::{json, Value};

const LEASE: &str = "orders";
/// The Python run's limit; its own waits are a few seconds each.
const PYTHON_TIMEOUT: Duration = Duration::from_secs(180);

fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(60)..].join("\n")
}

#[tokio::test]
async fn the_python_client_against_real_sidecars_and_the_webhook() {
    let python = Command::new("python3").arg("--version").output();
    assert!(
        python.as_ref().is_ok_and(|o| o.status.success()),
        "python3 is needed to test the Python client (clients/python): {python:?}"
    );
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "pyclient").await;
    let dir = scratch_dir("pyclient");
    let _webhook = Webhook::start(&client, &dir, &ns.name).await;

    // pod-a first, so that it is the one leading when pod-b joins.
    let a = sidecar(&dir, &ns.name, LEASE, "pod-a", &[]);
    eventually(Duration::from_secs(20), "pod-a to lead", || async {
        a.status().filter(|s| s["leading"] == true)
    })
    .await;
    let b = sidecar(&dir, &ns.name, LEASE, "pod-b", &[]);
    eventually(Duration::from_secs(20), "pod-b to follow pod-a", || async {
        b.status().filter(|s| s["holder"] == "pod-a")
    })
    .await;
    let leases: Api<FencedLease> = Api::namespaced(client.clone(), &ns.name);
    let lease = leases.get(LEASE).await.expect("the lease");
    assert_eq!(lease.holder(), Some("pod-a"));
    let token = lease.token().expect("generation");
    let uid = lease.metadata.uid.clone().expect("uid");

    let sync = dir.join("sync");
    std::fs::create_dir_all(&sync).expect("sync dir");
    let keys = json!({
        "token": TOKEN_ANNOTATION,
        "leaseUid": LEASE_UID_ANNOTATION,
        "writeId": WRITE_ID_ANNOTATION,
        "leaseLabel": LEASE_LABEL,
    });
    let py_root = repo_root().join("clients/python");
    let out_path = dir.join("python.out");
    let out = std::fs::File::create(&out_path).expect("python output file");
    let mut py = Command::new("python3")
        .args(["-m", "unittest", "-v", "integration.test_sidecar"])
        .current_dir(&py_root)
        .env("PYTHONPATH", py_root.join("src"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("KUBECONFIG", kubeconfig_path())
        .env("FL_PY_NAMESPACE", &ns.name)
        .env("FL_PY_LEASE", LEASE)
        .env("FL_PY_LEADER_ID", &a.identity)
        .env("FL_PY_FOLLOWER_ID", &b.identity)
        .env("FL_PY_LEADER_URL", &a.url)
        .env("FL_PY_FOLLOWER_URL", &b.url)
        .env("FL_PY_LEADER_TOKEN_DIR", &a.token_dir)
        .env("FL_PY_FOLLOWER_TOKEN_DIR", &b.token_dir)
        .env("FL_PY_EXPECT_TOKEN", token.to_string())
        .env("FL_PY_EXPECT_LEASE_UID", &uid)
        .env("FL_PY_RUST_KEYS", keys.to_string())
        .env("FL_PY_SYNC_DIR", &sync)
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("dup"))
        .stderr(out)
        .spawn()
        .expect("starting python3");

    // Wait for Python, killing a sidecar when it asks.
    let started = Instant::now();
    let mut killed = None;
    let status = loop {
        if let Some(status) = py.try_wait().expect("waiting for python3") {
            break status;
        }
        if killed.is_none() {
            if let Ok(who) = std::fs::read_to_string(sync.join("kill")) {
                let victim = [&a, &b]
                    .into_iter()
                    .find(|s| s.identity == who.trim())
                    .unwrap_or_else(|| panic!("Python asked to kill {who:?}, no such sidecar"));
                victim.proc.signal(Signal::SIGKILL);
                eprintln!("SIGKILLed {} as the Python test asked", victim.identity);
                killed = Some(victim.identity.clone());
            }
        }
        if started.elapsed() > PYTHON_TIMEOUT {
            let _ = py.kill();
            let _ = py.wait();
            panic!(
                "the Python integration test did not finish within {PYTHON_TIMEOUT:?}:\n{}",
                tail(&out_path)
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let output = std::fs::read_to_string(&out_path).unwrap_or_default();
    eprintln!("{output}");
    assert!(
        status.success(),
        "the Python integration test failed ({status}); its output is above.\n\
         pod-a's log:\n{}\npod-b's log:\n{}",
        a.proc.log_tail(),
        b.proc.log_tail()
    );
    assert_eq!(
        killed.as_deref(),
        Some("pod-b"),
        "Python never asked for the kill"
    );
    // Ran and passed all three phases (none skipped: a skip would still exit 0).
    assert!(output.contains("Ran 3 tests"), "{output}");
    assert!(!output.contains("skipped"), "{output}");

    // What Python last saw is what the API server holds.
    let seen: Value = serde_json::from_str(
        &std::fs::read_to_string(sync.join("result.json")).expect("Python's result.json"),
    )
    .expect("result.json");
    let lease = leases.get(LEASE).await.expect("the lease");
    assert_eq!(seen["token"].as_i64(), lease.token(), "{seen}");
    assert_eq!(seen["leaseUID"].as_str(), lease.metadata.uid.as_deref());
    assert_eq!(lease.holder(), Some("pod-a"));
    assert!(
        lease.token() > Some(token + 1),
        "two handovers since {token}"
    );
}
