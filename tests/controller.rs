//! Controller duties beyond the lease itself, against the real API server: the leader label
//! on pods, and self-managed webhook certificates written by the active replica only.

use fencedlease_testkit as common;

use std::time::Duration;

use common::procs::{campaign, controller, controller_with, following, scratch_dir};
use common::{client, ensure_crd, eventually, TestNamespace};
use fencedlease::api::{FencedLease, FencedLeaseSpec};
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::PostParams;
use kube::Api;
use nix::sys::signal::Signal;
use serde_json::json;

fn stored_pod(name: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": {"fencedlease.io/lease": "db"}},
        "spec": {"containers": [{"name": "app", "image": "busybox"}]}
    }))
    .expect("pod literal")
}

fn leaders(pods: &[Pod]) -> Vec<String> {
    pods.iter()
        .filter(|p| {
            p.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("fencedlease.io/role"))
                .map(String::as_str)
                == Some("leader")
        })
        .filter_map(|p| p.metadata.name.clone())
        .collect()
}

#[tokio::test]
async fn the_leader_label_follows_the_lease_from_pod_to_pod() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "label").await;
    let dir = scratch_dir("label");
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    for name in ["pod-a", "pod-b"] {
        pods.create(&PostParams::default(), &stored_pod(name))
            .await
            .expect("pod");
    }
    let _ctl = controller(&dir, &ns.name, "controller-0");
    let a = campaign(&dir, &ns.name, "db", "pod-a", 2);
    let labelled = eventually(Duration::from_secs(15), "pod-a labelled leader", || async {
        let l = leaders(&pods.list(&Default::default()).await.ok()?.items);
        (l == ["pod-a"]).then_some(l)
    })
    .await;
    assert_eq!(labelled, ["pod-a"]);
    let b = campaign(&dir, &ns.name, "db", "pod-b", 2);
    following(&b, "pod-a").await;
    a.signal(Signal::SIGKILL);
    // Never two labelled pods while it moves, and it ends on pod-b.
    eventually(
        Duration::from_secs(15),
        "the label to move to pod-b",
        || async {
            let l = leaders(&pods.list(&Default::default()).await.expect("list").items);
            assert!(l.len() <= 1, "two pods labelled leader: {l:?}");
            if l == ["pod-b"] {
                Ok(())
            } else {
                Err(format!("labelled: {l:?}"))
            }
        },
    )
    .await;
}

/// The label is level-triggered from the controller's pod watch: a holder's pod that appears
/// after it acquired gets the label, and a label put by hand on a pod that does not hold the
/// lease comes off, without any change to the lease.
#[tokio::test]
async fn the_leader_label_is_corrected_when_pods_change() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "label-level").await;
    let dir = scratch_dir("label-level");
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    let _ctl = controller(&dir, &ns.name, "controller-0");
    // pod-c holds the lease before any pod of that name exists.
    let c = campaign(&dir, &ns.name, "db", "pod-c", 30);
    eventually(Duration::from_secs(15), "pod-c to lead", || async {
        c.events().into_iter().find(|e| e.event == "leading")
    })
    .await;
    pods.create(&PostParams::default(), &stored_pod("pod-c"))
        .await
        .expect("pod");
    let labelled = eventually(Duration::from_secs(10), "pod-c labelled leader", || async {
        let l = leaders(&pods.list(&Default::default()).await.ok()?.items);
        (l == ["pod-c"]).then_some(l)
    })
    .await;
    assert_eq!(labelled, ["pod-c"]);
    // A stray label on a pod of the same lease that does not hold it.
    let mut stray = stored_pod("pod-x");
    stray.metadata.labels =
        Some([("fencedlease.io/role".to_string(), "leader".to_string())].into());
    pods.create(&PostParams::default(), &stray)
        .await
        .expect("pod");
    let after = eventually(
        Duration::from_secs(10),
        "the stray label removed",
        || async {
            let l = leaders(&pods.list(&Default::default()).await.ok()?.items);
            (l == ["pod-c"]).then_some(l)
        },
    )
    .await;
    assert_eq!(after, ["pod-c"]);
    // A pod of another lease keeps its label: it is not ours to judge.
    let mut other = stored_pod("pod-q");
    other.metadata.annotations =
        Some([("fencedlease.io/lease".to_string(), "queue".to_string())].into());
    other.metadata.labels =
        Some([("fencedlease.io/role".to_string(), "leader".to_string())].into());
    pods.create(&PostParams::default(), &other)
        .await
        .expect("pod");
    // Then another stray label on a pod of "db": once the controller has taken it off, it has
    // seen pod-q (its watch of pods delivers them in order) and left pod-q's label alone.
    let mut barrier = stored_pod("pod-y");
    barrier.metadata.labels =
        Some([("fencedlease.io/role".to_string(), "leader".to_string())].into());
    pods.create(&PostParams::default(), &barrier)
        .await
        .expect("pod");
    let mut l = eventually(
        Duration::from_secs(10),
        "pod-y's stray label removed",
        || async {
            let l = leaders(&pods.list(&Default::default()).await.ok()?.items);
            (!l.iter().any(|p| p == "pod-y")).then_some(l)
        },
    )
    .await;
    l.sort();
    assert_eq!(l, ["pod-c", "pod-q"]);
}

#[tokio::test]
async fn the_active_controller_alone_issues_the_webhook_certificate_and_ca_bundle() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "certs").await;
    let dir = scratch_dir("certs");
    let config_name = format!("fencedlease-certs-test-{}", ns.name);
    // A configuration that matches no namespace: only its caBundle matters here.
    let cfg: ValidatingWebhookConfiguration = serde_json::from_value(json!({
        "metadata": {"name": config_name},
        "webhooks": [{
            "name": "fencing.fencedlease.io",
            "admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": "Ignore",
            "clientConfig": {"service": {"name": "fencedlease-webhook", "namespace": ns.name, "path": "/validate"}},
            "namespaceSelector": {"matchLabels": {"fencedlease.io/never": "true"}},
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["configmaps"]}]
        }]
    }))
    .expect("literal");
    let configs: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    configs
        .create(&PostParams::default(), &cfg)
        .await
        .expect("create configuration");
    let flags = [
        "--webhook-cert-secret",
        "fencedlease-webhook-tls",
        "--webhook-service",
        "fencedlease-webhook",
        "--webhook-configurations",
        config_name.as_str(),
    ];
    let free = common::webhook::free_ports(2);
    let ports = [free[0], free[1]];
    let replica = |i: usize| {
        let addr = format!("127.0.0.1:{}", ports[i]);
        let mut args = flags.to_vec();
        args.extend_from_slice(&["--metrics-addr", &addr]);
        controller_with(&dir, &ns.name, &format!("controller-{i}"), &args)
    };
    let reps = [replica(0), replica(1)];
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns.name);
    let secret = eventually(
        Duration::from_secs(20),
        "the certificate Secret",
        || async {
            secrets
                .get_opt("fencedlease-webhook-tls")
                .await
                .ok()
                .flatten()
        },
    )
    .await;
    assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
    let data = secret.data.clone().expect("data");
    for k in ["tls.crt", "tls.key", "ca.crt"] {
        assert!(data.contains_key(k), "{k}");
    }
    let ca = data["ca.crt"].clone();
    eventually(
        Duration::from_secs(20),
        "the caBundle to match the Secret's CA",
        || async {
            let c = configs.get(&config_name).await.ok()?;
            let w = c.webhooks?.into_iter().next()?;
            (w.client_config.ca_bundle.as_ref() == Some(&ca)).then_some(())
        },
    )
    .await;
    // Two replicas, one writer: the standby wrote nothing, and when it takes over, its first
    // check finds the certificate and the caBundle current and writes nothing either.
    let rv = secret.metadata.resource_version.clone();
    let crv = configs
        .get(&config_name)
        .await
        .expect("get")
        .metadata
        .resource_version;
    let leading = |port: u16| {
        http_get(port, "/metrics")
            .1
            .lines()
            .any(|l| l == "fencedlease_controller_leading 1")
    };
    let active = eventually(Duration::from_secs(20), "one active replica", || async {
        (0..2).find(|i| leading(ports[*i]))
    })
    .await;
    let standby = &reps[1 - active];
    reps[active].signal(Signal::SIGTERM);
    eventually(
        Duration::from_secs(30),
        "the new active replica to find the certificate current",
        || async {
            let log = std::fs::read_to_string(&standby.log).ok()?;
            log.contains("the webhook certificate and caBundles are current")
                .then_some(())
        },
    )
    .await;
    assert_eq!(
        secrets
            .get("fencedlease-webhook-tls")
            .await
            .expect("get")
            .metadata
            .resource_version,
        rv,
        "the certificate Secret was written again"
    );
    assert_eq!(
        configs
            .get(&config_name)
            .await
            .expect("get")
            .metadata
            .resource_version,
        crv,
        "the caBundle was written again"
    );
    let _ = configs.delete(&config_name, &Default::default()).await;
}

fn http_get(port: u16, path: &str) -> (u16, String) {
    let out = std::process::Command::new("curl")
        .args(["-sS", "--max-time", "2", "-o", "-", "-w", "\n%{http_code}"])
        .arg(format!("http://127.0.0.1:{port}{path}"))
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

/// Two replicas: one active (by the project's own election), both live and ready, metrics on
/// each; SIGTERM of the active one hands over at once and exits 0; a handover to a preferred
/// holder gets its own Event.
#[tokio::test]
async fn one_of_two_replicas_is_active_and_sigterm_hands_over() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "replicas").await;
    let dir = scratch_dir("replicas");
    let free = common::webhook::free_ports(2);
    let ports = [free[0], free[1]];
    let addr = |p: u16| format!("127.0.0.1:{p}");
    let (a0, a1) = (addr(ports[0]), addr(ports[1]));
    let mut reps = [
        controller_with(&dir, &ns.name, "controller-0", &["--metrics-addr", &a0]),
        controller_with(&dir, &ns.name, "controller-1", &["--metrics-addr", &a1]),
    ];
    // The sample line exactly: the HELP text also starts with "1 while ...".
    let leading = |port: u16| {
        http_get(port, "/metrics")
            .1
            .lines()
            .any(|l| l == "fencedlease_controller_leading 1")
    };
    let active = eventually(
        Duration::from_secs(20),
        "exactly one active replica",
        || async {
            let l: Vec<usize> = (0..2).filter(|i| leading(ports[*i])).collect();
            (l.len() == 1).then(|| l[0])
        },
    )
    .await;
    for p in ports {
        assert_eq!(http_get(p, "/livez").0, 200);
        assert_eq!(
            http_get(p, "/readyz").0,
            200,
            "a standby replica is ready too"
        );
        let m = http_get(p, "/metrics").1;
        assert!(
            m.lines()
                .any(|l| l.starts_with("fencedlease_controller_leading ")),
            "{m}"
        );
    }
    // A handover to a preferred holder, seen by the active replica.
    let a = common::procs::campaign(&dir, &ns.name, "db", "pod-a", 15);
    let b = common::procs::campaign(&dir, &ns.name, "db", "pod-b", 15);
    let api: Api<fencedlease::api::FencedLease> = Api::namespaced(client.clone(), &ns.name);
    eventually(
        Duration::from_secs(10),
        "pod-a or pod-b to hold db",
        || async { api.get("db").await.ok()?.holder().map(str::to_string) },
    )
    .await;
    let holder = api
        .get("db")
        .await
        .expect("get")
        .holder()
        .map(str::to_string)
        .expect("holder");
    let other = if holder == "pod-a" { "pod-b" } else { "pod-a" };
    api.patch(
        "db",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(json!({"spec": {"preferredHolder": other}})),
    )
    .await
    .expect("ask for a handover");
    eventually(Duration::from_secs(10), "a HandedOver event", || async {
        let (ok, out, _) = common::kubectl(&[
            "get",
            "events",
            "-n",
            &ns.name,
            "-o",
            "custom-columns=R:.reason,M:.message",
        ]);
        (ok && out.contains("HandedOver") && out.contains(other)).then_some(())
    })
    .await;
    drop((a, b));
    // SIGTERM of the active replica: it exits 0 and releases the election lease (a change to
    // no holder, seen on a watch), so that the other takes over without waiting for the 15 s
    // lease to expire.
    let election: Api<FencedLease> = Api::namespaced(client.clone(), &ns.name);
    let log = common::handover::LeaseLog::start(election, "fencedlease-controller").await;
    reps[active].signal(Signal::SIGTERM);
    assert_eq!(
        reps[active].wait_exit(Duration::from_secs(10)),
        Some(0),
        "{}",
        reps[active].log_tail()
    );
    let standby = 1 - active;
    eventually(
        Duration::from_secs(20),
        "the standby to become active",
        || async { leading(ports[standby]).then_some(()) },
    )
    .await;
    let (old, new) = (
        format!("controller-{active}"),
        format!("controller-{standby}"),
    );
    let seen = eventually(
        Duration::from_secs(10),
        "the standby's tenure on the watch",
        || async {
            let holders: Vec<Option<String>> =
                log.entries().into_iter().map(|s| s.holder).collect();
            holders.contains(&Some(new.clone())).then_some(holders)
        },
    )
    .await;
    let from_old = seen.iter().position(|h| h.as_deref() == Some(old.as_str()));
    let to_new = seen.iter().position(|h| h.as_deref() == Some(new.as_str()));
    let released = matches!((from_old, to_new), (Some(o), Some(n))
        if seen[o..n].iter().any(Option::is_none));
    assert!(
        released,
        "the active replica released before the standby took over: {seen:?}"
    );
}

/// A FencedLease in a namespace the fencing leaves out (kube-system and the release's own, by
/// default) guards nothing: the controller says so with the condition Fenced=False and a
/// Warning Event (issue 33, residual 11).
#[tokio::test]
async fn a_lease_where_nothing_is_fenced_gets_a_warning() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "unfenced").await;
    let other = TestNamespace::new(&client, "fenced").await;
    let dir = scratch_dir("unfenced");
    let flag = format!("--unfenced-namespace={}", ns.name);
    let _c = common::procs::controller_with(&dir, &ns.name, "ctl", &[flag.as_str()]);
    let _c2 = common::procs::controller_with(&dir, &other.name, "ctl2", &[flag.as_str()]);
    for n in [&ns.name, &other.name] {
        Api::<FencedLease>::namespaced(client.clone(), n)
            .create(
                &PostParams::default(),
                &FencedLease::new("db", FencedLeaseSpec::free()),
            )
            .await
            .expect("create the lease");
    }
    let fenced = |n: String| {
        let api: Api<FencedLease> = Api::namespaced(client.clone(), &n);
        async move {
            let l = api.get("db").await.ok()?;
            let c = l
                .status?
                .conditions
                .into_iter()
                .find(|c| c.type_ == "Fenced")?;
            Some((c.status, c.reason))
        }
    };
    let got = eventually(Duration::from_secs(20), "the Fenced condition", || {
        fenced(ns.name.clone())
    })
    .await;
    assert_eq!(got, ("False".to_string(), "NamespaceNotFenced".to_string()));
    // Elsewhere no Fenced condition at all, once the controller has written the status.
    let api: Api<FencedLease> = Api::namespaced(client.clone(), &other.name);
    let conditions = eventually(Duration::from_secs(20), "the lease's status", || async {
        let c = api.get("db").await.ok()?.status?.conditions;
        (!c.is_empty()).then_some(c)
    })
    .await;
    assert!(
        conditions.iter().all(|c| c.type_ != "Fenced"),
        "{conditions:?}"
    );
    eventually(
        Duration::from_secs(20),
        "a NamespaceNotFenced Warning",
        || async {
            let (ok, out, _) = common::kubectl(&[
                "get",
                "events",
                "-n",
                &ns.name,
                "--field-selector",
                "type=Warning",
                "-o",
                "custom-columns=R:.reason,M:.message",
            ]);
            (ok && out.contains("NamespaceNotFenced") && out.contains("guards nothing"))
                .then_some(())
        },
    )
    .await;
}
