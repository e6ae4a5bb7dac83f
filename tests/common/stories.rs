//! The fencing stories, told once and played under either guard: the webhook
//! (`tests/fencing_presented.rs`, `tests/fencing_server_side_apply.rs`) and the fencing policy
//! (`tests/fencing_policy.rs`). The same writes get the same verdicts, messages and status code
//! (403 Forbidden from either: `stamp::REFUSAL_CODE`), and in policy mode a story
//! waits after moving a lease until the API server's view of it has caught up (`sees`).

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;
use serde_json::json;

use super::fencing::{
    assert_refused, create, fenced_merge, merge, move_lease, stamp, Held, Protected, Refused,
    LEASE, TOKEN, UID, WRITE_ID,
};
use super::kubectl;

fn data_n(cm: &ConfigMap) -> Option<&str> {
    cm.data.as_ref()?.get("n").map(String::as_str)
}

/// The articles' story: A writes; the lease moves to B; B writes with its token; A, replaced,
/// writes again with its old token and is refused, with a message naming both tokens and B.
pub async fn a_replaced_holder_is_refused(p: &Protected) {
    let (ns, cms, a) = (&p.ns.name, &p.cms, &p.a);
    fenced_merge(cms, "inv", a, json!({"data": {"n": "a1"}}))
        .await
        .expect("the holder's write lands");
    let b = move_lease(&p.client, ns, "inv", "pod-b").await;
    assert!(b.token > a.token);
    p.sees(&b).await;
    fenced_merge(cms, "inv", &b, json!({"data": {"n": "b1"}}))
        .await
        .expect("the new holder's write lands");
    let r = fenced_merge(cms, "inv", a, json!({"data": {"n": "a2"}})).await;
    eprintln!("a replaced holder's write: {:?}", r.as_ref().err());
    assert_refused(
        "A's stale write",
        r.clone(),
        p.code(),
        &format!("stale token {}", a.token),
    );
    let (_, msg) = r.expect_err("refused");
    assert!(
        msg.contains(&format!("moved on to token {}", b.token)) && msg.contains("held by pod-b"),
        "{msg}"
    );
    let stored = cms.get("inv").await.expect("read");
    assert_eq!(data_n(&stored), Some("b1"), "B's write stands");
}

/// Every way a write can fail to present the current token, on a create labelled for lease
/// "inv" (and a free lease): refused, each with its own message naming the lease.
pub async fn every_bad_token_is_refused(p: &Protected) {
    let (ns, cms, a) = (&p.ns.name, &p.cms, &p.a);
    let free = super::fencing::free_lease(&p.client, ns, "free").await;
    p.judges("free").await;
    let g = a.token.to_string();
    let uid = a.uid.as_str();
    let cases: Vec<(&str, &str, serde_json::Value, &str)> = vec![
        (
            "future",
            "inv",
            json!({TOKEN: (a.token + 5).to_string(), UID: uid}),
            "is ahead of",
        ),
        (
            "missing",
            "inv",
            json!({UID: uid}),
            "must carry the holder's token",
        ),
        (
            "malformed",
            "inv",
            json!({TOKEN: "7abc", UID: uid}),
            "is not a fencing token",
        ),
        (
            "padded",
            "inv",
            json!({TOKEN: format!("0{g}"), UID: uid}),
            "leading zeros",
        ),
        (
            "negative",
            "inv",
            json!({TOKEN: "-1", UID: uid}),
            "negative",
        ),
        (
            "huge",
            "inv",
            json!({TOKEN: "99999999999999999999", UID: uid}),
            "64-bit",
        ),
        ("empty", "inv", json!({TOKEN: "", UID: uid}), "it is empty"),
        (
            "nouid",
            "inv",
            json!({TOKEN: g}),
            "no fencedlease.io/lease-uid",
        ),
        (
            "olduid",
            "inv",
            json!({TOKEN: g, UID: "not-this-lease"}),
            "which was deleted",
        ),
        (
            "free",
            "free",
            json!({TOKEN: free.token.to_string(), UID: free.uid}),
            "is free",
        ),
    ];
    for (name, lease, annotations, want) in cases {
        let cm = json!({"metadata": {"name": name, "labels": {LEASE: lease}, "annotations": annotations}});
        let r: Result<ConfigMap, Refused> = create(cms, cm).await;
        if let Err((code, msg)) = &r {
            eprintln!("{name}: {code} {msg}");
        }
        assert_refused(name, r.clone(), p.code(), want);
        let (_, msg) = r.expect_err("refused");
        assert!(
            msg.contains(&format!("{ns}/{lease}")),
            "{name}: the message names the lease: {msg}"
        );
    }
    // The current token passes, and an unlabelled object never needs one.
    create::<ConfigMap>(
        cms,
        json!({"metadata": super::fencing::protected_meta("ok", "inv", a)}),
    )
    .await
    .expect("the current token is accepted");
    create::<ConfigMap>(cms, json!({"metadata": {"name": "plain"}}))
        .await
        .expect("unprotected objects are untouched");
}

/// A write must present its token itself: the token an earlier write left on the object (kubectl
/// label, annotate, edit, a read-modify-write that keeps what it read) does not count; an update
/// passes only with a new write id beside the token.
pub async fn a_write_must_present_its_token(p: &Protected) {
    let (ns, cms, a) = (&p.ns.name, &p.cms, &p.a);
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
        let mut full = vec!["-n", ns.as_str()];
        full.extend(args.iter().copied());
        let (ok, _, err) = kubectl(&full);
        assert!(
            !ok && err.contains(not_presented),
            "kubectl {args:?}: {err}"
        );
    }
    // A read-modify-write that keeps what it read (the stored write id): refused.
    let mut read = cms.get("inv").await.expect("read");
    read.data
        .get_or_insert_default()
        .insert("n".into(), "2".into());
    let r = cms
        .replace("inv", &PostParams::default(), &read)
        .await
        .map_err(|e| match e {
            kube::Error::Api(s) => (s.code, s.message),
            other => (0, other.to_string()),
        });
    assert_refused("replace with the stored stamp", r, p.code(), not_presented);
    // The token and uid written again, but the write id reused: refused.
    let stored_id = read
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(WRITE_ID))
        .cloned()
        .expect("the stored write id");
    let reuse = json!({"metadata": {"annotations": {
        TOKEN: a.token.to_string(), UID: a.uid, WRITE_ID: stored_id}}, "data": {"n": "3"}});
    let r = merge(cms, "inv", reuse).await;
    eprintln!("a reused write id: {:?}", r.as_ref().err());
    assert_refused("a reused write id", r, p.code(), not_presented);
    // A write that presents: token, uid and a new write id.
    let ok = fenced_merge(cms, "inv", a, json!({"data": {"n": "4"}}))
        .await
        .expect("a write that presents its token");
    assert_eq!(data_n(&ok), Some("4"));
    // And a full replace that presents, too.
    let mut read = cms.get("inv").await.expect("read");
    read.metadata.annotations = serde_json::from_value(stamp(a)).ok();
    read.data
        .get_or_insert_default()
        .insert("n".into(), "5".into());
    cms.replace("inv", &PostParams::default(), &read)
        .await
        .expect("a replace that presents its token");
}

/// Applies `n` to ConfigMap "inv" as field manager `manager`, with `annotations`.
async fn apply(
    cms: &Api<ConfigMap>,
    manager: &str,
    annotations: serde_json::Value,
    n: &str,
) -> Result<ConfigMap, Refused> {
    let cm = json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "inv", "labels": {LEASE: "inv"}, "annotations": annotations},
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

/// Server-side apply (kubectl apply --server-side, Flux, Argo CD) is fenced like any write: the
/// guard judges the object the apply would store.
pub async fn server_side_apply_is_fenced(p: &Protected) {
    let (ns, cms, a) = (&p.ns.name, &p.cms, &p.a);
    let applied = apply(cms, "writer-a", stamp(a), "1")
        .await
        .expect("the holder's apply with its stamp");
    assert_eq!(data_n(&applied), Some("1"));

    let b: Held = move_lease(&p.client, ns, "inv", "pod-b").await;
    assert!(b.token > a.token);
    p.sees(&b).await;
    // The replaced writer applies again with its own (now stale) token: refused.
    assert_refused(
        "a stale apply",
        apply(cms, "writer-a", stamp(a), "2").await,
        p.code(),
        &format!("stale token {}", a.token),
    );
    // An apply that leaves the stamp out keeps the token stored by earlier writes (another
    // manager owns it too), but that token is not presented by this write: refused.
    assert_refused(
        "an apply without a stamp",
        apply(cms, "writer-a", json!({}), "3").await,
        p.code(),
        "does not present a token of its own",
    );
    // The new holder's apply, stamped: accepted, and the object shows it.
    let applied = apply(cms, "writer-b", stamp(&b), "4")
        .await
        .expect("the new holder's apply with its stamp");
    assert_eq!(data_n(&applied), Some("4"));
    let stored = cms.get("inv").await.expect("read back");
    assert_eq!(data_n(&stored), Some("4"));
    let token = stored
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(TOKEN))
        .cloned();
    assert_eq!(token, Some(b.token.to_string()));
}

/// The fencing label is protected too: the stored object's label decides which lease judges a
/// write. A replaced holder can neither remove the label nor move the object to a lease it
/// does hold; the current holder may unprotect the object, and then anyone may write it.
pub async fn the_label_is_protected_too(p: &Protected) {
    let (ns, cms, a) = (&p.ns.name, &p.cms, &p.a);
    let other = super::fencing::held_lease(&p.client, ns, "other", "pod-a").await;
    p.judges("other").await;
    let b = move_lease(&p.client, ns, "inv", "pod-b").await;
    p.sees(&b).await;
    let unlabel = json!({"metadata": {"labels": {LEASE: null}}});
    let r = fenced_merge(cms, "inv", a, unlabel.clone()).await;
    let stale = format!("stale token {}", a.token);
    assert_refused("A removes the lease label", r, p.code(), &stale);
    // With the token of a lease A holds: judged by the stored label's lease, whose uid differs.
    let relabel = json!({"metadata": {"labels": {LEASE: "other"}}});
    let r = fenced_merge(cms, "inv", &other, relabel).await;
    let other_incarnation = format!("stale token {}: it belongs to an earlier", other.token);
    assert_refused(
        "A moves the object to lease other",
        r,
        p.code(),
        &other_incarnation,
    );
    fenced_merge(cms, "inv", &b, unlabel)
        .await
        .expect("the holder may unprotect the object");
    merge(cms, "inv", json!({"data": {"n": "free"}}))
        .await
        .expect("an unlabelled object needs no token");
}

/// Deletes are fenced (issue 33, hole 3): a protected object is deleted only by the current
/// holder, which announces the delete in a fenced update and then deletes. A replaced holder
/// cannot announce one, cannot carry out one it announced before it was replaced, and cannot
/// ride on an announcement that a later write followed; nobody deletes unannounced, one object
/// or a whole collection.
pub async fn deletes_are_fenced(p: &Protected) {
    use super::fencing::{announce_delete, delete, fenced_delete, protected_meta};
    let (ns, cms, a) = (&p.ns.name, &p.cms, &p.a);
    let unannounced = "did not announce a delete";
    assert_refused(
        "a delete nobody announced",
        delete(cms, "inv").await,
        p.code(),
        unannounced,
    );
    announce_delete(cms, "inv", a)
        .await
        .expect("the holder announces a delete");
    let b = move_lease(&p.client, ns, "inv", "pod-b").await;
    p.sees(&b).await;
    let stale = format!("stale token {}", a.token);
    assert_refused(
        "A's delete, announced before it was replaced",
        delete(cms, "inv").await,
        p.code(),
        &stale,
    );
    assert_refused(
        "A announcing again",
        announce_delete(cms, "inv", a).await,
        p.code(),
        &stale,
    );
    // B writes; A's announcement is still on the object, but no longer the last write's.
    fenced_merge(cms, "inv", &b, json!({"data": {"by": "b"}}))
        .await
        .expect("B writes");
    let r = delete(cms, "inv").await;
    assert_refused(
        "a delete riding on A's old announcement",
        r.clone(),
        p.code(),
        unannounced,
    );
    let (_, msg) = r.expect_err("refused");
    assert!(msg.contains("not the last write's id"), "{msg}");
    // A collection delete is judged object by object: nothing protected goes unannounced.
    let meta = protected_meta("inv-2", "inv", &b);
    create::<ConfigMap>(cms, json!({"metadata": meta}))
        .await
        .expect("B creates a second object");
    let by_lease = kube::api::ListParams::default().labels(&format!("{LEASE}=inv"));
    let r = cms.delete_collection(&Default::default(), &by_lease).await;
    assert!(r.is_err(), "an unannounced collection delete: {r:?}");
    let left = cms.list(&by_lease).await.expect("list").items.len();
    assert_eq!(left, 2, "both protected objects are still there");
    // The holder's delete lands.
    fenced_delete(cms, "inv", &b)
        .await
        .expect("B's announced delete");
    assert!(
        cms.get_opt("inv").await.expect("read").is_none(),
        "inv is gone"
    );
}

/// A lease being deleted fences nothing (issue 37): while it waits for a finalizer (in policy
/// mode the controller holds it until the lease index drops it; here a finalizer of the test's
/// own), a write presenting even its current token is refused, saying the lease is being
/// deleted. Elections end too: the electors take a lease being deleted for a deleted one.
pub async fn a_lease_being_deleted_fences_nothing(p: &Protected) {
    use super::fencing::protected_meta;
    use fencedlease::api::{FencedLease, FencedLeaseSpec};
    use kube::api::DeleteParams;
    const HOLD: &str = "example.com/test-hold";
    let ns = &p.ns.name;
    let leases: Api<FencedLease> = Api::namespaced(p.client.clone(), ns);
    let mut spec = FencedLeaseSpec::free();
    spec.holder_identity = Some("pod-d".into());
    let mut doomed = FencedLease::new("doomed", spec);
    doomed.metadata.finalizers = Some(vec![HOLD.into()]);
    let made = leases
        .create(&PostParams::default(), &doomed)
        .await
        .expect("create lease doomed");
    let d = Held {
        token: made.metadata.generation.expect("generation"),
        uid: made.metadata.uid.clone().expect("uid"),
    };
    p.judges("doomed").await;
    create::<ConfigMap>(
        &p.cms,
        json!({"metadata": protected_meta("doomed", "doomed", &d)}),
    )
    .await
    .expect("the holder writes while the lease stands");
    leases
        .delete("doomed", &DeleteParams::default())
        .await
        .expect("delete lease doomed");
    let now = leases
        .get("doomed")
        .await
        .expect("the lease waits for its finalizer");
    let current = Held {
        token: now.metadata.generation.expect("generation"),
        uid: d.uid.clone(),
    };
    assert!(current.token > d.token, "the delete raised the generation");
    // The guard's view of the lease follows it (in policy mode, the API server's cache).
    let want = format!(
        "FencedLease {ns}/doomed is being deleted (current token {})",
        current.token
    );
    let cms = p.cms.clone();
    super::eventually(
        std::time::Duration::from_secs(20),
        "the guard to see the delete",
        || async {
            let probe: ConfigMap = serde_json::from_value(
                json!({"metadata": protected_meta("doomed-2", "doomed", &current)}),
            )
            .ok()?;
            let dry = PostParams {
                dry_run: true,
                ..Default::default()
            };
            match cms.create(&dry, &probe).await {
                Err(kube::Error::Api(s)) if s.message.contains(&want) => Some(()),
                _ => None,
            }
        },
    )
    .await;
    let r = fenced_merge(&p.cms, "doomed", &current, json!({"data": {"n": "after"}})).await;
    assert_refused(
        "the lease's current token, the lease being deleted",
        r,
        p.code(),
        &want,
    );
    // Let it go: the test's finalizer off, the others (policy mode's) left to the controller,
    // which may change the lease meanwhile (a conflict: read again).
    super::eventually(
        std::time::Duration::from_secs(20),
        "the test's finalizer off",
        || async {
            let Some(now) = leases.get_opt("doomed").await.ok()? else {
                return Some(());
            };
            let left: Vec<String> = now.metadata.finalizers.unwrap_or_default();
            let left: Vec<String> = left.into_iter().filter(|f| f != HOLD).collect();
            let rv = now.metadata.resource_version;
            let patch = json!({"metadata": {"resourceVersion": rv, "finalizers": left}});
            let pp = PatchParams::default();
            leases
                .patch("doomed", &pp, &Patch::Merge(&patch))
                .await
                .ok()
                .map(|_| ())
        },
    )
    .await;
}
