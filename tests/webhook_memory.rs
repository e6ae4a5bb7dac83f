//! One request body costs the webhook about its bytes in memory, whatever the body holds
//! (issue 14): the server's byte budget (16 MiB of bodies in flight, each up to 8 MiB) is its
//! memory arithmetic only if the parsers keep to that. Each case starts a real `fencedlease
//! webhook`, sends it one 8 MiB body and reads how far its peak RSS (VmHWM) grew. Before the
//! fix, an 8 MiB /mutate body of empty arrays grew it by 265 MiB (debug build), and a smaller
//! one of empty containers by gigabytes.
//!
//! The webhook needs an API server only to start (it asks for its version); the bodies are
//! judged without one. It runs with a 2 GiB address-space limit, so that a regression dies
//! instead of taking the machine's memory.

use fencedlease_testkit as common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::procs::Proc;
use common::webhook::{free_ports, issue_certs};
use serde_json::{json, Value};

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;
/// Just within the server's 8 MiB body limit.
const BODY_BYTES: usize = 8 * MIB - KIB;
/// How far one body may raise the peak: the body itself, and as much again for what is
/// built from it.
const MAX_GROWTH_BYTES: usize = 2 * BODY_BYTES;

/// An AdmissionReview creating `object` (a Pod or a ConfigMap), compact.
fn review(object: &Value, operation: &str) -> String {
    json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "shop", "operation": operation,
            "userInfo": {"username": "system:serviceaccount:shop:worker"},
            "object": object, "dryRun": false,
        }
    })
    .to_string()
}

/// The review of `object` grown to [`BODY_BYTES`]: its string `"@X@"` becomes an array of
/// copies of `item`, or with `members`, its member `"@X@":""` becomes members
/// `"<i>":""`.
fn grown(object: Value, item: &str, members: bool) -> Vec<u8> {
    let base = review(&object, "CREATE");
    let mut fill = String::with_capacity(BODY_BYTES);
    let room = BODY_BYTES - base.len();
    if members {
        let mut i = 0usize;
        while fill.len() + 16 < room {
            fill.push_str(&format!("\"{i}\":\"\","));
            i += 1;
        }
        fill.pop();
        base.replace(r#""@X@":"""#, &fill).into_bytes()
    } else {
        fill.push('[');
        while fill.len() + item.len() + 2 < room {
            fill.push_str(item);
            fill.push(',');
        }
        fill.pop();
        fill.push(']');
        base.replace(r#""@X@""#, &fill).into_bytes()
    }
}

/// A pod asking for the sidecar.
fn pod(annotations: Value, spec: Value) -> Value {
    let mut a = json!({"fencedlease.io/lease": "db"});
    if let (Some(a), Some(more)) = (a.as_object_mut(), annotations.as_object()) {
        a.extend(more.clone());
    }
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "web-1", "namespace": "shop", "annotations": a}, "spec": spec})
}

fn vm_hwm_bytes(pid: i32) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("reading the webhook's status (did it die?): {e}"));
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
        .expect("VmHWM in /proc/PID/status");
    kib * KIB
}

/// A fresh webhook on free ports, under a 2 GiB address-space limit, listening.
async fn webhook(dir: &Path) -> (Proc, u16) {
    let mount = dir.join("certs");
    std::fs::create_dir_all(&mount).expect("mkdir certs");
    issue_certs(&mount, false);
    let ports = free_ports(2);
    let log = dir.join("webhook.log");
    let logf = std::fs::File::create(&log).expect("create log");
    let child = Command::new("prlimit")
        .arg(format!("--as={}", 2048 * MIB))
        .arg("--")
        .arg(env!("CARGO_BIN_EXE_fencedlease"))
        .args(["webhook", "--listen", &format!("127.0.0.1:{}", ports[0])])
        .args(["--metrics-addr", &format!("127.0.0.1:{}", ports[1])])
        .arg("--tls-cert")
        .arg(mount.join("tls.crt"))
        .arg("--tls-key")
        .arg(mount.join("tls.key"))
        .env("KUBECONFIG", common::kubeconfig_path())
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(logf.try_clone().expect("dup log"))
        .stderr(logf)
        .spawn()
        .expect("starting prlimit fencedlease webhook");
    let proc = Proc {
        name: "webhook".into(),
        child,
        events: dir.join("webhook.events"),
        log,
    };
    let port = ports[0];
    common::eventually(Duration::from_secs(30), "the webhook to listen", || async {
        std::net::TcpStream::connect(("127.0.0.1", port)).ok()
    })
    .await;
    // The start's own allocations (client, lease watch, first probe) come first: it is ready
    // once its lease cache has synced and the API server answered.
    let readyz = format!("http://127.0.0.1:{}/readyz", ports[1]);
    common::eventually(
        Duration::from_secs(30),
        "the webhook to be ready",
        || async {
            let out = Command::new("curl")
                .args(["-fsS", "--max-time", "2", &readyz])
                .output()
                .ok()?;
            out.status.success().then_some(())
        },
    )
    .await;
    (proc, port)
}

/// Sends `body` to `path` of a fresh webhook; returns how far its peak RSS grew and the answer.
async fn one_request(name: &str, path: &str, body: &[u8]) -> (usize, Value) {
    let dir = common::procs::scratch_dir(&format!("webhook-memory-{name}"));
    let (proc, port) = webhook(&dir).await;
    let body_file = dir.join("body.json");
    std::fs::write(&body_file, body).expect("write the body");
    let before = vm_hwm_bytes(proc.pid());
    let out = Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "120",
            "-H",
            "Content-Type: application/json",
        ])
        .arg("--cacert")
        .arg(dir.join("certs/staging/ca.crt"))
        .arg("--data-binary")
        .arg(format!("@{}", body_file.display()))
        .arg(format!("https://127.0.0.1:{port}{path}"))
        .output()
        .expect("curl");
    let after = vm_hwm_bytes(proc.pid());
    let answer: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{name}: no AdmissionReview back ({e}): {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            proc.log_tail()
        )
    });
    drop(proc);
    let _ = std::fs::remove_dir_all(&dir);
    (after.saturating_sub(before), answer)
}

/// The pathological bodies, each with a word its answer must have (so that the body was
/// judged, not turned away unread). The first is the one the old code failed on soonest.
fn cases() -> Vec<(&'static str, &'static str, Vec<u8>, &'static str)> {
    let app = json!({"name": "app", "image": "app:1"});
    vec![
        (
            "mutate-unknown-empty-arrays",
            "/mutate",
            grown(
                pod(json!({}), json!({"containers": [app], "future": "@X@"})),
                "[]",
                false,
            ),
            "patch",
        ),
        (
            "mutate-tiny-annotations",
            "/mutate",
            grown(
                pod(json!({"@X@": ""}), json!({"containers": [app]})),
                "",
                true,
            ),
            "patch",
        ),
        (
            "mutate-empty-env",
            "/mutate",
            grown(
                pod(
                    json!({}),
                    json!({"containers": [{"name": "app", "env": "@X@"}]}),
                ),
                "{}",
                false,
            ),
            "patch",
        ),
        (
            "mutate-empty-containers",
            "/mutate",
            grown(pod(json!({}), json!({"containers": "@X@"})), "{}", false),
            "containers",
        ),
        (
            "mutate-empty-volumes",
            "/mutate",
            grown(
                pod(json!({}), json!({"containers": [app], "volumes": "@X@"})),
                "{}",
                false,
            ),
            "patch",
        ),
        (
            "validate-tiny-labels",
            "/validate",
            grown(
                json!({"apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": "inventory", "labels": {"@X@": ""}}}),
                "",
                true,
            ),
            "allowed",
        ),
    ]
}

#[tokio::test]
async fn one_body_costs_the_webhook_about_its_bytes_whatever_it_holds() {
    common::client().await; // the webhook asks the API server for its version at start
    for (name, path, body, word) in cases() {
        let (grew, answer) = one_request(name, path, &body).await;
        eprintln!(
            "{name}: body {:.2} MiB, peak RSS grew {:.1} MiB",
            body.len() as f64 / MIB as f64,
            grew as f64 / MIB as f64
        );
        let text = answer.to_string();
        assert!(
            text.contains(word),
            "{name}: {word:?} in the answer {text:.300}"
        );
        assert!(
            grew <= MAX_GROWTH_BYTES,
            "{name}: one {} byte body raised the webhook's peak RSS by {:.1} MiB, more than {:.1} MiB",
            body.len(),
            grew as f64 / MIB as f64,
            MAX_GROWTH_BYTES as f64 / MIB as f64
        );
    }
}
