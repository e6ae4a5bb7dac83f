//! Restricted Pod Security on a real node (issue 36): in a namespace that enforces the
//! `restricted` level, the chart's operator pods start, and pods that meet the level before
//! injection (their one container `hardened()`, seccomp set per container, nothing at pod
//! level) still meet it once the sidecar is injected: the API server admits them, they run,
//! and one of them leads.

use fencedlease_testkit as common;

use std::time::Duration;

use common::node::{container_names, name_of};
use common::operator::Injected;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_and_injected_pods_meet_restricted_pod_security() {
    let w = Injected::start_restricted("restricted").await;
    let (leader, follower, lease) = w.steady(Duration::from_secs(120)).await;
    for p in [&leader, &follower] {
        assert!(
            container_names(p).iter().any(|n| n == "fencedlease"),
            "{} runs without the sidecar: {:?}",
            name_of(p),
            container_names(p)
        );
    }
    assert!(lease.token().is_some(), "the leader holds a token");
}
