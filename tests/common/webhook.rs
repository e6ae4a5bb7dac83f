//! A real `fencedlease webhook` process, registered with the real API server by URL, scoped to
//! one test namespace so that tests running in parallel do not see each other's webhooks.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use kube::api::PostParams;
use kube::{Api, Client};

use super::procs::{spawn_fencedlease_env, Proc};

/// `n` distinct free ports (all held open while choosing, so none repeats).
pub fn free_ports(n: usize) -> Vec<u16> {
    let held: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("a free port on 127.0.0.1"))
        .collect();
    held.iter()
        .map(|l| l.local_addr().expect("local addr").port())
        .collect()
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port on 127.0.0.1")
}

/// Writes certificates into a Kubernetes-style Secret mount: timestamped folder, `..data`
/// symlink, and `tls.crt`/`tls.key` links through it. Returns the caBundle.
pub fn issue_certs(mount: &Path, reuse_ca: bool) -> String {
    let staging = mount.join("staging");
    if reuse_ca {
        // keep ca.crt/ca.key in staging
    } else {
        let _ = std::fs::remove_dir_all(&staging);
    }
    let mut cmd = Command::new(super::fencedlease_bin());
    cmd.args([
        "certs",
        "--out",
        staging.to_str().expect("utf-8"),
        "--host",
        "127.0.0.1",
    ]);
    if reuse_ca {
        cmd.arg("--reuse-ca");
    }
    let out = cmd.output().expect("run fencedlease certs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bundle = String::from_utf8(out.stdout)
        .expect("utf-8")
        .trim()
        .to_string();
    // The atomic swap kubelet does for Secret volumes.
    let version = mount.join(format!("..{:08x}", super::rand_u32()));
    std::fs::create_dir_all(&version).expect("mkdir version");
    for f in ["tls.crt", "tls.key"] {
        std::fs::copy(staging.join(f), version.join(f)).expect("copy cert");
    }
    let tmp_link = mount.join("..data_tmp");
    let _ = std::fs::remove_file(&tmp_link);
    std::os::unix::fs::symlink(version.file_name().expect("name"), &tmp_link).expect("symlink");
    std::fs::rename(&tmp_link, mount.join("..data")).expect("swap ..data");
    for f in ["tls.crt", "tls.key"] {
        let link = mount.join(f);
        if std::fs::symlink_metadata(&link).is_err() {
            std::os::unix::fs::symlink(format!("..data/{f}"), &link).expect("link");
        }
    }
    bundle
}

/// The group of the test-only custom resource `Widget` (with /status and /scale), see
/// `ensure_widget_crd`.
pub const WIDGET_GROUP: &str = "test.fencedlease.io";

pub struct Webhook {
    pub proc: Proc,
    pub bundle: String,
    pub port: u16,
    pub metrics_port: u16,
    pub mount: PathBuf,
    pub config_name: String,
}

/// How to run the test's webhook.
#[derive(Default)]
pub struct WebhookOpts {
    /// The kubeconfig the webhook uses (default: the test cluster's), e.g. one through a
    /// `ApiProxy`.
    pub kubeconfig: Option<PathBuf>,
    /// More command-line flags, e.g. `--exempt-user`.
    pub extra_args: Vec<String>,
    /// Also fence pods, as the chart does when `fencing.resources` names them: labelled pods
    /// and their subresources that carry the pod, and every pod binding.
    pub fence_pods: bool,
}

impl Webhook {
    /// Starts the webhook and registers it for labelled ConfigMaps, Deployments and
    /// StatefulSets (and their /status and /scale) in namespace `ns`.
    pub async fn start(client: &Client, dir: &Path, ns: &str) -> Webhook {
        Webhook::start_with(client, dir, ns, WebhookOpts::default()).await
    }

    pub async fn start_with(client: &Client, dir: &Path, ns: &str, opts: WebhookOpts) -> Webhook {
        let mount = dir.join("certs");
        std::fs::create_dir_all(&mount).expect("mkdir certs");
        let bundle = issue_certs(&mount, false);
        let ports = free_ports(2);
        let (port, metrics_port) = (ports[0], ports[1]);
        let (listen, metrics) = (
            format!("127.0.0.1:{port}"),
            format!("127.0.0.1:{metrics_port}"),
        );
        let (cert, key) = (
            mount.join("tls.crt").to_str().expect("utf-8").to_string(),
            mount.join("tls.key").to_str().expect("utf-8").to_string(),
        );
        let mut args: Vec<&str> = vec![
            "webhook",
            "--listen",
            &listen,
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--tls-reload-seconds",
            "1",
            "--metrics-addr",
            &metrics,
        ];
        args.extend(opts.extra_args.iter().map(String::as_str));
        let kubeconfig = opts.kubeconfig.unwrap_or_else(super::kubeconfig_path);
        let proc = spawn_fencedlease_env(
            "webhook",
            dir,
            &args,
            &[("KUBECONFIG", kubeconfig.as_os_str())],
        );
        let config_name = format!("fencedlease-test-{ns}");
        let wh = Webhook {
            proc,
            bundle: bundle.clone(),
            port,
            metrics_port,
            mount,
            config_name,
        };
        wh.wait_ready().await;
        wh.register(client, ns, &bundle, opts.fence_pods).await;
        wh
    }

    /// The HTTP status of the webhook's /readyz (0 when it does not answer).
    pub fn readyz(&self) -> u16 {
        let out = Command::new("curl")
            .args([
                "-sS",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--max-time",
                "2",
                &format!("http://127.0.0.1:{}/readyz", self.metrics_port),
            ])
            .output()
            .expect("curl");
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .unwrap_or(0)
    }

    async fn wait_ready(&self) {
        super::eventually(
            Duration::from_secs(20),
            "the webhook to be ready",
            || async {
                let out = Command::new("curl")
                    .args([
                        "-fsS",
                        "--max-time",
                        "1",
                        &format!("http://127.0.0.1:{}/readyz", self.metrics_port),
                    ])
                    .output()
                    .ok()?;
                out.status.success().then_some(())
            },
        )
        .await;
    }

    pub fn metrics(&self) -> String {
        let out = Command::new("curl")
            .args([
                "-fsS",
                "--max-time",
                "2",
                &format!("http://127.0.0.1:{}/metrics", self.metrics_port),
            ])
            .output()
            .expect("curl");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    async fn register(&self, client: &Client, ns: &str, bundle: &str, fence_pods: bool) {
        // As the chart does: the fenced types, each with the subresources of the one table
        // (`fencedlease::webhook::subresources::TABLE`); with fencing.deletes (its default),
        // deletes are judged too.
        let mut fenced = vec![
            ("", vec!["configmaps"]),
            ("apps", vec!["deployments", "statefulsets"]),
            (WIDGET_GROUP, vec!["widgets"]),
        ];
        if fence_pods {
            fenced.push(("", vec!["pods"]));
        }
        let (judged, mut parents) = table_rules(&fenced);
        // As the chart does: an autoscaler's writes, judged by its target's lease.
        parents.push(serde_json::json!(
            {"apiGroups": ["autoscaling"], "apiVersions": ["*"], "operations": ["CREATE", "UPDATE"],
             "resources": ["horizontalpodautoscalers"], "scope": "Namespaced"}));
        let cfg: ValidatingWebhookConfiguration = serde_json::from_value(serde_json::json!({
            "metadata": {"name": self.config_name},
            "webhooks": [{
                "name": "fencing.fencedlease.io",
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "failurePolicy": "Fail",
                "timeoutSeconds": 5,
                "clientConfig": {"url": format!("https://127.0.0.1:{}/validate", self.port), "caBundle": bundle},
                "namespaceSelector": {"matchLabels": {"fencedlease.io/test-ns": ns}},
                "objectSelector": {"matchExpressions": [{"key": "fencedlease.io/lease", "operator": "Exists"}]},
                "rules": judged
            }, {
                // As the chart does: /scale carries no labels, so no objectSelector.
                "name": "scale.fencing.fencedlease.io",
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "failurePolicy": "Fail",
                "timeoutSeconds": 5,
                "clientConfig": {"url": format!("https://127.0.0.1:{}/validate", self.port), "caBundle": bundle},
                "namespaceSelector": {"matchLabels": {"fencedlease.io/test-ns": ns}},
                "rules": parents
            }]
        }))
        .expect("webhook configuration literal");
        Api::<ValidatingWebhookConfiguration>::all(client.clone())
            .create(&PostParams::default(), &cfg)
            .await
            .expect("register the webhook");
        // The API server picks configurations up asynchronously: wait until a labelled write
        // without a token is refused by our webhook.
        let cms: Api<k8s_openapi::api::core::v1::ConfigMap> = Api::namespaced(client.clone(), ns);
        super::eventually(Duration::from_secs(20), "the webhook to be in effect", || async {
            let probe: k8s_openapi::api::core::v1::ConfigMap = serde_json::from_value(serde_json::json!({
                "metadata": {"name": "webhook-probe", "labels": {"fencedlease.io/lease": "probe"}}
            }))
            .ok()?;
            match cms.create(&PostParams::default(), &probe).await {
                Err(kube::Error::Api(s)) if s.message.contains("fencedlease") => Some(()),
                Ok(_) => {
                    let _ = cms.delete("webhook-probe", &Default::default()).await;
                    None
                }
                Err(_) => None,
            }
        })
        .await;
    }
}

impl Webhook {
    /// Also registers /mutate for pod creation in namespace `ns` (sidecar injection).
    pub async fn register_mutating(&self, client: &Client, ns: &str) {
        use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
        let cfg: MutatingWebhookConfiguration = serde_json::from_value(serde_json::json!({
            "metadata": {"name": self.config_name},
            "webhooks": [{
                "name": "inject.fencedlease.io",
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "failurePolicy": "Fail",
                "reinvocationPolicy": "Never",
                "timeoutSeconds": 5,
                "clientConfig": {"url": format!("https://127.0.0.1:{}/mutate", self.port), "caBundle": self.bundle},
                "namespaceSelector": {"matchLabels": {"fencedlease.io/test-ns": ns}},
                "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                           "resources": ["pods"], "scope": "Namespaced"}]
            }]
        }))
        .expect("mutating configuration literal");
        Api::<MutatingWebhookConfiguration>::all(client.clone())
            .create(&PostParams::default(), &cfg)
            .await
            .expect("register the mutating webhook");
    }
}

impl Drop for Webhook {
    fn drop(&mut self) {
        for kind in [
            "validatingwebhookconfiguration",
            "mutatingwebhookconfiguration",
        ] {
            let _ = super::kubectl(&[
                "delete",
                kind,
                &self.config_name,
                "--ignore-not-found",
                "--wait=false",
            ]);
        }
    }
}

/// Installs (once per test binary) a test-only custom resource, `widgets.test.fencedlease.io`,
/// with a /status and a /scale subresource: the fencing of custom resources' subresources is
/// shown on it.
pub fn ensure_widget_crd() {
    static DONE: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    DONE.get_or_init(|| {
        let crd = serde_json::json!({
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": format!("widgets.{WIDGET_GROUP}")},
            "spec": {
                "group": WIDGET_GROUP,
                "scope": "Namespaced",
                "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "listKind": "WidgetList"},
                "versions": [{
                    "name": "v1", "served": true, "storage": true,
                    "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                        "spec": {"type": "object", "properties": {"replicas": {"type": "integer"}}},
                        "status": {"type": "object", "properties": {
                            "replicas": {"type": "integer"}, "note": {"type": "string"}}}
                    }}},
                    "subresources": {
                        "status": {},
                        "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas"}
                    }
                }]
            }
        });
        let path = std::env::temp_dir().join(format!("fencedlease-widget-crd-{}.json", super::rand_u32()));
        std::fs::write(&path, crd.to_string()).expect("write the widget CRD");
        let path = path.to_str().expect("utf-8").to_string();
        let (ok, _, err) = super::kubectl(&["apply", "-f", &path]);
        assert!(ok, "installing the widget CRD failed: {err}");
        let (ok, _, err) = super::kubectl(&[
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            &format!("crd/widgets.{WIDGET_GROUP}"),
        ]);
        assert!(ok, "the widget CRD did not become Established: {err}");
    });
}

/// The webhook rules for the fenced `(group, resources)`, from the table of judged subresources:
/// (the rules of the webhook that selects by label, the rules of the one that reads parents).
pub fn table_rules(
    fenced: &[(&str, Vec<&str>)],
) -> (Vec<serde_json::Value>, Vec<serde_json::Value>) {
    use fencedlease::webhook::subresources::{Judged, TABLE};
    let (mut judged, mut parents) = (vec![], vec![]);
    for (group, resources) in fenced {
        let mut like: Vec<String> = resources.iter().map(|r| r.to_string()).collect();
        let mut by_op: std::collections::BTreeMap<&str, Vec<String>> = Default::default();
        for r in resources {
            for row in TABLE {
                let Some(rule) = row.rule_for(group, r) else {
                    continue;
                };
                match row.judged {
                    Judged::LikeTheObject => like.push(rule),
                    Judged::ByItsParent(_) => by_op.entry(row.operation).or_default().push(rule),
                }
            }
        }
        judged.push(serde_json::json!({"apiGroups": [group], "apiVersions": ["*"],
            "operations": ["CREATE", "UPDATE", "DELETE"], "resources": like, "scope": "Namespaced"}));
        for (op, rules) in by_op {
            parents.push(
                serde_json::json!({"apiGroups": [group], "apiVersions": ["*"],
                "operations": [op], "resources": rules, "scope": "Namespaced"}),
            );
        }
    }
    (judged, parents)
}
