//! `helm install` of the chart on a real node: the operator pods become Ready, the active
//! controller issues the webhook certificate and caBundle, both webhooks answer through the
//! Service (a fenced write is refused, an annotated pod gets the sidecar), and `helm uninstall`
//! removes it all but the CRD.

use fencedlease_testkit as common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::helm::Release;
use common::node::{
    container_names, holder, name_of, ready_node, running_containers, LEASE_LABEL, SIDECAR_IMAGE,
};
use common::operator::{
    annotated_pod, component_of, opt_in_to_injection, wait_certificate_and_ca_bundles,
    wait_injection_served, wait_operator_ready,
};
use common::{client, ensure_crd, eventually, TestNamespace};
use fencedlease::api::FencedLease;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::Api;
use serde_json::json;

#[tokio::test]
async fn helm_install_runs_the_operator_serves_both_webhooks_and_uninstall_removes_it() {
    let client = client().await;
    ready_node(&client).await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "node-helm").await;
    opt_in_to_injection(&client, &ns.name).await;
    let started = Instant::now();
    let phase = |what: &str| {
        println!(
            "helm test: {what} after {:.1} s",
            started.elapsed().as_secs_f64()
        )
    };
    let mut release = Release::install_on_node(&ns, "flh", &[]);
    let full = release.fullname();

    // The chart's default two pods of each component run Ready, one container each (the
    // webhook apart from the controller, under its own read-only ServiceAccount).
    let operators = wait_operator_ready(&client, &release, 2).await;
    phase("two controller and two webhook pods Ready");
    for p in &operators {
        let component = component_of(p);
        assert_eq!(
            container_names(p),
            [component.as_str()],
            "operator pod {}",
            name_of(p)
        );
        let account = p.spec.as_ref().and_then(|s| s.service_account_name.clone());
        let expected = if component == "webhook" {
            release.webhook()
        } else {
            release.controller_account()
        };
        assert_eq!(account, Some(expected), "ServiceAccount of {}", name_of(p));
    }
    let operator_names: BTreeSet<String> = operators
        .iter()
        .filter(|p| component_of(p) == "controller")
        .map(name_of)
        .collect();

    // One controller is active: it holds the election lease ...
    let leases: Api<FencedLease> = Api::namespaced(client.clone(), &ns.name);
    let active = eventually(
        Duration::from_secs(60),
        "one operator pod to hold the controller's election lease",
        || async {
            let h = holder(&leases, &release.election_lease()).await;
            match h {
                Some(h) if operator_names.contains(&h) => Ok(h),
                other => Err(format!(
                    "holder {other:?}, operator pods {operator_names:?}"
                )),
            }
        },
    )
    .await;
    // The election lease is owned by the webhook Service, so that uninstalling removes it.
    let election = leases
        .get(&release.election_lease())
        .await
        .expect("the election lease");
    let owners: Vec<(String, String)> = election
        .metadata
        .owner_references
        .unwrap_or_default()
        .into_iter()
        .map(|o| (o.kind, o.name))
        .collect();
    assert_eq!(
        owners,
        [("Service".to_string(), release.fullname())],
        "owners of the election lease"
    );
    // ... and has issued the serving certificate, owned by the webhook Service, and written its
    // CA into both webhook configurations.
    let ca = wait_certificate_and_ca_bundles(&client, &release).await;
    let secret = Api::<Secret>::namespaced(client.clone(), &ns.name)
        .get(&release.tls_secret())
        .await
        .expect("the certificate Secret");
    assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
    let keys: BTreeSet<String> = secret
        .data
        .clone()
        .unwrap_or_default()
        .into_keys()
        .collect();
    for k in ["tls.crt", "tls.key", "ca.crt"] {
        assert!(keys.contains(k), "the Secret lacks {k}: {keys:?}");
    }
    let owners = secret.metadata.owner_references.clone().unwrap_or_default();
    assert!(
        owners.iter().any(|o| o.kind == "Service" && o.name == full),
        "the Secret is not owned by the webhook Service {full}: {owners:?}"
    );
    assert!(String::from_utf8_lossy(&ca).contains("BEGIN CERTIFICATE"));
    phase(&format!(
        "certificate and caBundles issued by the active controller {active}"
    ));

    // The fencing webhook answers through the Service: a labelled write without a token is
    // refused with its message (the API server dials the Service's endpoints).
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    let unfenced: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "protected", "labels": {LEASE_LABEL: "inventory"}},
        "data": {"items": "1"}
    }))
    .expect("configmap literal");
    let refusal = eventually(
        Duration::from_secs(60),
        "the fencing webhook to refuse a protected write without a token",
        || async {
            match cms.create(&PostParams::default(), &unfenced).await {
                Ok(_) => panic!(
                    "a write to a ConfigMap labelled {LEASE_LABEL} without a token was allowed: the \
                     fencing webhook was not called"
                ),
                Err(kube::Error::Api(s)) if s.code == 403 && s.message.contains("fencedlease:") => {
                    Ok(s.message)
                }
                Err(e) => Err(e.to_string()),
            }
        },
    )
    .await;
    assert!(
        refusal.contains("admission webhook \"fencing.fencedlease.io\" denied the request")
            && refusal.contains("fencedlease.io/token"),
        "unexpected refusal: {refusal}"
    );
    phase(&format!("fencing webhook refused a write: {refusal}"));
    // `kubectl fencedlease check` sees the same: its dry-run probe of the fence in this
    // namespace is refused by a webhook replica.
    let check = std::process::Command::new(env!("CARGO_BIN_EXE_fencedlease"))
        .args(["kubectl", "check", "-n", &ns.name])
        .env("KUBECONFIG", common::kubeconfig_path())
        .output()
        .expect("running fencedlease kubectl check");
    let report = String::from_utf8_lossy(&check.stdout);
    let fence = format!(
        "✓ the fence answers: a dry-run write of a protected ConfigMap without a token in namespace {} was refused (403)",
        ns.name
    );
    assert!(
        report.contains(&fence),
        "{fence:?} missing from check:\n{report}"
    );
    phase("kubectl fencedlease check: the fence answers");

    // The injection webhook answers through the Service: an annotated pod gets the sidecar.
    wait_injection_served(&client, &ns.name).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    let created = pods
        .create(&PostParams::default(), &annotated_pod("injected", "demo"))
        .await
        .expect("creating an annotated pod");
    let sidecar = running_containers(&created)
        .into_iter()
        .find(|c| c.name == "fencedlease")
        .unwrap_or_else(|| {
            panic!(
                "the annotated pod was created without the sidecar: {:?}",
                container_names(&created)
            )
        });
    assert_eq!(sidecar.image.as_deref(), Some(SIDECAR_IMAGE));
    assert_eq!(sidecar.image_pull_policy.as_deref(), Some("Never"));
    let args = sidecar.args.clone().unwrap_or_default();
    assert_eq!(
        &args[..3],
        ["sidecar", "--lease", "demo"],
        "sidecar args {args:?}"
    );
    pods.delete(
        "injected",
        &DeleteParams {
            grace_period_seconds: Some(0),
            ..DeleteParams::default()
        },
    )
    .await
    .expect("deleting the annotated pod");

    phase("injection webhook added the sidecar");
    // helm uninstall: everything of the release goes (pods and the certificate Secret through
    // the garbage collector, hence the wait), the CRD stays.
    release.uninstall();
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns.name);
    eventually(
        Duration::from_secs(120),
        "helm uninstall to remove every object of the release, its pods and its certificate Secret",
        || async {
            let mut left = release.left_behind(false);
            let all_pods = pods
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?;
            left.extend(all_pods.items.iter().map(|p| format!("pod/{}", name_of(p))));
            let all_secrets = secrets
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?;
            left.extend(
                all_secrets
                    .items
                    .iter()
                    .filter(|s| {
                        s.type_.as_deref() != Some("kubernetes.io/service-account-token")
                            || s.metadata
                                .name
                                .as_deref()
                                .is_some_and(|n| n.starts_with(&full))
                    })
                    .map(|s| format!("secret/{}", s.metadata.name.clone().unwrap_or_default())),
            );
            if left.is_empty() {
                Ok(())
            } else {
                Err(format!("left: {left:?}"))
            }
        },
    )
    .await;
    phase("uninstalled: objects, pods and Secrets gone");
    // None of its cluster-scoped objects or helm records is left, and the CRD stays.
    release.assert_uninstalled_cleanly();
    // No FencedLease is left: the election lease goes with its owner, the Service (the garbage
    // collector deletes it shortly after).
    eventually(
        Duration::from_secs(60),
        "the election lease to be garbage-collected with the Service",
        || async {
            let left: Vec<String> = leases
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?
                .items
                .iter()
                .filter_map(|l| l.metadata.name.clone())
                .collect();
            if left.is_empty() {
                Ok(())
            } else {
                Err(format!("FencedLeases left after uninstall: {left:?}"))
            }
        },
    )
    .await;
}
