//! Pods on the test cluster's node (`hack/node.sh up`, then `hack/image.sh`) for the node tests
//! (tests/node_*.rs): the kubelet runs `fencedlease` from the image `fencedlease:VERSION` through
//! containerd.
//!
//! How pods reach the API server (see hack/node.sh): on the pod network, through the
//! `kubernetes` Service IP that the kubelet hands every pod (the node NATs it to the API server).
//! The API server reaches the webhook Service by dialing its endpoints (kube-apiserver
//! `--enable-aggregator-routing`, hack/cluster.sh). Service-account tokens are mounted by the
//! ServiceAccount admission plugin.
//!
//! `kubectl logs` cannot reach a kubelet that listens on loopback only, so logs are read from
//! the kubelet's files under /var/log/pods (and containerd is driven with `ctr`, see
//! [`super::containerd`]). The node tests therefore run on the node's machine, as root (as
//! hack/test.sh does).

use std::path::PathBuf;

use fencedlease::api::FencedLease;
use k8s_openapi::api::core::v1::{Container, ContainerStatus, Node, Pod};
use kube::api::ListParams;
use kube::{Api, Client};
use serde_json::json;

pub const IMAGE: &str = concat!("fencedlease:", env!("CARGO_PKG_VERSION"));
/// The sidecar's image (`FL_IMAGE_ROLE=sidecar hack/image.sh`), which the chart injects.
pub const SIDECAR_IMAGE: &str = concat!("fencedlease-sidecar:", env!("CARGO_PKG_VERSION"));
/// The node's pause image (hack/node.sh builds and imports it): a do-nothing app container. The
/// project's image holds only the `fencedlease` binary, which has no idle subcommand.
pub const APP_IMAGE: &str = "localhost/fencedlease/pause:3.4";
pub const POD_LOGS: &str = "/var/log/pods";
pub const ROLE_LABEL: &str = "fencedlease.io/role";
pub const LEASE_LABEL: &str = "fencedlease.io/lease";
/// Annotation hack/node.sh puts on the Node: its containerd socket.
pub const SOCKET_ANNOTATION: &str = "fencedlease.io/containerd-socket";

pub fn how_to_start_a_node() -> &'static str {
    "start a node on the test cluster with `hack/node.sh up` (after `hack/cluster.sh up`, with the \
     same FENCEDLEASE_CLUSTER_DIR and FL_* ports), then build and import the image with \
     `FL_IMAGE_PROFILE=debug hack/image.sh` (hack/test.sh does all of this)"
}

/// The Ready node; panics, saying how to start one, when there is none.
pub async fn ready_node(client: &Client) -> Node {
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
        Some(n) => n.clone(),
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
pub fn fail_fast_on_waiting(pod: &Pod) {
    for cs in container_statuses(pod) {
        let Some(w) = cs.state.and_then(|s| s.waiting) else {
            continue;
        };
        let reason = w.reason.unwrap_or_default();
        if matches!(
            reason.as_str(),
            "ErrImageNeverPull" | "ErrImagePull" | "ImagePullBackOff" | "InvalidImageName"
        ) {
            panic!(
                "pod {} cannot start: {reason}: {}\nthe image is not on the node: run \
                 `FL_IMAGE_PROFILE=debug hack/image.sh` ({IMAGE}), `FL_IMAGE_PROFILE=debug \
                 FL_IMAGE_ROLE=sidecar hack/image.sh` ({SIDECAR_IMAGE}) or `hack/node.sh up` ({APP_IMAGE})",
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

/// What a container wrote to `stream` ("stdout", "stderr", or both with None), from the
/// kubelet's log file (CRI format: `TIME STREAM TAG text`, tag `P` for a partial line continued
/// in the next record). Empty when there is no log (yet).
pub fn container_log(ns: &str, pod: &Pod, container: &str, stream: Option<&str>) -> String {
    let name = pod.metadata.name.as_deref().expect("pod name");
    let uid = pod.metadata.uid.as_deref().expect("pod uid");
    let dir = PathBuf::from(POD_LOGS).join(format!("{ns}_{name}_{uid}/{container}"));
    let Some(file) = std::fs::read_dir(&dir).ok().and_then(|d| {
        d.filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "log"))
            .max()
    }) else {
        return String::new();
    };
    let raw = std::fs::read_to_string(&file).unwrap_or_default();
    let mut out = String::new();
    for record in raw.lines() {
        let mut parts = record.splitn(4, ' ');
        let (_time, from, tag) = (parts.next(), parts.next(), parts.next());
        if stream.is_some() && from != stream {
            continue;
        }
        out.push_str(parts.next().unwrap_or(""));
        if tag != Some("P") {
            out.push('\n');
        }
    }
    out
}

/// The last `n` lines of a container's log, without terminal colours (for failure messages).
pub fn log_tail(ns: &str, pod: &Pod, container: &str, n: usize) -> String {
    let log = container_log(ns, pod, container, None);
    let mut clean = String::with_capacity(log.len());
    let mut chars = log.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // ESC [ ... m
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            clean.push(c);
        }
    }
    let lines: Vec<&str> = clean.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The restrictive security context every container here runs with, all that Pod Security's
/// `restricted` level asks of a container: the kubelet refuses to start it unless the image's
/// own user is not root.
pub fn hardened() -> serde_json::Value {
    json!({
        "runAsNonRoot": true,
        "allowPrivilegeEscalation": false,
        "readOnlyRootFilesystem": true,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"}
    })
}

pub fn name_of(p: &Pod) -> String {
    p.metadata.name.clone().unwrap_or_default()
}

pub fn is_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

pub fn is_running(p: &Pod) -> bool {
    p.metadata.deletion_timestamp.is_none()
        && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
}

pub fn has_leader_label(p: &Pod) -> bool {
    p.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(ROLE_LABEL))
        .is_some_and(|v| v == "leader")
}

/// The containers that run beside each other for the pod's life: native sidecars (init
/// containers with `restartPolicy: Always`, from 1.29) first, in their order, then the
/// ordinary containers.
pub fn running_containers(p: &Pod) -> Vec<Container> {
    let Some(spec) = p.spec.as_ref() else {
        return Vec::new();
    };
    let sidecars = spec.init_containers.iter().flatten();
    sidecars
        .filter(|c| c.restart_policy.as_deref() == Some("Always"))
        .chain(spec.containers.iter())
        .cloned()
        .collect()
}

pub fn container_names(p: &Pod) -> Vec<String> {
    running_containers(p).into_iter().map(|c| c.name).collect()
}

/// The statuses of [`running_containers`] (a native sidecar's is among the init containers').
pub fn container_statuses(p: &Pod) -> Vec<ContainerStatus> {
    let names = container_names(p);
    let Some(status) = p.status.as_ref() else {
        return Vec::new();
    };
    let init = status.init_container_statuses.iter().flatten();
    init.chain(status.container_statuses.iter().flatten())
        .filter(|c| names.contains(&c.name))
        .cloned()
        .collect()
}

pub fn all_containers_ready(p: &Pod) -> bool {
    let statuses = container_statuses(p);
    !statuses.is_empty()
        && statuses.len() == container_names(p).len()
        && statuses.iter().all(|c| c.ready)
}

/// containerd's id of a container of the pod ("containerd://<id>" in its status).
pub fn container_id(p: &Pod, container: &str) -> String {
    container_statuses(p)
        .into_iter()
        .find(|c| c.name == container)
        .and_then(|c| c.container_id)
        .and_then(|id| id.strip_prefix("containerd://").map(str::to_string))
        .unwrap_or_else(|| panic!("pod {} has no running container {container}", name_of(p)))
}

/// One line per pod: name, Ready, containers, leader label, phase (for failure messages).
pub fn describe(pods: &[Pod]) -> String {
    pods.iter()
        .map(|p| {
            let ready = container_statuses(p).iter().filter(|c| c.ready).count();
            format!(
                "{} {}/{} ready={} containers={:?} leader-label={} phase={:?}{}",
                name_of(p),
                ready,
                container_names(p).len(),
                is_ready(p),
                container_names(p),
                has_leader_label(p),
                p.status.as_ref().and_then(|s| s.phase.clone()),
                if p.metadata.deletion_timestamp.is_some() {
                    " (terminating)"
                } else {
                    ""
                }
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The FencedLease's holder, if any.
pub async fn holder(leases: &Api<FencedLease>, name: &str) -> Option<String> {
    let lease = leases.get_opt(name).await.ok()??;
    lease.holder().map(str::to_string)
}
