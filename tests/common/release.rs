//! Releases in the test bed's registry (tests/release.rs): hack/release.sh pushes them,
//! hack/verify-release.sh checks them, and helm installs them from `oci://`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use tokio::sync::Mutex;

use super::helm::Release;
use super::repo_root;

/// A variable of hack/lib.sh (where every address and version of the scripts is defined once).
pub fn hack_var(name: &str) -> String {
    let lib = repo_root().join("hack/lib.sh");
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "source '{}' && printf %s \"${name}\"",
            lib.display()
        ))
        .output()
        .expect("bash runs");
    let value = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && !value.is_empty(),
        "hack/lib.sh defines no {name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    value
}

/// The test bed's registry, HOST:PORT; panics with what to do when it does not answer.
pub fn registry() -> String {
    let script = repo_root().join("hack/registry.sh");
    let out = Command::new(&script)
        .arg("status")
        .output()
        .expect("hack/registry.sh runs");
    assert!(
        out.status.success(),
        "the test bed's OCI registry does not answer: start it with `hack/registry.sh up` \
         (hack/test.sh does), then rerun"
    );
    hack_var("FL_REGISTRY")
}

/// One pushed release: its version and every digest hack/release.sh printed.
#[derive(Clone, Debug)]
pub struct Pushed {
    pub version: String,
    /// kind ("image", "chart") -> refs (REF@DIGEST), in the order printed.
    pub digests: BTreeMap<String, Vec<String>>,
    /// The public key to verify with.
    pub public_key: PathBuf,
}

impl Pushed {
    /// The image ref@digest whose repository ends with `/name`.
    pub fn image(&self, name: &str) -> String {
        self.digests["image"]
            .iter()
            .find(|r| {
                r.split('@')
                    .next()
                    .is_some_and(|repo| repo.ends_with(&format!("/{name}")))
            })
            .unwrap_or_else(|| {
                panic!(
                    "release {} pushed no image {name}: {:?}",
                    self.version, self.digests
                )
            })
            .clone()
    }

    pub fn chart_digest(&self) -> String {
        let chart = &self.digests["chart"][0];
        chart.split('@').nth(1).expect("REF@DIGEST").to_string()
    }
}

/// Runs a hack/ script with `args`; returns (success, stdout, stderr).
pub fn script(name: &str, args: &[&str]) -> (bool, String, String) {
    let path = repo_root().join("hack").join(name);
    let mut cmd = Command::new(&path);
    // The test build's binaries go into the images unless the caller chose a profile: a
    // release build would take minutes more.
    if std::env::var_os("FL_IMAGE_PROFILE").is_none() {
        cmd.env("FL_IMAGE_PROFILE", "debug");
    }
    let out = cmd
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", path.display()));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Pushes `version` (of this tree, or of `source`, a commit or tag) to the test bed's registry
/// with hack/release.sh. One release script runs at a time: they share target/image.
pub async fn push(version: &str, source: Option<&str>) -> Pushed {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::const_new(());
    let _turn = ONE_AT_A_TIME.lock().await;
    let registry = registry();
    // --force: the test bed pushes the same versions again on every run.
    let mut args = vec![
        "--registry",
        &registry,
        "--plain-http",
        "--version",
        version,
        "--force",
    ];
    if let Some(s) = source {
        args.extend(["--source", s]);
    }
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let (ok, out, err) = tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        script("release.sh", &args)
    })
    .await
    .expect("release.sh task");
    assert!(ok, "hack/release.sh {version} failed:\n{err}\n{out}");
    let mut digests: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in out.lines() {
        if let Some((kind, reference)) = line.split_once(' ') {
            digests
                .entry(kind.into())
                .or_default()
                .push(reference.into());
        }
    }
    assert!(
        digests.get("image").map(Vec::len) == Some(2)
            && digests.get("chart").map(Vec::len) == Some(1),
        "hack/release.sh printed no two images and one chart:\n{out}"
    );
    Pushed {
        version: version.into(),
        digests,
        public_key: repo_root().join(format!("target/release/{version}/cosign.pub")),
    }
}

/// hack/verify-release.sh on `version` with the public key `key`: Ok(stdout) when VERIFIED,
/// Err(stderr) when REFUSED (or failing otherwise).
pub fn verify(version: &str, key: &std::path::Path) -> Result<String, String> {
    let registry = registry();
    let key = key.to_str().expect("utf-8 path");
    let args = [
        "--registry",
        &registry,
        "--plain-http",
        "--version",
        version,
        "--key",
        key,
    ];
    let (ok, out, err) = script("verify-release.sh", &args);
    if ok && out.contains("VERIFIED") {
        Ok(out)
    } else {
        Err(err)
    }
}

/// The chart reference of the test bed's registry (`helm install RELEASE <this> --version V`).
pub fn oci_chart() -> String {
    format!("oci://{}/charts/fencedlease", registry())
}

/// How a chart is named to helm: by version (`--version V`: what the tag points to when helm
/// runs), or by the digest hack/verify-release.sh verified (`oci://...@sha256:...`).
pub enum ChartRef<'a> {
    Version(&'a str),
    Digest(&'a str),
}

/// Installs or upgrades `release` from the test bed's registry, as a user would.
pub fn helm_from_registry(
    release: &Release,
    subcommand: &str,
    chart: ChartRef,
    extra: &[&str],
) -> String {
    let watch = format!("controller.watchNamespace={}", release.namespace);
    let mut args = vec!["--plain-http", "--set", &watch];
    let chart = match chart {
        ChartRef::Version(v) => {
            args.extend(["--version", v]);
            oci_chart()
        }
        ChartRef::Digest(d) => format!("{}@{d}", oci_chart()),
    };
    args.extend(extra);
    release.run_chart(subcommand, &chart, &args)
}
