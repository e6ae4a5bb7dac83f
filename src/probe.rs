//! The HTTP health probe the sidecar makes of the app (`fencedlease.io/app-health-url`) and
//! `fencedlease probe URL` runs: a strict parser of plain `http://` URLs and one GET that must
//! answer 2xx in time. Shared by the sidecar, the injector (which checks the annotation) and
//! the `probe` command.

use std::time::Duration;

use axum::http::Uri;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A plain http:// URL split into what a GET needs.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct HttpUrl {
    /// The host name or IP address to connect to; an IPv6 address without its brackets.
    pub host: String,
    pub port: u16,
    /// The path and query to request; always starts with `/`.
    pub path: String,
}

impl HttpUrl {
    /// The Host header's value: an IPv6 address in brackets; the port unless it is 80.
    pub(crate) fn host_header(&self) -> String {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        if self.port == 80 {
            host
        } else {
            format!("{host}:{}", self.port)
        }
    }
}

/// Why a URL is not one the health check can use. Each message says what is wrong and how to
/// write it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum UrlError {
    #[error("not a URL ({0}); write http://HOST[:PORT]/PATH")]
    NotAUrl(String),
    #[error(
        "only http:// URLs are supported for the app health check (write http://HOST[:PORT]/PATH)"
    )]
    NotHttp,
    #[error("user info (USER@HOST) is not supported: remove it")]
    UserInfo,
    #[error("unclosed '[' in the host; {HOW}")]
    UnclosedBracket,
    #[error("[{0}] is not an IPv6 address (zone IDs are not supported); {HOW}")]
    NotIpv6(String),
    #[error("unexpected {0:?} after the IPv6 address; {HOW}")]
    AfterIpv6(String),
    #[error("no host; {HOW}")]
    NoHost,
    #[error("{0:?} is neither a host name nor an IP address; {HOW}")]
    NotAHost(String),
    #[error("port {0} is out of range: use 1 to 65535")]
    PortOutOfRange(String),
    #[error("bad port {0:?}: use a number from 1 to 65535")]
    BadPort(String),
}

const HOW: &str = "write http://HOST[:PORT]/PATH, an IPv6 HOST in brackets";

/// A URL the health check refused, with the URL itself in the message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{url:?}: {why}")]
pub(crate) struct BadUrl {
    pub url: String,
    pub why: UrlError,
}

/// Parses `http://HOST[:PORT][/PATH][?QUERY]`, where HOST is a name, an IPv4 address or an IPv6
/// address in brackets (`http://[::1]:8080/healthz`). Only plain HTTP, without user info: the
/// app listens inside the pod. The error says what is wrong and how to write it.
pub(crate) fn parse_http_url(url: &str) -> Result<HttpUrl, BadUrl> {
    let bad = |why: UrlError| BadUrl {
        url: url.to_string(),
        why,
    };
    let uri: Uri = url
        .parse()
        .map_err(|e: axum::http::uri::InvalidUri| bad(UrlError::NotAUrl(e.to_string())))?;
    if !uri
        .scheme_str()
        .is_some_and(|s| s.eq_ignore_ascii_case("http"))
    {
        return Err(bad(UrlError::NotHttp));
    }
    let authority = uri.authority().map_or("", |a| a.as_str());
    if authority.contains('@') {
        return Err(bad(UrlError::UserInfo));
    }
    let (host, port) = split_host_port(authority).map_err(bad)?;
    let path = match uri.path_and_query().map_or("", |p| p.as_str()) {
        "" => "/".to_string(),
        p if p.starts_with('/') => p.to_string(),
        p => format!("/{p}"),
    };
    Ok(HttpUrl { host, port, path })
}

/// Splits a URL's authority (user info already refused) into the host to connect to and the
/// port (80 when absent).
fn split_host_port(authority: &str) -> Result<(String, u16), UrlError> {
    let (host, port) = if let Some(rest) = authority.strip_prefix('[') {
        let (inside, after) = rest.split_once(']').ok_or(UrlError::UnclosedBracket)?;
        let ip: std::net::Ipv6Addr = inside
            .parse()
            .map_err(|_| UrlError::NotIpv6(inside.to_string()))?;
        if !after.is_empty() && !after.starts_with(':') {
            return Err(UrlError::AfterIpv6(after.to_string()));
        }
        (ip.to_string(), after.strip_prefix(':'))
    } else {
        let (h, p) = match authority.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        };
        if h.is_empty() {
            return Err(UrlError::NoHost);
        }
        let name_char = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '.';
        if !h.chars().all(name_char) {
            return Err(UrlError::NotAHost(h.to_string()));
        }
        (h.to_string(), p)
    };
    Ok((host, parse_port(port)?))
}

/// The port of an authority: 80 when absent, else a number from 1 to 65535.
fn parse_port(port: Option<&str>) -> Result<u16, UrlError> {
    match port {
        None => Ok(80),
        Some(p) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => match p.parse() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(UrlError::PortOutOfRange(p.to_string())),
        },
        Some(p) => Err(UrlError::BadPort(p.to_string())),
    }
}

/// One health check: a GET that must answer 2xx within `timeout`.
pub(crate) async fn check_health(url: &HttpUrl, timeout: Duration) -> bool {
    let fut = async {
        let mut stream = tokio::net::TcpStream::connect((url.host.as_str(), url.port))
            .await
            .ok()?;
        let req = format!(
            "GET {} HTTP/1.1\r\nHost: {}\r\nUser-Agent: fencedlease-sidecar\r\nConnection: close\r\n\r\n",
            url.path,
            url.host_header()
        );
        stream.write_all(req.as_bytes()).await.ok()?;
        let mut buf = [0u8; 16];
        let mut n = 0;
        while n < 12 {
            let r = stream.read(&mut buf[n..]).await.ok()?;
            if r == 0 {
                break;
            }
            n += r;
        }
        let head = std::str::from_utf8(&buf[..n]).ok()?;
        let code = head.strip_prefix("HTTP/1.")?.get(2..5)?;
        Some(code.starts_with('2'))
    };
    matches!(tokio::time::timeout(timeout, fut).await, Ok(Some(true)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_urls_parse_strictly() {
        let ok = |host: &str, port: u16, path: &str| {
            Ok(HttpUrl {
                host: host.into(),
                port,
                path: path.into(),
            })
        };
        for (url, want) in [
            (
                "http://127.0.0.1:8080/healthz",
                ok("127.0.0.1", 8080, "/healthz"),
            ),
            ("http://localhost", ok("localhost", 80, "/")),
            ("http://localhost/", ok("localhost", 80, "/")),
            (
                "HTTP://App-1.svc.local:81/a/b?x=1&y",
                ok("App-1.svc.local", 81, "/a/b?x=1&y"),
            ),
            ("http://h?ready", ok("h", 80, "/?ready")),
            ("http://[::1]:8080/", ok("::1", 8080, "/")),
            ("http://[::1]/", ok("::1", 80, "/")),
            ("http://[::1]", ok("::1", 80, "/")),
            (
                "http://[2001:DB8::1]:65535/h",
                ok("2001:db8::1", 65535, "/h"),
            ),
            (
                "http://[::ffff:127.0.0.1]:9/",
                ok("::ffff:127.0.0.1", 9, "/"),
            ),
            ("http://h:1/p#frag", ok("h", 1, "/p")),
        ] {
            assert_eq!(parse_http_url(url), want, "{url}");
        }
        for (bad, says) in [
            ("https://x/", "only http://"),
            ("ftp://x/", "only http://"),
            ("x:80", "only http://"),
            ("/healthz", "only http://"),
            ("", "not a URL"),
            ("http://", "not a URL"),
            ("http://:80/", "no host"),
            ("http:///p", "not a URL"),
            ("http://h:0/", "out of range"),
            ("http://h:99999/", "out of range"),
            ("http://[::1]:70000/", "out of range"),
            ("http://h:x/", "bad port"),
            ("http://h:+80/", "bad port"),
            ("http://h:/", "bad port"),
            ("http://[::1]:/", "bad port"),
            ("http://user:pw@h/", "user info"),
            ("http://u@[::1]:80/", "user info"),
            ("http://::1/", "not a URL"),
            ("http://[::1/", "not a URL"),
            ("http://[nope]/", "not an IPv6 address"),
            ("http://[fe80::1%25eth0]/", "not an IPv6 address"),
            ("http://[::1]x/", "after the IPv6 address"),
            ("http://h!st/", "neither a host name"),
            ("http://h/a b", "not a URL"),
            ("http://h/\r\nX: y", "not a URL"),
        ] {
            match parse_http_url(bad) {
                Ok(u) => panic!("{bad:?} was accepted as {u:?}"),
                Err(e) => {
                    let e = e.to_string();
                    assert!(e.contains(says), "{bad:?}: {e:?} should say {says:?}")
                }
            }
        }
    }

    #[test]
    fn the_host_header_brackets_ipv6_and_names_a_port_other_than_80() {
        for (url, header) in [
            ("http://[::1]:8080/", "[::1]:8080"),
            ("http://[::1]/", "[::1]"),
            ("http://127.0.0.1:81/", "127.0.0.1:81"),
            ("http://localhost/", "localhost"),
        ] {
            let u = parse_http_url(url).expect("a good URL");
            assert_eq!(u.host_header(), header, "{url}");
        }
    }

    /// The health check reaches an app listening on IPv6 loopback and names it in the Host
    /// header the way HTTP wants (`[::1]:PORT`).
    #[tokio::test]
    async fn health_check_reaches_an_app_on_ipv6_loopback() {
        let listener = tokio::net::TcpListener::bind("[::1]:0")
            .await
            .expect("binding [::1] (IPv6 loopback)");
        let port = listener.local_addr().expect("addr").port();
        let (seen_tx, seen_rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            if let Ok((mut s, _)) = listener.accept().await {
                let mut buf = vec![0u8; 1024];
                let n = s.read(&mut buf).await.unwrap_or(0);
                let _ = seen_tx.send(String::from_utf8_lossy(&buf[..n]).into_owned());
                let _ = s
                    .write_all(b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n")
                    .await;
            }
        });
        let url = parse_http_url(&format!("http://[::1]:{port}/healthz?deep=1")).expect("url");
        assert!(check_health(&url, Duration::from_secs(2)).await);
        let request = seen_rx.await.expect("the app saw a request");
        assert!(
            request.starts_with("GET /healthz?deep=1 HTTP/1.1\r\n"),
            "{request}"
        );
        assert!(
            request.contains(&format!("\r\nHost: [::1]:{port}\r\n")),
            "{request}"
        );
    }

    #[tokio::test]
    async fn health_check_needs_a_2xx_in_time() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        tokio::spawn(async move {
            let mut n = 0;
            while let Ok((mut s, _)) = listener.accept().await {
                n += 1;
                let mut buf = [0u8; 512];
                let _ = s.read(&mut buf).await;
                let reply: &[u8] = match n {
                    1 => b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
                    2 => b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n",
                    _ => {
                        tokio::time::sleep(Duration::from_secs(5)).await; // hangs
                        b""
                    }
                };
                let _ = s.write_all(reply).await;
            }
        });
        let url = parse_http_url(&format!("http://127.0.0.1:{port}/h")).expect("url");
        assert!(check_health(&url, Duration::from_secs(2)).await);
        assert!(
            !check_health(&url, Duration::from_secs(2)).await,
            "503 is unhealthy"
        );
        assert!(
            !check_health(&url, Duration::from_millis(200)).await,
            "a hang is unhealthy"
        );
        let closed = parse_http_url("http://127.0.0.1:1/").expect("url");
        assert!(!check_health(&closed, Duration::from_secs(1)).await);
    }
}
