//! The one clock every deadline of a tenure is on: CLOCK_BOOTTIME.
//!
//! `std::time::Instant` and tokio's `Instant` read CLOCK_MONOTONIC, which stops while the
//! machine is suspended. A holder resumed from a suspend longer than its lease would find its
//! validity still running on that clock while another holder has taken over. CLOCK_BOOTTIME
//! counts the suspend too, so this module puts tokio's instants on it: [`now`] is tokio's
//! `Instant::now()` moved on by the time the machine spent suspended since this process first
//! asked. Deadlines computed from [`now`] and compared with [`now`] count the suspend; a tokio
//! timer for such a deadline is armed at [`timer_for`] (tokio sleeps on CLOCK_MONOTONIC), and a
//! timer armed before a suspend fires late, so whoever sleeps until a deadline also waits on
//! [`Resumes::next`], which returns within [`RESUME_CHECK`] of a resume.
//!
//! Off Linux (no CLOCK_BOOTTIME) no suspend is seen: the clock is tokio's.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use tokio::time::Instant;

/// How often a sleeper looks whether the machine was suspended meanwhile.
pub const RESUME_CHECK: Duration = Duration::from_secs(1);

/// Gaps between the two clocks below this are read jitter (the two are read one after the
/// other), not a suspend.
const JITTER: Duration = Duration::from_millis(1);

#[cfg(target_os = "linux")]
fn read(clock: libc::clockid_t) -> Option<Duration> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through the valid pointer it is given.
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    let secs = u64::try_from(ts.tv_sec).ok()?;
    let nanos = u32::try_from(ts.tv_nsec).ok()?;
    (rc == 0).then(|| Duration::new(secs, nanos))
}

/// CLOCK_BOOTTIME minus CLOCK_MONOTONIC: it grows by exactly the time spent suspended.
fn gap() -> Duration {
    #[cfg(target_os = "linux")]
    if let (Some(boot), Some(mono)) = (read(libc::CLOCK_BOOTTIME), read(libc::CLOCK_MONOTONIC)) {
        return boot.saturating_sub(mono);
    }
    Duration::ZERO
}

static BASE: OnceLock<Duration> = OnceLock::new();
static SIMULATED_NANOS: AtomicU64 = AtomicU64::new(0);

/// The pure part: the suspended time, from the gap between the clocks when the process first
/// asked (`base`) and now (`gap`), ignoring read jitter.
pub fn suspended_between(base: Duration, gap: Duration) -> Duration {
    let grown = gap.saturating_sub(base);
    if grown < JITTER {
        Duration::ZERO
    } else {
        grown
    }
}

/// How long the machine was suspended since this process first asked.
pub fn suspended() -> Duration {
    let base = *BASE.get_or_init(gap);
    let simulated = Duration::from_nanos(SIMULATED_NANOS.load(Ordering::SeqCst));
    suspended_between(base, gap()) + simulated
}

/// Now, on CLOCK_BOOTTIME: tokio's now moved on by the time spent suspended.
pub fn now() -> Instant {
    Instant::now() + suspended()
}

/// The tokio instant (CLOCK_MONOTONIC) at which a timer for `deadline` (on this clock) fires,
/// as far as the suspends so far are known.
pub fn timer_for(deadline: Instant) -> Instant {
    deadline.checked_sub(suspended()).unwrap_or(deadline)
}

/// Tells a sleeper that the machine was suspended: [`Resumes::next`] returns once the time
/// spent suspended has grown since the last return.
#[derive(Debug)]
pub struct Resumes {
    seen: Duration,
    tick: tokio::time::Interval,
}

impl Default for Resumes {
    fn default() -> Self {
        Resumes::new()
    }
}

impl Resumes {
    /// Starts looking, every [`RESUME_CHECK`].
    pub fn new() -> Resumes {
        let mut tick = tokio::time::interval(RESUME_CHECK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Resumes {
            seen: suspended(),
            tick,
        }
    }

    /// Returns after the next resume from a suspend (cancel-safe: drop it in a `select!`).
    pub async fn next(&mut self) {
        loop {
            self.tick.tick().await;
            let now = suspended();
            if now > self.seen {
                self.seen = now;
                return;
            }
        }
    }
}

/// Makes this process's clock behave as if the machine had just been suspended for `d`: for
/// tests of what a resumed holder does, since a test machine cannot suspend itself.
#[doc(hidden)]
pub fn simulate_suspend(d: Duration) {
    let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
    SIMULATED_NANOS.fetch_add(nanos, Ordering::SeqCst);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_suspended_time_is_what_the_gap_between_the_clocks_grew_by() {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        #[rustfmt::skip]
        let table = [
            // (gap when first asked, gap now, suspended)
            (s(100), s(100), s(0)),
            (s(100), s(100) + Duration::from_micros(40), s(0)), // read jitter
            (s(100), s(100) + ms(2), ms(2)),
            (s(100), s(130), s(30)),
            (s(100), s(99), s(0)), // never negative
        ];
        for (base, gap, want) in table {
            assert_eq!(suspended_between(base, gap), want, "{base:?} {gap:?}");
        }
    }

    #[test]
    fn the_clocks_can_be_read_and_a_fresh_process_saw_no_suspend() {
        // On the test machine nothing suspends: the gap does not grow while the test runs.
        let base = gap();
        assert_eq!(suspended_between(base, gap()), Duration::ZERO);
        let t = now();
        assert!(timer_for(t) <= t);
    }
}
