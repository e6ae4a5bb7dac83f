//! Reconcile sequences against the in-process fake API server (`fixtures.rs`): which requests
//! one reconcile makes, in which order, with what in them. The real-server tests
//! (tests/holder_death.rs, tests/controller.rs) show the same behaviour end to end; these pin
//! the requests and run in milliseconds, without a cluster.

use std::sync::Arc;

use hyper::Method;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::runtime::watcher::Event;
use prometheus_client::registry::Registry;
use serde_json::{json, Value};

use super::fixtures::{Script, Step};
use super::metrics::ControllerMetrics;
use super::reconcile::{note_asked, reconcile, Context};
use crate::api::{FencedLease, FencedLeaseSpec, FencedLeaseStatus, LEASE_ANNOTATION};

const LEASES: &str = "/apis/fencedlease.io/v1alpha1/namespaces/apps/fencedleases";

/// Lease apps/db held by `db-0` at `generation`, renewed just now, at resourceVersion "7".
fn held(generation: i64) -> FencedLease {
    let mut spec = FencedLeaseSpec::free();
    spec.holder_identity = Some("db-0".into());
    let mut lease = FencedLease::new("db", spec);
    lease.metadata.namespace = Some("apps".into());
    lease.metadata.uid = Some("uid-1".into());
    lease.metadata.generation = Some(generation);
    lease.metadata.resource_version = Some("7".into());
    let now = jiff::Timestamp::now();
    lease.status = Some(FencedLeaseStatus {
        holder_identity: Some("db-0".into()),
        token: Some(generation),
        acquire_time: Some(MicroTime(now)),
        renew_time: Some(MicroTime(now)),
        lease_duration_seconds: Some(15),
        ..FencedLeaseStatus::default()
    });
    lease
}

/// The lease as the API server returns it after the revocation: holder cleared, next token.
fn revoked(generation: i64) -> Value {
    let mut lease = held(generation + 1);
    lease.spec.holder_identity = None;
    lease.metadata.resource_version = Some("8".into());
    serde_json::to_value(lease).unwrap_or_default()
}

fn pod(name: &str, lease: &str) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("apps".into()),
            uid: Some(format!("{name}-uid")),
            annotations: Some([(LEASE_ANNOTATION.to_string(), lease.to_string())].into()),
            ..ObjectMeta::default()
        },
        ..Pod::default()
    }
}

fn context(script: &Script) -> Arc<Context> {
    let metrics = ControllerMetrics::register(&mut Registry::default());
    Arc::new(Context::new(script.client(), metrics, "controller-0"))
}

/// The pod index listed the holder's pod `db-0` of lease `db`, then saw it deleted.
fn saw_the_holders_pod_go(ctx: &Context) {
    let mut index = ctx.pods.lock().unwrap_or_else(|p| p.into_inner());
    index.apply(&Event::Init);
    index.apply(&Event::InitApply(pod("db-0", "db")));
    index.apply(&Event::InitDone);
    index.apply(&Event::Delete(pod("db-0", "db")));
}

fn field<'a>(v: &'a Value, path: &[&str]) -> &'a Value {
    path.iter().fold(v, |v, k| &v[*k])
}

#[tokio::test]
async fn a_holder_whose_pod_is_gone_is_revoked_at_once_then_told() {
    let script = Script::new(vec![
        // The index says the pod is gone: a fresh read by name confirms it first.
        Step::new(
            Method::GET,
            "/api/v1/namespaces/apps/pods",
            200,
            json!({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": []}),
        ),
        // The revocation: the holder cleared, with the precondition of what was read.
        Step::new(Method::PUT, &format!("{LEASES}/db"), 200, revoked(3)).body(|b| {
            match (
                field(b, &["spec", "holderIdentity"]),
                field(b, &["metadata", "resourceVersion"]),
            ) {
                (Value::Null, v) if v == "7" => Ok(()),
                (h, v) => Err(format!(
                    "holder {h}, resourceVersion {v}: not a revocation of what was read"
                )),
            }
        }),
        // Status of the new generation, saying why.
        Step::new(
            Method::PATCH,
            &format!("{LEASES}/db/status"),
            200,
            revoked(3),
        )
        .body(|b| {
            let observed = field(b, &["status", "observedGeneration"]);
            let said = b.to_string().contains("PodGone");
            (observed == 4 && said)
                .then_some(())
                .ok_or_else(|| format!("observedGeneration {observed}, PodGone said: {said}"))
        }),
        // The Event, once the status is written.
        Step::new(
            Method::POST,
            "/apis/events.k8s.io/v1/namespaces/apps/events",
            201,
            json!({}),
        )
        .body(|b| {
            let reason = field(b, &["reason"]);
            let note = field(b, &["note"]).as_str().unwrap_or("");
            (reason == "HolderPodGone" && note.contains("token now 4"))
                .then_some(())
                .ok_or_else(|| format!("reason {reason}, note {note:?}"))
        }),
    ]);
    let ctx = context(&script);
    saw_the_holders_pod_go(&ctx);
    let result = reconcile(Arc::new(held(3)), ctx).await;
    script.finish();
    assert!(result.is_ok(), "{result:?}");
}

#[tokio::test]
async fn a_holder_whose_pod_came_back_under_its_name_is_not_revoked() {
    // The index saw the pod go, but a pod of that name that is not this lease's exists now:
    // the fresh read wins, and only the status is written.
    let other = json!({"kind": "PodList", "apiVersion": "v1", "metadata": {},
        "items": [serde_json::to_value(pod("db-0", "another-lease")).unwrap_or_default()]});
    let script = Script::new(vec![
        Step::new(Method::GET, "/api/v1/namespaces/apps/pods", 200, other),
        Step::new(
            Method::PATCH,
            &format!("{LEASES}/db/status"),
            200,
            serde_json::to_value(held(3)).unwrap_or_default(),
        )
        .body(|b| {
            let observed = field(b, &["status", "observedGeneration"]);
            (observed == 3)
                .then_some(())
                .ok_or_else(|| format!("observedGeneration {observed}"))
        }),
    ]);
    let ctx = context(&script);
    saw_the_holders_pod_go(&ctx);
    let result = reconcile(Arc::new(held(3)), ctx).await;
    script.finish();
    assert!(result.is_ok(), "{result:?}");
}

/// Lease apps/db at `generation`, held by `holder` (or free), asked (or not) to hand over to
/// `asked`.
fn held_by(holder: Option<&str>, generation: i64, asked: Option<&str>) -> FencedLease {
    let mut lease = held(generation);
    lease.spec.holder_identity = holder.map(str::to_string);
    lease.spec.preferred_holder = asked.map(str::to_string);
    if let Some(status) = lease.status.as_mut() {
        status.holder_identity = holder.map(str::to_string);
    }
    lease
}

/// A status patch of the lease at `generation`, answered with `lease`.
fn status_step(generation: i64, lease: &FencedLease) -> Step {
    let answer = serde_json::to_value(lease).unwrap_or_default();
    Step::new(Method::PATCH, &format!("{LEASES}/db/status"), 200, answer).body(move |b| {
        let observed = field(b, &["status", "observedGeneration"]);
        (observed == generation)
            .then_some(())
            .ok_or_else(|| format!("observedGeneration {observed}, not {generation}"))
    })
}

/// db-0 holds at generation 3 (asked to hand over to `asked_first`, if any) when a reconcile
/// looks; the watch then delivers `between` and, with no reconcile in between, db-1 holding at
/// generation 6, which the next reconcile sees: its Event must be `reason`, naming db-1.
async fn db1_takes_over_after(asked_first: Option<&str>, between: &[FencedLease], reason: &str) {
    let (first, taken) = (
        held_by(Some("db-0"), 3, asked_first),
        held_by(Some("db-1"), 6, None),
    );
    let reason = reason.to_string();
    let script = Script::new(vec![
        status_step(3, &first),
        status_step(6, &taken),
        Step::new(
            Method::POST,
            "/apis/events.k8s.io/v1/namespaces/apps/events",
            201,
            json!({}),
        )
        .body(move |b| {
            let got = field(b, &["reason"]);
            let note = field(b, &["note"]).as_str().unwrap_or("");
            (got == reason.as_str() && note.contains("db-1"))
                .then_some(())
                .ok_or_else(|| format!("reason {got}, not {reason}; note {note:?}"))
        }),
    ]);
    let ctx = context(&script);
    let result = reconcile(Arc::new(first), ctx.clone()).await;
    assert!(result.is_ok(), "{result:?}");
    for version in between.iter().chain([&taken]) {
        note_asked(&ctx, version);
    }
    let result = reconcile(Arc::new(taken), ctx).await;
    script.finish();
    assert!(result.is_ok(), "{result:?}");
}

#[tokio::test]
async fn a_handover_whose_steps_no_reconcile_saw_is_still_named_a_handover() {
    // The ask for db-1, db-0's release and db-1's acquisition all pass the watch before the
    // next reconcile, which sees only db-1 holding (preferredHolder cleared).
    let between = [
        held_by(Some("db-0"), 4, Some("db-1")),
        held_by(None, 5, Some("db-1")),
    ];
    db1_takes_over_after(None, &between, "HandedOver").await;
}

#[tokio::test]
async fn an_ask_withdrawn_or_taken_by_another_is_forgotten() {
    // The ask a reconcile saw is withdrawn before db-1 acquires on its own.
    let withdrawn = [held_by(Some("db-0"), 4, None), held_by(None, 5, None)];
    db1_takes_over_after(Some("db-1"), &withdrawn, "Acquired").await;
    // The ask for db-1 is seen, but db-2 acquires first (clearing it); db-1 acquires later.
    let other = [
        held_by(Some("db-0"), 4, Some("db-1")),
        held_by(Some("db-2"), 5, None),
        held_by(None, 5, None),
    ];
    db1_takes_over_after(None, &other, "Acquired").await;
}
