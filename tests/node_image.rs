//! The project's image on a real node: the kubelet runs `fencedlease` from `fencedlease:VERSION`
//! through containerd, on the pod network (see tests/common/node.rs for the node).

use fencedlease_testkit as common;

use std::time::Duration;

use common::node::{container_log, fail_fast_on_waiting, hardened, ready_node, IMAGE};
use common::{client, eventually, TestNamespace};
use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use kube::Api;
use serde_json::json;

#[tokio::test]
async fn the_image_runs_fencedlease_crd_to_completion_in_a_pod() {
    let client = client().await;
    let node = ready_node(&client).await;
    let ns = TestNamespace::new(&client, "node-crd").await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "print-crd"},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": false,
            "containers": [{
                "name": "fencedlease",
                "image": IMAGE,
                "imagePullPolicy": "Never",
                "args": ["crd"],
                "securityContext": hardened()
            }]
        }
    }))
    .expect("pod literal");
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("creating the pod");

    let done = eventually(
        Duration::from_secs(120),
        "pod print-crd to finish",
        || async {
            let p = pods.get("print-crd").await.ok()?;
            fail_fast_on_waiting(&p);
            let phase = p.status.as_ref()?.phase.clone()?;
            (phase == "Succeeded" || phase == "Failed").then_some(p)
        },
    )
    .await;
    let status = done.status.clone().expect("status");
    assert_eq!(
        status.phase.as_deref(),
        Some("Succeeded"),
        "the pod failed: {:?}",
        status.container_statuses
    );
    assert_eq!(
        done.spec.as_ref().and_then(|s| s.node_name.clone()),
        node.metadata.name
    );
    let ip = status.pod_ip.unwrap_or_default();
    assert!(!ip.is_empty(), "the pod got no IP on the pod network");

    let log = container_log(&ns.name, &done, "fencedlease", Some("stdout"));
    let crd: serde_json::Value = serde_yaml_ng::from_str(&log)
        .unwrap_or_else(|e| panic!("the pod's output is not YAML ({e}):\n{log}"));
    assert_eq!(crd["kind"], "CustomResourceDefinition", "output:\n{log}");
    assert_eq!(crd["metadata"]["name"], "fencedleases.fencedlease.io");
    assert_eq!(crd["spec"]["names"]["kind"], "FencedLease");
}
