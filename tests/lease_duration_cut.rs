//! Shortening `spec.leaseDurationSeconds` while the lease is held, against the real API server.
//! A holder cut off from the API server never sees the edit and keeps acting on the duration
//! it renewed under, so neither a candidate nor the controller may take over before that long
//! has passed since its last renewal; and both do take over after it.

use fencedlease_testkit as common;

use std::time::Duration;

use common::procs::{assert_no_overlap, campaign, claims, controller, now_ns, scratch_dir, Proc};
use common::{client, ensure_crd, eventually, k8s_events, TestNamespace};
use fencedlease::api::FencedLease;
use kube::api::{Patch, PatchParams};
use kube::Api;
use nix::sys::signal::Signal;

/// The duration the holder acquires and renews under.
const LEASE_S: i32 = 10;
/// What the spec is cut to while the holder is frozen.
const CUT_S: i32 = 2;
/// How long after the holder's last renewal the cut comes.
const CUT_AFTER: Duration = Duration::from_secs(1);
const NS_PER_S: i128 = 1_000_000_000;

/// Waits until `holder` leads and has renewed, freezes it right after a renewal, and cuts the
/// spec's duration a moment later. Returns the wall-clock time (ns) of its last renewal as
/// the lease records it (`status.renewTime`, read before the renewal was sent) and of the cut.
async fn freeze_after_a_renewal_then_cut(api: &Api<FencedLease>, holder: &Proc) -> (i128, i128) {
    let led = eventually(Duration::from_secs(30), "the holder to lead", || async {
        holder.events().into_iter().find(|e| e.event == "leading")
    })
    .await;
    eventually(
        Duration::from_secs(2 * LEASE_S as u64),
        "a renewal",
        || async {
            holder
                .events()
                .into_iter()
                .find(|e| e.event == "renewed" && e.t_ns > led.t_ns + 2 * NS_PER_S)
        },
    )
    .await;
    holder.signal(Signal::SIGSTOP);
    tokio::time::sleep(CUT_AFTER).await;
    let lease = api.get("db").await.expect("get the lease");
    let status = lease.status.expect("a renewed lease has a status");
    assert_eq!(
        status.lease_duration_seconds,
        Some(LEASE_S),
        "the holder records the duration it renewed under"
    );
    let renewed_ns = status.renew_time.expect("renewTime").0.as_nanosecond();
    let cut_ns = now_ns();
    api.patch(
        "db",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"spec": {"leaseDurationSeconds": CUT_S}})),
    )
    .await
    .expect("cut the lease duration");
    (renewed_ns, cut_ns)
}

fn secs(ns: i128) -> f64 {
    ns as f64 / 1e9
}

#[tokio::test]
async fn a_candidate_waits_out_the_duration_a_frozen_holder_renewed_under() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "cut-candidate").await;
    let dir = scratch_dir("cut-candidate");
    let api: Api<FencedLease> = Api::namespaced(client.clone(), &ns.name);
    let a = campaign(&dir, &ns.name, "db", "a", LEASE_S as u32);
    eventually(Duration::from_secs(30), "a to lead", || async {
        a.events().into_iter().find(|e| e.event == "leading")
    })
    .await;
    let b = campaign(&dir, &ns.name, "db", "b", LEASE_S as u32);
    let (renewed_ns, cut_ns) = freeze_after_a_renewal_then_cut(&api, &a).await;
    let took_over = eventually(
        Duration::from_secs(LEASE_S as u64 + 10),
        "b to take over",
        || async { b.events().into_iter().find(|e| e.event == "leading") },
    )
    .await;
    let after_renewal = took_over.t_ns - renewed_ns;
    eprintln!(
        "b took over {:.2} s after a's last renewal, {:.2} s after the cut",
        secs(after_renewal),
        secs(took_over.t_ns - cut_ns)
    );
    assert!(
        after_renewal >= i128::from(LEASE_S) * NS_PER_S,
        "b took over {:.2} s after the frozen holder's last renewal, before the {LEASE_S} s it \
         renewed under had passed\nb:\n{}",
        secs(after_renewal),
        b.log_tail()
    );
    let now = now_ns();
    let all: Vec<_> = [&a, &b]
        .iter()
        .flat_map(|p| claims(&p.events(), now))
        .collect();
    assert_no_overlap(&all);
}

#[tokio::test]
async fn the_controller_revokes_only_after_the_duration_a_frozen_holder_renewed_under() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "cut-controller").await;
    let dir = scratch_dir("cut-controller");
    let api: Api<FencedLease> = Api::namespaced(client.clone(), &ns.name);
    let ctl = controller(&dir, &ns.name, "controller-0");
    let a = campaign(&dir, &ns.name, "db", "a", LEASE_S as u32);
    let (renewed_ns, cut_ns) = freeze_after_a_renewal_then_cut(&api, &a).await;
    let frozen = api.get("db").await.expect("get the lease");
    assert_eq!(frozen.holder(), Some("a"));
    let revoked = eventually(
        Duration::from_secs(4 * LEASE_S as u64),
        "the controller to revoke",
        || async { api.get("db").await.ok().filter(|l| l.holder().is_none()) },
    )
    .await;
    // When it revoked, by its Event: not before the duration the holder renewed under had
    // passed since that renewal (both clocks are this machine's).
    let event = eventually(Duration::from_secs(30), "the Revoked Event", || async {
        k8s_events(&client, &ns.name)
            .await
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("Revoked"))
    })
    .await;
    let revoked_ns = event
        .event_time
        .as_ref()
        .expect("eventTime")
        .0
        .as_nanosecond();
    let bound_ns = renewed_ns + i128::from(LEASE_S) * NS_PER_S;
    eprintln!(
        "revoked {:.2} s after the last renewal, {:.2} s after the cut",
        secs(revoked_ns - renewed_ns),
        secs(revoked_ns - cut_ns)
    );
    assert!(
        revoked_ns >= bound_ns,
        "revoked {:.2} s after the frozen holder's last renewal, before the {LEASE_S} s it renewed \
         under had passed\ncontroller:\n{}",
        secs(revoked_ns - renewed_ns),
        ctl.log_tail()
    );
    assert!(revoked.token() > frozen.token());
}
