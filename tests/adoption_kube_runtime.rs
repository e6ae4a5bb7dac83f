//! A kube-runtime operator fenced in a few lines (issue 35): two replicas of the elector
//! crate's sample operator (elector/examples/fenced_operator.rs: `run_while_leading` around its
//! `Controller`, writes through `fenced_client`) play the frozen-leader story of
//! tests/common/samples.rs against the real API server and the real fencing webhook.

use fencedlease_testkit as common;

#[tokio::test]
async fn a_frozen_leaders_stamped_write_is_refused_and_the_new_leaders_lands() {
    let bin = common::example_bin("fenced_operator");
    common::samples::frozen_leader_story(&bin, "kube-runtime").await;
}

/// `fenced_client` on its own, in-process, against the real webhook: a leader's create and
/// JSON patch land stamped; a delete is announced for it, and the caller's resourceVersion
/// precondition still guards it (a stale one deletes nothing); once the tenure is over,
/// nothing is sent.
#[tokio::test]
async fn the_fenced_client_stamps_announces_deletes_and_stops_with_the_tenure() {
    use fencedlease_elector::client::fenced_client;
    use fencedlease_elector::{Elector, ElectorConfig, LeaderState};
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
    use serde_json::json;

    let client = common::client().await;
    common::ensure_crd();
    let ns = common::TestNamespace::new(&client, "fenced-client").await;
    let dir = common::procs::scratch_dir("fenced-client");
    let _webhook = common::webhook::Webhook::start(&client, &dir, &ns.name).await;
    let mut cfg = ElectorConfig::new(&ns.name, "db", "me");
    cfg.create_with_duration = Some(5);
    let (elector, handle) = Elector::new(client.clone(), cfg).expect("an elector");
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let campaign = tokio::spawn(elector.run(async move {
        let _ = stopped.wait_for(|s| *s).await;
    }));
    let mut state = handle.state.clone();
    state
        .wait_for(|s| matches!(s, LeaderState::Leading { .. }))
        .await
        .expect("leading");
    let writes: Api<ConfigMap> =
        Api::namespaced(fenced_client(&client, "db", handle.state.clone()), &ns.name);
    let cm: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "inv", "labels": {fencedlease::stamp::LEASE_LABEL: "db"}},
        "data": {"v": "1"},
    }))
    .expect("a ConfigMap");
    let created = writes
        .create(&PostParams::default(), &cm)
        .await
        .expect("the leader's stamped create lands");
    let ops: json_patch::Patch =
        serde_json::from_value(json!([{"op": "replace", "path": "/data/v", "value": "2"}]))
            .expect("a JSON patch");
    writes
        .patch("inv", &PatchParams::default(), &Patch::<()>::Json(ops))
        .await
        .expect("the leader's stamped JSON patch lands");
    // A delete guarded by a version the object has moved past deletes nothing.
    let stale = DeleteParams {
        preconditions: Some(Preconditions {
            resource_version: created.metadata.resource_version.clone(),
            uid: None,
        }),
        ..DeleteParams::default()
    };
    let refused = writes.delete("inv", &stale).await;
    assert!(
        matches!(&refused, Err(kube::Error::Service(e)) if e.to_string().contains("409")),
        "{refused:?}"
    );
    let current = writes.get("inv").await.expect("still there");
    let guarded = DeleteParams {
        preconditions: Some(Preconditions {
            resource_version: current.metadata.resource_version.clone(),
            uid: None,
        }),
        ..DeleteParams::default()
    };
    writes
        .delete("inv", &guarded)
        .await
        .expect("announced, the leader's delete lands");
    assert!(writes.get_opt("inv").await.expect("get").is_none());
    // The tenure ends: nothing more is sent.
    handle.request_release();
    state
        .wait_for(|s| !matches!(s, LeaderState::Leading { .. }))
        .await
        .expect("released");
    let after = writes.create(&PostParams::default(), &cm).await;
    assert!(
        matches!(&after, Err(kube::Error::Service(e)) if e.to_string().contains("does not lead")),
        "{after:?}"
    );
    let _ = stop.send(true);
    campaign.await.expect("join").expect("the campaign ends");
}
