//! The project in real pods, on a cluster with a node (`hack/node.sh up`, then `hack/image.sh`):
//! the kubelet runs `fencedlease` from the image `fencedlease:0.1.0` through containerd.
//!
//! - the image runs (`fencedlease crd` in a pod), and a plain sidecar Deployment elects one pod;
//! - `helm install` of the chart: the operator pods become Ready, the active controller issues
//!   the webhook certificate and caBundle, both webhooks answer through the Service (a fenced
//!   write is refused, an annotated pod gets the sidecar), and `helm uninstall` removes it;
//! - a Deployment with the injection annotation and leader-only readiness: one pod leads, only
//!   it is Ready and labelled `fencedlease.io/role=leader`;
//! - deleting the leader pod, and freezing it (containerd's task pause, the freezer cgroup: a
//!   stalled VM) past its lease, both give a new leader with a larger token; the frozen pod turns
//!   unready while still frozen; the thawed one's write with its old token is refused by the API
//!   server;
//! - a rolling update of that Deployment hands leadership over; the longest time without a
//!   holder is measured and printed (run with `--nocapture` to see the numbers).
//!
//! How pods reach the API server (see hack/node.sh): on the pod network, through the
//! `kubernetes` Service IP that the kubelet hands every pod (the node NATs it to the API server).
//! The API server reaches the webhook Service by dialing its endpoints (kube-apiserver
//! `--enable-aggregator-routing`, hack/cluster.sh). Service-account tokens are mounted by the
//! ServiceAccount admission plugin.
//!
//! Each chart test installs a release of its own into a namespace of its own, with both webhook
//! configurations' namespace selectors restricted to that namespace's `fencedlease.io/test-ns`
//! label and the controller watching that namespace only, so that parallel tests do not see
//! each other's releases.
//!
//! `kubectl logs` cannot reach a kubelet that listens on loopback only, so logs are read from
//! the kubelet's files under /var/log/pods; freezing uses `ctr` against the node's containerd.
//! These tests therefore run on the node's machine, as root (as hack/test.sh does).

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::helm::{objects_of_release, Release};
use common::{client, ensure_crd, eventually, kubectl, TestNamespace};
use fencedlease::api::FencedLease;
use futures::StreamExt;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, ContainerStatus, Namespace, Node, Pod, Secret, ServiceAccount,
};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use kube::{Api, Client};
use serde_json::json;

const IMAGE: &str = "fencedlease:0.1.0";
/// The node's pause image (hack/node.sh builds and imports it): a do-nothing app container. The
/// project's image holds only the `fencedlease` binary, which has no idle subcommand.
const APP_IMAGE: &str = "localhost/fencedlease/pause:3.4";
const POD_LOGS: &str = "/var/log/pods";
const ROLE_LABEL: &str = "fencedlease.io/role";
const LEASE_LABEL: &str = "fencedlease.io/lease";
/// Annotation hack/node.sh puts on the Node: its containerd socket.
const SOCKET_ANNOTATION: &str = "fencedlease.io/containerd-socket";

fn how_to_start_a_node() -> &'static str {
    "start a node on the test cluster with `hack/node.sh up` (after `hack/cluster.sh up`, with the \
     same FENCEDLEASE_CLUSTER_DIR and FL_* ports), then build and import the image with \
     `FL_IMAGE_PROFILE=debug hack/image.sh` (hack/test.sh does all of this)"
}

/// The Ready node; panics, saying how to start one, when there is none.
async fn ready_node(client: &Client) -> Node {
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
fn fail_fast_on_waiting(pod: &Pod) {
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
                 `FL_IMAGE_PROFILE=debug hack/image.sh` ({IMAGE}) or `hack/node.sh up` ({APP_IMAGE})",
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
fn container_log(ns: &str, pod: &Pod, container: &str, stream: Option<&str>) -> String {
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
fn log_tail(ns: &str, pod: &Pod, container: &str, n: usize) -> String {
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

/// Polls `f` every 100 ms until it returns Ok; after `timeout`, the last state `f` described in
/// its Err.
async fn try_poll<T, F, Fut>(timeout: Duration, mut f: F) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let last = match f().await {
            Ok(v) => return Ok(v),
            Err(state) => state,
        };
        if tokio::time::Instant::now() >= deadline {
            return Err(last);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// [`try_poll`], panicking on timeout with `what` and the last state.
async fn poll<T, F, Fut>(timeout: Duration, what: &str, f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    try_poll(timeout, f).await.unwrap_or_else(|last| {
        panic!("timed out after {timeout:?} waiting for: {what}\nlast state: {last}")
    })
}

fn name_of(p: &Pod) -> String {
    p.metadata.name.clone().unwrap_or_default()
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

fn has_leader_label(p: &Pod) -> bool {
    p.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(ROLE_LABEL))
        .is_some_and(|v| v == "leader")
}

/// The containers that run beside each other for the pod's life: native sidecars (init
/// containers with `restartPolicy: Always`, from 1.29) first, in their order, then the
/// ordinary containers.
fn running_containers(p: &Pod) -> Vec<Container> {
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

fn container_names(p: &Pod) -> Vec<String> {
    running_containers(p).into_iter().map(|c| c.name).collect()
}

/// The statuses of [`running_containers`] (a native sidecar's is among the init containers').
fn container_statuses(p: &Pod) -> Vec<ContainerStatus> {
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

fn all_containers_ready(p: &Pod) -> bool {
    let statuses = container_statuses(p);
    !statuses.is_empty()
        && statuses.len() == container_names(p).len()
        && statuses.iter().all(|c| c.ready)
}

/// containerd's id of a container of the pod ("containerd://<id>" in its status).
fn container_id(p: &Pod, container: &str) -> String {
    container_statuses(p)
        .into_iter()
        .find(|c| c.name == container)
        .and_then(|c| c.container_id)
        .and_then(|id| id.strip_prefix("containerd://").map(str::to_string))
        .unwrap_or_else(|| panic!("pod {} has no running container {container}", name_of(p)))
}

/// One line per pod: name, Ready, containers, leader label, phase (for failure messages).
fn describe(pods: &[Pod]) -> String {
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

// ---------------------------------------------------------------------------------------------
// helm and a release of the chart

/// Labels the namespace `fencedlease.io/injection=enabled`: it opts in to sidecar injection
/// (the chart's default injection selector, merged with the test's namespace label).
async fn opt_in_to_injection(client: &Client, ns: &str) {
    Api::<Namespace>::all(client.clone())
        .patch(
            ns,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"fencedlease.io/injection": "enabled"}}})),
        )
        .await
        .unwrap_or_else(|e| panic!("labelling namespace {ns} for injection: {e}"));
}

/// The last log lines of every container of every operator pod (for failure messages).
async fn operator_logs(client: &Client, release: &Release) -> String {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &release.namespace);
    let list = pods
        .list(&ListParams::default().labels(&release.pod_selector()))
        .await
        .map(|l| l.items)
        .unwrap_or_default();
    list.iter()
        .flat_map(|p| {
            container_names(p).into_iter().map(move |c| {
                format!(
                    "--- {} {c}:\n{}",
                    name_of(p),
                    log_tail(&release.namespace, p, &c, 6)
                )
            })
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The operator's two components, each a Deployment of its own.
const COMPONENTS: [&str; 2] = ["controller", "webhook"];

/// Waits until `replicas` pods of each operator component (controller and webhook) run Ready;
/// returns them all.
async fn wait_operator_ready(client: &Client, release: &Release, replicas: usize) -> Vec<Pod> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &release.namespace);
    let timeout = Duration::from_secs(150);
    let found = try_poll(timeout, || async {
        let mut all = Vec::new();
        for component in COMPONENTS {
            let lp = ListParams::default().labels(&release.component_selector(component));
            let list = pods.list(&lp).await.map_err(|e| e.to_string())?.items;
            list.iter().for_each(fail_fast_on_waiting);
            let live: Vec<Pod> = list.into_iter().filter(is_running).collect();
            let ready = live.iter().filter(|p| all_containers_ready(p)).count();
            if live.len() != replicas || ready != replicas {
                return Err(format!("{component}: {}", describe(&live)));
            }
            all.extend(live);
        }
        Ok(all)
    })
    .await;
    match found {
        Ok(pods) => pods,
        Err(last) => panic!(
            "timed out after {timeout:?} waiting for {replicas} controller and {replicas} webhook \
             pods of release {} Running and Ready\nlast state: {last}\n{}",
            release.name,
            operator_logs(client, release).await
        ),
    }
}

/// The operator component a pod belongs to ("controller" or "webhook").
fn component_of(p: &Pod) -> String {
    p.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get("app.kubernetes.io/component"))
        .cloned()
        .unwrap_or_default()
}

/// Waits until the active controller has issued the certificate Secret and written its CA into
/// every webhook of both configurations; returns the CA (PEM).
async fn wait_certificate_and_ca_bundles(client: &Client, release: &Release) -> Vec<u8> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &release.namespace);
    let vwcs: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let mwcs: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let timeout = Duration::from_secs(90);
    let found = try_poll(timeout, || async {
        let secret = secrets
            .get_opt(&release.tls_secret())
            .await
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("no Secret {} yet", release.tls_secret()))?;
        let data = secret.data.clone().unwrap_or_default();
        let ca = data
            .get("ca.crt")
            .map(|b| b.0.clone())
            .ok_or("the Secret has no ca.crt")?;
        let trusts = |b: Option<&k8s_openapi::ByteString>| b.map(|b| &b.0) == Some(&ca);
        let v = vwcs
            .get(&release.validating())
            .await
            .map_err(|e| e.to_string())?;
        let m = mwcs
            .get(&release.mutating())
            .await
            .map_err(|e| e.to_string())?;
        let v_ok = v
            .webhooks
            .iter()
            .flatten()
            .all(|w| trusts(w.client_config.ca_bundle.as_ref()));
        let m_ok = m
            .webhooks
            .iter()
            .flatten()
            .all(|w| trusts(w.client_config.ca_bundle.as_ref()));
        if v_ok && m_ok {
            Ok(ca)
        } else {
            Err(format!(
                "caBundle is the Secret's CA: in {} {v_ok}, in {} {m_ok}",
                release.validating(),
                release.mutating()
            ))
        }
    })
    .await;
    match found {
        Ok(ca) => ca,
        Err(last) => panic!(
            "timed out after {timeout:?} waiting for the active controller to issue the webhook \
             certificate Secret {} and write its CA into both webhook configurations\n\
             last state: {last}\n{}",
            release.tls_secret(),
            operator_logs(client, release).await
        ),
    }
}

/// A pod that asks for injection (annotation `fencedlease.io/lease`), with the do-nothing app.
fn annotated_pod(name: &str, lease: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": {"fencedlease.io/lease": lease}},
        "spec": {
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "app", "image": APP_IMAGE, "imagePullPolicy": "Never",
                            "securityContext": hardened()}]
        }
    }))
    .expect("pod literal")
}

/// Waits until the injection webhook answers through the Service: a dry-run create of an
/// annotated pod comes back with the sidecar. (The injection webhook fails open, so a pod
/// created before it answers would silently lack the sidecar.)
async fn wait_injection_served(client: &Client, ns: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let dry = PostParams {
        dry_run: true,
        field_manager: None,
    };
    poll(
        Duration::from_secs(60),
        "the injection webhook to add the sidecar to a (dry-run) annotated pod",
        || async {
            let pod = pods
                .create(&dry, &annotated_pod("injection-probe", "probe"))
                .await
                .map_err(|e| e.to_string())?;
            let names = container_names(&pod);
            if names.iter().any(|n| n == "fencedlease") {
                Ok(())
            } else {
                Err(format!("containers without injection: {names:?}"))
            }
        },
    )
    .await
}

// ---------------------------------------------------------------------------------------------
// A Deployment with the injected sidecar

const WORKLOAD: &str = "worker";
const LEASE: &str = "worker";
const LEASE_SECONDS: u64 = 5;

/// A test's namespace with a release of the chart and a Deployment of two annotated pods
/// (injection, leader-only readiness) that campaign for the FencedLease `worker`. Fields drop in
/// order: the release is uninstalled before the namespace goes.
struct Injected {
    client: Client,
    release: Release,
    ns: TestNamespace,
}

impl Injected {
    async fn start(prefix: &str) -> Injected {
        let client = client().await;
        ready_node(&client).await;
        ensure_crd();
        let ns = TestNamespace::new(&client, prefix).await;
        opt_in_to_injection(&client, &ns.name).await;
        // One operator replica is enough here (the helm test runs the default two).
        let release = Release::install_on_node(&ns, "fl", &["--set", "replicas=1"]);
        wait_operator_ready(&client, &release, 1).await;
        wait_certificate_and_ca_bundles(&client, &release).await;
        wait_injection_served(&client, &ns.name).await;
        let me = Injected {
            client,
            release,
            ns,
        };
        me.deploy().await;
        me
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.ns.name)
    }
    fn leases(&self) -> Api<FencedLease> {
        Api::namespaced(self.client.clone(), &self.ns.name)
    }
    fn deployments(&self) -> Api<Deployment> {
        Api::namespaced(self.client.clone(), &self.ns.name)
    }

    /// The workload's ServiceAccount bound to the chart's sidecar ClusterRole, its FencedLease
    /// (the sidecar may not create one), and the Deployment.
    async fn deploy(&self) {
        let ns = &self.ns.name;
        let sas: Api<ServiceAccount> = Api::namespaced(self.client.clone(), ns);
        let sa: ServiceAccount =
            serde_json::from_value(json!({"metadata": {"name": WORKLOAD}})).expect("sa literal");
        sas.create(&PostParams::default(), &sa)
            .await
            .expect("creating the ServiceAccount");
        let binding: RoleBinding = serde_json::from_value(json!({
            "metadata": {"name": format!("{WORKLOAD}-fencedlease")},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": self.release.sidecar_role()},
            "subjects": [{"kind": "ServiceAccount", "name": WORKLOAD, "namespace": ns}]
        }))
        .expect("rolebinding literal");
        Api::<RoleBinding>::namespaced(self.client.clone(), ns)
            .create(&PostParams::default(), &binding)
            .await
            .expect("creating the RoleBinding");
        let lease: FencedLease = serde_json::from_value(json!({
            "apiVersion": "fencedlease.io/v1alpha1", "kind": "FencedLease",
            "metadata": {"name": LEASE},
            "spec": {"leaseDurationSeconds": LEASE_SECONDS}
        }))
        .expect("lease literal");
        self.leases()
            .create(&PostParams::default(), &lease)
            .await
            .expect("creating the FencedLease");
        // Rather than wait through the ReplicaSet's retries.
        common::wait_service_account(&self.client, ns, WORKLOAD).await;

        let deployment: Deployment = serde_json::from_value(json!({
            "metadata": {"name": WORKLOAD},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": {"app": WORKLOAD}},
                // Only the leader is ever Ready, so a rollout that must keep a pod available
                // never finishes: with maxUnavailable below 100% the new pods (followers, never
                // Ready) wait for the old leader to go, and it is not let go until a new pod is
                // Ready. Checked: with maxUnavailable 1 the rollout stalls.
                "strategy": {"type": "RollingUpdate",
                             "rollingUpdate": {"maxSurge": 1, "maxUnavailable": "100%"}},
                "template": {
                    "metadata": {
                        "labels": {"app": WORKLOAD},
                        "annotations": {
                            "fencedlease.io/lease": LEASE,
                            "fencedlease.io/ready-only-when-leader": "true"
                        }
                    },
                    "spec": {
                        "serviceAccountName": WORKLOAD,
                        "terminationGracePeriodSeconds": 10,
                        "containers": [{
                            "name": "app",
                            "image": APP_IMAGE,
                            "imagePullPolicy": "Never",
                            "securityContext": hardened()
                        }]
                    }
                }
            }
        }))
        .expect("deployment literal");
        self.deployments()
            .create(&PostParams::default(), &deployment)
            .await
            .expect("creating the Deployment");
    }

    /// The Deployment's pods that are not being deleted.
    async fn live_pods(&self) -> Result<Vec<Pod>, String> {
        let list = self
            .pods()
            .list(&ListParams::default().labels(&format!("app={WORKLOAD}")))
            .await
            .map_err(|e| e.to_string())?
            .items;
        list.iter().for_each(fail_fast_on_waiting);
        Ok(list
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .collect())
    }

    /// Waits for the steady state: two running pods, both with the injected sidecar, exactly
    /// one Ready, and that one holds the lease and alone carries the leader label. Returns
    /// (leader pod, follower pod, lease).
    async fn steady(&self, timeout: Duration) -> (Pod, Pod, FencedLease) {
        poll(
            timeout,
            "two running pods with the sidecar, exactly one Ready, holding the lease and labelled leader",
            || async {
                let live = self.live_pods().await?;
                let lease = self
                    .leases()
                    .get(LEASE)
                    .await
                    .map_err(|e| e.to_string())?;
                let holder = lease.holder().map(str::to_string);
                let state = format!("holder {holder:?}, token {:?}; pods: {}", lease.token(), describe(&live));
                let running: Vec<&Pod> = live.iter().filter(|p| is_running(p)).collect();
                if running.len() != 2 {
                    return Err(state);
                }
                for p in &running {
                    let names = container_names(p);
                    assert!(
                        names.iter().any(|n| n == "fencedlease"),
                        "pod {} runs without the injected sidecar (containers {names:?}): the \
                         injection webhook was not called or failed open",
                        name_of(p)
                    );
                }
                let ready: Vec<&&Pod> = running.iter().filter(|p| is_ready(p)).collect();
                let labelled: Vec<&&Pod> = running.iter().filter(|p| has_leader_label(p)).collect();
                let Some(h) = holder else { return Err(state) };
                if ready.len() == 1
                    && name_of(ready[0]) == h
                    && labelled.len() == 1
                    && name_of(labelled[0]) == h
                    && all_containers_ready(ready[0])
                {
                    let follower = running.iter().find(|p| name_of(p) != h).expect("follower");
                    // The follower's sidecar is up (and so watching the lease).
                    if !container_log(&self.ns.name, follower, "fencedlease", None)
                        .contains("sidecar API listening")
                    {
                        return Err(format!("{state}; the follower's sidecar has not started yet"));
                    }
                    return Ok(((*ready[0]).clone(), (*follower).clone(), lease.clone()));
                }
                Err(state)
            },
        )
        .await
    }

    /// The sidecar log of every pod of the Deployment, for failure messages.
    async fn sidecar_logs(&self) -> String {
        let list = self
            .pods()
            .list(&ListParams::default().labels(&format!("app={WORKLOAD}")))
            .await
            .map(|l| l.items)
            .unwrap_or_default();
        list.iter()
            .map(|p| {
                format!(
                    "--- {}:\n{}",
                    name_of(p),
                    log_tail(&self.ns.name, p, "fencedlease", 12)
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

// ---------------------------------------------------------------------------------------------
// A record of the lease's holder over time

#[derive(Clone, Debug)]
struct Seen {
    at: Instant,
    holder: Option<String>,
    token: i64,
}

/// Watches the FencedLease and records each change of holder or token, stamped with the time
/// this process received it. Runs on the test runtime's other worker thread, so the test's own
/// blocking calls do not delay the stamps.
struct LeaseLog {
    seen: Arc<Mutex<Vec<Seen>>>,
    task: tokio::task::JoinHandle<()>,
}

impl LeaseLog {
    async fn start(api: Api<FencedLease>, name: &str) -> LeaseLog {
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let rec = seen.clone();
        let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let task = tokio::spawn(async move {
            let mut stream = watcher(api, config).boxed();
            while let Some(ev) = stream.next().await {
                let lease = match ev {
                    Ok(watcher::Event::Apply(l) | watcher::Event::InitApply(l)) => l,
                    _ => continue,
                };
                let s = Seen {
                    at: Instant::now(),
                    holder: lease.holder().map(str::to_string),
                    token: lease.token().unwrap_or(0),
                };
                let mut v = rec.lock().expect("lease log");
                if v.last()
                    .is_none_or(|l| l.holder != s.holder || l.token != s.token)
                {
                    v.push(s);
                }
            }
        });
        let log = LeaseLog { seen, task };
        // The initial list is in before the test goes on.
        eventually(
            Duration::from_secs(10),
            "the lease watch's first event",
            || async { (!log.seen.lock().expect("lease log").is_empty()).then_some(()) },
        )
        .await;
        log
    }

    fn entries(&self) -> Vec<Seen> {
        self.seen.lock().expect("lease log").clone()
    }
}

impl Drop for LeaseLog {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// How leadership moved away from `old` after `from`: whether `old` released (the first change
/// after it held the lease left the lease free) and the longest and total time with no holder
/// until `until`.
#[derive(Debug)]
struct Handover {
    released: bool,
    longest_gap: Duration,
    total_gap: Duration,
    history: String,
}

fn handover(entries: &[Seen], old: &str, from: Instant, until: Instant) -> Handover {
    // The state at `from` is the last entry before it.
    let start = entries.iter().rposition(|s| s.at <= from).unwrap_or(0);
    let window = &entries[start..];
    let released = window
        .iter()
        .find(|s| s.holder.as_deref() != Some(old))
        .is_some_and(|s| s.holder.is_none());
    let (mut longest, mut total) = (Duration::ZERO, Duration::ZERO);
    for (i, s) in window.iter().enumerate() {
        if s.holder.is_some() || s.at > until {
            continue;
        }
        let begin = s.at.max(from);
        let end = window.get(i + 1).map_or(until, |n| n.at.min(until));
        let gap = end.saturating_duration_since(begin);
        longest = longest.max(gap);
        total += gap;
    }
    let history = window
        .iter()
        .map(|s| {
            format!(
                "+{:.3}s {} (token {})",
                s.at.saturating_duration_since(from).as_secs_f64(),
                s.holder.as_deref().unwrap_or("<free>"),
                s.token
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    Handover {
        released,
        longest_gap: longest,
        total_gap: total,
        history,
    }
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

fn summary(label: &str, gaps: &[Duration]) -> String {
    let mut s = gaps.to_vec();
    s.sort();
    format!(
        "{label}: {} samples, longest gap without a holder: min {}, median {}, max {} (target from the Benchmarks issue: graceful handover p50 < 100 ms)",
        s.len(),
        ms(s[0]),
        ms(s[s.len() / 2]),
        ms(s[s.len() - 1])
    )
}

// ---------------------------------------------------------------------------------------------
// Freezing a pod with containerd's task pause (the freezer cgroup)

/// The node's containerd socket: the Node's annotation (hack/node.sh), else where hack/node.sh
/// puts it beside the test cluster's kubeconfig.
fn containerd_socket(node: &Node) -> PathBuf {
    let from_node = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(SOCKET_ANNOTATION))
        .map(PathBuf::from);
    let beside = common::kubeconfig_path()
        .parent()
        .map(|d| d.join("node/containerd/containerd.sock"));
    from_node
        .into_iter()
        .chain(beside)
        .find(|p| p.exists())
        .unwrap_or_else(|| {
            panic!(
                "cannot find the node's containerd socket (Node annotation {SOCKET_ANNOTATION}, or \
                 node/containerd/containerd.sock beside {}): freezing a pod needs `ctr` on the \
                 node's machine",
                common::kubeconfig_path().display()
            )
        })
}

fn ctr(socket: &Path, args: &[&str]) -> String {
    let out = Command::new("ctr")
        .arg("--address")
        .arg(socket)
        .args(["--namespace", "k8s.io"])
        .args(args)
        .output()
        .expect("running ctr (Debian's containerd package; hack/node.sh installs it)");
    assert!(
        out.status.success(),
        "ctr {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// containerd's event stream (`ctr events`), recorded to a file while it lives: the order in
/// which the node started and stopped tasks, as the runtime saw it.
struct CtrEvents {
    child: std::process::Child,
    out: PathBuf,
}

impl CtrEvents {
    fn start(socket: &Path, out: PathBuf) -> CtrEvents {
        let file = std::fs::File::create(&out).expect("creating the events file");
        let child = Command::new("ctr")
            .arg("--address")
            .arg(socket)
            .args(["--namespace", "k8s.io", "events"])
            .stdout(file)
            .spawn()
            .expect("running ctr events (Debian's containerd package; hack/node.sh installs it)");
        CtrEvents { child, out }
    }

    /// Stops recording; returns (topic, container id) of every container's task start and exit,
    /// in order.
    fn stop(mut self) -> Vec<(String, String)> {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let text = std::fs::read_to_string(&self.out).unwrap_or_default();
        text.lines()
            .filter_map(|l| {
                let topic = ["/tasks/start", "/tasks/exit"]
                    .into_iter()
                    .find(|t| l.contains(&format!(" {t} ")))?;
                let body = &l[l.find(topic)? + topic.len()..];
                let v: serde_json::Value = serde_json::from_str(body.trim()).ok()?;
                let container = v["container_id"].as_str()?;
                // An exec'd process (an exec probe) exits as a task of the container too, under
                // an id of its own: only the container's own task counts.
                if topic == "/tasks/exit" && v["id"].as_str() != Some(container) {
                    return None;
                }
                Some((topic.to_string(), container.to_string()))
            })
            .collect()
    }
}

impl Drop for CtrEvents {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The host pid of a container's task.
fn task_pid(socket: &Path, id: &str) -> u32 {
    let list = ctr(socket, &["tasks", "ls"]);
    list.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            (f.next()? == id).then(|| f.next()?.parse().ok())?
        })
        .next()
        .unwrap_or_else(|| panic!("containerd runs no task {id}:\n{list}"))
}

/// The token file as the pod's app container sees it (None when absent), read through the
/// container's root on the host.
fn token_file(socket: &Path, pod: &Pod) -> Option<String> {
    let pid = task_pid(socket, &container_id(pod, "app"));
    std::fs::read_to_string(format!("/proc/{pid}/root/var/run/fencedlease/token"))
        .ok()
        .map(|s| s.trim().to_string())
}

/// Every container of a pod, its sandbox included, paused (frozen) until `thaw` or drop.
struct Frozen {
    socket: PathBuf,
    ids: Vec<String>,
    since: Instant,
}

impl Frozen {
    fn freeze(socket: &Path, pod: &Pod) -> Frozen {
        let uid = pod.metadata.uid.as_deref().expect("pod uid");
        let filter = format!("labels.\"io.kubernetes.pod.uid\"=={uid}");
        let ids: Vec<String> = ctr(socket, &["containers", "ls", "-q", &filter])
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect();
        // The sandbox and the two containers.
        assert!(
            ids.len() >= 3,
            "containers of pod {} in containerd: {ids:?}",
            name_of(pod)
        );
        let mut frozen = Frozen {
            socket: socket.to_path_buf(),
            ids: vec![],
            since: Instant::now(),
        };
        for id in ids {
            ctr(socket, &["tasks", "pause", &id]);
            frozen.ids.push(id);
        }
        for id in &frozen.ids {
            let list = ctr(socket, &["tasks", "ls"]);
            let line = list
                .lines()
                .find(|l| l.starts_with(id.as_str()))
                .unwrap_or_default();
            assert!(line.contains("PAUSED"), "task {id} is not paused: {line:?}");
        }
        frozen
    }

    fn thaw(&mut self) {
        for id in std::mem::take(&mut self.ids) {
            let _ = Command::new("ctr")
                .arg("--address")
                .arg(&self.socket)
                .args(["--namespace", "k8s.io", "tasks", "resume", &id])
                .output();
        }
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        // Never leave a frozen pod behind: the kubelet could not stop it.
        self.thaw();
    }
}

// ---------------------------------------------------------------------------------------------
// The tests

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

/// The FencedLease's holder, if any.
async fn holder(leases: &Api<FencedLease>, name: &str) -> Option<String> {
    let lease = leases.get_opt(name).await.ok()??;
    lease.holder().map(str::to_string)
}

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

#[tokio::test]
async fn helm_install_runs_the_operator_serves_both_webhooks_and_uninstall_removes_it() {
    let client = client().await;
    ready_node(&client).await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "node-helm").await;
    opt_in_to_injection(&client, &ns.name).await;
    let started = Instant::now();
    let phase = |what: &str| {
        println!(
            "helm test: {what} after {:.1} s",
            started.elapsed().as_secs_f64()
        )
    };
    let mut release = Release::install_on_node(&ns, "flh", &[]);
    let full = release.fullname();

    // The chart's default two pods of each component run Ready, one container each (the
    // webhook apart from the controller, under its own read-only ServiceAccount).
    let operators = wait_operator_ready(&client, &release, 2).await;
    phase("two controller and two webhook pods Ready");
    for p in &operators {
        let component = component_of(p);
        assert_eq!(
            container_names(p),
            [component.as_str()],
            "operator pod {}",
            name_of(p)
        );
        let account = p.spec.as_ref().and_then(|s| s.service_account_name.clone());
        let expected = if component == "webhook" {
            release.webhook()
        } else {
            release.controller_account()
        };
        assert_eq!(account, Some(expected), "ServiceAccount of {}", name_of(p));
    }
    let operator_names: BTreeSet<String> = operators
        .iter()
        .filter(|p| component_of(p) == "controller")
        .map(name_of)
        .collect();

    // One controller is active: it holds the election lease ...
    let leases: Api<FencedLease> = Api::namespaced(client.clone(), &ns.name);
    let active = poll(
        Duration::from_secs(60),
        "one operator pod to hold the controller's election lease",
        || async {
            let h = holder(&leases, &release.election_lease()).await;
            match h {
                Some(h) if operator_names.contains(&h) => Ok(h),
                other => Err(format!(
                    "holder {other:?}, operator pods {operator_names:?}"
                )),
            }
        },
    )
    .await;
    // The election lease is owned by the webhook Service, so that uninstalling removes it.
    let election = leases
        .get(&release.election_lease())
        .await
        .expect("the election lease");
    let owners: Vec<(String, String)> = election
        .metadata
        .owner_references
        .unwrap_or_default()
        .into_iter()
        .map(|o| (o.kind, o.name))
        .collect();
    assert_eq!(
        owners,
        [("Service".to_string(), release.fullname())],
        "owners of the election lease"
    );
    // ... and has issued the serving certificate, owned by the webhook Service, and written its
    // CA into both webhook configurations.
    let ca = wait_certificate_and_ca_bundles(&client, &release).await;
    let secret = Api::<Secret>::namespaced(client.clone(), &ns.name)
        .get(&release.tls_secret())
        .await
        .expect("the certificate Secret");
    assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
    let keys: BTreeSet<String> = secret
        .data
        .clone()
        .unwrap_or_default()
        .into_keys()
        .collect();
    for k in ["tls.crt", "tls.key", "ca.crt"] {
        assert!(keys.contains(k), "the Secret lacks {k}: {keys:?}");
    }
    let owners = secret.metadata.owner_references.clone().unwrap_or_default();
    assert!(
        owners.iter().any(|o| o.kind == "Service" && o.name == full),
        "the Secret is not owned by the webhook Service {full}: {owners:?}"
    );
    assert!(String::from_utf8_lossy(&ca).contains("BEGIN CERTIFICATE"));
    phase(&format!(
        "certificate and caBundles issued by the active controller {active}"
    ));

    // The fencing webhook answers through the Service: a labelled write without a token is
    // refused with its message (the API server dials the Service's endpoints).
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    let unfenced: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "protected", "labels": {LEASE_LABEL: "inventory"}},
        "data": {"items": "1"}
    }))
    .expect("configmap literal");
    let refusal = poll(
        Duration::from_secs(60),
        "the fencing webhook to refuse a protected write without a token",
        || async {
            match cms.create(&PostParams::default(), &unfenced).await {
                Ok(_) => panic!(
                    "a write to a ConfigMap labelled {LEASE_LABEL} without a token was allowed: the \
                     fencing webhook was not called"
                ),
                Err(kube::Error::Api(s)) if s.code == 409 && s.message.contains("fencedlease:") => {
                    Ok(s.message)
                }
                Err(e) => Err(e.to_string()),
            }
        },
    )
    .await;
    assert!(
        refusal.contains("admission webhook \"fencing.fencedlease.io\" denied the request")
            && refusal.contains("fencedlease.io/token"),
        "unexpected refusal: {refusal}"
    );
    phase(&format!("fencing webhook refused a write: {refusal}"));
    // `kubectl fencedlease check` sees the same: its dry-run probe of the fence in this
    // namespace is refused by a webhook replica.
    let check = std::process::Command::new(env!("CARGO_BIN_EXE_fencedlease"))
        .args(["kubectl", "check", "-n", &ns.name])
        .env("KUBECONFIG", common::kubeconfig_path())
        .output()
        .expect("running fencedlease kubectl check");
    let report = String::from_utf8_lossy(&check.stdout);
    let fence = format!(
        "✓ the fence answers: a dry-run write of a protected ConfigMap without a token in namespace {} was refused (409)",
        ns.name
    );
    assert!(
        report.contains(&fence),
        "{fence:?} missing from check:\n{report}"
    );
    phase("kubectl fencedlease check: the fence answers");

    // The injection webhook answers through the Service: an annotated pod gets the sidecar.
    wait_injection_served(&client, &ns.name).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    let created = pods
        .create(&PostParams::default(), &annotated_pod("injected", "demo"))
        .await
        .expect("creating an annotated pod");
    let sidecar = running_containers(&created)
        .into_iter()
        .find(|c| c.name == "fencedlease")
        .unwrap_or_else(|| {
            panic!(
                "the annotated pod was created without the sidecar: {:?}",
                container_names(&created)
            )
        });
    assert_eq!(sidecar.image.as_deref(), Some(IMAGE));
    assert_eq!(sidecar.image_pull_policy.as_deref(), Some("Never"));
    let args = sidecar.args.clone().unwrap_or_default();
    assert_eq!(
        &args[..3],
        ["sidecar", "--lease", "demo"],
        "sidecar args {args:?}"
    );
    pods.delete(
        "injected",
        &DeleteParams {
            grace_period_seconds: Some(0),
            ..DeleteParams::default()
        },
    )
    .await
    .expect("deleting the annotated pod");

    phase("injection webhook added the sidecar");
    // helm uninstall: everything of the release goes (pods and the certificate Secret through
    // the garbage collector, hence the wait), the CRD stays.
    release.uninstall();
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns.name);
    let release_name = release.name.clone();
    poll(
        Duration::from_secs(120),
        "helm uninstall to remove every object of the release, its pods and its certificate Secret",
        || async {
            let mut left: Vec<String> = objects_of_release(&release_name)
                .into_iter()
                .map(|(name, _)| name)
                .collect();
            let all_pods = pods
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?;
            left.extend(all_pods.items.iter().map(|p| format!("pod/{}", name_of(p))));
            let all_secrets = secrets
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?;
            left.extend(
                all_secrets
                    .items
                    .iter()
                    .filter(|s| {
                        s.type_.as_deref() != Some("kubernetes.io/service-account-token")
                            || s.metadata
                                .name
                                .as_deref()
                                .is_some_and(|n| n.starts_with(&full))
                    })
                    .map(|s| format!("secret/{}", s.metadata.name.clone().unwrap_or_default())),
            );
            if left.is_empty() {
                Ok(())
            } else {
                Err(format!("left: {left:?}"))
            }
        },
    )
    .await;
    phase("uninstalled: objects, pods and Secrets gone");
    for (kind, name) in [
        ("clusterrole", release.sidecar_role()),
        ("clusterrole", full.clone()),
        ("clusterrolebinding", full.clone()),
        ("validatingwebhookconfiguration", release.validating()),
        ("mutatingwebhookconfiguration", release.mutating()),
    ] {
        let (ok, out, err) = kubectl(&["get", kind, &name, "--ignore-not-found", "-o", "name"]);
        assert!(
            ok && out.trim().is_empty(),
            "{kind}/{name} is still there: {out}{err}"
        );
    }
    // No FencedLease is left: the election lease goes with its owner, the Service (the garbage
    // collector deletes it shortly after).
    poll(
        Duration::from_secs(60),
        "the election lease to be garbage-collected with the Service",
        || async {
            let left: Vec<String> = leases
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?
                .items
                .iter()
                .filter_map(|l| l.metadata.name.clone())
                .collect();
            if left.is_empty() {
                Ok(())
            } else {
                Err(format!("FencedLeases left after uninstall: {left:?}"))
            }
        },
    )
    .await;
    let (ok, _, err) = kubectl(&["get", "crd", "fencedleases.fencedlease.io"]);
    assert!(ok, "the CRD must stay after uninstall: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_injected_deployment_has_one_leader_the_only_ready_and_labelled_pod() {
    let w = Injected::start("node-inject").await;
    let (leader, follower, lease) = w.steady(Duration::from_secs(120)).await;
    let leader_name = name_of(&leader);
    println!(
        "leader {leader_name} (token {:?}), follower {}",
        lease.token(),
        name_of(&follower)
    );
    // The sidecar was injected as a native sidecar where the server has them (1.29+: an init
    // container that runs for the pod's life, ahead of the app), else as an ordinary container.
    if common::server_minor(&w.client).await >= 29 {
        assert_eq!(container_names(&leader), ["fencedlease", "app"]);
    } else {
        assert_eq!(container_names(&leader), ["app", "fencedlease"]);
    }
    // The holder reports the token it holds; the token is the lease's generation.
    let status = lease.status.clone().unwrap_or_default();
    assert_eq!(
        status.holder_identity.as_deref(),
        Some(leader_name.as_str())
    );
    assert_eq!(
        status.token,
        lease.token(),
        "status.token vs metadata.generation"
    );

    // And it stays that way for a while: one Ready pod, the holder, alone labelled.
    for _ in 0..20 {
        let live = w.live_pods().await.expect("listing pods");
        let ready: Vec<String> = live.iter().filter(|p| is_ready(p)).map(name_of).collect();
        let labelled: Vec<String> = live
            .iter()
            .filter(|p| has_leader_label(p))
            .map(name_of)
            .collect();
        assert_eq!(
            ready.as_slice(),
            std::slice::from_ref(&leader_name),
            "Ready pods: {}",
            describe(&live)
        );
        assert_eq!(
            labelled.as_slice(),
            std::slice::from_ref(&leader_name),
            "labelled pods: {}",
            describe(&live)
        );
        assert_eq!(
            holder(&w.leases(), LEASE).await.as_deref(),
            Some(leader_name.as_str()),
            "the lease moved without a failure\n{}",
            w.sidecar_logs().await
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_leader_pod_gives_a_new_leader_with_a_larger_token() {
    let w = Injected::start("node-delete").await;
    let log = LeaseLog::start(w.leases(), LEASE).await;
    let mut gaps = vec![];
    for round in 1..=3 {
        let (leader, _, lease) = w.steady(Duration::from_secs(120)).await;
        let (old, old_token) = (name_of(&leader), lease.token().expect("token"));
        let t0 = Instant::now();
        // The default grace period: the kubelet sends SIGTERM, the sidecar releases.
        w.pods()
            .delete(&old, &DeleteParams::default())
            .await
            .expect("deleting the leader pod");
        let (new, new_token) = poll(
            Duration::from_secs(60),
            "another pod of the Deployment to lead: holder, Ready, labelled",
            || async {
                let l = w.leases().get(LEASE).await.map_err(|e| e.to_string())?;
                let h = l.holder().map(str::to_string);
                let state = format!("holder {h:?} token {:?}", l.token());
                let Some(h) = h.filter(|h| *h != old) else {
                    return Err(state);
                };
                let p = w.pods().get(&h).await.map_err(|e| e.to_string())?;
                if is_running(&p) && is_ready(&p) && has_leader_label(&p) {
                    Ok((h, l.token().expect("token")))
                } else {
                    Err(format!("{state}; {}", describe(&[p])))
                }
            },
        )
        .await;
        assert!(new_token > old_token, "token {new_token} after {old_token}");
        tokio::time::sleep(Duration::from_millis(300)).await;
        let h = handover(&log.entries(), &old, t0, Instant::now());
        assert!(
            h.released,
            "round {round}: {old} did not release the lease on SIGTERM: {}\n{}",
            h.history,
            w.sidecar_logs().await
        );
        // A release is taken over from a running follower's watch: far below the lease.
        assert!(
            h.longest_gap < Duration::from_secs(LEASE_SECONDS),
            "round {round}: no holder for {:?}: {}",
            h.longest_gap,
            h.history
        );
        println!(
            "delete round {round}: {old} (token {old_token}) -> {new} (token {new_token}); no holder for {}; {}",
            ms(h.longest_gap),
            h.history
        );
        gaps.push(h.longest_gap);
    }
    println!(
        "{}",
        summary("deleting the leader pod (a follower is running)", &gaps)
    );
}

/// Native sidecars (Kubernetes 1.29+; the injection chooses them by the server's version): the
/// kubelet starts the injected sidecar, and waits for its startup probe, before the app, and
/// stops it only after the app has exited, so the app has its token and proxy for its whole
/// life. Seen in containerd's own event stream, which orders task starts and exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_native_sidecar_starts_before_the_app_and_stops_after_it() {
    let w = Injected::start("node-native").await;
    let minor = common::server_minor(&w.client).await;
    assert!(
        minor >= 29,
        "native sidecars need Kubernetes 1.29+, this server is 1.{minor}: hack/test.sh runs the \
         node tests on the current release"
    );
    let socket = containerd_socket(&ready_node(&w.client).await);
    let (leader, follower, _) = w.steady(Duration::from_secs(120)).await;
    assert_eq!(container_names(&leader), ["fencedlease", "app"]);
    let before = [name_of(&leader), name_of(&follower)];
    let old_ids = [
        container_id(&leader, "fencedlease"),
        container_id(&leader, "app"),
    ];
    let dir = common::procs::scratch_dir("node-native");
    let events = CtrEvents::start(&socket, dir.join("ctr-events.txt"));
    w.pods()
        .delete(&before[0], &DeleteParams::default())
        .await
        .expect("deleting the leader pod");
    let replacement = poll(
        Duration::from_secs(120),
        "the Deployment's replacement pod with both containers running, and the old pod gone",
        || async {
            let all = w.pods().list(&ListParams::default()).await;
            let all = all.map_err(|e| e.to_string())?.items;
            let old_gone = !all.iter().any(|p| name_of(p) == before[0]);
            let new = w.live_pods().await?.into_iter().find(|p| {
                !before.contains(&name_of(p))
                    && container_statuses(p)
                        .iter()
                        .all(|c| c.started == Some(true))
                    && container_statuses(p).len() == 2
            });
            match new {
                Some(p) if old_gone => Ok(p),
                _ => Err(describe(&all)),
            }
        },
    )
    .await;
    let new_ids = [
        container_id(&replacement, "fencedlease"),
        container_id(&replacement, "app"),
    ];
    let seen = events.stop();
    let at = |topic: &str, id: &str| {
        seen.iter()
            .position(|(t, c)| t == topic && c == id)
            .unwrap_or_else(|| panic!("containerd reported no {topic} of {id}: {seen:?}"))
    };
    assert!(
        at("/tasks/start", &new_ids[0]) < at("/tasks/start", &new_ids[1]),
        "the replacement's app started before its sidecar: {seen:?}"
    );
    assert!(
        at("/tasks/exit", &old_ids[1]) < at("/tasks/exit", &old_ids[0]),
        "the deleted pod's sidecar stopped before its app: {seen:?}"
    );
    println!(
        "native sidecar: started first in {}, stopped last in {}",
        name_of(&replacement),
        before[0]
    );
}

/// Issue 17 on a real node: the leader's sidecar container is killed (SIGKILL, through
/// containerd, as an OOM kill would). The kubelet reports it terminated and restarts it; the
/// controller, seeing the campaigning container stopped after it acquired, revokes the lease at
/// once, so a new token is issued before the lease could have run out. (The Event is what tells
/// the two apart: expiry alone gave a new token 4.0 s after the kill when this test ran with
/// `revokeOnHolderDeath: false`, inside the 5 s lease, since the last renewal came before it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_leader_sidecar_is_revoked_before_its_lease_runs_out() {
    let w = Injected::start("node-death").await;
    let socket = containerd_socket(&ready_node(&w.client).await);
    let (leader, _, lease) = w.steady(Duration::from_secs(120)).await;
    let (old, old_token) = (name_of(&leader), lease.token().expect("token"));
    let t0 = Instant::now();
    ctr(
        &socket,
        &[
            "tasks",
            "kill",
            "--signal",
            "SIGKILL",
            &container_id(&leader, "fencedlease"),
        ],
    );
    let (holder, token) = poll(
        Duration::from_secs(30),
        "a new token for the lease after the leader's sidecar was killed",
        || async {
            let l = w.leases().get(LEASE).await.map_err(|e| e.to_string())?;
            let (h, t) = (l.holder().map(str::to_string), l.token());
            match (&h, t) {
                (Some(h), Some(t)) if t > old_token => Ok((h.clone(), t)),
                _ => Err(format!("holder {h:?} token {t:?}")),
            }
        },
    )
    .await;
    let took = t0.elapsed();
    // The controller records its Event after the revocation's write, so the Event may come
    // after the new token: wait for it (an expiry records none, however long we wait).
    let revocations = try_poll(Duration::from_secs(15), || async {
        let reasons: Vec<String> = common::k8s_events(&w.client, &w.ns.name)
            .await
            .into_iter()
            .filter_map(|e| e.reason)
            .filter(|r| r.starts_with("HolderContainer"))
            .collect();
        if reasons.is_empty() {
            Err("no HolderContainer* Event".to_string())
        } else {
            Ok(reasons)
        }
    })
    .await;
    println!(
        "killed {old}'s sidecar (token {old_token}): token {token} held by {holder} after {}; events {revocations:?}",
        ms(took)
    );
    assert!(
        revocations.is_ok(),
        "the controller recorded no HolderContainerTerminated/Restarted Event within 15 s: the \
         new token came from the lease running out, not from the confirmed death"
    );
    assert!(
        took < Duration::from_secs(LEASE_SECONDS),
        "a new token only after {took:?}, not before the {LEASE_SECONDS} s lease ran out"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_leader_is_replaced_and_its_stale_write_is_refused_after_it_thaws() {
    let w = Injected::start("node-freeze").await;
    let node = ready_node(&w.client).await;
    let socket = containerd_socket(&node);
    let (leader, _, lease) = w.steady(Duration::from_secs(120)).await;
    let old = name_of(&leader);
    let old_token = lease.token().expect("token");
    let uid = lease.metadata.uid.clone().expect("lease uid");
    // What the frozen pod's app holds: the token file the sidecar wrote for it.
    let file = token_file(&socket, &leader);
    assert_eq!(
        file.as_deref(),
        Some(old_token.to_string().as_str()),
        "the leader's token file (as its app container sees it) vs the lease's token"
    );

    // Freeze every container of the leader's pod: the freezer cgroup stops it dead, as a
    // stalled VM or a long GC pause would. Nothing in it can renew or release.
    let mut frozen = Frozen::freeze(&socket, &leader);
    let (new, new_token) = poll(
        Duration::from_secs(LEASE_SECONDS * 3 + 20),
        "another pod to take over the frozen leader's lease",
        || async {
            let l = w.leases().get(LEASE).await.map_err(|e| e.to_string())?;
            match l.holder() {
                Some(h) if h != old && l.token() > Some(old_token) => {
                    Ok((h.to_string(), l.token().expect("token")))
                }
                h => Err(format!("holder {h:?} token {:?}", l.token())),
            }
        },
    )
    .await;
    let took_over = frozen.since.elapsed();
    // Frozen for longer than the lease, in any case.
    let lease_len = Duration::from_secs(LEASE_SECONDS);
    if took_over < lease_len + Duration::from_secs(1) {
        tokio::time::sleep(lease_len + Duration::from_secs(1) - took_over).await;
    }
    // The new leader is Ready and labelled; the label came off the frozen pod, and so did its
    // readiness while it is still frozen: kubelet's HTTP readiness probe times out against a
    // frozen sidecar (an exec probe would hang in the frozen cgroup and keep the last result).
    let new_pod = poll(
        Duration::from_secs(30),
        "the new leader to be Ready and to carry the leader label; the frozen pod neither",
        || async {
            let p = w.pods().get(&new).await.map_err(|e| e.to_string())?;
            let o = w.pods().get(&old).await.map_err(|e| e.to_string())?;
            if is_ready(&p) && has_leader_label(&p) && !has_leader_label(&o) && !is_ready(&o) {
                Ok(p)
            } else {
                Err(describe(&[p, o]))
            }
        },
    )
    .await;
    let frozen_for = frozen.since.elapsed();
    frozen.thaw();
    println!(
        "froze {old} (token {old_token}); {new} took over with token {new_token} after {} (lease {LEASE_SECONDS} s); the frozen pod was unready and the new one Ready {} after the freeze; thawed",
        ms(took_over),
        ms(frozen_for)
    );

    // The new leader writes the protected object with its token (from its own token file).
    let new_file = token_file(&socket, &new_pod).expect("the new leader's token file");
    assert_eq!(new_file, new_token.to_string());
    let cms: Api<ConfigMap> = Api::namespaced(w.client.clone(), &w.ns.name);
    let fenced = |by: &str, token: i64| -> ConfigMap {
        serde_json::from_value(json!({
            "metadata": {
                "name": "inventory",
                "labels": {LEASE_LABEL: LEASE},
                "annotations": {"fencedlease.io/token": token.to_string(), "fencedlease.io/lease-uid": uid,
                    "fencedlease.io/write-id": common::new_write_id()}
            },
            "data": {"reserved-by": by}
        }))
        .expect("configmap literal")
    };
    cms.create(&PostParams::default(), &fenced(&new, new_token))
        .await
        .unwrap_or_else(|e| {
            panic!("the new leader's write with token {new_token} was refused: {e}")
        });

    // The thawed pod writes with the token it held when it froze: the API server refuses it.
    let mut stale = cms.get("inventory").await.expect("reading the ConfigMap");
    let fresh = fenced(&old, old_token);
    stale.metadata.annotations = fresh.metadata.annotations;
    stale.data = fresh.data;
    match cms
        .replace("inventory", &PostParams::default(), &stale)
        .await
    {
        Ok(_) => panic!("the thawed leader's write with its old token {old_token} was accepted"),
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 409, "refusal: {s:?}");
            assert!(
                s.message.contains(&format!("stale token {old_token}")),
                "refusal: {}",
                s.message
            );
            println!("the thawed leader's write was refused: {}", s.message);
        }
        Err(e) => panic!("writing with the old token: {e}"),
    }
    let stored = cms.get("inventory").await.expect("reading the ConfigMap");
    assert_eq!(
        stored
            .data
            .unwrap_or_default()
            .get("reserved-by")
            .map(String::as_str),
        Some(new.as_str())
    );

    // Thawed, the old leader's sidecar sees it no longer leads: its token file goes, its pod
    // turns unready, and the lease stays with the new leader.
    poll(
        Duration::from_secs(30),
        "the thawed pod's token file to go and the pod to turn unready",
        || async {
            let o = w.pods().get(&old).await.map_err(|e| e.to_string())?;
            let f = token_file(&socket, &o);
            if f.is_none() && !is_ready(&o) {
                Ok(())
            } else {
                Err(format!("token file {f:?}; {}", describe(&[o])))
            }
        },
    )
    .await;
    assert_eq!(
        holder(&w.leases(), LEASE).await.as_deref(),
        Some(new.as_str())
    );
    let thawed = w.pods().get(&old).await.expect("the thawed pod");
    let restarts: Vec<(String, i32)> = container_statuses(&thawed)
        .into_iter()
        .map(|c| (c.name, c.restart_count))
        .collect();
    println!(
        "the thawed pod's restarts {restarts:?}; its sidecar's last lines:\n{}",
        log_tail(&w.ns.name, &thawed, "fencedlease", 6)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_update_hands_leadership_over_to_the_new_pods() {
    let w = Injected::start("node-rollout").await;
    let log = LeaseLog::start(w.leases(), LEASE).await;
    let mut gaps = vec![];
    for round in 1..=3 {
        let (leader, _, lease) = w.steady(Duration::from_secs(120)).await;
        let (old, old_token) = (name_of(&leader), lease.token().expect("token"));
        let old_hash = leader
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("pod-template-hash").cloned())
            .expect("pod-template-hash");
        let t0 = Instant::now();
        let patch = json!({"spec": {"template": {"metadata": {"annotations": {"example.com/revision": round.to_string()}}}}});
        w.deployments()
            .patch(WORKLOAD, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .expect("changing the pod template");
        // A pod of the new ReplicaSet leads (Ready, labelled), the rollout is complete, and the
        // old ReplicaSet's pods are all being deleted.
        let (new, new_token) = poll(
            Duration::from_secs(90),
            "a pod of the new ReplicaSet to lead and the rollout to complete",
            || async {
                let l = w.leases().get(LEASE).await.map_err(|e| e.to_string())?;
                let d = w
                    .deployments()
                    .get(WORKLOAD)
                    .await
                    .map_err(|e| e.to_string())?;
                let live = w.live_pods().await?;
                let ds = d.status.clone().unwrap_or_default();
                let state = format!(
                    "holder {:?} token {:?}; deployment updated {:?} replicas {:?}; pods {}",
                    l.holder(),
                    l.token(),
                    ds.updated_replicas,
                    ds.replicas,
                    describe(&live)
                );
                let done = ds.observed_generation >= d.metadata.generation
                    && ds.updated_replicas == Some(2)
                    && live.iter().all(|p| {
                        p.metadata
                            .labels
                            .as_ref()
                            .and_then(|l| l.get("pod-template-hash"))
                            != Some(&old_hash)
                    });
                let Some(h) = l.holder().filter(|h| *h != old) else {
                    return Err(state);
                };
                let Some(p) = live.iter().find(|p| name_of(p) == h) else {
                    return Err(state);
                };
                if done && is_running(p) && is_ready(p) && has_leader_label(p) {
                    Ok((h.to_string(), l.token().expect("token")))
                } else {
                    Err(state)
                }
            },
        )
        .await;
        assert!(new_token > old_token, "token {new_token} after {old_token}");
        tokio::time::sleep(Duration::from_millis(300)).await;
        let h = handover(&log.entries(), &old, t0, Instant::now());
        assert!(
            h.released,
            "round {round}: {old} did not release the lease on SIGTERM: {}\n{}",
            h.history,
            w.sidecar_logs().await
        );
        // No takeover by expiry: the new pods take the released lease as soon as they run.
        assert!(
            h.longest_gap < Duration::from_secs(30),
            "round {round}: no holder for {:?}: {}",
            h.longest_gap,
            h.history
        );
        println!(
            "rollout round {round}: {old} (token {old_token}) -> {new} (token {new_token}); no holder for {} (total {}); {}",
            ms(h.longest_gap),
            ms(h.total_gap),
            h.history
        );
        gaps.push(h.longest_gap);
    }
    println!("{}", summary("rolling update (maxUnavailable 100%)", &gaps));
}
