//! TLS for the sidecar's Kubernetes API proxy, and the kubeconfig that points an app at it.
//!
//! The proxy answers only requests with the pod's secret ([`crate::sidecar::secret`]), and standard
//! Kubernetes clients (kubectl, client-go's kubeconfig loading) send credentials over TLS
//! only. So the proxy serves TLS on loopback with a certificate of its own: a CA and a serving
//! certificate for 127.0.0.1, ::1 and localhost, written with the key into the token dir
//! (an emptyDir of the pod alone) and kept across restarts of the sidecar, so that an app's
//! loaded configuration stays good. Beside them the sidecar writes `kubeconfig`: the proxy's
//! address, its CA and the secret file (paths relative to the kubeconfig, as kubeconfigs
//! resolve them), for `KUBECONFIG=$FENCEDLEASE_KUBECONFIG`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use rustls::crypto::ring::default_provider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::api::{API_SECRET_FILE, PROXY_KUBECONFIG_FILE};
use crate::runtime::accept::accept_until;

/// The proxy's serving certificate (PEM), its key and the CA that signed it, in the token dir.
const CERT_FILE: &str = "proxy.crt";
const KEY_FILE: &str = "proxy.key";
pub const CA_FILE: &str = "proxy-ca.crt";
/// The names the serving certificate is for: the loopback addresses the proxy may listen on.
const HOSTS: [&str; 3] = ["127.0.0.1", "::1", "localhost"];
/// How long the proxy's certificates are valid: the pod's life is shorter, and they never
/// leave it.
const VALID_YEARS: i32 = 10;

/// Bounds of the proxy's server: connections at once (an app's clients keep a few open), the
/// TLS handshake, and a request's headers.
const MAX_CONNECTIONS: usize = 64;
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const HEADER_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub(super) enum ProxyTlsError {
    #[error("generating the proxy's certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("the certificate just written into {0} does not load back: is the token dir shared with a process that changes it?")]
    Unloadable(PathBuf),
    #[error("the proxy's TLS configuration: {0}")]
    Config(#[from] rustls::Error),
    #[error(
        "writing {path} failed: {source}. The proxy serves TLS with a certificate it keeps in \
         the token dir: make the token dir writable by the sidecar"
    )]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The proxy's TLS server configuration, from the certificate kept in `dir` or a new one.
pub(super) fn load_or_create(dir: &Path) -> Result<Arc<rustls::ServerConfig>, ProxyTlsError> {
    let (certs, key) = match kept(dir) {
        Some(kept) => kept,
        None => {
            generate_into(dir)?;
            match kept(dir) {
                Some(kept) => kept,
                None => return Err(ProxyTlsError::Unloadable(dir.to_path_buf())),
            }
        }
    };
    let mut cfg = rustls::ServerConfig::builder_with_provider(Arc::new(default_provider()))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// The certificate chain and key kept in `dir`, when all three files are there and parse.
fn kept(dir: &Path) -> Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)> {
    let cert = std::fs::read(dir.join(CERT_FILE)).ok()?;
    let key = std::fs::read(dir.join(KEY_FILE)).ok()?;
    std::fs::metadata(dir.join(CA_FILE)).ok()?;
    let certs: Vec<_> = CertificateDer::pem_slice_iter(&cert)
        .collect::<Result<_, _>>()
        .ok()?;
    let key = PrivateKeyDer::from_pem_slice(&key).ok()?;
    (!certs.is_empty()).then_some((certs, key))
}

/// Generates a CA and a serving certificate for [`HOSTS`] and writes them into `dir`: the
/// key first, the CA last (an app waits for the kubeconfig, written after all of them).
fn generate_into(dir: &Path) -> Result<(), ProxyTlsError> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    };
    let now = jiff::Timestamp::now()
        .to_zoned(jiff::tz::TimeZone::UTC)
        .date();
    let until = rcgen::date_time_ymd(
        i32::from(now.year()) + VALID_YEARS,
        now.month().unsigned_abs(),
        now.day().unsigned_abs().min(28),
    );
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.distinguished_name
        .push(DnType::CommonName, "fencedlease sidecar proxy CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    ca.not_after = until;
    let ca_key = KeyPair::generate()?;
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca, ca_key);
    let mut leaf = CertificateParams::new(HOSTS.map(String::from).to_vec())?;
    leaf.distinguished_name
        .push(DnType::CommonName, "fencedlease sidecar proxy");
    leaf.not_after = until;
    let key = KeyPair::generate()?;
    let cert = leaf.signed_by(&key, &issuer)?;
    write_atomic(&dir.join(KEY_FILE), &key.serialize_pem())?;
    write_atomic(&dir.join(CERT_FILE), &cert.pem())?;
    write_atomic(&dir.join(CA_FILE), &ca_cert.pem())
}

/// The kubeconfig of an app that talks to the API server through the proxy at `addr`, as
/// JSON (which every kubeconfig reader takes as YAML): the proxy's CA and the pod's secret by
/// paths relative to the kubeconfig itself, and `namespace` as the default namespace.
pub(super) fn kubeconfig(addr: SocketAddr, namespace: &str) -> serde_json::Value {
    let name = "fencedlease-proxy";
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": {
            "server": format!("https://{addr}"),
            "certificate-authority": CA_FILE,
        }}],
        "users": [{"name": name, "user": {"tokenFile": API_SECRET_FILE}}],
        "contexts": [{"name": name, "context": {
            "cluster": name, "user": name, "namespace": namespace,
        }}],
        "current-context": name,
    })
}

/// Writes [`kubeconfig`] into `dir` (after the certificate and the secret, which it names).
pub(super) fn write_kubeconfig(
    dir: &Path,
    addr: SocketAddr,
    namespace: &str,
) -> Result<(), ProxyTlsError> {
    let text = format!("{:#}\n", kubeconfig(addr, namespace));
    write_atomic(&dir.join(PROXY_KUBECONFIG_FILE), &text)
}

fn write_atomic(path: &Path, content: &str) -> Result<(), ProxyTlsError> {
    // NAME.tmp beside NAME (with_extension would give proxy.crt and proxy.key one name).
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let parent = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent)
        .and_then(|()| std::fs::write(&tmp, content))
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|source| ProxyTlsError::Write {
            path: path.to_path_buf(),
            source,
        })
}

/// Serves `router` over TLS on `listener` until `stop`: at most [`MAX_CONNECTIONS`] at once
/// (one more waits for a slot, the rest in the listen queue), each handshake within [`HANDSHAKE_TIMEOUT`] and each
/// request's headers within [`HEADER_TIMEOUT`]; at `stop`, open connections finish the
/// request under way and close.
pub(super) async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    tls: Arc<rustls::ServerConfig>,
    stop: CancellationToken,
) -> std::io::Result<()> {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let tracker = tokio_util::task::TaskTracker::new();
    let stopped = stop.clone().cancelled_owned();
    accept_until(&listener, "API proxy", stopped, |tcp, _| {
        let (slots, acceptor, router, stop) = (
            slots.clone(),
            acceptor.clone(),
            router.clone(),
            stop.clone(),
        );
        let tracker = tracker.clone();
        async move {
            // All slots taken: wait for one before the next accept (the rest wait in the
            // listen queue).
            let Ok(slot) = slots.acquire_owned().await else {
                return;
            };
            tracker.spawn(async move {
                let _slot = slot;
                connection(tcp, acceptor, router, stop).await;
            });
        }
    })
    .await;
    tracker.close();
    tracker.wait().await;
    Ok(())
}

/// One connection: the handshake, then HTTP/1.1 requests until the client closes or `stop`.
async fn connection(
    tcp: tokio::net::TcpStream,
    acceptor: tokio_rustls::TlsAcceptor,
    router: Router,
    stop: CancellationToken,
) {
    let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => return debug!(error = %e, "API proxy: TLS handshake failed"),
        Err(_) => return debug!("API proxy: TLS handshake timed out"),
    };
    let service = hyper_util::service::TowerToHyperService::new(router);
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .keep_alive(true)
        .serve_connection(hyper_util::rt::TokioIo::new(tls), service);
    tokio::pin!(conn);
    tokio::select! {
        r = conn.as_mut() => {
            if let Err(e) = r {
                debug!(error = %e, "API proxy: connection ended");
            }
        }
        _ = stop.cancelled() => {
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_certificate_is_made_once_and_kept_across_restarts() {
        let dir = std::env::temp_dir().join(format!("fl-proxy-tls-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        load_or_create(&dir).expect("create");
        let ca = std::fs::read_to_string(dir.join(CA_FILE)).expect("ca");
        let cert = std::fs::read_to_string(dir.join(CERT_FILE)).expect("cert");
        assert!(ca.starts_with("-----BEGIN CERTIFICATE-----"), "{ca}");
        load_or_create(&dir).expect("load");
        assert_eq!(std::fs::read_to_string(dir.join(CA_FILE)).expect("ca"), ca);
        assert_eq!(
            std::fs::read_to_string(dir.join(CERT_FILE)).expect("cert"),
            cert
        );
        // A broken key is replaced, with a new CA.
        std::fs::write(dir.join(KEY_FILE), "not a key").expect("write");
        load_or_create(&dir).expect("replace");
        assert_ne!(std::fs::read_to_string(dir.join(CA_FILE)).expect("ca"), ca);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_kubeconfig_names_the_proxy_its_ca_and_the_secret_relative_to_itself() {
        let addr: SocketAddr = "127.0.0.1:8788".parse().expect("addr");
        let k = kubeconfig(addr, "shop");
        assert_eq!(
            k["clusters"][0]["cluster"]["server"],
            "https://127.0.0.1:8788"
        );
        assert_eq!(
            k["clusters"][0]["cluster"]["certificate-authority"],
            CA_FILE
        );
        assert_eq!(k["users"][0]["user"]["tokenFile"], API_SECRET_FILE);
        assert_eq!(k["contexts"][0]["context"]["namespace"], "shop");
        assert_eq!(k["current-context"], k["contexts"][0]["name"]);
        let v6: SocketAddr = "[::1]:8788".parse().expect("addr");
        assert_eq!(
            kubeconfig(v6, "shop")["clusters"][0]["cluster"]["server"],
            "https://[::1]:8788"
        );
    }
}
