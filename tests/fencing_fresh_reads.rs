//! Fencing holes 1 and 2: an Allow never rests on a view of the lease that lags. The webhook's
//! own connection to the API server runs through a proxy that can freeze it (the watch goes
//! silent, as one that dies without an error does) or cut it (the webhook cannot reach the API
//! server while the API server still reaches the webhook).

use fencedlease_testkit as common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::eventually;
use common::fencing::{
    assert_refused, create, fenced_merge, move_lease, protected_meta, Held, Protected,
};
use fencedlease::api::{FencedLease, FencedLeaseSpec};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::PostParams;
use kube::Api;
use tokio::sync::watch;

/// A ceiling that only stops a hung test: the webhook's probe reads the API server every 2 s
/// (2 s timeout), and a failed read turns it unready at once.
const READINESS_CEILING: Duration = Duration::from_secs(60);

async fn setup(name: &str) -> Protected {
    Protected::new(name, true).await
}

/// Writes as `h` until the webhook answers with something other than 503 (the frozen pooled
/// connections time out first); returns that answer.
async fn write_past_frozen_connections(
    cms: &Api<ConfigMap>,
    h: &Held,
    by: &str,
) -> Result<ConfigMap, (u16, String)> {
    eventually(
        Duration::from_secs(30),
        "an answer that is not 503",
        || async {
            match fenced_merge(cms, "inv", h, serde_json::json!({"data": {"by": by}})).await {
                Err((503, _)) => None,
                other => Some(other),
            }
        },
    )
    .await
}

#[tokio::test]
async fn hole_1_a_lagging_lease_cache_never_lets_a_replaced_holders_token_through() {
    let s = setup("hole1-stale").await;
    s.proxy().freeze_open_connections();
    let b = move_lease(&s.client, &s.ns.name, "inv", "pod-b").await;
    // A's late write: its token is the one the frozen cache still shows as current.
    let late = write_past_frozen_connections(&s.cms, &s.a, "a").await;
    assert_refused(
        "A's write after the lease moved",
        late,
        403,
        &format!("stale token {}", s.a.token),
    );
    let m = s.webhook().metrics();
    let caught = common::metric_value(&m, "fencedlease_webhook_cache_lag_caught_total");
    assert!(
        caught >= 1.0,
        "the cache must really have lagged (it would have allowed A):\n{m}"
    );
    // B's write is allowed although the cache has not seen B: the fresh read has.
    write_past_frozen_connections(&s.cms, &b, "b")
        .await
        .expect("B writes with the current token");
}

#[tokio::test]
async fn hole_1_a_webhook_cut_off_from_the_api_server_refuses_and_turns_unready() {
    let s = setup("hole1-cut").await;
    assert_eq!(s.webhook().readyz(), 200);
    s.proxy().cut();
    // With no write to notice it, the probe turns the webhook unready.
    eventually(READINESS_CEILING, "the webhook to turn unready", || async {
        (s.webhook().readyz() == 503).then_some(())
    })
    .await;
    // Even the holder's current token is refused: nothing can be confirmed (fail closed).
    let b = move_lease(&s.client, &s.ns.name, "inv", "pod-b").await;
    for (who, h) in [("A", &s.a), ("B", &b)] {
        let r = fenced_merge(&s.cms, "inv", h, serde_json::json!({"data": {"by": who}})).await;
        assert_refused(who, r, 503, "could not read FencedLease");
    }
    s.proxy().restore();
    eventually(READINESS_CEILING, "the webhook to turn ready", || async {
        (s.webhook().readyz() == 200).then_some(())
    })
    .await;
    fenced_merge(&s.cms, "inv", &b, serde_json::json!({"data": {"by": "b"}}))
        .await
        .expect("B writes once the webhook can read again");
    let late = fenced_merge(
        &s.cms,
        "inv",
        &s.a,
        serde_json::json!({"data": {"by": "a"}}),
    )
    .await;
    assert_refused("A after the reconnect", late, 403, "stale token");
}

#[tokio::test]
async fn hole_2_a_recreated_lease_refuses_the_old_incarnations_token_while_the_cache_lags() {
    let s = setup("hole2").await;
    s.proxy().freeze_open_connections();
    let leases: Api<FencedLease> = Api::namespaced(s.client.clone(), &s.ns.name);
    common::delete_ignore_missing(&leases, "inv").await;
    eventually(Duration::from_secs(10), "the lease to be gone", || async {
        leases
            .get_opt("inv")
            .await
            .ok()
            .flatten()
            .is_none()
            .then_some(())
    })
    .await;
    let mut spec = FencedLeaseSpec::free();
    spec.holder_identity = Some("pod-c".into());
    let l = leases
        .create(&PostParams::default(), &FencedLease::new("inv", spec))
        .await
        .expect("re-create the lease");
    let c = Held {
        token: l.token().expect("generation"),
        uid: l.metadata.uid.clone().expect("uid"),
    };
    assert!(
        c.token <= s.a.token,
        "tokens restart with the new incarnation"
    );
    write_past_frozen_connections(&s.cms, &c, "c")
        .await
        .expect("C, the new incarnation's holder, writes");
    // A still presents the old incarnation's token, which the frozen cache shows as current.
    let late = write_past_frozen_connections(&s.cms, &s.a, "a").await;
    assert_refused(
        "A's old-incarnation token",
        late,
        403,
        "belongs to an earlier",
    );
    let stored = s.cms.get("inv").await.expect("read");
    assert_eq!(
        stored
            .data
            .unwrap_or_default()
            .get("by")
            .map(String::as_str),
        Some("c")
    );
}

/// The writers of the concurrent test, each with an object of its own: writers of one object
/// would mostly wait for each other.
const WRITERS: u64 = 16;

/// One writer of the concurrent test: writes object `w{i}` with the token in `tokens`, out of
/// step with the others, until `stop`, counting each write it finished in `done`; returns when
/// each write began, its token and outcome.
async fn writer(
    cms: Api<ConfigMap>,
    i: u64,
    tokens: watch::Receiver<Held>,
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
) -> Vec<(Instant, i64, Result<(), (u16, String)>)> {
    let mut seen = Vec::new();
    for n in 0u64.. {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        // Out of step, so that some writes begin while a read is in flight.
        tokio::time::sleep(Duration::from_millis((i * 37 + n * 53) % 120)).await;
        let h = tokens.borrow().clone();
        let began = Instant::now();
        let patch = serde_json::json!({"data": {"n": n.to_string()}});
        let r = fenced_merge(&cms, &format!("w{i}"), &h, patch).await;
        seen.push((began, h.token, r.map(|_| ())));
        done.fetch_add(1, Ordering::Relaxed);
    }
    seen
}

/// Waits until the writers have finished `more` writes past those finished now.
async fn more_writes(done: &Arc<AtomicU64>, more: u64) {
    let goal = done.load(Ordering::Relaxed) + more;
    eventually(Duration::from_secs(120), "the writers to write on", || {
        let done = done.clone();
        async move {
            let d = done.load(Ordering::Relaxed);
            (d >= goal)
                .then_some(())
                .ok_or(format!("{d} of {goal} writes"))
        }
    })
    .await
}

/// Concurrent writes share fresh reads (src/webhook/coalesce.rs), and sharing never decides a
/// write on a read older than the write. The watch is frozen, so the cache keeps showing A as
/// the holder and every write goes to a fresh read, and reads are slow (100 ms a chunk), so a
/// read is in flight when the lease moves. 16 writers keep writing with the holder's token,
/// and for 32 writes more with it after the lease moves on (four times): no write begun after
/// its token's holder was replaced is allowed (a write that joined a read sent before the move
/// would be).
#[tokio::test]
async fn concurrent_writes_share_reads_but_none_begun_after_the_lease_moved_is_allowed() {
    let s = setup("coalesce").await;
    for i in 0..WRITERS {
        let meta = protected_meta(&format!("w{i}"), "inv", &s.a);
        create(&s.cms, serde_json::json!({"metadata": meta, "data": {}}))
            .await
            .expect("create a protected ConfigMap");
    }
    s.proxy().slow_new_connections(Duration::from_millis(100));
    s.proxy().freeze_open_connections();
    write_past_frozen_connections(&s.cms, &s.a, "a")
        .await
        .expect("A writes with the current token");
    let (tokens, rx) = watch::channel(s.a.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let writers: Vec<_> = (0..WRITERS)
        .map(|i| {
            let w = writer(s.cms.clone(), i, rx.clone(), stop.clone(), done.clone());
            tokio::spawn(w)
        })
        .collect();
    let mut stale_since = HashMap::new();
    for holder in ["pod-b", "pod-c", "pod-d", "pod-e"] {
        // 32 writes with the holder's token, then the lease moves; then 32 more with the same
        // token before the writers learn of the new one: at most 16 were in flight at the move,
        // so at least 16 began after it.
        more_writes(&done, 2 * WRITERS).await;
        let old = tokens.borrow().token;
        let new = move_lease(&s.client, &s.ns.name, "inv", holder).await;
        stale_since.insert(old, Instant::now());
        more_writes(&done, 2 * WRITERS).await;
        tokens.send_replace(new);
    }
    stop.store(true, Ordering::Relaxed);
    let (mut allowed, mut stale_refused) = (0, 0);
    for w in writers {
        for (began, token, r) in w.await.expect("a writer") {
            let stale = stale_since.get(&token).is_some_and(|t| began > *t);
            match r {
                Ok(()) if stale => panic!(
                    "a write with token {token}, begun after its holder was replaced, was allowed"
                ),
                Ok(()) => allowed += 1,
                Err((403, m)) if stale && m.contains("stale token") => stale_refused += 1,
                Err(_) => {}
            }
        }
    }
    let m = s.webhook().metrics();
    let metric = |name: &str| common::metric_value(&m, name);
    let shared = metric("fencedlease_webhook_fresh_reads_shared_total");
    eprintln!(
        "{allowed} allowed, {stale_refused} refused as stale; {} fresh reads, {shared} writes on a shared read",
        metric("fencedlease_webhook_fresh_reads_total")
    );
    assert!(
        allowed > 0 && stale_refused > 0,
        "writes with current and with stale tokens"
    );
    assert!(
        metric("fencedlease_webhook_cache_lag_caught_total") >= 1.0,
        "the frozen cache would have allowed stale tokens:\n{m}"
    );
    assert!(shared >= 1.0, "16 writers on one lease share reads:\n{m}");
    let timed = ["lease", "namespace"].map(|o| {
        metric(&format!(
            "fencedlease_webhook_fresh_read_seconds_count{{object=\"{o}\"}}"
        ))
    });
    assert!(
        timed[0] >= 1.0 && timed[0] + timed[1] == metric("fencedlease_webhook_fresh_reads_total"),
        "every fresh read sent, of a lease or a namespace, is timed once:\n{m}"
    );
}
