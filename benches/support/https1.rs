//! A minimal blocking HTTPS/1.1 client for the load generators (one OS thread per keep-alive
//! connection, rustls): connect with a CA file, send a request, read one response (with a
//! Content-Length or chunked), so that what is timed is the server and not a client's pool.

use std::io::{Read, Write};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};

pub type Error = Box<dyn std::error::Error + Send + Sync>;

pub struct Conn {
    tls: rustls::StreamOwned<rustls::ClientConnection, std::net::TcpStream>,
    buf: Vec<u8>,
}

/// A client configuration trusting only the CA(s) in `ca_pem`, speaking HTTP/1.1.
pub fn client_config(ca_pem: &[u8]) -> Result<Arc<rustls::ClientConfig>, Error> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem) {
        roots.add(c?)?;
    }
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// A TLS connection to `addr` (host:port; the host is the name the certificate must carry).
pub fn connect(addr: &str, cfg: &Arc<rustls::ClientConfig>) -> Result<Conn, Error> {
    let tcp = std::net::TcpStream::connect(addr)?;
    tcp.set_nodelay(true)?;
    let host = addr.rsplit_once(':').map(|(h, _)| h).unwrap_or(addr);
    let name = ServerName::try_from(host.to_string())?;
    let conn = rustls::ClientConnection::new(cfg.clone(), name)?;
    Ok(Conn {
        tls: rustls::StreamOwned::new(conn, tcp),
        buf: Vec::with_capacity(8192),
    })
}

pub fn find(h: &[u8], needle: &[u8]) -> Option<usize> {
    h.windows(needle.len()).position(|w| w == needle)
}

/// One answer: its status code and its body.
pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

impl Conn {
    /// Sends `request` (a whole HTTP/1.1 request) and reads one response.
    pub fn roundtrip(&mut self, request: &[u8]) -> std::io::Result<Response> {
        self.tls.write_all(request)?;
        self.tls.flush()?;
        self.buf.clear();
        let end = loop {
            if let Some(end) = find(&self.buf, b"\r\n\r\n") {
                break end;
            }
            self.fill()?;
        };
        let head = String::from_utf8_lossy(&self.buf[..end]).to_ascii_lowercase();
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| std::io::Error::other("a response without a status code"))?;
        let header = |name: &str| {
            head.lines()
                .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_string()))
        };
        let rest = self.buf.split_off(end + 4);
        self.buf = rest;
        let body = if let Some(len) = header("content-length:").and_then(|v| v.parse().ok()) {
            self.read_exact_body(len)?
        } else if header("transfer-encoding:").is_some_and(|v| v.contains("chunked")) {
            self.read_chunked()?
        } else {
            return Err(std::io::Error::other(
                "a response with neither Content-Length nor chunked encoding",
            ));
        };
        Ok(Response { status, body })
    }

    fn fill(&mut self) -> std::io::Result<()> {
        let mut chunk = [0u8; 8192];
        let n = self.tls.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(())
    }

    /// Takes `len` bytes from the front of the buffer, reading more as needed.
    fn read_exact_body(&mut self, len: usize) -> std::io::Result<Vec<u8>> {
        while self.buf.len() < len {
            self.fill()?;
        }
        let rest = self.buf.split_off(len);
        Ok(std::mem::replace(&mut self.buf, rest))
    }

    fn read_chunked(&mut self) -> std::io::Result<Vec<u8>> {
        let mut body = Vec::new();
        loop {
            let line_end = loop {
                if let Some(i) = find(&self.buf, b"\r\n") {
                    break i;
                }
                self.fill()?;
            };
            let size_text = String::from_utf8_lossy(&self.buf[..line_end]).to_string();
            let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
                .map_err(|_| std::io::Error::other(format!("bad chunk size {size_text:?}")))?;
            self.buf.drain(..line_end + 2);
            // The chunk and its CRLF (after the last, empty chunk: the final CRLF, no trailers).
            let chunk = self.read_exact_body(size + 2)?;
            if size == 0 {
                return Ok(body);
            }
            body.extend_from_slice(&chunk[..size]);
        }
    }
}

/// The `p`th percentile of sorted nanoseconds, in microseconds.
pub fn pct(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (p / 100.0 * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)] as f64 / 1000.0
}

/// Percentiles and mean of nanosecond samples, in microseconds.
pub fn summary(mut v: Vec<u64>) -> serde_json::Value {
    v.sort_unstable();
    let mean = if v.is_empty() {
        f64::NAN
    } else {
        v.iter().map(|x| *x as f64).sum::<f64>() / v.len() as f64 / 1000.0
    };
    serde_json::json!({
        "p50_us": pct(&v, 50.0), "p90_us": pct(&v, 90.0), "p99_us": pct(&v, 99.0),
        "p999_us": pct(&v, 99.9), "max_us": pct(&v, 100.0), "mean_us": mean,
    })
}
