//! `check`: is fencedlease installed and working? Each finding says what to do when it is not.
//! The verdicts are pure functions of the fetched objects; [`gather`] does the fetching.
//! [`rbac`] checks the sidecar's rights in the namespace (-n), [`control`] that protection
//! follows control there.

pub(super) mod control;
pub(super) mod rbac;

use std::sync::Arc;

use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration, WebhookClientConfig,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, CustomResourceDefinitionVersion,
};
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};

/// The label every object of the chart carries.
pub(super) const PART_OF_SELECTOR: &str = "app.kubernetes.io/part-of=fencedlease";
/// The chart's label telling its two Deployments apart.
pub(super) const COMPONENT_LABEL: &str = "app.kubernetes.io/component";
/// The webhook Deployment's volume with the serving certificate (charts/.../deployment.yaml).
pub(super) const CERTS_VOLUME: &str = "certs";

/// One line of the report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Finding {
    pub ok: bool,
    pub what: String,
    /// For failures: what to do next.
    pub fix: Option<String>,
}

impl Finding {
    fn ok(what: impl Into<String>) -> Finding {
        Finding {
            ok: true,
            what: what.into(),
            fix: None,
        }
    }
    fn fail(what: impl Into<String>, fix: impl Into<String>) -> Finding {
        Finding {
            ok: false,
            what: what.into(),
            fix: Some(fix.into()),
        }
    }
}

/// The report, one line per finding, failures followed by what to do.
pub(super) fn render(findings: &[Finding]) -> String {
    let mut out = String::new();
    for f in findings {
        let mark = if f.ok { "✓" } else { "✗" };
        out.push_str(&format!("{mark} {}\n", f.what));
        if let Some(fix) = &f.fix {
            out.push_str(&format!("    → {fix}\n"));
        }
    }
    let failed = findings.iter().filter(|f| !f.ok).count();
    if failed == 0 {
        out.push_str("\nStatus check results are ✓\n");
    } else {
        out.push_str(&format!("\n{failed} check(s) failed\n"));
    }
    out
}

const APPLY_CRD: &str =
    "apply this version's CRD: fencedlease crd --for-server | kubectl apply --server-side -f -";

/// The parts of a CRD version that this binary relies on.
fn version_view(v: &CustomResourceDefinitionVersion) -> serde_json::Value {
    serde_json::json!({
        "name": v.name, "served": v.served, "storage": v.storage,
        "schema": v.schema, "subresources": v.subresources,
    })
}

/// Verdicts on the served CRD against the one this binary generates for the server.
pub(super) fn crd_findings(
    served: Option<&CustomResourceDefinition>,
    expected: &CustomResourceDefinition,
) -> Vec<Finding> {
    let name = expected.name_any();
    let Some(served) = served else {
        return vec![Finding::fail(
            format!("CRD {name} is not installed"),
            format!("install it: kubectl apply -f crds/ (before Kubernetes 1.25: crds/pre-1.25/), or {APPLY_CRD}"),
        )];
    };
    let mut out = vec![Finding::ok(format!("CRD {name} is installed"))];
    let established = served.status.as_ref().and_then(|s| s.conditions.as_ref());
    if established.is_some_and(|cs| {
        cs.iter()
            .any(|c| c.type_ == "Established" && c.status == "True")
    }) {
        out.push(Finding::ok(format!("CRD {name} is established")));
    } else {
        out.push(Finding::fail(
            format!("CRD {name} is not established"),
            format!("see why: kubectl get crd {name} -o jsonpath='{{.status.conditions}}'"),
        ));
    }
    let view = |c: &CustomResourceDefinition| -> Vec<serde_json::Value> {
        c.spec.versions.iter().map(version_view).collect()
    };
    if view(served) == view(expected) {
        out.push(Finding::ok(format!(
            "CRD {name} is the one this fencedlease ({}) generates",
            env!("CARGO_PKG_VERSION")
        )));
    } else {
        out.push(Finding::fail(
            format!(
                "CRD {name} differs from the one this fencedlease ({}) generates (versions, schema or subresources)",
                env!("CARGO_PKG_VERSION")
            ),
            APPLY_CRD,
        ));
    }
    out
}

/// One webhook of a configuration, as `check` looks at it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Hook {
    /// "ValidatingWebhookConfiguration x, webhook y".
    pub label: String,
    pub ca_bundle: Vec<u8>,
    /// The Service's DNS name (`name.namespace.svc`), when the hook calls a Service.
    pub host: Option<String>,
}

fn hook(kind: &str, config: &str, name: &str, client: &WebhookClientConfig) -> Hook {
    Hook {
        label: format!("{kind} {config}, webhook {name}"),
        ca_bundle: client
            .ca_bundle
            .as_ref()
            .map(|b| b.0.clone())
            .unwrap_or_default(),
        host: client
            .service
            .as_ref()
            .map(|s| format!("{}.{}.svc", s.name, s.namespace)),
    }
}

/// The webhooks of the chart's configurations.
pub(super) fn hooks(
    validating: &[ValidatingWebhookConfiguration],
    mutating: &[MutatingWebhookConfiguration],
) -> Vec<Hook> {
    let v = validating.iter().flat_map(|c| {
        let hooks = c.webhooks.iter().flatten();
        hooks.map(|w| {
            hook(
                "ValidatingWebhookConfiguration",
                &c.name_any(),
                &w.name,
                &w.client_config,
            )
        })
    });
    let m = mutating.iter().flat_map(|c| {
        let hooks = c.webhooks.iter().flatten();
        hooks.map(|w| {
            hook(
                "MutatingWebhookConfiguration",
                &c.name_any(),
                &w.name,
                &w.client_config,
            )
        })
    });
    v.chain(m).collect()
}

/// Whether `ca_bundle` (PEM) verifies `cert_pem` (the serving certificate, PEM) for `host`.
pub(super) fn ca_verifies(ca_bundle: &[u8], cert_pem: &[u8], host: &str) -> Result<(), String> {
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(ca_bundle) {
        let ca = ca.map_err(|e| format!("the caBundle is not PEM: {e}"))?;
        roots
            .add(ca)
            .map_err(|e| format!("the caBundle holds no usable CA: {e}"))?;
    }
    let mut chain = CertificateDer::pem_slice_iter(cert_pem);
    let leaf = chain
        .next()
        .ok_or("the serving certificate is empty")?
        .map_err(|e| format!("the serving certificate is not PEM: {e}"))?;
    let intermediates: Vec<CertificateDer<'_>> = chain.filter_map(Result::ok).collect();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier =
        rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
            .build()
            .map_err(|e| format!("the caBundle holds no usable CA: {e}"))?;
    let name = ServerName::try_from(host.to_string()).map_err(|e| format!("{host}: {e}"))?;
    verifier
        .verify_server_cert(&leaf, &intermediates, &name, &[], UnixTime::now())
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// Verdicts on the webhook configurations. `serving_cert` is the webhook's serving
/// certificate (PEM) when it could be read; `policy` whether a ValidatingAdmissionPolicy of
/// the chart guards writes instead of (or besides) the fencing webhook.
pub(super) fn webhook_findings(
    validating: &[ValidatingWebhookConfiguration],
    mutating: &[MutatingWebhookConfiguration],
    policy: bool,
    serving_cert: Option<&[u8]>,
) -> Vec<Finding> {
    let install = "install the chart: helm install fencedlease charts/fencedlease -n fencedlease --create-namespace";
    let mut out = Vec::new();
    match (validating.is_empty(), policy) {
        (false, _) => out.push(Finding::ok("the fencing ValidatingWebhookConfiguration is present")),
        (true, true) => out.push(Finding::ok("fencing runs as a ValidatingAdmissionPolicy (fencing.mode=policy)")),
        (true, false) => out.push(Finding::fail(
            format!("no ValidatingWebhookConfiguration or ValidatingAdmissionPolicy labelled {PART_OF_SELECTOR}: stale writes are not refused"),
            install,
        )),
    }
    if mutating.is_empty() && (policy || !validating.is_empty()) {
        out.push(Finding::ok(
            "no injection MutatingWebhookConfiguration: sidecar injection is off (injection.enabled=false)",
        ));
    } else if mutating.is_empty() {
        out.push(Finding::fail(
            format!("no MutatingWebhookConfiguration labelled {PART_OF_SELECTOR}: sidecars are not injected"),
            install,
        ));
    } else {
        out.push(Finding::ok(
            "the injection MutatingWebhookConfiguration is present",
        ));
    }
    for h in hooks(validating, mutating) {
        out.push(ca_finding(&h, serving_cert));
    }
    out
}

fn ca_finding(h: &Hook, serving_cert: Option<&[u8]>) -> Finding {
    let keeper = "the active controller (self-managed certificates) or cert-manager's CA injector writes it: check that the controller is available (below) and read its logs";
    if h.ca_bundle.is_empty() {
        return Finding::fail(
            format!(
                "{}: caBundle is empty, the API server cannot call it",
                h.label
            ),
            keeper,
        );
    }
    let (Some(cert), Some(host)) = (serving_cert, h.host.as_deref()) else {
        return Finding::ok(format!(
            "{}: caBundle is present (serving certificate not readable here, not verified)",
            h.label
        ));
    };
    match ca_verifies(&h.ca_bundle, cert, host) {
        Ok(()) => Finding::ok(format!(
            "{}: caBundle verifies the webhook's serving certificate for {host}",
            h.label
        )),
        Err(why) => Finding::fail(
            format!(
                "{}: caBundle does not verify the webhook's serving certificate for {host}: {why}",
                h.label
            ),
            keeper,
        ),
    }
}

fn component(d: &Deployment) -> Option<&str> {
    d.labels().get(COMPONENT_LABEL).map(String::as_str)
}

fn available(d: &Deployment) -> bool {
    let conditions = d.status.as_ref().and_then(|s| s.conditions.as_ref());
    conditions.is_some_and(|cs| {
        cs.iter()
            .any(|c| c.type_ == "Available" && c.status == "True")
    }) && d
        .status
        .as_ref()
        .and_then(|s| s.available_replicas)
        .unwrap_or(0)
        > 0
}

/// Verdicts on the chart's controller and webhook Deployments. `webhook` says whether a
/// webhook server is expected (a webhook configuration exists; policy mode without injection
/// runs none).
pub(super) fn deployment_findings(deployments: &[Deployment], webhook: bool) -> Vec<Finding> {
    let mut out = Vec::new();
    let roles: &[&str] = if webhook {
        &["controller", "webhook"]
    } else {
        &["controller"]
    };
    for &role in roles {
        let found: Vec<&Deployment> = deployments
            .iter()
            .filter(|d| component(d) == Some(role))
            .collect();
        if found.is_empty() {
            out.push(Finding::fail(
                format!("no {role} Deployment labelled {PART_OF_SELECTOR},{COMPONENT_LABEL}={role}"),
                "install the chart: helm install fencedlease charts/fencedlease -n fencedlease --create-namespace",
            ));
        }
        for d in found {
            let at = format!("{}/{}", d.namespace().unwrap_or_default(), d.name_any());
            if available(d) {
                out.push(Finding::ok(format!(
                    "the {role} Deployment {at} is available"
                )));
            } else {
                out.push(Finding::fail(
                    format!("the {role} Deployment {at} has no available replica"),
                    format!("see why: kubectl -n {} describe deployment {}; kubectl -n {} logs deployment/{}",
                        d.namespace().unwrap_or_default(), d.name_any(), d.namespace().unwrap_or_default(), d.name_any()),
                ));
            }
        }
    }
    out
}

/// The Secret holding the webhook's serving certificate: (namespace, name), from the webhook
/// Deployment's `certs` volume.
pub(super) fn serving_secret(deployments: &[Deployment]) -> Option<(String, String)> {
    let d = deployments
        .iter()
        .find(|d| component(d) == Some("webhook"))?;
    let spec = d.spec.as_ref()?.template.spec.as_ref()?;
    let volume = spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == CERTS_VOLUME)?;
    let name = volume.secret.as_ref()?.secret_name.clone()?;
    Some((d.namespace()?, name))
}

/// Errors fetching what `check` looks at.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("reading {what}: {source} (does your kubeconfig user may list it? `kubectl auth can-i list {what}`)")]
    Read {
        what: &'static str,
        #[source]
        source: kube::Error,
    },
}

fn read(what: &'static str) -> impl FnOnce(kube::Error) -> CheckError {
    move |source| CheckError::Read { what, source }
}

/// Fetches everything and returns the findings.
pub(super) async fn gather(client: &Client, probe_ns: &str) -> Result<Vec<Finding>, CheckError> {
    let v = client
        .apiserver_version()
        .await
        .map_err(read("the server version"))?;
    let expected = if crate::crdgen::version_takes_rules(&v.major, &v.minor) {
        crate::crdgen::crd()
    } else {
        crate::crdgen::crd_without_rules()
    };
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let served = crds
        .get_opt(&expected.name_any())
        .await
        .map_err(read("customresourcedefinitions"))?;
    let mut out = crd_findings(served.as_ref(), &expected);
    let lp = ListParams::default().labels(PART_OF_SELECTOR);
    let vwc: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let vwc = vwc
        .list(&lp)
        .await
        .map_err(read("validatingwebhookconfigurations"))?
        .items;
    let mwc: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let mwc = mwc
        .list(&lp)
        .await
        .map_err(read("mutatingwebhookconfigurations"))?
        .items;
    let policy = policy_present(client, &lp).await;
    let deps: Api<Deployment> = Api::all(client.clone());
    let deps = deps.list(&lp).await.map_err(read("deployments"))?.items;
    let cert = match serving_secret(&deps) {
        Some((ns, name)) => serving_cert(client, &ns, &name).await,
        None => None,
    };
    out.extend(webhook_findings(&vwc, &mwc, policy, cert.as_deref()));
    out.extend(deployment_findings(
        &deps,
        !vwc.is_empty() || !mwc.is_empty(),
    ));
    if !vwc.is_empty() || policy {
        out.push(fence_finding(
            &probe_fence(client, probe_ns).await,
            probe_ns,
        ));
    }
    out.extend(rbac::gather(client, probe_ns).await);
    out.extend(control::gather(client, probe_ns, &vwc).await);
    Ok(out)
}

/// The name of the ConfigMap the fence probe pretends to create.
pub(super) const PROBE_OBJECT: &str = "fencedlease-check-probe";
/// The lease the probe names: one nobody holds (the fence refuses either way).
pub(super) const PROBE_LEASE: &str = "fencedlease-check-probe";

/// Asks the API server to create, as a dry run, a ConfigMap in `ns` labelled with a lease and
/// carrying no token: the fence (a webhook replica, or the policy) must refuse it. Nothing is
/// written, and the API server calls the webhook for dry runs (its sideEffects are None).
async fn probe_fence(client: &Client, ns: &str) -> Result<(), kube::Error> {
    use k8s_openapi::api::core::v1::ConfigMap;
    let cm: ConfigMap = serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": PROBE_OBJECT,
            "labels": {crate::api::LEASE_LABEL: PROBE_LEASE},
        },
    }))
    .map_err(kube::Error::SerdeError)?;
    let pp = kube::api::PostParams {
        dry_run: true,
        ..Default::default()
    };
    Api::<ConfigMap>::namespaced(client.clone(), ns)
        .create(&pp, &cm)
        .await
        .map(|_| ())
}

/// The verdict on the fence probe in `ns`: refused by fencedlease means a replica (or the
/// policy) answered on the path of real writes.
pub(super) fn fence_finding(probe: &Result<(), kube::Error>, ns: &str) -> Finding {
    let pods = "kubectl get pods -A -l app.kubernetes.io/part-of=fencedlease,app.kubernetes.io/component=webhook, and read their logs";
    match probe {
        Err(kube::Error::Api(s)) if s.message.contains("fencedlease") && !s.message.contains("failed calling webhook") => {
            Finding::ok(format!("the fence answers: a dry-run write of a protected ConfigMap without a token in namespace {ns} was refused ({})", s.code))
        }
        Err(kube::Error::Api(s)) if s.message.contains("failed calling webhook") => Finding::fail(
            format!("no fencing webhook replica answered the API server (namespace {ns}): {}; protected writes are refused meanwhile", s.message),
            pods,
        ),
        Ok(()) => Finding::fail(
            format!("a dry-run write of a ConfigMap labelled {} without a token was allowed in namespace {ns}: that namespace is not fenced, or configmaps are not among fencing.resources", crate::api::LEASE_LABEL),
            "run check with -n NAMESPACE of a namespace whose writes you fence (the chart's fencing.namespaceSelector and excludeNamespaces decide which)",
        ),
        Err(e) => Finding::fail(
            format!("could not probe the fence in namespace {ns}: {e}"),
            "check needs create rights on configmaps there (a dry run writes nothing); or pass -n NAMESPACE",
        ),
    }
}

/// Whether a ValidatingAdmissionPolicy of the chart exists with the chart's binding (a policy
/// without a binding checks nothing). False where the API is absent or not readable: the
/// webhook finding then says what is missing.
async fn policy_present(client: &Client, lp: &ListParams) -> bool {
    use k8s_openapi::api::admissionregistration::v1::{
        ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    };
    let policies: Api<ValidatingAdmissionPolicy> = Api::all(client.clone());
    let bindings: Api<ValidatingAdmissionPolicyBinding> = Api::all(client.clone());
    policies.list(lp).await.is_ok_and(|l| !l.items.is_empty())
        && bindings.list(lp).await.is_ok_and(|l| !l.items.is_empty())
}

/// The serving certificate's PEM, if this user may read the Secret.
async fn serving_cert(client: &Client, ns: &str, name: &str) -> Option<Vec<u8>> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    let secret = secrets.get_opt(name).await.ok()??;
    secret.data?.get("tls.crt").map(|b| b.0.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn served(established: bool) -> CustomResourceDefinition {
        let mut crd = crate::crdgen::crd();
        let status = if established { "True" } else { "False" };
        crd.status = serde_json::from_value(serde_json::json!({
            "conditions": [{"type": "Established", "status": status}]
        }))
        .unwrap();
        crd
    }

    #[test]
    fn an_absent_crd_fails_and_says_how_to_install_it() {
        let f = crd_findings(None, &crate::crdgen::crd());
        assert_eq!(f.len(), 1);
        assert!(!f[0].ok);
        assert!(
            f[0].what
                .contains("fencedleases.fencedlease.io is not installed"),
            "{f:?}"
        );
        assert!(
            f[0].fix.as_deref().unwrap().contains("kubectl apply"),
            "{f:?}"
        );
    }

    #[test]
    fn the_crd_this_binary_generates_passes() {
        let f = crd_findings(Some(&served(true)), &crate::crdgen::crd());
        assert!(f.iter().all(|f| f.ok), "{f:?}");
    }

    #[test]
    fn an_old_or_unestablished_crd_fails() {
        let f = crd_findings(Some(&served(false)), &crate::crdgen::crd());
        assert!(
            f.iter()
                .any(|f| !f.ok && f.what.contains("not established")),
            "{f:?}"
        );
        // The pre-1.25 CRD on a server that takes the rules: another schema.
        let mut old = crate::crdgen::crd_without_rules();
        old.status = served(true).status;
        let f = crd_findings(Some(&old), &crate::crdgen::crd());
        let diff = f.iter().find(|f| !f.ok).expect("a failure");
        assert!(diff.what.contains("differs"), "{f:?}");
        assert!(diff
            .fix
            .as_deref()
            .unwrap()
            .contains("fencedlease crd --for-server"));
    }

    fn hooks_with(
        ca: &str,
    ) -> (
        Vec<ValidatingWebhookConfiguration>,
        Vec<MutatingWebhookConfiguration>,
    ) {
        let hook = |name: &str| {
            serde_json::json!({
                "name": name, "admissionReviewVersions": ["v1"], "sideEffects": "None",
                "clientConfig": {"caBundle": ca, "service": {"name": "fl-webhook", "namespace": "fl"}}
            })
        };
        let v = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "fl"}, "webhooks": [hook("fencing.fencedlease.io")]
        }))
        .unwrap();
        let m = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "fl"}, "webhooks": [hook("inject.fencedlease.io")]
        }))
        .unwrap();
        (vec![v], vec![m])
    }

    fn b64(s: &str) -> String {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD.encode(s)
    }

    #[test]
    fn webhooks_absent_or_without_ca_fail_with_what_to_do() {
        let f = webhook_findings(&[], &[], false, None);
        assert_eq!(f.iter().filter(|f| !f.ok).count(), 2, "{f:?}");
        assert!(f
            .iter()
            .all(|f| f.ok || f.fix.as_deref().unwrap().contains("helm install")));
        assert!(webhook_findings(&[], &hooks_with("").1, true, None)
            .iter()
            .any(|f| f.ok && f.what.contains("Policy")));
        // Policy mode without injection: no webhook configuration at all, and that is fine.
        let f = webhook_findings(&[], &[], true, None);
        assert!(f.iter().all(|f| f.ok), "{f:?}");
        assert!(
            f.iter().any(|f| f.what.contains("injection is off")),
            "{f:?}"
        );
        let (v, m) = hooks_with("");
        let f = webhook_findings(&v, &m, false, None);
        let empty: Vec<_> = f.iter().filter(|f| !f.ok).collect();
        assert_eq!(empty.len(), 2, "{f:?}");
        assert!(empty[0].what.contains("caBundle is empty"));
    }

    #[test]
    fn the_ca_bundle_is_verified_against_the_serving_certificate() {
        let host = "fl-webhook.fl.svc".to_string();
        let ours = crate::runtime::tls::generate(std::slice::from_ref(&host), None).unwrap();
        let other = crate::runtime::tls::generate(std::slice::from_ref(&host), None).unwrap();
        let (v, m) = hooks_with(&b64(&ours.ca_cert));
        let f = webhook_findings(&v, &m, false, Some(ours.cert.as_bytes()));
        assert!(f.iter().all(|f| f.ok), "{f:?}");
        assert!(f.iter().any(|f| f.what.contains("verifies")), "{f:?}");
        let f = webhook_findings(&v, &m, false, Some(other.cert.as_bytes()));
        assert_eq!(
            f.iter()
                .filter(|f| !f.ok && f.what.contains("does not verify"))
                .count(),
            2,
            "{f:?}"
        );
        // Without the serving certificate: present is all that can be said.
        let f = webhook_findings(&v, &m, false, None);
        assert!(f.iter().all(|f| f.ok), "{f:?}");
    }

    fn deployment(component: &str, available: bool) -> Deployment {
        let status = if available { "True" } else { "False" };
        serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "fl", "name": format!("fl-{component}"),
                         "labels": {COMPONENT_LABEL: component}},
            "spec": {"selector": {}, "template": {"spec": {"containers": [],
                "volumes": [{"name": CERTS_VOLUME, "secret": {"secretName": "fl-certs"}}]}}},
            "status": {"availableReplicas": i32::from(available),
                       "conditions": [{"type": "Available", "status": status}]}
        }))
        .unwrap()
    }

    #[test]
    fn both_deployments_must_be_available() {
        let f = deployment_findings(
            &[deployment("controller", true), deployment("webhook", true)],
            true,
        );
        assert!(f.iter().all(|f| f.ok), "{f:?}");
        let f = deployment_findings(&[deployment("controller", false)], true);
        let failed: Vec<_> = f.iter().filter(|f| !f.ok).collect();
        assert_eq!(failed.len(), 2, "{f:?}");
        assert!(failed[0]
            .fix
            .as_deref()
            .unwrap()
            .contains("kubectl -n fl describe deployment fl-controller"));
        assert!(failed[1].what.contains("no webhook Deployment"));
        // Policy mode without injection runs no webhook: none is asked for.
        let f = deployment_findings(&[deployment("controller", true)], false);
        assert!(f.iter().all(|f| f.ok) && f.len() == 1, "{f:?}");
        assert_eq!(
            serving_secret(&[deployment("webhook", true)]),
            Some(("fl".into(), "fl-certs".into()))
        );
    }

    fn api_error(code: u16, message: &str) -> Result<(), kube::Error> {
        Err(kube::Error::Api(Box::new(
            kube::core::Status::failure(message, "").with_code(code),
        )))
    }

    #[test]
    fn the_fence_probe_is_ok_only_when_fencedlease_refused_it() {
        let cases = [
            (api_error(409, "admission webhook \"fencing.fencedlease.io\" denied the request: fencedlease: a write to an object labelled fencedlease.io/lease must carry fencedlease.io/token"), true, "the fence answers"),
            (api_error(403, "fencedlease: the write must present its token"), true, "refused (403)"),
            (api_error(500, "Internal error occurred: failed calling webhook \"fencing.fencedlease.io\": connection refused"), false, "no fencing webhook replica answered"),
            (Ok(()), false, "was allowed in namespace shop"),
            (api_error(403, "configmaps is forbidden: User \"x\" cannot create resource"), false, "could not probe"),
        ];
        for (probe, ok, says) in cases {
            let f = fence_finding(&probe, "shop");
            assert_eq!(f.ok, ok, "{f:?}");
            assert!(f.what.contains(says), "{says:?} not in {f:?}");
            assert!(ok || f.fix.is_some(), "a failure says what to do: {f:?}");
        }
    }
}
