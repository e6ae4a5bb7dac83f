//! A frozen leader on a real node: its pod paused with containerd (the freezer cgroup: a stalled
//! VM, a long GC pause) past its lease is replaced by a new leader with a larger token, turns
//! unready while still frozen, and once thawed its write with its old token is refused by the
//! API server.

use fencedlease_testkit as common;

use std::time::Duration;

use common::containerd::{containerd_socket, token_file, Frozen};
use common::eventually;
use common::handover::ms;
use common::node::{
    container_statuses, describe, has_leader_label, holder, is_ready, log_tail, name_of,
    ready_node, LEASE_LABEL,
};
use common::operator::{Injected, LEASE, LEASE_SECONDS};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::PostParams;
use kube::Api;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_leader_is_replaced_and_its_stale_write_is_refused_after_it_thaws() {
    let w = Injected::start("node-freeze").await;
    let node = ready_node(&w.client).await;
    let socket = containerd_socket(&node);
    let (leader, _, lease) = w.steady(Duration::from_secs(120)).await;
    let old = name_of(&leader);
    let old_token = lease.token().expect("token");
    let uid = lease.metadata.uid.clone().expect("lease uid");
    // What the frozen pod's app holds: the token file the sidecar wrote for it.
    let file = token_file(&socket, &leader);
    assert_eq!(
        file.as_deref(),
        Some(old_token.to_string().as_str()),
        "the leader's token file (as its app container sees it) vs the lease's token"
    );

    // Freeze every container of the leader's pod: the freezer cgroup stops it dead, as a
    // stalled VM or a long GC pause would. Nothing in it can renew or release.
    let mut frozen = Frozen::freeze(&socket, &leader);
    let (new, new_token) = eventually(
        Duration::from_secs(LEASE_SECONDS * 3 + 20),
        "another pod to take over the frozen leader's lease",
        || async {
            let l = w.leases().get(LEASE).await.map_err(|e| e.to_string())?;
            match l.holder() {
                Some(h) if h != old && l.token() > Some(old_token) => {
                    Ok((h.to_string(), l.token().expect("token")))
                }
                h => Err(format!("holder {h:?} token {:?}", l.token())),
            }
        },
    )
    .await;
    let took_over = frozen.since.elapsed();
    // Frozen for longer than the lease, in any case.
    let lease_len = Duration::from_secs(LEASE_SECONDS);
    if took_over < lease_len + Duration::from_secs(1) {
        tokio::time::sleep(lease_len + Duration::from_secs(1) - took_over).await;
    }
    // The new leader is Ready and labelled; the label came off the frozen pod, and so did its
    // readiness while it is still frozen: kubelet's HTTP readiness probe times out against a
    // frozen sidecar (an exec probe would hang in the frozen cgroup and keep the last result).
    let new_pod = eventually(
        Duration::from_secs(30),
        "the new leader to be Ready and to carry the leader label; the frozen pod neither",
        || async {
            let p = w.pods().get(&new).await.map_err(|e| e.to_string())?;
            let o = w.pods().get(&old).await.map_err(|e| e.to_string())?;
            if is_ready(&p) && has_leader_label(&p) && !has_leader_label(&o) && !is_ready(&o) {
                Ok(p)
            } else {
                Err(describe(&[p, o]))
            }
        },
    )
    .await;
    let frozen_for = frozen.since.elapsed();
    frozen.thaw();
    println!(
        "froze {old} (token {old_token}); {new} took over with token {new_token} after {} (lease {LEASE_SECONDS} s); the frozen pod was unready and the new one Ready {} after the freeze; thawed",
        ms(took_over),
        ms(frozen_for)
    );

    // The new leader writes the protected object with its token (from its own token file).
    let new_file = token_file(&socket, &new_pod).expect("the new leader's token file");
    assert_eq!(new_file, new_token.to_string());
    let cms: Api<ConfigMap> = Api::namespaced(w.client.clone(), &w.ns.name);
    let fenced = |by: &str, token: i64| -> ConfigMap {
        serde_json::from_value(json!({
            "metadata": {
                "name": "inventory",
                "labels": {LEASE_LABEL: LEASE},
                "annotations": {"fencedlease.io/token": token.to_string(), "fencedlease.io/lease-uid": uid,
                    "fencedlease.io/write-id": common::new_write_id()}
            },
            "data": {"reserved-by": by}
        }))
        .expect("configmap literal")
    };
    cms.create(&PostParams::default(), &fenced(&new, new_token))
        .await
        .unwrap_or_else(|e| {
            panic!("the new leader's write with token {new_token} was refused: {e}")
        });

    // The thawed pod writes with the token it held when it froze: the API server refuses it.
    let mut stale = cms.get("inventory").await.expect("reading the ConfigMap");
    let fresh = fenced(&old, old_token);
    stale.metadata.annotations = fresh.metadata.annotations;
    stale.data = fresh.data;
    match cms
        .replace("inventory", &PostParams::default(), &stale)
        .await
    {
        Ok(_) => panic!("the thawed leader's write with its old token {old_token} was accepted"),
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 403, "refusal: {s:?}");
            assert!(
                s.message.contains(&format!("stale token {old_token}")),
                "refusal: {}",
                s.message
            );
            println!("the thawed leader's write was refused: {}", s.message);
        }
        Err(e) => panic!("writing with the old token: {e}"),
    }
    let stored = cms.get("inventory").await.expect("reading the ConfigMap");
    assert_eq!(
        stored
            .data
            .unwrap_or_default()
            .get("reserved-by")
            .map(String::as_str),
        Some(new.as_str())
    );

    // Thawed, the old leader's sidecar sees it no longer leads: its token file goes, its pod
    // turns unready, and the lease stays with the new leader.
    eventually(
        Duration::from_secs(30),
        "the thawed pod's token file to go and the pod to turn unready",
        || async {
            let o = w.pods().get(&old).await.map_err(|e| e.to_string())?;
            let f = token_file(&socket, &o);
            if f.is_none() && !is_ready(&o) {
                Ok(())
            } else {
                Err(format!("token file {f:?}; {}", describe(&[o])))
            }
        },
    )
    .await;
    assert_eq!(
        holder(&w.leases(), LEASE).await.as_deref(),
        Some(new.as_str())
    );
    let thawed = w.pods().get(&old).await.expect("the thawed pod");
    let restarts: Vec<(String, i32)> = container_statuses(&thawed)
        .into_iter()
        .map(|c| (c.name, c.restart_count))
        .collect();
    println!(
        "the thawed pod's restarts {restarts:?}; its sidecar's last lines:\n{}",
        log_tail(&w.ns.name, &thawed, "fencedlease", 6)
    );
}
