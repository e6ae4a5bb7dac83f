//! The pod's API secret. The sidecar's API hands out the token and its proxy writes with the
//! pod's credentials; both listen on the pod's loopback, which is not private: `kubectl
//! port-forward` (anyone with `pods/portforward`) connects to it from outside. So both answer
//! only requests that carry a secret which only the pod's containers can read: a random value
//! the sidecar writes at start into the token directory (an emptyDir mounted in the pod alone),
//! sent as `Authorization: Bearer SECRET`. The health endpoints stay open (they tell nothing a
//! probe does not).

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::api::{API_SECRET_ENV, API_SECRET_FILE};

/// Random bytes in a secret (written as twice as many hex digits).
const SECRET_BYTES: usize = 32;

/// The secret, and where the pod's containers read it.
#[derive(Debug)]
pub(super) struct ApiSecret {
    value: String,
    path: PathBuf,
}

/// Why the secret could not be had; the sidecar does not start without it.
#[derive(Debug, thiserror::Error)]
pub(super) enum SecretError {
    #[error(
        "reading the API secret {path} failed: {source}. Make the token dir readable by the \
         sidecar, or remove the file (a new secret is then written)"
    )]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "writing the API secret {path} failed: {source}. The sidecar's API and proxy answer \
         only requests that send it, so the sidecar does not start: make the token dir \
         writable by the sidecar"
    )]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("drawing the API secret from /dev/urandom failed: {0}")]
    Random(std::io::Error),
}

impl ApiSecret {
    /// The secret in `dir`, kept from an earlier run of the sidecar in this pod (the app may
    /// have read it already), or a new one written there when there is none or it is not one
    /// of ours.
    pub(super) fn load_or_create(dir: &Path) -> Result<Self, SecretError> {
        let path = dir.join(API_SECRET_FILE);
        match std::fs::read_to_string(&path) {
            Ok(text) if is_secret(text.trim_end()) => {
                let value = text.trim_end().to_string();
                return Ok(ApiSecret { value, path });
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(SecretError::Read { path, source }),
        }
        let value = random_hex()?;
        let write = |path: &Path| -> std::io::Result<()> {
            std::fs::create_dir_all(dir)?;
            let mut tmp = path.as_os_str().to_owned();
            tmp.push(".tmp");
            std::fs::write(&tmp, format!("{value}\n"))?;
            std::fs::rename(&tmp, path)
        };
        write(&path).map_err(|source| SecretError::Write {
            path: path.clone(),
            source,
        })?;
        Ok(ApiSecret { value, path })
    }

    /// Whether `headers` carry this secret as a bearer token (compared in constant time).
    pub(super) fn admits(&self, headers: &HeaderMap) -> bool {
        bearer(headers).is_some_and(|given| same(given.as_bytes(), self.value.as_bytes()))
    }

    /// What to tell a request that did not send the secret.
    pub(super) fn refusal_message(&self) -> String {
        format!(
            "fencedlease sidecar: this endpoint answers only requests of the pod's own \
             containers: send the header `Authorization: Bearer SECRET`, SECRET being the \
             contents of {} (${API_SECRET_ENV} in an injected pod; the fencedlease clients \
             read it themselves)",
            self.path.display()
        )
    }
}

/// Middleware: the request goes on only with the secret; else 401 with what to send.
pub(super) async fn require(
    State(secret): State<Arc<ApiSecret>>,
    req: Request,
    next: Next,
) -> Response {
    if secret.admits(req.headers()) {
        return next.run(req).await;
    }
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        Json(serde_json::json!({"error": secret.refusal_message()})),
    )
        .into_response()
}

/// The credentials of `Authorization: Bearer CREDENTIALS` (the scheme's case ignored).
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, credentials) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| credentials.trim())
}

/// Byte equality whose time depends on the lengths only, not on where the bytes differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether `s` is a secret this sidecar writes: `2 * SECRET_BYTES` lowercase hex digits.
fn is_secret(s: &str) -> bool {
    s.len() == 2 * SECRET_BYTES && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fn random_hex() -> Result<String, SecretError> {
    let mut bytes = [0u8; SECRET_BYTES];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(SecretError::Random)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(authorization: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(v) = authorization {
            h.insert(header::AUTHORIZATION, v.parse().expect("header value"));
        }
        h
    }

    #[test]
    fn only_the_exact_secret_as_a_bearer_token_is_admitted() {
        let secret = ApiSecret {
            value: "ab".repeat(SECRET_BYTES),
            path: PathBuf::from("/x/api-secret"),
        };
        let good = format!("Bearer {}", "ab".repeat(SECRET_BYTES));
        let lower = format!("bearer {}", "ab".repeat(SECRET_BYTES));
        let short = format!("Bearer {}", "ab".repeat(SECRET_BYTES - 1));
        let longer = format!("Bearer {}c", "ab".repeat(SECRET_BYTES));
        let other = format!("Bearer {}", "ba".repeat(SECRET_BYTES));
        let basic = format!("Basic {}", "ab".repeat(SECRET_BYTES));
        let table: [(Option<&str>, bool); 8] = [
            (Some(&good), true),
            (Some(&lower), true),
            (None, false),
            (Some("Bearer "), false),
            (Some(&short), false),
            (Some(&longer), false),
            (Some(&other), false),
            (Some(&basic), false),
        ];
        for (auth, admitted) in table {
            assert_eq!(secret.admits(&headers(auth)), admitted, "{auth:?}");
        }
        assert!(secret.refusal_message().contains("/x/api-secret"));
        assert!(secret.refusal_message().contains(API_SECRET_ENV));
    }

    #[test]
    fn the_secret_is_written_once_and_kept_across_restarts() {
        let dir = std::env::temp_dir().join(format!("fl-secret-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let first = ApiSecret::load_or_create(&dir).expect("create");
        assert!(is_secret(&first.value), "{}", first.value);
        let on_disk = std::fs::read_to_string(dir.join(API_SECRET_FILE)).expect("file");
        assert_eq!(on_disk, format!("{}\n", first.value));
        let again = ApiSecret::load_or_create(&dir).expect("load");
        assert_eq!(
            again.value, first.value,
            "a restarted sidecar keeps the pod's secret"
        );
        // Something that is not one of ours is replaced by a new secret.
        std::fs::write(dir.join(API_SECRET_FILE), "guessable\n").expect("write");
        let replaced = ApiSecret::load_or_create(&dir).expect("replace");
        assert!(is_secret(&replaced.value) && replaced.value != first.value);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_unreadable_secret_stops_the_start_with_what_to_do() {
        let dir = std::env::temp_dir().join(format!("fl-secret-dir-{}", std::process::id()));
        // A directory in the file's place: reading it fails, even for root.
        std::fs::create_dir_all(dir.join(API_SECRET_FILE)).expect("dir");
        let err = ApiSecret::load_or_create(&dir).expect_err("must not start");
        assert!(matches!(err, SecretError::Read { .. }), "{err:?}");
        assert!(err.to_string().contains("remove the file"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
