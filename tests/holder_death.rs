//! Instant failover when the holder is known dead, against the real API server: the controller
//! revokes a held lease at once when the holder's pod is gone, finished, or its campaigning
//! container stopped or restarted after it acquired; and never for less (a process gone with
//! its pod still there, a pod being deleted gracefully, a lease that opted out).
//!
//! The pods are stored, not run (the test cluster has no node): their status is written as the
//! kubelet would, through pods/status. The holders are real `fencedlease campaign` processes
//! whose identity is the pod's name, as the injected sidecar's is.

use fencedlease_testkit as common;

use std::path::PathBuf;
use std::time::Duration;

use common::fencing::holders_until;
use common::procs::{campaign, controller_env, now_ns, scratch_dir, Proc};
use common::{client, ensure_crd, eventually, k8s_events, TestNamespace};
use fencedlease::api::{FencedLease, FencedLeaseSpec};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use nix::sys::signal::Signal;
use serde_json::json;

/// The lease duration everyone campaigns with: long, so that any revocation seen within a few
/// seconds is an early one.
const LEASE_S: u32 = 15;
const NS_PER_S: i128 = 1_000_000_000;
/// Finalizer that holds a pod in graceful deletion.
const HOLD: &str = "fencedlease.io/test-hold";

/// One test's world: a namespace, its controller, and a pod `pod-a` of lease `db` whose
/// campaign process (identity `pod-a`) holds the lease.
struct World {
    client: Client,
    ns: TestNamespace,
    dir: PathBuf,
    pods: Api<Pod>,
    leases: Api<FencedLease>,
    holder: Proc,
    /// The lease as it was once the holder led and recorded its acquisition.
    held: FencedLease,
    _controller: Proc,
}

fn pod_literal(name: &str, finalizer: bool) -> Pod {
    let finalizers: Vec<&str> = if finalizer { vec![HOLD] } else { vec![] };
    serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": {"fencedlease.io/lease": "db"},
                     "finalizers": finalizers},
        "spec": {"containers": [
            {"name": "app", "image": "busybox"},
            {"name": fencedlease::webhook::inject::CONTAINER, "image": "fencedlease"}
        ]}
    }))
    .expect("pod literal")
}

impl World {
    async fn new(prefix: &str, finalizer: bool, spec: FencedLeaseSpec) -> World {
        let client = client().await;
        ensure_crd();
        let ns = TestNamespace::new(&client, prefix).await;
        let dir = scratch_dir(prefix);
        let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
        let leases: Api<FencedLease> = Api::namespaced(client.clone(), &ns.name);
        pods.create(&PostParams::default(), &pod_literal("pod-a", finalizer))
            .await
            .expect("create the holder's pod");
        leases
            .create(&PostParams::default(), &FencedLease::new("db", spec))
            .await
            .expect("create the lease");
        // At debug, the controller says when it judged the holder's pod and waited.
        let log_level =
            std::ffi::OsStr::new("info,kube=warn,fencedlease::controller::reconcile=debug");
        let ctl = controller_env(
            &dir,
            &ns.name,
            "controller-0",
            &[],
            &[("RUST_LOG", log_level)],
        );
        let holder = campaign(&dir, &ns.name, "db", "pod-a", LEASE_S);
        let held = held_by(&leases, &holder).await;
        World {
            client,
            ns,
            dir,
            pods,
            leases,
            holder,
            held,
            _controller: ctl,
        }
    }

    /// Waits until a line of the controller's log satisfies `line` (the ceiling only stops a
    /// hung test).
    async fn logged(&self, what: &str, line: impl Fn(&str) -> bool) {
        let log = self.dir.join("controller-0.log");
        eventually(Duration::from_secs(30), what, || async {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            text.lines().any(&line).then_some(())
        })
        .await;
    }

    /// Waits until the controller leads its own lease and watches pods.
    async fn controller_active(&self) {
        self.logged("the controller to lead", |l| {
            l.contains("this replica is the active controller")
        })
        .await;
        // Its pod index has listed pod-a (only then does it put the leader label on it): a
        // deletion before the list would leave no tombstone, and the lease would be waited out.
        eventually(
            Duration::from_secs(10),
            "the leader label on pod-a",
            || async {
                let p = self.pods.get("pod-a").await.ok()?;
                let labels = p.metadata.labels?;
                (labels.get("fencedlease.io/role").map(String::as_str) == Some("leader"))
                    .then_some(())
            },
        )
        .await;
    }

    async fn lease(&self) -> FencedLease {
        self.leases.get("db").await.expect("get the lease")
    }

    /// Writes `status` into pod `name` through pods/status, as the kubelet would.
    async fn pod_status(&self, name: &str, status: serde_json::Value) {
        self.pods
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({ "status": status })),
            )
            .await
            .expect("write the pod's status");
    }

    /// Waits until the controller has judged pod-a in a state whose description shows each of
    /// `shows` and found no sign of death (its debug line), then asserts that the lease is still
    /// pod-a's at the token it acquired, with no revocation Event: the controller saw that state
    /// and waited. The ceiling only stops a hung test.
    async fn waited_out(&self, why: &str, shows: &[&str]) {
        let what = format!("the controller to judge pod-a ({why}) and wait: {shows:?}");
        self.logged(&what, |l| {
            l.contains("the holder gives no sign of death") && shows.iter().all(|s| l.contains(s))
        })
        .await;
        self.still_held(why, self.held.token()).await;
    }

    /// Asserts that pod-a still holds the lease at `token` and that no revocation was recorded.
    async fn still_held(&self, why: &str, token: Option<i64>) {
        let lease = self.lease().await;
        assert!(
            lease.holder() == Some("pod-a") && lease.token() == token,
            "{why}: the lease changed hands early: {:?} token {:?}\ncontroller:\n{}",
            lease.spec,
            lease.token(),
            self.log_tail()
        );
        let events = k8s_events(&self.client, &self.ns.name).await;
        let revoked: Vec<_> = events.iter().filter(|e| is_revocation(e)).collect();
        assert!(revoked.is_empty(), "{why}: {revoked:?}");
    }

    /// Waits until the lease no longer names pod-a, with a larger token; returns it. What
    /// revoked it is the test's to show (the Event naming the cause): a revocation after the
    /// lease ran out would end here too. The ceiling only stops a hung test.
    async fn revoked(&self) -> FencedLease {
        let lease = eventually(Duration::from_secs(60), "pod-a's revocation", || async {
            let l = self.leases.get("db").await.ok()?;
            (l.holder() != Some("pod-a")).then_some(l)
        })
        .await;
        assert!(lease.token() > self.held.token(), "{:?}", lease.metadata);
        lease
    }

    /// An Event with `reason`, waited for.
    async fn event(&self, reason: &str) -> Event {
        eventually(Duration::from_secs(30), reason, || async {
            let evs = k8s_events(&self.client, &self.ns.name).await;
            evs.into_iter()
                .find(|e| e.reason.as_deref() == Some(reason))
        })
        .await
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("controller-0.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

/// Waits until `holder` leads (its first renewal recorded acquireTime); returns the lease then.
async fn held_by(leases: &Api<FencedLease>, holder: &Proc) -> FencedLease {
    eventually(Duration::from_secs(30), "pod-a to lead", || async {
        holder.events().into_iter().find(|e| e.event == "leading")
    })
    .await;
    eventually(
        Duration::from_secs(30),
        "the acquisition recorded",
        || async {
            let l = leases.get("db").await.ok()?;
            let s = l.status.as_ref()?;
            (l.holder() == Some("pod-a") && s.token == l.token() && s.acquire_time.is_some())
                .then_some(l)
        },
    )
    .await
}

fn acquired_ns(lease: &FencedLease) -> i128 {
    lease
        .status
        .as_ref()
        .and_then(|s| s.acquire_time.as_ref())
        .expect("acquireTime")
        .0
        .as_nanosecond()
}

/// A time `s` whole seconds after `ns`, as the kubelet writes it (seconds, UTC).
fn rfc3339_after(ns: i128, s: i128) -> String {
    let t = jiff::Timestamp::from_nanosecond(ns + s * NS_PER_S).expect("a time");
    jiff::Timestamp::from_second(t.as_second())
        .expect("a time")
        .to_string()
}

/// Sleeps until the wall clock has passed `ns`.
async fn sleep_until_ns(ns: i128) {
    let left = ns - now_ns();
    if left > 0 {
        tokio::time::sleep(Duration::from_nanos(left as u64)).await;
    }
}

fn container_status(state: serde_json::Value) -> serde_json::Value {
    json!({"phase": "Running", "containerStatuses": [{
        "name": fencedlease::webhook::inject::CONTAINER, "ready": true, "restartCount": 1,
        "image": "fencedlease", "imageID": "", "state": state
    }]})
}

fn is_revocation(e: &Event) -> bool {
    let r = e.reason.as_deref().unwrap_or_default();
    r == "Revoked" || r.starts_with("Holder")
}

fn opted_out() -> FencedLeaseSpec {
    let mut spec = FencedLeaseSpec::free();
    spec.revoke_on_holder_death = false;
    spec
}

#[tokio::test]
async fn a_force_deleted_holder_pod_is_revoked_before_its_lease_runs_out() {
    let w = World::new("death-gone", false, FencedLeaseSpec::free()).await;
    w.controller_active().await;
    let b = campaign(&w.dir, &w.ns.name, "db", "pod-b", LEASE_S);
    eventually(Duration::from_secs(10), "pod-b to start", || async {
        b.events().into_iter().find(|e| e.event == "started")
    })
    .await;
    // The node is gone with the holder: it stops renewing, and its pod is force-deleted. The
    // controller revokes: the lease's watch sees it free before pod-b holds it, and the Event
    // below names the deletion as the cause (with the death unseen, the lease would be freed
    // only after its 15 s, for expiry: seen red so, the Event missing).
    w.holder.signal(Signal::SIGSTOP);
    let deleted_ns = now_ns();
    let holders = holders_until(&w.leases, "db", |h| h == Some("pod-b"), async {
        w.pods
            .delete("pod-a", &DeleteParams::default().grace_period(0))
            .await
            .expect("force-delete the holder's pod");
    })
    .await;
    assert!(
        holders.contains(&None),
        "pod-b took the lease without a revocation before it: holders seen {holders:?}"
    );
    let took = (now_ns() - deleted_ns) as f64 / 1e9;
    eprintln!("pod-b acquired {took:.3} s after the deletion (lease {LEASE_S} s)");
    let next = w.lease().await;
    assert!(next.token() > w.held.token());
    let ev = w.event("HolderPodGone").await;
    let note = ev.note.unwrap_or_default();
    assert!(note.contains("pod-a") && note.contains("deleted"), "{note}");
}

#[tokio::test]
async fn a_dead_process_in_a_live_pod_waits_out_the_lease() {
    let mut w = World::new("death-process", false, FencedLeaseSpec::free()).await;
    w.controller_active().await;
    // Killed without a release; its pod stays, with nothing in its status to say so.
    w.holder.signal(Signal::SIGKILL);
    let _ = w.holder.wait_exit(Duration::from_secs(5));
    // Nothing about the pod changed: the lease runs out, and the controller revokes it as
    // expired, not for a death.
    w.revoked().await;
    let expired = eventually(
        Duration::from_secs(30),
        "the controller's status of the revoked lease",
        || async {
            let l = w.leases.get("db").await.ok()?;
            let g = l.metadata.generation;
            l.status?
                .conditions
                .into_iter()
                .find(|c| c.type_ == "Expired" && c.observed_generation == g)
        },
    )
    .await;
    assert!(
        expired.status == "True" && expired.reason == "NotRenewed",
        "revoked as expired: {expired:?}"
    );
    let evs = k8s_events(&w.client, &w.ns.name).await;
    let deaths: Vec<_> = evs
        .iter()
        .filter(|e| e.reason.as_deref().is_some_and(|r| r.starts_with("Holder")))
        .collect();
    assert!(deaths.is_empty(), "revoked for a death: {deaths:?}");
}

#[tokio::test]
async fn a_campaigning_container_restarted_after_acquiring_is_revoked() {
    let w = World::new("death-restart", false, FencedLeaseSpec::free()).await;
    w.controller_active().await;
    w.holder.signal(Signal::SIGSTOP);
    let acquired = acquired_ns(&w.held);
    // A start before the acquisition (the run that acquired) is no restart.
    w.pod_status(
        "pod-a",
        container_status(json!({"running": {"startedAt": rfc3339_after(acquired, -1)}})),
    )
    .await;
    let started = rfc3339_after(acquired, -1);
    w.waited_out(
        "the container that acquired is running",
        &[&format!("since: {started}")],
    )
    .await;
    // The kubelet reports a newer run of the sidecar, begun well after the acquisition.
    sleep_until_ns(acquired + 3 * NS_PER_S).await;
    w.pod_status(
        "pod-a",
        container_status(json!({"running": {"startedAt": rfc3339_after(acquired, 3)}})),
    )
    .await;
    w.revoked().await;
    let ev = w.event("HolderContainerRestarted").await;
    eprintln!("{:?}", ev.note);
    // The status says why.
    let held = eventually(Duration::from_secs(30), "Held=False", || async {
        let s = w.leases.get("db").await.ok()?.status?;
        s.conditions
            .into_iter()
            .find(|c| c.type_ == "Held" && c.status == "False")
    })
    .await;
    assert_eq!(held.reason, "HolderContainerRestarted");
}

#[tokio::test]
async fn a_failed_holder_pod_is_revoked() {
    let w = World::new("death-failed", false, FencedLeaseSpec::free()).await;
    w.controller_active().await;
    w.holder.signal(Signal::SIGSTOP);
    w.pod_status("pod-a", json!({"phase": "Failed", "reason": "Evicted"}))
        .await;
    w.revoked().await;
    let ev = w.event("HolderPodFinished").await;
    let note = ev.note.unwrap_or_default();
    assert!(note.contains("Failed"), "{note}");
}

#[tokio::test]
async fn a_pod_being_deleted_gracefully_is_left_to_its_sidecar() {
    let w = World::new("death-graceful", true, FencedLeaseSpec::free()).await;
    w.controller_active().await;
    // Graceful deletion (held open by a finalizer), and the sidecar's container already
    // reported terminated after the acquisition: still not the controller's to revoke.
    w.pods
        .delete("pod-a", &DeleteParams::default())
        .await
        .expect("delete the holder's pod");
    let acquired = acquired_ns(&w.held);
    sleep_until_ns(acquired + 3 * NS_PER_S).await;
    let finished = rfc3339_after(acquired, 3);
    w.pod_status(
        "pod-a",
        container_status(json!({"terminated": {"exitCode": 0, "finishedAt": finished}})),
    )
    .await;
    let pod = w.pods.get("pod-a").await.expect("the pod is still there");
    assert!(pod.metadata.deletion_timestamp.is_some());
    w.waited_out(
        "a pod being deleted gracefully",
        &["deleting: true", "Stopped"],
    )
    .await;
    // The sidecar releases by itself, and that is the only Event.
    w.holder.signal(Signal::SIGTERM);
    w.event("Released").await;
    // The controller has reconciled the released lease (its status is of the lease's current
    // generation) and calls it free, not revoked; a revocation it had decided on for the
    // pre-release state would have come before.
    eventually(
        Duration::from_secs(30),
        "the controller's status of the released lease",
        || async {
            let l = w.leases.get("db").await.ok()?;
            let g = l.metadata.generation;
            let s = l.status?;
            (s.observed_generation == g).then_some(())?;
            s.conditions
                .iter()
                .find(|c| c.type_ == "Released" && c.status == "True" && c.observed_generation == g)
                .map(|c| assert_eq!(c.reason, "Free", "released, not revoked: {c:?}"))
        },
    )
    .await;
    let evs = k8s_events(&w.client, &w.ns.name).await;
    let revoked: Vec<_> = evs.iter().filter(|e| is_revocation(e)).collect();
    assert!(revoked.is_empty(), "{revoked:?}");
    w.pods
        .patch(
            "pod-a",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await
        .expect("let the pod go");
}

#[tokio::test]
async fn an_opted_out_lease_waits_out_a_dead_holder() {
    let w = World::new("death-optout", false, opted_out()).await;
    w.controller_active().await;
    assert!(!w.held.spec.revoke_on_holder_death);
    w.holder.signal(Signal::SIGSTOP);
    w.pods
        .delete("pod-a", &DeleteParams::default().grace_period(0))
        .await
        .expect("force-delete the holder's pod");
    w.waited_out("a lease that opted out", &["Gone"]).await;
}

#[tokio::test]
async fn a_process_still_running_under_a_deleted_pods_name_is_revoked_once() {
    let w = World::new("death-zombie", false, FencedLeaseSpec::free()).await;
    w.controller_active().await;
    // The pod is force-deleted, but its process still reaches the API server and campaigns.
    w.pods
        .delete("pod-a", &DeleteParams::default().grace_period(0))
        .await
        .expect("force-delete the holder's pod");
    w.revoked().await;
    w.event("HolderPodGone").await;
    // It acquires again; from then on it is waited out like any holder, not revoked again at
    // once (which would trade writes with it as fast as both can go).
    let again = eventually(
        Duration::from_secs(30),
        "pod-a to acquire again",
        || async {
            let l = w.leases.get("db").await.ok()?;
            (l.holder() == Some("pod-a") && l.token() > w.held.token()).then_some(l)
        },
    )
    .await;
    // The controller sees it hold again and waits it out, this once.
    w.logged("the controller to wait out pod-a's return", |l| {
        l.contains("revoked for its death less than a lease duration ago")
    })
    .await;
    let l = w.lease().await;
    assert!(
        l.holder() == Some("pod-a") && l.token() == again.token(),
        "revoked again: {:?} token {:?} (re-acquired with {:?})\ncontroller:\n{}",
        l.spec,
        l.token(),
        again.token(),
        w.log_tail()
    );
    let evs = k8s_events(&w.client, &w.ns.name).await;
    let gone = evs
        .iter()
        .filter(|e| e.reason.as_deref() == Some("HolderPodGone"))
        .count();
    assert_eq!(gone, 1, "one early revocation");
}
