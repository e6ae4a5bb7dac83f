//! The webhook's in-memory work for one review, without network or TLS (issue 9, item 5):
//! - `decide`: the fencing rule alone (allowed, stale, missing token, forged);
//! - `parse`: reading an AdmissionReview body (a create, an update of a small and of a 64 KiB
//!   ConfigMap, an unlabelled object that passes);
//! - `respond`: the verdict on a parsed write and its answer (allowed, refused with its message):
//!   `Judgement::verdict` then `admission::answer`, the calls the webhook makes per write;
//! - `pipeline`: parse + respond + serializing the answering review, which is what the
//!   HTTPS server does per request apart from I/O and the lease-cache lookup.
//!
//! `cargo bench --bench webhook_decision` (add `-- --quick` for a fast pass).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use fencedlease::api::{LEASE_LABEL, LEASE_UID_ANNOTATION, TOKEN_ANNOTATION, WRITE_ID_ANNOTATION};
use fencedlease::webhook::admission::{answer, parse, Judgement, Parsed};
use fencedlease::webhook::decision::Answer;
use fencedlease::webhook::fence::{decide, Exemptions, LeaseView, Mode, Stamp, WriteAttempt};

const UID: &str = "0b6f3c2e-8a51-4f0e-9d7a-5c1e2f3a4b5c";

fn lease(generation: i64) -> LeaseView {
    LeaseView {
        uid: UID.into(),
        generation,
        holder: Some("worker-b".into()),
        deleting: false,
    }
}

fn attempt<'a>(token: Option<&'a str>, previous: Option<&'a str>) -> WriteAttempt<'a> {
    WriteAttempt {
        lease_name: "inventory",
        namespace: "shop",
        stamp: Stamp {
            token,
            lease_uid: Some(UID),
            write_id: Some("w2"),
            delete_intent: None,
        },
        previous: previous.map(|p| Stamp {
            token: Some(p),
            lease_uid: Some(UID),
            write_id: Some("w1"),
            delete_intent: None,
        }),
        deleting: false,
    }
}

fn exemptions() -> Exemptions {
    Exemptions::new(vec!["system:kube-controller-manager".into()], vec![]).expect("exemptions")
}

/// A ConfigMap as the API server sends it, with managedFields and `data_bytes` of data.
fn configmap(token: &str, labelled: bool, data_bytes: usize) -> serde_json::Value {
    let mut labels = serde_json::json!({"app": "shop", "tier": "backend"});
    if labelled {
        labels[LEASE_LABEL] = "inventory".into();
    }
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "inventory",
            "namespace": "shop",
            "uid": "7d1b1c8e-0f0a-4b9a-9a36-0e2b9b7f1a11",
            "resourceVersion": "123456",
            "creationTimestamp": "2026-11-30T12:00:00Z",
            "labels": labels,
            "annotations": {
                TOKEN_ANNOTATION: token,
                LEASE_UID_ANNOTATION: UID,
                WRITE_ID_ANNOTATION: format!("write-{token}"),
                "kubectl.kubernetes.io/last-applied-configuration": "{\"apiVersion\":\"v1\",\"kind\":\"ConfigMap\"}"
            },
            "managedFields": [{
                "manager": "worker", "operation": "Update", "apiVersion": "v1",
                "time": "2026-11-30T12:00:00Z", "fieldsType": "FieldsV1",
                "fieldsV1": {"f:data": {".": {}, "f:items": {}, "f:reservations": {}},
                             "f:metadata": {"f:annotations": {".": {}, "f:fencedlease.io/token": {}, "f:fencedlease.io/lease-uid": {}},
                                            "f:labels": {".": {}, "f:app": {}, "f:tier": {}, "f:fencedlease.io/lease": {}}}}
            }]
        },
        "data": {"items": "1", "reservations": "worker-b", "blob": "x".repeat(data_bytes)}
    })
}

fn review(op: &str, object: serde_json::Value, old: Option<serde_json::Value>) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "ConfigMap"},
            "resource": {"group": "", "version": "v1", "resource": "configmaps"},
            "requestKind": {"group": "", "version": "v1", "kind": "ConfigMap"},
            "requestResource": {"group": "", "version": "v1", "resource": "configmaps"},
            "name": "inventory",
            "namespace": "shop",
            "operation": op,
            "userInfo": {"username": "system:serviceaccount:shop:worker", "uid": "u-1",
                         "groups": ["system:serviceaccounts", "system:serviceaccounts:shop", "system:authenticated"]},
            "object": object,
            "oldObject": old,
            "dryRun": false,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "UpdateOptions"}
        }
    }))
    .expect("review literal")
}

fn bench_decide(c: &mut Criterion) {
    let mut g = c.benchmark_group("decide");
    let current = lease(6);
    g.bench_function("allowed", |b| {
        b.iter(|| {
            decide(
                black_box(&attempt(Some("6"), Some("4"))),
                black_box(Some(&current)),
            )
        })
    });
    g.bench_function("stale", |b| {
        b.iter(|| {
            decide(
                black_box(&attempt(Some("4"), None)),
                black_box(Some(&current)),
            )
        })
    });
    g.bench_function("missing_token", |b| {
        b.iter(|| decide(black_box(&attempt(None, None)), black_box(Some(&current))))
    });
    g.bench_function("forged_future", |b| {
        b.iter(|| {
            decide(
                black_box(&attempt(Some("9223372036854775807"), None)),
                black_box(Some(&current)),
            )
        })
    });
    g.finish();
}

struct Bodies {
    create: Vec<u8>,
    update_small: Vec<u8>,
    update_64k: Vec<u8>,
    unlabelled: Vec<u8>,
    stale_update: Vec<u8>,
}

fn bodies() -> Bodies {
    Bodies {
        create: review("CREATE", configmap("6", true, 64), None),
        update_small: review(
            "UPDATE",
            configmap("6", true, 64),
            Some(configmap("5", true, 64)),
        ),
        update_64k: review(
            "UPDATE",
            configmap("6", true, 64 * 1024),
            Some(configmap("5", true, 64 * 1024)),
        ),
        unlabelled: review(
            "UPDATE",
            configmap("6", false, 64),
            Some(configmap("5", false, 64)),
        ),
        stale_update: review(
            "UPDATE",
            configmap("4", true, 64),
            Some(configmap("5", true, 64)),
        ),
    }
}

fn bench_parse(c: &mut Criterion) {
    let b = bodies();
    let ex = exemptions();
    let mut g = c.benchmark_group("parse");
    for (name, body) in [
        ("create", &b.create),
        ("update", &b.update_small),
        ("update_64KiB", &b.update_64k),
        ("unlabelled_pass", &b.unlabelled),
    ] {
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_function(name, |bench| {
            bench.iter(|| {
                let p = parse(black_box(body), &ex);
                assert!(!matches!(p, Parsed::Invalid(_)));
                p
            })
        });
    }
    g.finish();
}

fn judgement(body: &[u8]) -> Box<fencedlease::webhook::admission::Judgement> {
    match parse(body, &exemptions()) {
        Parsed::Judge(j) => j,
        other => panic!("expected a protected write, got {other:?}"),
    }
}

/// What the webhook does with a parsed protected write and a lease it has read (the decision
/// in enforce mode: a refusal's namespace mode is a read of its own).
fn respond(j: &Judgement, lease: Option<&LeaseView>, mode: Mode) -> Answer {
    answer(j, &j.verdict(lease), mode)
}

fn bench_respond(c: &mut Criterion) {
    let b = bodies();
    let current = lease(6);
    let allowed = judgement(&b.update_small);
    let stale = judgement(&b.stale_update);
    let mut g = c.benchmark_group("respond");
    g.bench_function("allowed", |bench| {
        bench.iter(|| {
            respond(
                black_box(&allowed),
                black_box(Some(&current)),
                Mode::Enforce,
            )
        })
    });
    g.bench_function("refused_stale", |bench| {
        bench.iter(|| respond(black_box(&stale), black_box(Some(&current)), Mode::Enforce))
    });
    g.finish();
}

fn bench_pipeline(c: &mut Criterion) {
    let b = bodies();
    let current = lease(6);
    let ex = exemptions();
    let mut g = c.benchmark_group("pipeline");
    for (name, body) in [
        ("update_allowed", &b.update_small),
        ("update_refused", &b.stale_update),
        ("update_64KiB_allowed", &b.update_64k),
    ] {
        g.throughput(Throughput::Elements(1));
        g.bench_function(name, |bench| {
            bench.iter_batched(
                || body.clone(),
                |body| {
                    let review = match parse(&body, &ex) {
                        Parsed::Judge(j) => {
                            respond(&j, Some(&current), Mode::Enforce).into_review()
                        }
                        Parsed::Pass(r, _) => r.into_review(),
                        Parsed::Parent(c) => c.response.into_review(),
                        Parsed::Autoscaler(c) => c.judgement.response.into_review(),
                        Parsed::Invalid(r) => *r,
                    };
                    serde_json::to_vec(&review).expect("serialize")
                },
                BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    bench_decide,
    bench_parse,
    bench_respond,
    bench_pipeline
);
criterion_main!(benches);
