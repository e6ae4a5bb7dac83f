//! Failover on a real node: deleting the leader pod (SIGTERM: its sidecar releases) gives a
//! new leader with a larger token at once, the longest time without a holder measured (run with
//! `--nocapture` to see the numbers); a leader sidecar killed through containerd is revoked by the
//! controller before its lease could run out.

use fencedlease_testkit as common;

use std::time::{Duration, Instant};

use common::containerd::{containerd_socket, ctr};
use common::eventually;
use common::handover::{ms, summary, LeaseLog};
use common::node::{
    container_id, describe, has_leader_label, is_ready, is_running, name_of, ready_node,
};
use common::operator::{Injected, LEASE};
use fencedlease::controller::holder;
use kube::api::DeleteParams;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_leader_pod_gives_a_new_leader_with_a_larger_token() {
    let w = Injected::start("node-delete").await;
    let log = LeaseLog::start(w.leases(), LEASE).await;
    let mut gaps = vec![];
    for round in 1..=3 {
        let (leader, _, lease) = w.steady(Duration::from_secs(120)).await;
        let (old, old_token) = (name_of(&leader), lease.token().expect("token"));
        let t0 = Instant::now();
        // The default grace period: the kubelet sends SIGTERM, the sidecar releases.
        w.pods()
            .delete(&old, &DeleteParams::default())
            .await
            .expect("deleting the leader pod");
        let (new, new_token) = eventually(
            Duration::from_secs(60),
            "another pod of the Deployment to lead: holder, Ready, labelled",
            || async {
                let l = w.leases().get(LEASE).await.map_err(|e| e.to_string())?;
                let h = l.holder().map(str::to_string);
                let state = format!("holder {h:?} token {:?}", l.token());
                let Some(h) = h.filter(|h| *h != old) else {
                    return Err(state);
                };
                let p = w.pods().get(&h).await.map_err(|e| e.to_string())?;
                if is_running(&p) && is_ready(&p) && has_leader_label(&p) {
                    Ok((h, l.token().expect("token")))
                } else {
                    Err(format!("{state}; {}", describe(&[p])))
                }
            },
        )
        .await;
        assert!(new_token > old_token, "token {new_token} after {old_token}");
        let h = log.handover(&old, &new, new_token, t0).await;
        // A release, taken over from a running follower's watch: no waiting out the lease.
        if let Err(e) = h.released(round, &old) {
            panic!("{e}\n{}", w.sidecar_logs().await);
        }
        println!(
            "delete round {round}: {old} (token {old_token}) -> {new} (token {new_token}); no holder for {}; {}",
            ms(h.longest_gap),
            h.history
        );
        gaps.push(h.longest_gap);
    }
    println!(
        "{}",
        summary("deleting the leader pod (a follower is running)", &gaps)
    );
}

/// Issue 17 on a real node: the leader's sidecar container is killed (SIGKILL, through
/// containerd, as an OOM kill would). The kubelet reports it terminated and restarts it; the
/// controller, seeing the campaigning container stopped after it acquired, revokes the lease at
/// once, so a new token is issued before the lease could have run out. (The Event is what tells
/// the two apart: expiry alone gave a new token 4.0 s after the kill when this test ran with
/// `revokeOnHolderDeath: false` and a 5 s lease, since the last renewal came before it.) The
/// lease is 15 s, as in the benchmark of this case: the death reaches the controller only
/// through the kubelet's status report (p99 3.55 s there), which a 5 s lease on a loaded
/// machine sometimes outlasted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_leader_sidecar_is_revoked_before_its_lease_runs_out() {
    let lease_seconds = 15;
    let w = Injected::start_with_lease("node-death", lease_seconds).await;
    let socket = containerd_socket(&ready_node(&w.client).await);
    let (leader, _, lease) = w.steady(Duration::from_secs(120)).await;
    let (old, old_token) = (name_of(&leader), lease.token().expect("token"));
    settled_tenure(&w, &old, old_token).await;
    let t0 = Instant::now();
    ctr(
        &socket,
        &[
            "tasks",
            "kill",
            "--signal",
            "SIGKILL",
            &container_id(&leader, "fencedlease"),
        ],
    );
    let (holder, token) = eventually(
        Duration::from_secs(30),
        "a new token for the lease after the leader's sidecar was killed",
        || async {
            let l = w.leases().get(LEASE).await.map_err(|e| e.to_string())?;
            let (h, t) = (l.holder().map(str::to_string), l.token());
            match (&h, t) {
                (Some(h), Some(t)) if t > old_token => Ok((h.clone(), t)),
                _ => Err(format!("holder {h:?} token {t:?}")),
            }
        },
    )
    .await;
    let took = t0.elapsed();
    // The controller records its Event after the revocation's write, so the Event may come
    // after the new token: wait for it. It is the proof that the new token came from the
    // confirmed death: a takeover after the lease ran out records none (the ceiling only stops
    // a hung test). How soon it comes is the benchmarks' to measure.
    let revocations = eventually(
        Duration::from_secs(60),
        "a HolderContainerTerminated/Restarted Event (the controller revoked on the death)",
        || async {
            let reasons: Vec<String> = common::k8s_events(&w.client, &w.ns.name)
                .await
                .into_iter()
                .filter_map(|e| e.reason)
                .filter(|r| r.starts_with("HolderContainer"))
                .collect();
            if reasons.is_empty() {
                Err("no HolderContainer* Event".to_string())
            } else {
                Ok(reasons)
            }
        },
    )
    .await;
    println!(
        "killed {old}'s sidecar (token {old_token}): token {token} held by {holder} after {}; events {revocations:?}",
        ms(took)
    );
}

/// Waits until the lease's status records `holder`'s tenure of `token` and its acquireTime is
/// more than two seconds past. The controller compares the container's `startedAt` and
/// `finishedAt` (one-second resolution) with acquireTime only when they are later by more than
/// [`holder::RESOLUTION`]; a container that dies within that margin of acquiring is waited out,
/// as the README says. (Killing it sooner made this test fail three times: the kill came a second
/// after the acquisition and the restart's startedAt was too close to tell.)
async fn settled_tenure(w: &Injected, holder: &str, token: i64) {
    let margin = holder::RESOLUTION + jiff::SignedDuration::from_secs(1);
    let acquired = eventually(
        Duration::from_secs(30),
        "the lease's status to record the holder's tenure",
        || async {
            let l = w.leases().get(LEASE).await.map_err(|e| e.to_string())?;
            match holder::tenure_start(&l) {
                Some(at) if l.holder() == Some(holder) && l.token() == Some(token) => Ok(at),
                other => Err(format!(
                    "holder {:?} token {:?} tenure start {other:?}",
                    l.holder(),
                    l.token()
                )),
            }
        },
    )
    .await;
    let left = (acquired + margin).duration_since(jiff::Timestamp::now());
    if left.is_positive() {
        tokio::time::sleep(left.unsigned_abs()).await;
    }
}
