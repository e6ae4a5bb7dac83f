//! The CRD's CEL validation rules (`x-kubernetes-validations`) against the real API server:
//! from Kubernetes 1.25 a status that breaks one is refused with the rule's message, while
//! every write the product makes (acquisitions, renewals, a takeover, a duration cut while
//! held, a release, the controller's status) is still accepted. Servers before 1.25 get the CRD
//! without rules (crds/pre-1.25/) and accept what they always did.

use fencedlease_testkit as common;

use std::time::Duration;

use common::procs::{campaign, controller, scratch_dir};
use common::{client, ensure_crd, eventually, server_minor, TestNamespace};
use fencedlease::api::{
    FencedLease, FencedLeaseSpec, FencedLeaseStatus, STATUS_DURATION_NEEDS_HOLDER,
    STATUS_HOLDER_AND_TOKEN_TOGETHER, TRANSITIONS_NEVER_DECREASE,
};
use fencedlease::crdgen::server_takes_rules;
use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;
use nix::sys::signal::Signal;

#[tokio::test]
async fn a_status_that_breaks_a_rule_is_refused_with_the_rules_message() {
    let client = client().await;
    ensure_crd();
    let enforced = server_takes_rules(server_minor(&client).await);
    let ns = TestNamespace::new(&client, "crd-rules").await;
    let api: Api<FencedLease> = Api::namespaced(client.clone(), &ns.name);
    let mut spec = FencedLeaseSpec::free();
    spec.holder_identity = Some("pod-a".into());
    let lease = api
        .create(&PostParams::default(), &FencedLease::new("db", spec))
        .await
        .expect("create");
    let renewal = FencedLeaseStatus {
        holder_identity: Some("pod-a".into()),
        token: lease.token(),
        lease_duration_seconds: Some(15),
        lease_transitions: 3,
        ..Default::default()
    };
    let write = |status: FencedLeaseStatus| {
        let (api, mut lease) = (api.clone(), lease.clone());
        async move {
            lease.metadata.resource_version =
                api.get("db").await.expect("get").metadata.resource_version;
            lease.status = Some(status);
            api.replace_status("db", &PostParams::default(), &lease)
                .await
        }
    };
    write(renewal.clone())
        .await
        .expect("a renewal as the holder writes it");
    let cases = [
        (
            "a holder without its token",
            FencedLeaseStatus {
                token: None,
                ..renewal.clone()
            },
            STATUS_HOLDER_AND_TOKEN_TOGETHER.1,
        ),
        (
            "a token without its holder",
            FencedLeaseStatus {
                holder_identity: None,
                lease_duration_seconds: None,
                ..renewal.clone()
            },
            STATUS_HOLDER_AND_TOKEN_TOGETHER.1,
        ),
        (
            "a renewed duration without its holder",
            FencedLeaseStatus {
                holder_identity: None,
                token: None,
                ..renewal.clone()
            },
            STATUS_DURATION_NEEDS_HOLDER.1,
        ),
        (
            "fewer transitions than before",
            FencedLeaseStatus {
                lease_transitions: 2,
                ..renewal.clone()
            },
            TRANSITIONS_NEVER_DECREASE.1,
        ),
    ];
    for (what, status, message) in cases {
        match write(status).await {
            Err(kube::Error::Api(s)) if enforced => {
                assert_eq!(s.code, 422, "{what}: {s:?}");
                assert!(
                    s.message.contains(message) && s.message.contains("status"),
                    "{what}: the refusal must name the status and give the rule's message, got: {}",
                    s.message
                );
            }
            Ok(_) if !enforced => {
                // No rules before 1.25: put the renewal back for the next case.
                write(renewal.clone()).await.expect("restore the renewal");
            }
            other => panic!(
                "{what}: expected {} on this server, got {other:?}",
                if enforced { "a 422" } else { "acceptance" }
            ),
        }
    }
    let stored = api.get("db").await.expect("get").status.expect("status");
    assert_eq!(stored, renewal, "nothing refused was stored");
}

#[tokio::test]
async fn every_write_of_the_campaigns_and_the_controller_is_accepted() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "crd-rules-writers").await;
    let dir = scratch_dir("crd-rules-writers");
    let api: Api<FencedLease> = Api::namespaced(client.clone(), &ns.name);
    let ctl = controller(&dir, &ns.name, "controller-0");
    // a creates the lease, acquires it and renews (holder, token, duration in status).
    let a = campaign(&dir, &ns.name, "db", "a", 2);
    let leading = |p: &common::procs::Proc| p.events().into_iter().any(|e| e.event == "leading");
    eventually(Duration::from_secs(30), "a to lead", || async {
        leading(&a).then_some(())
    })
    .await;
    // b takes over from a frozen a (the controller may revoke a first; either is fine).
    let mut b = campaign(&dir, &ns.name, "db", "b", 2);
    a.signal(Signal::SIGSTOP);
    eventually(Duration::from_secs(30), "b to lead", || async {
        leading(&b).then_some(())
    })
    .await;
    // A cut of the duration while b holds it is accepted, and so is b's renewal under it.
    api.patch(
        "db",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"spec": {"leaseDurationSeconds": 1}})),
    )
    .await
    .expect("a shorter duration while the lease is held");
    eventually(
        Duration::from_secs(10),
        "b to renew under the cut",
        || async {
            let s = api.get("db").await.ok()?.status?;
            (s.holder_identity.as_deref() == Some("b") && s.lease_duration_seconds == Some(1))
                .then_some(())
        },
    )
    .await;
    // b releases; the controller clears the holder's fields from the status.
    b.signal(Signal::SIGTERM);
    assert!(
        b.wait_exit(Duration::from_secs(10)).is_some(),
        "b did not stop"
    );
    let free = eventually(
        Duration::from_secs(15),
        "the controller to clear the status of the free lease",
        || async {
            let l = api.get("db").await.ok()?;
            let s = l.status.clone()?;
            (l.holder().is_none()
                && s.holder_identity.is_none()
                && s.token.is_none()
                && s.lease_duration_seconds.is_none())
            .then_some(l)
        },
    )
    .await;
    assert!(
        free.status
            .as_ref()
            .is_some_and(|s| !s.conditions.is_empty()),
        "the controller wrote its conditions"
    );
    for p in [&a, &b, &ctl] {
        let log = std::fs::read_to_string(&p.log).unwrap_or_default();
        assert!(
            !log.contains("is invalid"),
            "the API server refused a write of {}:\n{}",
            p.name,
            p.log_tail()
        );
    }
}
