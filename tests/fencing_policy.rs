//! Policy mode (issue 18): with NO webhook running, the API server itself refuses stale writes
//! to protected objects, evaluating the chart's ValidatingAdmissionPolicy with the object's
//! FencedLease as its parameter, through the chart's one binding (issue 37). A controller keeps
//! the namespace's lease index, which the chart's index policy reads to refuse writes naming a
//! lease it does not list; the fencing holds with the controller stopped (it is on the liveness
//! path of new leases only).
//!
//! The webhook's stories play here unchanged (`tests/common/stories.rs`): the same writes get
//! the same verdicts, messages and status (403 Forbidden). Then what differs: the
//! writes policy mode does not check or does not soften (the book, docs/src/policy-mode.md).
//!
//! Needs Kubernetes 1.30 or later (ValidatingAdmissionPolicy v1); on an older server every test
//! here fails, saying so. hack/test.sh runs it on the current release only.

use fencedlease_testkit as common;

use std::time::Duration;

use common::fencing::{
    assert_refused, create, fenced_merge, merge, move_lease, Protected, LEASE, TOKEN, UID, WRITE_ID,
};
use common::{client_as, eventually, kubectl};
use fencedlease::api::FencedLease;
use fencedlease::controller::policy::policy_hash;
use k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicyBinding;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::Api;
use serde_json::json;

#[tokio::test]
async fn policy_mode_a_replaced_holder_is_refused_by_the_api_server() {
    let p = Protected::with_policy("vapstale").await;
    common::stories::a_replaced_holder_is_refused(&p).await;
}

#[tokio::test]
async fn policy_mode_deletes_are_fenced() {
    let p = Protected::with_policy("vapdelete").await;
    common::stories::deletes_are_fenced(&p).await;
}

#[tokio::test]
async fn policy_mode_every_bad_token_is_refused_with_its_own_message() {
    let p = Protected::with_policy("vapbad").await;
    common::stories::every_bad_token_is_refused(&p).await;
}

#[tokio::test]
async fn policy_mode_a_write_must_present_its_token() {
    let p = Protected::with_policy("vappresent").await;
    common::stories::a_write_must_present_its_token(&p).await;
}

#[tokio::test]
async fn policy_mode_the_label_is_protected_too() {
    let p = Protected::with_policy("vaplabel").await;
    common::stories::the_label_is_protected_too(&p).await;
}

#[tokio::test]
async fn policy_mode_server_side_apply_is_fenced() {
    let p = Protected::with_policy("vapssa").await;
    common::stories::server_side_apply_is_fenced(&p).await;
}

/// Kubernetes' own controllers (the garbage collector here) may update a protected object
/// without a token while they leave the fencing label and annotations as they are; changing
/// those, they are judged like anyone.
#[tokio::test]
async fn policy_mode_exempt_controllers_pass_while_they_leave_the_fencing_metadata_alone() {
    let p = Protected::with_policy("vapexempt").await;
    let gc = client_as("system:serviceaccount:kube-system:generic-garbage-collector").await;
    let gc_cms: Api<ConfigMap> = Api::namespaced(gc, &p.ns.name);
    merge(
        &gc_cms,
        "inv",
        json!({"metadata": {"finalizers": ["test.fencedlease.io/hold"]}}),
    )
    .await
    .expect("the garbage collector adds a finalizer without a token");
    merge(&gc_cms, "inv", json!({"metadata": {"finalizers": null}}))
        .await
        .expect("and removes it");
    // Anyone else doing the same is refused: the stored token is not presented by that write.
    let r = merge(
        &p.cms,
        "inv",
        json!({"metadata": {"finalizers": ["test.fencedlease.io/hold"]}}),
    )
    .await;
    assert_refused(
        "a finalizer by the admin",
        r,
        403,
        "does not present a token of its own",
    );
    // The exempt writer that changes the fencing annotations is judged: a stale token is refused.
    let b = move_lease(&p.client, &p.ns.name, "inv", "pod-b").await;
    p.sees(&b).await;
    let r = fenced_merge(&gc_cms, "inv", &p.a, json!({})).await;
    assert_refused(
        "the GC writing a stale stamp",
        r,
        403,
        &format!("stale token {}", p.a.token),
    );
}

/// The forged-high lockout, closed (issue 37). A token above the lease's, stored while the
/// object was unchecked (created without the label), refuses the holder only while the object's
/// last write is newer than the API server's copy of the lease, when a later holder's write is
/// what such a token would be. Once the lease is renewed, the copy has every token the lease
/// handed out before that write: the stored one was never among them and counts for nothing.
#[tokio::test]
async fn policy_mode_a_forged_token_above_the_lease_counts_only_until_the_lease_is_renewed() {
    let p = Protected::with_policy("vapforged").await;
    let forged = (p.a.token + 1000).to_string();
    let unchecked = json!({"metadata": {"name": "forged",
        "annotations": {TOKEN: forged, UID: p.a.uid, WRITE_ID: "forged-write"}}});
    create::<ConfigMap>(&p.cms, unchecked)
        .await
        .expect("an unlabelled object is not checked");
    let label = json!({"metadata": {"labels": {LEASE: "inv"}}});
    let r = fenced_merge(&p.cms, "forged", &p.a, label.clone()).await;
    assert_refused(
        "the holder, while the object's last write is newer than the lease",
        r,
        403,
        &format!("the object already carries token {forged}"),
    );
    // The holder renews (a status write: a new version of the lease, the same token).
    let leases: Api<FencedLease> = Api::namespaced(p.client.clone(), &p.ns.name);
    let renewal = json!({"status": {"renewTime": jiff::Timestamp::now().to_string()}});
    leases
        .patch_status("inv", &PatchParams::default(), &Patch::Merge(&renewal))
        .await
        .expect("renew the lease");
    // Once the API server's copy has the renewal, the holder's write lands.
    eventually(
        Duration::from_secs(30),
        "the holder's write to land once the lease was renewed",
        || async {
            fenced_merge(&p.cms, "forged", &p.a, label.clone())
                .await
                .ok()
                .map(|_| ())
        },
    )
    .await;
}

/// Where policy mode differs from the webhook, shown: a write labelled for a lease that does not
/// exist is refused by the index policy, with its own message (the webhook says the lease is
/// missing); the namespace's warn mode is not honoured (refusals stay refusals, with no
/// warning); a deleted lease's objects are refused once the controller has dropped it from the
/// index (before that, the lease's parameter may already be gone: the window the book names).
#[tokio::test]
async fn policy_mode_what_it_does_not_check_and_what_it_does_not_soften() {
    let p = Protected::with_policy("vapdiff").await;
    let ns = &p.ns.name;

    // No lease "ghost": the index does not list it, so the write is refused.
    let ghost = json!({"metadata": {"name": "ghost", "labels": {LEASE: "ghost"}}});
    let r = create::<ConfigMap>(&p.cms, ghost).await;
    assert_refused(
        "a write labelled for a lease that does not exist",
        r,
        403,
        &format!("FencedLease {ns}/ghost (label fencedlease.io/lease), which the namespace's lease index"),
    );

    // Warn mode of the namespace: the webhook would let a bad write through with a warning; the
    // policy refuses it all the same.
    let nss: Api<Namespace> = Api::all(p.client.clone());
    let warn = json!({"metadata": {"annotations": {fencedlease::api::MODE_ANNOTATION: "warn"}}});
    nss.patch(ns, &PatchParams::default(), &Patch::Merge(&warn))
        .await
        .expect("annotate the namespace warn");
    let r = merge(&p.cms, "inv", json!({"data": {"n": "unstamped"}})).await;
    assert_refused(
        "an unstamped write in warn mode",
        r,
        403,
        "does not present a token of its own",
    );

    // A deleted lease: once the controller has dropped it from the index and the API server
    // has that index, its objects' writes are refused as naming a lease not listed.
    Api::<FencedLease>::namespaced(p.client.clone(), ns)
        .delete("inv", &DeleteParams::default())
        .await
        .expect("delete the lease");
    eventually(
        Duration::from_secs(30),
        "the controller to drop inv from the index",
        || async { (!common::policy::indexed(&p.client, ns, "inv").await).then_some(()) },
    )
    .await;
    eventually(
        Duration::from_secs(30),
        "the index policy to refuse inv's objects' writes",
        || async {
            // The deleted lease's own holder, with its token.
            let r = fenced_merge(
                &p.cms,
                "inv",
                &p.a,
                json!({"data": {"n": "after the delete"}}),
            )
            .await;
            r.err()?.1.contains("does not list").then_some(())
        },
    )
    .await;
}

/// A lease is fenced by the chart's one binding, with no binding made for it: it judges every
/// lease of every namespace. And only the lease an object's label names judges its writes: the
/// namespace's other leases (here, held at other tokens by other holders) never refuse them.
#[tokio::test]
async fn policy_mode_a_new_lease_is_fenced_by_the_one_binding() {
    use common::fencing::{held_lease, protected_meta};
    let p = Protected::with_policy("vapnew").await;
    let ns = &p.ns.name;
    let bindings: Api<ValidatingAdmissionPolicyBinding> = Api::all(p.client.clone());
    let per_lease = bindings
        .list(&ListParams::default())
        .await
        .expect("list bindings")
        .items
        .into_iter()
        .filter(|b| {
            b.spec.as_ref().and_then(|s| s.policy_name.as_deref()) == Some(p.policy().name.as_str())
        })
        .map(|b| b.metadata.name.unwrap_or_default())
        .collect::<Vec<_>>();
    assert_eq!(
        per_lease,
        vec![p.policy().name.clone()],
        "the chart's binding only"
    );
    // Two more leases in the namespace, each at its own token.
    let fresh = held_lease(&p.client, ns, "fresh", "pod-f").await;
    let other = held_lease(&p.client, ns, "other", "pod-o").await;
    p.judges("fresh").await;
    let r = create::<ConfigMap>(
        &p.cms,
        json!({"metadata": {"name": "f1", "labels": {LEASE: "fresh"}}}),
    )
    .await;
    assert_refused(
        "an unstamped write to the new lease's object",
        r,
        403,
        "every write must carry",
    );
    create::<ConfigMap>(
        &p.cms,
        json!({"metadata": protected_meta("f1", "fresh", &fresh)}),
    )
    .await
    .expect("the new lease's holder writes");
    // Another lease's token for this object: refused as a stamp of another lease incarnation.
    let r = create::<ConfigMap>(
        &p.cms,
        json!({"metadata": protected_meta("f2", "fresh", &other)}),
    )
    .await;
    assert_refused("another lease's stamp", r, 403, "belongs to an earlier");
    // The first lease's holder still writes its own object, judged by "inv" alone.
    fenced_merge(&p.cms, "inv", &p.a, json!({"data": {"by": "a again"}}))
        .await
        .expect("inv's holder writes while the namespace has other leases");
}

/// With the controller stopped, nothing is unfenced: the leases it listed stay fenced by the
/// API server alone (a replaced holder is refused), and a lease created meanwhile, or one that
/// does not exist at all, is refused by the index policy, even with the new lease's own token,
/// until the controller is back and lists it.
#[tokio::test]
async fn policy_mode_without_the_controller_no_lease_is_unfenced() {
    use common::fencing::{held_lease, protected_meta};
    let p = Protected::with_policy("vapstop").await;
    p.policy().stop_controller();
    common::stories::a_replaced_holder_is_refused(&p).await;
    let ns = p.ns.name.clone();
    let late = held_lease(&p.client, &ns, "late", "pod-l").await;
    let ghost = common::fencing::Held {
        token: 1,
        uid: "no-such-uid".into(),
    };
    for (what, lease, held) in [
        ("the new lease's holder", "late", &late),
        (
            "a writer naming a lease that does not exist",
            "ghost",
            &ghost,
        ),
    ] {
        let r = create::<ConfigMap>(
            &p.cms,
            json!({"metadata": protected_meta("l1", lease, held)}),
        )
        .await;
        assert_refused(
            what,
            r.clone(),
            403,
            "lease index (annotation fencedlease.io/leases) does not list",
        );
        let (_, msg) = r.expect_err("refused");
        assert!(
            msg.contains(&format!("FencedLease {ns}/{lease}")) && msg.contains("retry"),
            "{msg}"
        );
    }
    p.policy().start_controller();
    p.judges("late").await;
    create::<ConfigMap>(
        &p.cms,
        json!({"metadata": protected_meta("l1", "late", &late)}),
    )
    .await
    .expect("the new lease's holder writes once the controller lists it");
    let r = create::<ConfigMap>(
        &p.cms,
        json!({"metadata": protected_meta("g1", "ghost", &ghost)}),
    )
    .await;
    assert_refused("a write naming a missing lease", r, 403, "does not list");
}

#[tokio::test]
async fn policy_mode_a_lease_being_deleted_fences_nothing() {
    let p = Protected::with_policy("vapdoomed").await;
    common::stories::a_lease_being_deleted_fences_nothing(&p).await;
}

/// Every stale-writer story of the webhook's holds in policy mode with the controller stopped:
/// the controller is on the path of new and deleted leases only, never of a listed lease's
/// writes. (A story that makes a lease of its own runs the controller until it is listed.)
#[tokio::test]
async fn policy_mode_every_story_holds_with_the_controller_stopped() {
    use common::stories;
    stories::a_replaced_holder_is_refused(&Protected::with_policy_stopped("vapsx-replaced").await)
        .await;
    stories::every_bad_token_is_refused(&Protected::with_policy_stopped("vapsx-tokens").await)
        .await;
    stories::a_write_must_present_its_token(&Protected::with_policy_stopped("vapsx-present").await)
        .await;
    stories::server_side_apply_is_fenced(&Protected::with_policy_stopped("vapsx-ssa").await).await;
    stories::the_label_is_protected_too(&Protected::with_policy_stopped("vapsx-label").await).await;
    stories::deletes_are_fenced(&Protected::with_policy_stopped("vapsx-delete").await).await;
    stories::a_lease_being_deleted_fences_nothing(
        &Protected::with_policy_stopped("vapsx-doomed").await,
    )
    .await;
}

/// A lease deleted while the controller is stopped stays fenced: the controller put its
/// finalizer on the lease before it listed it, so the delete only marks the lease (and raises its
/// generation: every token it handed out is stale) and the index keeps listing a lease that
/// still judges. Neither its holder nor an unstamped write gets through. Once the controller is
/// back, it drops the name from the index first and then lets the lease go; a write naming it
/// is refused as unlisted.
#[tokio::test]
async fn policy_mode_a_lease_deleted_while_the_controller_is_down_stays_fenced() {
    use common::fencing::protected_meta;
    use fencedlease::api::LEASE_INDEX_FINALIZER;
    let p = Protected::with_policy("vapdel").await;
    let leases: Api<FencedLease> = Api::namespaced(p.client.clone(), &p.ns.name);
    let guarded = leases.get("inv").await.expect("lease inv");
    assert!(
        guarded
            .metadata
            .finalizers
            .as_ref()
            .is_some_and(|f| f.iter().any(|f| f == LEASE_INDEX_FINALIZER)),
        "a listed lease carries the finalizer: {:?}",
        guarded.metadata.finalizers
    );
    p.policy().stop_controller();
    leases
        .delete("inv", &DeleteParams::default())
        .await
        .expect("delete lease inv");
    // The API server's view of the lease follows it: wait until it judges the holder's stamp
    // stale (a dry run), then write for real.
    let cms = p.cms.clone();
    let a = p.a.clone();
    eventually(
        Duration::from_secs(20),
        "the policy to refuse the deleted lease's holder",
        || async {
            let probe = json!({"metadata": protected_meta("del-probe", "inv", &a)});
            let probe: ConfigMap = serde_json::from_value(probe).ok()?;
            let dry = kube::api::PostParams {
                dry_run: true,
                ..Default::default()
            };
            match cms.create(&dry, &probe).await {
                Err(kube::Error::Api(s)) if s.message.contains("is being deleted") => Some(()),
                _ => None,
            }
        },
    )
    .await;
    let r = fenced_merge(
        &p.cms,
        "inv",
        &p.a,
        json!({"data": {"by": "a after the delete"}}),
    )
    .await;
    assert_refused(
        "the deleted lease's holder",
        r,
        p.code(),
        &format!("FencedLease {}/inv is being deleted", p.ns.name),
    );
    let bare = json!({"metadata": {"name": "del-bare", "labels": {LEASE: "inv"}}});
    let r = create::<ConfigMap>(&p.cms, bare).await;
    assert_refused("an unstamped write", r, p.code(), "every write must carry");
    let held = leases
        .get("inv")
        .await
        .expect("the deleted lease stays while no controller runs");
    assert!(held.metadata.deletion_timestamp.is_some());
    // The controller back: the name leaves the index, then the lease goes.
    p.policy().start_controller();
    eventually(
        Duration::from_secs(30),
        "the deleted lease to go",
        || async { matches!(leases.get_opt("inv").await, Ok(None)).then_some(()) },
    )
    .await;
    assert!(!common::policy::indexed(&p.client, &p.ns.name, "inv").await);
    let r = fenced_merge(&p.cms, "inv", &p.a, json!({"data": {"by": "a at last"}})).await;
    assert_refused(
        "a write naming the gone lease",
        r,
        p.code(),
        "does not list",
    );
}

/// Only the controller writes a namespace's lease index: anyone else (here a cluster admin) is
/// refused, whether they add a name, change the index or create a namespace carrying one;
/// other annotations of the namespace stay free to change.
#[tokio::test]
async fn policy_mode_only_the_controller_writes_the_lease_index() {
    let p = Protected::with_policy("vapguard").await;
    let ns = p.ns.name.clone();
    let admin = ["--as", "someone-else", "--as-group", "system:masters"];
    let annotate = |value: &str| {
        let kv = format!("fencedlease.io/leases={value}");
        let mut args = vec![
            "annotate",
            "namespace",
            ns.as_str(),
            kv.as_str(),
            "--overwrite",
        ];
        args.extend(admin);
        kubectl(&args)
    };
    let (ok, _, err) = annotate("/inv/ghost/");
    assert!(
        !ok && err.contains("only the fencedlease controller writes it"),
        "{err}"
    );
    let mut args = vec![
        "annotate",
        "namespace",
        ns.as_str(),
        "fencedlease.io/leases-",
    ];
    args.extend(admin);
    let (ok, _, err) = kubectl(&args);
    assert!(!ok && err.contains("not someone-else"), "{err}");
    // Through /status and by server-side apply, the same.
    let body =
        json!({"metadata": {"annotations": {"fencedlease.io/leases": "/inv/ghost/"}}}).to_string();
    let mut args = vec![
        "patch",
        "namespace",
        ns.as_str(),
        "--subresource=status",
        "--type=merge",
        "-p",
        body.as_str(),
    ];
    args.extend(admin);
    let (ok, _, err) = kubectl(&args);
    assert!(
        !ok && err.contains("only the fencedlease controller writes it"),
        "/status: {err}"
    );
    let applied = json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": ns, "annotations": {"fencedlease.io/leases": "/inv/ghost/"}}});
    let file = common::procs::scratch_dir("vapguard-ssa").join("ns.json");
    std::fs::write(&file, applied.to_string()).expect("write");
    let mut args = vec![
        "apply",
        "--server-side",
        "--force-conflicts",
        "--field-manager=intruder",
        "-f",
        file.to_str().expect("utf-8"),
    ];
    args.extend(admin);
    let (ok, _, err) = kubectl(&args);
    assert!(
        !ok && err.contains("only the fencedlease controller writes it"),
        "server-side apply: {err}"
    );
    let mut args = vec![
        "annotate",
        "namespace",
        ns.as_str(),
        "team=shop",
        "--overwrite",
    ];
    args.extend(admin);
    let (ok, _, err) = kubectl(&args);
    assert!(ok, "another annotation: {err}");
    let fake = format!("{ns}-fake");
    let manifest = json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": fake, "annotations": {"fencedlease.io/leases": "/ghost/"}}});
    let file = common::procs::scratch_dir("vapguard").join("ns.json");
    std::fs::write(&file, manifest.to_string()).expect("write");
    let mut args = vec!["create", "-f", file.to_str().expect("utf-8")];
    args.extend(admin);
    let (ok, _, err) = kubectl(&args);
    if ok {
        let _ = kubectl(&["delete", "namespace", &fake, "--wait=false"]);
    }
    assert!(
        !ok && err.contains("only the fencedlease controller writes it"),
        "{err}"
    );
    assert!(
        common::policy::indexed(&p.client, &ns, "inv").await
            && !common::policy::indexed(&p.client, &ns, "ghost").await,
        "the index is the controller's"
    );
}

/// A controller in policy mode removes the per-lease bindings that releases up to 0.2.0 kept for
/// its policy, and leaves every other binding alone; the writes stay judged throughout.
#[tokio::test]
async fn policy_mode_the_controller_removes_the_per_lease_bindings_of_0_2_0() {
    let p = Protected::with_policy("vaplegacy").await;
    let ns = p.ns.name.clone();
    let policy = p.policy().name.clone();
    let bindings: Api<ValidatingAdmissionPolicyBinding> = Api::all(p.client.clone());
    let legacy = |name: &str, policy: &str| -> ValidatingAdmissionPolicyBinding {
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"fencedlease.io/policy": policy_hash(policy)}},
            "spec": {
                "policyName": policy,
                "paramRef": {"name": "inv", "namespace": ns, "parameterNotFoundAction": "Deny"},
                "matchResources": {"objectSelector": {"matchLabels": {LEASE: "inv"}}},
                "validationActions": ["Deny"],
            },
        }))
        .expect("binding literal")
    };
    let old = format!("{ns}.inv.fencedlease-{}", policy_hash(&policy));
    // Another release's policy: not this controller's to remove.
    let theirs = format!("{ns}.inv.fencedlease-theirs");
    let pp = kube::api::PostParams::default();
    bindings
        .create(&pp, &legacy(&old, &policy))
        .await
        .expect("0.2.0's binding");
    bindings
        .create(&pp, &legacy(&theirs, "another-fencing"))
        .await
        .expect("another policy's binding");
    p.policy().start_controller();
    eventually(
        Duration::from_secs(60),
        "the controller to remove 0.2.0's per-lease binding",
        || async { bindings.get_opt(&old).await.ok()?.is_none().then_some(()) },
    )
    .await;
    let kept = bindings.get_opt(&theirs).await.expect("get");
    let _ = bindings.delete(&theirs, &DeleteParams::default()).await;
    assert!(kept.is_some(), "another policy's binding was removed");
    let r = merge(&p.cms, "inv", json!({"data": {"n": "unstamped"}})).await;
    assert_refused(
        "an unstamped write",
        r,
        403,
        "does not present a token of its own",
    );
}

/// The active controller keeps an eye on the chart's binding: changed so that it no longer
/// enforces (validationActions Audit), it says so in its gauge (0) and a warning; restored, the
/// gauge is 1 again. Only metrics and logs: the controller changes no binding.
#[tokio::test]
async fn policy_mode_the_controller_reports_a_changed_binding() {
    let p = Protected::with_policy("vapwatch").await;
    let name = p.policy().name.clone();
    let port = common::webhook::free_port();
    let addr = format!("127.0.0.1:{port}");
    p.policy().start_controller_with(&[
        "--metrics-addr",
        &addr,
        "--fencing-policy-check-seconds",
        "1",
    ]);
    let intact = |want: f64| {
        let addr = addr.clone();
        async move {
            eventually(
                Duration::from_secs(30),
                &format!("fencedlease_controller_fencing_binding_intact {want}"),
                || async {
                    let (code, body) = common::sidecars::curl(&[&format!("http://{addr}/metrics")]);
                    (code == 200
                        && common::metric_value(
                            &body,
                            "fencedlease_controller_fencing_binding_intact",
                        ) == want)
                        .then_some(())
                },
            )
            .await
        }
    };
    intact(1.0).await;
    let bindings: Api<ValidatingAdmissionPolicyBinding> = Api::all(p.client.clone());
    let audit = json!({"spec": {"validationActions": ["Audit"]}});
    bindings
        .patch(&name, &PatchParams::default(), &Patch::Merge(&audit))
        .await
        .expect("change the binding");
    intact(0.0).await;
    let log = p.policy().controller_log();
    assert!(
        log.contains("without Deny") && log.contains("helm upgrade"),
        "{log}"
    );
    let deny = json!({"spec": {"validationActions": ["Deny"]}});
    bindings
        .patch(&name, &PatchParams::default(), &Patch::Merge(&deny))
        .await
        .expect("restore the binding");
    intact(1.0).await;
}

/// The controller refuses to run policy mode without its policy or its binding (either alone
/// checks nothing), and says what to do.
#[tokio::test]
async fn policy_mode_the_controller_refuses_to_start_without_its_policy() {
    let client = common::client().await;
    common::policy::require_policy_api(&client).await;
    let ns = common::TestNamespace::new(&client, "vapnopolicy").await;
    let dir = common::procs::scratch_dir("vapnopolicy");
    let mut c = common::procs::controller_with(
        &dir,
        &ns.name,
        "controller",
        &["--fencing-policy", "no-such-fencing-policy"],
    );
    let code = c.wait_exit(Duration::from_secs(20));
    let log = c.log_tail();
    assert_eq!(code, Some(1), "{log}");
    assert!(
        log.contains("no ValidatingAdmissionPolicy of that name exists")
            && log.contains("fencing.mode: policy or both"),
        "{log}"
    );
    // The rendered policy is what the server accepts and type-checks without warnings.
    let rendered = common::policy::render_policy("vapcheck", &ns.name);
    let file = dir.join("policy.yaml");
    std::fs::write(&file, &rendered).expect("write");
    let (ok, out, err) = kubectl(&[
        "apply",
        "--dry-run=server",
        "-f",
        file.to_str().expect("utf-8"),
    ]);
    assert!(ok, "{out}{err}");
    // The policy without its binding (which the chart renders beside it) checks nothing: the
    // controller refuses that too.
    let fence = common::policy::PolicyFence::start(&client, &dir, &ns.name).await;
    // The indexer that start() runs checks the binding as it starts: stop it first.
    fence.stop_controller();
    let (ok, _, err) = kubectl(&["delete", "validatingadmissionpolicybinding", &fence.name]);
    assert!(ok, "{err}");
    fence.start_controller();
    let mut c = fence.take_controller();
    let code = c.wait_exit(Duration::from_secs(20));
    let log = c.log_tail();
    assert_eq!(code, Some(1), "{log}");
    assert!(
        log.contains("a policy without a binding checks nothing"),
        "{log}"
    );
}

/// With pods fenced in policy mode, a kubelet (a node identity, never exempt otherwise) reports
/// a protected pod's status while it leaves the fencing label and annotations alone, as the
/// webhook lets it; touching them through /status, it is judged like anyone, and so is anyone
/// else's status write.
#[tokio::test]
async fn policy_mode_a_kubelet_reports_a_protected_pod_s_status_and_nothing_else() {
    use common::fencing::{held_lease, protected_meta};
    let client = common::client().await;
    common::ensure_crd();
    let ns = common::TestNamespace::new(&client, "vapkubelet").await;
    let dir = common::procs::scratch_dir("vapkubelet");
    let pods = r#"fencing.resources=[{"group":"","resource":"pods"}]"#;
    let _policy =
        common::policy::PolicyFence::start_with(&client, &dir, &ns.name, &["--set-json", pods])
            .await;
    let a = held_lease(&client, &ns.name, "inv", "pod-a").await;
    let pods_api: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), &ns.name);
    let spec =
        json!({"nodeName": "n1", "containers": [{"name": "c", "image": "registry.invalid/x"}]});
    // Judged once the binding is in effect: a dry run of an unstamped protected pod is refused.
    let probe: k8s_openapi::api::core::v1::Pod = serde_json::from_value(
        json!({"metadata": {"name": "probe", "labels": {LEASE: "inv"}}, "spec": spec}),
    )
    .expect("pod literal");
    let dry = kube::api::PostParams {
        dry_run: true,
        ..Default::default()
    };
    common::eventually(
        Duration::from_secs(30),
        "protected pods to be judged",
        || async {
            let e = pods_api.create(&dry, &probe).await.err()?;
            e.to_string()
                .contains("every write must carry")
                .then_some(())
        },
    )
    .await;
    let pod = json!({"metadata": protected_meta("p", "inv", &a), "spec": spec});
    create(&pods_api, pod)
        .await
        .expect("the holder creates the protected pod");
    let status_patch = |who: Option<&str>, patch: serde_json::Value| {
        let mut args = vec![
            "-n",
            ns.name.as_str(),
            "patch",
            "pod",
            "p",
            "--subresource=status",
        ];
        let body = patch.to_string();
        args.extend(["--type=merge", "-p", body.as_str()]);
        if let Some(user) = who {
            args.extend([
                "--as",
                user,
                "--as-group",
                "system:nodes",
                "--as-group",
                "system:masters",
            ]);
        }
        let (ok, _, err) = kubectl(&args);
        (ok, err)
    };
    let kubelet = Some("system:node:n1");
    let (ok, err) = status_patch(kubelet, json!({"status": {"message": "running"}}));
    assert!(ok, "the kubelet's status report: {err}");
    let (ok, err) = status_patch(
        kubelet,
        json!({"metadata": {"annotations": {"fencedlease.io/token": "99"}}, "status": {"message": "x"}}),
    );
    assert!(
        !ok && err.contains("does not present a token"),
        "a kubelet touching the token: {err}"
    );
    let (ok, err) = status_patch(Some("someone"), json!({"status": {"message": "y"}}));
    assert!(
        !ok && err.contains("does not present a token"),
        "someone else's status write: {err}"
    );
}
