//! The injection webhook refuses hostNetwork pods, against the real API server: their loopback is
//! the node's, so the sidecar's token API and API proxy would be open to every process on the node.

use fencedlease_testkit as common;

use std::time::Duration;

use common::procs::scratch_dir;
use common::webhook::Webhook;
use common::{client, ensure_crd, eventually, TestNamespace};
use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use kube::Api;
use serde_json::{json, Value};

fn pod(name: &str, host_network: bool, labels: Value) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels, "annotations": {"fencedlease.io/lease": "web"}},
        "spec": {
            "hostNetwork": host_network,
            "containers": [{"name": "app", "image": "busybox", "command": ["sleep", "3600"]}]
        }
    }))
    .expect("pod literal")
}

fn has_sidecar(p: &Pod) -> bool {
    p.spec.as_ref().is_some_and(|s| {
        s.containers.iter().any(|c| c.name == "fencedlease")
            || s.init_containers
                .iter()
                .flatten()
                .any(|c| c.name == "fencedlease")
    })
}

/// The value of the injection counter for `result`, 0 when absent.
fn injections(wh: &Webhook, result: &str) -> u64 {
    let key = format!("fencedlease_webhook_injections_total{{result=\"{result}\"}} ");
    wh.metrics()
        .lines()
        .find_map(|l| l.strip_prefix(&key))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn host_network_pods_are_refused_the_sidecar_with_the_reason_and_the_way_out() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "hostnet").await;
    let dir = scratch_dir("hostnet");
    let wh = Webhook::start(&client, &dir, &ns.name).await;
    wh.register_mutating(&client, &ns.name).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);

    // The same pod without hostNetwork gets the sidecar (once the webhook is in effect).
    let injected = eventually(
        Duration::from_secs(20),
        "the mutating webhook to be in effect",
        || async {
            let name = format!("web-{:06x}", common::rand_u32() & 0x00ff_ffff);
            let p = pods
                .create(&PostParams::default(), &pod(&name, false, json!({})))
                .await
                .ok()?;
            has_sidecar(&p).then_some(p)
        },
    )
    .await;
    assert_ne!(
        injected.spec.as_ref().and_then(|s| s.host_network),
        Some(true)
    );
    assert_eq!(injections(&wh, "refused"), 0);

    // With hostNetwork, the CREATE is refused, saying why and what to do instead.
    match pods
        .create(&PostParams::default(), &pod("hostnet", true, json!({})))
        .await
    {
        Err(kube::Error::Api(s)) => {
            for want in [
                "hostNetwork",
                "any process on the node",
                "without hostNetwork",
                "fencedlease.io/inject: \"false\"",
                "fencedlease campaign",
            ] {
                assert!(s.message.contains(want), "{want:?} in {}", s.message);
            }
        }
        other => panic!("a hostNetwork pod asking for the sidecar must be refused, got {other:?}"),
    }
    assert!(
        pods.get_opt("hostnet").await.expect("get").is_none(),
        "the refused pod must not exist"
    );
    assert_eq!(injections(&wh, "refused"), 1, "{}", wh.metrics());

    // The way out the message names: the opt-out label; the pod is created as written.
    let out = pods
        .create(
            &PostParams::default(),
            &pod(
                "hostnet-optout",
                true,
                json!({"fencedlease.io/inject": "false"}),
            ),
        )
        .await
        .expect("an opted-out hostNetwork pod is created");
    assert!(!has_sidecar(&out));
    assert_eq!(out.spec.as_ref().and_then(|s| s.host_network), Some(true));
}
