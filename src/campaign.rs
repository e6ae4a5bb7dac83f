//! `fencedlease campaign`: runs a command only while this process holds the lease.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

use anyhow::Context as _;
use tokio::process::{Child, Command};
use tokio::sync::watch;
use tokio::time::{sleep_until, Instant};
use tracing::{info, warn};

use crate::lease::elector::{Elector, ElectorConfig, LeaderState};
use crate::lease::rules::FencingToken;

#[derive(Debug, clap::Args)]
pub struct CampaignArgs {
    /// Name of the FencedLease to campaign for.
    #[arg(long)]
    pub lease: String,
    /// Namespace of the FencedLease.
    #[arg(long, env = "FENCEDLEASE_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// Identity of this candidate (default: hostname and process id).
    #[arg(long, env = "FENCEDLEASE_IDENTITY")]
    pub identity: Option<String>,
    /// leaseDurationSeconds to use when the FencedLease does not exist yet and is created.
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(i32).range(1..=3600))]
    pub lease_duration: i32,
    /// Seconds between SIGTERM and SIGKILL when the command must stop.
    #[arg(long, default_value_t = 10.0)]
    pub grace_seconds: f64,
    /// Append one JSON line per leadership change to this file (for tests and audits).
    #[arg(long)]
    pub events_file: Option<PathBuf>,
    /// The command to run while leading; it gets FENCEDLEASE_TOKEN and FENCEDLEASE_LEASE_UID.
    #[arg(last = true, required = true, num_args = 1..)]
    pub command: Vec<String>,
}

/// A JSON-lines log of what this candidate believed, with wall-clock times (one machine).
struct EventLog {
    file: Option<std::fs::File>,
    identity: String,
}

impl EventLog {
    fn write(&mut self, event: &str, extra: serde_json::Value) {
        let Some(f) = self.file.as_mut() else { return };
        let mut line = serde_json::json!({
            "t_ns": unix_ns(jiff::Timestamp::now()),
            "identity": self.identity,
            "event": event,
        });
        if let (Some(obj), serde_json::Value::Object(more)) = (line.as_object_mut(), extra) {
            obj.extend(more);
        }
        // One write per line (O_APPEND): a reader never sees half a line.
        let mut text = line.to_string();
        text.push('\n');
        if let Err(e) = f.write_all(text.as_bytes()) {
            warn!(error = %e, "writing the events file failed");
        }
    }
}

fn unix_ns(t: jiff::Timestamp) -> i128 {
    t.as_nanosecond()
}

/// The wall-clock time of a monotonic instant (on this machine).
fn wall_of(at: Instant) -> jiff::Timestamp {
    let now_i = Instant::now();
    let now_w = jiff::Timestamp::now();
    let delta = if at >= now_i {
        jiff::SignedDuration::try_from(at - now_i).unwrap_or_default()
    } else {
        -jiff::SignedDuration::try_from(now_i - at).unwrap_or_default()
    };
    now_w.checked_add(delta).unwrap_or(now_w)
}

pub fn default_identity() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "unknown".into());
    format!("{host}-{}", std::process::id())
}

pub async fn run(args: CampaignArgs) -> anyhow::Result<std::process::ExitCode> {
    let identity = args.identity.clone().unwrap_or_else(default_identity);
    if !args.grace_seconds.is_finite() || args.grace_seconds < 0.0 {
        anyhow::bail!("--grace-seconds must be a non-negative number");
    }
    let grace = Duration::from_secs_f64(args.grace_seconds);
    let file = match &args.events_file {
        Some(p) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .with_context(|| format!("opening the events file {}", p.display()))?,
        ),
        None => None,
    };
    let mut log = EventLog {
        file,
        identity: identity.clone(),
    };
    let client = kube::Client::try_default()
        .await
        .context("connecting to Kubernetes (set KUBECONFIG or run in a pod)")?;
    let (elector, handle) = Elector::new(
        client,
        ElectorConfig {
            namespace: args.namespace.clone(),
            lease: args.lease.clone(),
            identity: identity.clone(),
            create_with_duration: Some(args.lease_duration),
            create_owner: None,
            timing_override: None,
        },
    )?;
    let (stop_tx, mut stop_rx) = watch::channel(false);
    let elector_task = tokio::spawn(elector.run(async move {
        let _ = stop_rx.wait_for(|s| *s).await;
    }));
    let mut state = handle.state.clone();
    let mut child: Option<(Child, FencingToken)> = None;
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    let far = || Instant::now() + Duration::from_secs(3600);
    let exit_status: Option<ExitStatus>;
    log.write("started", serde_json::json!({"lease": args.lease}));

    loop {
        let current = state.borrow_and_update().clone();
        let now = Instant::now();
        let leading = current.leading_token(now).cloned();
        match (&leading, &mut child) {
            (Some(token), None) => {
                let valid_until = match &current {
                    LeaderState::Leading { valid_until, .. } => *valid_until,
                    _ => now,
                };
                log.write(
                    "leading",
                    serde_json::json!({"token": token.generation, "lease_uid": token.lease_uid,
                        "valid_until_ns": unix_ns(wall_of(valid_until))}),
                );
                info!(token = token.generation, "leading: starting the command");
                let spawned = spawn_command(&args, &identity, token)?;
                child = Some((spawned, token.clone()));
            }
            (Some(token), Some((_, running))) if token != running => {
                // The token moved on while we kept holding (a spec edit): restart the
                // command with the new token, since its old one is refused now.
                if let Some((c, old)) = child.take() {
                    log.write(
                        "stopped",
                        serde_json::json!({"token": old.generation, "token_moved": true}),
                    );
                    stop_child(c, grace).await;
                }
                continue;
            }
            (Some(_), Some(_)) => {
                if let LeaderState::Leading { token, valid_until } = &current {
                    log.write(
                        "renewed",
                        serde_json::json!({"token": token.generation,
                            "valid_until_ns": unix_ns(wall_of(*valid_until))}),
                    );
                }
            }
            (None, Some(_)) => {
                if let Some((c, token)) = child.take() {
                    log.write("stopped", serde_json::json!({"token": token.generation}));
                    warn!(
                        token = token.generation,
                        "leadership lost: stopping the command"
                    );
                    stop_child(c, grace).await;
                }
            }
            (None, None) => {}
        }
        let deadline = match &current {
            LeaderState::Leading { valid_until, .. } if child.is_some() => *valid_until,
            _ => far(),
        };
        tokio::select! {
            changed = state.changed() => {
                if changed.is_err() {
                    // The elector stopped (its watch ended): nothing guarantees leadership.
                    if let Some((c, token)) = child.take() {
                        log.write("stopped", serde_json::json!({"token": token.generation}));
                        stop_child(c, grace).await;
                    }
                    let res = elector_task.await.context("the elector task failed")?;
                    res?;
                    anyhow::bail!("the elector ended unexpectedly");
                }
            }
            () = sleep_until(deadline) => {} // validity ran out: the next pass stops the command
            status = wait_child(&mut child) => {
                exit_status = Some(status?);
                if let Some((_, token)) = child.take() {
                    log.write("stopped", serde_json::json!({"token": token.generation, "command_exited": true}));
                }
                break;
            }
            _ = sigterm.recv() => {
                info!("SIGTERM: stopping the command and releasing the lease");
                if let Some((c, token)) = child.take() {
                    log.write("stopped", serde_json::json!({"token": token.generation}));
                    stop_child(c, grace).await;
                }
                exit_status = None;
                break;
            }
            _ = tokio::signal::ctrl_c() => {
                info!("interrupted: stopping the command and releasing the lease");
                if let Some((c, token)) = child.take() {
                    log.write("stopped", serde_json::json!({"token": token.generation}));
                    stop_child(c, grace).await;
                }
                exit_status = None;
                break;
            }
        }
    }
    let _ = stop_tx.send(true);
    match elector_task.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => warn!(error = %e, "the elector ended with an error"),
        Err(e) => warn!(error = %e, "the elector task failed"),
    }
    log.write("exited", serde_json::json!({}));
    Ok(match exit_status.and_then(|s| s.code()) {
        Some(code) => std::process::ExitCode::from(u8::try_from(code).unwrap_or(1)),
        None if exit_status.is_some() => std::process::ExitCode::FAILURE,
        None => std::process::ExitCode::SUCCESS,
    })
}

fn spawn_command(
    args: &CampaignArgs,
    identity: &str,
    token: &FencingToken,
) -> anyhow::Result<Child> {
    let (program, rest) = args
        .command
        .split_first()
        .context("no command given after --")?;
    Command::new(program)
        .args(rest)
        .env("FENCEDLEASE_TOKEN", token.generation.to_string())
        .env("FENCEDLEASE_LEASE_UID", &token.lease_uid)
        .env("FENCEDLEASE_LEASE", &args.lease)
        .env("FENCEDLEASE_NAMESPACE", &args.namespace)
        .env("FENCEDLEASE_IDENTITY", identity)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {program:?}"))
}

async fn wait_child(child: &mut Option<(Child, FencingToken)>) -> anyhow::Result<ExitStatus> {
    match child {
        Some((c, _)) => c.wait().await.context("waiting for the command"),
        None => std::future::pending().await,
    }
}

/// SIGTERM, then SIGKILL after `grace`.
async fn stop_child(mut child: Child, grace: Duration) {
    if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGTERM,
        );
    }
    match tokio::time::timeout(grace, child.wait()).await {
        Ok(_) => {}
        Err(_) => {
            warn!("the command ignored SIGTERM for {grace:?}: SIGKILL");
            let _ = child.kill().await;
        }
    }
}
