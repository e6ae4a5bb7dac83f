//! Real `fencedlease sidecar` processes (2 s leases), as tests/sidecar.rs, token_files.rs and
//! the client libraries' tests run them: the loopback API on a free port, the token files in
//! the test's scratch folder, the log beside them.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use super::procs::{spawn_fencedlease, Proc};
use super::webhook::free_port;

pub struct Sidecar {
    pub proc: Proc,
    pub identity: String,
    pub port: u16,
    /// `http://127.0.0.1:PORT`, the sidecar API.
    pub url: String,
    pub token_dir: PathBuf,
}

/// Starts `fencedlease sidecar` for `lease` in `ns` as `identity`, with `extra` flags.
pub fn sidecar(dir: &Path, ns: &str, lease: &str, identity: &str, extra: &[&str]) -> Sidecar {
    let port = free_port();
    let token_dir = dir.join(format!("{identity}-token"));
    let listen = format!("127.0.0.1:{port}");
    let mut args = vec![
        "sidecar",
        "--lease",
        lease,
        "--namespace",
        ns,
        "--identity",
        identity,
        "--listen",
        &listen,
        "--lease-duration",
        "2",
        "--token-dir",
        token_dir.to_str().expect("utf-8"),
    ];
    args.extend_from_slice(extra);
    let proc = spawn_fencedlease(identity, dir, &args);
    Sidecar {
        proc,
        identity: identity.to_string(),
        port,
        url: format!("http://{listen}"),
        token_dir,
    }
}

impl Sidecar {
    /// `/v1/status`, None while the sidecar does not answer.
    pub fn status(&self) -> Option<Value> {
        let (code, body) = self.curl(&[&format!("{}/v1/status", self.url)]);
        (code == 200)
            .then(|| serde_json::from_str(&body).ok())
            .flatten()
    }
}

impl Sidecar {
    /// The pod's API secret as this sidecar wrote it in its token dir ("" before it has).
    pub fn secret(&self) -> String {
        secret_in(&self.token_dir)
    }

    /// The kubeconfig the sidecar writes for its API proxy (with `--proxy-listen`).
    pub fn proxy_kubeconfig(&self) -> String {
        let k = self.token_dir.join(fencedlease::api::PROXY_KUBECONFIG_FILE);
        k.to_str().expect("utf-8").to_string()
    }

    /// [`curl`] as the pod's own containers call the sidecar's API and proxy: with the secret.
    pub fn curl(&self, args: &[&str]) -> (u16, String) {
        curl_with_secret(&self.token_dir, args)
    }
}

/// The API secret in a sidecar's token dir ("" before it has written one).
pub fn secret_in(token_dir: &Path) -> String {
    std::fs::read_to_string(token_dir.join(fencedlease::api::API_SECRET_FILE))
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// [`curl`] with the secret of the sidecar whose token dir is `token_dir` (it outlives the
/// sidecar's restarts).
pub fn curl_with_secret(token_dir: &Path, args: &[&str]) -> (u16, String) {
    let auth = format!("Authorization: Bearer {}", secret_in(token_dir));
    // The proxy's CA too, for https:// (the proxy's) URLs.
    let ca = token_dir.join(fencedlease::sidecar::proxy_tls::CA_FILE);
    let ca = ca.to_str().expect("utf-8");
    let mut all = vec!["-H", auth.as_str(), "--cacert", ca];
    all.extend_from_slice(args);
    curl(&all)
}

/// curl with a 3 s limit: (HTTP status, 0 when there was no answer; body).
pub fn curl(args: &[&str]) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "3", "-o", "-", "-w", "\n%{http_code}"])
        .args(args)
        .output()
        .expect("curl must be installed");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_string())
}
