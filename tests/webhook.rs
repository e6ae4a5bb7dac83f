//! Fencing webhook: the real API server calls the real webhook over HTTPS by URL and refuses
//! writes to protected objects that carry a stale, missing, malformed or forged token.

use fencedlease_testkit as common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::procs::{campaign, now_ns, scratch_dir, Ev, Proc};
use common::webhook::{issue_certs, Webhook};
use common::{client, ensure_crd, eventually, kubectl, TestNamespace};
use fencedlease::api::{FencedLease, FencedLeaseSpec};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;
use nix::sys::signal::Signal;
use tokio::sync::Mutex;

const LEASE: &str = "fencedlease.io/lease";
const TOKEN: &str = "fencedlease.io/token";
const UID: &str = "fencedlease.io/lease-uid";
const WRITE_ID: &str = "fencedlease.io/write-id";

/// A racing writer's attempt: the token it presented, and the resourceVersion it produced or
/// the refusal it got.
type WriteOutcome = (i64, Result<u64, String>);

/// A fenced write: a merge patch (no resourceVersion, like a blind writer) of data plus the
/// writer's token and a new write id. Returns the error message on refusal.
async fn fenced_patch(
    cms: &Api<ConfigMap>,
    name: &str,
    token: &str,
    uid: &str,
    data: serde_json::Value,
) -> Result<ConfigMap, String> {
    let patch = serde_json::json!({
        "metadata": {"annotations": {TOKEN: token, UID: uid, WRITE_ID: common::new_write_id()}},
        "data": data,
    });
    cms.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(|e| match e {
            kube::Error::Api(s) => format!("{} (code {})", s.message, s.code),
            other => other.to_string(),
        })
}

fn protected_cm(
    name: &str,
    lease: &str,
    token: &str,
    uid: &str,
    data: serde_json::Value,
) -> ConfigMap {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "labels": {LEASE: lease}, "annotations": {TOKEN: token, UID: uid}},
        "data": data,
    }))
    .expect("configmap literal")
}

async fn leading_event(p: &Proc, after_ns: i128) -> Ev {
    eventually(Duration::from_secs(20), "a leading event", || async {
        p.events()
            .into_iter()
            .find(|e| e.event == "leading" && e.t_ns > after_ns)
    })
    .await
}

/// The articles' story, for real: A holds the lease and reads the inventory (one item left);
/// A pauses past its lease; B takes over with a larger token and reserves the item; A wakes and
/// writes its reservation with its old token: the API server refuses it.
#[tokio::test]
async fn the_inventory_story_a_paused_holder_cannot_double_book() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "story").await;
    let dir = scratch_dir("story");
    let _wh = Webhook::start(&client, &dir, &ns.name).await;
    let a = campaign(&dir, &ns.name, "inventory", "worker-a", 2);
    let ta = leading_event(&a, 0).await;
    let b = campaign(&dir, &ns.name, "inventory", "worker-b", 2);
    let (tok_a, uid) = (
        ta.token.expect("token").to_string(),
        ta.lease_uid.clone().expect("uid"),
    );

    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    cms.create(
        &PostParams::default(),
        &protected_cm(
            "inventory",
            "inventory",
            &tok_a,
            &uid,
            serde_json::json!({"items": "1", "reservations": ""}),
        ),
    )
    .await
    .expect("A creates the inventory with its valid token");
    // A reads: one item left. Then A stalls.
    let seen_by_a = cms.get("inventory").await.expect("read");
    assert_eq!(
        seen_by_a
            .data
            .as_ref()
            .and_then(|d| d.get("items"))
            .map(String::as_str),
        Some("1")
    );
    let paused = now_ns();
    a.signal(Signal::SIGSTOP);

    let tb = leading_event(&b, paused).await;
    let tok_b = tb.token.expect("token");
    assert!(
        tok_b > ta.token.expect("token"),
        "B's token {tok_b} must be larger than A's {tok_a}"
    );
    fenced_patch(
        &cms,
        "inventory",
        &tok_b.to_string(),
        &uid,
        serde_json::json!({"items": "0", "reservations": "worker-b"}),
    )
    .await
    .expect("B reserves the last item with its current token");

    // A wakes up and, believing what it read, writes its own reservation with its old token.
    a.signal(Signal::SIGCONT);
    let refused = fenced_patch(
        &cms,
        "inventory",
        &tok_a,
        &uid,
        serde_json::json!({"items": "0", "reservations": "worker-a"}),
    )
    .await
    .expect_err("the API server must refuse A's stale write");
    assert!(
        refused.contains(&format!("stale token {tok_a}")),
        "{refused}"
    );
    assert!(
        refused.contains(&format!("token {tok_b}")) && refused.contains("worker-b"),
        "{refused}"
    );
    assert!(refused.contains("code 403"), "{refused}");

    let fin = cms.get("inventory").await.expect("read");
    let data = fin.data.unwrap_or_default();
    assert_eq!(
        data.get("reservations").map(String::as_str),
        Some("worker-b"),
        "exactly one reservation"
    );
    assert_eq!(data.get("items").map(String::as_str), Some("0"));
    drop(b);
}

#[tokio::test]
async fn racing_writers_never_move_an_object_backwards() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "race").await;
    let dir = scratch_dir("race");
    let wh = Webhook::start(&client, &dir, &ns.name).await;
    let leases: Api<FencedLease> = Api::namespaced(client.clone(), &ns.name);
    let mut spec = FencedLeaseSpec::free();
    spec.holder_identity = Some("holder-0".into());
    let lease = leases
        .create(&PostParams::default(), &FencedLease::new("race", spec))
        .await
        .expect("lease");
    let uid = lease.metadata.uid.clone().expect("uid");
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    cms.create(
        &PostParams::default(),
        &protected_cm(
            "counter",
            "race",
            &lease.token().expect("gen").to_string(),
            &uid,
            serde_json::json!({"w": ""}),
        ),
    )
    .await
    .expect("create");

    // The lease changes hands every 40 ms while four writers write with what they last read.
    let mover = {
        let leases = leases.clone();
        tokio::spawn(async move {
            for i in 1..=25 {
                let mut l = leases.get("race").await.expect("get");
                l.spec.holder_identity = Some(format!("holder-{i}"));
                let _ = leases.replace("race", &PostParams::default(), &l).await;
                tokio::time::sleep(Duration::from_millis(40)).await;
            }
        })
    };
    let log: Arc<Mutex<Vec<WriteOutcome>>> = Arc::default();
    let mut writers = Vec::new();
    for w in 0..4 {
        let (leases, cms, log, uid) = (leases.clone(), cms.clone(), log.clone(), uid.clone());
        writers.push(tokio::spawn(async move {
            for n in 0..25 {
                let token = leases.get("race").await.expect("get").token().expect("gen");
                // Some writers dawdle between reading the token and writing, as paused ones do.
                tokio::time::sleep(Duration::from_millis(((w * 7 + n * 13) % 60) as u64)).await;
                let res = fenced_patch(
                    &cms,
                    "counter",
                    &token.to_string(),
                    &uid,
                    serde_json::json!({"w": format!("{w}-{n}")}),
                )
                .await
                .map(|cm| {
                    cm.metadata
                        .resource_version
                        .and_then(|rv| rv.parse().ok())
                        .unwrap_or(0)
                });
                log.lock().await.push((token, res));
            }
        }));
    }
    for w in writers {
        w.await.expect("writer");
    }
    mover.await.expect("mover");
    let mut log = log.lock().await.clone();
    let refused: Vec<_> = log
        .iter()
        .filter_map(|(t, r)| r.as_ref().err().map(|m| (*t, m.clone())))
        .collect();
    for (t, m) in &refused {
        assert!(
            m.contains(&format!("stale token {t}")),
            "a refusal that was not for staleness: {m}"
        );
    }
    log.retain(|(_, r)| r.is_ok());
    log.sort_by_key(|(_, r)| r.as_ref().map(|rv| *rv).unwrap_or(0));
    let accepted: Vec<i64> = log.iter().map(|(t, _)| *t).collect();
    assert!(
        accepted.windows(2).all(|p| p[0] <= p[1]),
        "accepted tokens went down: {accepted:?}"
    );
    assert!(
        !accepted.is_empty() && !refused.is_empty(),
        "the race must produce both: {} accepted, {} refused",
        accepted.len(),
        refused.len()
    );
    eprintln!(
        "racing writers: {} accepted, {} refused as stale",
        accepted.len(),
        refused.len()
    );
    // Counted: each stale refusal of the race (the series itself exists from the start, at 0).
    let m = wh.metrics();
    let stale = common::metric_value(
        &m,
        r#"fencedlease_webhook_admissions_total{result="denied_stale"}"#,
    );
    assert!(
        stale >= refused.len() as f64,
        "{stale} counted for {} refused\n{m}",
        refused.len()
    );
}

#[tokio::test]
async fn every_bad_token_is_refused_with_its_own_message() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "badtok").await;
    let other = TestNamespace::new(&client, "otherns").await;
    let dir = scratch_dir("badtok");
    let wh = Webhook::start(&client, &dir, &ns.name).await;
    let mut spec = FencedLeaseSpec::free();
    spec.holder_identity = Some("pod-a".into());
    let lease = Api::<FencedLease>::namespaced(client.clone(), &ns.name)
        .create(
            &PostParams::default(),
            &FencedLease::new("inv", spec.clone()),
        )
        .await
        .expect("lease");
    let (gen, uid) = (
        lease.token().expect("gen"),
        lease.metadata.uid.clone().expect("uid"),
    );
    // A lease of the same name in another namespace: its token means nothing here.
    let foreign = Api::<FencedLease>::namespaced(client.clone(), &other.name)
        .create(&PostParams::default(), &FencedLease::new("shared", spec))
        .await
        .expect("foreign lease");
    let free = Api::<FencedLease>::namespaced(client.clone(), &ns.name)
        .create(
            &PostParams::default(),
            &FencedLease::new("free", FencedLeaseSpec::free()),
        )
        .await
        .expect("free lease");

    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    let g = gen.to_string();
    let future = (gen + 5).to_string();
    let fuid = foreign.metadata.uid.clone().expect("uid");
    let free_uid = free.metadata.uid.clone().expect("uid");
    let cases: Vec<(&str, serde_json::Value, &str)> = vec![
        (
            "future",
            serde_json::json!({LEASE: "inv", "a": {TOKEN: future, UID: uid}}),
            "is ahead of",
        ),
        (
            "missing",
            serde_json::json!({LEASE: "inv", "a": {UID: uid}}),
            "must carry the holder's token",
        ),
        (
            "malformed",
            serde_json::json!({LEASE: "inv", "a": {TOKEN: "7abc", UID: uid}}),
            "is not a fencing token",
        ),
        (
            "padded",
            serde_json::json!({LEASE: "inv", "a": {TOKEN: format!("0{g}"), UID: uid}}),
            "leading zeros",
        ),
        (
            "negative",
            serde_json::json!({LEASE: "inv", "a": {TOKEN: "-1", UID: uid}}),
            "negative",
        ),
        (
            "huge",
            serde_json::json!({LEASE: "inv", "a": {TOKEN: "99999999999999999999", UID: uid}}),
            "64-bit",
        ),
        (
            "empty",
            serde_json::json!({LEASE: "inv", "a": {TOKEN: "", UID: uid}}),
            "it is empty",
        ),
        (
            "nouid",
            serde_json::json!({LEASE: "inv", "a": {TOKEN: g}}),
            "no fencedlease.io/lease-uid",
        ),
        (
            "ghost",
            serde_json::json!({LEASE: "ghost", "a": {TOKEN: g, UID: uid}}),
            "does not exist",
        ),
        (
            "foreign",
            serde_json::json!({LEASE: "shared", "a": {TOKEN: "1", UID: fuid}}),
            "does not exist",
        ),
        (
            "free",
            serde_json::json!({LEASE: "free", "a": {TOKEN: "1", UID: free_uid}}),
            "is free",
        ),
    ];
    for (name, spec, want) in cases {
        let cm: ConfigMap = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "labels": {LEASE: spec[LEASE]}, "annotations": spec["a"]},
        }))
        .expect("literal");
        match cms.create(&PostParams::default(), &cm).await {
            Err(kube::Error::Api(s)) => {
                assert!(
                    s.message.contains(want),
                    "{name}: want {want:?} in {:?}",
                    s.message
                );
                assert!(
                    s.message.contains(&format!("{}/", ns.name)),
                    "{name}: the message names the lease: {}",
                    s.message
                );
            }
            other => panic!("{name} must be refused, got {other:?}"),
        }
    }
    // The valid token passes, and an unlabelled object never needs one.
    cms.create(
        &PostParams::default(),
        &protected_cm("ok", "inv", &g, &uid, serde_json::json!({})),
    )
    .await
    .expect("the current token is accepted");
    cms.create(
        &PostParams::default(),
        &serde_json::from_value(serde_json::json!({"metadata": {"name": "plain"}})).expect("cm"),
    )
    .await
    .expect("unprotected objects are untouched");
    // Deletes are fenced: unannounced, refused (tests/common/stories.rs tells the rest).
    let r = cms.delete("ok", &Default::default()).await;
    assert!(
        r.is_err(),
        "an unannounced delete of a protected object: {r:?}"
    );
    cms.delete("plain", &Default::default())
        .await
        .expect("an unprotected object is deleted as ever");
    let m = wh.metrics();
    for label in [
        "denied_unannounced_delete",
        "denied_future",
        "denied_missing",
        "denied_malformed",
        "denied_no_lease",
        "denied_free",
        "allowed",
    ] {
        assert!(
            m.contains(&format!("result=\"{label}\"")),
            "metric {label} missing:\n{m}"
        );
    }
}

#[tokio::test]
async fn warn_mode_of_the_namespace_allows_with_a_warning_and_fails_closed_when_the_webhook_is_down(
) {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "warn").await;
    let dir = scratch_dir("warn");
    let wh = Webhook::start(&client, &dir, &ns.name).await;
    let mut spec = FencedLeaseSpec::free();
    spec.holder_identity = Some("pod-a".into());
    let leases: Api<FencedLease> = Api::namespaced(client.clone(), &ns.name);
    let lease = leases
        .create(&PostParams::default(), &FencedLease::new("inv", spec))
        .await
        .expect("lease");
    let (g, uid) = (
        lease.token().expect("gen").to_string(),
        lease.metadata.uid.clone().expect("uid"),
    );
    let cm = protected_cm("rollout", "inv", &g, &uid, serde_json::json!({"v": "1"}));
    Api::<ConfigMap>::namespaced(client.clone(), &ns.name)
        .create(&PostParams::default(), &cm)
        .await
        .expect("create");
    let (ok, _, err) = kubectl(&[
        "annotate",
        "namespace",
        &ns.name,
        "fencedlease.io/fencing=warn",
    ]);
    assert!(ok, "{err}");
    // A forged write in a warn-mode namespace lands, with a warning kubectl shows.
    let (ok, _, stderr) = kubectl(&[
        "annotate",
        "-n",
        &ns.name,
        "configmap",
        "rollout",
        "--overwrite",
        "fencedlease.io/token=99",
        &format!("{WRITE_ID}={}", common::new_write_id()),
    ]);
    assert!(ok, "warn mode must allow: {stderr}");
    assert!(
        stderr.contains("Warning") && stderr.contains("token 99 is ahead"),
        "{stderr}"
    );
    assert!(wh.metrics().contains("result=\"warned\""));

    // Webhook down (killed, its configuration still registered): protected writes fail
    // closed, everything else is untouched.
    wh.proc.signal(Signal::SIGKILL);
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    let down = eventually(
        Duration::from_secs(10),
        "a refused write while the webhook is down",
        || async {
            fenced_patch(&cms, "rollout", &g, &uid, serde_json::json!({"v": "2"}))
                .await
                .err()
        },
    )
    .await;
    assert!(
        down.contains("failed calling webhook") || down.contains("connection refused"),
        "{down}"
    );
    cms.create(
        &PostParams::default(),
        &serde_json::from_value(serde_json::json!({"metadata": {"name": "plain"}})).expect("cm"),
    )
    .await
    .expect("unprotected writes do not need the webhook");
}

#[tokio::test]
async fn certificate_rotation_while_writes_flow_fails_no_admission() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "rotate").await;
    let dir = scratch_dir("rotate");
    let wh = Webhook::start(&client, &dir, &ns.name).await;
    let mut spec = FencedLeaseSpec::free();
    spec.holder_identity = Some("pod-a".into());
    let lease = Api::<FencedLease>::namespaced(client.clone(), &ns.name)
        .create(&PostParams::default(), &FencedLease::new("inv", spec))
        .await
        .expect("lease");
    let (g, uid) = (
        lease.token().expect("gen").to_string(),
        lease.metadata.uid.clone().expect("uid"),
    );
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    cms.create(
        &PostParams::default(),
        &protected_cm("c", "inv", &g, &uid, serde_json::json!({"n": "0"})),
    )
    .await
    .expect("create");
    let stop = Arc::new(AtomicBool::new(false));
    let written = Arc::new(AtomicUsize::new(0));
    let writer = {
        let (cms, g, uid) = (cms.clone(), g.clone(), uid.clone());
        let (stop, written) = (stop.clone(), written.clone());
        tokio::spawn(async move {
            let mut failures = Vec::new();
            for n in 0.. {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                if let Err(e) =
                    fenced_patch(&cms, "c", &g, &uid, serde_json::json!({"n": n.to_string()})).await
                {
                    failures.push(e);
                }
                written.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(50)).await; // a steady pace
            }
            failures
        })
    };
    // Rotate twice (same CA, new key and certificate), the way kubelet updates a Secret mount;
    // each time, wait for the webhook to say it reloaded, and for writes to go on past it.
    let reloads = || {
        std::fs::read_to_string(&wh.proc.log)
            .unwrap_or_default()
            .matches("reloaded the serving certificate")
            .count()
    };
    let before = std::fs::read(wh.mount.join("tls.crt")).expect("cert");
    for _ in 0..2 {
        let (seen, at) = (reloads(), written.load(Ordering::Relaxed));
        issue_certs(&wh.mount, true);
        eventually(Duration::from_secs(30), "the webhook to reload", || async {
            (reloads() > seen).then_some(())
        })
        .await;
        eventually(
            Duration::from_secs(30),
            "writes through the reload",
            || async { (written.load(Ordering::Relaxed) >= at + 5).then_some(()) },
        )
        .await;
    }
    stop.store(true, Ordering::Relaxed);
    let after = std::fs::read(wh.mount.join("tls.crt")).expect("cert");
    assert_ne!(before, after, "the certificate was rotated");
    let failures = writer.await.expect("writer");
    assert!(
        failures.is_empty(),
        "admissions failed during rotation: {failures:?}"
    );
    let log = std::fs::read_to_string(&wh.proc.log).unwrap_or_default();
    assert!(log.contains("reloaded the serving certificate"), "{log}");
}

/// Bad input straight at the HTTPS server: every answer is an HTTP 200 AdmissionReview that
/// denies, or a 4xx, and the server keeps serving.
#[tokio::test]
async fn bad_input_gets_a_denial_or_a_4xx_and_never_a_crash() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "badinput").await;
    let dir = scratch_dir("badinput");
    let mut wh = Webhook::start(&client, &dir, &ns.name).await;
    let url = format!("https://127.0.0.1:{}/validate", wh.port);
    let ca = wh.mount.join("staging/ca.crt");
    let post = |body: &std::path::Path, ctype: &str| {
        let out = std::process::Command::new("curl")
            .args([
                "-sS",
                "--max-time",
                "10",
                "--cacert",
                ca.to_str().expect("utf-8"),
                "-H",
                ctype,
            ])
            .args([
                "--data-binary",
                &format!("@{}", body.display()),
                "-w",
                "\n%{http_code}",
                &url,
            ])
            .output()
            .expect("curl");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
        (code.trim().parse::<u16>().unwrap_or(0), body.to_string())
    };
    let huge = vec![b'{'; 9 * 1024 * 1024];
    let unicode_review = serde_json::json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": "ü-1", "kind": {"group": "", "version": "v1", "kind": "ConfigMap"},
            "resource": {"group": "", "version": "v1", "resource": "configmaps"},
            "namespace": ns.name, "operation": "CREATE", "userInfo": {},
            "object": {"metadata": {"name": "x", "labels": {LEASE: "ünïcode"},
                "annotations": {TOKEN: "٣", UID: "\u{0}"}}}}
    })
    .to_string();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("garbage", b"\xff\xfe not json".to_vec()),
        ("empty", Vec::new()),
        ("wrong kind", br#"{"apiVersion":"v1","kind":"Pod"}"#.to_vec()),
        ("no request", br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#.to_vec()),
        ("v1beta1 shape", br#"{"apiVersion":"admission.k8s.io/v1beta1","kind":"AdmissionReview","request":{"uid":"1"}}"#.to_vec()),
        ("unicode and odd annotations", unicode_review.into_bytes()),
        ("huge", huge),
    ];
    for (name, body) in cases {
        let f = dir.join("body");
        std::fs::write(&f, &body).expect("write body");
        let (code, answer) = post(&f, "Content-Type: application/json");
        assert!(
            code == 200 || (400..500).contains(&code),
            "{name}: HTTP {code}"
        );
        if code == 200 {
            let v: serde_json::Value = serde_json::from_str(&answer)
                .unwrap_or_else(|e| panic!("{name}: not JSON ({e}): {answer}"));
            assert_eq!(v["response"]["allowed"], false, "{name}: {answer}");
        }
    }
    // Still alive and still deciding correctly.
    assert_eq!(
        wh.proc.child.try_wait().expect("try_wait"),
        None,
        "the webhook exited"
    );
    let (ok, _, _) = kubectl(&["get", "--raw", "/readyz"]);
    assert!(ok);
    let m = wh.metrics();
    assert!(m.contains("result=\"invalid\""), "{m}");
}

/// The stories shared with policy mode (`tests/common/stories.rs`), played by the webhook: the
/// same verdicts, messages and status (403) as `tests/fencing_policy.rs` gets from the API server.
#[tokio::test]
async fn shared_story_a_replaced_holder_is_refused() {
    let p = common::fencing::Protected::new("wstale", false).await;
    common::stories::a_replaced_holder_is_refused(&p).await;
}

#[tokio::test]
async fn shared_story_every_bad_token_is_refused_with_its_own_message() {
    let p = common::fencing::Protected::new("wbad", false).await;
    common::stories::every_bad_token_is_refused(&p).await;
}

#[tokio::test]
async fn shared_story_the_label_is_protected_too() {
    let p = common::fencing::Protected::new("wlabel", false).await;
    common::stories::the_label_is_protected_too(&p).await;
}

#[tokio::test]
async fn shared_story_deletes_are_fenced() {
    let p = common::fencing::Protected::new("wdelete", false).await;
    common::stories::deletes_are_fenced(&p).await;
}

#[tokio::test]
async fn shared_story_a_lease_being_deleted_fences_nothing() {
    let p = common::fencing::Protected::new("wdoomed", false).await;
    common::stories::a_lease_being_deleted_fences_nothing(&p).await;
}
