//! Foundation: the FencedLease API against a real kube-apiserver.

use fencedlease_testkit as common;

use std::time::Duration;

use common::{client, ensure_crd, eventually, kubectl, TestNamespace};
use fencedlease::api::{FencedLease, FencedLeaseSpec, FencedLeaseStatus};
use fencedlease::crdgen;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Api, Client};

const CRD_NAME: &str = "fencedleases.fencedlease.io";

fn dynamic(client: &Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, &ApiResource::erase::<FencedLease>(&()))
}

fn raw_lease(name: &str, spec: serde_json::Value) -> DynamicObject {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "fencedlease.io/v1alpha1",
        "kind": "FencedLease",
        "metadata": {"name": name},
        "spec": spec,
    }))
    .expect("valid DynamicObject literal")
}

#[tokio::test]
async fn crd_installs_with_kubectl_apply_and_server_side_apply_and_is_established() {
    let client = client().await;
    let minor = common::server_minor(&client).await;
    let with_rules = crdgen::server_takes_rules(minor);
    // crds/ from 1.25, crds/pre-1.25/ before, as the README tells users.
    let crd_dir = common::crd_file()
        .parent()
        .expect("the CRD file's folder")
        .to_path_buf();
    let crd_dir = crd_dir.to_str().expect("utf-8 path");
    // Client-side apply of the whole folder, as the README tells users. Another test binary
    // may be installing the same cluster-wide CRD at this moment: a create that loses that race
    // reports AlreadyExists, and applying again is what a user would do.
    let (mut ok, mut out, mut err) = kubectl(&["apply", "-f", crd_dir]);
    for _ in 0..3 {
        if ok || !err.contains("AlreadyExists") {
            break;
        }
        (ok, out, err) = kubectl(&["apply", "-f", crd_dir]);
    }
    assert!(ok, "kubectl apply -f {crd_dir} failed: {err}");
    assert!(out.contains(CRD_NAME), "{out}");
    // kubectl's server-side apply of the committed file, as the upgrade section says.
    let (ok, _, err) = kubectl(&["apply", "--server-side", "--force-conflicts", "-f", crd_dir]);
    assert!(ok, "kubectl apply --server-side -f {crd_dir} failed: {err}");
    // Server-side apply from the Rust types, as an operator would do it.
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let generated = if with_rules {
        crdgen::crd()
    } else {
        crdgen::crd_without_rules()
    };
    let applied = crds
        .patch(
            CRD_NAME,
            &PatchParams::apply("fencedlease-test-ssa").force(),
            &Patch::Apply(generated),
        )
        .await
        .unwrap_or_else(|e| panic!("server-side apply of the generated CRD on 1.{minor}: {e}"));
    assert_eq!(applied.spec.names.short_names, Some(vec!["flease".into()]));
    let stored = serde_json::to_string(&applied).expect("CRD JSON");
    assert_eq!(
        stored.contains(crdgen::RULES_KEY),
        with_rules,
        "the installed CRD carries validation rules exactly from 1.25"
    );
    if !with_rules {
        // Why old servers get a CRD of their own: kubectl refuses the one with rules there.
        let top = common::repo_root().join("crds/");
        let (ok, _, err) = kubectl(&[
            "apply",
            "--dry-run=server",
            "-f",
            top.to_str().expect("utf-8"),
        ]);
        assert!(
            !ok && err.contains(crdgen::RULES_KEY),
            "kubectl apply -f crds/ on 1.{minor} should be refused for {}: {err}",
            crdgen::RULES_KEY
        );
    }
    eventually(
        Duration::from_secs(30),
        "the CRD to be Established",
        || async {
            let conds = crds.get(CRD_NAME).await.ok()?.status?.conditions?;
            conds
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
                .then_some(())
        },
    )
    .await;
}

#[tokio::test]
async fn server_fills_in_defaults() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "defaults").await;
    dynamic(&client, &ns.name)
        .create(
            &PostParams::default(),
            &raw_lease("db", serde_json::json!({})),
        )
        .await
        .expect("an empty spec is valid");
    let lease = Api::<FencedLease>::namespaced(client.clone(), &ns.name)
        .get("db")
        .await
        .expect("read back");
    assert_eq!(lease.spec, FencedLeaseSpec::free());
    assert_eq!(lease.spec.lease_duration_seconds, 15);
    assert_eq!(lease.metadata.generation, Some(1));
    assert_eq!(lease.token(), Some(1));
    assert_eq!(lease.holder(), None);
}

#[tokio::test]
async fn spec_change_bumps_generation_and_status_write_does_not() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "generation").await;
    let api: Api<FencedLease> = Api::namespaced(client.clone(), &ns.name);
    let created = api
        .create(
            &PostParams::default(),
            &FencedLease::new("writer", FencedLeaseSpec::free()),
        )
        .await
        .expect("create");
    assert_eq!(created.token(), Some(1));

    // An ownership change goes through the spec: a new token.
    let mut taken = created.clone();
    taken.spec.holder_identity = Some("pod-a".into());
    let taken = api
        .replace("writer", &PostParams::default(), &taken)
        .await
        .expect("conditional replace with the current resourceVersion");
    assert_eq!(taken.token(), Some(2));

    // A stale resourceVersion is refused with 409: nobody overwrites blindly.
    let mut stale = created.clone();
    stale.spec.holder_identity = Some("pod-b".into());
    match api.replace("writer", &PostParams::default(), &stale).await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 409, "{s:?}"),
        other => panic!("a write with a stale resourceVersion must be refused, got {other:?}"),
    }

    // A renewal goes through the status subresource: the token stays.
    let mut renewed = taken.clone();
    renewed.status = Some(FencedLeaseStatus {
        holder_identity: Some("pod-a".into()),
        token: Some(2),
        ..Default::default()
    });
    let renewed = api
        .replace_status("writer", &PostParams::default(), &renewed)
        .await
        .expect("status write");
    assert_eq!(
        renewed.token(),
        Some(2),
        "a status write must not change the token"
    );
    assert_eq!(renewed.status.as_ref().and_then(|s| s.token), Some(2));

    // And the status subresource ignores spec changes smuggled into it.
    let mut smuggled = renewed.clone();
    smuggled.spec.holder_identity = Some("intruder".into());
    let after = api
        .replace_status("writer", &PostParams::default(), &smuggled)
        .await
        .expect("status write");
    assert_eq!(after.holder(), Some("pod-a"));
    assert_eq!(after.token(), Some(2));
}

#[tokio::test]
async fn invalid_objects_are_refused_with_a_readable_message() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "invalid").await;
    let api = dynamic(&client, &ns.name);
    let cases = [
        (
            serde_json::json!({"leaseDurationSeconds": 0}),
            "leaseDurationSeconds",
        ),
        (
            serde_json::json!({"leaseDurationSeconds": -5}),
            "leaseDurationSeconds",
        ),
        (
            serde_json::json!({"leaseDurationSeconds": 3601}),
            "leaseDurationSeconds",
        ),
        (
            serde_json::json!({"leaseDurationSeconds": "15s"}),
            "leaseDurationSeconds",
        ),
        (serde_json::json!({"holderIdentity": 7}), "holderIdentity"),
    ];
    for (i, (spec, field)) in cases.into_iter().enumerate() {
        let name = format!("bad-{i}");
        match api
            .create(&PostParams::default(), &raw_lease(&name, spec.clone()))
            .await
        {
            Err(kube::Error::Api(s)) => {
                assert_eq!(s.code, 422, "{spec}: {s:?}");
                assert!(
                    s.message.contains(&format!("spec.{field}")),
                    "the message must name the field; for {spec} it was: {}",
                    s.message
                );
            }
            other => panic!("{spec} must be refused, got {other:?}"),
        }
    }
    // The bounds themselves are accepted.
    for (i, d) in [1, 3600].into_iter().enumerate() {
        api.create(
            &PostParams::default(),
            &raw_lease(
                &format!("edge-{i}"),
                serde_json::json!({"leaseDurationSeconds": d}),
            ),
        )
        .await
        .unwrap_or_else(|e| panic!("leaseDurationSeconds {d} is valid: {e}"));
    }
}

#[tokio::test]
async fn kubectl_get_shows_the_printer_columns() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "columns").await;
    let api: Api<FencedLease> = Api::namespaced(client.clone(), &ns.name);
    let mut spec = FencedLeaseSpec::free();
    spec.holder_identity = Some("pod-a".into());
    let lease = api
        .create(&PostParams::default(), &FencedLease::new("inventory", spec))
        .await
        .expect("create");
    let mut with_status = lease.clone();
    with_status.status = Some(FencedLeaseStatus {
        holder_identity: Some("pod-a".into()),
        token: Some(1),
        ..Default::default()
    });
    api.replace_status("inventory", &PostParams::default(), &with_status)
        .await
        .expect("status write");

    let (ok, out, err) = kubectl(&["get", "flease", "-n", &ns.name]);
    assert!(ok, "kubectl get flease (short name) failed: {err}");
    let mut lines = out.lines();
    let header: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        ["NAME", "HOLDER", "TOKEN", "DURATION", "RENEWED", "AGE"],
        "{out}"
    );
    let row: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(&row[..4], ["inventory", "pod-a", "1", "15"], "{out}");
}

#[tokio::test]
async fn kubectl_explain_reads_well() {
    let _client = client().await;
    ensure_crd();
    // 1.20 publishes CRD schemas to OpenAPI a moment after Established.
    let out = eventually(
        Duration::from_secs(30),
        "kubectl explain to know the CRD",
        || async {
            let (ok, out, _) = kubectl(&["explain", "fencedlease.spec"]);
            (ok && out.contains("leaseDurationSeconds")).then_some(out)
        },
    )
    .await;
    assert!(out.contains("holderIdentity"), "{out}");
    assert!(out.contains("preferredHolder"), "{out}");
    assert!(out.contains("fencing token"), "{out}");
}
