//! `check`, protection follows control: in the namespace (-n), protected objects whose
//! controller is not protected, and autoscalers of protected objects. Kubernetes' controllers
//! write without a token (they are exempt), so whoever may edit an unprotected controller, or
//! an autoscaler nothing judges, changes the protected object through them.

use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, ReplicaSet, StatefulSet};
use k8s_openapi::api::autoscaling::v1::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{Api, ListParams, ObjectMeta};
use kube::core::PartialObjectMeta;
use kube::Client;

use super::Finding;
use crate::api::LEASE_LABEL;

/// At most this many objects of each kind are read (the first page).
const MAX_OBJECTS: u32 = 500;

/// What the check knows of one object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Controlled {
    pub kind: String,
    pub name: String,
    /// Its [`LEASE_LABEL`], if protected.
    pub lease: Option<String>,
    /// Its controller (the owner reference with `controller: true`): kind and name.
    pub controller: Option<(String, String)>,
}

impl Controlled {
    fn of(kind: &str, meta: &ObjectMeta) -> Controlled {
        let lease = meta
            .labels
            .as_ref()
            .and_then(|l| l.get(LEASE_LABEL))
            .filter(|l| !l.is_empty())
            .cloned();
        let controller = meta
            .owner_references
            .iter()
            .flatten()
            .find(|o| o.controller == Some(true))
            .map(|o| (o.kind.clone(), o.name.clone()));
        Controlled {
            kind: kind.to_string(),
            name: meta.name.clone().unwrap_or_default(),
            lease,
            controller,
        }
    }
}

/// An autoscaler and the object it scales (kind, name).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Autoscaler {
    pub name: String,
    pub target: (String, String),
}

/// The findings, from what was read: `objects` of every kind read (protected or not),
/// `autoscalers`, and whether a fencing webhook judges autoscalers' writes (policy mode alone
/// does not: a policy sees the written object and its lease, never a third object).
pub(crate) fn findings(
    ns: &str,
    objects: &[Controlled],
    autoscalers: &[Autoscaler],
    webhook_follows: bool,
) -> Vec<Finding> {
    let find = |kind: &str, name: &str| objects.iter().find(|o| o.kind == kind && o.name == name);
    let mut out = Vec::new();
    for o in objects {
        let (Some(lease), Some((ck, cn))) = (&o.lease, &o.controller) else {
            continue;
        };
        let Some(c) = find(ck, cn) else { continue };
        if c.lease.as_ref() != Some(lease) {
            out.push(Finding::fail(
                format!("{} {ns}/{} is protected by FencedLease {lease}, but its controller {ck} {ns}/{cn} is not: whoever may edit the {ck} changes the {} through Kubernetes' exempt controller", o.kind, o.name, o.kind),
                format!("protect the {ck} too: label it {LEASE_LABEL}={lease} in a fenced write, or give the writers no rights on it"),
            ));
        }
    }
    for a in autoscalers {
        let (tk, tn) = &a.target;
        let Some(lease) = find(tk, tn).and_then(|t| t.lease.as_ref()) else {
            continue;
        };
        let what = format!("HorizontalPodAutoscaler {ns}/{} scales {tk} {ns}/{tn}, protected by FencedLease {lease}", a.name);
        out.push(if webhook_follows {
            Finding::ok(format!("{what}: the fencing webhook judges its writes by that lease"))
        } else {
            Finding::fail(
                format!("{what}, and nothing judges the autoscaler's writes (policy mode cannot read its target)"),
                "give the writers no rights on the autoscaler, or judge with the webhook too (fencing.mode: both)",
            )
        });
    }
    if out.is_empty() {
        out.push(Finding::ok(format!(
            "no protected object in namespace {ns} has an unprotected controller or an autoscaler"
        )));
    }
    out
}

/// Whether some fencing webhook configuration judges autoscalers' writes.
pub(crate) fn webhook_follows(vwc: &[ValidatingWebhookConfiguration]) -> bool {
    vwc.iter()
        .flat_map(|c| c.webhooks.iter().flatten())
        .flat_map(|w| w.rules.iter().flatten())
        .any(|r| {
            r.resources
                .iter()
                .flatten()
                .any(|res| res == "horizontalpodautoscalers")
        })
}

async fn metas<K>(client: &Client, ns: &str, kind: &str) -> Result<Vec<Controlled>, String>
where
    K: kube::Resource<Scope = kube::core::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
    K::DynamicType: Default,
{
    let api: Api<K> = Api::namespaced(client.clone(), ns);
    let list = api
        .list_metadata(&ListParams::default().limit(MAX_OBJECTS))
        .await
        .map_err(|e| format!("listing {kind}s in {ns}: {e}"))?;
    Ok(list
        .items
        .iter()
        .map(|o: &PartialObjectMeta<K>| Controlled::of(kind, &o.metadata))
        .collect())
}

async fn read_all(client: &Client, ns: &str) -> Result<(Vec<Controlled>, Vec<Autoscaler>), String> {
    let mut objects = metas::<Deployment>(client, ns, "Deployment").await?;
    objects.extend(metas::<StatefulSet>(client, ns, "StatefulSet").await?);
    objects.extend(metas::<ReplicaSet>(client, ns, "ReplicaSet").await?);
    objects.extend(metas::<DaemonSet>(client, ns, "DaemonSet").await?);
    objects.extend(metas::<Pod>(client, ns, "Pod").await?);
    objects.extend(metas::<ConfigMap>(client, ns, "ConfigMap").await?);
    let hpas: Api<HorizontalPodAutoscaler> = Api::namespaced(client.clone(), ns);
    let hpas = hpas
        .list(&ListParams::default().limit(MAX_OBJECTS))
        .await
        .map_err(|e| format!("listing HorizontalPodAutoscalers in {ns}: {e}"))?;
    let autoscalers = hpas
        .items
        .iter()
        .filter_map(|h| {
            let t = &h.spec.as_ref()?.scale_target_ref;
            Some(Autoscaler {
                name: h.metadata.name.clone()?,
                target: (t.kind.clone(), t.name.clone()),
            })
        })
        .collect();
    Ok((objects, autoscalers))
}

/// Reads the namespace's controllers, controlled objects and autoscalers; the findings.
pub(crate) async fn gather(
    client: &Client,
    ns: &str,
    vwc: &[ValidatingWebhookConfiguration],
) -> Vec<Finding> {
    match read_all(client, ns).await {
        Ok((objects, autoscalers)) => findings(ns, &objects, &autoscalers, webhook_follows(vwc)),
        Err(e) => vec![Finding::fail(
            format!("cannot tell whether protection follows control in namespace {ns}: {e}"),
            "run check as a user who may list Deployments, StatefulSets, ReplicaSets, DaemonSets, Pods, ConfigMaps and HorizontalPodAutoscalers there",
        )],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(kind: &str, name: &str, lease: Option<&str>, ctl: Option<(&str, &str)>) -> Controlled {
        Controlled {
            kind: kind.into(),
            name: name.into(),
            lease: lease.map(str::to_string),
            controller: ctl.map(|(k, n)| (k.to_string(), n.to_string())),
        }
    }

    #[test]
    fn protection_must_follow_control_up_the_owner_chain_and_to_autoscalers() {
        let objects = [
            // A protected Deployment whose ReplicaSet is protected by the same lease: fine.
            obj("Deployment", "web", Some("inv"), None),
            obj(
                "ReplicaSet",
                "web-1",
                Some("inv"),
                Some(("Deployment", "web")),
            ),
            // A protected ReplicaSet of an unprotected Deployment, and one of another lease's.
            obj("Deployment", "api", None, None),
            obj(
                "ReplicaSet",
                "api-1",
                Some("inv"),
                Some(("Deployment", "api")),
            ),
            obj("Deployment", "db", Some("other"), None),
            obj(
                "ConfigMap",
                "db-conf",
                Some("inv"),
                Some(("Deployment", "db")),
            ),
            // A controller the check did not read (a custom resource): not judged.
            obj("ConfigMap", "x", Some("inv"), Some(("Widget", "w"))),
            // Unprotected objects are nobody's business.
            obj("Pod", "api-1-abc", None, Some(("ReplicaSet", "api-1"))),
        ];
        let hpas = [
            Autoscaler {
                name: "web".into(),
                target: ("Deployment".into(), "web".into()),
            },
            Autoscaler {
                name: "api".into(),
                target: ("Deployment".into(), "api".into()),
            },
        ];
        let f = findings("shop", &objects, &hpas, true);
        let failed: Vec<&str> = f
            .iter()
            .filter(|f| !f.ok)
            .map(|f| f.what.as_str())
            .collect();
        assert_eq!(failed.len(), 2, "{failed:#?}");
        assert!(failed[0].starts_with("ReplicaSet shop/api-1 is protected by FencedLease inv, but its controller Deployment shop/api is not"), "{}", failed[0]);
        assert!(
            failed[1].starts_with("ConfigMap shop/db-conf"),
            "{}",
            failed[1]
        );
        assert!(f.iter().any(|f| f.ok
            && f.what
                .contains("HorizontalPodAutoscaler shop/web scales Deployment shop/web")));
        // Policy mode alone: the autoscaler of a protected object is a finding.
        let f = findings("shop", &objects[..2], &hpas, false);
        assert!(
            f.iter()
                .any(|f| !f.ok && f.what.contains("nothing judges the autoscaler's writes")),
            "{f:#?}"
        );
        // Nothing to say: one line that says so.
        let f = findings("shop", &objects[2..3], &[], false);
        assert!(f.len() == 1 && f[0].ok, "{f:#?}");
    }
}
