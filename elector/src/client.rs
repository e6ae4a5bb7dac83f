//! A `kube::Client` that stamps every write with the current tenure's token, and sends none
//! once the tenure has ended: the glue that lets a kube-rs program (a kube-runtime `Controller`,
//! say) write protected objects without touching each write.
//!
//! [`fenced_client`] wraps a client you have (keep the plain one for the elector and the
//! watches); [`StampLayer`] is the same as a tower layer, for a stack whose inner service is
//! `Clone` (kube's default `ClientBuilder` stack is not: build a `Client` from it and wrap that
//! with [`fenced_client`]). Every request that is not a read goes through these steps:
//!
//! 1. The token is taken from the elector's state *as the request is sent*, with the deadline
//!    checked ([`LeaderState::leading_token`]): after the tenure ended, or while following, the
//!    write fails with [`FenceError::NotLeading`] and nothing is sent.
//! 2. A body is stamped as [`stamp_body`] says for its content type (creates, updates, merge,
//!    strategic merge and JSON patches, server-side apply, and the `/status` of built-in
//!    types; a custom resource's `/status` keeps the stored metadata, so no token can be
//!    presented there and the webhook refuses it), with a new write id
//!    ([`new_write_id`]). A content type it cannot stamp (protobuf) fails with
//!    [`FenceError::Unsupported`].
//! 3. A delete of one object is announced first when the object is protected (it carries the
//!    [`LEASE_LABEL`]): a merge patch under the token that sets the
//!    delete intent ([`crate::stamp::announce_delete`]), then the delete, its
//!    `preconditions.resourceVersion` (if any) moved to the announcement's version.
//!
//! The webhook, not this client, is what keeps a replaced leader's writes out: a write stamped
//! just before a pause still goes out when the process resumes, and the webhook refuses it.
//! This client only makes a current leader's writes carry what the webhook asks for, and
//! saves a former leader the round trip.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{header, Method, Request, Response, StatusCode};
use http_body_util::BodyExt as _;
use kube::client::Body;
use tokio::sync::watch;
use tower::{Layer, Service, ServiceExt as _};

use crate::lease::clock;
use crate::lease::elector::LeaderState;
use crate::lease::rules::FencingToken;
use crate::stamp::{
    delete_announcement, new_write_id, stamp_body, BodyKind, StampError, LEASE_LABEL,
};

/// The errors of the services here (what a `kube::Client` reports as `kube::Error::Service`).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a write was not sent.
#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    /// This participant does not lead the lease now (it never did, or its tenure ended).
    #[error(
        "not sent: this process does not lead FencedLease {lease} now, and a write without \
         its current token would be refused (wait for the next tenure)"
    )]
    NotLeading {
        /// The lease.
        lease: String,
    },
    /// The body's content type cannot be stamped.
    #[error("not sent: a {content_type} body cannot be stamped with the token; send JSON")]
    Unsupported {
        /// The request's content type.
        content_type: String,
    },
    /// The body could not be stamped.
    #[error("not sent: {0}")]
    Stamp(#[from] StampError),
    /// The request body could not be read.
    #[error("not sent: reading the request body: {0}")]
    Body(#[source] BoxError),
    /// The object to delete could not be read, or its delete not announced.
    #[error("not sent: announcing the delete of {path}: {why}")]
    Announce {
        /// The object's path.
        path: String,
        /// What went wrong.
        why: String,
    },
}

impl FenceError {
    /// A bounded label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            FenceError::NotLeading { .. } => "not_leading",
            FenceError::Unsupported { .. } => "unsupported",
            FenceError::Stamp(_) => "stamp",
            FenceError::Body(_) => "body",
            FenceError::Announce { .. } => "announce",
        }
    }
}

/// A tower layer that stamps writes with the token of `state` (an elector's
/// [`ElectorHandle::state`](crate::ElectorHandle::state)) for `lease`.
#[derive(Clone, Debug)]
pub struct StampLayer {
    lease: Arc<str>,
    state: watch::Receiver<LeaderState>,
}

impl StampLayer {
    /// Stamps writes for `lease` with the token `state` holds when each is sent.
    pub fn new(lease: impl Into<String>, state: watch::Receiver<LeaderState>) -> StampLayer {
        StampLayer {
            lease: Arc::from(lease.into()),
            state,
        }
    }
}

impl<S> Layer<S> for StampLayer {
    type Service = Stamped<S>;

    fn layer(&self, inner: S) -> Stamped<S> {
        Stamped {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service of [`StampLayer`].
#[derive(Clone, Debug)]
pub struct Stamped<S> {
    inner: S,
    layer: StampLayer,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B> Service<Request<Body>> for Stamped<S>
where
    S: Service<Request<Body>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<B>;
    type Error = BoxError;
    type Future = BoxFuture<Result<Response<B>, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        // The service that was polled ready serves this request; the clone waits for the next.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let layer = self.layer.clone();
        Box::pin(async move { fenced_call(inner, &layer, req).await })
    }
}

/// Whether a request only reads.
fn is_read(method: &Method) -> bool {
    matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

async fn fenced_call<S, B>(
    inner: S,
    layer: &StampLayer,
    req: Request<Body>,
) -> Result<Response<B>, BoxError>
where
    S: Service<Request<Body>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    if is_read(req.method()) {
        return inner.oneshot(req).await.map_err(Into::into);
    }
    let token = current_token(layer)?;
    let req = if *req.method() == Method::DELETE {
        announced_delete(inner.clone(), &token, req).await?
    } else {
        stamped(req, &token).await?
    };
    inner.oneshot(req).await.map_err(Into::into)
}

/// The token if this participant leads now, by the clock of the elector.
fn current_token(layer: &StampLayer) -> Result<FencingToken, FenceError> {
    layer
        .state
        .borrow()
        .leading_token(clock::now())
        .cloned()
        .ok_or_else(|| FenceError::NotLeading {
            lease: layer.lease.to_string(),
        })
}

/// The request with its body stamped (an empty body, as some subresource POSTs send, as is).
async fn stamped(req: Request<Body>, token: &FencingToken) -> Result<Request<Body>, FenceError> {
    let (mut parts, body) = req.into_parts();
    let bytes = body
        .collect_bytes()
        .await
        .map_err(|e| FenceError::Body(e.into()))?;
    if bytes.is_empty() {
        return Ok(Request::from_parts(parts, Body::from(bytes)));
    }
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let kind = BodyKind::of(&content_type).ok_or(FenceError::Unsupported { content_type })?;
    let body = stamp_body(kind, &bytes, token, &new_write_id(token))?;
    parts.headers.remove(header::CONTENT_LENGTH);
    Ok(Request::from_parts(parts, Body::from(body)))
}

/// A delete of a protected object, announced: reads the object; if it carries the lease label,
/// announces the delete under `token` and returns the delete with its precondition moved to the
/// announcement's version. The caller's `preconditions.resourceVersion` guards the
/// announcement itself (a merge patch naming a resourceVersion is refused if the object moved
/// on), so the delete still happens only to the version the caller saw; a `dryRun` delete
/// announces in a dry run. Other deletes (of unprotected objects, of
/// collections) as they are.
async fn announced_delete<S, B>(
    inner: S,
    token: &FencingToken,
    req: Request<Body>,
) -> Result<Request<Body>, FenceError>
where
    S: Service<Request<Body>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let (parts, body) = req.into_parts();
    let bytes = body
        .collect_bytes()
        .await
        .map_err(|e| FenceError::Body(e.into()))?;
    let path = parts.uri.path().to_string();
    let announce = |why: String| FenceError::Announce {
        path: path.clone(),
        why,
    };
    let as_sent = |parts, bytes| Ok(Request::from_parts(parts, Body::from(bytes)));
    let stored = send_json(inner.clone(), Method::GET, &format!("{path}?limit=1"), None)
        .await
        .map_err(announce)?;
    let protected = stored
        .as_ref()
        .is_some_and(|o| o["metadata"]["labels"][LEASE_LABEL].as_str().is_some());
    if !protected {
        return as_sent(parts, bytes); // unprotected, a collection, or gone already
    }
    let mut options: serde_json::Value =
        serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
    let precondition = options["preconditions"]["resourceVersion"]
        .as_str()
        .map(str::to_string);
    let mut patch = delete_announcement(token);
    if let Some(rv) = &precondition {
        patch["metadata"]["resourceVersion"] = serde_json::Value::String(rv.clone());
    }
    // Of the delete's query only dryRun goes with the announcement (a dry-run delete announces
    // in a dry run); the rest (gracePeriodSeconds, propagationPolicy) is the delete's own.
    let dry_run = parts
        .uri
        .query()
        .into_iter()
        .flat_map(|q| q.split('&'))
        .filter(|kv| kv.starts_with("dryRun="))
        .collect::<Vec<_>>()
        .join("&");
    let target = if dry_run.is_empty() {
        path.clone()
    } else {
        format!("{path}?{dry_run}")
    };
    let written = send_json(inner, Method::PATCH, &target, Some(patch))
        .await
        .map_err(announce)?
        .ok_or_else(|| announce("the object was deleted meanwhile".into()))?;
    let Some(rv) = precondition.and(written["metadata"]["resourceVersion"].as_str()) else {
        return as_sent(parts, bytes);
    };
    options["preconditions"]["resourceVersion"] = serde_json::Value::String(rv.to_string());
    let mut parts = parts;
    parts.headers.remove(header::CONTENT_LENGTH);
    let body = serde_json::to_vec(&options).map_err(|e| FenceError::Body(e.into()))?;
    Ok(Request::from_parts(parts, Body::from(body)))
}

/// Sends a GET or a merge PATCH of `target` (a path and query); the object answered, `None`
/// on 404, else why not.
async fn send_json<S, B>(
    inner: S,
    method: Method,
    target: &str,
    patch: Option<serde_json::Value>,
) -> Result<Option<serde_json::Value>, String>
where
    S: Service<Request<Body>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let mut builder = Request::builder().method(method).uri(target);
    let body = match patch {
        Some(p) => {
            builder = builder.header(header::CONTENT_TYPE, "application/merge-patch+json");
            Body::from(serde_json::to_vec(&p).map_err(|e| e.to_string())?)
        }
        None => Body::empty(),
    };
    let req = builder.body(body).map_err(|e| e.to_string())?;
    let resp = inner.oneshot(req).await.map_err(|e| e.into().to_string())?;
    let status = resp.status();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.into().to_string())?
        .to_bytes();
    if status == StatusCode::NOT_FOUND {
        return Ok(None);
    }
    if !status.is_success() {
        let text = String::from_utf8_lossy(&bytes);
        return Err(format!("the API server answered {status}: {text}"));
    }
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| format!("the answer is not JSON: {e}"))
}

/// A `kube::Client` as a tower service (what [`StampLayer`] wraps in [`fenced_client`]).
#[derive(Clone)]
struct ViaClient(kube::Client);

impl Service<Request<Body>> for ViaClient {
    type Response = Response<Body>;
    type Error = kube::Error;
    type Future = BoxFuture<Result<Response<Body>, kube::Error>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), kube::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let client = self.0.clone();
        Box::pin(async move { client.send(req).await })
    }
}

/// `client`, with every write stamped with the token of `state` for `lease`, and no write sent
/// while this participant does not lead (see the module's documentation). Reads go through
/// unchanged. Use it for the writes a leader makes, e.g. the client a kube-runtime
/// `Controller`'s reconciler writes with.
///
/// ```no_run
/// # async fn f(client: kube::Client) -> Result<(), Box<dyn std::error::Error>> {
/// use fencedlease_elector::{client::fenced_client, Elector, ElectorConfig};
///
/// let (elector, handle) =
///     Elector::new(client.clone(), ElectorConfig::new("default", "inventory", "worker-a"))?;
/// let writes = fenced_client(&client, "inventory", handle.state.clone());
/// # Ok(()) }
/// ```
pub fn fenced_client(
    client: &kube::Client,
    lease: impl Into<String>,
    state: watch::Receiver<LeaderState>,
) -> kube::Client {
    let service = StampLayer::new(lease, state).layer(ViaClient(client.clone()));
    kube::Client::new(service, client.default_namespace().to_string())
}
