//! Policy mode for the fencing tests: the chart's ValidatingAdmissionPolicy and its one binding
//! (rendered from `charts/fencedlease/templates/fencing-policy.yaml`, the one definition of its
//! CEL), scoped to one test namespace. No webhook and no controller run: the API server judges
//! the writes itself, so every policy-mode story shows that the controller is off the fencing
//! path. [`PolicyFence::start_controller`] adds a real `fencedlease controller --fencing-policy`
//! where a test needs one.

use std::path::Path;
use std::time::Duration;

use fencedlease::controller::policy::POLICY_API;
use kube::Client;

use super::helm::{chart, helm_ok};
use super::procs::{controller_with, Proc};

pub struct PolicyFence {
    /// The ValidatingAdmissionPolicy's name, and its binding's.
    pub name: String,
    pub controller: Option<Proc>,
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
        // The API server type-checks the CEL against the matched types: no warnings.
        let status = super::eventually(
            Duration::from_secs(20),
            "the policy to be type-checked",
            || async {
                let (ok, out, _) = super::kubectl(&[
                    "get",
                    "validatingadmissionpolicy",
                    &name,
                    "-o",
                    "jsonpath={.status}",
                ]);
                (ok && out.contains("typeChecking")).then_some(out)
            },
        )
        .await;
        assert!(
            !status.contains("expressionWarnings"),
            "the fencing policy's CEL has type-checking warnings: {status}"
        );
        PolicyFence {
            name,
            controller: None,
        }
    }

    /// Starts `fencedlease controller --fencing-policy` for this policy, in namespace `ns`.
    pub fn start_controller(&mut self, dir: &Path, ns: &str) -> &mut Proc {
        self.start_controller_with(dir, ns, &[])
    }

    /// [`PolicyFence::start_controller`] with more arguments.
    pub fn start_controller_with(&mut self, dir: &Path, ns: &str, extra: &[&str]) -> &mut Proc {
        let mut args = vec!["--fencing-policy", self.name.as_str()];
        args.extend_from_slice(extra);
        let c = controller_with(dir, ns, "controller", &args);
        self.controller.insert(c)
    }
}

impl Drop for PolicyFence {
    fn drop(&mut self) {
        let _ = super::kubectl(&[
            "delete",
            "validatingadmissionpolicy",
            &self.name,
            "--ignore-not-found",
            "--wait=false",
        ]);
        let _ = super::kubectl(&[
            "delete",
            "validatingadmissionpolicybindings",
            &self.name,
            "--ignore-not-found",
            "--wait=false",
        ]);
    }
}

/// Waits until a write labelled for `lease` in `ns` is judged (a labelled create without a
/// token is refused by fencedlease): the API server has loaded the policy, its binding and the
/// lease.
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
        match cms.create(&dry, &probe).await {
            Err(kube::Error::Api(s)) if s.message.contains("fencedlease") => Some(()),
            _ => None,
        }
    })
    .await;
}
