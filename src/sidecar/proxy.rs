//! The sidecar's opt-in Kubernetes API proxy. An app points its Kubernetes client at it
//! (plain HTTP on the pod's loopback) and needs to know nothing about tokens: the proxy adds
//! the current token and lease UID to the body of every create, update and merge patch,
//! announces each delete of a protected object before sending it (the two steps a fenced
//! delete takes), and refuses writes itself while the pod is not leading. Reads and watches pass through. The
//! fencing webhook still has the last word, so a write that races a loss of leadership is
//! refused by the API server.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::api::{DELETE_INTENT_ANNOTATION, LEASE_LABEL};
use crate::lease::clock;
use crate::lease::elector::LeaderState;
use crate::lease::rules::FencingToken;

use crate::runtime::MAX_BODY_BYTES;
use crate::stamp::BodyKind;

/// Request header pinning a write to the tenure it was decided under: the token (a canonical
/// decimal). The proxy stamps the current token on every write, so without a pin a request
/// decided under token N, delayed while the pod lost the lease and got it back under N+k,
/// would go out under N+k; with the pin it is refused. (Stripped before forwarding.)
pub(super) const PIN_HEADER: &str = "fencedlease-token";
/// With [`PIN_HEADER`]: the lease UID the pinned token belongs to (optional).
pub(super) const PIN_UID_HEADER: &str = "fencedlease-lease-uid";

/// Checks a write's pin (the values of [`PIN_HEADER`] and [`PIN_UID_HEADER`], if sent)
/// against the tenure the pod leads in now: a write with no pin passes; one pinned to another
/// tenure, or with a malformed pin, is refused with the reason.
pub(super) fn check_pin(
    token: Option<&str>,
    uid: Option<&str>,
    current: &FencingToken,
) -> Result<(), String> {
    let Some(token) = token else {
        return match uid {
            Some(_) => Err(format!("{PIN_UID_HEADER} needs {PIN_HEADER} beside it")),
            None => Ok(()),
        };
    };
    let pinned = crate::stamp::parse_token(token)
        .map_err(|e| format!("{PIN_HEADER} {token:?} is not a token: {e}"))?;
    let same_uid = uid.is_none_or(|u| u == current.lease_uid);
    if pinned == current.generation && same_uid {
        return Ok(());
    }
    Err(format!(
        "this write was decided under token {pinned}{}, and the pod now leads with token {current}: the tenure it was decided in is over; re-read what the write was based on and decide again under the current token",
        uid.map(|u| format!(" (lease uid {u})")).unwrap_or_default()
    ))
}

/// Whether a write without a pin may go out in the pod's tenure `tenure` (see
/// [`LeaderState::Leading`]), given the tenure the app last showed it knows (`acknowledged`, 0
/// for none) and whether an earlier run of the sidecar in this pod had led (`led_before`). The
/// first tenure of a sidecar that is the pod's first to lead needs no acknowledgement: the app
/// can have decided nothing under an earlier one. Any other tenure follows a loss (or a restart
/// of the sidecar that led), and a write the app decided before it would go out stamped with the
/// new token, over the work of whoever led in between: such writes wait until the app
/// acknowledges the tenure (`POST /v1/acknowledge` on the sidecar's API, or a write pinned to
/// the current token).
pub(super) fn admits_unpinned(tenure: u64, acknowledged: u64, led_before: bool) -> bool {
    (tenure <= 1 && !led_before) || tenure == acknowledged
}

/// Which tenure the app last showed it knows: shared by the proxy and the sidecar's API.
#[derive(Clone, Debug, Default)]
pub(super) struct Acknowledged(Arc<std::sync::atomic::AtomicU64>);

impl Acknowledged {
    /// Records that the app knows tenure `tenure`.
    pub(super) fn set(&self, tenure: u64) {
        self.0.store(tenure, std::sync::atomic::Ordering::SeqCst);
    }
    /// The tenure the app last acknowledged (0: none).
    pub(super) fn get(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// The pod's token and tenure, if it leads now.
pub(super) fn leading_now(state: &LeaderState) -> Option<(FencingToken, u64)> {
    match state {
        LeaderState::Leading { token, tenure, .. } => state
            .leading_token(clock::now())
            .map(|_| (token.clone(), *tenure)),
        _ => None,
    }
}

struct Proxy {
    client: kube::Client,
    state: watch::Receiver<LeaderState>,
    lease: String,
    namespace: String,
    acknowledged: Acknowledged,
    /// `--proxy-allow-unacknowledged`: send unpinned writes in every tenure (the hand-back
    /// window stays open).
    allow_unacknowledged: bool,
    /// An earlier run of the sidecar in this pod had led (see [`admits_unpinned`]).
    led_before: bool,
}

impl Proxy {
    /// Why a write must not go out now, if it must not: the pod does not lead, the write is
    /// pinned to another tenure, or it is unpinned in a tenure the app has not acknowledged.
    /// A write pinned to the current tenure acknowledges it.
    fn refusal(&self, headers: &axum::http::HeaderMap) -> Option<String> {
        let lease = format!("FencedLease {}/{}", self.namespace, self.lease);
        let Some((current, tenure)) = leading_now(&self.state.borrow()) else {
            return Some(format!("this pod does not lead {lease}"));
        };
        if let Err(why) = pin_of(headers, &current) {
            return Some(format!("{lease}: {why}"));
        }
        if headers.contains_key(PIN_HEADER) {
            self.acknowledged.set(tenure);
            return None;
        }
        if self.allow_unacknowledged
            || admits_unpinned(tenure, self.acknowledged.get(), self.led_before)
        {
            return None;
        }
        Some(format!(
            "this pod lost {lease} and leads it again, with token {current}; a write the app decided before the loss would go out stamped with the new token, over the work of whoever led in between, so writes without a pin wait until the app shows it knows the new tenure: POST /v1/acknowledge {{\"token\": {}}} on the sidecar's API (the fencedlease clients do when a leading block starts), or send each write with the header {PIN_HEADER}: {} (the token it was decided under)",
            current.generation, current.generation
        ))
    }
}

/// What to do with a request body before forwarding it.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Rewrite {
    /// Forward unchanged (a read, or a body we do not rewrite).
    Pass,
    /// Add the token to this JSON body, as its kind says.
    Stamp(BodyKind),
    /// Refuse: a body that cannot be stamped (protobuf, YAML).
    Unsupported(&'static str),
}

/// Decides by method and content type ([`BodyKind::of`]: the same rule as the Rust client's
/// layer and the Go Transport).
pub(super) fn rewrite_for(method: &Method, content_type: Option<&str>) -> Rewrite {
    let ct = content_type.unwrap_or("");
    match *method {
        Method::POST | Method::PUT => match BodyKind::of(ct) {
            Some(BodyKind::Object) => Rewrite::Stamp(BodyKind::Object),
            _ => Rewrite::Unsupported("send creates and updates as application/json"),
        },
        Method::PATCH => match BodyKind::of(ct) {
            Some(kind) => Rewrite::Stamp(kind),
            None => Rewrite::Unsupported(
                "send a JSON merge, strategic merge or JSON patch, or server-side apply in JSON",
            ),
        },
        _ => Rewrite::Pass,
    }
}

pub(super) use crate::stamp::new_write_id;

/// Adds the token annotations and a new write id to a body of `kind`.
pub(super) fn stamp(kind: BodyKind, body: &[u8], token: &FencingToken) -> Result<Vec<u8>, String> {
    crate::stamp::stamp_body(kind, body, token, &new_write_id(token)).map_err(|e| e.to_string())
}

/// The lease a stored object (or list: none) is protected by: its [`LEASE_LABEL`].
pub(super) fn protected_by(object: &Value) -> Option<&str> {
    object["metadata"]["labels"][LEASE_LABEL]
        .as_str()
        .filter(|l| !l.is_empty())
}

/// The merge patch that announces a delete under `token` (one definition, in the stamp module).
pub(super) use crate::stamp::delete_announcement as announcement;

/// The `preconditions.resourceVersion` of a delete's body (DeleteOptions), if it has one.
pub(super) fn precondition_of(body: &[u8]) -> Option<String> {
    let v: Value = serde_json::from_slice(body).ok()?;
    v["preconditions"]["resourceVersion"]
        .as_str()
        .map(str::to_string)
}

/// The delete's body with its `preconditions.resourceVersion` (if it has one) moved to `rv`,
/// the version the announcement wrote: the client's precondition was checked against the
/// version before it.
pub(super) fn with_precondition(body: Vec<u8>, rv: &str) -> Vec<u8> {
    let Ok(mut v) = serde_json::from_slice::<Value>(&body) else {
        return body;
    };
    if v["preconditions"]["resourceVersion"].is_string() {
        v["preconditions"]["resourceVersion"] = json!(rv);
        return serde_json::to_vec(&v).unwrap_or(body);
    }
    body
}

fn refused_by_api(what: &str, e: kube::Error) -> Response {
    match e {
        kube::Error::Api(e) => status(
            StatusCode::from_u16(e.code).unwrap_or(StatusCode::BAD_GATEWAY),
            &e.reason,
            format!("fencedlease sidecar: {what} was refused: {}", e.message),
        ),
        e => status(
            StatusCode::BAD_GATEWAY,
            "ServiceUnavailable",
            format!("fencedlease sidecar: {what} failed: {e}; retry the delete"),
        ),
    }
}

/// Before a delete: reads the object at `path` and, if it is protected, announces the delete
/// in a fenced merge patch, conditional on the version read (and on the client's own
/// `resourceVersion` precondition, checked here first). Returns the version the announcement
/// wrote, for the delete's precondition; None when nothing was announced: a path that names a
/// collection (a deletecollection: its protected items are refused), or an object that cannot
/// be read, is left to the delete itself (the API server answers it; the webhook refuses a
/// protected object's unannounced delete).
async fn announce_delete(
    p: &Proxy,
    path: &str,
    token: &FencingToken,
    precondition: Option<&str>,
) -> Result<Option<String>, Response> {
    let get = axum::http::Request::get(format!("{path}?limit=1")).body(Vec::new());
    let Ok(get) = get else { return Ok(None) };
    let Ok(stored) = p.client.request::<Value>(get).await else {
        return Ok(None);
    };
    if protected_by(&stored).is_none() {
        return Ok(None);
    }
    let rv = stored["metadata"]["resourceVersion"]
        .as_str()
        .unwrap_or_default();
    if let Some(want) = precondition.filter(|want| *want != rv) {
        return Err(status(
            StatusCode::CONFLICT,
            "Conflict",
            format!("fencedlease sidecar: the delete's precondition names resourceVersion {want}, and the object is at {rv}: it was modified; read it again"),
        ));
    }
    let mut announcement = announcement(token);
    announcement["metadata"]["resourceVersion"] = json!(rv);
    let patch = axum::http::Request::patch(path)
        .header(header::CONTENT_TYPE, "application/merge-patch+json")
        .body(announcement.to_string().into_bytes());
    let Ok(patch) = patch else { return Ok(None) };
    match p.client.request::<Value>(patch).await {
        Ok(written) => Ok(written["metadata"]["resourceVersion"]
            .as_str()
            .map(str::to_string)),
        Err(e) => Err(refused_by_api("announcing the delete", e)),
    }
}

/// After an announced delete failed: takes the announcement back with a fenced write, so that
/// no later delete (by anyone) can ride on it. Best effort: the next write of the object takes
/// it back too.
async fn withdraw_announcement(p: &Proxy, path: &str, token: &FencingToken) {
    let mut patch = announcement(token);
    patch["metadata"]["annotations"][DELETE_INTENT_ANNOTATION] = Value::Null;
    let req = axum::http::Request::patch(path)
        .header(header::CONTENT_TYPE, "application/merge-patch+json")
        .body(patch.to_string().into_bytes());
    if let Ok(req) = req {
        if let Err(e) = p.client.request::<Value>(req).await {
            tracing::warn!(%path, error = %e, "could not take back the announcement of a delete that failed; the object's next write takes it back");
        }
    }
}

fn status(code: StatusCode, reason: &str, message: String) -> Response {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code.as_u16(),
    });
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

async fn forward(State(p): State<Arc<Proxy>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let write = !matches!(parts.method, Method::GET | Method::HEAD | Method::OPTIONS);
    let token = p.state.borrow().leading_token(clock::now()).cloned();
    if write {
        if let Some(why) = p.refusal(&parts.headers) {
            return status(
                StatusCode::FORBIDDEN,
                crate::stamp::REFUSAL_REASON,
                format!("fencedlease sidecar: {why}; writes through the proxy are refused"),
            );
        }
    }
    let mut body = match upstream_body(&parts, body, token.as_ref()).await {
        Ok(b) => b,
        Err(refusal) => return refusal,
    };
    let mut announced = None;
    if let (&Method::DELETE, Some(t)) = (&parts.method, &token) {
        match announce_delete(&p, parts.uri.path(), t, precondition_of(&body).as_deref()).await {
            Ok(Some(rv)) => {
                body = with_precondition(body, &rv);
                announced = Some(t.clone());
            }
            Ok(None) => {}
            Err(refusal) => return refusal,
        }
    }
    let upstream = match upstream_request(&parts, body) {
        Ok(r) => r,
        Err(e) => {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                format!("fencedlease sidecar: {e}"),
            )
        }
    };
    match p.client.send(upstream.map(kube::client::Body::from)).await {
        Ok(resp) => {
            if let (Some(t), false) = (&announced, resp.status().is_success()) {
                withdraw_announcement(&p, parts.uri.path(), t).await;
            }
            let (parts, body) = resp.into_parts();
            Response::from_parts(parts, Body::new(body))
        }
        Err(e) => status(
            StatusCode::BAD_GATEWAY,
            "ServiceUnavailable",
            format!("fencedlease sidecar: the API server could not be reached: {e}"),
        ),
    }
}

/// Every request goes on only with the pod's secret; else 401 as a Kubernetes Status.
async fn gate(
    State(secret): State<Arc<crate::sidecar::secret::ApiSecret>>,
    req: Request,
    next: axum::middleware::Next,
) -> Response {
    if secret.admits(req.headers()) {
        return next.run(req).await;
    }
    status(
        StatusCode::UNAUTHORIZED,
        "Unauthorized",
        secret.refusal_message(),
    )
}

/// [`check_pin`] on a request's headers.
fn pin_of(headers: &axum::http::HeaderMap, current: &FencingToken) -> Result<(), String> {
    let value = |name: &str| headers.get(name).map(|v| v.to_str().unwrap_or("\u{fffd}"));
    check_pin(value(PIN_HEADER), value(PIN_UID_HEADER), current)
}

/// Reads the request body (at most [`MAX_BODY_BYTES`]) and stamps `token` on it when the
/// request is a write that [`rewrite_for`] says to stamp; else the refusal to answer.
async fn upstream_body(
    parts: &axum::http::request::Parts,
    body: Body,
    token: Option<&FencingToken>,
) -> Result<Vec<u8>, Response> {
    let ct = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let bytes = match axum::body::to_bytes(body, MAX_BODY_BYTES).await {
        Ok(b) => b,
        Err(_) => {
            return Err(status(
                StatusCode::PAYLOAD_TOO_LARGE,
                "RequestEntityTooLarge",
                format!(
                    "fencedlease sidecar: request bodies are limited to {MAX_BODY_BYTES} bytes"
                ),
            ))
        }
    };
    match (rewrite_for(&parts.method, ct), token) {
        (Rewrite::Pass, _) => Ok(bytes.to_vec()),
        (Rewrite::Unsupported(why), _) => Err(status(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            format!("fencedlease sidecar: {why}"),
        )),
        (Rewrite::Stamp(kind), Some(t)) => stamp(kind, &bytes, t).map_err(|e| {
            status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                format!("fencedlease sidecar: {e}"),
            )
        }),
        (Rewrite::Stamp(_), None) => Ok(bytes.to_vec()),
    }
}

/// The request to send upstream: the same method, path, query and headers, less the client's
/// credentials and the hop-by-hop headers.
fn upstream_request(
    parts: &axum::http::request::Parts,
    body: Vec<u8>,
) -> Result<axum::http::Request<Vec<u8>>, axum::http::Error> {
    let uri = parts
        .uri
        .path_and_query()
        .map(|pq| pq.as_str())
        .unwrap_or("/")
        .to_string();
    let mut builder = axum::http::Request::builder()
        .method(parts.method.clone())
        .uri(uri);
    for (k, v) in parts.headers.iter() {
        // The client's own credentials and hop-by-hop headers stay here; the sidecar's
        // identity (the pod's ServiceAccount) is used upstream.
        if matches!(
            k.as_str(),
            "authorization"
                | "host"
                | "content-length"
                | "connection"
                | "transfer-encoding"
                | PIN_HEADER
                | PIN_UID_HEADER
        ) {
            continue;
        }
        builder = builder.header(k, v);
    }
    builder.body(body)
}

/// What the proxy needs besides its client.
pub(super) struct ProxyConfig {
    pub state: watch::Receiver<LeaderState>,
    pub lease: String,
    pub namespace: String,
    pub acknowledged: Acknowledged,
    pub allow_unacknowledged: bool,
    /// An earlier run of the sidecar in this pod had led (its token directory says so).
    pub led_before: bool,
    /// Every request must carry it ([`crate::sidecar::secret`]).
    pub secret: Arc<crate::sidecar::secret::ApiSecret>,
}

/// The proxy's router.
pub(super) fn router(client: kube::Client, cfg: ProxyConfig) -> Router {
    let secret = cfg.secret;
    Router::new()
        .fallback(forward)
        .layer(axum::middleware::from_fn_with_state(secret, gate))
        .with_state(Arc::new(Proxy {
            client,
            state: cfg.state,
            lease: cfg.lease,
            namespace: cfg.namespace,
            acknowledged: cfg.acknowledged,
            allow_unacknowledged: cfg.allow_unacknowledged,
            led_before: cfg.led_before,
        }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{LEASE_UID_ANNOTATION, TOKEN_ANNOTATION, WRITE_ID_ANNOTATION};

    #[test]
    fn unpinned_writes_wait_for_the_app_after_a_loss() {
        // (tenure, acknowledged, an earlier run of the sidecar had led, sent)
        #[rustfmt::skip]
        let table = [
            (1, 0, false, true),  // the pod's first tenure: nothing the app decided is older
            (1, 0, true, false),  // a restarted sidecar's first: the app may hold old writes
            (1, 1, true, true),
            (2, 0, false, false), // the lease came back: not until the app shows it knows
            (2, 1, false, false), // it acknowledged an earlier tenure only
            (2, 2, false, true),
            (5, 2, true, false),
            (5, 5, true, true),
        ];
        for (tenure, acked, led, sent) in table {
            assert_eq!(
                admits_unpinned(tenure, acked, led),
                sent,
                "{tenure} {acked} {led}"
            );
        }
    }

    #[test]
    fn a_pinned_write_goes_out_only_in_the_tenure_it_was_decided_in() {
        let now = FencingToken {
            lease_uid: "u1".into(),
            generation: 9,
        };
        /// (fencedlease-token, fencedlease-lease-uid, what the proxy does).
        type Case<'a> = (Option<&'a str>, Option<&'a str>, Result<(), &'a str>);
        #[rustfmt::skip]
        let table: [Case; 8] = [
            (None, None, Ok(())),
            (Some("9"), None, Ok(())),
            (Some("9"), Some("u1"), Ok(())),
            (Some("6"), None, Err("decided under token 6")),
            (Some("9"), Some("u0"), Err("lease uid u0")),
            (Some("10"), None, Err("decided under token 10")),
            (Some("09"), None, Err("is not a token")),
            (None, Some("u1"), Err("needs fencedlease-token")),
        ];
        for (token, uid, want) in table {
            let got = check_pin(token, uid, &now);
            match (&got, want) {
                (Ok(()), Ok(())) => {}
                (Err(m), Err(w)) if m.contains(w) => {}
                _ => panic!("{token:?} {uid:?}: got {got:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn a_delete_is_announced_only_for_protected_objects_with_the_write_id_as_intent() {
        let t = FencingToken {
            lease_uid: "u1".into(),
            generation: 9,
        };
        let protected = json!({"kind": "ConfigMap", "metadata": {"labels": {LEASE_LABEL: "db"}}});
        assert_eq!(protected_by(&protected), Some("db"));
        for other in [
            json!({"kind": "ConfigMapList", "metadata": {}, "items": [protected.clone()]}),
            json!({"metadata": {"labels": {LEASE_LABEL: ""}}}),
            json!({"metadata": {"labels": {"app": "db"}}}),
            json!([]),
        ] {
            assert_eq!(protected_by(&other), None, "{other}");
        }
        let a = &announcement(&t)["metadata"]["annotations"];
        assert_eq!(a[TOKEN_ANNOTATION], "9");
        assert_eq!(a[LEASE_UID_ANNOTATION], "u1");
        assert!(a[WRITE_ID_ANNOTATION]
            .as_str()
            .is_some_and(|id| id.starts_with("9-")));
        assert_eq!(a[DELETE_INTENT_ANNOTATION], a[WRITE_ID_ANNOTATION]);
        let b = &announcement(&t)["metadata"]["annotations"];
        assert_ne!(
            a[WRITE_ID_ANNOTATION], b[WRITE_ID_ANNOTATION],
            "a new id each time"
        );
    }

    #[test]
    fn a_delete_s_own_precondition_moves_to_the_announced_version() {
        let body =
            br#"{"kind":"DeleteOptions","preconditions":{"resourceVersion":"41","uid":"u"}}"#;
        assert_eq!(precondition_of(body).as_deref(), Some("41"));
        let moved: Value =
            serde_json::from_slice(&with_precondition(body.to_vec(), "42")).expect("json");
        assert_eq!(moved["preconditions"]["resourceVersion"], "42");
        assert_eq!(moved["preconditions"]["uid"], "u");
        for other in [
            &b""[..],
            b"{}",
            br#"{"preconditions":{"uid":"u"}}"#,
            b"not json",
        ] {
            assert_eq!(precondition_of(other), None);
            assert_eq!(
                with_precondition(other.to_vec(), "42"),
                other.to_vec(),
                "left alone"
            );
        }
    }

    #[test]
    fn which_bodies_get_the_token() {
        assert_eq!(rewrite_for(&Method::GET, None), Rewrite::Pass);
        assert_eq!(rewrite_for(&Method::DELETE, None), Rewrite::Pass);
        assert_eq!(
            rewrite_for(&Method::POST, Some("application/json")),
            Rewrite::Stamp(BodyKind::Object)
        );
        assert_eq!(
            rewrite_for(&Method::PUT, Some("application/json; charset=utf-8")),
            Rewrite::Stamp(BodyKind::Object)
        );
        assert_eq!(
            rewrite_for(&Method::PATCH, Some("application/merge-patch+json")),
            Rewrite::Stamp(BodyKind::Object)
        );
        assert_eq!(
            rewrite_for(
                &Method::PATCH,
                Some("application/strategic-merge-patch+json")
            ),
            Rewrite::Stamp(BodyKind::Object)
        );
        assert_eq!(
            rewrite_for(&Method::PATCH, Some("application/json-patch+json")),
            Rewrite::Stamp(BodyKind::JsonPatch)
        );
        assert_eq!(
            rewrite_for(&Method::PATCH, Some("application/apply-patch+yaml")),
            Rewrite::Stamp(BodyKind::Apply)
        );
        assert!(matches!(
            rewrite_for(&Method::POST, Some("application/vnd.kubernetes.protobuf")),
            Rewrite::Unsupported(_)
        ));
    }

    #[test]
    fn stamping_adds_the_annotations_with_a_new_write_id_and_overrides_what_the_app_sent() {
        let t = FencingToken {
            lease_uid: "u1".into(),
            generation: 9,
        };
        let mut ids = Vec::new();
        for body in [
            r#"{"data":{"a":"1"}}"#,
            r#"{"metadata":{"annotations":null}}"#,
            r#"{"metadata":{"annotations":{"fencedlease.io/token":"1","x":"y"}}}"#,
        ] {
            let out: Value = serde_json::from_slice(
                &stamp(BodyKind::Object, body.as_bytes(), &t).expect("stamp"),
            )
            .expect("json");
            assert_eq!(out["metadata"]["annotations"][TOKEN_ANNOTATION], "9");
            assert_eq!(out["metadata"]["annotations"][LEASE_UID_ANNOTATION], "u1");
            ids.push(out["metadata"]["annotations"][WRITE_ID_ANNOTATION].clone());
        }
        // Every write presents a write id of its own.
        assert!(
            ids.iter()
                .all(|id| id.as_str().is_some_and(|s| s.starts_with("9-"))),
            "{ids:?}"
        );
        ids.sort_by_key(|v| v.to_string());
        ids.dedup();
        assert_eq!(ids.len(), 3, "write ids repeat: {ids:?}");
        for bad in [
            "",
            "[]",
            "3",
            r#"{"metadata":3}"#,
            r#"{"metadata":{"annotations":[]}}"#,
        ] {
            assert!(
                stamp(BodyKind::Object, bad.as_bytes(), &t).is_err(),
                "{bad}"
            );
        }
    }
}
