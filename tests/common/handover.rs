//! Handovers of a lease as the node tests measure them: [`LeaseLog`] records each change of the
//! lease's holder or token with the time it arrived, [`Handover`] reads from it how leadership
//! moved away from the old leader (did it release, how long was the lease without a holder).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fencedlease::api::FencedLease;
use futures::StreamExt;
use kube::runtime::watcher;
use kube::Api;

use super::eventually;

#[derive(Clone, Debug)]
pub struct Seen {
    pub at: Instant,
    pub holder: Option<String>,
    pub token: i64,
}

/// Watches the FencedLease and records each change of holder or token, stamped with the time
/// this process received it. Runs on the test runtime's other worker thread, so the test's own
/// blocking calls do not delay the stamps.
pub struct LeaseLog {
    seen: Arc<Mutex<Vec<Seen>>>,
    task: tokio::task::JoinHandle<()>,
}

impl LeaseLog {
    pub async fn start(api: Api<FencedLease>, name: &str) -> LeaseLog {
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let rec = seen.clone();
        let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let task = tokio::spawn(async move {
            let mut stream = watcher(api, config).boxed();
            while let Some(ev) = stream.next().await {
                let lease = match ev {
                    Ok(watcher::Event::Apply(l) | watcher::Event::InitApply(l)) => l,
                    _ => continue,
                };
                let s = Seen {
                    at: Instant::now(),
                    holder: lease.holder().map(str::to_string),
                    token: lease.token().unwrap_or(0),
                };
                let mut v = rec.lock().expect("lease log");
                if v.last()
                    .is_none_or(|l| l.holder != s.holder || l.token != s.token)
                {
                    v.push(s);
                }
            }
        });
        let log = LeaseLog { seen, task };
        // The initial list is in before the test goes on.
        eventually(
            Duration::from_secs(10),
            "the lease watch's first event",
            || async { (!log.seen.lock().expect("lease log").is_empty()).then_some(()) },
        )
        .await;
        log
    }

    pub fn entries(&self) -> Vec<Seen> {
        self.seen.lock().expect("lease log").clone()
    }

    /// The [`Handover`] away from `old` since `from`, until this log has seen `new` hold the
    /// lease with `token` (the test saw it lead; the watch may deliver it a moment later).
    pub async fn handover(&self, old: &str, new: &str, token: i64, from: Instant) -> Handover {
        let what = format!("the lease log to see {new} hold the lease with token {token}");
        let until = eventually(Duration::from_secs(30), &what, || async {
            self.entries()
                .into_iter()
                .find(|s| s.holder.as_deref() == Some(new) && s.token == token)
                .map(|s| s.at)
        })
        .await;
        handover(&self.entries(), old, from, until)
    }
}

impl Drop for LeaseLog {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// How leadership moved away from `old` after `from`: whether `old` released (the first change
/// after it held the lease left the lease free) and the longest and total time with no holder
/// until `until`.
#[derive(Debug)]
pub struct Handover {
    pub released: bool,
    pub longest_gap: Duration,
    pub total_gap: Duration,
    pub history: String,
}

impl Handover {
    /// What a graceful handover must show: `old` released the lease (the first change after
    /// it held it left the lease free), so nobody waited for it to run out; else what went
    /// wrong. How long the lease stayed free is the benchmarks' to measure.
    pub fn released(&self, round: usize, old: &str) -> Result<(), String> {
        if self.released {
            Ok(())
        } else {
            Err(format!(
                "round {round}: {old} did not release the lease on SIGTERM: {}",
                self.history
            ))
        }
    }
}

pub fn handover(entries: &[Seen], old: &str, from: Instant, until: Instant) -> Handover {
    // The state at `from` is the last entry before it.
    let start = entries.iter().rposition(|s| s.at <= from).unwrap_or(0);
    let window = &entries[start..];
    let released = window
        .iter()
        .find(|s| s.holder.as_deref() != Some(old))
        .is_some_and(|s| s.holder.is_none());
    let (mut longest, mut total) = (Duration::ZERO, Duration::ZERO);
    for (i, s) in window.iter().enumerate() {
        if s.holder.is_some() || s.at > until {
            continue;
        }
        let begin = s.at.max(from);
        let end = window.get(i + 1).map_or(until, |n| n.at.min(until));
        let gap = end.saturating_duration_since(begin);
        longest = longest.max(gap);
        total += gap;
    }
    let history = window
        .iter()
        .map(|s| {
            format!(
                "+{:.3}s {} (token {})",
                s.at.saturating_duration_since(from).as_secs_f64(),
                s.holder.as_deref().unwrap_or("<free>"),
                s.token
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    Handover {
        released,
        longest_gap: longest,
        total_gap: total,
        history,
    }
}

pub fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

pub fn summary(label: &str, gaps: &[Duration]) -> String {
    let mut s = gaps.to_vec();
    s.sort();
    format!(
        "{label}: {} samples, longest gap without a holder: min {}, median {}, max {} (target from the Benchmarks issue: graceful handover p50 < 100 ms)",
        s.len(),
        ms(s[0]),
        ms(s[s.len() / 2]),
        ms(s[s.len() - 1])
    )
}
