//! `fencedlease campaign` stops the command's whole process tree (children, grandchildren, and
//! those that escaped into a session of their own), not just its direct child, and does so by
//! the end of leadership validity: processes that survive keep acting with a stale token.

use fencedlease_testkit as common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::procs::{now_ns, scratch_dir, spawn_fencedlease_env, Proc};
use common::{client, ensure_crd, eventually, kubeconfig_path, TestNamespace};
use fencedlease::api::FencedLease;
use kube::api::{Patch, PatchParams};
use kube::Api;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Children in the background, and a grandchild under a second shell; SIGTERM is ignored
/// throughout (an ignored signal stays ignored across exec), so only SIGKILL stops them.
/// Every process appends its pid to the file named by `$0`.
const NESTED: &str = r#"trap '' TERM; echo $$ >> "$0"
sleep 1000 & echo $! >> "$0"
sleep 1000 & echo $! >> "$0"
sh -c 'sleep 1000 & echo $! >> "$0"; wait' "$0" & echo $! >> "$0"
wait"#;
const NESTED_PIDS: usize = 5;

/// Two grandchildren leave the command's session and process group: one in place (`setsid`
/// from a background job execs), one by forking (`setsid -f`: it is orphaned at once).
const ESCAPING: &str = r#"trap '' TERM; echo $$ >> "$0"
setsid sleep 1000 & echo $! >> "$0"
setsid -f sh -c 'echo $$ >> "$0"; exec sleep 1000' "$0"
sleep 1000 & echo $! >> "$0"
wait"#;
const ESCAPING_PIDS: usize = 4;

/// Both scripts start three processes that end up running `sleep`.
const SLEEPERS: usize = 3;

/// A process's command name (`/proc/PID/comm`).
fn comm(pid: i32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|c| c.trim().to_string())
}

/// A campaign running `sh -c SCRIPT PIDFILE`.
struct TreeCampaign {
    proc: Proc,
    pid_file: PathBuf,
}

impl TreeCampaign {
    fn start(
        dir: &Path,
        ns: &str,
        script: &str,
        flags: &[&str],
        env: &[(&str, &std::ffi::OsStr)],
    ) -> Self {
        let pid_file = dir.join("pids");
        let events = dir.join("a.events");
        let mut args = vec![
            "campaign",
            "--lease",
            "db",
            "--namespace",
            ns,
            "--identity",
            "a",
            "--events-file",
            events.to_str().expect("utf-8"),
        ];
        args.extend_from_slice(flags);
        args.extend_from_slice(&["--", "sh", "-c", script, pid_file.to_str().expect("utf-8")]);
        let proc = spawn_fencedlease_env("a", dir, &args, env);
        TreeCampaign { proc, pid_file }
    }

    fn pids(&self) -> Vec<i32> {
        std::fs::read_to_string(&self.pid_file)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    fn events(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.proc.events)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// The first event named `name` at or after `after_ns`.
    async fn event_after(&self, name: &str, after_ns: i128, timeout: Duration) -> Value {
        eventually(timeout, &format!("a {name:?} event"), || async {
            self.events()
                .into_iter()
                .find(|e| e["event"] == name && t_ns(e) >= after_ns)
        })
        .await
    }

    /// Waits until the command leads and all `n` of its processes run; returns their pids.
    async fn running(&self, n: usize) -> Vec<i32> {
        self.event_after("leading", 0, Duration::from_secs(30))
            .await;
        let pids = eventually(
            Duration::from_secs(10),
            "the command's processes",
            || async {
                let pids = self.pids();
                (pids.len() == n && pids.iter().all(|p| alive(*p))).then_some(pids)
            },
        )
        .await;
        // A process writes its pid before it execs: wait until the sleepers run `sleep`, their
        // last exec (after `setsid` for those that escape).
        eventually(Duration::from_secs(10), "the sleepers to exec", || async {
            let sleeping = pids
                .iter()
                .filter(|p| comm(**p).as_deref() == Some("sleep"));
            (sleeping.count() == SLEEPERS).then_some(())
        })
        .await;
        pids
    }
}

impl Drop for TreeCampaign {
    /// Whatever the test's outcome, leave no sleeper behind.
    fn drop(&mut self) {
        for pid in self.pids() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

fn t_ns(e: &Value) -> i128 {
    e["t_ns"].as_i64().map_or(0, i128::from)
}

/// The fields of /proc/PID/stat after the command name: state, ppid, pgrp, session, ...
fn stat_fields(pid: i32) -> Option<Vec<String>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = text.rsplit_once(')')?;
    Some(rest.split_whitespace().map(str::to_string).collect())
}

fn alive(pid: i32) -> bool {
    stat_fields(pid).is_some_and(|f| f.first().map(String::as_str) != Some("Z"))
}

fn session(pid: i32) -> Option<String> {
    stat_fields(pid).and_then(|f| f.get(3).cloned())
}

/// Those of `pids` that still exist in any form (a zombie too: the campaign reaps them).
fn still_there(pids: &[i32]) -> Vec<i32> {
    pids.iter()
        .copied()
        .filter(|p| Path::new(&format!("/proc/{p}")).exists())
        .collect()
}

/// Another holder takes the lease from "a" (an administrator's revocation).
async fn revoke(client: &kube::Client, ns: &str) -> i128 {
    let api: Api<FencedLease> = Api::namespaced(client.clone(), ns);
    let at = now_ns();
    api.patch(
        "db",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"holderIdentity": "usurper"}})),
    )
    .await
    .expect("revoke the lease");
    at
}

/// Revokes the lease from a campaign running `script` and checks that every process of the
/// command is gone by the time the campaign says so, and that this came at once, not after
/// the 5 s grace.
async fn revocation_kills_the_tree(prefix: &str, script: &str, n: usize) -> Vec<i32> {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, prefix).await;
    let dir = scratch_dir(prefix);
    let flags = ["--lease-duration", "10", "--grace-seconds", "5"];
    let c = TreeCampaign::start(&dir, &ns.name, script, &flags, &[]);
    let pids = c.running(n).await;
    let revoked_at = revoke(&client, &ns.name).await;
    let gone = c
        .event_after("command_gone", revoked_at, Duration::from_secs(10))
        .await;
    let left = still_there(&pids);
    assert!(
        left.is_empty(),
        "processes {left:?} of {pids:?} outlived the loss of the lease ({gone}):\n{}",
        c.proc.log_tail()
    );
    let stopped = c.event_after("stopped", revoked_at, Duration::ZERO).await;
    assert_eq!(stopped["reason"], "lost", "{stopped}");
    // At once, not after the grace: the SIGKILL was due when the stop began.
    let kill_at = stopped["kill_at_ns"]
        .as_i64()
        .map(i128::from)
        .expect("kill_at_ns");
    assert!(
        kill_at <= t_ns(&stopped),
        "a lost lease must kill at once, not after the grace: SIGKILL due {:.0} ms after the stop",
        (kill_at - t_ns(&stopped)) as f64 / 1e6
    );
    let took_ms = (t_ns(&gone) - revoked_at) as f64 / 1e6;
    eprintln!("{prefix}: the whole tree was gone {took_ms:.0} ms after the revocation");
    pids
}

#[tokio::test]
async fn losing_the_lease_kills_children_and_grandchildren_at_once() {
    revocation_kills_the_tree("tree-nested", NESTED, NESTED_PIDS).await;
}

#[tokio::test]
async fn grandchildren_that_escape_into_a_session_of_their_own_are_killed_too() {
    let client = client().await;
    ensure_crd();
    // First check that the script does escape: the setsid'd sleepers are in other sessions.
    {
        let ns = TestNamespace::new(&client, "tree-escape-check").await;
        let dir = scratch_dir("tree-escape-check");
        let flags = ["--lease-duration", "10", "--grace-seconds", "5"];
        let c = TreeCampaign::start(&dir, &ns.name, ESCAPING, &flags, &[]);
        let pids = c.running(ESCAPING_PIDS).await;
        let sessions: Vec<Option<String>> = pids.iter().map(|p| session(*p)).collect();
        let escaped = sessions.iter().filter(|s| **s != sessions[0]).count();
        assert_eq!(
            escaped, 2,
            "two grandchildren left the command's session: {sessions:?}"
        );
        c.proc.signal(nix::sys::signal::Signal::SIGTERM);
    }
    revocation_kills_the_tree("tree-escape", ESCAPING, ESCAPING_PIDS).await;
}

/// Issue 33, hole 10: campaign SIGKILLed (as the OOM killer would) takes the command's whole
/// tree with it, the grandchildren that escaped into sessions of their own included: nothing
/// keeps working with the token once the process that renews it is gone. (The keeper between
/// them, src/campaign/keeper.rs, sees campaign's end of its pipe close.)
#[tokio::test]
async fn a_sigkilled_campaign_takes_the_command_s_whole_tree_with_it() {
    let client = client().await;
    ensure_crd();
    for (prefix, script, n) in [
        ("tree-kill9-nested", NESTED, NESTED_PIDS),
        ("tree-kill9-escape", ESCAPING, ESCAPING_PIDS),
    ] {
        let ns = TestNamespace::new(&client, prefix).await;
        let dir = scratch_dir(prefix);
        let flags = ["--lease-duration", "10", "--grace-seconds", "5"];
        let mut c = TreeCampaign::start(&dir, &ns.name, script, &flags, &[]);
        let pids = c.running(n).await;
        c.proc.signal(nix::sys::signal::Signal::SIGKILL);
        assert_eq!(
            c.proc.wait_exit(Duration::from_secs(10)),
            Some(-1),
            "campaign ended by its SIGKILL (no exit code)"
        );
        // The ceiling only stops a hung test; without the keeper the tree runs on for good.
        eventually(
            Duration::from_secs(20),
            &format!("{prefix}: every process of the command to end"),
            || async {
                let left: Vec<i32> = pids.iter().copied().filter(|p| alive(*p)).collect();
                left.is_empty()
                    .then_some(())
                    .ok_or(format!("still running: {left:?}"))
            },
        )
        .await;
    }
}

/// A TCP forwarder to the API server that can be cut like a network partition: bytes stop
/// flowing both ways, connections stay open, new ones are taken and never answered.
struct Partition {
    port: u16,
    open: Arc<AtomicBool>,
}

impl Partition {
    async fn start(upstream: String) -> Partition {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the forwarder");
        let port = listener.local_addr().expect("addr").port();
        let open = Arc::new(AtomicBool::new(true));
        let flag = open.clone();
        tokio::spawn(async move {
            while let Ok((down, _)) = listener.accept().await {
                let (upstream, flag) = (upstream.clone(), flag.clone());
                tokio::spawn(async move {
                    let Ok(up) = tokio::net::TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let (dr, dw) = down.into_split();
                    let (ur, uw) = up.into_split();
                    tokio::join!(pump(dr, uw, flag.clone()), pump(ur, dw, flag));
                });
            }
        });
        Partition { port, open }
    }

    fn cut(&self) {
        self.open.store(false, Ordering::SeqCst);
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    open: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if !open.load(Ordering::SeqCst) {
            std::future::pending::<()>().await; // hold the connection, answer nothing
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// The test cluster's server URL, as its kubeconfig names it.
fn server_url() -> String {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig_path()).expect("read the kubeconfig");
    kc.clusters
        .iter()
        .find_map(|c| c.cluster.as_ref().and_then(|c| c.server.clone()))
        .expect("a server in the kubeconfig")
}

/// The server's host:port, which must be on 127.0.0.1: the forwarder listens there too, and
/// the server's certificate names 127.0.0.1 (the port is not checked).
fn server_address() -> String {
    let server = server_url();
    let host_port = server
        .strip_prefix("https://")
        .expect("an https server")
        .trim_end_matches('/')
        .to_string();
    assert!(
        host_port.starts_with("127.0.0.1:"),
        "the forwarder needs a server on 127.0.0.1, not {server}"
    );
    host_port
}

/// The test cluster's kubeconfig with the server reached through `port` on 127.0.0.1.
fn kubeconfig_through(port: u16, dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(kubeconfig_path()).expect("read the kubeconfig");
    let proxied = dir.join("kubeconfig");
    let via = format!("https://127.0.0.1:{port}");
    std::fs::write(&proxied, text.replace(&server_url(), &via)).expect("write the kubeconfig");
    proxied
}

/// The campaign is cut off from the API server: renewals stop, and nobody tells it that it
/// lost. Its command ignores SIGTERM, so only SIGKILL stops it: the whole tree must be killed
/// no later than the end of the validity the campaign last announced, after SIGTERM went out
/// the grace before.
#[tokio::test]
async fn cut_off_from_the_api_server_the_tree_is_killed_before_validity_ends() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "tree-cut").await;
    let dir = scratch_dir("tree-cut");
    let partition = Partition::start(server_address()).await;
    let kubeconfig = kubeconfig_through(partition.port, &dir);
    let env = [("KUBECONFIG", kubeconfig.as_os_str())];
    // A 3 s lease: 2.4 s of validity per renewal, one renewal a second.
    let flags = ["--lease-duration", "3", "--grace-seconds", "0.5"];
    let c = TreeCampaign::start(&dir, &ns.name, NESTED, &flags, &env);
    let pids = c.running(NESTED_PIDS).await;
    c.event_after("renewed", 0, Duration::from_secs(10)).await;
    partition.cut();
    let cut_at = now_ns();
    let gone = c
        .event_after("command_gone", cut_at, Duration::from_secs(10))
        .await;
    let left = still_there(&pids);
    assert!(
        left.is_empty(),
        "{left:?} outlived validity:\n{}",
        c.proc.log_tail()
    );
    // The validity it last announced before it stopped the command.
    let evs = c.events();
    let valid_until = evs
        .iter()
        .filter(|e| (e["event"] == "leading" || e["event"] == "renewed") && t_ns(e) <= t_ns(&gone))
        .filter_map(|e| e["valid_until_ns"].as_i64().map(i128::from))
        .max()
        .expect("an announced validity");
    let stopped = c.event_after("stopped", cut_at, Duration::ZERO).await;
    assert_eq!(stopped["reason"], "renewal_overdue", "{stopped}");
    let sigkill = gone["sigkill_ns"]
        .as_i64()
        .map(i128::from)
        .expect("SIGKILL was needed: the command ignores SIGTERM");
    let ms = |ns: i128| ns as f64 / 1e6;
    eprintln!(
        "cut off: SIGTERM {:.0} ms, SIGKILL {:.0} ms, all gone {:.0} ms before validity ended",
        ms(valid_until - t_ns(&stopped)),
        ms(valid_until - sigkill),
        ms(valid_until - t_ns(&gone)),
    );
    // The claim (README): SIGKILL by the end of validity. And the tree is gone before anyone
    // else could hold the lease: validity (0.8 of the 3 s lease from a renewal) ends 0.6 s
    // before the lease could expire for another candidate.
    assert!(sigkill <= valid_until, "SIGKILL after validity ended");
    let others_may_acquire = valid_until + 600_000_000;
    assert!(
        t_ns(&gone) <= others_may_acquire,
        "the tree was not gone before another candidate could hold the lease ({:.0} ms after validity ended)",
        ms(t_ns(&gone) - valid_until)
    );
    // SIGTERM came the grace (0.5 s) before SIGKILL, give or take a timer's lateness.
    let grace_ms = ms(sigkill - t_ns(&stopped));
    assert!(
        (450.0..700.0).contains(&grace_ms),
        "SIGTERM {grace_ms} ms before SIGKILL"
    );
}
