//! Fencing hole 5: writes through subresources. /status of built-in types can change labels and
//! annotations, and is judged like any write; a custom resource's /status keeps the stored
//! metadata, so no token can be presented there (refused, saying so); a Scale object carries no
//! labels, so every /scale write is checked against the scaled object and refused when it is
//! protected. Kubernetes' own controllers (the HPA) stay exempt.

mod common;

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
        409,
        "does not present a token",
    );
    let three = serde_json::json!({"spec": {"replicas": 3}});
    let r = patched(deploys.patch_scale("web", &pp, &Patch::Merge(&three)).await).await;
    assert_refused("deployments/scale", r, 409, SCALE_REFUSED);
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
        409,
        "does not present a token",
    );
    let r = patched(sts.patch_scale("db", &pp, &Patch::Merge(&three)).await).await;
    assert_refused("statefulsets/scale", r, 409, SCALE_REFUSED);

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
    assert_refused("widgets/status", r, 409, "no token can be presented there");
    let r = patched(
        widgets
            .patch_scale("gear", &pp, &Patch::Merge(&three))
            .await,
    )
    .await;
    assert_refused("widgets/scale", r, 409, SCALE_REFUSED);
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
