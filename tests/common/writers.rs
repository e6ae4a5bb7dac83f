//! Writers that keep writing while something changes under them (an upgrade, a switch of the
//! fencing mode): a holder and a replaced holder, each sending a fenced write every few
//! milliseconds and recording every outcome, so that a test can assert that no stale write was
//! accepted at any moment and print how the holder fared.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::{Api, Client};
use serde_json::json;

use super::fencing::{fenced_merge, Held};

/// Creates lease `name` held by `holder` for the longest lease there is: the test's holders do
/// not renew, and the release's controller revokes a holder whose lease runs out (seen in CI,
/// where the upgrade took longer than the default lease).
pub async fn long_held_lease(client: &Client, ns: &str, name: &str, holder: &str) -> Held {
    let longest = fencedlease::api::MAX_LEASE_DURATION_SECONDS;
    super::fencing::held_lease_for(client, ns, name, holder, Some(longest)).await
}

/// What a writer saw: when it sent each write and whether it was accepted (else the refusal).
#[derive(Default)]
pub struct Outcomes {
    pub writes: Vec<(Duration, Result<(), String>)>,
}

impl Outcomes {
    pub fn accepted(&self) -> usize {
        self.writes.iter().filter(|(_, r)| r.is_ok()).count()
    }

    /// The stretches between the last accepted write and the next accepted one during which
    /// every write was refused: (start, length, refusals), start counted from the writers' start.
    pub fn refused_stretches(&self) -> Vec<(Duration, Duration, usize)> {
        let mut out = Vec::new();
        let mut last_ok: Option<Duration> = None;
        let mut refused = 0;
        for (at, r) in &self.writes {
            match r {
                Ok(()) => {
                    if let (Some(start), true) = (last_ok, refused > 0) {
                        out.push((start, *at - start, refused));
                    }
                    last_ok = Some(*at);
                    refused = 0;
                }
                Err(_) => refused += 1,
            }
        }
        out
    }
}

/// Sends a fenced merge patch of ConfigMap `name` under `held` every `every` until `stop`
/// turns true; records each outcome.
pub fn keep_writing(
    cms: Api<ConfigMap>,
    held: Held,
    every: Duration,
    started: Instant,
    stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<Outcomes> {
    tokio::spawn(async move {
        let mut outcomes = Outcomes::default();
        let mut tick = tokio::time::interval(every);
        let mut n = 0u64;
        while !*stop.borrow() {
            tick.tick().await;
            n += 1;
            let patch = json!({"data": {"writer": held.token.to_string(), "n": n.to_string()}});
            let r = fenced_merge(&cms, "copy", &held, patch).await;
            outcomes.writes.push((
                started.elapsed(),
                r.map(|_| ()).map_err(|(c, m)| format!("{c}: {m}")),
            ));
        }
        outcomes
    })
}

/// Prints the measurements (and writes them, with every write's outcome, to
/// $FL_UPGRADE_SAMPLES when set): how often and how long the holder's writes were refused.
pub fn report(holder: &Outcomes, stale: &Outcomes, marks: &[(String, Duration)]) {
    let stretches = holder.refused_stretches();
    let longest = stretches.iter().map(|s| s.1).max().unwrap_or_default();
    println!(
        "writers: holder {} writes, {} accepted; refused stretches {:?} (longest {:?}); stale {} writes, {} accepted; marks {:?}",
        holder.writes.len(),
        holder.accepted(),
        stretches,
        longest,
        stale.writes.len(),
        stale.accepted(),
        marks
    );
    if let Some(path) = std::env::var_os("FL_UPGRADE_SAMPLES") {
        let sample = |w: &(Duration, Result<(), String>)| json!({"at_ms": w.0.as_secs_f64() * 1e3, "error": w.1.as_ref().err()});
        let doc = json!({
            "marks": marks.iter().map(|(m, at)| json!({"mark": m, "at_ms": at.as_secs_f64() * 1e3})).collect::<Vec<_>>(),
            "holder": holder.writes.iter().map(sample).collect::<Vec<_>>(),
            "stale": stale.writes.iter().map(sample).collect::<Vec<_>>(),
        });
        std::fs::write(&path, serde_json::to_string_pretty(&doc).expect("json"))
            .expect("writing FL_UPGRADE_SAMPLES");
    }
}
