//! A small HTTPS load generator for the webhook server alone (issue 9, item 5): POSTs one
//! AdmissionReview body to `/validate` over keep-alive HTTP/1.1 connections and records the
//! latency of every request. Driven by `bench/run.sh webhook-server`; without arguments (as in a
//! plain `cargo bench`) it prints its usage and exits 0.
//!
//! One OS thread per connection (blocking rustls), so that pacing uses the OS timer.
//!
//! Two modes:
//! - `--rate R`: open loop. Request i is due at start + i/R; latency is counted from when it was
//!   due (so a stalled server cannot hide its queue: no coordinated omission), and also from
//!   when it was actually sent (`service_*`).
//! - no `--rate`: closed loop. Each of `--connections` connections sends its next request as
//!   soon as the previous answer arrived: the server's maximum throughput.
//!
//! Output: one JSON object on stdout (and in `--out F`); with `--samples F`, every measured
//! request's latency in F too (ns, from when it was due and from when it was sent), so that each
//! figure can be recomputed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[path = "support/https1.rs"]
mod https1;

use https1::{connect, find, summary, Conn, Error};

struct Args {
    addr: String,
    path: String,
    ca: String,
    body: String,
    seconds: f64,
    warmup: f64,
    rate: Option<f64>,
    connections: usize,
    /// Whether the review must be allowed (`allowed`) or refused (`refused`).
    expect_allowed: bool,
    out: Option<String>,
    samples: Option<String>,
}

const USAGE: &str =
    "usage: webhook_load --url https://127.0.0.1:PORT/validate --ca CA.pem --body REVIEW.json \
[--seconds 10] [--warmup 2] [--rate R] [--connections 16] [--expect allowed|refused] [--out F.json] \
[--samples F.json]";

fn parse_args() -> Result<Option<Args>, String> {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    if !raw.iter().any(|a| a == "--url") {
        return Ok(None);
    }
    let mut a = Args {
        addr: String::new(),
        path: String::new(),
        ca: String::new(),
        body: String::new(),
        seconds: 10.0,
        warmup: 2.0,
        rate: None,
        connections: 16,
        expect_allowed: true,
        out: None,
        samples: None,
    };
    let mut it = raw.into_iter();
    while let Some(flag) = it.next() {
        if flag == "--bench" {
            continue; // cargo bench passes it
        }
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        let num = |v: &str| v.parse::<f64>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--url" => {
                let rest = v
                    .strip_prefix("https://")
                    .ok_or("--url must start with https://")?;
                let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
                a.addr = host.to_string();
                a.path = format!("/{path}");
            }
            "--ca" => a.ca = v,
            "--body" => a.body = v,
            "--seconds" => a.seconds = num(&v)?,
            "--warmup" => a.warmup = num(&v)?,
            "--rate" => a.rate = Some(num(&v)?),
            "--connections" => a.connections = num(&v)? as usize,
            "--out" => a.out = Some(v),
            "--samples" => a.samples = Some(v),
            "--expect" => {
                a.expect_allowed = match v.as_str() {
                    "allowed" => true,
                    "refused" => false,
                    _ => return Err(format!("--expect {v}: allowed or refused")),
                }
            }
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if a.ca.is_empty() || a.body.is_empty() || a.connections == 0 {
        return Err(USAGE.into());
    }
    Ok(Some(a))
}

/// One request's outcome: (due offset, sent offset, done offset) in ns since start, ok?
type Sample = (u64, u64, u64, bool);

/// Sends one request and reads one response; Ok(true) if it was 200 and allowed (or refused,
/// when `allowed` is false), as expected.
fn roundtrip(c: &mut Conn, request: &[u8], allowed: bool) -> std::io::Result<bool> {
    let r = c.roundtrip(request)?;
    let want: &[u8] = if allowed {
        b"\"allowed\":true"
    } else {
        b"\"allowed\":false"
    };
    Ok(r.status == 200 && find(&r.body, want).is_some())
}

fn main() -> std::process::ExitCode {
    let args = match parse_args() {
        Ok(Some(a)) => a,
        Ok(None) => {
            eprintln!("webhook_load: nothing to do without --url ({USAGE}); bench/run.sh webhook-server drives it");
            return std::process::ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("webhook_load: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    match run(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("webhook_load: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Sleeps until `at` with the OS timer (tens of microseconds late at most, unlike a 1 ms
/// timer wheel), so that the open loop sends on time.
fn sleep_until(at: Instant) {
    let now = Instant::now();
    if at > now {
        std::thread::sleep(at - now);
    }
}

fn run(args: Args) -> Result<(), Error> {
    let cfg = https1::client_config(&std::fs::read(&args.ca)?)?;
    let body = std::fs::read(&args.body)?;
    let mut request = format!(
        "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nAccept: application/json\r\nContent-Length: {}\r\n\r\n",
        args.path,
        args.addr,
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(&body);
    let request = Arc::new(request);

    // Connect everything first (one thread per connection), and check an answer says allowed.
    let mut conns = Vec::new();
    for _ in 0..args.connections {
        let mut c = connect(&args.addr, &cfg)?;
        if !roundtrip(&mut c, &request, args.expect_allowed)? {
            return Err(format!(
                "the webhook did not answer 200 with allowed={} to the body given",
                args.expect_allowed
            )
            .into());
        }
        conns.push(c);
    }

    let start = Instant::now() + Duration::from_millis(50);
    let warmup_ns = (args.warmup * 1e9) as u64;
    let end_ns = warmup_ns + (args.seconds * 1e9) as u64;
    let next = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    for mut c in conns {
        let request = request.clone();
        let next = next.clone();
        let (rate, expect_allowed) = (args.rate, args.expect_allowed);
        threads.push(std::thread::spawn(move || {
            let mut samples: Vec<Sample> = Vec::with_capacity(1 << 16);
            let mut errors = 0u64;
            sleep_until(start);
            loop {
                let due = match rate {
                    Some(r) => {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let due = (i as f64 / r * 1e9) as u64;
                        if due >= end_ns {
                            break;
                        }
                        sleep_until(start + Duration::from_nanos(due));
                        due
                    }
                    None => {
                        let now = start.elapsed().as_nanos() as u64;
                        if now >= end_ns {
                            break;
                        }
                        now
                    }
                };
                let sent = start.elapsed().as_nanos() as u64;
                match roundtrip(&mut c, &request, expect_allowed) {
                    Ok(ok) => {
                        let done = start.elapsed().as_nanos() as u64;
                        samples.push((due, sent, done, ok));
                    }
                    Err(_) => {
                        errors += 1;
                        break; // a broken connection ends this worker
                    }
                }
            }
            (samples, errors)
        }));
    }
    let mut all: Vec<Sample> = Vec::new();
    let mut errors = 0;
    for t in threads {
        let (s, e) = t.join().map_err(|_| "a load thread panicked")?;
        all.extend(s);
        errors += e;
    }
    let measured: Vec<&Sample> = all.iter().filter(|s| s.0 >= warmup_ns).collect();
    let unexpected = measured.iter().filter(|s| !s.3).count();
    let from_due: Vec<u64> = measured.iter().map(|s| s.2 - s.0).collect();
    let service: Vec<u64> = measured.iter().map(|s| s.2 - s.1).collect();
    let first = measured.iter().map(|s| s.1).min().unwrap_or(0);
    let last = measured.iter().map(|s| s.2).max().unwrap_or(0);
    let span_s = (last.saturating_sub(first)) as f64 / 1e9;
    if let Some(p) = &args.samples {
        let raw = serde_json::json!({"from_due_ns": &from_due, "service_ns": &service});
        std::fs::write(p, serde_json::to_vec(&raw)?)?;
    }
    let out = serde_json::json!({
        "mode": if args.rate.is_some() { "open_loop" } else { "closed_loop" },
        "target_rps": args.rate,
        "connections": args.connections,
        "body_bytes": body.len(),
        "seconds": args.seconds,
        "warmup_seconds": args.warmup,
        "requests": measured.len(),
        "expect_allowed": args.expect_allowed,
        "unexpected": unexpected,
        "errors": errors,
        "achieved_rps": if span_s > 0.0 { measured.len() as f64 / span_s } else { 0.0 },
        "latency": summary(from_due),
        "service_latency": summary(service),
    });
    let text = serde_json::to_string_pretty(&out)?;
    println!("{text}");
    if let Some(p) = &args.out {
        std::fs::write(p, text)?;
    }
    Ok(())
}
