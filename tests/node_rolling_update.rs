//! A rolling update on a real node hands leadership over to the new pods: the old leader
//! releases on SIGTERM and a new pod takes the lease; the longest time without a holder is
//! measured and printed (run with `--nocapture` to see the numbers).

use fencedlease_testkit as common;

use std::time::{Duration, Instant};

use common::eventually;
use common::handover::{ms, summary, LeaseLog};
use common::node::{describe, has_leader_label, is_ready, is_running, name_of};
use common::operator::{Injected, LEASE, WORKLOAD};
use kube::api::{Patch, PatchParams};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_update_hands_leadership_over_to_the_new_pods() {
    let w = Injected::start("node-rollout").await;
    let log = LeaseLog::start(w.leases(), LEASE).await;
    let mut gaps = vec![];
    for round in 1..=3 {
        let (leader, _, lease) = w.steady(Duration::from_secs(120)).await;
        let (old, old_token) = (name_of(&leader), lease.token().expect("token"));
        let old_hash = leader
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("pod-template-hash").cloned())
            .expect("pod-template-hash");
        let t0 = Instant::now();
        let patch = json!({"spec": {"template": {"metadata": {"annotations": {"example.com/revision": round.to_string()}}}}});
        w.deployments()
            .patch(WORKLOAD, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .expect("changing the pod template");
        // A pod of the new ReplicaSet leads (Ready, labelled), the rollout is complete, and the
        // old ReplicaSet's pods are all being deleted.
        let (new, new_token) = eventually(
            Duration::from_secs(90),
            "a pod of the new ReplicaSet to lead and the rollout to complete",
            || async {
                let l = w.leases().get(LEASE).await.map_err(|e| e.to_string())?;
                let d = w
                    .deployments()
                    .get(WORKLOAD)
                    .await
                    .map_err(|e| e.to_string())?;
                let live = w.live_pods().await?;
                let ds = d.status.clone().unwrap_or_default();
                let state = format!(
                    "holder {:?} token {:?}; deployment updated {:?} replicas {:?}; pods {}",
                    l.holder(),
                    l.token(),
                    ds.updated_replicas,
                    ds.replicas,
                    describe(&live)
                );
                let done = ds.observed_generation >= d.metadata.generation
                    && ds.updated_replicas == Some(2)
                    && live.iter().all(|p| {
                        p.metadata
                            .labels
                            .as_ref()
                            .and_then(|l| l.get("pod-template-hash"))
                            != Some(&old_hash)
                    });
                let Some(h) = l.holder().filter(|h| *h != old) else {
                    return Err(state);
                };
                let Some(p) = live.iter().find(|p| name_of(p) == h) else {
                    return Err(state);
                };
                if done && is_running(p) && is_ready(p) && has_leader_label(p) {
                    Ok((h.to_string(), l.token().expect("token")))
                } else {
                    Err(state)
                }
            },
        )
        .await;
        assert!(new_token > old_token, "token {new_token} after {old_token}");
        let h = log.handover(&old, &new, new_token, t0).await;
        // No takeover by expiry: the new pods take the released lease as soon as they run.
        if let Err(e) = h.released(round, &old) {
            panic!("{e}\n{}", w.sidecar_logs().await);
        }
        println!(
            "rollout round {round}: {old} (token {old_token}) -> {new} (token {new_token}); no holder for {} (total {}); {}",
            ms(h.longest_gap),
            ms(h.total_gap),
            h.history
        );
        gaps.push(h.longest_gap);
    }
    println!("{}", summary("rolling update (maxUnavailable 100%)", &gaps));
}
