//! Policy mode for the fencing tests: the chart's ValidatingAdmissionPolicy and its one binding
//! (rendered from `charts/fencedlease/templates/fencing-policy.yaml`, the one definition of its
//! CEL), scoped to one test namespace, with its lease index policy and the index's guard. No
//! webhook runs: the API server judges the writes itself. A real `fencedlease controller
//! --fencing-policy` keeps the namespace's lease index (only that: the fencing itself is the
//! API server's); [`PolicyFence::stop_controller`] shows the fencing holds without it.

use std::path::Path;
use std::time::Duration;

use fencedlease::controller::policy::POLICY_API;
use kube::Client;

use super::helm::{chart, helm_ok};
use super::procs::{controller_with, Proc};

/// The user the tests' kubeconfig authenticates as (hack/cluster.sh): the tests' controllers
/// run as it, so the rendered index guard lets it write the lease index.
pub const TEST_USER: &str = "admin";

pub struct PolicyFence {
    /// The ValidatingAdmissionPolicy's name, and its binding's; the index policy and its guard
    /// are named after it ([`PolicyFence::names`]).
    pub name: String,
    /// The running controller, if any (behind a lock, so that a shared fence can stop and
    /// start it).
    controller: std::sync::Mutex<Option<Proc>>,
    dir: std::path::PathBuf,
    ns: String,
}

/// Panics (the test fails, never skips) when the server lacks ValidatingAdmissionPolicy v1.
pub async fn require_policy_api(client: &Client) {
    let served = match client.list_api_group_resources(POLICY_API).await {
        Ok(l) => l
            .resources
            .iter()
            .any(|r| r.name == "validatingadmissionpolicies"),
        Err(_) => false,
    };
    let version = client
        .apiserver_version()
        .await
        .map(|v| v.git_version)
        .unwrap_or_default();
    assert!(
        served,
        "the policy-mode tests need {POLICY_API} ValidatingAdmissionPolicy (Kubernetes 1.30 or later), which this API server ({version}) does not serve: run them on the current release (hack/test.sh runs them on 1.37 only)"
    );
}

/// The chart's fencing policy as `helm template` renders it for a release named `release`,
/// judging only namespace `ns` (the tests' namespaces are labelled with their own name).
pub fn render_policy(release: &str, ns: &str) -> String {
    render_policy_with(release, ns, &[])
}

/// [`render_policy`] with more `helm template` arguments (`--set-json fencing.resources=...`).
pub fn render_policy_with(release: &str, ns: &str, extra: &[&str]) -> String {
    let selector = format!(r#"{{"matchLabels":{{"fencedlease.io/test-ns":"{ns}"}}}}"#);
    let (chart, selector) = (chart(), format!("fencing.namespaceSelector={selector}"));
    let writers = format!(r#"fencing.indexWriters=["{TEST_USER}"]"#);
    let mut args = vec![
        "template",
        release,
        &chart,
        "--namespace",
        ns,
        "--set",
        "fencing.mode=policy",
        // The tests protect objects in the release's own namespace.
        "--set",
        "fencing.excludeReleaseNamespace=false",
        "--set-json",
        &selector,
        "--set-json",
        &writers,
        "--api-versions",
        "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy",
        "--show-only",
        "templates/fencing-policy.yaml",
    ];
    args.extend_from_slice(extra);
    helm_ok(&args)
}

impl PolicyFence {
    /// Installs the policy and its binding for namespace `ns`.
    pub async fn start(client: &Client, dir: &Path, ns: &str) -> PolicyFence {
        PolicyFence::start_with(client, dir, ns, &[]).await
    }

    /// [`PolicyFence::start`] with the policy rendered with more `helm template` arguments.
    pub async fn start_with(client: &Client, dir: &Path, ns: &str, extra: &[&str]) -> PolicyFence {
        require_policy_api(client).await;
        let suffix = ns.rsplit('-').next().expect("namespace suffix");
        let release = format!("vap-{suffix}");
        let name = format!("{release}-fencedlease-fencing");
        let file = dir.join("policy.yaml");
        std::fs::write(&file, render_policy_with(&release, ns, extra))
            .expect("write the rendered policy");
        let (ok, _, err) = super::kubectl(&["apply", "-f", file.to_str().expect("utf-8")]);
        assert!(ok, "installing the fencing policy failed: {err}");
        let fence = PolicyFence {
            name,
            controller: std::sync::Mutex::new(None),
            dir: dir.to_path_buf(),
            ns: ns.to_string(),
        };
        // The API server type-checks the CEL against the matched types: no warnings.
        for policy in fence.names() {
            let status = super::eventually(
                Duration::from_secs(20),
                &format!("policy {policy} to be type-checked"),
                || async {
                    let (ok, out, _) = super::kubectl(&[
                        "get",
                        "validatingadmissionpolicy",
                        &policy,
                        "-o",
                        "jsonpath={.status}",
                    ]);
                    (ok && out.contains("typeChecking")).then_some(out)
                },
            )
            .await;
            assert!(
                !status.contains("expressionWarnings"),
                "policy {policy}'s CEL has type-checking warnings: {status}"
            );
        }
        fence.start_controller_as("indexer", &[]);
        fence
    }

    /// The fencing policy, the index policy and the index's guard (each with a binding of the
    /// same name).
    pub fn names(&self) -> [String; 3] {
        let n = &self.name;
        [n.clone(), format!("{n}-index"), format!("{n}-index-guard")]
    }

    /// Starts `fencedlease controller --fencing-policy` for this policy (identity
    /// "controller"), in place of the one running.
    pub fn start_controller(&self) {
        self.start_controller_with(&[])
    }

    /// [`PolicyFence::start_controller`] with more arguments.
    pub fn start_controller_with(&self, extra: &[&str]) {
        self.start_controller_as("controller", extra)
    }

    fn start_controller_as(&self, identity: &str, extra: &[&str]) {
        self.stop_controller();
        let mut args = vec!["--fencing-policy", self.name.as_str()];
        args.extend_from_slice(extra);
        let c = controller_with(&self.dir, &self.ns, identity, &args);
        *self.running() = Some(c);
    }

    fn running(&self) -> std::sync::MutexGuard<'_, Option<Proc>> {
        self.controller.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The running controller, taken from the fence (to wait for its exit, say).
    pub fn take_controller(&self) -> Proc {
        self.running().take().expect("a controller runs")
    }

    /// The running controller's log's tail.
    pub fn controller_log(&self) -> String {
        self.running()
            .as_ref()
            .expect("a controller runs")
            .log_tail()
    }

    /// Stops the controller (SIGTERM: it hands its election lease back) and waits for it to
    /// exit: with 0, or killed by the signal when it came before the controller had set up its
    /// handling (then it had not campaigned yet either).
    pub fn stop_controller(&self) {
        let running = self.running().take();
        if let Some(mut c) = running {
            c.signal(nix::sys::signal::Signal::SIGTERM);
            let code = c.wait_exit(Duration::from_secs(60));
            assert!(
                matches!(code, Some(0) | Some(-1)),
                "the controller's exit: {code:?}: {}",
                c.log_tail()
            );
        }
    }
}

impl Drop for PolicyFence {
    fn drop(&mut self) {
        // The controller put its finalizer on the namespace's leases; stopped, it no longer
        // takes it off, so take it off here, or the namespace's deletion would wait for ever.
        drop(self.running().take());
        let (_, leases, _) = super::kubectl(&["get", "fencedleases", "-n", &self.ns, "-o", "name"]);
        for lease in leases.lines() {
            let unguarded = r#"{"metadata":{"finalizers":null}}"#;
            let _ = super::kubectl(&[
                "patch",
                lease,
                "-n",
                &self.ns,
                "--type=merge",
                "-p",
                unguarded,
            ]);
        }
        // Bindings first, each policy after its binding is gone: the guard matches every
        // namespace write of the cluster, so nothing of a test's policies should linger.
        for kind in [
            "validatingadmissionpolicybindings",
            "validatingadmissionpolicy",
        ] {
            for name in self.names() {
                let _ =
                    super::kubectl(&["delete", kind, &name, "--ignore-not-found", "--wait=true"]);
            }
        }
    }
}

/// Whether namespace `ns`'s lease index lists `lease` (as the index policy reads it).
pub async fn indexed(client: &Client, ns: &str, lease: &str) -> bool {
    use fencedlease::api::LEASE_INDEX_ANNOTATION;
    use k8s_openapi::api::core::v1::Namespace;
    let Ok(n) = kube::Api::<Namespace>::all(client.clone()).get(ns).await else {
        return false;
    };
    n.metadata
        .annotations
        .and_then(|mut a| a.remove(LEASE_INDEX_ANNOTATION))
        .is_some_and(|i| i.contains(&format!("/{lease}/")))
}

/// Waits until a write labelled for `lease` in `ns` is judged by the lease (a labelled create
/// without a token is refused as one that carries no token): the controller has listed the
/// lease in the namespace's index, and the API server has loaded the policies, their bindings,
/// the index and the lease. (A write the index policy refuses, the API server reports with the
/// index policy's message even when the fencing policy refuses it too.)
pub async fn wait_judged(client: &Client, ns: &str, lease: &str, timeout: Duration) {
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::{Api, PostParams};
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let what = format!("writes labelled for lease {ns}/{lease} to be judged");
    super::eventually(timeout, &what, || async {
        let probe: ConfigMap = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "judged-probe", "labels": {"fencedlease.io/lease": lease}}
        }))
        .ok()?;
        let dry = PostParams {
            dry_run: true,
            ..Default::default()
        };
        if !indexed(client, ns, lease).await {
            return None;
        }
        match cms.create(&dry, &probe).await {
            Err(kube::Error::Api(s)) if s.message.contains("every write must carry") => Some(()),
            _ => None,
        }
    })
    .await;
}
