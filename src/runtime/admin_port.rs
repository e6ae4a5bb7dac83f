//! The admin port of the operator's roles (controller, webhook): `/livez`, `/readyz` and
//! `/metrics` on a port of their own, served by [`super::admin::serve`]. The sidecar serves the
//! same routes on its loopback API instead.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::Router;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::admin::{health_routes, metrics_route, serve, Limits, Readiness};

/// A readiness switch (not ready until set): for roles whose readiness is a moment, not a check.
#[derive(Clone, Debug, Default)]
pub(crate) struct ReadyFlag(Arc<AtomicBool>);

impl ReadyFlag {
    pub(crate) fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::Relaxed);
    }

    /// The [`Readiness`] that follows this flag.
    pub(crate) fn readiness(&self) -> Readiness {
        let flag = self.0.clone();
        Readiness::from_fn(move || {
            if flag.load(Ordering::Relaxed) {
                Ok(())
            } else {
                Err("not ready")
            }
        })
    }
}

/// `/livez`, `/readyz` and `/metrics`: what a role's admin port serves.
pub(crate) fn router(ready: Readiness, registry: Arc<Registry>) -> Router {
    health_routes(ready).merge(metrics_route(registry))
}

/// Binds `addr` for an admin server.
pub(crate) async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}

/// A role's admin server: `/livez`, `/readyz` and `/metrics` on a port of their own.
pub(crate) struct AdminServer(tokio::task::JoinHandle<std::io::Result<()>>);

impl AdminServer {
    /// Binds `addr` and serves there until `stop` is cancelled. A failure to bind does not
    /// stop the role: [`AdminServer::join`] reports it.
    pub(crate) fn start(
        addr: SocketAddr,
        ready: Readiness,
        registry: Arc<Registry>,
        stop: CancellationToken,
    ) -> AdminServer {
        AdminServer(tokio::spawn(async move {
            let listener = bind(addr).await?;
            info!(%addr, "serving /metrics, /livez and /readyz");
            serve(
                listener,
                router(ready, registry),
                Limits::default(),
                stop.cancelled_owned(),
            )
            .await;
            Ok(())
        }))
    }

    /// Waits for the server to stop, logging why it failed if it did.
    pub(crate) async fn join(self) {
        match self.0.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => warn!(error = %e, "the metrics server failed"),
            Err(e) => warn!(error = %e, "the metrics server task failed"),
        }
    }
}
