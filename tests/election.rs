//! Lease: the election protocol with real candidate processes against a real kube-apiserver.
//! No controller runs in these tests unless named: failover must not need it.

use fencedlease_testkit as common;

use std::time::Duration;

use common::fencing::holders_until;
use common::procs::{
    assert_no_overlap, campaign, claims, controller, following, now_ns, scratch_dir, Ev, Proc,
};
use common::{client, ensure_crd, eventually, TestNamespace};
use fencedlease::api::FencedLease;
use kube::api::{Patch, PatchParams};
use kube::Api;
use nix::sys::signal::Signal;

/// Waits until exactly one of `procs` has announced leadership it still holds; returns its
/// index and the "leading" event.
async fn leader(procs: &[&Proc], timeout: Duration) -> (usize, Ev) {
    eventually(timeout, "one candidate to lead", || async {
        let mut leaders = Vec::new();
        for (i, p) in procs.iter().enumerate() {
            let evs = p.events();
            if let Some(last) = evs
                .iter()
                .rev()
                .find(|e| e.event == "leading" || e.event == "stopped")
            {
                if last.event == "leading" {
                    leaders.push((i, last.clone()));
                }
            }
        }
        (leaders.len() == 1).then(|| leaders.remove(0))
    })
    .await
}

/// Waits for a "leading" event after `after_ns` in any of `procs`.
async fn next_leader(procs: &[&Proc], after_ns: i128, timeout: Duration) -> (usize, Ev) {
    eventually(timeout, "a new leader", || async {
        procs.iter().enumerate().find_map(|(i, p)| {
            p.events()
                .into_iter()
                .find(|e| e.event == "leading" && e.t_ns > after_ns)
                .map(|e| (i, e))
        })
    })
    .await
}

fn all_claims(procs: &[&Proc]) -> Vec<common::procs::Claim> {
    let now = now_ns();
    procs
        .iter()
        .flat_map(|p| claims(&p.events(), now))
        .collect()
}

/// Waits until `p` has logged `n` renewals (of its current or an earlier term).
async fn renewals(p: &Proc, n: usize) {
    eventually(Duration::from_secs(30), "renewals", || async {
        (p.events().iter().filter(|e| e.event == "renewed").count() >= n).then_some(())
    })
    .await;
}

fn ms(ns: i128) -> f64 {
    ns as f64 / 1e6
}

#[tokio::test]
async fn sigkill_of_the_holder_fails_over_within_the_lease_with_a_larger_token() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "crash").await;
    let dir = scratch_dir("crash");
    let a = campaign(&dir, &ns.name, "db", "a", 2);
    let b = campaign(&dir, &ns.name, "db", "b", 2);
    let c = campaign(&dir, &ns.name, "db", "c", 2);
    let procs = [&a, &b, &c];
    let (i, first) = leader(&procs, Duration::from_secs(30)).await;
    // Let it renew twice, then crash it.
    renewals(procs[i], 2).await;
    procs[i].signal(Signal::SIGKILL);
    let killed_at = now_ns();
    let others: Vec<&Proc> = procs
        .iter()
        .enumerate()
        .filter(|(j, _)| *j != i)
        .map(|(_, p)| *p)
        .collect();
    let (_, second) = next_leader(&others, killed_at, Duration::from_secs(10)).await;
    // How soon is the failover benchmarks' business (bench/failover.py); here, that it happens,
    // with a larger token and no overlap of belief.
    eprintln!(
        "crash failover: {:.0} ms (lease 2000 ms)",
        ms(second.t_ns - killed_at)
    );
    assert!(second.token > first.token, "{second:?} vs {first:?}");
    assert_eq!(second.lease_uid, first.lease_uid);
    assert_no_overlap(&all_claims(&procs));
}

#[tokio::test]
async fn a_paused_holder_is_replaced_and_reports_not_leading_when_it_resumes() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "pause").await;
    let dir = scratch_dir("pause");
    let a = campaign(&dir, &ns.name, "db", "a", 2);
    let b = campaign(&dir, &ns.name, "db", "b", 2);
    let procs = [&a, &b];
    let (i, first) = leader(&procs, Duration::from_secs(30)).await;
    let (held, other) = (procs[i], procs[1 - i]);
    renewals(held, 1).await;
    held.signal(Signal::SIGSTOP);
    let paused_at = now_ns();
    let (_, second) = next_leader(&[other], paused_at, Duration::from_secs(10)).await;
    assert!(second.token > first.token);
    // Keep it paused past the new leader's start and its first renewal, then resume it.
    renewals(other, 1).await;
    let resumed_at = now_ns();
    held.signal(Signal::SIGCONT);
    // After resuming, its first word is that it stopped leading; it never renews first.
    let after = eventually(
        Duration::from_secs(30),
        "the resumed holder to step down",
        || async {
            let evs: Vec<Ev> = held
                .events()
                .into_iter()
                .filter(|e| e.t_ns >= resumed_at)
                .collect();
            (!evs.is_empty()).then_some(evs)
        },
    )
    .await;
    assert_eq!(
        after[0].event,
        "stopped",
        "after SIGCONT: {after:?}\n{}",
        held.log_tail()
    );
    assert!(!after.iter().any(|e| e.event == "renewed"), "{after:?}");
    // Judged by the candidates' own validity rule, there were never two leaders.
    assert_no_overlap(&all_claims(&procs));
    // And the paused one's claim had ended before the new leader began.
    let old: Vec<_> = claims(&held.events(), now_ns());
    let old_end = old
        .iter()
        .filter(|c| Some(c.token) == first.token)
        .map(|c| c.end_ns)
        .max()
        .unwrap_or(0);
    assert!(
        old_end < second.t_ns,
        "old claim ended {old_end}, new began {}",
        second.t_ns
    );
}

#[tokio::test]
async fn sigterm_hands_over_by_a_release() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "handover").await;
    let dir = scratch_dir("handover");
    // A long lease: only a release can explain a fast handover.
    let mut a = campaign(&dir, &ns.name, "db", "a", 30);
    let (_, first) = leader(&[&a], Duration::from_secs(30)).await;
    let b = campaign(&dir, &ns.name, "db", "b", 30);
    following(&b, "a").await; // b watches the lease
    let t0 = now_ns();
    // Handed over by a's release, not by waiting out the 30 s lease: the lease's watch sees it
    // free before b holds it.
    let leases: Api<FencedLease> = Api::namespaced(client.clone(), &ns.name);
    let holders = holders_until(&leases, "db", |h| h == Some("b"), async {
        a.signal(Signal::SIGTERM)
    })
    .await;
    assert!(
        holders.contains(&None),
        "b took the lease without a release before it: holders seen {holders:?}"
    );
    let (_, second) = next_leader(&[&b], t0, Duration::from_secs(5)).await;
    eprintln!("graceful handover: {:.0} ms", ms(second.t_ns - t0));
    assert!(second.token > first.token);
    assert_eq!(
        a.wait_exit(Duration::from_secs(5)),
        Some(0),
        "{}",
        a.log_tail()
    );
    assert_no_overlap(&all_claims(&[&a, &b]));
}

#[tokio::test]
async fn preferred_holder_gets_the_lease_by_handover() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "preferred").await;
    let dir = scratch_dir("preferred");
    let a = campaign(&dir, &ns.name, "db", "a", 30);
    let (_, first) = leader(&[&a], Duration::from_secs(30)).await;
    let b = campaign(&dir, &ns.name, "db", "b", 30);
    let c = campaign(&dir, &ns.name, "db", "c", 30);
    following(&b, "a").await;
    following(&c, "a").await;
    let api: Api<FencedLease> = Api::namespaced(client.clone(), &ns.name);
    let t0 = now_ns();
    api.patch(
        "db",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"spec": {"preferredHolder": "c"}})),
    )
    .await
    .expect("set preferredHolder");
    let (j, second) = next_leader(&[&b, &c], t0, Duration::from_secs(5)).await;
    assert_eq!(j, 1, "the preferred candidate c must win, got {second:?}");
    eprintln!("handover to preferred: {:.0} ms", ms(second.t_ns - t0));
    assert!(second.token > first.token);
    let lease = api.get("db").await.expect("get");
    assert_eq!(lease.holder(), Some("c"));
    assert_eq!(
        lease.spec.preferred_holder, None,
        "cleared by the acquiring write"
    );
    assert_no_overlap(&all_claims(&[&a, &b, &c]));
}

#[tokio::test]
async fn controller_revokes_an_expired_lease_with_no_other_candidate() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "revoke").await;
    let dir = scratch_dir("revoke");
    let ctl = controller(&dir, &ns.name, "controller-0");
    let a = campaign(&dir, &ns.name, "db", "a", 2);
    let (_, first) = leader(&[&a], Duration::from_secs(30)).await;
    let api: Api<FencedLease> = Api::namespaced(client.clone(), &ns.name);
    // The controller marks it held.
    eventually(Duration::from_secs(10), "status Held=True", || async {
        let l = api.get("db").await.ok()?;
        let st = l.status?;
        (st.observed_generation == l.metadata.generation
            && st
                .conditions
                .iter()
                .any(|c| c.type_ == "Held" && c.status == "True"))
        .then_some(())
    })
    .await;
    a.signal(Signal::SIGSTOP);
    let revoked = eventually(
        Duration::from_secs(10),
        "the controller to revoke",
        || async {
            let l = api.get("db").await.ok()?;
            (l.holder().is_none()).then_some(l)
        },
    )
    .await;
    assert!(revoked.token() > Some(first.token.unwrap_or_default()));
    let expired = eventually(Duration::from_secs(30), "Expired=True", || async {
        let st = api.get("db").await.ok()?.status?;
        st.conditions
            .iter()
            .find(|c| c.type_ == "Expired" && c.status == "True")
            .cloned()
    })
    .await;
    assert_eq!(expired.reason, "NotRenewed");
    // An Event says so.
    let (ok, out, err) = common::kubectl(&["get", "events", "-n", &ns.name, "-o", "wide"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("Revoked"),
        "events:\n{out}\ncontroller log:\n{}",
        ctl.log_tail()
    );
    // The paused holder comes back: it stops, then campaigns again and wins a larger token.
    let t0 = now_ns();
    a.signal(Signal::SIGCONT);
    let (_, again) = next_leader(&[&a], t0, Duration::from_secs(10)).await;
    assert!(again.token > revoked.token(), "{again:?}");
}

#[tokio::test]
async fn a_recreated_lease_never_reuses_a_token() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "recreate").await;
    let dir = scratch_dir("recreate");
    let a = campaign(&dir, &ns.name, "db", "a", 2);
    let (_, first) = leader(&[&a], Duration::from_secs(30)).await;
    let api: Api<FencedLease> = Api::namespaced(client.clone(), &ns.name);
    let t0 = now_ns();
    api.delete("db", &Default::default()).await.expect("delete");
    // The campaign loses it at once, re-creates it, and leads again.
    let (_, second) = next_leader(&[&a], t0, Duration::from_secs(15)).await;
    assert_ne!(
        second.lease_uid, first.lease_uid,
        "a new object has a new uid"
    );
    let evs = a.events();
    let stopped = evs.iter().find(|e| e.event == "stopped" && e.t_ns > t0);
    assert!(stopped.is_some_and(|s| s.t_ns < second.t_ns), "{evs:?}");
    // Every (uid, generation) handed out is distinct, and within a uid generations increase.
    let leading: Vec<(String, i64)> = evs
        .iter()
        .filter(|e| e.event == "leading")
        .map(|e| {
            (
                e.lease_uid.clone().unwrap_or_default(),
                e.token.unwrap_or_default(),
            )
        })
        .collect();
    let mut unique = leading.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(
        unique.len(),
        leading.len(),
        "a token was handed out twice: {leading:?}"
    );
}

#[tokio::test]
async fn campaign_command_exit_releases_the_lease_and_passes_the_exit_code() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "exit").await;
    let dir = scratch_dir("exit");
    let out = dir.join("out");
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_fencedlease"))
        .args([
            "campaign",
            "--lease",
            "job",
            "--namespace",
            &ns.name,
            "--identity",
            "once",
            "--lease-duration",
            "30",
            "--",
        ])
        .args([
            "sh",
            "-c",
            "echo \"$FENCEDLEASE_TOKEN $FENCEDLEASE_LEASE_UID\" > \"$0\"; exit 7",
        ])
        .arg(&out)
        .env("KUBECONFIG", common::kubeconfig_path())
        .status()
        .expect("run campaign");
    assert_eq!(status.code(), Some(7));
    let written = std::fs::read_to_string(&out).expect("the command ran");
    let mut parts = written.split_whitespace();
    let token: i64 = parts
        .next()
        .and_then(|t| t.parse().ok())
        .expect("a numeric token");
    assert!(token >= 2, "{written}");
    assert!(parts.next().is_some_and(|u| u.len() >= 32), "{written}");
    let lease = Api::<FencedLease>::namespaced(client.clone(), &ns.name)
        .get("job")
        .await
        .expect("get");
    assert_eq!(lease.holder(), None, "released when the command exited");
    assert!(lease.token() > Some(token));
}

#[test]
fn campaign_refuses_bad_flags_with_a_clear_error() {
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_fencedlease"))
            .args(args)
            .output()
            .expect("run");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, err) = run(&["campaign", "--lease", "x"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("<COMMAND>"), "{err}");
    let (code, err) = run(&[
        "campaign",
        "--lease",
        "x",
        "--lease-duration",
        "0",
        "--",
        "true",
    ]);
    assert_eq!(code, Some(2));
    assert!(err.contains("lease-duration"), "{err}");
    let (code, err) = run(&[
        "campaign",
        "--lease",
        "x",
        "--grace-seconds=-1",
        "--",
        "true",
    ]);
    assert_ne!(code, Some(0));
    assert!(err.contains("grace"), "{err}");
}

/// A candidate that finds the lease still naming itself (it lost its in-memory state, or its
/// validity ran out while the API server was away) must take it over with a *new* token: a
/// write that leaves the spec unchanged moves neither the generation nor anyone's clock.
#[tokio::test]
async fn retaking_a_lease_that_still_names_you_gives_a_new_token() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "retake").await;
    let dir = scratch_dir("retake");
    let api: Api<FencedLease> = Api::namespaced(client.clone(), &ns.name);
    let mut spec = fencedlease::api::FencedLeaseSpec::free();
    spec.holder_identity = Some("a".into());
    spec.lease_duration_seconds = 1;
    let stale = api
        .create(
            &kube::api::PostParams::default(),
            &FencedLease::new("db", spec),
        )
        .await
        .expect("create a lease held by a previous life of 'a'");
    let old = stale.token().expect("generation");
    let a = campaign(&dir, &ns.name, "db", "a", 1);
    let (_, led) = leader(&[&a], Duration::from_secs(15)).await;
    assert!(
        led.token > Some(old),
        "'a' must lead with a token above {old}, got {led:?}"
    );
    let lease = api.get("db").await.expect("get");
    assert_eq!(lease.holder(), Some("a"));
    assert_eq!(lease.token(), led.token);
}

/// A lease being deleted (it waits for a finalizer: in policy mode the controller's, until the
/// lease index drops it) elects nobody: its holder stops leading at once, and no candidate
/// leads on it. Once it is gone a candidate makes it again and leads under the new lease.
#[tokio::test]
async fn a_lease_being_deleted_elects_nobody() {
    use kube::api::DeleteParams;
    const HOLD: &str = "example.com/test-hold";
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "doomed").await;
    let dir = scratch_dir("doomed");
    let a = campaign(&dir, &ns.name, "db", "a", 2);
    let (_, led) = leader(&[&a], Duration::from_secs(30)).await;
    let old_uid = led.lease_uid.clone().expect("the lease uid");
    let leases: Api<FencedLease> = Api::namespaced(client.clone(), &ns.name);
    let hold = serde_json::json!({"metadata": {"finalizers": [HOLD]}});
    leases
        .patch("db", &PatchParams::default(), &Patch::Merge(&hold))
        .await
        .expect("hold the lease with a finalizer");
    let b = campaign(&dir, &ns.name, "db", "b", 2);
    following(&b, "a").await;
    let deleted_at = now_ns();
    leases
        .delete("db", &DeleteParams::default())
        .await
        .expect("delete the lease");
    // It stops because it lost the lease, not because the delete moved its token on (after
    // which it would lead again under the raised generation).
    eventually(
        Duration::from_secs(30),
        "the holder to stop: lost",
        || async {
            a.events()
                .iter()
                .any(|e| {
                    e.event == "stopped"
                        && e.t_ns > deleted_at
                        && e.reason.as_deref() == Some("lost")
                })
                .then_some(())
        },
    )
    .await;
    let doomed = leases
        .get("db")
        .await
        .expect("the lease waits for its finalizer");
    assert!(doomed.metadata.deletion_timestamp.is_some());
    let release = serde_json::json!({"metadata": {"finalizers": null}});
    leases
        .patch("db", &PatchParams::default(), &Patch::Merge(&release))
        .await
        .expect("let the lease go");
    let (_, next) = next_leader(&[&a, &b], deleted_at, Duration::from_secs(60)).await;
    assert_ne!(
        next.lease_uid.as_deref(),
        Some(old_uid.as_str()),
        "{next:?}"
    );
    // Nobody led on the lease being deleted: every tenure begun after the delete is the new
    // lease's.
    for p in [&a, &b] {
        for e in p
            .events()
            .iter()
            .filter(|e| e.event == "leading" && e.t_ns > deleted_at)
        {
            assert_ne!(e.lease_uid.as_deref(), Some(old_uid.as_str()), "{e:?}");
        }
    }
}
