//! What every long-running role starts with: the Kubernetes client, a shutdown token that
//! SIGTERM or SIGINT cancels, the elector as a task that releases the lease when told to, and
//! (controller, webhook) the admin port that serves the role's registry and readiness.
//!
//! The elector has a stop of its own, not the shutdown token: a role first stops its work (the
//! command, the reconciler, the servers), then the elector, so that the lease is released only
//! once nothing acts on it any more.

pub(crate) mod accept;
pub(crate) mod admin;
#[cfg(feature = "operator")]
pub(crate) mod admin_port;
pub mod args;
pub(crate) mod identity;
pub mod logging;
#[cfg(feature = "operator")]
pub mod tls;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::api::{MAX_LEASE_DURATION_SECONDS, MIN_LEASE_DURATION_SECONDS};
use crate::lease::elector::{Elector, ElectorConfig, ElectorHandle};

/// The largest request body any server of this binary reads: the webhook's AdmissionReview (an
/// update carries two objects of at most 1.5 MiB each, etcd's default request limit, plus the
/// envelope) and a write the sidecar's proxy stamps (one object).
pub(crate) const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub(crate) enum RuntimeError {
    #[error("connecting to Kubernetes (set KUBECONFIG or run in a pod): {0}")]
    Client(#[source] kube::Error),
    #[error("installing the {signal} handler: {source}")]
    Signal {
        signal: &'static str,
        source: std::io::Error,
    },
}

/// The Kubernetes client from the kubeconfig (`$KUBECONFIG`) or the pod's service account.
pub(crate) async fn client() -> Result<kube::Client, RuntimeError> {
    kube::Client::try_default()
        .await
        .map_err(RuntimeError::Client)
}

/// The client, the shutdown token and the admin server of a running role.
pub(crate) struct Runtime {
    client: kube::Client,
    shutdown: CancellationToken,
    /// The role's metrics, until the admin server serves them.
    #[cfg(feature = "operator")]
    registry: prometheus_client::registry::Registry,
    #[cfg(feature = "operator")]
    admin: Option<admin_port::AdminServer>,
}

impl Runtime {
    /// Installs the signal handlers (first, so that a SIGTERM during start-up is not lost and
    /// does not kill the process), then connects to Kubernetes.
    pub(crate) async fn start() -> Result<Runtime, RuntimeError> {
        let shutdown = CancellationToken::new();
        cancel_on_signals(shutdown.clone())?;
        let client = client().await?;
        Ok(Runtime {
            client,
            shutdown,
            #[cfg(feature = "operator")]
            registry: Default::default(),
            #[cfg(feature = "operator")]
            admin: None,
        })
    }

    pub(crate) fn client(&self) -> &kube::Client {
        &self.client
    }

    /// Cancelled on SIGTERM or SIGINT; a role may cancel it itself to stop.
    pub(crate) fn shutdown(&self) -> &CancellationToken {
        &self.shutdown
    }

    /// A candidate for the lease `args` name as `identity`, which creates the lease with
    /// `--lease-duration` seconds if it does not exist (campaign and sidecar).
    pub(crate) fn candidate(
        &self,
        args: &args::ElectionArgs,
        identity: &str,
    ) -> Result<(Elector, ElectorHandle), crate::lease::elector::Error> {
        let mut cfg = ElectorConfig::new(&args.namespace, &args.lease, identity);
        cfg.create_with_duration = Some(args.lease_duration);
        Elector::new(self.client.clone(), cfg)
    }

    /// Runs `elector` on a task until [`ElectorTask::stop`].
    pub(crate) fn spawn_elector(&self, elector: Elector) -> ElectorTask {
        ElectorTask::spawn(elector)
    }
}

#[cfg(feature = "operator")]
impl Runtime {
    /// Where the role registers its metrics, before [`Runtime::serve_admin`].
    pub(crate) fn registry(&mut self) -> &mut prometheus_client::registry::Registry {
        &mut self.registry
    }

    /// Serves the role's admin port (`--metrics-addr`) until the shutdown: `/metrics` from
    /// the registry, `/readyz` as `ready` says, `/livez`. A failure to bind does not stop the
    /// role: [`Runtime::finish`] reports it.
    pub(crate) fn serve_admin(&mut self, args: &args::AdminArgs, ready: admin::Readiness) {
        let until = self.shutdown.clone();
        self.serve_admin_until(args, ready, until);
    }

    /// [`Runtime::serve_admin`] until `until` is cancelled instead of the shutdown: a role that
    /// keeps serving a moment past the signal keeps its probes and metrics answering as long.
    pub(crate) fn serve_admin_until(
        &mut self,
        args: &args::AdminArgs,
        ready: admin::Readiness,
        until: CancellationToken,
    ) {
        let registry = std::mem::take(&mut self.registry);
        self.admin = Some(admin_port::AdminServer::start(
            args.metrics_addr,
            ready,
            std::sync::Arc::new(registry),
            until,
        ));
    }

    /// Ends the role: cancels the shutdown (if nothing has yet) and waits for the admin server
    /// to close.
    pub(crate) async fn finish(self) {
        self.shutdown.cancel();
        if let Some(admin) = self.admin {
            admin.join().await;
        }
    }
}

/// A token cancelled `delay` after `shutdown` is: for a server that must outlive the shutdown
/// signal by a moment (the webhook keeps answering while the API server stops sending to it).
/// Its task ends when either token is cancelled.
#[cfg(feature = "operator")]
pub(crate) fn cancelled_after(
    shutdown: &CancellationToken,
    delay: std::time::Duration,
) -> CancellationToken {
    let later = CancellationToken::new();
    let (signal, done) = (shutdown.clone(), later.clone());
    tokio::spawn(async move {
        tokio::select! {
            () = signal.cancelled() => {}
            () = done.cancelled() => return,
        }
        if !delay.is_zero() {
            info!(
                seconds = delay.as_secs(),
                "shutting down: still answering for a moment, while callers stop sending here"
            );
            tokio::time::sleep(delay).await;
        }
        done.cancel();
    });
    later
}

/// The parser of every `--lease-duration` flag: whole seconds within the CRD's bounds.
pub(crate) fn lease_duration_parser() -> clap::builder::RangedI64ValueParser<i32> {
    clap::value_parser!(i32)
        .range(i64::from(MIN_LEASE_DURATION_SECONDS)..=i64::from(MAX_LEASE_DURATION_SECONDS))
}

/// Cancels `token` on the first SIGTERM or SIGINT. The handlers are installed before this
/// returns; the waiting goes on in a task.
pub(crate) fn cancel_on_signals(token: CancellationToken) -> Result<JoinHandle<()>, RuntimeError> {
    use tokio::signal::unix::{signal, SignalKind};
    let installed = |kind, signal_name| {
        signal(kind).map_err(|source| RuntimeError::Signal {
            signal: signal_name,
            source,
        })
    };
    let mut term = installed(SignalKind::terminate(), "SIGTERM")?;
    let mut int = installed(SignalKind::interrupt(), "SIGINT")?;
    Ok(tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => info!("SIGTERM: shutting down"),
            _ = int.recv() => info!("interrupted: shutting down"),
            () = token.cancelled() => return,
        }
        token.cancel();
    }))
}

/// The elector running on a task of its own, and its stop.
pub(crate) struct ElectorTask {
    stop: CancellationToken,
    task: JoinHandle<Result<(), crate::lease::elector::Error>>,
}

impl ElectorTask {
    fn spawn(elector: Elector) -> ElectorTask {
        let stop = CancellationToken::new();
        let task = tokio::spawn(elector.run(stop.clone().cancelled_owned()));
        ElectorTask { stop, task }
    }

    /// Stops the elector (it releases the lease if it holds it) and waits for it; the error
    /// it ended with, if any.
    pub(crate) async fn stop(self) -> Option<anyhow::Error> {
        self.stop.cancel();
        match self.task.await {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(anyhow::Error::from(e)),
            Err(e) => Some(anyhow::Error::from(e).context("the elector task failed")),
        }
    }

    /// [`ElectorTask::stop`], logging the error as a warning.
    pub(crate) async fn stop_and_warn(self) {
        if let Some(e) = self.stop().await {
            warn!(error = %crate::runtime::logging::error_line(&e), "the elector ended with an error");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[cfg(feature = "operator")]
    #[tokio::test(start_paused = true)]
    async fn the_delayed_token_is_cancelled_only_after_the_delay() {
        let shutdown = CancellationToken::new();
        let later = cancelled_after(&shutdown, Duration::from_secs(5));
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!later.is_cancelled(), "cancelled with no shutdown");
        shutdown.cancel();
        tokio::time::sleep(Duration::from_millis(4_999)).await;
        assert!(!later.is_cancelled(), "cancelled before the delay");
        tokio::time::timeout(Duration::from_secs(1), later.cancelled())
            .await
            .expect("cancelled once the delay has passed");
    }

    #[tokio::test]
    async fn sigterm_cancels_the_shutdown_token() {
        let token = CancellationToken::new();
        let waiter = cancel_on_signals(token.clone()).expect("handlers");
        assert!(!token.is_cancelled());
        nix::sys::signal::raise(nix::sys::signal::Signal::SIGTERM).expect("raise");
        tokio::time::timeout(Duration::from_secs(5), token.cancelled())
            .await
            .expect("cancelled by SIGTERM");
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("the waiter ends")
            .expect("the waiter does not panic");
    }

    #[tokio::test]
    async fn cancelling_the_token_ends_the_signal_waiter() {
        let token = CancellationToken::new();
        let waiter = cancel_on_signals(token.clone()).expect("handlers");
        token.cancel();
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("the waiter ends without a signal")
            .expect("the waiter does not panic");
    }
}
