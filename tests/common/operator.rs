//! The operator as the chart installs it on the node, and workloads it injects the sidecar into.
//!
//! Each test installs a release of its own into a namespace of its own, with both webhook
//! configurations' namespace selectors restricted to that namespace's `fencedlease.io/test-ns`
//! label and the controller watching that namespace only, so that parallel tests do not see
//! each other's releases.

use std::time::Duration;

use fencedlease::api::FencedLease;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Pod, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::RoleBinding;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;

use super::helm::Release;
use super::node::{
    all_containers_ready, container_log, container_names, describe, fail_fast_on_waiting, hardened,
    has_leader_label, is_ready, is_running, log_tail, name_of, ready_node, APP_IMAGE,
};
use super::{client, ensure_crd, eventually, try_eventually, TestNamespace};

/// Labels the namespace `fencedlease.io/injection=enabled`: it opts in to sidecar injection
/// (the chart's default injection selector, merged with the test's namespace label).
pub async fn opt_in_to_injection(client: &Client, ns: &str) {
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
pub async fn operator_logs(client: &Client, release: &Release) -> String {
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
pub const COMPONENTS: [&str; 2] = ["controller", "webhook"];

/// Waits until `replicas` pods of each operator component (controller and webhook) run Ready;
/// returns them all.
pub async fn wait_operator_ready(client: &Client, release: &Release, replicas: usize) -> Vec<Pod> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &release.namespace);
    let timeout = Duration::from_secs(150);
    let found = try_eventually(timeout, || async {
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
pub fn component_of(p: &Pod) -> String {
    p.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get("app.kubernetes.io/component"))
        .cloned()
        .unwrap_or_default()
}

/// Waits until the active controller has issued the certificate Secret and written its CA into
/// every webhook of both configurations; returns the CA (PEM).
pub async fn wait_certificate_and_ca_bundles(client: &Client, release: &Release) -> Vec<u8> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &release.namespace);
    let vwcs: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let mwcs: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let timeout = Duration::from_secs(90);
    let found = try_eventually(timeout, || async {
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
pub fn annotated_pod(name: &str, lease: &str) -> Pod {
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
pub async fn wait_injection_served(client: &Client, ns: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let dry = PostParams {
        dry_run: true,
        field_manager: None,
    };
    eventually(
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

pub const WORKLOAD: &str = "worker";
pub const LEASE: &str = "worker";
pub const LEASE_SECONDS: u64 = 5;

/// A test's namespace with a release of the chart and a Deployment of two annotated pods
/// (injection, leader-only readiness) that campaign for the FencedLease `worker`. Fields drop in
/// order: the release is uninstalled before the namespace goes.
pub struct Injected {
    pub client: Client,
    /// The FencedLease's leaseDurationSeconds ([`LEASE_SECONDS`] unless started with another).
    pub lease_seconds: u64,
    pub release: Release,
    pub ns: TestNamespace,
}

impl Injected {
    pub async fn start(prefix: &str) -> Injected {
        Injected::start_with_lease(prefix, LEASE_SECONDS).await
    }

    /// [`Injected::start`] with a lease of `lease_seconds`.
    pub async fn start_with_lease(prefix: &str, lease_seconds: u64) -> Injected {
        Injected::start_labelled(prefix, lease_seconds, json!({})).await
    }

    /// [`Injected::start`] in a namespace that enforces Pod Security's `restricted` level: the
    /// chart's pods and the injected pods must meet it.
    pub async fn start_restricted(prefix: &str) -> Injected {
        let restricted = json!({
            "pod-security.kubernetes.io/enforce": "restricted",
            "pod-security.kubernetes.io/enforce-version": "latest",
        });
        Injected::start_labelled(prefix, LEASE_SECONDS, restricted).await
    }

    async fn start_labelled(
        prefix: &str,
        lease_seconds: u64,
        labels: serde_json::Value,
    ) -> Injected {
        let client = client().await;
        ready_node(&client).await;
        ensure_crd();
        let ns = TestNamespace::new(&client, prefix).await;
        Api::<Namespace>::all(client.clone())
            .patch(
                &ns.name,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": labels}})),
            )
            .await
            .unwrap_or_else(|e| panic!("labelling namespace {}: {e}", ns.name));
        opt_in_to_injection(&client, &ns.name).await;
        // One operator replica is enough here (the helm test runs the default two).
        let release = Release::install_on_node(&ns, "fl", &["--set", "replicas=1"]);
        wait_operator_ready(&client, &release, 1).await;
        wait_certificate_and_ca_bundles(&client, &release).await;
        wait_injection_served(&client, &ns.name).await;
        let me = Injected {
            client,
            lease_seconds,
            release,
            ns,
        };
        me.deploy().await;
        me
    }

    pub fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.ns.name)
    }
    pub fn leases(&self) -> Api<FencedLease> {
        Api::namespaced(self.client.clone(), &self.ns.name)
    }
    pub fn deployments(&self) -> Api<Deployment> {
        Api::namespaced(self.client.clone(), &self.ns.name)
    }

    /// The workload's ServiceAccount bound to the chart's sidecar ClusterRole, its FencedLease
    /// (the sidecar may not create one), and the Deployment.
    pub async fn deploy(&self) {
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
            "spec": {"leaseDurationSeconds": self.lease_seconds}
        }))
        .expect("lease literal");
        self.leases()
            .create(&PostParams::default(), &lease)
            .await
            .expect("creating the FencedLease");
        // Rather than wait through the ReplicaSet's retries.
        super::wait_service_account(&self.client, ns, WORKLOAD).await;

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
                            "fencedlease.io/ready-only-when-leader": "true",
                            "fencedlease.io/proxy": "true"
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
    pub async fn live_pods(&self) -> Result<Vec<Pod>, String> {
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
    pub async fn steady(&self, timeout: Duration) -> (Pod, Pod, FencedLease) {
        eventually(
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
    pub async fn sidecar_logs(&self) -> String {
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
