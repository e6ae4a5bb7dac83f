//! Fencing holes 6 and 7: warn mode is chosen on the Namespace, never by a writer of the object;
//! and a high token stored while warn mode let it through never locks out the real holder.

use fencedlease_testkit as common;

use common::fencing::{
    assert_refused, create, delete, fenced_delete, fenced_merge, move_lease, protected_meta, Held,
    Protected,
};
use common::kubectl;

const MODE: &str = "fencedlease.io/fencing";

fn annotate_namespace(ns: &str, value: Option<&str>) {
    let kv = match value {
        Some(v) => format!("{MODE}={v}"),
        None => format!("{MODE}-"),
    };
    let (ok, _, err) = kubectl(&["annotate", "namespace", ns, "--overwrite", &kv]);
    assert!(ok, "annotating namespace {ns}: {err}");
}

#[tokio::test]
async fn hole_6_a_stale_writer_cannot_choose_warn_mode_for_the_object() {
    let Protected {
        client,
        ns,
        cms,
        a,
        wh: _wh,
        ..
    } = Protected::new("hole6", false).await;
    let b = move_lease(&client, &ns.name, "inv", "pod-b").await;
    fenced_merge(&cms, "inv", &b, serde_json::json!({"data": {"by": "b"}}))
        .await
        .expect("B writes");
    // A, replaced, asks for warn mode in its own write: still refused.
    let warn =
        serde_json::json!({"metadata": {"annotations": {MODE: "warn"}}, "data": {"by": "a"}});
    let mut patch = warn.clone();
    let r = fenced_merge(&cms, "inv", &a, patch.take()).await;
    assert_refused("A's write asking for warn", r, 403, "stale token");
    // A cannot delete the object (deletes are fenced); once B has, A re-creates it in warn
    // mode with its stale token: the create is judged in the namespace's mode, enforce.
    assert_refused(
        "A's delete",
        delete(&cms, "inv").await,
        403,
        "did not announce",
    );
    fenced_delete(&cms, "inv", &b).await.expect("B deletes");
    let mut meta = protected_meta("inv", "inv", &a);
    meta["annotations"][MODE] = "warn".into();
    let r = create(
        &cms,
        serde_json::json!({"metadata": meta, "data": {"by": "a"}}),
    )
    .await;
    assert_refused("A's re-create in warn mode", r, 403, "stale token");
}

#[tokio::test]
async fn hole_7_a_forged_high_token_stored_in_warn_mode_does_not_lock_out_the_holder() {
    let Protected {
        ns,
        cms,
        a,
        wh: _wh,
        ..
    } = Protected::new("hole7", false).await;
    annotate_namespace(&ns.name, Some("warn"));
    let forged = Held {
        token: 999_999,
        uid: a.uid.clone(),
    };
    fenced_merge(
        &cms,
        "inv",
        &forged,
        serde_json::json!({"data": {"by": "forger"}}),
    )
    .await
    .expect("warn mode lets the forged token through (with a warning)");
    annotate_namespace(&ns.name, None);
    // Back in enforce mode the holder's real token is accepted: 999999 counts for nothing.
    fenced_merge(&cms, "inv", &a, serde_json::json!({"data": {"by": "a"}}))
        .await
        .expect("the holder is not locked out by the stored forged token");
    let r = fenced_merge(
        &cms,
        "inv",
        &forged,
        serde_json::json!({"data": {"by": "forger"}}),
    )
    .await;
    assert_refused("the forged token in enforce mode", r, 403, "is ahead of");
}
