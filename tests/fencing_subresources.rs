//! Fencing hole 5: writes through subresources. /status of built-in types can change labels and
//! annotations, and is judged like any write; a custom resource's /status keeps the stored
//! metadata, so no token can be presented there (refused, saying so); a Scale object carries no
//! labels, so every /scale write is checked against the scaled object and refused when it is
//! protected. Kubernetes' own controllers (the HPA) stay exempt.

use fencedlease_testkit as common;

use common::fencing::{
    assert_refused, create, fenced_merge, held_lease, protected_meta, stamp, LEASE,
};
use common::procs::scratch_dir;
use common::webhook::{ensure_widget_crd, Webhook, WIDGET_GROUP};
use common::{client, ensure_crd, TestNamespace};
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use kube::api::{ApiResource, DynamicObject, Patch, PatchParams};
use kube::Api;

const HPA: &str = "system:serviceaccount:kube-system:horizontal-pod-autoscaler";
const SCALE_REFUSED: &str = "a write through /scale cannot carry a fencing token";

fn workload(meta: serde_json::Value, sts: bool) -> serde_json::Value {
    let mut spec = serde_json::json!({
        "replicas": 1,
        "selector": {"matchLabels": {"app": "w"}},
        "template": {
            "metadata": {"labels": {"app": "w"}},
            "spec": {"nodeSelector": {"fencedlease.io/nowhere": "true"},
                     "containers": [{"name": "c", "image": "fencedlease-test-none:0"}]}
        }
    });
    if sts {
        spec["serviceName"] = "w".into();
    }
    serde_json::json!({"metadata": meta, "spec": spec})
}

async fn patched<T: std::fmt::Debug>(r: kube::Result<T>) -> Result<T, (u16, String)> {
    r.map_err(|e| match e {
        kube::Error::Api(s) => (s.code, s.message),
        other => (0, other.to_string()),
    })
}

#[tokio::test]
async fn hole_5_status_and_scale_writes_of_protected_objects_are_fenced() {
    let client = client().await;
    ensure_crd();
    ensure_widget_crd();
    let ns = TestNamespace::new(&client, "hole5").await;
    let dir = scratch_dir("hole5");
    let _wh = Webhook::start(&client, &dir, &ns.name).await;
    let a = held_lease(&client, &ns.name, "inv", "pod-a").await;
    let pp = PatchParams::default();

    // Deployments: /status may carry annotations, so it is judged like any write.
    let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns.name);
    create(&deploys, workload(protected_meta("web", "inv", &a), false))
        .await
        .expect("web");
    create(
        &deploys,
        workload(serde_json::json!({"name": "plain"}), false),
    )
    .await
    .expect("plain");
    let warn = serde_json::json!({"metadata": {"annotations": {"fencedlease.io/fencing": "warn"}}});
    let r = patched(deploys.patch_status("web", &pp, &Patch::Merge(&warn)).await).await;
    assert_refused(
        "deployments/status without a token",
        r,
        403,
        "does not present a token",
    );
    let three = serde_json::json!({"spec": {"replicas": 3}});
    let r = patched(deploys.patch_scale("web", &pp, &Patch::Merge(&three)).await).await;
    assert_refused("deployments/scale", r, 403, SCALE_REFUSED);
    patched(
        deploys
            .patch_scale("plain", &pp, &Patch::Merge(&three))
            .await,
    )
    .await
    .expect("an unprotected Deployment scales freely");
    // The HPA is one of Kubernetes' own writers, exempt: it reads /scale and updates it.
    // Like the HPA, it reads again and retries when the Deployment controller's status writes
    // moved the resourceVersion in between (409 "the object has been modified": optimistic
    // concurrency, not fencing, whose refusals say "fencedlease").
    let as_hpa: Api<Deployment> = Api::namespaced(common::client_as(HPA).await, &ns.name);
    let mut last = None;
    for _ in 0..10 {
        let mut scale = as_hpa.get_scale("web").await.expect("the HPA reads /scale");
        scale.spec.get_or_insert_default().replicas = Some(2);
        match as_hpa
            .replace_scale("web", &Default::default(), &scale)
            .await
        {
            Ok(_) => {
                last = None;
                break;
            }
            Err(kube::Error::Api(e)) if e.code == 409 && !e.message.contains("fencedlease") => {
                last = Some(e.message);
            }
            Err(e) => panic!("the HPA's /scale write must pass: {e}"),
        }
    }
    assert_eq!(last, None, "the HPA's /scale write kept conflicting");

    // StatefulSets: /status can drop the lease label; /scale as above.
    let sts: Api<StatefulSet> = Api::namespaced(client.clone(), &ns.name);
    create(&sts, workload(protected_meta("db", "inv", &a), true))
        .await
        .expect("db");
    let unlabel = serde_json::json!({"metadata": {"labels": {LEASE: null}}});
    let r = patched(sts.patch_status("db", &pp, &Patch::Merge(&unlabel)).await).await;
    assert_refused(
        "statefulsets/status dropping the label",
        r,
        403,
        "does not present a token",
    );
    let r = patched(sts.patch_scale("db", &pp, &Patch::Merge(&three)).await).await;
    assert_refused("statefulsets/scale", r, 403, SCALE_REFUSED);

    // A custom resource: /status keeps the stored metadata, so no token can be presented there.
    let ar = ApiResource {
        group: WIDGET_GROUP.into(),
        version: "v1".into(),
        api_version: format!("{WIDGET_GROUP}/v1"),
        kind: "Widget".into(),
        plural: "widgets".into(),
    };
    let widgets: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns.name, &ar);
    let w = serde_json::json!({"apiVersion": format!("{WIDGET_GROUP}/v1"), "kind": "Widget",
        "metadata": protected_meta("gear", "inv", &a), "spec": {"replicas": 1}});
    create(&widgets, w)
        .await
        .expect("create a protected widget");
    let status =
        serde_json::json!({"metadata": {"annotations": stamp(&a)}, "status": {"note": "hi"}});
    let r = patched(
        widgets
            .patch_status("gear", &pp, &Patch::Merge(&status))
            .await,
    )
    .await;
    assert_refused("widgets/status", r, 403, "no token can be presented there");
    let r = patched(
        widgets
            .patch_scale("gear", &pp, &Patch::Merge(&three))
            .await,
    )
    .await;
    assert_refused("widgets/scale", r, 403, SCALE_REFUSED);
    // The object itself still takes fenced writes.
    fenced_merge(
        &widgets,
        "gear",
        &a,
        serde_json::json!({"spec": {"replicas": 2}}),
    )
    .await
    .expect("a fenced write of the widget itself");
}

/// A refusal tells a replaced leader to stop, once: `kubectl scale` of a protected Deployment
/// without a token exits after the first refusal (with 409 Conflict it re-read and retried for
/// minutes), having sent exactly one /scale write (its own request log, -v=6, says so; the
/// webhook may be asked more than once per request, when the API server retries its update
/// against a status write of the deployment controller). The refusal is 403 Forbidden,
/// not Conflict: client-go's `RetryOnConflict` retries exactly the errors whose reason is
/// Conflict or whose code is 409, so it stops after one too.
#[tokio::test]
async fn a_refusal_stops_kubectl_scale_after_one_attempt() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "once").await;
    let dir = scratch_dir("once");
    let _wh = Webhook::start(&client, &dir, &ns.name).await;
    let a = held_lease(&client, &ns.name, "inv", "pod-a").await;
    let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns.name);
    create(&deploys, workload(protected_meta("web", "inv", &a), false))
        .await
        .expect("web");
    // The ceiling only stops a hung test: kubectl's own retries of a conflict last minutes.
    let kubeconfig = common::kubeconfig_path();
    let out = std::process::Command::new("timeout")
        .args(["120", "kubectl", "--kubeconfig"])
        .arg(&kubeconfig)
        .args([
            "-v=6",
            "-n",
            &ns.name,
            "scale",
            "deployment/web",
            "--replicas=3",
        ])
        .output()
        .expect("run kubectl scale");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(
        out.status.code(),
        Some(124),
        "kubectl scale was still retrying: {err}"
    );
    assert!(!out.status.success(), "kubectl scale succeeded: {err}");
    assert!(
        err.contains(SCALE_REFUSED) && err.contains("Forbidden"),
        "{err}"
    );
    let sent: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("/scale") && l.contains("403 Forbidden"))
        .collect();
    assert_eq!(
        sent.len(),
        1,
        "one /scale write, refused once: {sent:#?}\n{err}"
    );
    let r = patched(deploys.get("web").await).await.expect("read web");
    assert_eq!(r.spec.and_then(|s| s.replicas), Some(1), "not scaled");
}

async fn refused_as<T: std::fmt::Debug>(what: &str, r: kube::Result<T>, want: &str) {
    match patched(r).await {
        Err((403, m)) if m.contains("fencedlease") && m.contains(want) => {}
        other => panic!("{what}: want a 403 fencedlease refusal saying {want:?}, got {other:?}"),
    }
}

/// The pod's subresources that carry the pod: refused without a token, and with one too.
async fn ephemeral_containers_and_resize(
    pods: &Api<k8s_openapi::api::core::v1::Pod>,
    a: &common::fencing::Held,
    minor: u32,
) {
    let pp = PatchParams::default();
    let debug = serde_json::json!({"spec": {"ephemeralContainers": [
        {"name": "dbg", "image": "fencedlease-test-none:0"}]}});
    let r = pods
        .patch_subresource("ephemeralcontainers", "p", &pp, &Patch::Strategic(&debug))
        .await;
    refused_as("pods/ephemeralcontainers without a token", r, "token").await;
    let mut stamped = debug.clone();
    stamped["metadata"] = serde_json::json!({"annotations": stamp(a)});
    let r = pods
        .patch_subresource("ephemeralcontainers", "p", &pp, &Patch::Strategic(&stamped))
        .await;
    // The API server keeps the stored metadata on this subresource (like a custom resource's
    // /status): even the holder's stamp does not reach the webhook, so only exempt writers
    // may add a debug container to a protected pod, and the message says why.
    refused_as(
        "the holder's stamped /ephemeralcontainers",
        r,
        "no token can be presented",
    )
    .await;
    if minor >= 33 {
        let more = serde_json::json!({"spec": {"containers": [
            {"name": "c", "resources": {"requests": {"cpu": "150m"}}}]}});
        let r = pods
            .patch_subresource("resize", "p", &pp, &Patch::Strategic(&more))
            .await;
        refused_as("pods/resize without a token", r, "token").await;
        let mut stamped = more.clone();
        stamped["metadata"] = serde_json::json!({"annotations": stamp(a)});
        let r = pods
            .patch_subresource("resize", "p", &pp, &Patch::Strategic(&stamped))
            .await;
        refused_as(
            "the holder's stamped /resize",
            r,
            "no token can be presented",
        )
        .await;
    } else {
        eprintln!("pods/resize: not served before Kubernetes 1.33; checked on the current release");
    }
}

/// Issue 33, hole 5: with pods fenced, a pod's subresources that carry the pod
/// (/ephemeralcontainers, /resize from Kubernetes 1.33) are judged like the pod (the API server
/// keeps the stored metadata there, so no token can be presented: refused but for the exempt
/// writers, as a custom resource's /status), and a binding
/// (pods/binding, or the legacy bindings resource), which carries none of the pod's labels, is
/// checked against the pod: refused when it is protected, except for the scheduler (exempt).
#[tokio::test]
async fn hole_5_a_protected_pod_s_subresources_and_bindings_are_fenced() {
    use k8s_openapi::api::core::v1::{Binding, Pod};
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "hole5pods").await;
    let dir = scratch_dir("hole5pods");
    let opts = common::webhook::WebhookOpts {
        fence_pods: true,
        ..Default::default()
    };
    let wh = Webhook::start_with(&client, &dir, &ns.name, opts).await;
    let a = held_lease(&client, &ns.name, "inv", "pod-a").await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    let pod = |name: &str| {
        serde_json::json!({"metadata": protected_meta(name, "inv", &a), "spec": {
            // Never scheduled: the test is about the API objects.
            "nodeSelector": {"fencedlease.io/nowhere": "true"},
            "containers": [{"name": "c", "image": "fencedlease-test-none:0",
                            "resources": {"requests": {"cpu": "100m"}}}]}})
    };
    create(&pods, pod("p"))
        .await
        .expect("a fenced create of the pod");
    let minor = common::server_minor(&client).await;
    if minor >= 23 {
        ephemeral_containers_and_resize(&pods, &a, minor).await;
    } else {
        eprintln!("pods/ephemeralcontainers: off by default before Kubernetes 1.23; checked on the current release");
    }
    let binding = |name: &str| -> Binding {
        serde_json::from_value(serde_json::json!({"metadata": {"name": name},
            "target": {"kind": "Node", "name": "node-1"}}))
        .expect("a binding")
    };
    let body = binding("p");
    let r = pods
        .create_subresource::<Binding, kube::core::Status>(
            "binding",
            "p",
            &Default::default(),
            &body,
        )
        .await;
    refused_as("pods/binding by anyone but the scheduler", r, "/binding").await;
    create(&pods, pod("q")).await.expect("a second pod");
    let legacy: Api<Binding> = Api::namespaced(client.clone(), &ns.name);
    let r = legacy.create(&Default::default(), &binding("q")).await;
    refused_as(
        "a Binding through the legacy bindings resource",
        r,
        "/binding",
    )
    .await;
    let m = wh.metrics();
    let denied = r#"fencedlease_webhook_admissions_total{result="denied_binding"}"#;
    assert_eq!(common::metric_value(&m, denied), 2.0, "{m}");
    // The scheduler binds a protected pod (exempt, its writes need no token).
    let scheduler: Api<Pod> =
        Api::namespaced(common::client_as("system:kube-scheduler").await, &ns.name);
    scheduler
        .create_subresource::<Binding, kube::core::Status>(
            "binding",
            "p",
            &Default::default(),
            &body,
        )
        .await
        .expect("the scheduler binds the pod");
    let bound = pods.get("p").await.expect("the pod");
    assert_eq!(
        bound.spec.and_then(|s| s.node_name).as_deref(),
        Some("node-1")
    );
    // Its kubelet reports its status (a node identity, allowed for pods/status while it leaves
    // the fencing alone), but may not touch the token through it.
    let status = |patch: serde_json::Value| {
        let body = patch.to_string();
        common::kubectl(&[
            "-n",
            &ns.name,
            "patch",
            "pod",
            "p",
            "--subresource=status",
            "--type=merge",
            "-p",
            &body,
            "--as",
            "system:node:node-1",
            "--as-group",
            "system:nodes",
            "--as-group",
            "system:masters",
        ])
    };
    let (ok, _, err) = status(serde_json::json!({"status": {"message": "running"}}));
    assert!(ok, "the kubelet's status report: {err}");
    let touch = serde_json::json!({"metadata": {"annotations": {"fencedlease.io/token": "99"}}});
    let (ok, _, err) = status(touch);
    assert!(
        !ok && err.contains("does not present a token"),
        "the kubelet touching the token: {err}"
    );
}
