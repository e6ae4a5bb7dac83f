//! What the chart gives a platform team to watch fencedlease with: the PrometheusRule (checked
//! and unit-tested by promtool), the PodMonitor of the sidecars, the Grafana dashboard; that
//! every series they name is one the binary exports; and the options for restricted clusters.
//! No cluster needed: helm renders, promtool judges.

use fencedlease_testkit as common;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;

use common::helm::{chart, chart_dir, helm_ok};
use serde_json::Value;

const MONITORING: [&str; 2] = [
    "monitoring.coreos.com/v1/PrometheusRule",
    "monitoring.coreos.com/v1/PodMonitor",
];

/// `helm template` of one template with the monitoring APIs present; the documents.
fn render(template: &str, sets: &[&str]) -> Vec<Value> {
    let c = chart();
    let mut args = vec!["template", "t", &c, "--namespace", "ops"];
    for api in MONITORING {
        args.extend(["--api-versions", api]);
    }
    for s in sets {
        args.extend(["--set", s]);
    }
    args.extend(["--show-only", template]);
    use serde::Deserialize;
    serde_yaml_ng::Deserializer::from_str(&helm_ok(&args))
        .map(|d| Value::deserialize(d).expect("rendered YAML"))
        .filter(|v| !v.is_null())
        .collect()
}

/// promtool, from `hack/promtool.sh` (Debian's prometheus package, unpacked on first use).
fn promtool() -> PathBuf {
    let script = common::repo_root().join("hack/promtool.sh");
    let out = Command::new(&script)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "hack/promtool.sh could not provide promtool:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

fn run_promtool(args: &[&str]) -> (bool, String) {
    let out = Command::new(promtool())
        .args(args)
        .output()
        .expect("running promtool");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// The rules file of the rendered PrometheusRule (its spec), written into a fresh folder beside
/// the chart's promtool unit tests; the folder.
fn rules_beside_their_tests() -> PathBuf {
    let docs = render(
        "templates/prometheusrule.yaml",
        &["metrics.prometheusRule.enabled=true"],
    );
    assert_eq!(docs.len(), 1, "one PrometheusRule");
    let dir = std::env::temp_dir().join(format!("fencedlease-alerts-{}", common::rand_u32()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let spec = serde_yaml_ng::to_string(&docs[0]["spec"]).expect("yaml");
    std::fs::write(dir.join("rules.yaml"), spec).expect("write rules.yaml");
    std::fs::copy(
        chart_dir().join("tests/alerts_test.yaml"),
        dir.join("alerts_test.yaml"),
    )
    .expect("copy the alert tests");
    dir
}

#[test]
fn the_alerts_pass_promtools_check_and_fire_when_they_should() {
    let dir = rules_beside_their_tests();
    let rules = dir.join("rules.yaml");
    let (ok, out) = run_promtool(&["check", "rules", rules.to_str().expect("utf-8")]);
    assert!(ok, "promtool check rules:\n{out}");
    assert!(out.contains("SUCCESS: 9 rules found"), "{out}");
    let tests = dir.join("alerts_test.yaml");
    let (ok, out) = run_promtool(&["test", "rules", tests.to_str().expect("utf-8")]);
    assert!(
        ok,
        "promtool test rules (charts/fencedlease/tests/alerts_test.yaml):\n{out}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_changed_threshold_reaches_the_rules() {
    let docs = render(
        "templates/prometheusrule.yaml",
        &["metrics.prometheusRule.enabled=true,metrics.prometheusRule.noLeaderFor=7m"],
    );
    let rules = docs[0]["spec"]["groups"][1]["rules"]
        .as_array()
        .expect("rules");
    let no_leader = rules
        .iter()
        .find(|r| r["alert"] == "FencedLeaseNoLeader")
        .expect("FencedLeaseNoLeader");
    assert_eq!(no_leader["for"], "7m");
    // Off by default, and only where the Prometheus operator's API is.
    let c = chart();
    let (ok, _, err) = common::helm::helm(&[
        "template",
        "t",
        &c,
        "--show-only",
        "templates/prometheusrule.yaml",
    ]);
    assert!(!ok && err.contains("could not find template"), "{err}");
}

/// A /metrics text, once `get` answers 200 with one.
async fn metrics_text(what: &str, get: impl Fn() -> (u16, String)) -> String {
    common::eventually(std::time::Duration::from_secs(30), what, || async {
        let (code, body) = get();
        (code == 200 && body.contains("# TYPE")).then_some(body)
    })
    .await
}

/// Every `fencedlease_*` metric family the binary serves: a webhook, a controller and a
/// sidecar started against the test cluster, their /metrics read once each answers. Families
/// are named by their `# TYPE` lines (the binary starts every bounded label's series at 0).
async fn served_metrics() -> BTreeSet<String> {
    use common::sidecars::{curl, sidecar};
    let client = common::client().await;
    common::ensure_crd();
    let ns = common::TestNamespace::new(&client, "metrics-names").await;
    let dir = common::procs::scratch_dir("metrics-names");
    let webhook = common::webhook::Webhook::start(&client, &dir, &ns.name).await;
    let addr = format!("127.0.0.1:{}", common::webhook::free_port());
    let _controller =
        common::procs::controller_with(&dir, &ns.name, "controller-0", &["--metrics-addr", &addr]);
    let car = sidecar(&dir, &ns.name, "db", "pod-a", &[]);
    let mut text = webhook.metrics();
    text += &metrics_text("the controller's /metrics", || {
        curl(&[&format!("http://{addr}/metrics")])
    })
    .await;
    text += &metrics_text("the sidecar's /metrics", || {
        car.curl(&[&format!("http://127.0.0.1:{}/metrics", car.port)])
    })
    .await;
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with("fencedlease_"))
        .map(str::to_string)
        .collect()
}

/// The `fencedlease_*` series named in a PromQL text, without the suffixes exposition adds.
fn series_named(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (i, _) in text.match_indices("fencedlease_") {
        let name: String = text[i..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || *c == '_')
            .collect();
        let base = ["_total", "_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(&name);
        out.insert(base.to_string());
    }
    out
}

#[tokio::test]
async fn the_rules_and_the_dashboard_name_only_series_the_binary_exports() {
    let exported = served_metrics().await;
    assert!(
        exported.contains("fencedlease_webhook_admissions"),
        "{exported:?}"
    );
    let rules = render(
        "templates/prometheusrule.yaml",
        &["metrics.prometheusRule.enabled=true"],
    );
    let dashboard = render(
        "templates/dashboard.yaml",
        &["metrics.dashboard.enabled=true"],
    );
    let json = dashboard[0]["data"]["fencedlease.json"]
        .as_str()
        .expect("the dashboard's JSON");
    let parsed: Value = serde_json::from_str(json).expect("the dashboard is JSON");
    assert_eq!(parsed["uid"], "fencedlease");
    assert_eq!(
        dashboard[0]["metadata"]["labels"]["grafana_dashboard"], "1",
        "labelled for Grafana's dashboard sidecar"
    );
    let exprs: Vec<String> = parsed["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .map(|t| t["expr"].as_str().expect("expr").to_string())
        .chain(
            rules[0]["spec"]["groups"]
                .as_array()
                .expect("groups")
                .iter()
                .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
                .map(|r| r["expr"].as_str().expect("expr").to_string()),
        )
        .collect();
    assert!(exprs.len() > 15, "{exprs:?}");
    for e in &exprs {
        for s in series_named(e) {
            assert!(
                exported.contains(&s),
                "{s} (in {e}) is not a metric the binary exports"
            );
        }
    }
}

#[test]
fn the_pod_monitor_scrapes_the_sidecars_probe_port_by_name() {
    let docs = render(
        "templates/podmonitor.yaml",
        &["metrics.podMonitor.enabled=true"],
    );
    let ep = &docs[0]["spec"]["podMetricsEndpoints"][0];
    assert_eq!(ep["port"], fencedlease::webhook::inject::PROBE_PORT_NAME);
    assert_eq!(ep["path"], "/metrics");
    assert_eq!(docs[0]["spec"]["namespaceSelector"]["any"], true);
}

#[test]
fn restricted_clusters_can_drop_the_fixed_uid_spread_pods_and_pin_the_image() {
    let digest = format!("sha256:{}", "a".repeat(64));
    let c = chart();
    let out = helm_ok(&[
        "template", "r", &c, "--namespace", "ops",
        "--set", "podSecurityContext.runAsUser=null,podSecurityContext.runAsGroup=null,podSecurityContext.fsGroup=null",
        "--set", "containerSecurityContext.runAsUser=null,containerSecurityContext.runAsGroup=null",
        "--set", "injection.sidecar.runAsUser=null,logFormat=json",
        "--set", &format!("image.digest={digest}"),
        "--set-json", r#"topologySpreadConstraints=[{"maxSkew":1,"topologyKey":"topology.kubernetes.io/zone","whenUnsatisfiable":"DoNotSchedule"}]"#,
        "--set-json", r#"extraEnv=[{"name":"HTTPS_PROXY","value":"http://proxy:3128"}]"#,
        "--show-only", "templates/deployment.yaml",
    ]);
    use serde::Deserialize;
    let docs: Vec<Value> = serde_yaml_ng::Deserializer::from_str(&out)
        .map(|d| Value::deserialize(d).expect("rendered YAML"))
        .filter(|v| !v.is_null())
        .collect();
    assert_eq!(docs.len(), 2);
    for d in &docs {
        let pod = &d["spec"]["template"]["spec"];
        let c = &pod["containers"][0];
        assert!(pod["securityContext"].get("runAsUser").is_none(), "{pod}");
        assert!(pod["securityContext"].get("fsGroup").is_none(), "{pod}");
        assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
        assert!(c["securityContext"].get("runAsUser").is_none(), "{c}");
        assert_eq!(c["image"], format!("fencedlease@{digest}"));
        let spread = &pod["topologySpreadConstraints"][0];
        assert_eq!(spread["whenUnsatisfiable"], "DoNotSchedule");
        assert_eq!(
            spread["labelSelector"]["matchLabels"], d["spec"]["selector"]["matchLabels"],
            "the spread counts the component's own pods"
        );
        let env = c["env"].as_array().expect("env");
        assert!(
            env.contains(&serde_json::json!({"name": "FENCEDLEASE_LOG_FORMAT", "value": "json"}))
        );
        assert!(
            env.contains(&serde_json::json!({"name": "HTTPS_PROXY", "value": "http://proxy:3128"}))
        );
    }
    let webhook = docs
        .iter()
        .find(|d| d["metadata"]["name"] == "r-fencedlease-webhook")
        .expect("webhook");
    let args = webhook["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .expect("args");
    for want in ["--sidecar-run-as-user=none", "--sidecar-log-format=json"] {
        assert!(args.iter().any(|a| a == want), "{want} not in {args:?}");
    }
}
