//! Self-managed webhook certificates: the active controller replica (and only it, so replicas
//! never race on `caBundle`) keeps a TLS Secret for the webhook Service and the `caBundle` of
//! the operator's webhook configurations in step with it.

use std::collections::BTreeMap;

use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::ByteString;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use tracing::info;

use crate::api::{FIELD_MANAGER, HOSTS_ANNOTATION, NOT_AFTER_ANNOTATION};
use crate::runtime::tls;

/// Renew the serving certificate when it has fewer days left than this.
const RENEW_DAYS_BEFORE: i64 = 30;

#[derive(Clone, Debug)]
pub struct CertConfig {
    pub namespace: String,
    pub secret: String,
    pub service: String,
    pub configurations: Vec<String>,
}

impl CertConfig {
    /// The DNS names the API server may use for the Service.
    pub(super) fn hosts(&self) -> Vec<String> {
        let (s, ns) = (&self.service, &self.namespace);
        vec![
            format!("{s}.{ns}.svc"),
            format!("{s}.{ns}.svc.cluster.local"),
            format!("{s}.{ns}"),
            s.clone(),
        ]
    }
}

fn text(data: &BTreeMap<String, ByteString>, key: &str) -> Option<String> {
    data.get(key)
        .and_then(|b| String::from_utf8(b.0.clone()).ok())
}

/// Does this Secret still serve: all keys present, the right hosts, not near expiry?
pub(super) fn secret_is_current(
    secret: &Secret,
    hosts: &[String],
    today: jiff::civil::Date,
) -> bool {
    let Some(data) = secret.data.as_ref() else {
        return false;
    };
    let has_all = ["tls.crt", "tls.key", "ca.crt", "ca.key"]
        .iter()
        .all(|k| data.contains_key(*k));
    let ann = secret.metadata.annotations.clone().unwrap_or_default();
    let hosts_ok = ann.get(HOSTS_ANNOTATION).map(String::as_str) == Some(hosts.join(",").as_str());
    let fresh = ann
        .get(NOT_AFTER_ANNOTATION)
        .and_then(|d| d.parse::<jiff::civil::Date>().ok())
        .and_then(|end| today.until(end).ok())
        .is_some_and(|left| left.get_days() > RENEW_DAYS_BEFORE as i32);
    has_all && hosts_ok && fresh
}

/// Why keeping the webhook's certificate failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("issuing the certificate: {0}")]
    Tls(#[from] tls::TlsError),
    #[error("building the Secret: {0}")]
    Encode(#[from] serde_json::Error),
}

impl Error {
    /// A bounded label for metrics and logs.
    pub(super) fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube",
            Error::Tls(_) => "tls",
            Error::Encode(_) => "encode",
        }
    }
}

/// Makes sure the Secret is current (issuing or renewing with the same CA) and every webhook
/// in the named configurations trusts its CA. Returns whether anything was written.
pub async fn reconcile(client: &Client, cfg: &CertConfig) -> Result<bool, Error> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &cfg.namespace);
    let hosts = cfg.hosts();
    let today = jiff::Timestamp::now()
        .to_zoned(jiff::tz::TimeZone::UTC)
        .date();
    let existing = secrets.get_opt(&cfg.secret).await?;
    let mut wrote = false;
    let ca_pem = match &existing {
        Some(s) if secret_is_current(s, &hosts, today) => s
            .data
            .as_ref()
            .and_then(|d| text(d, "ca.crt"))
            .unwrap_or_default(),
        _ => {
            let ca_pem = issue(client, cfg, &secrets, &hosts, existing).await?;
            wrote = true;
            ca_pem
        }
    };
    let bundle = ByteString(ca_pem.into_bytes());
    wrote |= trust_ca(client, cfg, &bundle).await?;
    Ok(wrote)
}

/// Issues a new serving certificate into the Secret (creating it, or replacing `existing`),
/// with the CA of `existing` when it has one. Returns the CA's PEM.
async fn issue(
    client: &Client,
    cfg: &CertConfig,
    secrets: &Api<Secret>,
    hosts: &[String],
    existing: Option<Secret>,
) -> Result<String, Error> {
    // Keep the CA across renewals, so the caBundle does not change under the API server.
    let old_ca = existing
        .as_ref()
        .and_then(|s| s.data.as_ref())
        .and_then(|d| Some((text(d, "ca.crt")?, text(d, "ca.key")?)));
    let g = tls::generate(
        hosts,
        old_ca.as_ref().map(|(c, k)| (c.as_str(), k.as_str())),
    )?;
    let mut data = BTreeMap::new();
    for (k, v) in [
        ("tls.crt", &g.cert),
        ("tls.key", &g.key),
        ("ca.crt", &g.ca_cert),
        ("ca.key", &g.ca_key),
    ] {
        data.insert(k.to_string(), ByteString(v.as_bytes().to_vec()));
    }
    let mut secret: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": cfg.secret,
            "labels": {"app.kubernetes.io/managed-by": FIELD_MANAGER},
            "annotations": {
                NOT_AFTER_ANNOTATION: tls::serving_not_after().to_string(),
                HOSTS_ANNOTATION: hosts.join(","),
            },
        },
        "type": "kubernetes.io/tls",
    }))?;
    secret.data = Some(data);
    // Owned by the webhook Service, so that uninstalling the operator removes it.
    secret.metadata.owner_references =
        crate::controller::owners::service_owner(client, &cfg.namespace, &cfg.service)
            .await?
            .map(|o| vec![o]);
    match existing {
        Some(old) => {
            secret.metadata.resource_version = old.metadata.resource_version;
            secrets
                .replace(&cfg.secret, &PostParams::default(), &secret)
                .await?;
        }
        None => {
            secrets.create(&PostParams::default(), &secret).await?;
        }
    }
    info!(secret = %cfg.secret, "issued the webhook serving certificate");
    Ok(g.ca_cert)
}

/// Sets `bundle` as the caBundle of every webhook in the named configurations (validating or
/// mutating) that has another. Returns whether anything was written.
async fn trust_ca(
    client: &Client,
    cfg: &CertConfig,
    bundle: &ByteString,
) -> Result<bool, kube::Error> {
    let mut wrote = false;
    for name in &cfg.configurations {
        let v: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
        if let Some(c) = visible(v.get_opt(name).await)? {
            let hooks = c.webhooks.iter().flatten();
            let stale = stale_webhooks(
                hooks.map(|w| (&w.name, w.client_config.ca_bundle.as_ref())),
                bundle,
            );
            wrote |= patch_ca_bundle(&v, name, &stale, bundle).await?;
        }
        let m: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
        if let Some(c) = visible(m.get_opt(name).await)? {
            let hooks = c.webhooks.iter().flatten();
            let stale = stale_webhooks(
                hooks.map(|w| (&w.name, w.client_config.ca_bundle.as_ref())),
                bundle,
            );
            wrote |= patch_ca_bundle(&m, name, &stale, bundle).await?;
        }
    }
    Ok(wrote)
}

/// The names of the webhooks whose caBundle is not `bundle`.
fn stale_webhooks<'a>(
    hooks: impl Iterator<Item = (&'a String, Option<&'a ByteString>)>,
    bundle: &ByteString,
) -> Vec<String> {
    hooks
        .filter(|(_, ca)| *ca != Some(bundle))
        .map(|(name, _)| name.clone())
        .collect()
}

/// Sets caBundle on the named webhooks of one configuration; true when it wrote.
async fn patch_ca_bundle<K>(
    api: &Api<K>,
    name: &str,
    stale: &[String],
    bundle: &ByteString,
) -> Result<bool, kube::Error>
where
    K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    if stale.is_empty() {
        return Ok(false);
    }
    api.patch(name, &patch_params(), &ca_bundle_patch(stale, bundle))
        .await?;
    info!(configuration = %name, kind = %K::kind(&()), "updated the caBundle of its webhooks");
    Ok(true)
}

/// A configuration name is of one kind or the other, and the chart lets the operator get each
/// name as its own kind only: a 403 for the other kind means "not this kind", like a 404.
fn visible<K>(r: Result<Option<K>, kube::Error>) -> Result<Option<K>, kube::Error> {
    match r {
        Err(kube::Error::Api(s)) if s.code == 403 => Ok(None),
        other => other,
    }
}

/// A field manager of our own, so that Helm's server-side apply (which never sets caBundle)
/// and the controller own different fields.
fn patch_params() -> PatchParams {
    PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PatchParams::default()
    }
}

/// A strategic merge patch that sets only `caBundle`, webhook by webhook (the list merges on
/// `name`), so the operator needs `patch` and never `update` on the configurations.
fn ca_bundle_patch(webhooks: &[String], bundle: &ByteString) -> Patch<serde_json::Value> {
    let items: Vec<serde_json::Value> = webhooks
        .iter()
        .map(|n| serde_json::json!({"name": n, "clientConfig": {"caBundle": bundle}}))
        .collect();
    Patch::Strategic(serde_json::json!({ "webhooks": items }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(keys: &[&str], hosts: &str, not_after: &str) -> Secret {
        let mut data = BTreeMap::new();
        for k in keys {
            data.insert(k.to_string(), ByteString(b"x".to_vec()));
        }
        let mut s: Secret = serde_json::from_value(serde_json::json!({"metadata": {"name": "s",
            "annotations": {HOSTS_ANNOTATION: hosts, NOT_AFTER_ANNOTATION: not_after}}}))
        .expect("secret");
        s.data = Some(data);
        s
    }

    #[test]
    fn a_secret_is_renewed_when_incomplete_for_other_hosts_or_near_expiry() {
        let cfg = CertConfig {
            namespace: "ops".into(),
            secret: "s".into(),
            service: "wh".into(),
            configurations: vec![],
        };
        let hosts = cfg.hosts();
        assert_eq!(hosts[0], "wh.ops.svc");
        let h = hosts.join(",");
        let today: jiff::civil::Date = "2026-11-30".parse().expect("date");
        let all = ["tls.crt", "tls.key", "ca.crt", "ca.key"];
        assert!(secret_is_current(
            &secret(&all, &h, "2027-11-30"),
            &hosts,
            today
        ));
        assert!(
            !secret_is_current(&secret(&all, &h, "2026-12-20"), &hosts, today),
            "near expiry"
        );
        assert!(!secret_is_current(
            &secret(&all, "other.ops.svc", "2027-11-30"),
            &hosts,
            today
        ));
        assert!(!secret_is_current(
            &secret(&all[..3], &h, "2027-11-30"),
            &hosts,
            today
        ));
        assert!(!secret_is_current(
            &secret(&all, &h, "garbage"),
            &hosts,
            today
        ));
    }
}
