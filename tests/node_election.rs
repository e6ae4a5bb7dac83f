//! The sidecar without the chart, in real pods: a plain Deployment of two pods that run
//! `fencedlease sidecar` elects exactly one, only it is Ready, and deleting it hands the lease to
//! the other.

use fencedlease_testkit as common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::node::{
    container_log, fail_fast_on_waiting, hardened, holder, is_ready, is_running, ready_node, IMAGE,
};
use common::{client, ensure_crd, eventually, TestNamespace};
use fencedlease::api::FencedLease;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::Api;
use serde_json::json;

/// The sidecar without the chart: a Deployment that runs `fencedlease sidecar` itself.
#[tokio::test]
async fn a_deployment_of_two_sidecars_elects_exactly_one_of_its_pods() {
    let client = client().await;
    ready_node(&client).await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "node-sidecar").await;
    let lease_name = "singleton";

    // The workload's identity and the least it needs: its lease, nothing else.
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), &ns.name);
    let sa: ServiceAccount =
        serde_json::from_value(json!({"metadata": {"name": "worker"}})).expect("sa literal");
    sas.create(&PostParams::default(), &sa)
        .await
        .expect("creating the ServiceAccount");
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "fencedlease-sidecar"},
        "rules": [
            {"apiGroups": ["fencedlease.io"], "resources": ["fencedleases"],
             "verbs": ["get", "list", "watch", "create", "update"]},
            {"apiGroups": ["fencedlease.io"], "resources": ["fencedleases/status"],
             "verbs": ["update"]}
        ]
    }))
    .expect("role literal");
    Api::<Role>::namespaced(client.clone(), &ns.name)
        .create(&PostParams::default(), &role)
        .await
        .expect("creating the Role");
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "fencedlease-sidecar"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "fencedlease-sidecar"},
        "subjects": [{"kind": "ServiceAccount", "name": "worker", "namespace": ns.name}]
    }))
    .expect("rolebinding literal");
    Api::<RoleBinding>::namespaced(client.clone(), &ns.name)
        .create(&PostParams::default(), &binding)
        .await
        .expect("creating the RoleBinding");

    common::wait_service_account(&client, &ns.name, "worker").await;

    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "worker"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "worker"}},
            "template": {
                "metadata": {"labels": {"app": "worker"}},
                "spec": {
                    "serviceAccountName": "worker",
                    "terminationGracePeriodSeconds": 10,
                    "containers": [{
                        "name": "sidecar",
                        "image": IMAGE,
                        "imagePullPolicy": "Never",
                        "args": ["sidecar", "--lease", lease_name, "--lease-duration", "5",
                                 "--ready-only-when-leader"],
                        "env": [
                            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}
                        ],
                        // Ready only while leading: the kubelet itself shows who leads.
                        "readinessProbe": {
                            "exec": {"command": ["/usr/local/bin/fencedlease", "probe", "http://127.0.0.1:8787/readyz"]},
                            "periodSeconds": 1, "timeoutSeconds": 3, "failureThreshold": 1
                        },
                        "securityContext": hardened(),
                        "volumeMounts": [{"name": "run", "mountPath": "/var/run/fencedlease"}]
                    }],
                    "volumes": [{"name": "run", "emptyDir": {"medium": "Memory"}}]
                }
            }
        }
    }))
    .expect("deployment literal");
    Api::<Deployment>::namespaced(client.clone(), &ns.name)
        .create(&PostParams::default(), &deployment)
        .await
        .expect("creating the Deployment");

    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    let leases: Api<FencedLease> = Api::namespaced(client.clone(), &ns.name);
    let by_app = ListParams::default().labels("app=worker");

    // Both pods run; exactly one is Ready, and it is the lease's holder.
    let (running, leader) = eventually(
        Duration::from_secs(120),
        "two Running pods, exactly one of them Ready and holding the lease",
        || async {
            let list = pods.list(&by_app).await.ok()?.items;
            list.iter().for_each(fail_fast_on_waiting);
            let running: BTreeSet<String> = list
                .iter()
                .filter(|p| is_running(p))
                .filter_map(|p| p.metadata.name.clone())
                .collect();
            let ready: Vec<String> = list
                .iter()
                .filter(|p| is_running(p) && is_ready(p))
                .filter_map(|p| p.metadata.name.clone())
                .collect();
            let holder = holder(&leases, lease_name).await?;
            (running.len() == 2 && ready == [holder.clone()]).then_some((running, holder))
        },
    )
    .await;
    assert!(running.contains(&leader));

    // And it stays that way: never two leaders, never a holder outside the Deployment.
    for _ in 0..20 {
        let list = pods.list(&by_app).await.expect("listing pods").items;
        let ready: Vec<_> = list.iter().filter(|p| is_ready(p)).collect();
        assert!(ready.len() <= 1, "two pods Ready (leading) at once");
        let h = holder(&leases, lease_name).await;
        assert_eq!(
            h.as_deref(),
            Some(leader.as_str()),
            "the lease moved without a failure"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let lease = leases.get(lease_name).await.expect("lease");
    assert!(lease.metadata.generation.unwrap_or(0) >= 1);

    // The follower logged that it started.
    let follower_name = running
        .iter()
        .find(|n| **n != leader)
        .expect("a follower")
        .clone();
    let follower = pods.get(&follower_name).await.expect("follower pod");
    let log = container_log(&ns.name, &follower, "sidecar", None);
    assert!(
        log.contains("sidecar API listening"),
        "the follower's log lacks its start:\n{log}"
    );

    // Deleting the leader's pod (SIGTERM: the sidecar releases the lease) hands the lease to
    // another pod of the Deployment.
    pods.delete(&leader, &DeleteParams::default())
        .await
        .expect("deleting the leader pod");
    let next = eventually(
        Duration::from_secs(60),
        "another pod of the Deployment to take the lease",
        || async {
            let h = holder(&leases, lease_name).await?;
            if h == leader {
                return None;
            }
            let p = pods.get(&h).await.ok()?;
            (is_running(&p) && is_ready(&p)).then_some(h)
        },
    )
    .await;
    assert_ne!(next, leader);
}
