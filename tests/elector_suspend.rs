//! Suspend (issue 33, hole 6): a tenure's validity is on CLOCK_BOOTTIME, so time the machine
//! spends suspended counts. A holder resumed from a suspend longer than its lease must not go on
//! believing it leads: CLOCK_MONOTONIC (std's and tokio's `Instant`) stops during a suspend, so
//! on it the validity would still be running while another candidate took over.
//!
//! A test machine cannot suspend itself, so the process's clock is told that it was
//! (`clock::simulate_suspend`): to the elector that is exactly what a resume looks like,
//! CLOCK_BOOTTIME ahead of CLOCK_MONOTONIC by the time suspended. A binary of its own: the
//! simulated suspend is process-wide. Against a real kube-apiserver.

use fencedlease_testkit as common;

use std::time::Duration;

use common::{client, ensure_crd, TestNamespace};
use fencedlease_elector::lease::clock;
use fencedlease_elector::{Elector, ElectorConfig, LeaderState};
use tokio::sync::watch;

#[tokio::test]
async fn a_holder_resumed_from_a_suspend_longer_than_its_lease_stops_leading_with_that_token() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "suspend").await;
    let mut cfg = ElectorConfig::new(&ns.name, "db", "a");
    cfg.create_with_duration = Some(5);
    let (elector, handle) = Elector::new(client.clone(), cfg).expect("a valid config");
    let (stop, mut stopped) = watch::channel(false);
    let task = tokio::spawn(elector.run(async move {
        let _ = stopped.wait_for(|s| *s).await;
    }));
    let mut state = handle.state.clone();
    let leading = |s: &LeaderState| s.leading_token(clock::now()).is_some();
    let first = tokio::time::timeout(Duration::from_secs(30), state.wait_for(leading))
        .await
        .expect("the elector leads within 30 s")
        .expect("the elector runs")
        .clone();
    let LeaderState::Leading {
        token: t1,
        tenure: n1,
        ..
    } = first
    else {
        unreachable!("waited for leading")
    };

    // The machine sleeps for 30 s, six times the lease, and wakes up.
    clock::simulate_suspend(Duration::from_secs(30));
    // Whoever reads the state first thing finds the claim run out, before the elector has
    // even looked.
    assert!(
        handle.state.borrow().leading_token(clock::now()).is_none(),
        "a claim that ran out during the suspend must not be handed out"
    );
    // And the elector, on resuming, stops leading with that token: it reports not leading, or
    // (nobody else campaigns here) a new tenure with a larger token.
    let after = tokio::time::timeout(
        Duration::from_secs(30),
        state.wait_for(|s| !matches!(s, LeaderState::Leading { token, .. } if *token == t1)),
    )
    .await
    .expect("the resumed elector gives up the token it held before the suspend")
    .expect("the elector runs")
    .clone();
    if let LeaderState::Leading { token, tenure, .. } = &after {
        assert!(
            token.generation > t1.generation && *tenure > n1,
            "{after:?}"
        );
    }
    let _ = stop.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
}
