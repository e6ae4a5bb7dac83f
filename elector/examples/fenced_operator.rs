//! A sample kube-runtime operator, fenced: it copies each ConfigMap labelled
//! `sample.fencedlease.io/source` into a protected ConfigMap `<name>-copy` (server-side apply),
//! and runs its `Controller` only while it leads the FencedLease LEASE.
//!
//! ```text
//! cargo run -p fencedlease-elector --example fenced_operator -- NAMESPACE LEASE IDENTITY [SECONDS]
//! ```
//!
//! The fencing is these lines (the rest is an ordinary kube-runtime operator):
//!
//! ```text
//! let on_handle = |h: &ElectorHandle| writes.set(fenced_client(&client, lease, h.state.clone()));
//! run_while_leading(client, ElectorConfig::new(ns, lease, id), on_handle, shutdown, |tenure| async move {
//!     Controller::new(api, watcher::Config::default())
//!         .graceful_shutdown_on(async move { tenure.stopping().await })
//!         .run(reconcile, error_policy, ctx).for_each(|_| async {}).await
//! }).await?;
//! ```
//!
//! It prints one JSON line per event on stdout (`leading`, `reconcile-start`, `wrote`,
//! `refused`, `not-sent`, `reconcile-end`, `stopped`), which the repository's test
//! (tests/adoption_kube_runtime.rs) reads. For that test only: while the file named by
//! `$FENCEDLEASE_SAMPLE_STALL_FILE` exists, the next write, already stamped, stops the process
//! (SIGSTOP) just before it is sent, as a long pause would: the test resumes it once another
//! replica leads, and the webhook refuses the write.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use fencedlease_elector::client::fenced_client;
use fencedlease_elector::leading::run_while_leading;
use fencedlease_elector::stamp::LEASE_LABEL;
use fencedlease_elector::ElectorConfig;
use futures::StreamExt as _;
use http::{Method, Request};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams};
use kube::client::{Body, ClientBuilder};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use serde_json::json;
use tower::{Layer, Service};

const SOURCE_LABEL: &str = "sample.fencedlease.io/source";

/// One event line on stdout.
fn event(identity: &str, event: &str, fields: serde_json::Value) {
    let t_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    let mut line = json!({"t_ns": t_ns, "identity": identity, "event": event});
    if let (Some(l), Some(f)) = (line.as_object_mut(), fields.as_object()) {
        l.extend(f.clone());
    }
    println!("{line}");
}

struct Ctx {
    writes: kube::Client,
    namespace: String,
    lease: String,
    identity: String,
    token: i64,
}

async fn reconcile(source: Arc<ConfigMap>, ctx: Arc<Ctx>) -> Result<Action, kube::Error> {
    let name = source.metadata.name.clone().unwrap_or_default();
    let copy = format!("{name}-copy");
    let (id, token) = (&ctx.identity, ctx.token);
    event(id, "reconcile-start", json!({"name": name, "token": token}));
    let value = source.data.as_ref().and_then(|d| d.get("value")).cloned();
    let desired = json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": copy, "labels": {LEASE_LABEL: ctx.lease}},
        "data": {"value": value, "by": ctx.identity},
    });
    let api: Api<ConfigMap> = Api::namespaced(ctx.writes.clone(), &ctx.namespace);
    let params = PatchParams::apply("fenced-operator").force();
    let result = api.patch(&copy, &params, &Patch::Apply(desired)).await;
    match result {
        Ok(_) => event(
            id,
            "wrote",
            json!({"name": copy, "value": value, "token": token}),
        ),
        Err(kube::Error::Api(s)) if s.code == 403 => event(
            id,
            "refused",
            json!({"name": copy, "code": s.code, "message": s.message, "token": token}),
        ),
        Err(kube::Error::Service(e)) => {
            event(id, "not-sent", json!({"name": copy, "why": e.to_string()}))
        }
        Err(e) => return Err(e),
    }
    event(id, "reconcile-end", json!({"name": name, "token": token}));
    Ok(Action::await_change())
}

fn error_policy(_: Arc<ConfigMap>, _: &kube::Error, _: Arc<Ctx>) -> Action {
    Action::requeue(Duration::from_secs(1))
}

/// For the test only (see the top): stops the process before a write while the file exists.
#[derive(Clone)]
struct StallLayer(Option<PathBuf>, String);

#[derive(Clone)]
struct Stall<S> {
    inner: S,
    file: Option<PathBuf>,
    identity: String,
}

impl<S> Layer<S> for StallLayer {
    type Service = Stall<S>;
    fn layer(&self, inner: S) -> Stall<S> {
        Stall {
            inner,
            file: self.0.clone(),
            identity: self.1.clone(),
        }
    }
}

type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

impl<S, B> Service<Request<Body>> for Stall<S>
where
    S: Service<Request<Body>, Response = http::Response<B>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let stall = self.file.as_ref().filter(|f| f.exists());
        let Some(file) = stall.filter(|_| req.method() == Method::PATCH) else {
            return Box::pin(self.inner.call(req));
        };
        let _ = std::fs::remove_file(file);
        event(&self.identity, "stalling", json!({}));
        // SAFETY: raise only sends a signal to this process.
        unsafe { libc::raise(libc::SIGSTOP) };
        // Resumed. The request was stamped before the pause: it is sent now, as one already on
        // the wire would be, whatever this process has learnt meanwhile.
        let (sent, identity) = (self.inner.call(req), self.identity.clone());
        let late = tokio::spawn(async move {
            let answer = sent.await;
            let status = answer.as_ref().map(|r| r.status().as_u16()).unwrap_or(0);
            event(&identity, "late-answer", json!({"status": status}));
            answer
        });
        Box::pin(async move {
            match late.await {
                Ok(answer) => answer,
                Err(e) => std::panic::resume_unwind(e.into_panic()),
            }
        })
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [namespace, lease, identity] = match &args[..] {
        [n, l, i] | [n, l, i, _] => [n.clone(), l.clone(), i.clone()],
        _ => return Err("usage: fenced_operator NAMESPACE LEASE IDENTITY [SECONDS]".into()),
    };
    let seconds: i32 = args.get(3).map_or(Ok(15), |s| s.parse())?;
    let config = kube::Config::infer().await?;
    let client = kube::Client::try_from(config.clone())?;
    let mut cfg = ElectorConfig::new(&namespace, &lease, &identity);
    cfg.create_with_duration = Some(seconds);

    // The writes' client: every write stamped with the current token, none sent while not
    // leading. (The test's StallLayer is in the client below the stamp: its pause comes after
    // stamping, as a real one can.)
    let writes = OnceLock::new();
    let stall = StallLayer(
        std::env::var_os("FENCEDLEASE_SAMPLE_STALL_FILE").map(PathBuf::from),
        identity.clone(),
    );
    let below = ClientBuilder::try_from(config.clone())?
        .with_layer(&stall)
        .build();
    let on_handle = |h: &fencedlease_elector::ElectorHandle| {
        let _ = writes.set(fenced_client(&below, &lease, h.state.clone()));
    };
    let sources: Api<ConfigMap> = Api::namespaced(client.clone(), &namespace);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let shutdown = async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    };
    let (ns, le, id) = (&namespace, &lease, &identity);
    run_while_leading(client.clone(), cfg, on_handle, shutdown, |tenure| {
        let writes = writes.get().cloned();
        let sources = sources.clone();
        async move {
            let Some(writes) = writes else { return };
            let token = tenure.token.generation;
            event(id, "leading", json!({"token": token}));
            let ctx = Arc::new(Ctx {
                writes,
                namespace: ns.clone(),
                lease: le.clone(),
                identity: id.clone(),
                token,
            });
            let stopping = tenure.clone();
            Controller::new(sources, watcher::Config::default().labels(SOURCE_LABEL))
                .graceful_shutdown_on(async move { stopping.stopping().await })
                .run(reconcile, error_policy, ctx)
                .for_each(|_| async {})
                .await;
            event(id, "stopped", json!({"token": token}));
        }
    })
    .await?;
    Ok(())
}
