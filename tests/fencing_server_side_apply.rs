//! Server-side apply (what `kubectl apply --server-side`, Flux and Argo CD's SSA mode send) is
//! fenced like any other write: the webhook judges the object the apply would store, so an
//! apply presents a token only when the applied configuration carries one, with a new write id.

mod common;

use common::fencing::{assert_refused, move_lease, stamp, Held, Protected, Refused};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Patch, PatchParams};
use kube::Api;
use serde_json::json;

/// Applies `data` to ConfigMap "inv" as field manager `manager`, with `annotations`.
async fn apply(
    cms: &Api<ConfigMap>,
    manager: &str,
    annotations: serde_json::Value,
    n: &str,
) -> Result<ConfigMap, Refused> {
    let cm = json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "inv", "labels": {"fencedlease.io/lease": "inv"}, "annotations": annotations},
        "data": {"n": n}
    });
    cms.patch(
        "inv",
        &PatchParams::apply(manager).force(),
        &Patch::Apply(&cm),
    )
    .await
    .map_err(|e| match e {
        kube::Error::Api(s) => (s.code, s.message),
        other => (0, other.to_string()),
    })
}

fn n_of(cm: &ConfigMap) -> Option<&str> {
    cm.data.as_ref()?.get("n").map(String::as_str)
}

#[tokio::test]
async fn server_side_apply_is_fenced_like_any_write() {
    let Protected {
        client,
        ns,
        cms,
        a,
        wh: _wh,
        ..
    } = Protected::new("ssa", false).await;
    let applied = apply(&cms, "writer-a", stamp(&a), "1")
        .await
        .expect("the holder's apply with its stamp");
    assert_eq!(n_of(&applied), Some("1"));

    let b: Held = move_lease(&client, &ns.name, "inv", "pod-b").await;
    assert!(b.token > a.token);
    // The replaced writer applies again with its own (now stale) token: refused.
    assert_refused(
        "a stale apply",
        apply(&cms, "writer-a", stamp(&a), "2").await,
        409,
        &format!("stale token {}", a.token),
    );
    // An apply that leaves the stamp out keeps the token stored by earlier writes (another
    // manager owns it too), but that token is not presented by this write: refused.
    assert_refused(
        "an apply without a stamp",
        apply(&cms, "writer-a", json!({}), "3").await,
        409,
        "does not present a token of its own",
    );
    // The new holder's apply, stamped: accepted, and the object shows it.
    let applied = apply(&cms, "writer-b", stamp(&b), "4")
        .await
        .expect("the new holder's apply with its stamp");
    assert_eq!(n_of(&applied), Some("4"));
    let stored = cms.get("inv").await.expect("read back");
    assert_eq!(n_of(&stored), Some("4"));
    let token = stored
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(common::fencing::TOKEN))
        .cloned();
    assert_eq!(token, Some(b.token.to_string()));
}
