//! Policy mode (`controller --fencing-policy`): the fencing rule as a ValidatingAdmissionPolicy
//! that the API server evaluates itself, with the protected object's FencedLease as its
//! parameter. The policy (its CEL text) is the chart's, `templates/fencing-policy.yaml`; here is
//! what the controller keeps for it: one ValidatingAdmissionPolicyBinding per FencedLease that
//! selects the objects labelled for that lease in its namespace and names the lease as the
//! parameter. Bindings are cluster-scoped, so no FencedLease can own one: the controller removes
//! the bindings of deleted leases itself, in a sweep.

use std::collections::{BTreeMap, HashSet};
use std::sync::Mutex;

use anyhow::{bail, Context as _};
use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::{Api, Client};
use tracing::{info, warn};

use crate::api::{FencedLease, LEASE_LABEL, POLICY_LABEL};

/// Label on the bindings the controller keeps; its value is [`policy_hash`] of the policy the
/// binding names, so that a controller lists only its own policy's bindings.
/// The label the API server puts on every Namespace, its name (Kubernetes 1.21 and later).
pub(super) const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";
/// The API the mode needs (GA in Kubernetes 1.30).
pub const POLICY_API: &str = "admissionregistration.k8s.io/v1";

/// A short, stable digest of the policy name (FNV-1a, 32 bits, hex): it tells the bindings of
/// two releases' policies apart in names and labels. Not a security boundary: the binding's
/// `spec.policyName` says which policy it binds.
pub fn policy_hash(policy: &str) -> String {
    let mut h: u32 = 0x811c_9dc5;
    for b in policy.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    format!("{h:08x}")
}

/// The name of the binding of `policy` for lease `ns/lease`: `<ns>.<lease>.fencedlease-<hash>`.
/// One name per (namespace, lease) of a policy: a namespace name has no dots and the suffix has
/// a fixed length, so the parts can be read back unambiguously. At most 63 + 1 + 63 + 21 = 148
/// characters (bindings are made only for lease names that fit a label value).
pub(super) fn binding_name(policy: &str, ns: &str, lease: &str) -> String {
    format!("{ns}.{lease}.fencedlease-{}", policy_hash(policy))
}

/// Whether `v` can be a label value: a protected object names its lease in a label, so a lease
/// whose name cannot be one protects nothing, and gets no binding.
pub(super) fn is_label_value(v: &str) -> bool {
    let b = v.as_bytes();
    let alnum = |c: &u8| c.is_ascii_alphanumeric();
    b.len() <= 63
        && (b.is_empty()
            || (alnum(&b[0])
                && alnum(&b[b.len() - 1])
                && b.iter()
                    .all(|c| alnum(c) || matches!(c, b'-' | b'_' | b'.'))))
}

/// The policy name must be a DNS label (what the chart renders): at most 63 lowercase letters,
/// digits and '-', starting and ending with a letter or digit.
pub(super) fn check_policy_name(name: &str) -> Result<(), String> {
    let b = name.as_bytes();
    let ok = !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-';
    if ok {
        Ok(())
    } else {
        Err(format!(
            "--fencing-policy {name:?}: a ValidatingAdmissionPolicy name of at most 63 lowercase letters, digits and '-' (a DNS label), as the chart renders it"
        ))
    }
}

/// The binding that makes `policy` judge the writes to objects labelled `fencedlease.io/lease:
/// <lease>` in namespace `ns`, with that FencedLease as the parameter. Refuses (Deny) when the
/// lease cannot be found. None for a lease name that cannot be a label value.
pub(super) fn binding_for(
    policy: &str,
    ns: &str,
    lease: &str,
) -> Option<ValidatingAdmissionPolicyBinding> {
    if lease.is_empty() || !is_label_value(lease) {
        return None;
    }
    let b = serde_json::json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {
            "name": binding_name(policy, ns, lease),
            "labels": {
                POLICY_LABEL: policy_hash(policy),
                "app.kubernetes.io/managed-by": crate::api::FIELD_MANAGER,
            },
        },
        "spec": {
            "policyName": policy,
            "paramRef": {"name": lease, "namespace": ns, "parameterNotFoundAction": "Deny"},
            // matchPolicy as the API server defaults it, so that a stored binding equals this.
            "matchResources": {
                "matchPolicy": "Equivalent",
                "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: ns}},
                "objectSelector": {"matchLabels": {LEASE_LABEL: lease}},
            },
            "validationActions": ["Deny"],
        },
    });
    Some(serde_json::from_value(b).expect("a binding literal"))
}

/// The (namespace, lease) a binding's parameter names.
fn param_of(b: &ValidatingAdmissionPolicyBinding) -> Option<(String, String)> {
    let p = b.spec.as_ref()?.param_ref.as_ref()?;
    Some((p.namespace.clone()?, p.name.clone()?))
}

/// What a sweep must do: the bindings to delete (their lease is gone, or they are not the one
/// binding_for would make for it) and the leases whose binding to (re)apply. Pure.
pub(super) fn plan_sweep(
    policy: &str,
    leases: &[(String, String)],
    existing: &[ValidatingAdmissionPolicyBinding],
) -> (Vec<String>, Vec<(String, String)>) {
    let mut want: BTreeMap<String, (String, String)> = BTreeMap::new();
    for (ns, name) in leases {
        if let Some(b) = binding_for(policy, ns, name) {
            want.insert(
                b.metadata.name.clone().unwrap_or_default(),
                (ns.clone(), name.clone()),
            );
        }
    }
    let mut delete = Vec::new();
    let mut present = HashSet::new();
    for b in existing {
        let name = b.metadata.name.clone().unwrap_or_default();
        let same = param_of(b)
            .and_then(|(ns, l)| binding_for(policy, &ns, &l))
            .is_some_and(|d| d.metadata.name == b.metadata.name && d.spec == b.spec);
        match want.get(&name) {
            Some(_) if same => {
                present.insert(name);
            }
            // Ours, but changed by someone: applied again below.
            Some(_) => {}
            None => delete.push(name),
        }
    }
    let apply = want
        .into_iter()
        .filter(|(name, _)| !present.contains(name))
        .map(|(_, lease)| lease)
        .collect();
    (delete, apply)
}

/// Refuses to run policy mode where it cannot work: the server must serve
/// admissionregistration.k8s.io/v1 ValidatingAdmissionPolicy (Kubernetes 1.30 and later), and
/// the policy must exist (a binding of a missing policy checks nothing).
pub(super) async fn require_policy(client: &Client, policy: &str) -> anyhow::Result<()> {
    check_policy_name(policy).map_err(anyhow::Error::msg)?;
    let version = client
        .apiserver_version()
        .await
        .map(|v| v.git_version)
        .unwrap_or_else(|e| format!("unknown version: {e}"));
    let served = match client.list_api_group_resources(POLICY_API).await {
        Ok(list) => {
            let has = |n: &str| list.resources.iter().any(|r| r.name == n);
            has("validatingadmissionpolicies") && has("validatingadmissionpolicybindings")
        }
        Err(kube::Error::Api(s)) if s.code == 404 => false,
        Err(e) => return Err(e).context("asking the API server which admission APIs it serves"),
    };
    if !served {
        bail!(
            "--fencing-policy needs {POLICY_API} ValidatingAdmissionPolicy, which this API server ({version}) does not serve: it is GA from Kubernetes 1.30. Run without --fencing-policy (the chart's fencing.mode: webhook) on this cluster, or upgrade it"
        );
    }
    let policies: Api<ValidatingAdmissionPolicy> = Api::all(client.clone());
    match policies.get_opt(policy).await {
        Ok(Some(_)) => Ok(()),
        Ok(None) => bail!(
            "--fencing-policy {policy}: no ValidatingAdmissionPolicy of that name exists, and bindings of a missing policy check nothing; install it (the chart's fencing.mode: policy or both renders it) or name the right one"
        ),
        Err(e) => Err(e).with_context(|| {
            format!("reading ValidatingAdmissionPolicy {policy} (the controller needs get on it)")
        }),
    }
}

/// The bindings of one policy, kept by the active controller.
pub(crate) struct Bindings {
    api: Api<ValidatingAdmissionPolicyBinding>,
    policy: String,
    /// Only leases of this namespace (the controller's --namespace), if set.
    namespace: Option<String>,
    /// Names applied since the last sweep: a reconcile applies only what is not here.
    applied: Mutex<HashSet<String>>,
}

impl Bindings {
    pub(crate) fn new(client: Client, policy: String, namespace: Option<String>) -> Bindings {
        Bindings {
            api: Api::all(client),
            policy,
            namespace,
            applied: Mutex::new(HashSet::new()),
        }
    }

    fn applied(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.applied.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes sure the binding of lease `ns/name` exists (once per controller term, and again
    /// after each sweep that found it missing or changed).
    pub(crate) async fn ensure(&self, ns: &str, name: &str) -> Result<(), kube::Error> {
        let Some(b) = binding_for(&self.policy, ns, name) else {
            return Ok(());
        };
        let bname = b.metadata.name.clone().unwrap_or_default();
        if self.applied().contains(&bname) {
            return Ok(());
        }
        let pp = PatchParams::apply(crate::api::FIELD_MANAGER).force();
        self.api.patch(&bname, &pp, &Patch::Apply(&b)).await?;
        info!(binding = %bname, lease = %format!("{ns}/{name}"), "the fencing policy now judges this lease's objects");
        self.applied().insert(bname);
        Ok(())
    }

    /// Brings the bindings in line with the FencedLeases that exist (in the controller's
    /// namespace, if it has one): deletes those of leases that are gone, applies missing or
    /// changed ones. Lists the bindings first, then the leases (names only, from the API server,
    /// not a cache): a lease created in between has no binding in the first list, so no
    /// binding of a live lease is ever deleted.
    pub(crate) async fn sweep(&self) -> Result<(), kube::Error> {
        let lp =
            ListParams::default().labels(&format!("{POLICY_LABEL}={}", policy_hash(&self.policy)));
        let existing: Vec<_> = self
            .api
            .list(&lp)
            .await?
            .items
            .into_iter()
            .filter(|b| {
                b.spec
                    .as_ref()
                    .is_some_and(|s| s.policy_name.as_deref() == Some(self.policy.as_str()))
            })
            .filter(|b| match (&self.namespace, param_of(b)) {
                (Some(ns), Some((bns, _))) => *ns == bns,
                (Some(_), None) => false,
                (None, _) => true,
            })
            .collect();
        let leases: Api<FencedLease> = match &self.namespace {
            Some(ns) => Api::namespaced(self.api.clone().into_client(), ns),
            None => Api::all(self.api.clone().into_client()),
        };
        let leases: Vec<(String, String)> = leases
            .list_metadata(&ListParams::default())
            .await?
            .items
            .into_iter()
            .filter_map(|l| Some((l.metadata.namespace?, l.metadata.name?)))
            .collect();
        let leases = &leases[..];
        let (delete, apply) = plan_sweep(&self.policy, leases, &existing);
        tracing::debug!(
            leases = leases.len(),
            bindings = existing.len(),
            ?delete,
            ?apply,
            "swept the fencing bindings"
        );
        for name in delete {
            self.applied().remove(&name);
            match self.api.delete(&name, &DeleteParams::default()).await {
                Ok(_) => {
                    info!(binding = %name, "removed the fencing binding of a deleted FencedLease")
                }
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(e),
            }
        }
        for (ns, name) in apply {
            if let Some(b) = binding_for(&self.policy, &ns, &name) {
                self.applied()
                    .remove(b.metadata.name.as_deref().unwrap_or_default());
            }
            if let Err(e) = self.ensure(&ns, &name).await {
                warn!(lease = %format!("{ns}/{name}"), error = %e, "could not apply the fencing binding");
                return Err(e);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_binding_selects_the_leases_objects_in_its_namespace_and_names_the_lease() {
        let b = binding_for("fl-fencing", "shop", "inventory").expect("a binding");
        let v = serde_json::to_value(&b).expect("json");
        let h = policy_hash("fl-fencing");
        assert_eq!(
            v,
            serde_json::json!({
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingAdmissionPolicyBinding",
                "metadata": {
                    "name": format!("shop.inventory.fencedlease-{h}"),
                    "labels": {"fencedlease.io/policy": h, "app.kubernetes.io/managed-by": "fencedlease-controller"},
                },
                "spec": {
                    "policyName": "fl-fencing",
                    "paramRef": {"name": "inventory", "namespace": "shop", "parameterNotFoundAction": "Deny"},
                    "matchResources": {
                        "matchPolicy": "Equivalent",
                        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "shop"}},
                        "objectSelector": {"matchLabels": {"fencedlease.io/lease": "inventory"}},
                    },
                    "validationActions": ["Deny"],
                },
            })
        );
    }

    #[test]
    fn names_are_bounded_distinct_and_stable() {
        let long_ns = "n".repeat(63);
        let long_lease = format!("{}.{}", "a".repeat(31), "b".repeat(31));
        let name = binding_name("p", &long_ns, &long_lease);
        assert!(name.len() <= 148 && name.len() <= 253, "{}", name.len());
        // A dash in the namespace or the lease cannot make two leases share a name.
        assert_ne!(binding_name("p", "a-b", "c"), binding_name("p", "a", "b-c"));
        // A namespace has no dots: the first dot ends it, whatever dots the lease has.
        let name = binding_name("p", "a", "b.c");
        assert_eq!(
            name.split_once('.'),
            Some(("a", "b.c.fencedlease-f50c43ef"))
        );
        // Two policies: two bindings.
        assert_ne!(binding_name("p", "a", "b"), binding_name("q", "a", "b"));
        // Stable across builds and releases (FNV-1a, 32 bits).
        assert_eq!(policy_hash(""), "811c9dc5");
        assert_eq!(policy_hash("a"), "e40c292c");
        // No binding for a name that no label can carry.
        assert!(binding_for("p", "a", &"x".repeat(64)).is_none());
        assert!(binding_for("p", "a", "").is_none());
        assert!(binding_for("p", "a", &"x".repeat(63)).is_some());
        assert!(check_policy_name("fencedlease-fencing").is_ok());
        for bad in ["", "a.b", "-a", "A", &"x".repeat(64)] {
            assert!(check_policy_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_sweep_removes_the_bindings_of_gone_leases_and_restores_changed_ones() {
        let lease = |ns: &str, n: &str| (ns.to_string(), n.to_string());
        let kept = binding_for("p", "a", "kept").expect("binding");
        let gone = binding_for("p", "a", "gone").expect("binding");
        let mut changed = binding_for("p", "a", "changed").expect("binding");
        changed.spec.as_mut().expect("spec").validation_actions = Some(vec!["Warn".into()]);
        let leases = [lease("a", "kept"), lease("a", "changed"), lease("a", "new")];
        let (delete, apply) = plan_sweep("p", &leases, &[kept, gone, changed]);
        assert_eq!(delete, vec![binding_name("p", "a", "gone")]);
        assert_eq!(apply, vec![lease("a", "changed"), lease("a", "new")]);
    }
}
