//! Switching the fencing mode with `helm upgrade` on the real node (issue 37): webhook -> both ->
//! policy -> both -> webhook, while a holder writes and a replaced holder keeps trying every
//! 100 ms. No stale write is accepted at any moment, the holder writes again after each step
//! and writes last. A switch straight from webhook to policy (or back), which could leave a
//! moment in which nothing judges, is refused by the chart, naming the way through `both`.
//! The holder's refused stretches are printed as measurements, not asserted.

use fencedlease_testkit as common;

use std::time::{Duration, Instant};

use common::fencing::{fenced_merge, move_lease, protected_meta};
use common::helm::{helm, Release};
use common::node::ready_node;
use common::operator::{wait_certificate_and_ca_bundles, wait_operator_ready};
use common::writers::{keep_writing, long_held_lease, report};
use common::{client, ensure_crd, eventually, kubectl, TestNamespace};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::PostParams;
use kube::Api;
use serde_json::json;

/// Waits (on the API server's watch, through kubectl) until both of the release's Deployments
/// have rolled out: every replica updated and ready, no old one left.
fn rolled_out(release: &Release) {
    for d in [release.controller(), release.webhook()] {
        let (ok, out, err) = kubectl(&[
            "rollout",
            "status",
            &format!("deployment/{d}"),
            "-n",
            &release.namespace,
            "--timeout=240s",
        ]);
        assert!(ok, "deployment {d} did not roll out: {out}{err}");
    }
}

/// Whether the release's fencing webhook configuration and policy exist.
fn mechanisms(release: &Release) -> (bool, bool) {
    let exists = |kind: &str, name: &str| {
        let (ok, out, err) = kubectl(&["get", kind, name, "--ignore-not-found", "-o", "name"]);
        assert!(ok, "kubectl get {kind} {name}: {err}");
        !out.trim().is_empty()
    };
    let policy = format!("{}-fencing", release.fullname());
    (
        exists("validatingwebhookconfiguration", &release.validating()),
        exists("validatingadmissionpolicy", &policy),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switching_the_fencing_mode_through_both_accepts_no_stale_write() {
    let client = client().await;
    ready_node(&client).await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "node-modes").await;
    let release = Release::install_on_node(&ns, "flm", &[]);
    wait_operator_ready(&client, &release, 2).await;
    wait_certificate_and_ca_bundles(&client, &release).await;
    let replaced = long_held_lease(&client, &ns.name, "app", "app-0").await;
    let holder = move_lease(&client, &ns.name, "app", "app-1").await;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    eventually(
        Duration::from_secs(60),
        "the holder's stamped create, with the webhook judging",
        || async {
            let cm: ConfigMap =
                serde_json::from_value(json!({"metadata": protected_meta("copy", "app", &holder)}))
                    .expect("literal");
            cms.create(&PostParams::default(), &cm)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        },
    )
    .await;

    let started = Instant::now();
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let every = Duration::from_millis(100);
    let holder_writes = keep_writing(cms.clone(), holder.clone(), every, started, stop.clone());
    let stale_writes = keep_writing(cms.clone(), replaced.clone(), every, started, stop);
    let mut marks = Vec::new();
    for mode in ["both", "policy", "both", "webhook"] {
        marks.push((format!("helm upgrade to {mode}"), started.elapsed()));
        release.run_on_node("upgrade", &["--set", &format!("fencing.mode={mode}")]);
        rolled_out(&release);
        marks.push((format!("{mode} rolled out"), started.elapsed()));
        assert_eq!(
            mechanisms(&release),
            (mode != "policy", mode != "webhook"),
            "{mode}: (webhook configuration, policy)"
        );
        eventually(
            Duration::from_secs(90),
            "a write of the holder accepted after the switch",
            || async {
                fenced_merge(&cms, "copy", &holder, json!({"data": {"after": mode}}))
                    .await
                    .map(|_| ())
                    .map_err(|(c, m)| format!("{c}: {m}"))
            },
        )
        .await;
    }
    stop_tx.send(true).expect("the writers listen");
    let holder_writes = holder_writes.await.expect("holder writer");
    let stale_writes = stale_writes.await.expect("stale writer");
    report(&holder_writes, &stale_writes, &marks);
    assert_eq!(
        stale_writes.accepted(),
        0,
        "stale writes accepted while the mode switched"
    );
    assert!(holder_writes.accepted() > 0, "the holder never wrote");
    let copy = cms.get("copy").await.expect("ConfigMap copy");
    assert_eq!(
        copy.data
            .unwrap_or_default()
            .get("writer")
            .map(String::as_str),
        Some(holder.token.to_string().as_str()),
        "the copy's last writer is not the holder"
    );

    // Straight from webhook to policy: refused by the chart, the release left as it was.
    let args = release.on_node_args(&["--set", "fencing.mode=policy"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let args = release.args("upgrade", &args);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, out, err) = helm(&args);
    assert!(
        !ok && err.contains("Upgrade with fencing.mode=both first"),
        "a switch straight to policy: {out}{err}"
    );
    assert_eq!(mechanisms(&release), (true, false), "webhook mode kept");
}
