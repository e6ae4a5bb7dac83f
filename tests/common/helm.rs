//! helm for the chart tests (tests/chart.rs, tests/lease_rights.rs) and the node tests
//! (tests/node_*.rs): the binary from `hack/helm.sh`, a release of the chart that keeps to its
//! test's namespace, and checks of the rights it grants by impersonation.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::{kubectl, TestNamespace};

pub fn chart_dir() -> PathBuf {
    super::repo_root().join("charts/fencedlease")
}

pub fn chart() -> String {
    chart_dir().to_str().expect("utf-8 path").to_string()
}

/// The helm binary, from `hack/helm.sh` (once per test binary).
pub fn helm_path() -> &'static Path {
    static HELM: OnceLock<PathBuf> = OnceLock::new();
    HELM.get_or_init(|| {
        let script = super::repo_root().join("hack/helm.sh");
        let out = Command::new(&script)
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "hack/helm.sh could not provide helm ({}):\n{stderr}",
            out.status
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        let path = PathBuf::from(stdout.trim());
        assert!(
            path.is_file(),
            "hack/helm.sh printed {:?}, which is not a file; its stderr:\n{stderr}",
            stdout.trim()
        );
        path
    })
}

/// Runs helm against the test cluster; returns (success, stdout, stderr).
pub fn helm(args: &[&str]) -> (bool, String, String) {
    super::run_against_cluster(helm_path(), args, "running helm")
}

/// Runs helm and panics with its output unless it succeeds; returns stdout.
pub fn helm_ok(args: &[&str]) -> String {
    let (ok, out, err) = helm(args);
    assert!(ok, "helm {} failed:\n{err}\n{out}", args.join(" "));
    out
}

/// A release of the chart for one test: a name of its own, webhook selectors that match only the
/// test's namespace, a release-specific sidecar ClusterRole. Uninstalled when dropped (so a
/// failing test leaves no cluster-scoped objects behind); declare it after the namespace.
pub struct Release {
    pub name: String,
    pub namespace: String,
    /// What `helm install|upgrade` installs: the source tree's chart, or a chart reference such
    /// as `oci://HOST:PORT/charts/fencedlease` (tests/release.rs; add `--version`).
    pub chart: String,
    uninstalled: bool,
}

impl Release {
    pub fn new(ns: &TestNamespace, prefix: &str) -> Release {
        let suffix = ns.name.rsplit('-').next().expect("namespace suffix");
        Release {
            name: format!("{prefix}-{suffix}"),
            namespace: ns.name.clone(),
            chart: chart(),
            uninstalled: false,
        }
    }

    /// `helm install` of the image `hack/image.sh` imported into the node's containerd, with a
    /// controller that watches only the test's namespace (no --wait: the test waits itself,
    /// with better messages).
    pub fn install_on_node(ns: &TestNamespace, prefix: &str, extra: &[&str]) -> Release {
        let release = Release::new(ns, prefix);
        release.run_on_node("install", extra);
        release
    }

    /// `helm SUBCOMMAND` (install, upgrade) with the values of [`Release::install_on_node`].
    pub fn run_on_node(&self, subcommand: &str, extra: &[&str]) -> String {
        let args = self.on_node_args(extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.run(subcommand, &args)
    }

    /// The values that run the release on the node's imported image, its controller watching
    /// only the release's namespace; then `extra`.
    pub fn on_node_args(&self, extra: &[&str]) -> Vec<String> {
        let mut args = vec![
            "--set".to_string(),
            format!(
                "image.repository=fencedlease,image.tag={},image.pullPolicy=Never",
                env!("CARGO_PKG_VERSION")
            ),
            "--set".to_string(),
            format!("controller.watchNamespace={}", self.namespace),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    }

    pub fn fullname(&self) -> String {
        format!("{}-fencedlease", self.name)
    }

    /// The controller's Deployment (and its metrics Service).
    pub fn controller(&self) -> String {
        format!("{}-controller", self.fullname())
    }

    /// The webhook's Deployment, ServiceAccount, ClusterRole and ClusterRoleBinding.
    pub fn webhook(&self) -> String {
        format!("{}-webhook", self.fullname())
    }

    /// The controller's ServiceAccount (and its ClusterRole, Role and bindings).
    pub fn controller_account(&self) -> String {
        self.fullname()
    }

    pub fn sidecar_role(&self) -> String {
        format!("{}-sidecar", self.name)
    }

    pub fn validating(&self) -> String {
        format!("{}-fencing", self.fullname())
    }

    pub fn mutating(&self) -> String {
        format!("{}-injection", self.fullname())
    }

    pub fn tls_secret(&self) -> String {
        format!("{}-tls", self.fullname())
    }

    pub fn election_lease(&self) -> String {
        format!("{}-controller", self.fullname())
    }

    /// Every operator pod of the release, controller and webhook.
    pub fn pod_selector(&self) -> String {
        format!("app.kubernetes.io/instance={}", self.name)
    }

    /// The pods of one component, "controller" or "webhook".
    pub fn component_selector(&self, component: &str) -> String {
        format!(
            "app.kubernetes.io/instance={},app.kubernetes.io/component={component}",
            self.name
        )
    }

    /// The values that keep this release to its own namespace and names.
    pub fn isolation_args(&self) -> Vec<String> {
        let selector = format!(
            r#"{{"matchLabels":{{"fencedlease.io/test-ns":"{}"}}}}"#,
            self.namespace
        );
        vec![
            "--namespace".into(),
            self.namespace.clone(),
            "--set-json".into(),
            format!("fencing.namespaceSelector={selector}"),
            "--set-json".into(),
            format!("injection.namespaceSelector={selector}"),
            "--set".into(),
            format!("sidecarRole.name={}", self.sidecar_role()),
            // The tests protect objects in the release's own namespace.
            "--set".into(),
            "fencing.excludeReleaseNamespace=false".into(),
        ]
    }

    /// `helm SUBCOMMAND RELEASE CHART <isolation> EXTRA...`. An install on a server before
    /// 1.25 skips the chart's CRD, which has validation rules such servers refuse; the test
    /// harness has applied crds/pre-1.25/ there, as the README tells users to.
    pub fn args(&self, subcommand: &str, extra: &[&str]) -> Vec<String> {
        self.args_chart(subcommand, &self.chart, extra)
    }

    /// [`Release::args`] for another chart reference than the release's own (a digest).
    pub fn args_chart(&self, subcommand: &str, chart: &str, extra: &[&str]) -> Vec<String> {
        let mut args = vec![subcommand.to_string(), self.name.clone(), chart.to_string()];
        args.extend(self.isolation_args());
        if subcommand == "install"
            && !fencedlease::crdgen::server_takes_rules(super::server_minor_blocking())
        {
            args.push("--skip-crds".into());
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    }

    pub fn run(&self, subcommand: &str, extra: &[&str]) -> String {
        self.run_chart(subcommand, &self.chart, extra)
    }

    /// [`Release::run`] with another chart reference than the release's own.
    pub fn run_chart(&self, subcommand: &str, chart: &str, extra: &[&str]) -> String {
        let args = self.args_chart(subcommand, chart, extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        helm_ok(&args)
    }

    pub fn uninstall(&mut self) {
        helm_ok(&["uninstall", &self.name, "--namespace", &self.namespace]);
        self.uninstalled = true;
    }

    // -----------------------------------------------------------------------------------------
    // Uninstalled cleanly: what `helm uninstall` must leave behind (nothing but the CRD)

    /// What of the release is still in the cluster: objects of any kind with its instance label,
    /// as "kind/name". With `deleting_is_gone`, those already being deleted (deletionTimestamp
    /// set) count as gone. Namespaced ones go through the garbage collector after an uninstall,
    /// so callers wait for this to be empty.
    pub fn left_behind(&self, deleting_is_gone: bool) -> Vec<String> {
        objects_of_release(&self.name)
            .into_iter()
            .filter(|(_, deleting)| !(deleting_is_gone && *deleting))
            .map(|(name, _)| name)
            .collect()
    }

    /// The release's cluster-scoped objects, (kind, name): nothing namespaced owns them, so
    /// `helm uninstall` itself must remove them.
    pub fn cluster_scoped(&self) -> Vec<(&'static str, String)> {
        vec![
            ("clusterrole", self.sidecar_role()),
            ("clusterrole", self.fullname()),
            ("clusterrolebinding", self.fullname()),
            ("clusterrole", self.webhook()),
            ("clusterrolebinding", self.webhook()),
            ("validatingwebhookconfiguration", self.validating()),
            ("mutatingwebhookconfiguration", self.mutating()),
        ]
    }

    /// The checks after `helm uninstall` that need no waiting: none of the release's
    /// [`cluster_scoped`](Self::cluster_scoped) objects (no webhook configurations, no cluster
    /// roles) is left, nor helm's records of the release; the CRD stays. (Wait for
    /// [`left_behind`](Self::left_behind) to be empty first.)
    pub fn assert_uninstalled_cleanly(&self) {
        for (kind, name) in self.cluster_scoped() {
            let (ok, out, err) = kubectl(&["get", kind, &name, "--ignore-not-found", "-o", "name"]);
            assert!(
                ok && out.trim().is_empty(),
                "{kind}/{name} is still there: {out}{err}"
            );
        }
        let (ok, out, err) = kubectl(&[
            "get",
            "secrets",
            "-n",
            &self.namespace,
            "-l",
            &format!("owner=helm,name={}", self.name),
            "-o",
            "name",
        ]);
        assert!(
            ok && out.trim().is_empty(),
            "helm's release records remain: {out}{err}"
        );
        let (ok, _, err) = kubectl(&["get", "crd", "fencedleases.fencedlease.io"]);
        assert!(ok, "the CRD must stay after uninstall: {err}");
    }
}

impl Drop for Release {
    fn drop(&mut self) {
        if !self.uninstalled {
            let _ = helm(&[
                "uninstall",
                &self.name,
                "--namespace",
                &self.namespace,
                "--ignore-not-found",
            ]);
        }
    }
}

/// Objects of any listable kind, in any namespace, that carry the release's instance label, as
/// ("kind/name", being deleted).
pub fn objects_of_release(release: &str) -> Vec<(String, bool)> {
    static KINDS: OnceLock<String> = OnceLock::new();
    let kinds = KINDS.get_or_init(|| {
        let (ok, out, err) = kubectl(&["api-resources", "--verbs=list", "-o", "name"]);
        assert!(ok, "kubectl api-resources: {err}");
        out.lines()
            .map(str::trim)
            .filter(|k| !k.is_empty() && *k != "componentstatuses" && !k.starts_with("events"))
            .collect::<Vec<_>>()
            .join(",")
    });
    let selector = format!("app.kubernetes.io/instance={release}");
    let (ok, out, err) = kubectl(&[
        "get",
        kinds,
        "--all-namespaces",
        "-l",
        &selector,
        "--no-headers",
        "-o",
        "custom-columns=KIND:.kind,NAME:.metadata.name,DELETING:.metadata.deletionTimestamp",
    ]);
    assert!(ok, "listing objects of release {release}: {err}");
    out.lines()
        .filter_map(
            |l| match l.split_whitespace().collect::<Vec<_>>().as_slice() {
                [kind, name, deleting] => Some((
                    format!("{}/{name}", kind.to_lowercase()),
                    *deleting != "<none>",
                )),
                _ => None,
            },
        )
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Rights, by impersonation (`kubectl auth can-i --as`)

/// `kubectl auth can-i` as `who`; panics on anything but a plain yes or no.
pub fn can_i(who: &str, args: &[&str]) -> bool {
    let mut all = vec!["auth", "can-i", "--as", who];
    all.extend_from_slice(args);
    let (_, out, err) = kubectl(&all);
    match out.split_whitespace().next() {
        Some("yes") => true,
        Some("no") => false,
        _ => panic!("kubectl {}: no answer:\n{out}\n{err}", all.join(" ")),
    }
}

/// Waits (RBAC caches lag a little behind writes) until `who` may do `args`.
pub async fn eventually_allowed(who: &str, args: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !can_i(who, args) {
        assert!(
            Instant::now() < deadline,
            "{who} should be allowed to: {}",
            args.join(" ")
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

pub fn denied(who: &str, args: &[&str]) {
    assert!(
        !can_i(who, args),
        "{who} must NOT be allowed to: {}",
        args.join(" ")
    );
}

/// Verbs that change nothing.
const READ_VERBS: [&str; 3] = ["get", "list", "watch"];

/// What `who` may do in `namespace` beyond reading (cluster-wide grants included), from
/// `kubectl auth can-i --list`, as "verb resource[/name]" and "verb URL".
pub fn writes(who: &str, namespace: &str) -> BTreeSet<String> {
    let args = ["auth", "can-i", "--list", "--as", who, "-n", namespace];
    let (ok, out, err) = kubectl(&args);
    assert!(ok, "kubectl {}: {err}", args.join(" "));
    let mut found = BTreeSet::new();
    // Rows: RESOURCE [URLS] [NAMES] [VERBS]; RESOURCE is blank on non-resource rows.
    for line in out.lines().skip(1) {
        let Some(first) = line.find('[') else {
            continue;
        };
        let resource = line[..first].trim();
        let groups: Vec<Vec<&str>> = line[first..]
            .split(']')
            .filter_map(|g| g.trim().strip_prefix('['))
            .map(|g| g.split_whitespace().collect())
            .collect();
        let [urls, names, verbs] = groups.as_slice() else {
            panic!("unexpected `kubectl auth can-i --list` row: {line:?}\n{out}");
        };
        for verb in verbs.iter().filter(|v| !READ_VERBS.contains(v)) {
            for url in urls {
                found.insert(format!("{verb} {url}"));
            }
            if !resource.is_empty() {
                if names.is_empty() {
                    found.insert(format!("{verb} {resource}"));
                }
                for name in names {
                    found.insert(format!("{verb} {resource}/{name}"));
                }
            }
        }
    }
    found
}

/// What `who` may write in `namespace` that an identity bound to nothing may not.
pub fn extra_writes(who: &str, namespace: &str) -> BTreeSet<String> {
    let nobody = format!("system:serviceaccount:{namespace}:bound-to-nothing");
    let everyone = writes(&nobody, namespace);
    writes(who, namespace)
        .difference(&everyone)
        .cloned()
        .collect()
}

/// A copy of the test kubeconfig whose users act as `who` (kubeconfig `as:`, the same
/// impersonation as `kubectl --as`), written into `dir`: a real `fencedlease` process started
/// with it has exactly `who`'s rights.
pub fn kubeconfig_as(who: &str, dir: &Path) -> PathBuf {
    let source = super::kubeconfig_path();
    let text = std::fs::read_to_string(&source)
        .unwrap_or_else(|e| panic!("reading {}: {e}", source.display()));
    let mut config: serde_json::Value =
        serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", source.display()));
    let users = config["users"]
        .as_array_mut()
        .unwrap_or_else(|| panic!("{} has no users", source.display()));
    for user in users {
        user["user"]["as"] = serde_json::json!(who);
    }
    let path = dir.join(format!("kubeconfig-as-{:08x}", super::rand_u32()));
    std::fs::write(&path, serde_yaml_ng::to_string(&config).expect("yaml"))
        .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    path
}

/// `fencedlease ARGS` as a separate process acting as `who` (see `kubeconfig_as`); its output
/// goes to `dir/NAME.log`. Killed when dropped.
pub fn spawn_as(who: &str, name: &str, dir: &Path, args: &[&str]) -> super::procs::Proc {
    let kubeconfig = kubeconfig_as(who, dir);
    let log = dir.join(format!("{name}.log"));
    let logf = std::fs::File::create(&log).expect("create log");
    let child = Command::new(super::fencedlease_bin())
        .args(args)
        .env("KUBECONFIG", &kubeconfig)
        .env("RUST_LOG", "info,kube=warn")
        .stdin(std::process::Stdio::null())
        .stdout(logf.try_clone().expect("dup log"))
        .stderr(logf)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {name}: {e}"));
    super::procs::Proc {
        name: name.to_string(),
        child,
        events: dir.join(format!("{name}.events")),
        log,
    }
}
