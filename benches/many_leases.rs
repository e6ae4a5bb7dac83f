//! Load generator of the many-leases benchmark (`bench/many_leases.py`, issue 21): campaigns for
//! N FencedLeases with C candidates each, as N×C fencedlease electors in one process (the
//! `fencedlease-elector` the sidecar and `fencedlease campaign` run). Each elector does what a
//! candidate of its own does: one watch of its lease, and the holder's renewals; they share one
//! client (its connections), as the client-go side shares one clientset.
//!
//! ```sh
//! many_leases --namespace NS --leases N [--candidates 2] [--prefix lease]
//! ```
//!
//! The FencedLeases `PREFIX-0` ... `PREFIX-(N-1)` must exist (the driver creates them, so that
//! creating them is not counted). Prints `started N×C` once every elector runs; on SIGTERM or
//! SIGINT every elector stops, releasing what it holds. Without `--namespace` (as in a plain
//! `cargo bench`) it prints its usage and exits 0.

use std::time::Duration;

use fencedlease::lease::elector::{Elector, ElectorConfig};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;
use tokio::task::JoinSet;

const USAGE: &str =
    "usage: many_leases --namespace NS --leases N [--candidates 2] [--prefix lease]";

struct Args {
    namespace: String,
    leases: usize,
    candidates: usize,
    prefix: String,
}

fn parse_args() -> Result<Option<Args>, String> {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    if !raw.iter().any(|a| a == "--namespace") {
        return Ok(None);
    }
    let mut a = Args {
        namespace: String::new(),
        leases: 0,
        candidates: 2,
        prefix: "lease".into(),
    };
    let mut it = raw.into_iter();
    while let Some(flag) = it.next() {
        if flag == "--bench" {
            continue; // cargo bench passes it
        }
        let value = it.next().ok_or(format!("{flag} needs a value; {USAGE}"))?;
        let number = |v: &str| v.parse::<usize>().map_err(|e| format!("{flag} {v}: {e}"));
        match flag.as_str() {
            "--namespace" => a.namespace = value,
            "--leases" => a.leases = number(&value)?,
            "--candidates" => a.candidates = number(&value)?,
            "--prefix" => a.prefix = value,
            _ => return Err(format!("unknown flag {flag}; {USAGE}")),
        }
    }
    if a.leases == 0 || a.candidates == 0 {
        return Err(format!(
            "--leases and --candidates must be at least 1; {USAGE}"
        ));
    }
    Ok(Some(a))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Some(args) = parse_args()? else {
        eprintln!("{USAGE}");
        return Ok(());
    };
    let client = kube::Client::try_default().await?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut electors = JoinSet::new();
    let mut handles = Vec::with_capacity(args.leases * args.candidates);
    let pid = std::process::id();
    for i in 0..args.leases {
        for c in 0..args.candidates {
            let lease = format!("{}-{i}", args.prefix);
            let cfg = ElectorConfig::new(args.namespace.clone(), lease, format!("c{c}-{pid}"));
            let (elector, handle) = Elector::new(client.clone(), cfg)?;
            handles.push(handle);
            let mut stop = stop_rx.clone();
            electors.spawn(elector.run(async move {
                let _ = stop.wait_for(|s| *s).await;
            }));
        }
    }
    println!("started {}×{}", args.leases, args.candidates);
    let mut term = signal(SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    let _ = stop_tx.send(true);
    let mut failed = 0;
    let drain = async {
        while let Some(r) = electors.join_next().await {
            if !matches!(r, Ok(Ok(()))) {
                failed += 1;
            }
        }
    };
    if tokio::time::timeout(Duration::from_secs(30), drain)
        .await
        .is_err()
    {
        eprintln!("not every elector stopped within 30 s");
    }
    println!("stopped; {failed} electors ended with an error");
    drop(handles);
    Ok(())
}
