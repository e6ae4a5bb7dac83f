//! Candidate processes for the election tests: `fencedlease campaign` and `controller` run as
//! real separate processes against the test cluster.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::kubeconfig_path;

/// One line of a campaign's `--events-file`.
#[derive(Clone, Debug, serde::Deserialize)]
pub struct Ev {
    pub t_ns: i128,
    pub identity: String,
    pub event: String,
    pub token: Option<i64>,
    pub lease_uid: Option<String>,
    pub valid_until_ns: Option<i128>,
    /// The holder a `following` event names (None: nobody holds the lease).
    #[serde(default)]
    pub holder: Option<String>,
    /// Why a `stopped` event stopped: `lost`, `token_moved`, ...
    #[serde(default)]
    pub reason: Option<String>,
}

pub struct Proc {
    pub name: String,
    pub child: Child,
    pub events: PathBuf,
    pub log: PathBuf,
}

impl Proc {
    pub fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).expect("pid fits i32")
    }
    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), sig)
            .unwrap_or_else(|e| panic!("sending {sig} to {}: {e}", self.name));
    }
    pub fn events(&self) -> Vec<Ev> {
        read_events(&self.events)
    }
    pub fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
    /// Waits up to `timeout` for the process to exit; returns its exit code.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let deadline = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.code().or(Some(-1));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.pid());
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until campaign `p` has seen `holder` hold the lease while it follows (its `following`
/// event): it watches the lease. The ceiling only stops a hung test.
pub async fn following(p: &Proc, holder: &str) {
    let what = format!(
        "{} to see {holder} hold the lease (log: {})",
        p.name,
        p.log.display()
    );
    super::eventually(Duration::from_secs(60), &what, || async {
        p.events()
            .iter()
            .any(|e| e.event == "following" && e.holder.as_deref() == Some(holder))
            .then_some(())
    })
    .await;
}

pub fn read_events(path: &Path) -> Vec<Ev> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    // Only whole lines: the writer may be appending the last one right now.
    let whole = match text.rfind('\n') {
        Some(i) => &text[..=i],
        None => "",
    };
    whole
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad event line {l:?}: {e}")))
        .collect()
}

pub fn scratch_dir(test: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("fencedlease-test-{test}-{:08x}", super::rand_u32()));
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

pub fn spawn_fencedlease(name: &str, dir: &Path, args: &[&str]) -> Proc {
    spawn_fencedlease_env(name, dir, args, &[])
}

/// As [`spawn_fencedlease`], with extra environment variables that win over its own (a
/// `KUBECONFIG` through a proxy, say).
pub fn spawn_fencedlease_env(
    name: &str,
    dir: &Path,
    args: &[&str],
    env: &[(&str, &std::ffi::OsStr)],
) -> Proc {
    let events = dir.join(format!("{name}.events"));
    let log = dir.join(format!("{name}.log"));
    let logf = std::fs::File::create(&log).expect("create log");
    let child = Command::new(super::fencedlease_bin())
        .args(args)
        .env("KUBECONFIG", kubeconfig_path())
        .env("RUST_LOG", "info,kube=warn")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(logf.try_clone().expect("dup log"))
        .stderr(logf)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {name}: {e}"));
    Proc {
        name: name.to_string(),
        child,
        events,
        log,
    }
}

/// A campaign whose command records its token and then lives as long as its parent.
pub fn campaign(dir: &Path, ns: &str, lease: &str, identity: &str, duration: u32) -> Proc {
    let events = dir.join(format!("{identity}.events"));
    let duration = duration.to_string();
    // Also bounded in time: if the campaign is SIGKILLed and its PID is reused, `kill -0`
    // would keep an orphaned loop alive forever.
    let script = "echo \"$FENCEDLEASE_TOKEN\" >> \"$0.tokens\"; i=0; \
                  while kill -0 $PPID 2>/dev/null && [ $i -lt 3000 ]; do sleep 0.1; i=$((i+1)); done";
    let base = dir.join(identity);
    spawn_fencedlease(
        identity,
        dir,
        &[
            "campaign",
            "--lease",
            lease,
            "--namespace",
            ns,
            "--identity",
            identity,
            "--lease-duration",
            &duration,
            "--grace-seconds",
            "2",
            "--events-file",
            events.to_str().expect("utf-8"),
            "--",
            "sh",
            "-c",
            script,
            base.to_str().expect("utf-8"),
        ],
    )
}

/// The controller, scoped to one namespace, with its election lease there too.
pub fn controller(dir: &Path, ns: &str, identity: &str) -> Proc {
    controller_with(dir, ns, identity, &[])
}

/// The controller with extra flags.
pub fn controller_with(dir: &Path, ns: &str, identity: &str, extra: &[&str]) -> Proc {
    controller_env(dir, ns, identity, extra, &[])
}

/// The controller with extra flags and environment variables (`RUST_LOG`, say).
pub fn controller_env(
    dir: &Path,
    ns: &str,
    identity: &str,
    extra: &[&str],
    env: &[(&str, &std::ffi::OsStr)],
) -> Proc {
    let mut args = vec![
        "controller",
        "--namespace",
        ns,
        "--election-namespace",
        ns,
        "--identity",
        identity,
    ];
    if !extra.contains(&"--metrics-addr") {
        args.extend_from_slice(&["--metrics-addr", "127.0.0.1:0"]);
    }
    args.extend_from_slice(extra);
    spawn_fencedlease_env(identity, dir, &args, env)
}

/// A leadership claim as the candidate itself judged it: from its "leading" event until its
/// "stopped" event or the end of validity it last announced, whichever came first.
#[derive(Clone, Debug)]
pub struct Claim {
    pub identity: String,
    pub token: i64,
    pub lease_uid: String,
    pub start_ns: i128,
    pub end_ns: i128,
}

pub fn claims(events: &[Ev], now_ns: i128) -> Vec<Claim> {
    let mut out = Vec::new();
    let mut open: Option<Claim> = None;
    for e in events {
        match e.event.as_str() {
            "leading" => {
                if let Some(c) = open.take() {
                    out.push(c);
                }
                open = Some(Claim {
                    identity: e.identity.clone(),
                    token: e.token.unwrap_or_default(),
                    lease_uid: e.lease_uid.clone().unwrap_or_default(),
                    start_ns: e.t_ns,
                    end_ns: e.valid_until_ns.unwrap_or(e.t_ns),
                });
            }
            "renewed" => {
                if let (Some(c), Some(v)) = (open.as_mut(), e.valid_until_ns) {
                    // A renewal announced before validity ran out extends the claim.
                    if e.t_ns < c.end_ns {
                        c.end_ns = c.end_ns.max(v);
                    }
                }
            }
            "stopped" | "exited" => {
                if let Some(mut c) = open.take() {
                    c.end_ns = c.end_ns.min(e.t_ns);
                    out.push(c);
                }
            }
            _ => {}
        }
    }
    if let Some(mut c) = open {
        c.end_ns = c.end_ns.min(now_ns.max(c.start_ns));
        out.push(c);
    }
    out
}

/// Panics if two different candidates' claims overlap in time.
pub fn assert_no_overlap(all: &[Claim]) {
    for (i, a) in all.iter().enumerate() {
        for b in &all[i + 1..] {
            if a.identity != b.identity {
                let overlap = a.start_ns < b.end_ns && b.start_ns < a.end_ns;
                assert!(!overlap, "two leaders at once:\n  {a:?}\n  {b:?}");
            }
        }
    }
}

pub fn now_ns() -> i128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i128)
        .unwrap_or_default()
}
