//! Read coalescing for the webhook's fresh reads (group commit, as in Raft's ReadIndex
//! batching): concurrent requests that need a fresh read of the same key share one read.
//!
//! **The rule: a request is only ever answered from a read that was sent after the request
//! arrived.** That is what makes sharing safe: the webhook's freshness guarantee is that every
//! Allow rests on a lease state read after the write's admission request arrived, and a read
//! sent after a request arrived is exactly as fresh, for that request, as one the request
//! would have sent itself. A read already in flight when a request arrives was sent before
//! it, so the request never joins it; it joins the key's *next* batch instead.
//!
//! Per key, at most one read is in flight:
//! - no read in flight: one is sent at once, for this request alone;
//! - a read in flight: the request joins the next batch. When the read in flight ends (value or
//!   error), the next batch, if it has members, is closed (taken out whole, under the lock) and
//!   one new read is sent for it. Its members all arrived before it was closed, so before the
//!   read was sent.
//!
//! Every member of a batch gets its read's outcome: the value, or the same error text. A key's
//! entry exists only while a read for it is in flight, and is removed when that read ends with
//! no one waiting. Every read is bounded by `read_timeout`, a member's whole wait by `max_wait`
//! (after which it gets an error: the caller fails closed). The reads run in tasks of their
//! own, so a member whose caller hung up (its future dropped) breaks nothing for the others.

use std::collections::hash_map::{Entry, HashMap};
use std::future::Future;
use std::hash::Hash;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt as _;
use prometheus_client::metrics::counter::Counter;
use tokio::sync::oneshot;

/// A read's outcome: the value, or what went wrong, as text.
pub(super) type Outcome<V> = Result<V, String>;

type ReadFn<K, V> = dyn Fn(K) -> BoxFuture<'static, Outcome<V>> + Send + Sync;

/// The members of one batch: each waits for the batch's read.
type Batch<V> = Vec<oneshot::Sender<Outcome<V>>>;

/// How long a read, and a member's whole wait, may take.
#[derive(Clone, Copy, Debug)]
pub(super) struct Bounds {
    /// A read that takes longer ends with an error (a backstop: the read function should
    /// bound itself first).
    pub read_timeout: Duration,
    /// A member that waits longer, from its arrival, gets an error. A member waits at most for
    /// the read in flight when it arrived and then for its own: twice a read's bound.
    pub max_wait: Duration,
}

/// Whether concurrent requests for one key share reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Sharing {
    /// Requests that arrive while a read of their key is in flight share the key's next read
    /// (the module documentation's rule; what the webhook does).
    Coalesce,
    /// Every request sends a read of its own, at once: what the webhook would do without
    /// coalescing, kept so that a benchmark can measure both in the same conditions.
    PerRequest,
}

/// The counters a coalescer increments.
#[derive(Clone, Debug, Default)]
pub(super) struct Counters {
    /// Reads actually sent.
    pub reads: Counter,
    /// Requests answered by a read that answered other requests too.
    pub shared: Counter,
}

/// Coalesces concurrent reads of the same key (see the module documentation for the rule).
pub(super) struct Coalescer<K, V> {
    inner: Arc<Inner<K, V>>,
}

struct Inner<K, V> {
    read: Box<ReadFn<K, V>>,
    /// The keys with a read in flight, each with its next batch (the requests that arrived
    /// after that read was sent). Never held across an await.
    keys: Mutex<HashMap<K, Batch<V>>>,
    bounds: Bounds,
    counters: Counters,
    sharing: Sharing,
}

impl<K, V> Coalescer<K, V>
where
    K: Eq + Hash + Clone + Send + Sync + 'static,
    V: Clone + Send + 'static,
{
    /// A coalescer that reads a key with `read`, sharing reads as `sharing` says.
    pub(super) fn new<F, Fut>(
        read: F,
        bounds: Bounds,
        counters: Counters,
        sharing: Sharing,
    ) -> Coalescer<K, V>
    where
        F: Fn(K) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Outcome<V>> + Send + 'static,
    {
        Coalescer {
            inner: Arc::new(Inner {
                read: Box::new(move |k| read(k).boxed()),
                keys: Mutex::new(HashMap::new()),
                bounds,
                counters,
                sharing,
            }),
        }
    }

    /// The outcome of a read of `key` sent after this call began. Must be called within a
    /// Tokio runtime (the reads run in tasks of their own).
    pub(super) async fn read(&self, key: K) -> Outcome<V> {
        if self.inner.sharing == Sharing::PerRequest {
            self.inner.counters.reads.inc();
            return self.inner.read_once(key).await;
        }
        let (tx, rx) = oneshot::channel();
        if let Some(batch) = self.inner.join(&key, tx) {
            tokio::spawn(Arc::clone(&self.inner).drive(key, batch));
        }
        match tokio::time::timeout(self.inner.bounds.max_wait, rx).await {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(_)) => Err("the read was abandoned".to_string()),
            Err(_) => Err(format!(
                "no answer within {:?} (reads of this object are slow)",
                self.inner.bounds.max_wait
            )),
        }
    }

    /// The number of keys with a read in flight.
    #[cfg(test)]
    fn keys_in_flight(&self) -> usize {
        self.inner.lock().len()
    }
}

impl<K, V> Inner<K, V>
where
    K: Eq + Hash + Clone + Send + Sync + 'static,
    V: Clone + Send + 'static,
{
    fn lock(&self) -> MutexGuard<'_, HashMap<K, Batch<V>>> {
        // Nothing panics while the lock is held; should it, the map is still consistent.
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds a request to `key`'s next batch when a read is in flight (it was sent before this
    /// request arrived, so the request must not join it); otherwise marks a read in flight and
    /// returns the batch of one that the caller must send it for.
    fn join(&self, key: &K, tx: oneshot::Sender<Outcome<V>>) -> Option<Batch<V>> {
        match self.lock().entry(key.clone()) {
            Entry::Occupied(mut next) => {
                let next = next.get_mut();
                // Before the vector grows, drop the members whose callers hung up: the batch
                // stays bounded by the live requests.
                if next.len() == next.capacity() {
                    next.retain(|m| !m.is_closed());
                }
                next.push(tx);
                None
            }
            Entry::Vacant(slot) => {
                slot.insert(Vec::new());
                Some(vec![tx])
            }
        }
    }

    /// Sends one read per batch, for as long as batches form while a read is in flight.
    async fn drive(self: Arc<Self>, key: K, mut batch: Batch<V>) {
        loop {
            // Every member of `batch` arrived before it was closed, and so before this read.
            self.counters.reads.inc();
            let outcome = self.read_once(key.clone()).await;
            self.deliver(batch, &outcome);
            match self.close_next(&key) {
                Some(next) => batch = next,
                None => return,
            }
        }
    }

    /// One read, bounded, with a panic in the read function turned into an error.
    async fn read_once(&self, key: K) -> Outcome<V> {
        let read = AssertUnwindSafe((self.read)(key)).catch_unwind();
        match tokio::time::timeout(self.bounds.read_timeout, read).await {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(_)) => Err("the read failed unexpectedly".to_string()),
            Err(_) => Err(format!("no answer within {:?}", self.bounds.read_timeout)),
        }
    }

    /// Gives every member still waiting the outcome; members whose callers hung up are skipped.
    fn deliver(&self, batch: Batch<V>, outcome: &Outcome<V>) {
        let shared = batch.iter().filter(|m| !m.is_closed()).count() > 1;
        for member in batch {
            if member.send(outcome.clone()).is_ok() && shared {
                self.counters.shared.inc();
            }
        }
    }

    /// After a read of `key` ended: closes its next batch and returns it (a read must be sent
    /// for it; the key stays in flight), or, when no one waits, removes the key's entry.
    fn close_next(&self, key: &K) -> Option<Batch<V>> {
        let mut keys = self.lock();
        let next = keys.get_mut(key)?;
        next.retain(|m| !m.is_closed());
        if next.is_empty() {
            keys.remove(key);
            None
        } else {
            Some(std::mem::take(next))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use tokio::sync::mpsc;
    use tokio::task::JoinHandle;

    /// A fake read waiting for the test to complete it.
    struct Pending {
        key: u8,
        /// When it was sent, on the test's clock.
        sent_at: u64,
        done: oneshot::Sender<Outcome<u64>>,
    }

    impl Pending {
        /// Completes the read: its value is when it was sent.
        fn succeed(self) {
            let _ = self.done.send(Ok(self.sent_at));
        }
        fn fail(self) {
            let _ = self
                .done
                .send(Err(format!("read sent at {} failed", self.sent_at)));
        }
    }

    /// A coalescer over fake reads, a logical clock that stamps arrivals and sends, and the
    /// reads sent and not yet completed.
    struct Harness {
        c: Arc<Coalescer<u8, u64>>,
        clock: Arc<AtomicU64>,
        sent: mpsc::UnboundedReceiver<Pending>,
        counters: Counters,
    }

    const LONG: Bounds = Bounds {
        read_timeout: Duration::from_secs(60),
        max_wait: Duration::from_secs(120),
    };

    fn harness(bounds: Bounds) -> Harness {
        harness_sharing(bounds, Sharing::Coalesce)
    }

    fn harness_sharing(bounds: Bounds, sharing: Sharing) -> Harness {
        let clock = Arc::new(AtomicU64::new(0));
        let (tx, sent) = mpsc::unbounded_channel();
        let read_clock = clock.clone();
        let read = move |key: u8| {
            let sent_at = read_clock.fetch_add(1, Ordering::SeqCst);
            let (done, rx) = oneshot::channel();
            let _ = tx.send(Pending { key, sent_at, done });
            async move { rx.await.unwrap_or_else(|_| Err("fake read dropped".into())) }
        };
        let counters = Counters::default();
        let c = Arc::new(Coalescer::new(read, bounds, counters.clone(), sharing));
        Harness {
            c,
            clock,
            sent,
            counters,
        }
    }

    /// A request's arrival time and outcome.
    type Answer = (u64, Outcome<u64>);

    impl Harness {
        /// A request for `key`, stamped on arrival (in the same poll as it joins).
        fn arrive(&self, key: u8) -> JoinHandle<Answer> {
            let (c, clock) = (self.c.clone(), self.clock.clone());
            tokio::spawn(async move {
                let arrived = clock.fetch_add(1, Ordering::SeqCst);
                (arrived, c.read(key).await)
            })
        }

        /// The reads sent so far and not yet taken.
        fn take_sent(&mut self) -> Vec<Pending> {
            let mut v = Vec::new();
            while let Ok(p) = self.sent.try_recv() {
                v.push(p);
            }
            v
        }
    }

    /// Lets every ready task run (the tests use a current-thread runtime).
    async fn settle() {
        for _ in 0..64 {
            tokio::task::yield_now().await;
        }
    }

    /// The time the read that produced `outcome` was sent.
    fn sent_at(outcome: &Outcome<u64>) -> Option<u64> {
        match outcome {
            Ok(t) => Some(*t),
            Err(e) => e
                .strip_prefix("read sent at ")?
                .split(' ')
                .next()?
                .parse()
                .ok(),
        }
    }

    async fn answered_after_arrival(h: JoinHandle<Answer>) -> Outcome<u64> {
        let (arrived, outcome) = h.await.expect("request task");
        let sent = sent_at(&outcome).expect("answered by a read");
        assert!(
            sent > arrived,
            "answered by a read sent at {sent}, before its arrival at {arrived}"
        );
        outcome
    }

    #[tokio::test]
    async fn sequential_requests_read_once_each() {
        let mut h = harness(LONG);
        for _ in 0..3 {
            let r = h.arrive(1);
            settle().await;
            let sent = h.take_sent();
            assert_eq!(sent.len(), 1);
            sent.into_iter().for_each(Pending::succeed);
            assert!(answered_after_arrival(r).await.is_ok());
            settle().await;
            assert_eq!(h.c.keys_in_flight(), 0);
        }
        assert_eq!(h.counters.reads.get(), 3);
        assert_eq!(h.counters.shared.get(), 0);
    }

    #[tokio::test]
    async fn per_request_reads_are_never_shared() {
        let mut h = harness_sharing(LONG, Sharing::PerRequest);
        let requests: Vec<_> = (0..5).map(|_| h.arrive(1)).collect();
        settle().await;
        let sent = h.take_sent();
        assert_eq!(sent.len(), 5, "one read per request, all at once");
        sent.into_iter().for_each(Pending::succeed);
        let mut answers = Vec::new();
        for r in requests {
            answers.push(answered_after_arrival(r).await);
        }
        answers.sort();
        answers.dedup();
        assert_eq!(answers.len(), 5, "each answered by its own read");
        assert_eq!(h.counters.reads.get(), 5);
        assert_eq!(h.counters.shared.get(), 0);
        assert_eq!(h.c.keys_in_flight(), 0);
    }

    #[tokio::test]
    async fn requests_during_a_read_share_exactly_one_more() {
        let mut h = harness(LONG);
        let first = h.arrive(1);
        settle().await;
        let mut sent = h.take_sent();
        assert_eq!(sent.len(), 1);
        let waiting: Vec<_> = (0..10).map(|_| h.arrive(1)).collect();
        settle().await;
        assert!(h.take_sent().is_empty(), "no read while one is in flight");
        sent.remove(0).succeed();
        assert!(answered_after_arrival(first).await.is_ok());
        settle().await;
        let mut second = h.take_sent();
        assert_eq!(second.len(), 1, "one read for the whole batch");
        assert!(
            waiting.iter().all(|w| !w.is_finished()),
            "not answered by the first read"
        );
        let second_at = second[0].sent_at;
        second.remove(0).succeed();
        for w in waiting {
            assert_eq!(answered_after_arrival(w).await, Ok(second_at));
        }
        settle().await;
        assert_eq!(h.counters.reads.get(), 2);
        assert_eq!(h.counters.shared.get(), 10);
        assert_eq!(h.c.keys_in_flight(), 0);
    }

    #[tokio::test]
    async fn keys_are_read_independently() {
        let mut h = harness(LONG);
        let a = h.arrive(1);
        let b = h.arrive(2);
        settle().await;
        let sent = h.take_sent();
        let mut keys: Vec<u8> = sent.iter().map(|p| p.key).collect();
        keys.sort_unstable();
        assert_eq!(keys, vec![1, 2]);
        sent.into_iter().for_each(Pending::succeed);
        assert!(answered_after_arrival(a).await.is_ok());
        assert!(answered_after_arrival(b).await.is_ok());
    }

    #[tokio::test]
    async fn an_error_is_shared_by_the_whole_batch() {
        let mut h = harness(LONG);
        let first = h.arrive(1);
        settle().await;
        let mut sent = h.take_sent();
        let waiting: Vec<_> = (0..3).map(|_| h.arrive(1)).collect();
        settle().await;
        sent.remove(0).fail();
        assert!(answered_after_arrival(first).await.is_err());
        settle().await;
        let mut second = h.take_sent();
        let expected = format!("read sent at {} failed", second[0].sent_at);
        second.remove(0).fail();
        for w in waiting {
            assert_eq!(answered_after_arrival(w).await, Err(expected.clone()));
        }
        settle().await;
        assert_eq!(h.c.keys_in_flight(), 0);
    }

    #[tokio::test]
    async fn dropped_waiters_break_nothing_and_leak_nothing() {
        let mut h = harness(LONG);
        // The request that sent the read hangs up: the read goes on for the next batch.
        let first = h.arrive(1);
        settle().await;
        let mut sent = h.take_sent();
        let gone = h.arrive(1);
        let stays = h.arrive(1);
        settle().await;
        first.abort();
        gone.abort();
        settle().await;
        sent.remove(0).succeed();
        settle().await;
        let mut second = h.take_sent();
        assert_eq!(second.len(), 1);
        let second_at = second[0].sent_at;
        second.remove(0).succeed();
        assert_eq!(answered_after_arrival(stays).await, Ok(second_at));
        assert_eq!(h.counters.shared.get(), 0, "the batch was one live request");
        // A next batch whose members all hung up sends no read, and the key is let go.
        let third = h.arrive(1);
        settle().await;
        let mut sent = h.take_sent();
        let gone: Vec<_> = (0..5).map(|_| h.arrive(1)).collect();
        settle().await;
        gone.iter().for_each(JoinHandle::abort);
        settle().await;
        sent.remove(0).succeed();
        assert!(answered_after_arrival(third).await.is_ok());
        settle().await;
        assert!(h.take_sent().is_empty());
        assert_eq!(h.c.keys_in_flight(), 0);
        assert_eq!(h.counters.reads.get(), 3);
    }

    #[tokio::test]
    async fn reads_and_waits_are_bounded() {
        let mut h = harness(Bounds {
            read_timeout: Duration::from_millis(50),
            max_wait: Duration::from_millis(80),
        });
        let first = h.arrive(1);
        settle().await;
        let _never = h.take_sent();
        let (_, outcome) = first.await.expect("request task");
        let e = outcome.expect_err("a read that never answers");
        assert!(e.contains("no answer within 50ms"), "{e}");
        settle().await;
        assert_eq!(h.c.keys_in_flight(), 0);
        // A member's wait is bounded even when its read is not.
        let mut h = harness(Bounds {
            read_timeout: Duration::from_secs(60),
            max_wait: Duration::from_millis(50),
        });
        let r = h.arrive(1);
        let (_, outcome) = r.await.expect("request task");
        assert!(outcome
            .expect_err("waited too long")
            .contains("no answer within 50ms"));
        // Its read, when it ends, finds no one waiting and lets the key go.
        h.take_sent().into_iter().for_each(Pending::succeed);
        settle().await;
        assert_eq!(h.c.keys_in_flight(), 0);
    }

    #[tokio::test]
    async fn a_panicking_read_is_an_error_and_frees_the_key() {
        let c = Coalescer::new(
            |k: u8| async move {
                if k == 1 {
                    panic!("read panicked");
                }
                Ok(k)
            },
            LONG,
            Counters::default(),
            Sharing::Coalesce,
        );
        assert!(c.read(1).await.is_err());
        assert_eq!(c.keys_in_flight(), 0);
        assert_eq!(c.read(2).await, Ok(2));
    }

    #[derive(Clone, Debug)]
    enum Op {
        Arrive(u8),
        /// Completes one of the reads in flight (succeeding or failing).
        Complete(usize, bool),
        /// The caller of one of the requests hangs up.
        HangUp(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0u8..3).prop_map(Op::Arrive),
            3 => (any::<usize>(), any::<bool>()).prop_map(|(i, ok)| Op::Complete(i, ok)),
            1 => any::<usize>().prop_map(Op::HangUp),
        ]
    }

    /// Runs a schedule, then completes every read left; returns the live requests' answers.
    async fn run(ops: Vec<Op>) -> (Harness, Vec<Answer>) {
        let mut h = harness(LONG);
        let (mut requests, mut in_flight) = (Vec::new(), Vec::new());
        for op in ops {
            match op {
                Op::Arrive(key) => requests.push(Some(h.arrive(key))),
                Op::Complete(i, ok) if !in_flight.is_empty() => {
                    let p: Pending = in_flight.remove(i % in_flight.len());
                    if ok {
                        p.succeed()
                    } else {
                        p.fail()
                    }
                }
                Op::HangUp(i) if !requests.is_empty() => {
                    let n = requests.len();
                    if let Some(r) = requests[i % n].take() {
                        r.abort();
                    }
                }
                _ => {}
            }
            settle().await;
            in_flight.extend(h.take_sent());
            let mut keys: Vec<u8> = in_flight.iter().map(|p| p.key).collect();
            keys.sort_unstable();
            let n = keys.len();
            keys.dedup();
            assert_eq!(keys.len(), n, "at most one read in flight per key");
        }
        while !in_flight.is_empty() {
            in_flight.drain(..).for_each(Pending::succeed);
            settle().await;
            in_flight.extend(h.take_sent());
        }
        let mut answers = Vec::new();
        for r in requests.into_iter().flatten() {
            assert!(r.is_finished(), "every live request is answered");
            answers.push(r.await.expect("request task"));
        }
        (h, answers)
    }

    proptest! {
        /// The safety rule, over random schedules: the read that answered a request was sent
        /// after the request arrived. And no key is left behind.
        #[test]
        fn a_request_is_only_answered_by_a_read_sent_after_it_arrived(
            ops in proptest::collection::vec(op(), 1..60)
        ) {
            let rt = tokio::runtime::Builder::new_current_thread().enable_time().build()?;
            let (h, answers) = rt.block_on(run(ops));
            for (arrived, outcome) in &answers {
                let sent = sent_at(outcome);
                prop_assert!(
                    sent.is_some_and(|s| s > *arrived),
                    "a request that arrived at {} was answered by {:?}", arrived, outcome
                );
            }
            prop_assert_eq!(h.c.keys_in_flight(), 0);
            prop_assert!(h.counters.reads.get() <= h.clock.load(Ordering::SeqCst));
        }
    }
}
