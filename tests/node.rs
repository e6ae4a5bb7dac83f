//! The project's image in real pods, on a cluster with a node (`hack/node.sh up`, then
//! `hack/image.sh`): the kubelet runs `fencedlease` from `fencedlease:0.1.0` through containerd.
//!
//! How pods here reach the API server (see hack/node.sh): on the pod network, through the
//! `kubernetes` Service IP that the kubelet hands every pod in KUBERNETES_SERVICE_HOST/PORT (the
//! node NATs it to the API server; its certificate is valid for that IP). The ServiceAccount
//! admission plugin is off in hack/cluster.sh, so nothing mounts a token automatically: the
//! pods mount their ServiceAccount's token Secret (made by the controller-manager) at the
//! standard path themselves.
//!
//! `kubectl logs` cannot reach a kubelet that listens on loopback only, so logs are read from
//! the kubelet's files under /var/log/pods.

mod common;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use common::{client, ensure_crd, eventually, TestNamespace};
use fencedlease::api::FencedLease;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client};
use serde_json::json;

const IMAGE: &str = "fencedlease:0.1.0";
const POD_LOGS: &str = "/var/log/pods";

fn how_to_start_a_node() -> &'static str {
    "start a node on the test cluster with `hack/node.sh up` (after `hack/cluster.sh up`, with the \
     same FENCEDLEASE_CLUSTER_DIR and FL_* ports), then build and import the image with \
     `hack/image.sh`"
}

/// The name of a Ready node; panics, saying how to start one, when there is none.
async fn ready_node(client: &Client) -> String {
    let nodes = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await
        .expect("listing nodes");
    let ready = nodes.items.iter().find(|n| {
        n.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
    });
    match ready {
        Some(n) => n.metadata.name.clone().expect("node name"),
        None => panic!(
            "no Ready node in the cluster (nodes: {:?}): these tests run real pods.\n{}",
            nodes
                .items
                .iter()
                .filter_map(|n| n.metadata.name.as_deref())
                .collect::<Vec<_>>(),
            how_to_start_a_node()
        ),
    }
}

/// Panics at once with the reason when a pod's container cannot start (for example the image
/// was never imported), instead of waiting for a timeout.
fn fail_fast_on_waiting(pod: &Pod) {
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.clone())
        .unwrap_or_default();
    for cs in statuses {
        let Some(w) = cs.state.and_then(|s| s.waiting) else {
            continue;
        };
        let reason = w.reason.unwrap_or_default();
        if matches!(
            reason.as_str(),
            "ErrImageNeverPull" | "ErrImagePull" | "ImagePullBackOff" | "InvalidImageName"
        ) {
            panic!(
                "pod {} cannot start: {reason}: {}\nthe image {IMAGE} is not on the node: run `hack/image.sh`",
                pod.metadata.name.as_deref().unwrap_or("?"),
                w.message.unwrap_or_default()
            );
        }
        if matches!(
            reason.as_str(),
            "CreateContainerConfigError" | "CreateContainerError" | "RunContainerError"
        ) {
            panic!(
                "pod {}: container {} cannot start: {reason}: {}",
                pod.metadata.name.as_deref().unwrap_or("?"),
                cs.name,
                w.message.unwrap_or_default()
            );
        }
    }
}

/// The lines a container wrote, from the kubelet's log file (CRI format: `TIME STREAM TAG text`,
/// tag `P` for a partial line continued in the next record).
fn container_log(ns: &str, pod: &Pod, container: &str) -> String {
    let name = pod.metadata.name.as_deref().expect("pod name");
    let uid = pod.metadata.uid.as_deref().expect("pod uid");
    let dir = PathBuf::from(POD_LOGS).join(format!("{ns}_{name}_{uid}/{container}"));
    let file = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| {
            panic!(
                "reading {}: {e} (is this the node's machine?)",
                dir.display()
            )
        })
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .max()
        .unwrap_or_else(|| panic!("no log file in {}", dir.display()));
    let raw = std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
    let mut out = String::new();
    for record in raw.lines() {
        let mut parts = record.splitn(4, ' ');
        let (_time, _stream, tag) = (parts.next(), parts.next(), parts.next());
        out.push_str(parts.next().unwrap_or(""));
        if tag != Some("P") {
            out.push('\n');
        }
    }
    out
}

/// The restrictive security context every container here runs with: the kubelet refuses to
/// start it unless the image's own user is not root.
fn hardened() -> serde_json::Value {
    json!({
        "runAsNonRoot": true,
        "allowPrivilegeEscalation": false,
        "readOnlyRootFilesystem": true,
        "capabilities": {"drop": ["ALL"]}
    })
}

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
        Some(node)
    );
    let ip = status.pod_ip.unwrap_or_default();
    assert!(!ip.is_empty(), "the pod got no IP on the pod network");

    let log = container_log(&ns.name, &done, "fencedlease");
    let crd: serde_json::Value = serde_yaml_ng::from_str(&log)
        .unwrap_or_else(|e| panic!("the pod's output is not YAML ({e}):\n{log}"));
    assert_eq!(crd["kind"], "CustomResourceDefinition", "output:\n{log}");
    assert_eq!(crd["metadata"]["name"], "fencedleases.fencedlease.io");
    assert_eq!(crd["spec"]["names"]["kind"], "FencedLease");
}

/// The FencedLease's holder, if any.
async fn holder(leases: &Api<FencedLease>, name: &str) -> Option<String> {
    let lease = leases.get_opt(name).await.ok()??;
    lease.spec.holder_identity.filter(|h| !h.is_empty())
}

fn is_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn is_running(p: &Pod) -> bool {
    p.metadata.deletion_timestamp.is_none()
        && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
}

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

    // The controller-manager's token controller makes the ServiceAccount's token Secret
    // (Kubernetes 1.20); mount it where in-cluster clients look for it.
    let token_secret = eventually(
        Duration::from_secs(30),
        "the token Secret of ServiceAccount worker (made by kube-controller-manager)",
        || async {
            let sa = sas.get("worker").await.ok()?;
            sa.secrets?.into_iter().find_map(|s| s.name)
        },
    )
    .await;

    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "worker"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "worker"}},
            "template": {
                "metadata": {"labels": {"app": "worker"}},
                "spec": {
                    "serviceAccountName": "worker",
                    "automountServiceAccountToken": false,
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
                        "volumeMounts": [
                            {"name": "token", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": true},
                            {"name": "run", "mountPath": "/var/run/fencedlease"}
                        ]
                    }],
                    "volumes": [
                        {"name": "token", "secret": {"secretName": token_secret}},
                        {"name": "run", "emptyDir": {"medium": "Memory"}}
                    ]
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

    // The follower logged that it follows the leader.
    let follower_name = running
        .iter()
        .find(|n| **n != leader)
        .expect("a follower")
        .clone();
    let follower = pods.get(&follower_name).await.expect("follower pod");
    let log = container_log(&ns.name, &follower, "sidecar");
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
