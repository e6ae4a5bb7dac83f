//! `matchConditions` on the chart's webhook configurations (Kubernetes 1.30 and later): the API
//! server skips the call where the webhook's answer is certainly "allow, no change", and still
//! calls it everywhere else. Shown with the chart installed and no webhook replica running (the
//! test cluster has no node) and both webhooks failing closed: a request the API server admits
//! was not sent to the webhook, a request refused with "failed calling webhook" was. On servers
//! before 1.30 the chart renders the configurations as before, and every request is sent.

use fencedlease_testkit as common;

use common::helm::{chart, helm_ok, Release};
use common::{client, ensure_crd, kubectl, server_minor, TestNamespace};
use fencedlease::api::{
    INJECT_ANNOTATION, LEASE_ANNOTATION, LEASE_LABEL, LEASE_UID_ANNOTATION, TOKEN_ANNOTATION,
    WRITE_ID_ANNOTATION,
};
use fencedlease::webhook::fence::DEFAULT_EXEMPT_USERS;
use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use kube::Api;
use serde_json::{json, Value};

/// The first Kubernetes 1.x release whose webhooks get matchConditions from the chart.
const CONDITIONS_FROM_MINOR: u32 = 30;
const EXEMPT_USER: &str = "fl-test-exempt";
const EXEMPT_GROUP: &str = "fl-test-exempt-group";
/// What the API server says when it called the webhook and nobody answered.
const CALLED: &str = "failed calling webhook";

/// The rendered webhook configurations: (validating, mutating).
fn rendered(kube_version: &str, extra: &[&str]) -> (Value, Value) {
    let c = chart();
    let mut args = vec![
        "template",
        "mc",
        &c,
        "--namespace",
        "ops",
        "--kube-version",
        kube_version,
        "--show-only",
        "templates/webhooks.yaml",
    ];
    args.extend_from_slice(extra);
    let out = helm_ok(&args);
    use serde::Deserialize;
    let docs: Vec<Value> = serde_yaml_ng::Deserializer::from_str(&out)
        .map(|d| Value::deserialize(d).expect("rendered YAML"))
        .filter(|v| !v.is_null())
        .collect();
    let of = |kind: &str| {
        docs.iter()
            .find(|d| d["kind"] == kind)
            .unwrap_or_else(|| panic!("no {kind} rendered"))
            .clone()
    };
    (
        of("ValidatingWebhookConfiguration"),
        of("MutatingWebhookConfiguration"),
    )
}

/// The matchConditions of each webhook of a configuration, by webhook name.
fn conditions(config: &Value) -> Vec<(String, Vec<String>)> {
    config["webhooks"]
        .as_array()
        .expect("webhooks")
        .iter()
        .map(|w| {
            let exprs = w["matchConditions"]
                .as_array()
                .map(|cs| {
                    cs.iter()
                        .map(|c| c["expression"].as_str().expect("expression").to_string())
                        .collect()
                })
                .unwrap_or_default();
            (w["name"].as_str().expect("name").to_string(), exprs)
        })
        .collect()
}

#[test]
fn match_conditions_are_rendered_from_1_30_with_the_keys_the_webhook_reads() {
    let (validating, mutating) = rendered("1.29.9", &[]);
    for config in [validating, mutating] {
        for (hook, exprs) in conditions(&config) {
            assert!(exprs.is_empty(), "{hook} has matchConditions before 1.30");
        }
    }
    let (validating, mutating) = rendered("1.30.0", &[]);
    let v = conditions(&validating);
    let m = conditions(&mutating);
    assert_eq!(v.len(), 2);
    assert_eq!(m.len(), 1);
    let (fencing, scale, inject) = (&v[0].1, &v[1].1, &m[0].1);
    assert_eq!((fencing.len(), scale.len(), inject.len()), (1, 1, 2));
    for user in DEFAULT_EXEMPT_USERS {
        assert!(fencing[0].contains(&format!("\"{user}\"")), "{user}");
        assert!(scale[0].contains(&format!("\"{user}\"")), "{user}");
    }
    for key in [
        LEASE_LABEL,
        TOKEN_ANNOTATION,
        LEASE_UID_ANNOTATION,
        WRITE_ID_ANNOTATION,
    ] {
        assert!(fencing[0].contains(&format!("'{key}'")), "{key}");
    }
    assert!(inject[0].contains(&format!("'{LEASE_ANNOTATION}'")));
    assert!(inject[1].contains(&format!("'{INJECT_ANNOTATION}'")));
    // Without exempt writers the fencing webhooks are called for everything they match.
    let none = rendered(
        "1.30.0",
        &[
            "--set-json",
            "fencing.exemptUsers=[]",
            "--set-json",
            "fencing.exemptGroups=[]",
        ],
    );
    for (hook, exprs) in conditions(&none.0) {
        assert!(exprs.is_empty(), "{hook}: {exprs:?}");
    }
    assert_eq!(conditions(&none.1)[0].1.len(), 2);
}

/// The configurations' matchConditions as installed.
fn installed_conditions(kind: &str, name: &str) -> String {
    let (ok, out, err) = kubectl(&[
        "get",
        kind,
        name,
        "-o",
        "jsonpath={.webhooks[*].matchConditions[*].name}",
    ]);
    assert!(ok, "kubectl get {kind} {name}: {err}");
    out.trim().to_string()
}

/// Expects the API server to have admitted (`skipped`: the webhook was not called) or to have
/// refused because it called the webhook and nobody answered.
fn expect(what: &str, result: Result<(), String>, skipped: bool) {
    match result {
        Ok(()) if skipped => {}
        Err(e) if !skipped && e.contains(CALLED) => {}
        other => panic!(
            "{what}: expected {}, got {other:?}",
            if skipped {
                "admission without a webhook call"
            } else {
                "a call to the webhook (which nobody answers)"
            }
        ),
    }
}

/// Waits until the API server applies a newly installed configuration: until `probe`, a request
/// the webhook is always called for, is refused for want of an answer.
async fn wait_until_in_effect<F, Fut>(what: &str, probe: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    common::eventually(
        std::time::Duration::from_secs(30),
        &format!("the API server to call the webhook for {what}"),
        || async { probe().await.err().filter(|e| e.contains(CALLED)) },
    )
    .await;
}

#[tokio::test]
async fn injection_is_not_called_for_pods_that_do_not_ask_for_the_sidecar() {
    let client = client().await;
    ensure_crd();
    let conditions = server_minor(&client).await >= CONDITIONS_FROM_MINOR;
    let ns = TestNamespace::new(&client, "match-inject").await;
    // The chart's injection selector asks for this label as well as the test's own.
    let (ok, _, err) = kubectl(&[
        "label",
        "namespace",
        &ns.name,
        "fencedlease.io/injection=enabled",
    ]);
    assert!(ok, "{err}");
    let release = Release::new(&ns, "flm");
    release.run(
        "install",
        &[&NO_PODS[..], &["--set", "injection.failurePolicy=Fail"]].concat(),
    );
    assert_eq!(
        installed_conditions("mutatingwebhookconfiguration", &release.mutating()),
        if conditions {
            "asks-for-a-sidecar not-opted-out"
        } else {
            ""
        }
    );
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    let create_with = |name: &str, annotations: Value, dry_run: bool| {
        let pods = pods.clone();
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "annotations": annotations},
            "spec": {"containers": [{"name": "app", "image": "busybox"}]}
        }))
        .expect("pod literal");
        let pp = PostParams {
            dry_run,
            ..PostParams::default()
        };
        async move {
            pods.create(&pp, &pod)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
    };
    wait_until_in_effect("a pod that asks for the sidecar", || {
        create_with("probe", json!({LEASE_ANNOTATION: "db"}), true)
    })
    .await;
    let create = |name: &str, annotations: Value| create_with(name, annotations, false);
    expect(
        "a pod without annotations",
        create("plain", json!({})).await,
        conditions,
    );
    expect(
        "a pod with other annotations",
        create("other", json!({"example.com/x": "y"})).await,
        conditions,
    );
    expect(
        "a pod opted out by annotation",
        create(
            "opted-out",
            json!({LEASE_ANNOTATION: "db", INJECT_ANNOTATION: "false"}),
        )
        .await,
        conditions,
    );
    expect(
        "a pod that asks for the sidecar",
        create("asks", json!({LEASE_ANNOTATION: "db"})).await,
        false,
    );
}

/// No webhook may answer here: a call the API server makes must fail, which shows it was made.
/// The release's pods get an image no node has and never pull it, so they do not run even on a
/// cluster with a node (where the chart's default image would, and its controller and webhook
/// would answer).
const NO_PODS: [&str; 4] = [
    "--set",
    "image.repository=fencedlease-not-on-any-node",
    "--set",
    "image.pullPolicy=Never",
];

/// One write: what it is, who writes (user, group; None: the admin), kubectl's arguments (split
/// at spaces), and
/// whether the API server skips the webhook for it.
type Case<'a> = (&'a str, Option<(&'a str, &'a str)>, String, bool);

/// `kubectl ARGS` in the test namespace, as `who` (impersonated, in `group` and in
/// system:masters so that RBAC allows it) or as the admin.
fn kubectl_as(ns: &str, who: Option<(&str, &str)>, args: &[&str]) -> Result<(), String> {
    let mut all: Vec<&str> = vec!["-n", ns];
    all.extend_from_slice(args);
    if let Some((user, group)) = who {
        all.extend_from_slice(&[
            "--as",
            user,
            "--as-group",
            group,
            "--as-group",
            "system:masters",
        ]);
    }
    let (ok, out, err) = kubectl(&all);
    if ok {
        Ok(())
    } else {
        Err(format!("{err}{out}"))
    }
}

#[tokio::test]
async fn fencing_is_not_called_for_exempt_writers_that_leave_the_fencing_alone() {
    let client = client().await;
    ensure_crd();
    let conditions = server_minor(&client).await >= CONDITIONS_FROM_MINOR;
    let ns = TestNamespace::new(&client, "match-fencing").await;
    let n = ns.name.as_str();
    // A protected ConfigMap and a Deployment, made before the webhooks exist.
    for cmd in [
        "create configmap inventory --from-literal=items=1".to_string(),
        format!("label configmap inventory {LEASE_LABEL}=db"),
        format!("annotate configmap inventory {TOKEN_ANNOTATION}=3"),
        "create deployment web --image=busybox".to_string(),
    ] {
        kubectl_as(n, None, &cmd.split_whitespace().collect::<Vec<_>>()).expect("setup");
    }

    let release = Release::new(&ns, "flf");
    let users = format!(r#"fencing.exemptUsers=["{EXEMPT_USER}"]"#);
    let groups = format!(r#"fencing.exemptGroups=["{EXEMPT_GROUP}"]"#);
    let exempt = ["--set-json", users.as_str(), "--set-json", groups.as_str()];
    release.run("install", &[&NO_PODS[..], &exempt[..]].concat());
    let vwc = release.validating();
    let expected = if conditions {
        "not-an-exempt-update not-an-exempt-writer"
    } else {
        ""
    };
    assert_eq!(
        installed_conditions("validatingwebhookconfiguration", &vwc),
        expected
    );

    wait_until_in_effect("an update of a protected object", || async {
        kubectl_as(
            n,
            None,
            &[
                "annotate",
                "cm",
                "inventory",
                "--dry-run=server",
                "x.io/p=1",
            ],
        )
    })
    .await;
    let user = Some((EXEMPT_USER, "fl-test-other-group"));
    let group_member = Some(("fl-test-someone", EXEMPT_GROUP));
    // A labelled ConfigMap to create (never stored: --dry-run=server still runs admission).
    let created = std::env::temp_dir().join(format!("{n}-create.json"));
    let labelled = json!({"apiVersion": "v1", "kind": "ConfigMap",
                          "metadata": {"name": "new", "labels": {LEASE_LABEL: "db"}}});
    std::fs::write(&created, labelled.to_string()).expect("write the ConfigMap to create");
    let created = created.to_str().expect("utf-8").to_string();
    // kubectl arguments (split at spaces). Every round writes new values: a no-op proves nothing.
    let cases = |round: u32| -> Vec<Case> {
        let v = |k: u32| round * 10 + k;
        let patch = |k| {
            format!(
                r#"patch cm inventory --type=merge -p {{"data":{{"items":"{}"}}}}"#,
                v(k)
            )
        };
        let note = |kv: String| format!("annotate cm inventory --overwrite {kv}");
        let scale = |k| format!("scale deployment web --replicas={}", v(k));
        #[rustfmt::skip]
        let cases = vec![
            ("an exempt user's update that leaves the fencing alone", user, patch(1), conditions),
            ("an exempt group member's update that does", group_member, patch(2), conditions),
            ("an exempt user's update of another annotation", user, note(format!("x.io/n={}", v(3))), conditions),
            ("an exempt user's update of the token", user, note(format!("{TOKEN_ANNOTATION}={}", v(4))), false),
            ("an exempt user's empty write id", user, note(format!("{WRITE_ID_ANNOTATION}=")), false),
            ("an exempt user's removal of the lease label", user, format!("label cm inventory {LEASE_LABEL}-"), false),
            ("an exempt user's create of a protected object", user, format!("create --dry-run=server -f {created}"), false),
            ("anyone else's update", None, patch(5), false),
            ("an exempt user's /scale write", user, scale(6), conditions),
            ("anyone else's /scale write", None, scale(7), false),
            // fencing.deletes: an exempt deleter (the garbage collector, say) is not sent.
            ("an exempt user's delete", user, "delete cm inventory --dry-run=server".into(), conditions),
            ("anyone else's delete", None, "delete cm inventory --dry-run=server".into(), false),
        ];
        cases
    };
    let run = |round: u32| {
        for (what, who, cmd, skipped) in cases(round) {
            let args: Vec<&str> = cmd.split_whitespace().collect();
            let what = format!("{what} (round {round})");
            expect(&what, kubectl_as(n, who, &args), skipped);
        }
    };
    run(1);

    // The active controller patches caBundle into both configurations (the real code); the
    // matchConditions stay.
    let cfg = fencedlease::controller::certs::CertConfig {
        namespace: ns.name.clone(),
        secret: release.tls_secret(),
        service: release.fullname(),
        configurations: vec![vwc.clone(), release.mutating()],
    };
    assert!(
        fencedlease::controller::certs::reconcile(&client, &cfg)
            .await
            .expect("certificate and caBundle"),
        "the controller's code wrote"
    );
    let (ok, bundle, err) = kubectl(&[
        "get",
        "validatingwebhookconfiguration",
        &vwc,
        "-o",
        "jsonpath={.webhooks[0].clientConfig.caBundle}",
    ]);
    assert!(ok && !bundle.trim().is_empty(), "caBundle patched: {err}");
    assert_eq!(
        installed_conditions("validatingwebhookconfiguration", &vwc),
        expected,
        "the caBundle patch kept matchConditions"
    );
    run(2);
    let _ = std::fs::remove_file(&created);
}
