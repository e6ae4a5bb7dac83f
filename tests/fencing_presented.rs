//! Fencing hole 3: a write must present its token itself. The token stored on the object by an
//! earlier write (kubectl label, annotate, edit, a tool or code path that does not stamp) does
//! not count: an update passes only with a new `fencedlease.io/write-id` beside the token.

mod common;

use common::fencing::{
    assert_refused, fenced_merge, merge, stamp, Protected, TOKEN, UID, WRITE_ID,
};
use common::kubectl;
use kube::api::PostParams;

#[tokio::test]
async fn hole_3_an_update_that_does_not_present_a_token_is_refused_though_the_object_carries_the_current_one(
) {
    let Protected {
        ns,
        cms,
        a,
        wh: _wh,
        ..
    } = Protected::new("hole3", false).await;
    let not_presented = "does not present a token of its own";

    // kubectl's writes that do not stamp: label, annotate, a data patch.
    for args in [
        vec!["label", "configmap", "inv", "touched=yes"],
        vec!["annotate", "configmap", "inv", "note=hello"],
        vec![
            "patch",
            "configmap",
            "inv",
            "--type=merge",
            "-p",
            r#"{"data":{"n":"1"}}"#,
        ],
    ] {
        let mut full = vec!["-n", &ns.name];
        full.extend(args.iter().copied());
        let (ok, _, err) = kubectl(&full);
        assert!(
            !ok && err.contains(not_presented),
            "kubectl {args:?}: {err}"
        );
    }
    // A read-modify-write that keeps what it read (the stored write id), with a fresh
    // resourceVersion: refused.
    let mut read = cms.get("inv").await.expect("read");
    read.data
        .get_or_insert_default()
        .insert("n".into(), "2".into());
    let r = cms
        .replace("inv", &PostParams::default(), &read)
        .await
        .map_err(|e| (0, e.to_string()));
    assert_refused("replace with the stored stamp", r, 0, not_presented);
    // The token and uid written again, but the write id reused: refused.
    let stored_id = read
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(WRITE_ID))
        .cloned()
        .expect("the stored write id");
    let reuse = serde_json::json!({"metadata": {"annotations": {
        TOKEN: a.token.to_string(), UID: a.uid, WRITE_ID: stored_id}}, "data": {"n": "3"}});
    assert_refused(
        "a reused write id",
        merge(&cms, "inv", reuse).await,
        409,
        not_presented,
    );
    // A write that presents: token, uid and a new write id.
    let ok = fenced_merge(&cms, "inv", &a, serde_json::json!({"data": {"n": "4"}}))
        .await
        .expect("a write that presents its token");
    assert_eq!(
        ok.data.unwrap_or_default().get("n").map(String::as_str),
        Some("4")
    );
    // And a full replace that presents, too.
    let mut read = cms.get("inv").await.expect("read");
    read.metadata.annotations = serde_json::from_value(stamp(&a)).ok();
    read.data
        .get_or_insert_default()
        .insert("n".into(), "5".into());
    cms.replace("inv", &PostParams::default(), &read)
        .await
        .expect("a replace that presents its token");
}
