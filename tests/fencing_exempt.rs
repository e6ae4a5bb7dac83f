//! Fencing hole 4: Kubernetes' own writers are not stale leaders. kube-controller-manager's
//! controllers (their own ServiceAccounts in kube-system, as the local cluster runs them) update
//! a protected Deployment without a token: the revision annotation, status, the garbage
//! collector's finalizer removal and its deletes. They are exempt while they leave the fencing
//! label and annotations alone; nobody else is.

use fencedlease_testkit as common;

use std::time::Duration;

use common::fencing::{
    announce_delete, assert_refused, create, fenced_merge, held_lease, move_lease, protected_meta,
    stamp,
};
use common::procs::scratch_dir;
use common::webhook::Webhook;
use common::{client, ensure_crd, eventually, kubectl, TestNamespace};
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use kube::api::{DeleteParams, ListParams};
use kube::Api;

const REVISION: &str = "deployment.kubernetes.io/revision";
const GC: &str = "system:serviceaccount:kube-system:generic-garbage-collector";

async fn revision_reached(deploys: &Api<Deployment>, want: &str) {
    eventually(
        Duration::from_secs(60),
        &format!("the deployment controller to set revision {want} and report status"),
        || async {
            let d = deploys.get("web").await.ok()?;
            let rev = d.metadata.annotations.as_ref()?.get(REVISION)?.clone();
            let observed = d.status.as_ref()?.observed_generation?;
            (rev == want && Some(observed) == d.metadata.generation).then_some(())
        },
    )
    .await;
}

#[tokio::test]
async fn hole_4_a_rollout_and_a_cascading_delete_of_a_protected_deployment_work_while_its_lease_moves(
) {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "hole4").await;
    let dir = scratch_dir("hole4");
    let _wh = Webhook::start(&client, &dir, &ns.name).await;
    let a = held_lease(&client, &ns.name, "inv", "pod-a").await;
    let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns.name);
    create(
        &deploys,
        serde_json::json!({
            "metadata": protected_meta("web", "inv", &a),
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"app": "web"}},
                "template": {
                    "metadata": {"labels": {"app": "web"}},
                    // Never scheduled: the test is about the API objects, not the pods.
                    "spec": {"nodeSelector": {"fencedlease.io/nowhere": "true"},
                             "containers": [{"name": "c", "image": "fencedlease-test-none:0"}]}
                }
            }
        }),
    )
    .await
    .expect("A creates the protected Deployment");
    revision_reached(&deploys, "1").await;

    // The lease moves; B rolls out a new template; the controller follows without a token.
    let b = move_lease(&client, &ns.name, "inv", "pod-b").await;
    let rollout =
        serde_json::json!({"spec": {"template": {"metadata": {"annotations": {"rollout": "2"}}}}});
    fenced_merge(&deploys, "web", &b, rollout)
        .await
        .expect("B rolls out with its token");
    revision_reached(&deploys, "2").await;
    let rs: Api<ReplicaSet> = Api::namespaced(client.clone(), &ns.name);
    let owned = rs
        .list(&ListParams::default().labels("app=web"))
        .await
        .expect("list ReplicaSets");
    assert_eq!(owned.items.len(), 2, "one ReplicaSet per revision");

    // Nobody else may update without a token, and an exempt identity may not touch the fencing.
    let ns_flag = ["-n", ns.name.as_str()];
    let (ok, _, err) = kubectl(
        &[
            &ns_flag[..],
            &[
                "annotate",
                "deployment",
                "web",
                "--overwrite",
                &format!("{REVISION}=9"),
            ],
        ]
        .concat(),
    );
    assert!(!ok && err.contains("does not present a token"), "{err}");
    let as_gc = format!("--as={GC}");
    let (ok, _, err) = kubectl(
        &[
            &ns_flag[..],
            &[
                as_gc.as_str(),
                "annotate",
                "deployment",
                "web",
                "--overwrite",
                "fencedlease.io/token=1",
            ],
        ]
        .concat(),
    );
    assert!(
        !ok && err.contains("fencedlease"),
        "the GC's identity changed the token: {err}"
    );

    // The lease moves again; the holder deletes (announced, as every delete of a protected
    // object must be) in the foreground: the garbage collector deletes the ReplicaSets, then
    // removes its finalizer from the protected Deployment, which it then deletes.
    let c = move_lease(&client, &ns.name, "inv", "pod-c").await;
    announce_delete(&deploys, "web", &c)
        .await
        .expect("the holder announces the delete");
    deploys
        .delete("web", &DeleteParams::foreground())
        .await
        .expect("delete");
    eventually(
        Duration::from_secs(60),
        "the garbage collector to finish the cascading delete",
        || async {
            let gone = deploys.get_opt("web").await.ok()?.is_none();
            let left = rs
                .list(&ListParams::default().labels("app=web"))
                .await
                .ok()?;
            (gone && left.items.is_empty()).then_some(())
        },
    )
    .await;
}

/// Anonymous, unauthenticated and node identities are never exempt: the webhook refuses to
/// start with one (before it loads a certificate or talks to the API server), saying which and
/// why; the chart's schema refuses them first (tests/chart.rs).
#[test]
fn the_webhook_refuses_to_start_with_an_anonymous_or_node_exemption() {
    for (flag, name, why) in [
        ("--exempt-user", "system:anonymous", "without credentials"),
        ("--exempt-user", "system:node:node-1", "kubelet"),
        (
            "--exempt-group",
            "system:unauthenticated",
            "without credentials",
        ),
        ("--exempt-group", "system:nodes", "every kubelet"),
    ] {
        // The ceiling only stops a hung test: a webhook that took the exemption would wait for
        // its certificate files for good.
        let out = std::process::Command::new("timeout")
            .args(["30", env!("CARGO_BIN_EXE_fencedlease")])
            .args(["webhook", "--tls-cert", "/nonexistent/tls.crt"])
            .args([
                "--tls-key",
                "/nonexistent/tls.key",
                &format!("{flag}={name}"),
            ])
            .output()
            .expect("run fencedlease webhook");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag}={name} was accepted: {err}");
        assert!(
            err.contains(name) && err.contains(why) && err.contains("--exempt-user"),
            "{flag}={name}: {err}"
        );
    }
}

/// Protection follows control (issue 33, hole 4): an autoscaler scales its target through
/// exempt /scale writes for whoever may edit it, so writes to the HorizontalPodAutoscaler of a
/// protected Deployment are judged by the Deployment's lease. A replaced holder cannot move the
/// replicas through the autoscaler; the holder stamps its autoscaler like the object; an
/// autoscaler of an unprotected Deployment is nobody's business.
#[tokio::test]
async fn an_autoscaler_of_a_protected_deployment_is_judged_by_its_lease() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "hpa").await;
    let dir = scratch_dir("hpa");
    let _wh = Webhook::start(&client, &dir, &ns.name).await;
    let a = held_lease(&client, &ns.name, "inv", "pod-a").await;
    let deploys: Api<Deployment> = Api::namespaced(client.clone(), &ns.name);
    let deployment = |meta: serde_json::Value| {
        serde_json::json!({"metadata": meta, "spec": {"replicas": 1,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {"metadata": {"labels": {"app": "web"}},
                "spec": {"nodeSelector": {"fencedlease.io/nowhere": "true"},
                         "containers": [{"name": "c", "image": "fencedlease-test-none:0"}]}}}})
    };
    create(&deploys, deployment(protected_meta("web", "inv", &a)))
        .await
        .expect("the protected Deployment");
    create(&deploys, deployment(serde_json::json!({"name": "plain"})))
        .await
        .expect("an unprotected Deployment");
    // autoscaling/v2 from Kubernetes 1.23, v2beta2 before (the same fields).
    let version = if common::server_minor(&client).await >= 23 {
        "v2"
    } else {
        "v2beta2"
    };
    let ar = kube::discovery::ApiResource {
        group: "autoscaling".into(),
        version: version.into(),
        api_version: format!("autoscaling/{version}"),
        kind: "HorizontalPodAutoscaler".into(),
        plural: "horizontalpodautoscalers".into(),
    };
    let hpas: Api<kube::api::DynamicObject> = Api::namespaced_with(client.clone(), &ns.name, &ar);
    let hpa = |name: &str, target: &str, annotations: serde_json::Value| {
        serde_json::json!({"apiVersion": ar.api_version, "kind": ar.kind,
            "metadata": {"name": name, "annotations": annotations},
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target},
                     "minReplicas": 1, "maxReplicas": 3}})
    };
    let r = create(&hpas, hpa("web", "web", serde_json::json!({}))).await;
    assert_refused(
        "an unstamped autoscaler of the protected Deployment",
        r,
        403,
        "this autoscaler scales Deployment",
    );
    create(&hpas, hpa("web", "web", stamp(&a)))
        .await
        .expect("the holder's autoscaler, stamped");
    create(&hpas, hpa("plain", "plain", serde_json::json!({})))
        .await
        .expect("an unprotected Deployment's autoscaler needs no token");
    // The lease moves: A, replaced, raises the floor of the replicas: refused; B may.
    let b = move_lease(&client, &ns.name, "inv", "pod-b").await;
    let floor = serde_json::json!({"spec": {"minReplicas": 3}});
    let r = fenced_merge(&hpas, "web", &a, floor.clone()).await;
    assert_refused(
        "A's autoscaler change",
        r,
        403,
        &format!("stale token {}", a.token),
    );
    fenced_merge(&hpas, "web", &b, floor)
        .await
        .expect("B's autoscaler change");
    // The autoscaler controller finds its target by group and kind in any served version: an
    // apiVersion nobody serves does not hide a protected target.
    let mut unserved = hpa("v9", "web", serde_json::json!({}));
    unserved["spec"]["scaleTargetRef"]["apiVersion"] = "apps/v9".into();
    let r = create(&hpas, unserved).await;
    assert_refused(
        "an autoscaler naming apps/v9",
        r,
        403,
        "this autoscaler scales Deployment",
    );
    // An autoscaler labelled for a lease is protected by it, whatever it scales.
    let mut own = hpa("own", "plain", serde_json::json!({}));
    own["metadata"]["labels"] = serde_json::json!({"fencedlease.io/lease": "inv"});
    let r = create(&hpas, own).await;
    assert_refused(
        "an unstamped autoscaler labelled for the lease",
        r,
        403,
        "must carry the holder's token",
    );
    // Pointing the unprotected Deployment's autoscaler at the protected one is judged too.
    let retarget = serde_json::json!({"spec": {"scaleTargetRef": {"name": "web"}}});
    let r = common::fencing::merge(&hpas, "plain", retarget).await;
    assert_refused(
        "retargeting an autoscaler at the protected Deployment",
        r,
        403,
        "must carry the holder's token",
    );
}
