//! TLS for the webhook: certificates from files, reloaded when their content changes (which
//! covers Kubernetes' `..data` symlink swap of a mounted Secret), and a generator of a local CA
//! and serving certificate for use without cert-manager.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use rustls::crypto::ring::default_provider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tracing::{info, warn};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} holds a malformed PEM certificate: {detail}")]
    BadCertificate { path: PathBuf, detail: String },
    #[error("{path} holds no PEM certificate")]
    NoCertificate { path: PathBuf },
    #[error("{path} holds no usable PEM private key: {detail}")]
    BadKey { path: PathBuf, detail: String },
    #[error("generating certificates: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("writing {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Where the serving certificate and key live.
#[derive(Clone, Debug)]
pub(crate) struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// Loads a certificate chain and key into a rustls CertifiedKey.
pub(crate) fn load(files: &CertFiles) -> Result<(CertifiedKey, Vec<u8>), TlsError> {
    let cert_pem = read(&files.cert)?;
    let key_pem = read(&files.key)?;
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::BadCertificate {
            path: files.cert.clone(),
            detail: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            path: files.cert.clone(),
        });
    }
    let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| TlsError::BadKey {
        path: files.key.clone(),
        detail: e.to_string(),
    })?;
    let provider = default_provider();
    let signing = provider
        .key_provider
        .load_private_key(key)
        .map_err(|e| TlsError::BadKey {
            path: files.key.clone(),
            detail: e.to_string(),
        })?;
    let mut fingerprint = cert_pem;
    fingerprint.extend_from_slice(&key_pem);
    Ok((CertifiedKey::new(certs, signing), fingerprint))
}

/// When the leaf certificate of a chain expires, in seconds since the Unix epoch (None when it
/// cannot be parsed: rustls then refuses it anyway).
pub(crate) fn not_after_unix(key: &CertifiedKey) -> Option<i64> {
    let leaf = key.cert.first()?;
    let (_, cert) = x509_parser::parse_x509_certificate(leaf).ok()?;
    Some(cert.validity().not_after.timestamp())
}

/// Serves whatever certificate was loaded last; `watch` replaces it when the files change.
#[derive(Debug)]
pub struct ReloadingCert {
    current: RwLock<Arc<CertifiedKey>>,
    /// The expiry of the certificate being served, for the metric that alerts on it.
    not_after: Gauge,
}

impl ReloadingCert {
    pub fn new(first: CertifiedKey) -> Arc<ReloadingCert> {
        let cert = ReloadingCert {
            current: RwLock::new(Arc::new(first)),
            not_after: Gauge::default(),
        };
        cert.note_expiry();
        Arc::new(cert)
    }

    /// A gauge of the serving certificate's expiry (Unix seconds), kept current on reloads.
    pub(crate) fn not_after_gauge(&self) -> Gauge {
        self.not_after.clone()
    }

    fn note_expiry(&self) {
        let cur = self.current.read().unwrap_or_else(|p| p.into_inner());
        self.not_after.set(not_after_unix(&cur).unwrap_or(0));
    }

    fn set(&self, key: CertifiedKey) {
        {
            let mut cur = self.current.write().unwrap_or_else(|p| p.into_inner());
            *cur = Arc::new(key);
        }
        self.note_expiry();
    }

    /// Polls the files every `every` and swaps in a new certificate when their content changed.
    /// A half-written or broken pair is skipped (the old certificate keeps serving) and retried.
    pub(crate) async fn watch(
        self: Arc<Self>,
        files: CertFiles,
        mut fingerprint: Vec<u8>,
        every: Duration,
    ) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let files = files.clone();
            let loaded = tokio::task::spawn_blocking(move || load(&files)).await;
            match loaded {
                Ok(Ok((key, fp))) if fp != fingerprint => {
                    self.set(key);
                    fingerprint = fp;
                    info!("reloaded the serving certificate");
                }
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    warn!(error = %e, "certificate files unreadable; still serving the previous one")
                }
                Err(e) => warn!(error = %e, "certificate reload task failed"),
            }
        }
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.current
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        )
    }
}

/// A rustls server config that always serves the current certificate.
pub fn server_config(cert: Arc<ReloadingCert>) -> Result<rustls::ServerConfig, rustls::Error> {
    let mut cfg = rustls::ServerConfig::builder_with_provider(Arc::new(default_provider()))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(cert);
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(cfg)
}

/// A CA and a serving certificate signed by it, as PEM.
pub struct Generated {
    pub ca_cert: String,
    pub ca_key: String,
    pub cert: String,
    pub key: String,
}

/// How long a serving certificate is valid.
pub(crate) const SERVING_CERT_DAYS: i64 = 365;

/// The date a serving certificate issued now expires (UTC, whole days).
pub(crate) fn serving_not_after() -> jiff::civil::Date {
    let today = jiff::Timestamp::now()
        .to_zoned(jiff::tz::TimeZone::UTC)
        .date();
    today
        .checked_add(jiff::Span::new().days(SERVING_CERT_DAYS))
        .unwrap_or(today)
}

/// Generates a fresh CA (unless one is given) and a serving certificate for `hosts` (DNS names
/// or IP addresses), valid until [`serving_not_after`].
pub fn generate(hosts: &[String], ca: Option<(&str, &str)>) -> Result<Generated, TlsError> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    };
    let (ca_cert_pem, ca_key_pem) = match ca {
        Some((c, k)) => (c.to_string(), k.to_string()),
        None => {
            let mut p = CertificateParams::new(Vec::<String>::new())?;
            p.distinguished_name
                .push(DnType::CommonName, "fencedlease webhook CA");
            p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
            let k = KeyPair::generate()?;
            let c = p.self_signed(&k)?;
            (c.pem(), k.serialize_pem())
        }
    };
    let ca_key = KeyPair::from_pem(&ca_key_pem)?;
    let issuer = Issuer::from_ca_cert_pem(&ca_cert_pem, ca_key)?;
    let mut p = CertificateParams::new(hosts.to_vec())?;
    p.distinguished_name.push(
        DnType::CommonName,
        hosts
            .first()
            .map(String::as_str)
            .unwrap_or("fencedlease-webhook"),
    );
    let end = serving_not_after();
    p.not_after = rcgen::date_time_ymd(
        i32::from(end.year()),
        end.month().unsigned_abs(),
        end.day().unsigned_abs(),
    );
    let k = KeyPair::generate()?;
    let c = p.signed_by(&k, &issuer)?;
    Ok(Generated {
        ca_cert: ca_cert_pem,
        ca_key: ca_key_pem,
        cert: c.pem(),
        key: k.serialize_pem(),
    })
}

/// Writes a file atomically (write a temporary file, then rename), so readers never see half.
pub(crate) fn write_atomic(path: &Path, content: &str) -> Result<(), TlsError> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, content)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|source| TlsError::Write {
            path: path.to_path_buf(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_expiry_metric_reads_the_served_certificates_not_after() {
        let g = generate(&["fencedlease-webhook.ns.svc".into()], None).unwrap();
        let dir = std::env::temp_dir().join(format!("fl-tls-expiry-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let files = CertFiles {
            cert: dir.join("tls.crt"),
            key: dir.join("tls.key"),
        };
        std::fs::write(&files.cert, &g.cert).unwrap();
        std::fs::write(&files.key, &g.key).unwrap();
        let (key, _) = load(&files).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let want = serving_not_after()
            .to_zoned(jiff::tz::TimeZone::UTC)
            .unwrap()
            .timestamp()
            .as_second();
        assert_eq!(not_after_unix(&key), Some(want));
        let reloading = ReloadingCert::new(key);
        assert_eq!(reloading.not_after_gauge().get(), want);
    }
}
