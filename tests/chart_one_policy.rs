//! One release per cluster runs policy mode (the chart's lookup refuses a second): a test binary
//! of its own, since the other release's guard it creates would make every other policy-mode
//! render against the server fail while it exists (cargo runs test binaries one at a time, and
//! this one has a single test).

use fencedlease_testkit as common;

use common::helm::{helm, Release};
use common::{client, kubectl, TestNamespace};

/// One release per cluster may run policy mode (the lease index annotation is one per
/// namespace, and each release's guard admits only its own controller): with another release's
/// index guard in the cluster, rendering policy mode against the server fails, naming it;
/// webhook mode renders.
#[tokio::test]
async fn policy_mode_is_one_release_per_cluster() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "chart-onepolicy").await;
    let release = Release::new(&ns, "onepolicy");
    if common::server_minor(&client).await < 30 {
        // No ValidatingAdmissionPolicy: no policy mode at all.
        let args = release.args_chart(
            "template",
            &release.chart,
            &["--dry-run=server", "--set", "fencing.mode=policy"],
        );
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (ok, _, err) = helm(&args);
        assert!(!ok && err.contains("which this cluster"), "{err}");
        return;
    }
    let other = format!("other-{}-fencedlease-fencing-index-guard", ns.name);
    let guard = serde_json::json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": other, "labels": {"app.kubernetes.io/part-of": "fencedlease",
                                               "app.kubernetes.io/instance": "other",
                                               "fencedlease.io/index-guard": "true"}},
        "spec": {"matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
            "resources": ["namespaces"], "operations": ["UPDATE"]}]},
            "validations": [{"expression": "true"}]}});
    let file = std::env::temp_dir().join(format!("{other}.json"));
    std::fs::write(&file, guard.to_string()).expect("write");
    let (ok, _, err) = kubectl(&["create", "-f", file.to_str().expect("utf-8")]);
    assert!(ok, "{err}");
    let args = release.args_chart(
        "template",
        &release.chart,
        &["--dry-run=server", "--set", "fencing.mode=policy"],
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, out, err) = helm(&args);
    let webhook = release.args_chart("template", &release.chart, &["--dry-run=server"]);
    let webhook: Vec<&str> = webhook.iter().map(String::as_str).collect();
    let (webhook_ok, _, webhook_err) = helm(&webhook);
    let _ = kubectl(&["delete", "validatingadmissionpolicy", &other]);
    assert!(
        !ok && err.contains(
            "another fencedlease release (helm release \"other\") already runs policy mode"
        ) && err.contains(&other),
        "{out}{err}"
    );
    assert!(webhook_ok, "webhook mode beside it: {webhook_err}");
}
