//! The controller revokes an expired lease even when it cannot move the leader label, against
//! the real API server: it runs as a ServiceAccount that may not patch pods, so every label
//! patch fails. Revocation and status must not wait for the label; the failure is reported as
//! a Warning Event.

use fencedlease_testkit as common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::procs::{campaign, scratch_dir, Proc};
use common::{client, ensure_crd, eventually, kubeconfig_path, TestNamespace};
use fencedlease::api::FencedLease;
use k8s_openapi::api::core::v1::{Pod, Secret, ServiceAccount};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::PostParams;
use kube::{Api, Client};
use nix::sys::signal::Signal;
use serde_json::json;

const SA: &str = "controller-without-pod-patch";
/// The lease duration the holder campaigns with.
const LEASE_S: i128 = 2;
const NS_PER_S: i128 = 1_000_000_000;

/// Everything the controller needs in its namespace, except `patch` on pods.
async fn service_account_without_pod_patch(client: &Client, ns: &str) {
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": SA},
        "rules": [
            {"apiGroups": ["fencedlease.io"], "resources": ["fencedleases"],
             "verbs": ["get", "list", "watch", "update", "patch", "create"]},
            {"apiGroups": ["fencedlease.io"], "resources": ["fencedleases/status"],
             "verbs": ["get", "update", "patch"]},
            {"apiGroups": ["", "events.k8s.io"], "resources": ["events"],
             "verbs": ["create", "patch"]},
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}
        ]
    }))
    .expect("role literal");
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": SA},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": SA},
        "subjects": [{"kind": "ServiceAccount", "name": SA, "namespace": ns}]
    }))
    .expect("binding literal");
    let sa: ServiceAccount =
        serde_json::from_value(json!({"metadata": {"name": SA}})).expect("sa literal");
    let pp = PostParams::default();
    Api::<ServiceAccount>::namespaced(client.clone(), ns)
        .create(&pp, &sa)
        .await
        .expect("create the ServiceAccount");
    Api::<Role>::namespaced(client.clone(), ns)
        .create(&pp, &role)
        .await
        .expect("create the Role");
    Api::<RoleBinding>::namespaced(client.clone(), ns)
        .create(&pp, &binding)
        .await
        .expect("create the RoleBinding");
}

/// A kubeconfig for the test cluster that authenticates as the ServiceAccount's token.
async fn kubeconfig_for_service_account(client: &Client, ns: &str, dir: &Path) -> String {
    // A token Secret of our own, which the controller-manager fills in on every release
    // (since 1.24 it no longer makes one for each ServiceAccount by itself).
    let secret_name = format!("{SA}-token");
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": secret_name,
                     "annotations": {"kubernetes.io/service-account.name": SA}},
        "type": "kubernetes.io/service-account-token"
    }))
    .expect("secret literal");
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .expect("create the ServiceAccount's token Secret");
    let token = eventually(Duration::from_secs(30), "the token", || async {
        let secret = secrets.get(&secret_name).await.ok()?;
        let bytes = secret.data?.remove("token")?.0;
        String::from_utf8(bytes).ok()
    })
    .await;
    let admin = std::fs::read_to_string(kubeconfig_path()).expect("read the test kubeconfig");
    let mut config: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&admin).expect("kubeconfig YAML");
    let users = config["users"]
        .as_sequence_mut()
        .expect("a kubeconfig with users");
    for user in users {
        user["user"] = serde_yaml_ng::to_value(json!({ "token": token })).expect("yaml");
    }
    let path = dir.join("controller.kubeconfig");
    let text = serde_yaml_ng::to_string(&config).expect("serialize kubeconfig");
    std::fs::write(&path, text).expect("write kubeconfig");
    path.to_str().expect("utf-8 path").to_string()
}

/// The controller, scoped to `ns`, running as the ServiceAccount of `kubeconfig`.
fn controller_as(dir: &Path, ns: &str, kubeconfig: &str) -> Proc {
    let log = dir.join("controller.log");
    let logf = std::fs::File::create(&log).expect("create log");
    let child = Command::new(env!("CARGO_BIN_EXE_fencedlease"))
        .args(["controller", "--namespace", ns, "--election-namespace", ns])
        .args([
            "--identity",
            "controller-0",
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .env("KUBECONFIG", kubeconfig)
        .env("RUST_LOG", "info,kube=warn")
        .stdin(Stdio::null())
        .stdout(logf.try_clone().expect("dup log"))
        .stderr(logf)
        .spawn()
        .expect("start the controller");
    Proc {
        name: "controller-0".into(),
        child,
        events: dir.join("controller.events"),
        log,
    }
}

async fn events_with_reason(client: &Client, ns: &str, reason: &str) -> Vec<Event> {
    let all = common::k8s_events(client, ns).await;
    all.into_iter()
        .filter(|e| e.reason.as_deref() == Some(reason))
        .collect()
}

#[tokio::test]
async fn an_expired_lease_is_revoked_although_the_leader_label_cannot_be_moved() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "label-forbidden").await;
    let dir = scratch_dir("label-forbidden");
    service_account_without_pod_patch(&client, &ns.name).await;
    let kubeconfig = kubeconfig_for_service_account(&client, &ns.name, &dir).await;
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "pod-a", "annotations": {"fencedlease.io/lease": "db"}},
        "spec": {"containers": [{"name": "app", "image": "busybox"}]}
    }))
    .expect("pod literal");
    Api::<Pod>::namespaced(client.clone(), &ns.name)
        .create(&PostParams::default(), &pod)
        .await
        .expect("create the holder's pod");
    let _ctl = controller_as(&dir, &ns.name, &kubeconfig);
    let a = campaign(&dir, &ns.name, "db", "pod-a", LEASE_S as u32);
    // The controller is active, tries to label pod-a, fails, and says so.
    let failed = eventually(
        Duration::from_secs(30),
        "a LeaderLabelFailed Event",
        || async {
            let evs = events_with_reason(&client, &ns.name, "LeaderLabelFailed").await;
            evs.into_iter().next()
        },
    )
    .await;
    let note = failed.note.unwrap_or_default();
    assert!(note.contains("pod-a") && note.contains("patch"), "{note}");
    // Freeze the holder right after a renewal.
    let led = eventually(Duration::from_secs(10), "pod-a to lead", || async {
        a.events().into_iter().find(|e| e.event == "leading")
    })
    .await;
    eventually(Duration::from_secs(10), "a renewal", || async {
        a.events()
            .into_iter()
            .find(|e| e.event == "renewed" && e.t_ns > led.t_ns + NS_PER_S / 2)
    })
    .await;
    a.signal(Signal::SIGSTOP);
    let api: Api<FencedLease> = Api::namespaced(client.clone(), &ns.name);
    let held = api.get("db").await.expect("get the lease");
    assert_eq!(held.holder(), Some("pod-a"));
    // Revoked once its lease runs out, although every label patch fails (how soon after the
    // lease is the controller benchmark's business; the ceiling only stops a hung test).
    let revoked = eventually(
        Duration::from_secs(60),
        "the frozen holder's revocation",
        || async {
            let lease = api.get("db").await.ok()?;
            lease.holder().is_none().then_some(lease)
        },
    )
    .await;
    assert!(revoked.token() > held.token());
    // The status says so too, and so does an Event.
    let expired = eventually(Duration::from_secs(30), "Expired=True", || async {
        let status = api.get("db").await.ok()?.status?;
        status
            .conditions
            .into_iter()
            .find(|c| c.type_ == "Expired" && c.status == "True")
    })
    .await;
    assert_eq!(expired.reason, "NotRenewed");
    eventually(Duration::from_secs(30), "a Revoked Event", || async {
        let evs = events_with_reason(&client, &ns.name, "Revoked").await;
        evs.into_iter().next()
    })
    .await;
}
