//! Run work only while leading: [`run_while_leading`] campaigns and, each time this participant
//! comes to lead, runs the work for that tenure (a kube-runtime `Controller`, say), and stops
//! it as the tenure ends; at shutdown it stops the work first and releases the lease after, so
//! that nothing acts on the lease once another may hold it.

use std::future::Future;
use std::time::Duration;

use kube::Client;
use tokio::sync::watch;

use crate::lease::clock;
use crate::lease::elector::{Elector, ElectorConfig, ElectorHandle, Error, LeaderState};
use crate::lease::rules::FencingToken;

/// How long the work may take to stop at shutdown while still leading (it is dropped then).
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// How often a tenure's end is looked at again while nothing changes (the deadline is on the
/// elector's clock, which counts time suspended, and tokio's timers do not).
const RECHECK: Duration = Duration::from_millis(500);

/// One tenure of this participant: what the work gets each time it comes to lead.
#[derive(Clone, Debug)]
pub struct Tenure {
    /// The token of this tenure at its start (spec edits may move it on; writes through
    /// [`fenced_client`](crate::client::fenced_client) always take the current one).
    pub token: FencingToken,
    /// Which of this participant's tenures (1 for the first).
    pub number: u64,
    state: watch::Receiver<LeaderState>,
    stop: watch::Receiver<bool>,
}

impl Tenure {
    /// Completes when this tenure has ended: the lease was lost, released or handed over, or
    /// its validity ran out without a renewal. The work is dropped then anyway; awaiting this
    /// lets it end in order (e.g. `Controller::graceful_shutdown_on(tenure.ended())`).
    pub async fn ended(&self) {
        tenure_over(self.state.clone(), self.number).await;
    }

    /// Completes when the work should stop: at shutdown (while still leading, so it may finish
    /// what it is doing; it is dropped when the tenure ends) or when the tenure ends.
    pub async fn stopping(&self) {
        let mut stop = self.stop.clone();
        tokio::select! {
            _ = stop.wait_for(|s| *s) => {}
            () = self.ended() => {}
        }
    }

    /// The state channel, to read the current token ([`LeaderState::leading_token`]).
    pub fn state(&self) -> watch::Receiver<LeaderState> {
        self.state.clone()
    }
}

/// Whether `state` is tenure `number`, valid at `now`; its deadline if so.
fn valid_until(state: &LeaderState, number: u64) -> Option<tokio::time::Instant> {
    match state {
        LeaderState::Leading {
            tenure,
            valid_until,
            ..
        } if *tenure == number => Some(*valid_until),
        _ => None,
    }
}

async fn tenure_over(mut state: watch::Receiver<LeaderState>, number: u64) {
    loop {
        let Some(until) = valid_until(&state.borrow_and_update(), number) else {
            return;
        };
        let left = until.saturating_duration_since(clock::now());
        if left.is_zero() {
            return;
        }
        tokio::select! {
            changed = state.changed() => if changed.is_err() { return },
            () = tokio::time::sleep(left.min(RECHECK)) => {}
        }
    }
}

/// Waits for the next tenure; `None` if the elector ended.
async fn next_tenure(
    state: &mut watch::Receiver<LeaderState>,
    stop: &watch::Receiver<bool>,
) -> Option<Tenure> {
    loop {
        let leading = match &*state.borrow_and_update() {
            s @ LeaderState::Leading { tenure, .. } => {
                s.leading_token(clock::now()).map(|t| (t.clone(), *tenure))
            }
            _ => None,
        };
        if let Some((token, number)) = leading {
            return Some(Tenure {
                token,
                number,
                state: state.clone(),
                stop: stop.clone(),
            });
        }
        state.changed().await.ok()?;
    }
}

/// Campaigns for the lease of `cfg` and runs `work` for each tenure, until `shutdown`
/// completes; then releases the lease. The work of a tenure is dropped when the tenure ends
/// (at the latest at its validity's end, a safety margin before anyone else may take over); at
/// shutdown it is told so ([`Tenure::stopping`]) and awaited until it returns, the tenure ends
/// or [`SHUTDOWN_GRACE`] passes, whichever comes first, and only then is the lease released.
/// Work that returns on its own while still leading releases the lease (nothing would act on
/// it any more): another participant takes over, and this one campaigns again after a lease
/// duration, to start the work afresh in its next tenure.
///
/// A tenure can also end by a release the elector writes itself (a handover to
/// `spec.preferredHolder`, [`ElectorHandle::request_release`], or
/// [`ElectorHandle::set_eligible`]`(false)`): the work is then dropped at once, but the release
/// may reach the API server first. Writes stay fenced (the release moves the token on); side
/// effects outside Kubernetes are the work's to guard with the token.
///
/// `on_handle` gets the elector's handle before the campaign starts, e.g. for
/// [`fenced_client`](crate::client::fenced_client) or metrics.
///
/// ```no_run
/// # async fn f(client: kube::Client) -> Result<(), fencedlease_elector::Error> {
/// use fencedlease_elector::{leading::run_while_leading, ElectorConfig};
///
/// let cfg = ElectorConfig::new("default", "my-operator", "replica-0");
/// run_while_leading(client, cfg, |_handle| {}, tokio::signal::ctrl_c(), |tenure| async move {
///     println!("leading with token {}", tenure.token);
///     tenure.stopping().await; // a real operator runs its Controller here
/// })
/// .await
/// # }
/// ```
pub async fn run_while_leading<H, S, W, F>(
    client: Client,
    cfg: ElectorConfig,
    on_handle: H,
    shutdown: S,
    mut work: W,
) -> Result<(), Error>
where
    H: FnOnce(&ElectorHandle),
    S: Future,
    W: FnMut(Tenure) -> F,
    F: Future<Output = ()>,
{
    let (elector, handle) = Elector::new(client, cfg)?;
    on_handle(&handle);
    let release = handle.clone();
    // Two stops: the work's first, the elector's (which releases the lease) after it.
    let (stop_work, stop) = watch::channel(false);
    let (stop_elector, mut elector_stopped) = watch::channel(false);
    let campaign = tokio::spawn(elector.run(async move {
        let _ = elector_stopped.wait_for(|s| *s).await;
    }));
    let mut state = handle.state.clone();
    tokio::pin!(shutdown);
    loop {
        let tenure = tokio::select! {
            _ = &mut shutdown => break,
            t = next_tenure(&mut state, &stop) => t,
        };
        let Some(tenure) = tenure else { break };
        let this = tenure.clone();
        let run = work(tenure);
        tokio::pin!(run);
        let shut = tokio::select! {
            () = &mut run => {
                release.request_release();
                tokio::select! {
                    () = this.ended() => false,
                    _ = &mut shutdown => true,
                }
            }
            () = this.ended() => false,
            _ = &mut shutdown => {
                let _ = stop_work.send(true);
                tokio::select! {
                    () = &mut run => {}
                    () = this.ended() => {}
                    () = tokio::time::sleep(SHUTDOWN_GRACE) => {}
                }
                true
            }
        };
        // The work of this tenure is dropped here, before the lease is released below.
        if shut {
            break;
        }
    }
    let _ = stop_work.send(true);
    let _ = stop_elector.send(true);
    campaign.await.unwrap_or(Err(Error::Panicked))
}
