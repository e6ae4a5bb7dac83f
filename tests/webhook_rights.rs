//! The real `fencedlease webhook`, acting as the chart's webhook ServiceAccount, has all the
//! rights it needs: with nothing but read access it syncs its cache of every FencedLease (so
//! turns ready), and decides fenced writes, a fresh read of the lease included. The control: the
//! same process acting as an identity bound to nothing never turns ready. (What the webhook's
//! ServiceAccount may NOT do is checked in tests/chart.rs, `rbac_is_enough_and_no_more`.)

use fencedlease_testkit as common;

use std::time::Duration;

use common::helm::{spawn_as, Release};
use common::procs::{scratch_dir, Proc};
use common::webhook::{free_ports, issue_certs};
use common::{client, ensure_crd, eventually, kubectl, TestNamespace};
use serde_json::{json, Value};

const LEASE: &str = "inventory";

/// A webhook process acting as `who`, serving on 127.0.0.1; returns it and its two ports.
fn start_webhook(who: &str, name: &str, dir: &std::path::Path) -> (Proc, u16, u16) {
    let mount = dir.join("certs");
    std::fs::create_dir_all(&mount).expect("mkdir certs");
    if !mount.join("tls.crt").exists() {
        issue_certs(&mount, false);
    }
    let ports = free_ports(2);
    let proc = spawn_as(
        who,
        name,
        dir,
        &[
            "webhook",
            "--listen",
            &format!("127.0.0.1:{}", ports[0]),
            "--tls-cert",
            mount.join("tls.crt").to_str().expect("utf-8"),
            "--tls-key",
            mount.join("tls.key").to_str().expect("utf-8"),
            "--metrics-addr",
            &format!("127.0.0.1:{}", ports[1]),
        ],
    );
    (proc, ports[0], ports[1])
}

fn ready(metrics_port: u16) -> bool {
    std::process::Command::new("curl")
        .args([
            "-fsS",
            "--max-time",
            "1",
            &format!("http://127.0.0.1:{metrics_port}/readyz"),
        ])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Posts an AdmissionReview for an update of a ConfigMap fenced by `LEASE` presenting `token`;
/// returns the review's response.
fn review(dir: &std::path::Path, port: u16, ns: &str, uid: &str, token: i64) -> Value {
    let object = json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "stock", "namespace": ns,
            "labels": {"fencedlease.io/lease": LEASE},
            "annotations": {"fencedlease.io/token": token.to_string(), "fencedlease.io/lease-uid": uid}}});
    let body = json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": format!("req-{token}"),
            "kind": {"group": "", "version": "v1", "kind": "ConfigMap"},
            "resource": {"group": "", "version": "v1", "resource": "configmaps"},
            "name": "stock", "namespace": ns, "operation": "CREATE",
            "userInfo": {"username": "writer"}, "object": object, "dryRun": false}
    });
    let file = dir.join(format!("review-{token}.json"));
    std::fs::write(&file, body.to_string()).expect("writing the review");
    let ca = dir.join("certs/staging/ca.crt");
    let out = std::process::Command::new("curl")
        .args(["-sS", "--max-time", "10", "--cacert"])
        .arg(&ca)
        .args(["-H", "Content-Type: application/json", "--data-binary"])
        .arg(format!("@{}", file.display()))
        .arg(format!("https://127.0.0.1:{port}/validate"))
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout);
    let answer: Value = serde_json::from_str(&text).unwrap_or_else(|e| {
        panic!(
            "the webhook's answer is not JSON ({e}): {text} {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    answer["response"].clone()
}

#[tokio::test]
async fn the_webhook_decides_with_its_read_only_rights() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "webhook-rights").await;
    let release = Release::new(&ns, "flv");
    release.run("install", &[]);
    let n = ns.name.as_str();
    let dir = scratch_dir("webhook-rights");

    // A held lease.
    let lease = json!({"apiVersion": "fencedlease.io/v1alpha1", "kind": "FencedLease",
        "metadata": {"name": LEASE, "namespace": n},
        "spec": {"leaseDurationSeconds": 15, "holderIdentity": "writer-0"}});
    let file = dir.join("lease.json");
    std::fs::write(&file, lease.to_string()).expect("writing the lease");
    let (ok, out, err) = kubectl(&[
        "create",
        "-f",
        file.to_str().expect("utf-8"),
        "-o",
        "jsonpath={.metadata.uid} {.metadata.generation}",
    ]);
    assert!(ok, "creating the lease: {err}");
    let uid = out.split_once(' ').expect("uid and generation").0;
    // A second holder: token 2, so that 1 is stale.
    let (ok, out, err) = kubectl(&[
        "patch",
        "fencedleases.fencedlease.io",
        LEASE,
        "-n",
        n,
        "--type=merge",
        "-p",
        r#"{"spec":{"holderIdentity":"writer-1"}}"#,
        "-o",
        "jsonpath={.metadata.generation}",
    ]);
    assert!(ok, "changing the holder: {err}");
    let generation: i64 = out.trim().parse().expect("generation");
    assert_eq!(generation, 2);

    // As the chart's webhook ServiceAccount: ready (its cache of every FencedLease synced) ...
    let webhook = format!("system:serviceaccount:{n}:{}", release.webhook());
    let (proc, port, metrics_port) = start_webhook(&webhook, "webhook", &dir);
    let what = format!(
        "the webhook, as {webhook}, to turn ready (log: {})",
        proc.log.display()
    );
    eventually(Duration::from_secs(60), &what, || async {
        ready(metrics_port).then_some(())
    })
    .await;
    // ... and deciding: the current token passes, a stale one is refused from the cache, a
    // token from the future is refused after a fresh read of the lease (a get).
    let current = review(&dir, port, n, uid, generation);
    assert_eq!(current["allowed"], true, "{current}");
    let stale = review(&dir, port, n, uid, generation - 1);
    assert_eq!(stale["allowed"], false, "{stale}");
    let message = stale["status"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("stale token"), "{stale}");
    let future = review(&dir, port, n, uid, generation + 5);
    assert_eq!(future["allowed"], false, "{future}");
    let message = future["status"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("is ahead of") && !message.contains("could not read"),
        "the fresh read failed: {future}\n{}",
        proc.log_tail()
    );
    let log = std::fs::read_to_string(&proc.log).unwrap_or_default();
    assert!(
        !log.to_lowercase().contains("forbidden"),
        "the webhook was refused something:\n{log}"
    );
    drop(proc);

    // The control: an identity bound to nothing cannot even fill the cache.
    let nobody = format!("system:serviceaccount:{n}:bound-to-nothing");
    let (proc, _, metrics_port) = start_webhook(&nobody, "nobody", &dir);
    // Its list of FencedLeases is refused (the log says so), and then it is not ready.
    eventually(
        Duration::from_secs(30),
        "the unbound webhook to be refused",
        || async {
            let log = std::fs::read_to_string(&proc.log).unwrap_or_default();
            log.to_lowercase().contains("forbidden").then_some(())
        },
    )
    .await;
    assert!(
        !ready(metrics_port),
        "a webhook acting as {nobody} is ready: the impersonation did not take"
    );
    drop(release);
}
