//! `fencedlease campaign`: runs a command only while this process holds the lease, and stops
//! the command's whole process tree (children, grandchildren, and those that escaped into a
//! session of their own) before leadership ends.
//!
//! When to signal is decided by the pure [`plan`] and [`stop_times`]; the `tree` module does the
//! signalling over /proc. The command runs under a [`keeper`], which ends the tree when this
//! process ends, however it ends.

pub(crate) mod keeper;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

use anyhow::Context as _;
use tokio::process::{Child, Command};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;
use tokio::time::{sleep_until, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::lease::clock;
use crate::lease::elector::LeaderState;
use crate::lease::rules::FencingToken;
use crate::runtime::args::{ElectionArgs, Tailor, Tailored};

/// `campaign`'s election flags read FENCEDLEASE_ variables.
#[derive(Debug, Clone)]
pub struct CampaignFlags;

impl Tailor for CampaignFlags {
    fn tailor(cmd: clap::Command) -> clap::Command {
        cmd.mut_arg("namespace", |a| a.env("FENCEDLEASE_NAMESPACE"))
            .mut_arg("identity", |a| {
                a.env("FENCEDLEASE_IDENTITY")
                    .help("Identity of this candidate (default: hostname and process id)")
            })
    }
}

/// The longest `--grace-seconds` accepted (the longest lease is an hour as well).
const MAX_GRACE_SECONDS: f64 = 3600.0;

#[derive(Debug, clap::Args)]
pub struct CampaignArgs {
    #[command(flatten)]
    pub election: Tailored<ElectionArgs, CampaignFlags>,
    /// Seconds (0 to 3600) the command gets between SIGTERM and SIGKILL when it must stop.
    /// The command runs in a session of its own, and SIGKILL goes to its whole process tree
    /// (grandchildren that escaped into their own session included) no later than the moment
    /// leadership validity ends: when renewals stop arriving, SIGTERM goes out this long
    /// before that moment, but never before two thirds of the validity the last renewal gave
    /// (on time, renewals never stop the command). So the grace is at most a third of that
    /// validity: about 4 s with a 15 s lease. When leadership is lost outright (another
    /// holder, the lease deleted or re-created), the tree is killed at once.
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
    let now_i = clock::now();
    let now_w = jiff::Timestamp::now();
    let delta = if at >= now_i {
        jiff::SignedDuration::try_from(at - now_i).unwrap_or_default()
    } else {
        -jiff::SignedDuration::try_from(now_i - at).unwrap_or_default()
    };
    now_w.checked_add(delta).unwrap_or(now_w)
}

// ---------------------------------------------------------------------------------------------
// When to start and stop the command: pure decisions over an injected clock.

/// Of the validity a renewal gives, the share that must pass before the command is asked to
/// stop for want of the next renewal. Renewals are due a third of the way in, so renewals on
/// time never stop the command, and one that is late still has a sixth of the lease or more.
const RUN_SHARE: (u32, u32) = (2, 3);
/// SIGKILL goes out this long before validity ends (less for a very short validity), so that a
/// timer that fires late still kills the tree before then.
const KILL_LEAD: Duration = Duration::from_millis(100);

/// When the running command is asked to stop (SIGTERM) and when its whole tree is killed
/// (SIGKILL), unless a renewal extends the validity first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StopTimes {
    pub term_at: Instant,
    pub kill_at: Instant,
}

/// For leadership valid until `valid_until`, first seen at `since`: SIGKILL no later than
/// `valid_until` (`KILL_LEAD` before it, when the validity is long enough), SIGTERM `grace`
/// before SIGKILL but not before `RUN_SHARE` of the validity has passed.
pub(crate) fn stop_times(valid_until: Instant, since: Instant, grace: Duration) -> StopTimes {
    let window = valid_until.saturating_duration_since(since);
    let lead = KILL_LEAD.min(window / 10);
    let kill_at = valid_until.checked_sub(lead).unwrap_or(valid_until);
    let floor = since + window / RUN_SHARE.1 * RUN_SHARE.0;
    let wanted = kill_at.checked_sub(grace).unwrap_or(since);
    StopTimes {
        term_at: wanted.max(floor).min(kill_at),
        kill_at,
    }
}

/// Why the command is stopped (the `reason` of "stopped" and "command_gone" events).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StopReason {
    /// Not leading any more: another holder, the lease deleted, or validity over.
    Lost,
    /// Still leading, but no renewal came in time: the tree must be gone when validity ends.
    RenewalOverdue,
    /// Still leading with a new token (the spec was edited): the old one is refused now.
    TokenMoved,
    /// This process was told to stop, or the elector ended.
    Shutdown,
    /// The command itself exited; what it left behind is stopped.
    CommandExited,
}

impl StopReason {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            StopReason::Lost => "lost",
            StopReason::RenewalOverdue => "renewal_overdue",
            StopReason::TokenMoved => "token_moved",
            StopReason::Shutdown => "shutdown",
            StopReason::CommandExited => "command_exited",
        }
    }
}

/// What to do with the command now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Plan {
    /// Nothing runs and nothing should: wait for news.
    Idle,
    /// Start the command with this token.
    Start(FencingToken),
    /// Let it run; look again at `term_at` unless the state changes first.
    Run { term_at: Instant },
    /// SIGTERM now; SIGKILL the whole tree at `kill_at` if it is still there.
    Stop {
        kill_at: Instant,
        reason: StopReason,
    },
}

/// The decision at `now`, given the elector's `state`, when its current validity was first
/// seen (`since`), and the token of the command running, if one does.
pub(crate) fn plan(
    now: Instant,
    state: &LeaderState,
    since: Instant,
    running: Option<&FencingToken>,
    grace: Duration,
) -> Plan {
    let leading = match state {
        LeaderState::Leading {
            token, valid_until, ..
        } if now < *valid_until => Some((token, stop_times(*valid_until, since, grace))),
        _ => None,
    };
    let Some((token, times)) = leading else {
        return match running {
            Some(_) => Plan::Stop {
                kill_at: now,
                reason: StopReason::Lost,
            },
            None => Plan::Idle,
        };
    };
    match running {
        Some(r) if r != token => Plan::Stop {
            kill_at: graceful_kill_at(now, times.kill_at, grace),
            reason: StopReason::TokenMoved,
        },
        Some(_) if now >= times.term_at => Plan::Stop {
            kill_at: times.kill_at.max(now),
            reason: StopReason::RenewalOverdue,
        },
        Some(_) => Plan::Run {
            term_at: times.term_at,
        },
        // Not after a stop for want of renewal: only a renewal starts it again.
        None if now < times.term_at => Plan::Start(token.clone()),
        None => Plan::Idle,
    }
}

/// When to SIGKILL what is left when stopping for another reason than the lease (shutdown, the
/// command exited): after `grace`, but while leading no later than validity allows, and at
/// once when not leading.
pub(crate) fn shutdown_kill_at(
    now: Instant,
    state: &LeaderState,
    since: Instant,
    grace: Duration,
) -> Instant {
    match state {
        LeaderState::Leading { valid_until, .. } if now < *valid_until => {
            graceful_kill_at(now, stop_times(*valid_until, since, grace).kill_at, grace)
        }
        _ => now,
    }
}

fn graceful_kill_at(now: Instant, kill_at: Instant, grace: Duration) -> Instant {
    now.checked_add(grace)
        .map_or(kill_at, |g| g.min(kill_at))
        .max(now)
}

/// The validity currently held, and when it was first seen: the start of its window.
#[derive(Clone, Copy, Debug)]
struct Seen {
    valid_until: Option<Instant>,
    since: Instant,
}

impl Seen {
    /// Notes `state` at `now`; true if it brought a new validity (a renewal).
    fn update(&mut self, state: &LeaderState, now: Instant) -> bool {
        let valid_until = match state {
            LeaderState::Leading { valid_until, .. } => Some(*valid_until),
            _ => None,
        };
        let changed = valid_until != self.valid_until;
        if changed {
            *self = Seen {
                valid_until,
                since: now,
            };
        }
        changed && valid_until.is_some()
    }
}

// ---------------------------------------------------------------------------------------------
// The loop: the elector's state in, the command started and stopped.

/// The command while it runs: its direct child leads a session and process group of its own.
struct Running {
    /// The keeper (`fencedlease keep`), whose child is the command.
    child: Child,
    group: nix::unistd::Pid,
    token: FencingToken,
    /// The write end of the keeper's pipe: closed when this process ends (or the run is
    /// dropped), which makes the keeper kill the whole tree.
    _alive: std::os::fd::OwnedFd,
}

struct Campaign {
    args: CampaignArgs,
    identity: String,
    grace: Duration,
    log: EventLog,
    running: Option<Running>,
    seen: Seen,
    /// The holder and token of the last `following` event, so each change is logged once.
    followed: Option<(Option<String>, Option<i64>)>,
}

/// How the loop ended.
enum Ended {
    /// The command exited with this status.
    Command(ExitStatus),
    /// This process was told to stop.
    Signalled,
}

pub(crate) async fn run(args: CampaignArgs) -> anyhow::Result<std::process::ExitCode> {
    let identity = args.election.identity_or_default();
    let grace = grace_of(args.grace_seconds)?;
    // Orphaned descendants of the command are re-parented to this process, not to init, so
    // that they can be found and stopped with the rest of the tree.
    nix::sys::prctl::set_child_subreaper(true).context(
        "making this process a child subreaper (prctl PR_SET_CHILD_SUBREAPER) failed: it is \
         needed to stop all of the command's processes; run on Linux 3.4 or later",
    )?;
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
    let rt = crate::runtime::Runtime::start().await?;
    let (elector, handle) = rt.candidate(&args.election, &identity)?;
    let elector = rt.spawn_elector(elector);
    let log = EventLog {
        file,
        identity: identity.clone(),
    };
    let mut campaign = Campaign {
        args,
        identity,
        grace,
        log,
        running: None,
        seen: Seen {
            valid_until: None,
            since: clock::now(),
        },
        followed: None,
    };
    let ended = campaign
        .lead(handle.state.clone(), rt.shutdown().clone())
        .await;
    // Only now, with the command's tree gone, may the lease be released.
    let elector_error = elector.stop().await;
    campaign.log.write("exited", serde_json::json!({}));
    let ended = match (ended, elector_error) {
        (Ok(ended), None) => ended,
        (Ok(ended), Some(e)) => {
            warn!(error = %e, "the elector ended with an error");
            ended
        }
        (Err(e), None) => return Err(e),
        (Err(e), Some(cause)) => return Err(cause.context(e.to_string())),
    };
    Ok(match ended {
        Ended::Command(status) => match status.code() {
            Some(code) => std::process::ExitCode::from(u8::try_from(code).unwrap_or(1)),
            None => std::process::ExitCode::FAILURE,
        },
        Ended::Signalled => std::process::ExitCode::SUCCESS,
    })
}

fn grace_of(seconds: f64) -> anyhow::Result<Duration> {
    if !(0.0..=MAX_GRACE_SECONDS).contains(&seconds) {
        anyhow::bail!("--grace-seconds must be a number from 0 to {MAX_GRACE_SECONDS}");
    }
    Duration::try_from_secs_f64(seconds)
        .with_context(|| format!("--grace-seconds {seconds} is not a duration"))
}

impl Campaign {
    /// Follows the elector's state until the command exits or this process is told to stop;
    /// the command's tree is gone when it returns.
    async fn lead(
        &mut self,
        mut state: watch::Receiver<LeaderState>,
        shutdown: CancellationToken,
    ) -> anyhow::Result<Ended> {
        let mut sigchld = signal(SignalKind::child()).context("installing the SIGCHLD handler")?;
        self.log.write(
            "started",
            serde_json::json!({"lease": self.args.election.lease}),
        );
        loop {
            let current = state.borrow_and_update().clone();
            let Some(term_at) = self.act(&current).await? else {
                continue; // it started or stopped the command: decide again
            };
            let wake = term_at.unwrap_or_else(|| clock::now() + Duration::from_secs(3600));
            tokio::select! {
                changed = state.changed() => if changed.is_err() {
                    // The elector stopped (its watch ended): nothing guarantees leadership.
                    self.stop_all(&current, StopReason::Shutdown).await;
                    anyhow::bail!("the elector ended unexpectedly");
                },
                () = sleep_until(clock::timer_for(wake)) => {} // time to stop, unless renewed meanwhile
                status = wait_child(&mut self.running) => {
                    // What it left behind goes too, or it would outlive this process.
                    self.stop_all(&current, StopReason::CommandExited).await;
                    return Ok(Ended::Command(status?));
                }
                () = shutdown.cancelled() => {
                    info!("stopping the command and releasing the lease");
                    self.stop_all(&current, StopReason::Shutdown).await;
                    return Ok(Ended::Signalled);
                }
                _ = sigchld.recv() => {
                    let own = self.running.as_ref().map(|r| r.group);
                    tree::reap_orphans(own);
                }
            }
        }
    }

    /// Carries out the plan for `state` now. Returns None when it started or stopped the
    /// command, else when to look again (None: only on news).
    async fn act(&mut self, state: &LeaderState) -> anyhow::Result<Option<Option<Instant>>> {
        let now = clock::now();
        let renewed = self.seen.update(state, now);
        let running = self.running.as_ref().map(|r| &r.token);
        // A lost tenure's command is stopped (and logged) before the candidate says whom it
        // follows: the log's order is the order of what happened.
        let outcome = match plan(now, state, self.seen.since, running, self.grace) {
            Plan::Idle => Some(None),
            Plan::Run { term_at } => {
                if let (
                    true,
                    LeaderState::Leading {
                        token, valid_until, ..
                    },
                ) = (renewed, state)
                {
                    self.log.write(
                        "renewed",
                        serde_json::json!({"token": token.generation,
                            "valid_until_ns": unix_ns(wall_of(*valid_until))}),
                    );
                }
                Some(Some(term_at))
            }
            Plan::Start(token) => {
                self.start(state, &token)?;
                None
            }
            Plan::Stop { kill_at, reason } => {
                self.stop(kill_at, reason).await;
                None
            }
        };
        self.note_following(state);
        Ok(outcome)
    }

    /// Logs `following` when this candidate first sees, or sees a change of, who holds the
    /// lease while it does not: the proof, for a test or an audit, that it watches the lease.
    fn note_following(&mut self, state: &LeaderState) {
        let LeaderState::Following { holder, token } = state else {
            return;
        };
        let seen = Some((holder.clone(), *token));
        if self.followed != seen {
            self.log.write(
                "following",
                serde_json::json!({"holder": holder, "token": token}),
            );
            self.followed = seen;
        }
    }

    fn start(&mut self, state: &LeaderState, token: &FencingToken) -> anyhow::Result<()> {
        if let LeaderState::Leading { valid_until, .. } = state {
            self.log.write(
                "leading",
                serde_json::json!({"token": token.generation, "lease_uid": token.lease_uid,
                    "valid_until_ns": unix_ns(wall_of(*valid_until))}),
            );
        }
        info!(token = token.generation, "leading: starting the command");
        let (child, alive) = spawn_command(&self.args, &self.identity, token)?;
        let pid = child
            .id()
            .and_then(|p| i32::try_from(p).ok())
            .context("the command exited before its process id could be read")?;
        self.running = Some(Running {
            child,
            group: nix::unistd::Pid::from_raw(pid),
            token: token.clone(),
            _alive: alive,
        });
        Ok(())
    }

    /// Stops the running command's whole tree (SIGKILL at `kill_at` at the latest) and logs it.
    async fn stop(&mut self, kill_at: Instant, reason: StopReason) {
        let Some(mut run) = self.running.take() else {
            return;
        };
        let token = run.token.generation;
        self.log.write(
            "stopped",
            serde_json::json!({"token": token, "reason": reason.as_str(),
                "kill_at_ns": unix_ns(wall_of(kill_at)),
                "token_moved": reason == StopReason::TokenMoved,
                "command_exited": reason == StopReason::CommandExited}),
        );
        match reason {
            StopReason::Lost => warn!(token, "leadership lost: killing the command's processes"),
            StopReason::RenewalOverdue => warn!(
                token,
                "no renewal in time: stopping the command before leadership ends"
            ),
            _ => info!(token, reason = reason.as_str(), "stopping the command"),
        }
        let outcome = tree::stop(&mut run.child, run.group, kill_at).await;
        if !outcome.left.is_empty() {
            warn!(pids = ?outcome.left, "processes of the command outlived SIGKILL (uninterruptible sleep?)");
        }
        self.log.write(
            "command_gone",
            serde_json::json!({"token": token, "reason": reason.as_str(),
                "sigkill_ns": outcome.sigkill_at.map(|t| unix_ns(wall_of(t))),
                "left": outcome.left}),
        );
    }

    /// Stops whatever runs, for a reason other than the lease.
    async fn stop_all(&mut self, state: &LeaderState, reason: StopReason) {
        let kill_at = shutdown_kill_at(clock::now(), state, self.seen.since, self.grace);
        self.stop(kill_at, reason).await;
    }
}

/// Starts the command under a keeper (see [`keeper`]), in a session of its own (so that the
/// whole group can be signalled, and no terminal's signals reach it behind this process's
/// back). Returns the keeper and the write end of its pipe.
fn spawn_command(
    args: &CampaignArgs,
    identity: &str,
    token: &FencingToken,
) -> anyhow::Result<(Child, std::os::fd::OwnedFd)> {
    use std::os::fd::AsRawFd;
    let program = args.command.first().context("no command given after --")?;
    let me = std::env::current_exe().context("finding this program's own path for the keeper")?;
    // Both ends close on exec; the keeper's end is made inheritable in the child alone.
    let (watch, alive) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).context("making the keeper's pipe")?;
    let watch_fd = watch.as_raw_fd();
    let mut command = Command::new(me);
    command
        .args(keeper::keeper_args(watch_fd, &args.command))
        .env("FENCEDLEASE_TOKEN", token.generation.to_string())
        .env("FENCEDLEASE_LEASE_UID", &token.lease_uid)
        .env("FENCEDLEASE_LEASE", &args.election.lease)
        .env("FENCEDLEASE_NAMESPACE", &args.election.namespace)
        .env("FENCEDLEASE_IDENTITY", identity);
    // SAFETY: between fork and exec the closure only calls setsid(2) and fcntl(2), which are
    // async-signal-safe, and allocates nothing.
    unsafe {
        command.pre_exec(move || {
            nix::unistd::setsid()?;
            let fd = std::os::fd::BorrowedFd::borrow_raw(watch_fd);
            let flags = nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty());
            nix::fcntl::fcntl(fd, flags)?;
            Ok(())
        });
    }
    let child = command
        .spawn()
        .with_context(|| format!("starting {program:?}"))?;
    drop(watch);
    Ok((child, alive))
}

async fn wait_child(running: &mut Option<Running>) -> anyhow::Result<ExitStatus> {
    match running {
        Some(r) => r.child.wait().await.context("waiting for the command"),
        None => std::future::pending().await,
    }
}

/// Finding, signalling and reaping this process's descendants through /proc. This process is
/// a child subreaper, so descendants orphaned on the way stay its descendants.
mod tree {
    use std::time::Duration;

    use nix::sys::signal::{kill, Signal};
    use nix::sys::wait::{waitpid, WaitPidFlag};
    use nix::unistd::{getpgrp, getpid, Pid};
    use tokio::process::Child;
    use tokio::time::{sleep, sleep_until, Instant};
    use tracing::warn;

    use crate::lease::clock;

    /// How often to look whether the tree is gone.
    const POLL: Duration = Duration::from_millis(10);
    /// How long after SIGKILL to wait for every process to disappear before giving up (a
    /// process in uninterruptible sleep dies only when it leaves it; it runs no code before).
    const REAP_TIMEOUT: Duration = Duration::from_secs(5);

    /// One process as /proc/PID/stat shows it.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(super) struct ProcInfo {
        pub pid: i32,
        pub ppid: i32,
        pub pgid: i32,
        pub zombie: bool,
    }

    /// Parses /proc/PID/stat: `pid (comm) state ppid ...`; comm may hold spaces and `)`.
    pub(super) fn parse_stat(text: &str) -> Option<ProcInfo> {
        let (head, rest) = text.rsplit_once(')')?;
        let pid = head.split_once(" (")?.0.trim().parse().ok()?;
        let mut fields = rest.split_ascii_whitespace();
        let state = fields.next()?;
        let ppid = fields.next()?.parse().ok()?;
        let pgid = fields.next()?.parse().ok()?;
        Some(ProcInfo {
            pid,
            ppid,
            pgid,
            zombie: matches!(state, "Z" | "X" | "x"),
        })
    }

    /// The processes of commands that `root` started: its descendants outside its own process
    /// group `root_group`. Each command starts a session of its own, and no process can join
    /// a group of another session, so the command's processes never share `root_group`;
    /// children this process starts otherwise (a kubeconfig exec credential plugin) do, and
    /// are left to whoever waits for them.
    pub(super) fn command_processes(
        table: &[ProcInfo],
        root: i32,
        root_group: i32,
    ) -> Vec<ProcInfo> {
        descendants(table, root, Some(root_group))
    }

    /// `root`'s descendants, leaving out those in `except_group` (and what they started).
    fn descendants(table: &[ProcInfo], root: i32, except_group: Option<i32>) -> Vec<ProcInfo> {
        let mut out: Vec<ProcInfo> = Vec::new();
        let mut parents = vec![root];
        while let Some(parent) = parents.pop() {
            let children = table
                .iter()
                .filter(|p| p.ppid == parent && p.pid != root && Some(p.pgid) != except_group);
            for p in children {
                if !out.iter().any(|o| o.pid == p.pid) {
                    out.push(*p);
                    parents.push(p.pid);
                }
            }
        }
        out
    }

    /// Every process on the machine (that still exists while it is read).
    fn proc_table() -> Vec<ProcInfo> {
        let entries = match std::fs::read_dir("/proc") {
            Ok(e) => e,
            Err(e) => {
                warn!(error = %e, "reading /proc failed: only the process group is signalled");
                return Vec::new();
            }
        };
        entries
            .flatten()
            .filter(|e| {
                e.file_name()
                    .to_str()
                    .is_some_and(|n| n.parse::<i32>().is_ok())
            })
            .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
            .filter_map(|s| parse_stat(&s))
            .collect()
    }

    fn command_processes_now() -> Vec<ProcInfo> {
        command_processes(&proc_table(), getpid().as_raw(), getpgrp().as_raw())
    }

    /// Sends `sig` to the process group `group` and to every live descendant.
    fn signal_all(group: Pid, sig: Signal) {
        let _ = kill(Pid::from_raw(-group.as_raw()), sig); // ESRCH: the group is empty
        for p in command_processes_now().iter().filter(|p| !p.zombie) {
            let _ = kill(Pid::from_raw(p.pid), sig); // ESRCH: it just exited
        }
    }

    /// For the keeper: SIGKILLs every descendant of this process, again and again (a process
    /// may fork between the scan and the signal), until only zombies are left (the keeper's
    /// main thread reaps them) or `REAP_TIMEOUT` has passed. A zombie is signalled too: a
    /// process whose main thread exited shows as one while its other threads run.
    pub(super) fn kill_all_descendants() {
        let me = getpid().as_raw();
        let started = std::time::Instant::now();
        loop {
            let left = descendants(&proc_table(), me, None);
            for p in &left {
                let _ = kill(Pid::from_raw(p.pid), Signal::SIGKILL); // ESRCH: it just exited
            }
            if left.iter().all(|p| p.zombie) || started.elapsed() >= REAP_TIMEOUT {
                return;
            }
            std::thread::sleep(POLL);
        }
    }

    /// Reaps exited command processes re-parented to this process, other than `except`
    /// (tokio reaps the command's own process; waiting on it here would steal its status).
    pub(super) fn reap_orphans(except: Option<Pid>) {
        let me = getpid().as_raw();
        for p in command_processes_now() {
            if p.ppid == me && p.zombie && Some(p.pid) != except.map(Pid::as_raw) {
                let _ = waitpid(Pid::from_raw(p.pid), Some(WaitPidFlag::WNOHANG));
            }
        }
    }

    /// Reaps what can be reaped; true when nothing of the tree is left.
    fn reap_and_check(child: &mut Child, group: Pid) -> bool {
        let exited = !matches!(child.try_wait(), Ok(None));
        reap_orphans(Some(group));
        exited && command_processes_now().is_empty()
    }

    /// What stopping the tree took.
    pub(super) struct Outcome {
        /// When SIGKILL went out (None: the tree was gone after SIGTERM).
        pub sigkill_at: Option<Instant>,
        /// Processes still there `REAP_TIMEOUT` after SIGKILL.
        pub left: Vec<i32>,
    }

    /// SIGTERM to the command's group and all descendants now; SIGKILL to all of them at
    /// `kill_at` if any is left (repeated until no descendant remains), reaping as they go.
    pub(super) async fn stop(child: &mut Child, group: Pid, kill_at: Instant) -> Outcome {
        if clock::now() < kill_at {
            signal_all(group, Signal::SIGTERM);
            loop {
                if reap_and_check(child, group) {
                    return Outcome {
                        sigkill_at: None,
                        left: Vec::new(),
                    };
                }
                if clock::now() >= kill_at {
                    break;
                }
                sleep_until(clock::timer_for((clock::now() + POLL).min(kill_at))).await;
            }
        }
        let sigkill_at = clock::now();
        loop {
            // Again and again: a process may have forked between the scan and the signal.
            signal_all(group, Signal::SIGKILL);
            if reap_and_check(child, group) {
                return Outcome {
                    sigkill_at: Some(sigkill_at),
                    left: Vec::new(),
                };
            }
            if sigkill_at.elapsed() >= REAP_TIMEOUT {
                let left = command_processes_now().iter().map(|p| p.pid).collect();
                return Outcome {
                    sigkill_at: Some(sigkill_at),
                    left,
                };
            }
            sleep(POLL).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::tree::{command_processes, parse_stat, ProcInfo};
    use super::*;

    fn token(generation: i64) -> FencingToken {
        FencingToken {
            lease_uid: "u".into(),
            generation,
        }
    }

    fn leading(generation: i64, valid_until: Instant) -> LeaderState {
        LeaderState::Leading {
            token: token(generation),
            valid_until,
            tenure: 1,
        }
    }

    #[test]
    fn stop_times_kill_by_the_end_of_validity_and_never_cut_a_renewal_short() {
        let t0 = clock::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let s = Duration::from_secs;
        // (valid_until, since, grace) -> (term_at, kill_at), in ms after t0
        let table = [
            // A 15 s lease (13 s of validity): the default 10 s grace is cut to a third.
            ((13_000, 0, s(10)), (8_667, 12_900)),
            ((13_000, 0, s(2)), (10_900, 12_900)),
            ((13_000, 0, s(0)), (12_900, 12_900)),
            ((13_000, 0, s(3_600)), (8_667, 12_900)),
            // A 2 s lease (1.6 s of validity): the lead before validity ends shrinks too.
            ((1_600, 0, s(2)), (1_067, 1_500)),
            ((1_600, 0, Duration::from_millis(200)), (1_300, 1_500)),
            // A tiny validity: a tenth of it as lead.
            ((100, 0, s(1)), (67, 90)),
            // Nothing left: stop and kill at validity's end.
            ((500, 500, s(1)), (500, 500)),
            // Seen after it ended (a paused process): nothing later than validity.
            ((500, 900, s(1)), (500, 500)),
            // A later start of the window moves SIGTERM, never SIGKILL past validity.
            ((20_000, 7_000, s(10)), (15_667, 19_900)),
        ];
        for ((valid, since, grace), (term, kill)) in table {
            let got = stop_times(ms(valid), ms(since), grace);
            let want = StopTimes {
                term_at: ms(term),
                kill_at: ms(kill),
            };
            // The two-thirds floor is computed in whole nanoseconds: allow 1 ms of rounding.
            let close = |a: Instant, b: Instant| {
                a.max(b).duration_since(a.min(b)) <= Duration::from_millis(1)
            };
            assert!(
                close(got.term_at, want.term_at) && got.kill_at == want.kill_at,
                "valid_until {valid} since {since} grace {grace:?}: {got:?} vs {want:?}"
            );
            assert!(got.term_at <= got.kill_at && got.kill_at <= ms(valid));
        }
    }

    #[test]
    fn plan_starts_runs_and_stops_the_command_at_the_right_moments() {
        let t0 = clock::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let grace = Duration::from_secs(2);
        let following = LeaderState::Following {
            holder: Some("b".into()),
            token: Some(8),
        };
        let lead7 = leading(7, ms(13_000)); // seen at 0: SIGTERM at 10_900, SIGKILL at 12_900
        let (t7, t6) = (token(7), token(6));
        let stop = |kill: u64, reason| Plan::Stop {
            kill_at: ms(kill),
            reason,
        };
        // (now, state, running) -> plan, with the validity first seen at 0
        let table = [
            (0, &LeaderState::Unknown, None, Plan::Idle),
            (0, &following, None, Plan::Idle),
            (5, &following, Some(&t7), stop(5, StopReason::Lost)),
            (
                5,
                &LeaderState::Unknown,
                Some(&t7),
                stop(5, StopReason::Lost),
            ),
            (0, &lead7, None, Plan::Start(token(7))),
            (10_000, &lead7, None, Plan::Start(token(7))),
            (
                100,
                &lead7,
                Some(&t7),
                Plan::Run {
                    term_at: ms(10_900),
                },
            ),
            (
                10_900,
                &lead7,
                Some(&t7),
                stop(12_900, StopReason::RenewalOverdue),
            ),
            (
                12_960,
                &lead7,
                Some(&t7),
                stop(12_960, StopReason::RenewalOverdue),
            ),
            // Stopped for want of renewal: not started again until a renewal comes.
            (11_000, &lead7, None, Plan::Idle),
            // Validity over: lost, killed at once.
            (13_000, &lead7, Some(&t7), stop(13_000, StopReason::Lost)),
            (13_000, &lead7, None, Plan::Idle),
            // A new token while holding: grace, but no later than validity allows.
            (100, &lead7, Some(&t6), stop(2_100, StopReason::TokenMoved)),
            (
                12_000,
                &lead7,
                Some(&t6),
                stop(12_900, StopReason::TokenMoved),
            ),
        ];
        for (now, state, running, want) in table {
            let got = plan(ms(now), state, t0, running, grace);
            assert_eq!(got, want, "at {now} ms, {state:?}, running {running:?}");
        }
    }

    #[test]
    fn shutdown_waits_out_the_grace_only_while_leading() {
        let t0 = clock::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let grace = Duration::from_secs(2);
        let lead = leading(7, ms(13_000));
        for (now, state, want) in [
            (0, &lead, 2_000),
            (12_000, &lead, 12_900),
            (13_000, &lead, 13_000),
            (50, &LeaderState::Unknown, 50),
        ] {
            assert_eq!(
                shutdown_kill_at(ms(now), state, t0, grace),
                ms(want),
                "{now}"
            );
        }
        assert_eq!(
            shutdown_kill_at(ms(0), &lead, t0, Duration::MAX),
            ms(12_900)
        );
    }

    #[test]
    fn a_renewal_starts_a_new_window() {
        let t0 = clock::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let mut seen = Seen {
            valid_until: None,
            since: t0,
        };
        assert!(seen.update(&leading(7, ms(1_600)), ms(10)));
        assert_eq!(seen.since, ms(10));
        assert!(!seen.update(&leading(7, ms(1_600)), ms(500)), "no news");
        assert_eq!(seen.since, ms(10));
        assert!(seen.update(&leading(7, ms(2_300)), ms(700)));
        assert_eq!(seen.since, ms(700));
        assert!(!seen.update(&LeaderState::Unknown, ms(800)));
        assert_eq!(seen.valid_until, None);
    }

    #[test]
    fn bad_grace_is_refused() {
        for bad in [-1.0, f64::NAN, f64::INFINITY, 3600.5, 1e300] {
            assert!(grace_of(bad).is_err(), "{bad}");
        }
        assert_eq!(grace_of(0.25).ok(), Some(Duration::from_millis(250)));
    }

    #[test]
    fn proc_stat_lines_parse_even_with_odd_command_names() {
        let line = "4242 (we ird) (x)) S 17 4242 4242 0 -1 4194560 99 0 0 0";
        assert_eq!(
            parse_stat(line),
            Some(ProcInfo {
                pid: 4242,
                ppid: 17,
                pgid: 4242,
                zombie: false
            })
        );
        assert_eq!(parse_stat("5 (sh) Z 1 5 5").map(|p| p.zombie), Some(true));
        assert_eq!(parse_stat("garbage"), None);
        assert_eq!(parse_stat("5 (sh) S 1"), None);
    }

    #[test]
    fn command_processes_are_our_descendants_outside_our_group_at_any_depth() {
        let p = |pid, ppid, pgid| ProcInfo {
            pid,
            ppid,
            pgid,
            zombie: false,
        };
        // 10 is us (group 9); 11 the command (its own session and group), 12 its child, 13 a
        // grandchild that escaped into a session of its own; 14 an orphan of the command
        // re-parented to us; 15 a credential plugin we started (our group) and 16 its child;
        // 20 and 21 unrelated.
        let table = [
            p(1, 0, 1),
            p(10, 1, 9),
            p(11, 10, 11),
            p(12, 11, 11),
            p(13, 12, 13),
            p(14, 10, 11),
            p(15, 10, 9),
            p(16, 15, 9),
            p(20, 1, 20),
            p(21, 20, 20),
        ];
        let mut got: Vec<i32> = command_processes(&table, 10, 9)
            .iter()
            .map(|p| p.pid)
            .collect();
        got.sort();
        assert_eq!(got, [11, 12, 13, 14]);
        assert!(command_processes(&table, 13, 9).is_empty());
    }
}
