//! Concurrent writers through the API server (issue 21, the webhook at concurrency): W threads,
//! each on its own keep-alive HTTPS/1.1 connection to the API server, each updating ConfigMaps
//! of its own in turn: `protected-I` (labelled, so the fencing webhook judges it; current
//! token: allowed after the webhook's fresh read of the lease), `plain-I` (the same update, not
//! labelled: no webhook) and `stale-I` (labelled, its lease moved on: refused, 403). Every
//! writer starts at once (a barrier); each does `--warmup` rounds, then `--writes` measured
//! rounds of the three, in a rotating order: back to back (closed loop, the most the API server
//! takes), or with `--rate R` paced so that all writers together send R writes per second (a
//! writer's round r starts at start + r x 3W/R, writers staggered evenly; a late round starts
//! at once), to see the webhook's cost below saturation. Driven by `bench/webhook_bench.py concurrent`;
//! without arguments (as in a plain `cargo bench`) it prints its usage and exits 0.
//!
//! Output (`--out F`): JSON with, per kind, every measured latency in nanoseconds and the count
//! of each status code, and the connection errors (a broken connection is reopened and the
//! write counted as an error, status 0).

#[path = "support/https1.rs"]
mod https1;

use std::collections::BTreeMap;
use std::sync::{Arc, Barrier};
use std::time::Instant;

use https1::{connect, Error};

const KINDS: [&str; 3] = ["protected", "plain", "stale"];

const USAGE: &str = "usage: apiserver_writers --server https://127.0.0.1:PORT --ca CA.pem \
--token-file F --namespace NS --writers W --writes N [--warmup N] --annotations JSON \
--stale-annotations JSON [--rate WRITES_PER_S] --out F.json";

struct Args {
    addr: String,
    ca: String,
    token: String,
    namespace: String,
    writers: usize,
    writes: usize,
    warmup: usize,
    annotations: serde_json::Value,
    stale_annotations: serde_json::Value,
    /// Writes per second of all writers together; 0: back to back.
    rate: f64,
    out: String,
}

fn parse_args() -> Result<Option<Args>, String> {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    if !raw.iter().any(|a| a == "--server") {
        return Ok(None);
    }
    let mut kv = BTreeMap::new();
    kv.insert("--warmup".to_string(), "10".to_string());
    kv.insert("--rate".to_string(), "0".to_string());
    let mut it = raw.into_iter().filter(|a| a != "--bench");
    while let Some(flag) = it.next() {
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        kv.insert(flag, v);
    }
    let mut take = |k: &str| kv.remove(k).ok_or(format!("{k} is required ({USAGE})"));
    let num = |k: &str, v: String| v.parse::<usize>().map_err(|e| format!("{k}: {e}"));
    let json = |k: &str, v: String| {
        serde_json::from_str::<serde_json::Value>(&v).map_err(|e| format!("{k}: {e}"))
    };
    let server = take("--server")?;
    let addr = server
        .strip_prefix("https://")
        .ok_or("--server must start with https://")?
        .trim_end_matches('/')
        .to_string();
    let token_file = take("--token-file")?;
    let token = std::fs::read_to_string(&token_file)
        .map_err(|e| format!("--token-file {token_file}: {e}"))?
        .trim()
        .to_string();
    let a = Args {
        addr,
        ca: take("--ca")?,
        token,
        namespace: take("--namespace")?,
        writers: num("--writers", take("--writers")?)?,
        writes: num("--writes", take("--writes")?)?,
        warmup: num("--warmup", take("--warmup")?)?,
        annotations: json("--annotations", take("--annotations")?)?,
        stale_annotations: json("--stale-annotations", take("--stale-annotations")?)?,
        rate: take("--rate")?
            .parse::<f64>()
            .map_err(|e| format!("--rate: {e}"))?,
        out: take("--out")?,
    };
    if let Some(k) = kv.keys().next() {
        return Err(format!("unknown flag {k} ({USAGE})"));
    }
    Ok(Some(a))
}

/// What one writer saw: per kind, latencies (ns) and status counts.
#[derive(Default)]
struct Seen {
    ns: [Vec<u64>; 3],
    status: [BTreeMap<u16, u64>; 3],
    /// The first answer other than the expected one (200; 403 for `stale`), to say why.
    unexpected: [Option<String>; 3],
}

/// The merge patch of round `round` of writer `w` to a ConfigMap of kind `kind`.
fn request(a: &Args, w: usize, round: usize, kind: usize) -> Vec<u8> {
    let mut ann = if kind == 2 {
        a.stale_annotations.clone()
    } else {
        a.annotations.clone()
    };
    let id = format!("{w}-{round}");
    ann["fencedlease.io/write-id"] = serde_json::Value::String(id.clone());
    let body = serde_json::json!({"metadata": {"annotations": ann}, "data": {"n": id}}).to_string();
    format!(
        "PATCH /api/v1/namespaces/{}/configmaps/{}-{w} HTTP/1.1\r\nHost: {}\r\n\
         Authorization: Bearer {}\r\nContent-Type: application/merge-patch+json\r\n\
         Accept: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        a.namespace,
        KINDS[kind],
        a.addr,
        a.token,
        body.len()
    )
    .into_bytes()
}

/// When writer `w`'s round `round` is due, counted from the start, when paced.
fn due(a: &Args, w: usize, round: usize) -> Option<std::time::Duration> {
    (a.rate > 0.0).then(|| {
        let interval = 3.0 * a.writers as f64 / a.rate;
        let offset = interval * w as f64 / a.writers as f64;
        std::time::Duration::from_secs_f64(offset + interval * round as f64)
    })
}

fn writer(a: &Args, w: usize, cfg: &Arc<rustls::ClientConfig>, start: &Barrier) -> Seen {
    let mut seen = Seen::default();
    let mut conn = connect(&a.addr, cfg).ok();
    start.wait();
    let began = Instant::now();
    for round in 0..a.warmup + a.writes {
        if let Some(at) = due(a, w, round) {
            std::thread::sleep(at.saturating_sub(began.elapsed()));
        }
        for k in 0..3 {
            let kind = (round + k) % 3;
            let req = request(a, w, round, kind);
            let t0 = Instant::now();
            let (status, body) = match conn.as_mut().map(|c| c.roundtrip(&req)) {
                Some(Ok(r)) => (r.status, String::from_utf8_lossy(&r.body).into_owned()),
                Some(Err(e)) => {
                    conn = connect(&a.addr, cfg).ok();
                    (0, format!("connection error: {e}"))
                }
                None => {
                    conn = connect(&a.addr, cfg).ok();
                    (0, "could not connect".to_string())
                }
            };
            let took = t0.elapsed().as_nanos() as u64;
            if round >= a.warmup {
                seen.ns[kind].push(took);
                *seen.status[kind].entry(status).or_default() += 1;
                let expected = if kind == 2 { 403 } else { 200 };
                if status != expected && seen.unexpected[kind].is_none() {
                    seen.unexpected[kind] = Some(body.chars().take(600).collect());
                }
            }
        }
    }
    seen
}

fn run(a: Args) -> Result<(), Error> {
    let cfg = https1::client_config(&std::fs::read(&a.ca)?)?;
    let a = Arc::new(a);
    let start = Arc::new(Barrier::new(a.writers));
    let began = Instant::now();
    let threads: Vec<_> = (0..a.writers)
        .map(|w| {
            let (a, cfg, start) = (a.clone(), cfg.clone(), start.clone());
            std::thread::spawn(move || writer(&a, w, &cfg, &start))
        })
        .collect();
    let mut all = Seen::default();
    for t in threads {
        let s = t.join().map_err(|_| "a writer thread panicked")?;
        for k in 0..3 {
            all.ns[k].extend(&s.ns[k]);
            for (code, n) in &s.status[k] {
                *all.status[k].entry(*code).or_default() += n;
            }
            if all.unexpected[k].is_none() {
                all.unexpected[k] = s.unexpected[k].clone();
            }
        }
    }
    let mut kinds = serde_json::Map::new();
    for (k, name) in KINDS.iter().enumerate() {
        let status: BTreeMap<String, u64> = all.status[k]
            .iter()
            .map(|(c, n)| (c.to_string(), *n))
            .collect();
        kinds.insert(
            name.to_string(),
            serde_json::json!({"ns": all.ns[k], "status": status,
                               "first_unexpected": all.unexpected[k],
                               "summary_us": https1::summary(all.ns[k].clone())}),
        );
    }
    let out = serde_json::json!({
        "writers": a.writers, "writes_each": a.writes, "warmup_rounds": a.warmup,
        "rate": (a.rate > 0.0).then_some(a.rate),
        "wall_s": began.elapsed().as_secs_f64(), "kinds": kinds,
    });
    std::fs::write(&a.out, out.to_string())?;
    Ok(())
}

fn main() -> std::process::ExitCode {
    match parse_args() {
        Ok(None) => {
            eprintln!("apiserver_writers: nothing to do without --server ({USAGE}); bench/webhook_bench.py concurrent drives it");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("apiserver_writers: {e}");
            std::process::ExitCode::from(2)
        }
        Ok(Some(a)) => match run(a) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("apiserver_writers: {e}");
                std::process::ExitCode::FAILURE
            }
        },
    }
}
