//! The keeper: the process between `fencedlease campaign` and its command, which ends the
//! command's whole tree when campaign ends, however it ends (SIGKILL and the OOM killer
//! included), so that no process keeps working with a token after the one renewing it is gone.
//!
//! campaign starts `fencedlease keep --watch-fd N -- COMMAND...` in a session of its own and
//! keeps the write end of a pipe whose read end is fd N; nothing else holds that write end. The
//! keeper starts the command in its own process group (so campaign's signals to the group
//! reach both), blocks on the pipe, and when the read returns (end of file: campaign is gone)
//! SIGKILLs every descendant, those that left the session included (the keeper is a child
//! subreaper, so orphans stay its descendants), then exits. While campaign lives, campaign signals the tree as before
//! (`super::tree`); the keeper outlives its SIGTERM and exits with the command's status.

use std::os::fd::{BorrowedFd, RawFd};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context as _;
use nix::fcntl::{fcntl, FcntlArg, FdFlag};
use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};

/// `fencedlease keep`: not for people (campaign runs it).
#[derive(Debug, clap::Args)]
pub struct KeepArgs {
    /// The read end of campaign's pipe: its end of file means campaign is gone.
    #[arg(long)]
    pub watch_fd: RawFd,
    /// The command, as campaign was given it.
    #[arg(last = true, required = true, num_args = 1..)]
    pub command: Vec<String>,
}

/// The keeper's argument list for `command`, watching `fd`.
pub(crate) fn keeper_args(fd: RawFd, command: &[String]) -> Vec<String> {
    let mut args = vec![
        "keep".into(),
        "--watch-fd".into(),
        fd.to_string(),
        "--".into(),
    ];
    args.extend(command.iter().cloned());
    args
}

/// The exit code tells campaign how the command ended: its own code, or 128 plus the signal
/// that ended it (as shells report it).
extern "C" fn ignore(_: nix::libc::c_int) {}

/// Survives the SIGTERM (and SIGINT, SIGHUP) campaign sends the whole tree: a handler, not
/// SIG_IGN, so that the command, whose dispositions exec resets, still gets them.
fn outlive_polite_signals() -> anyhow::Result<()> {
    let act = SigAction::new(
        SigHandler::Handler(ignore),
        SaFlags::SA_RESTART,
        SigSet::empty(),
    );
    for sig in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
        // SAFETY: the handler does nothing, so it is async-signal-safe.
        unsafe { sigaction(sig, &act) }.with_context(|| format!("handling {sig}"))?;
    }
    Ok(())
}

/// Runs the keeper: returns the command's exit code, or never returns when campaign is gone.
pub(crate) fn run(args: KeepArgs) -> anyhow::Result<ExitCode> {
    // SAFETY: campaign put the pipe's read end at this number for this process; it stays open
    // for the process's whole life.
    let watch = unsafe { BorrowedFd::borrow_raw(args.watch_fd) };
    fcntl(watch, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC))
        .context("keep: --watch-fd is not an open file descriptor")?;
    nix::sys::prctl::set_child_subreaper(true)
        .context("keep: making this process a child subreaper failed")?;
    outlive_polite_signals()?;
    let (program, rest) = args.command.split_first().context("keep: no command")?;
    let child = std::process::Command::new(program)
        .args(rest)
        .spawn()
        .with_context(|| format!("starting {program:?}"))?;
    let command = i32::try_from(child.id()).context("keep: the command's pid")?;
    let fd = args.watch_fd;
    std::thread::Builder::new()
        .name("campaign-watch".into())
        .spawn(move || {
            wait_for_end_of_file(fd);
            // Held until the process ends: the main thread cannot exit under the kill.
            let _ending = ENDING.lock();
            DYING.store(true, Ordering::SeqCst);
            kill_everything();
        })
        .context("keep: starting the watch thread")?;
    let code = reap_until_the_command_exits(command);
    // Campaign is gone: the watch thread ends the process once the whole tree is dead; this
    // thread only reaps meanwhile, so that no second exit races it.
    while DYING.load(Ordering::SeqCst) {
        reap_until_the_command_exits(-1);
        std::thread::park_timeout(std::time::Duration::from_millis(10));
    }
    // Blocks for good if the watch thread began the kill meanwhile (it holds the lock).
    let _ending = ENDING.lock();
    Ok(ExitCode::from(code))
}

/// Set by the watch thread when campaign is gone; from then on it alone ends the process.
static DYING: AtomicBool = AtomicBool::new(false);
/// Whoever holds it ends the process: the watch thread (the kill) or the main thread (the
/// command's own exit), never both.
static ENDING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Reaps every child (the keeper is a subreaper: the command's orphans are its children too)
/// until the command, `command`, has exited; returns its exit code. With no command left to
/// wait for (-1), reaps what is there and returns.
fn reap_until_the_command_exits(command: i32) -> u8 {
    use nix::sys::wait::{waitpid, WaitStatus};
    loop {
        match waitpid(None, None) {
            Ok(WaitStatus::Exited(pid, code)) if pid.as_raw() == command => {
                return u8::try_from(code).unwrap_or(1)
            }
            Ok(WaitStatus::Signaled(pid, sig, _)) if pid.as_raw() == command => {
                return u8::try_from(128 + sig as i32).unwrap_or(1)
            }
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(_) => return 1, // no child left (ECHILD): nothing more to wait for
        }
    }
}

/// Blocks until the pipe's write end (campaign's) is closed.
fn wait_for_end_of_file(fd: RawFd) {
    let mut buf = [0u8; 64];
    loop {
        // SAFETY: as in `run`: the descriptor stays open for the process's life.
        let watch = unsafe { BorrowedFd::borrow_raw(fd) };
        match nix::unistd::read(watch, &mut buf) {
            Ok(0) => return,
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(_) => return, // the pipe is unusable: count it as campaign gone (fail safe)
        }
    }
}

/// SIGKILLs every descendant of this process until none is left, then this process (its
/// exit code, 137, is what a SIGKILLed command reports).
fn kill_everything() -> ! {
    super::tree::kill_all_descendants();
    std::process::exit(137)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_keeper_is_given_the_pipe_and_the_command() {
        assert_eq!(
            keeper_args(5, &["sh".into(), "-c".into(), "x".into()]),
            ["keep", "--watch-fd", "5", "--", "sh", "-c", "x"]
        );
    }
}
