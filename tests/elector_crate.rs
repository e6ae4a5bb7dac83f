//! The elector as a library (the fencedlease-elector crate, issue 20), used the way another
//! kube-rs program would: only `fencedlease_elector::` paths, two electors in one process on
//! one lease, against a real kube-apiserver. No controller runs: failover must not need it.

use fencedlease_testkit as common;

use std::time::Duration;

use common::fencing::holders_until;
use common::{client, ensure_crd, eventually, TestNamespace};
use fencedlease_elector::{
    Elector, ElectorConfig, ElectorHandle, FencedLease, FencingToken, LeaderState, Timing,
};
use kube::{Api, Client};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// One participant: its handle, the way to stop it, and its task.
struct Participant {
    identity: &'static str,
    handle: ElectorHandle,
    stop: watch::Sender<bool>,
    task: JoinHandle<Result<(), fencedlease_elector::Error>>,
}

impl Participant {
    fn start(client: &Client, ns: &str, lease: &str, identity: &'static str) -> Participant {
        let mut cfg = ElectorConfig::new(ns, lease, identity);
        cfg.create_with_duration = Some(2);
        let (elector, handle) = Elector::new(client.clone(), cfg).expect("a valid config");
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(elector.run(async move {
            let _ = stopped.wait_for(|s| *s).await;
        }));
        Participant {
            identity,
            handle,
            stop,
            task,
        }
    }

    fn token(&self) -> Option<FencingToken> {
        self.handle
            .state
            .borrow()
            .leading_token(fencedlease_elector::lease::clock::now())
            .cloned()
    }

    /// Stops campaigning; the elector releases the lease on its way out.
    async fn shut_down(self) {
        let _ = self.stop.send(true);
        let res = tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .expect("the elector stops within 10 s of its shutdown");
        res.expect("the elector task does not panic")
            .expect("the elector stops without error");
        assert_eq!(*self.handle.state.borrow(), LeaderState::Unknown);
    }
}

/// Waits until exactly one of `ps` leads; returns its index and token. Also checks the other
/// follows that leader.
async fn sole_leader(ps: &[&Participant]) -> (usize, FencingToken) {
    eventually(
        Duration::from_secs(30),
        "exactly one elector to lead",
        || async {
            let leading: Vec<(usize, FencingToken)> = ps
                .iter()
                .enumerate()
                .filter_map(|(i, p)| p.token().map(|t| (i, t)))
                .collect();
            match leading.as_slice() {
                [(i, t)] => Some((*i, t.clone())),
                _ => None,
            }
        },
    )
    .await
}

/// Samples every 10 ms that no two participants lead at once, until `leader` has renewed `n`
/// times (its validity moved on); the ceiling only stops a hung test.
async fn never_two_leaders(ps: &[&Participant], leader: &Participant, n: usize) {
    let valid_until = || match &*leader.handle.state.borrow() {
        LeaderState::Leading { valid_until, .. } => Some(*valid_until),
        _ => None,
    };
    let (mut last, mut renewals) = (valid_until(), 0);
    let ceiling = Instant::now() + Duration::from_secs(60);
    while renewals < n {
        let leading: Vec<&str> = ps
            .iter()
            .filter(|p| p.token().is_some())
            .map(|p| p.identity)
            .collect();
        assert!(leading.len() <= 1, "two leaders at once: {leading:?}");
        let now = valid_until();
        if now.is_some() && now != last {
            renewals += 1;
        }
        last = now;
        assert!(
            Instant::now() < ceiling,
            "{} renewed only {renewals} times",
            leader.identity
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn two_electors_one_leads_and_each_step_down_hands_over_with_a_larger_token() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "elector-crate").await;
    let a = Participant::start(&client, &ns.name, "db", "a");
    let b = Participant::start(&client, &ns.name, "db", "b");

    let (i, first) = sole_leader(&[&a, &b]).await;
    let (leader, other) = if i == 0 { (a, b) } else { (b, a) };
    // The other follows the leader and sees its token; over two renewals there is never a
    // second leader.
    never_two_leaders(&[&leader, &other], &leader, 2).await;
    eventually(
        Duration::from_secs(30),
        "the other to follow the leader",
        || async {
            let s = other.handle.state.borrow().clone();
            let want = LeaderState::Following {
                holder: Some(leader.identity.to_string()),
                token: Some(first.generation),
            };
            (s == want).then_some(())
        },
    )
    .await;
    // The lease object agrees: the same holder, with this token in status.
    let api: Api<FencedLease> = Api::namespaced(client.clone(), &ns.name);
    let lease = api.get("db").await.expect("the electors created the lease");
    assert_eq!(lease.holder(), Some(leader.identity));
    assert_eq!(lease.token(), Some(first.generation));
    assert_eq!(
        lease.metadata.uid.as_deref(),
        Some(first.lease_uid.as_str())
    );

    // Step down by request: the leader releases and stays out; the other takes over through
    // the release, not by waiting out the lease: a watch of the lease sees it free before the
    // other holds it. Then the other leads with a strictly larger token.
    let holders = holders_until(&api, "db", |h| h == Some(other.identity), async {
        leader.handle.request_release()
    })
    .await;
    assert!(
        holders.contains(&None),
        "the other took the lease without a release before it (an expiry takeover): holders seen {holders:?}"
    );
    let second = eventually(Duration::from_secs(10), "the other to lead", || async {
        other.token()
    })
    .await;
    assert!(
        second.generation > first.generation,
        "{second} after {first}"
    );
    assert_eq!(second.lease_uid, first.lease_uid);
    assert!(leader.token().is_none(), "the one that stepped down leads");
    never_two_leaders(&[&leader, &other], &other, 1).await;

    // Step down by shutting down: the elector releases on its way out, and the first leader
    // (out of the running for one lease duration after its release) leads again with a
    // strictly larger token still.
    other.shut_down().await;
    let third = eventually(
        Duration::from_secs(10),
        "the first leader to lead again",
        || async { leader.token() },
    )
    .await;
    assert!(
        third.generation > second.generation,
        "{third} after {second}"
    );
    assert_eq!(third.lease_uid, first.lease_uid);
    leader.shut_down().await;

    // Both released: the lease is free, with a token beyond every one handed out.
    let lease = api.get("db").await.expect("the lease stays");
    assert_eq!(lease.holder(), None);
    assert!(lease.token() > Some(third.generation));
}

/// Issue 33, hole 1: two processes of one identity (a StatefulSet pod re-created under its
/// name). A leads through a proxy that then cuts it off; meanwhile its lease is revoked and a
/// new process B of the same identity acquires it. When A reaches the API server again, its
/// next renewal meets a conflict and its re-read shows the lease naming its identity with a
/// higher token: B's tenure, which A must not adopt. A stops leading; B leads alone, with its
/// own incarnation on the lease. (The `sequences` tests in elector/src/lease/elector.rs feed the
/// same order to the elector deterministically, with a fake API server; here it runs against
/// the real one.)
#[tokio::test]
async fn a_process_cut_off_while_its_identity_re_acquires_stops_instead_of_taking_the_new_token() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "incarnation").await;
    let dir = common::procs::scratch_dir("incarnation");
    let proxy = common::apiproxy::ApiProxy::start(&dir);
    let through = common::client_from(&proxy.kubeconfig).await;
    // A renews every 100 ms, so that it is retrying a renewal (not waiting) when it comes back:
    // the conflict's re-read, not its watch, is the first to show it the new tenure.
    let timing = Timing {
        lease_duration: Duration::from_secs(10),
        renew_interval: Duration::from_millis(100),
        safety_margin: Duration::from_secs(2),
    };
    let start = |client: &Client| {
        let mut cfg = ElectorConfig::new(&ns.name, "db", "web-0");
        cfg.create_with_duration = Some(10);
        cfg.timing_override = Some(timing);
        let (elector, handle) = Elector::new(client.clone(), cfg).expect("a valid config");
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(elector.run(async move {
            let _ = stopped.wait_for(|s| *s).await;
        }));
        Participant {
            identity: "web-0",
            handle,
            stop,
            task,
        }
    };
    let a = start(&through);
    let first = eventually(Duration::from_secs(30), "A to lead", || async { a.token() }).await;

    proxy.cut();
    let api: Api<FencedLease> = Api::namespaced(client.clone(), &ns.name);
    let revoked = eventually(Duration::from_secs(10), "revoking A's tenure", || async {
        let lease = api.get("db").await.ok()?;
        match fencedlease_elector::lease::revoke(&api, &lease).await {
            Ok(fencedlease_elector::lease::Revocation::Revoked(l)) => Some(*l),
            _ => None,
        }
    })
    .await;
    let b = start(&client);
    let second = eventually(
        Duration::from_secs(10),
        "B (web-0 again) to lead",
        || async { b.token() },
    )
    .await;
    assert!(second.generation > revoked.token().unwrap_or(i64::MAX));
    let with_b = api.get("db").await.expect("the lease");
    let b_incarnation = with_b.holder_incarnation().map(str::to_string);
    assert!(
        b_incarnation.is_some(),
        "B's acquisition records its process"
    );

    proxy.restore();
    let after = eventually(
        Duration::from_secs(10),
        "A to see that its tenure ended",
        || async {
            let s = a.handle.state.borrow().clone();
            match &s {
                LeaderState::Leading { token, .. } if *token == first => None,
                _ => Some(s),
            }
        },
    )
    .await;
    assert!(
        matches!(after, LeaderState::Following { .. }),
        "A, cut off while its identity re-acquired, must stop leading; it went on as {after:?} \
         (B leads with {second})"
    );
    assert_eq!(b.token(), Some(second.clone()), "B still leads");
    let lease = api.get("db").await.expect("the lease");
    assert_eq!(
        lease.holder_incarnation().map(str::to_string),
        b_incarnation
    );
    assert_eq!(lease.token(), Some(second.generation));
    // A shuts down without releasing B's tenure; then B releases its own.
    a.shut_down().await;
    assert_eq!(api.get("db").await.expect("lease").holder(), Some("web-0"));
    b.shut_down().await;
    assert_eq!(api.get("db").await.expect("lease").holder(), None);
}
