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
        let (code, body) = curl(&[&format!("{}/v1/status", self.url)]);
        (code == 200)
            .then(|| serde_json::from_str(&body).ok())
            .flatten()
    }
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
