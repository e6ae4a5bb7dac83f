//! The sample operators' story (issue 35): elector/examples/fenced_operator.rs (kube-runtime)
//! and examples/controller-runtime (Go) play the same one against the real API server and the
//! real fencing webhook, and print the same events (one JSON line each on stdout: leading,
//! reconcile-start, wrote, refused, not-sent, reconcile-end, stalling, late-answer, stopped).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use fencedlease::stamp::{LEASE_LABEL, REFUSAL_CODE, TOKEN_ANNOTATION};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams};
use nix::sys::signal::Signal;
use serde_json::{json, Value};

use super::procs::{scratch_dir, Proc};
use super::webhook::Webhook;
use super::{client, ensure_crd, eventually, TestNamespace};

const SOURCE_LABEL: &str = "sample.fencedlease.io/source";
const LEASE: &str = "sample";

/// One replica of the sample operator, its event lines in `<dir>/<identity>.events`.
fn replica(bin: &Path, dir: &Path, ns: &str, identity: &str) -> (Proc, PathBuf) {
    let events = dir.join(format!("{identity}.events"));
    let log = dir.join(format!("{identity}.log"));
    let stall = dir.join(format!("{identity}.stall"));
    let child = Command::new(bin)
        .args([ns, LEASE, identity, "4"])
        .env("KUBECONFIG", super::kubeconfig_path())
        .env("FENCEDLEASE_SAMPLE_STALL_FILE", &stall)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&events).expect("events file"))
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("start the sample operator");
    let proc = Proc {
        name: identity.to_string(),
        child,
        events: events.clone(),
        log,
    };
    (proc, stall)
}

/// The whole event lines (JSON, one per line) a sample process has written so far.
pub fn events(p: &Proc) -> Vec<Value> {
    let text = std::fs::read_to_string(&p.events).unwrap_or_default();
    let whole = text.rfind('\n').map_or("", |i| &text[..=i]);
    whole
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad event {l:?}: {e}")))
        .collect()
}

/// The first event of `p` named `name` whose fields match `when` (the ceiling only stops a hung
/// test; the message names the process's log).
pub async fn event_of(p: &Proc, name: &str, when: impl Fn(&Value) -> bool) -> Value {
    let what = format!("{}: event {name} (log: {})", p.name, p.log.display());
    eventually(Duration::from_secs(60), &what, || async {
        events(p)
            .into_iter()
            .find(|e| e["event"] == name && when(e))
    })
    .await
}

/// An event's time, `t_ns` (the samples' own monotonic clock, comparable within one host).
pub fn t(e: &Value) -> u64 {
    e["t_ns"].as_u64().unwrap_or(0)
}

/// The story both samples play: two replicas of the operator at `bin` (arguments NAMESPACE
/// LEASE IDENTITY SECONDS, events on stdout, the stall file of `$FENCEDLEASE_SAMPLE_STALL_FILE`)
/// against the real API server and the real fencing webhook. One leads and copies the source;
/// it freezes with its next write stamped; past its lease the other leads and its copy lands
/// under a larger token; resumed, the old one's stamped write is refused by the webhook (403)
/// and the copy keeps the new leader's data; reconciles start only in a replica's own tenure.
pub async fn frozen_leader_story(bin: &Path, test: &str) {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, test).await;
    let dir = scratch_dir(test);
    let _webhook = Webhook::start(&client, &dir, &ns.name).await;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    let source = |value: &str| {
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "src", "labels": {SOURCE_LABEL: "yes"}},
               "data": {"value": value}})
    };
    let apply = PatchParams::apply("test").force();
    cms.patch("src", &apply, &Patch::Apply(source("1")))
        .await
        .expect("the source");

    let (a, a_stall) = replica(bin, &dir, &ns.name, "rep-a");
    let (b, b_stall) = replica(bin, &dir, &ns.name, "rep-b");
    // One of them leads and copies the source; its write is stamped and lands.
    let first = eventually(Duration::from_secs(30), "a first copy", || async {
        let copy = cms.get_opt("src-copy").await.ok()??;
        copy.data?.get("by").cloned()
    })
    .await;
    let (old, new, old_stall) = if first == "rep-a" {
        (&a, &b, &a_stall)
    } else {
        (&b, &a, &b_stall)
    };
    let copy = cms.get("src-copy").await.expect("the copy");
    let labels = copy.metadata.labels.clone().unwrap_or_default();
    assert_eq!(labels.get(LEASE_LABEL).map(String::as_str), Some(LEASE));
    let old_token: i64 = copy.metadata.annotations.clone().unwrap_or_default()[TOKEN_ANNOTATION]
        .parse()
        .expect("a stamped token");

    // The leader freezes with its next write stamped, just before sending it.
    std::fs::write(old_stall, b"").expect("stall file");
    cms.patch("src", &apply, &Patch::Apply(source("2")))
        .await
        .expect("the source changes");
    event_of(old, "stalling", |_| true).await;
    // Past its lease, the other replica leads and its copy of "2" lands, under a larger token.
    let led = event_of(new, "leading", |_| true).await;
    event_of(new, "wrote", |e| e["value"] == "2").await;
    let copy = cms.get("src-copy").await.expect("the copy");
    let data = copy.data.clone().unwrap_or_default();
    assert_eq!(data.get("by"), Some(&new.name));
    let new_token: i64 = copy.metadata.annotations.clone().unwrap_or_default()[TOKEN_ANNOTATION]
        .parse()
        .expect("a stamped token");
    assert!(new_token > old_token, "{new_token} after {old_token}");

    // Resumed, the old leader's stamped write goes out and the webhook refuses it.
    old.signal(Signal::SIGCONT);
    let late = event_of(old, "late-answer", |_| true).await;
    assert_eq!(late["status"], u64::from(REFUSAL_CODE), "{late}");
    let copy = cms.get("src-copy").await.expect("the copy");
    assert_eq!(
        copy.data.unwrap_or_default().get("by"),
        Some(&new.name),
        "the stale write did not land"
    );

    // Reconciles start only in a replica's own tenure: the old one started none after the new
    // one came to lead, and the new one none before.
    let old_starts: Vec<u64> = events(old)
        .iter()
        .filter(|e| e["event"] == "reconcile-start")
        .map(t)
        .collect();
    assert!(
        old_starts.iter().all(|&s| s < t(&led)),
        "the old leader started a reconcile in the new one's tenure: {:?}",
        events(old)
    );
    let new_starts = events(new);
    assert!(
        new_starts
            .iter()
            .filter(|e| e["event"] == "reconcile-start")
            .all(|e| t(e) > t(&led)),
        "{new_starts:?}"
    );
}
