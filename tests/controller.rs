//! Controller duties beyond the lease itself, against the real API server: the leader label
//! on pods, and self-managed webhook certificates written by the active replica only.

mod common;

use std::time::Duration;

use common::procs::{campaign, controller, controller_with, now_ns, scratch_dir};
use common::{client, ensure_crd, eventually, TestNamespace};
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
    let _b = campaign(&dir, &ns.name, "db", "pod-b", 2);
    tokio::time::sleep(Duration::from_millis(500)).await;
    a.signal(Signal::SIGKILL);
    let t0 = now_ns();
    // Never two labelled pods while it moves, and it ends on pod-b.
    loop {
        let l = leaders(&pods.list(&Default::default()).await.expect("list").items);
        assert!(l.len() <= 1, "two pods labelled leader: {l:?}");
        if l == ["pod-b"] {
            break;
        }
        assert!(
            now_ns() - t0 < 15_000_000_000,
            "the label did not move to pod-b: {l:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
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
    let _c0 = controller_with(&dir, &ns.name, "controller-0", &flags);
    let _c1 = controller_with(&dir, &ns.name, "controller-1", &flags);
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
    // Two replicas, one writer: nothing changes any more.
    let rv = secret.metadata.resource_version.clone();
    let crv = configs
        .get(&config_name)
        .await
        .expect("get")
        .metadata
        .resource_version;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        secrets
            .get("fencedlease-webhook-tls")
            .await
            .expect("get")
            .metadata
            .resource_version,
        rv
    );
    assert_eq!(
        configs
            .get(&config_name)
            .await
            .expect("get")
            .metadata
            .resource_version,
        crv
    );
    let _ = configs.delete(&config_name, &Default::default()).await;
}
