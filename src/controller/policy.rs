//! Policy mode (`controller --fencing-policy`): the fencing rule as a ValidatingAdmissionPolicy
//! that the API server evaluates itself, with the protected object's FencedLease as its
//! parameter. The policy and its one binding are the chart's, `templates/fencing-policy.yaml`:
//! the binding's parameters are every FencedLease of the written object's namespace, and the
//! policy judges only the lease the object's label names. So the controller is not on the
//! fencing path: it checks at start that the policy and its binding exist, and while active
//! removes the one-binding-per-lease layout of releases up to 0.2.0 and reports whether the
//! binding is still as the chart renders it ([`binding_problem`]).

use anyhow::{bail, Context as _};
use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use kube::api::{DeleteParams, ListParams};
use kube::{Api, Client};
use tracing::info;

use crate::api::POLICY_LABEL;

/// The API the mode needs (GA in Kubernetes 1.30).
pub const POLICY_API: &str = "admissionregistration.k8s.io/v1";

/// A short, stable digest of the policy name (FNV-1a, 32 bits, hex). Releases up to 0.2.0
/// labelled their per-lease bindings `fencedlease.io/policy: <hash>`; it finds them.
pub fn policy_hash(policy: &str) -> String {
    let mut h: u32 = 0x811c_9dc5;
    for b in policy.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    format!("{h:08x}")
}

/// Whether `b` is a per-lease binding of `policy` as releases up to 0.2.0 made them: labelled
/// with the policy's hash, binding that policy, with a parameter named (not selected). The
/// chart's own binding selects its parameters, so it is never one.
pub(super) fn is_legacy_binding(policy: &str, b: &ValidatingAdmissionPolicyBinding) -> bool {
    let labelled = b
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(POLICY_LABEL))
        .is_some_and(|h| *h == policy_hash(policy));
    let spec = b.spec.as_ref();
    let binds = spec.and_then(|s| s.policy_name.as_deref()) == Some(policy);
    let named = spec
        .and_then(|s| s.param_ref.as_ref())
        .is_some_and(|p| p.name.is_some() && p.selector.is_none());
    labelled && binds && named
}

/// What is wrong with the chart's binding of `policy` (named as the policy), if anything: it
/// must exist, bind that policy with Deny, and take every FencedLease of the written object's
/// namespace as a parameter (no paramRef name or namespace, an empty selector, Allow when there
/// is none), without narrowing what the policy matches. Any change can leave leases unfenced.
pub(super) fn binding_problem(
    policy: &str,
    b: Option<&ValidatingAdmissionPolicyBinding>,
) -> Option<String> {
    let Some(b) = b else {
        return Some("it does not exist".into());
    };
    let Some(spec) = b.spec.as_ref() else {
        return Some("it has no spec".into());
    };
    if spec.policy_name.as_deref() != Some(policy) {
        return Some(format!("it binds {:?}, not {policy:?}", spec.policy_name));
    }
    if !spec
        .validation_actions
        .iter()
        .flatten()
        .any(|a| a == "Deny")
    {
        return Some(format!(
            "its validationActions are {:?}, without Deny: refusals are not enforced",
            spec.validation_actions
        ));
    }
    if spec.match_resources.is_some() {
        return Some("it has matchResources, which narrow what the policy judges".into());
    }
    let Some(p) = spec.param_ref.as_ref() else {
        return Some("it has no paramRef".into());
    };
    let empty = |s: &k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector| {
        s.match_labels.as_ref().is_none_or(|m| m.is_empty())
            && s.match_expressions.as_ref().is_none_or(|e| e.is_empty())
    };
    if p.name.is_some() || p.namespace.is_some() || !p.selector.as_ref().is_some_and(empty) {
        return Some(
            "its paramRef does not select every FencedLease of the written object's namespace"
                .into(),
        );
    }
    None
}

/// The chart's other two policies of policy mode, named after the fencing policy: the lease
/// index policy (src/controller/index/mod.rs) and the index's guard.
pub(crate) fn index_policies(policy: &str) -> [String; 2] {
    [format!("{policy}-index"), format!("{policy}-index-guard")]
}

/// What is wrong with the chart's binding `name` of the policy of the same name, which takes no
/// parameter: it must exist, bind that policy with Deny, and not narrow what it matches.
pub(super) fn plain_binding_problem(
    name: &str,
    b: Option<&ValidatingAdmissionPolicyBinding>,
) -> Option<String> {
    let Some(spec) = b.and_then(|b| b.spec.as_ref()) else {
        return Some(format!("binding {name} does not exist"));
    };
    let deny = spec
        .validation_actions
        .iter()
        .flatten()
        .any(|a| a == "Deny");
    if spec.policy_name.as_deref() != Some(name) || !deny || spec.match_resources.is_some() {
        return Some(format!(
            "binding {name} is not as the chart renders it (policy {name}, validationActions Deny, no matchResources)"
        ));
    }
    None
}

/// [`binding_problem`] of the bindings as the API server has them now: the fencing binding,
/// then the index policy's and the guard's ([`plain_binding_problem`]).
pub(crate) async fn binding_problem_now(
    client: &Client,
    policy: &str,
) -> Result<Option<String>, kube::Error> {
    let api: Api<ValidatingAdmissionPolicyBinding> = Api::all(client.clone());
    if let Some(p) = binding_problem(policy, api.get_opt(policy).await?.as_ref()) {
        return Ok(Some(p));
    }
    for name in index_policies(policy) {
        if let Some(p) = plain_binding_problem(&name, api.get_opt(&name).await?.as_ref()) {
            return Ok(Some(p));
        }
    }
    Ok(None)
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

/// Refuses to run policy mode where it cannot work: the server must serve
/// admissionregistration.k8s.io/v1 ValidatingAdmissionPolicy (Kubernetes 1.30 and later), and
/// the policy and its binding (of the same name, the chart's) must exist.
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
        Ok(Some(_)) => {}
        Ok(None) => bail!(
            "--fencing-policy {policy}: no ValidatingAdmissionPolicy of that name exists, so nothing judges protected writes; install it (the chart's fencing.mode: policy or both renders it) or name the right one"
        ),
        Err(e) => {
            return Err(e).with_context(|| {
                format!("reading ValidatingAdmissionPolicy {policy} (the controller needs get on it)")
            })
        }
    }
    let bindings: Api<ValidatingAdmissionPolicyBinding> = Api::all(client.clone());
    match bindings.get_opt(policy).await {
        Ok(Some(_)) => Ok(()),
        Ok(None) => bail!(
            "--fencing-policy {policy}: the policy has no ValidatingAdmissionPolicyBinding named {policy}, and a policy without a binding checks nothing; install the chart's (fencing.mode: policy or both renders it beside the policy)"
        ),
        Err(e) => Err(e).with_context(|| {
            format!("reading ValidatingAdmissionPolicyBinding {policy} (the controller needs get on it)")
        }),
    }
}

/// Deletes the per-lease bindings of `policy` that releases up to 0.2.0 kept (see
/// [`is_legacy_binding`]). For a lease that exists they judged what the chart's binding judges,
/// by the same policy. One difference goes with them: a write naming a lease that does not
/// exist (or not yet, in the API server's view) but still has its 0.2.0 binding was refused
/// (its parameter missing, Deny); with the chart's binding alone it is not checked (the book,
/// policy-mode.md). Returns how many it deleted.
pub(crate) async fn remove_legacy_bindings(
    client: &Client,
    policy: &str,
) -> Result<usize, kube::Error> {
    let api: Api<ValidatingAdmissionPolicyBinding> = Api::all(client.clone());
    let lp = ListParams::default().labels(&format!("{POLICY_LABEL}={}", policy_hash(policy)));
    let mut deleted = 0;
    for b in api.list(&lp).await?.items {
        if !is_legacy_binding(policy, &b) {
            continue;
        }
        let name = b.metadata.name.unwrap_or_default();
        match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => deleted += 1,
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    if deleted > 0 {
        info!(deleted, policy, "removed the per-lease fencing bindings of an earlier release: the chart's one binding judges every lease");
    }
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn binding(v: serde_json::Value) -> ValidatingAdmissionPolicyBinding {
        serde_json::from_value(v).expect("a binding")
    }

    #[test]
    fn only_the_per_lease_bindings_of_the_same_policy_are_legacy() {
        let h = policy_hash("fl-fencing");
        let legacy = |labels: serde_json::Value, policy: &str, param: serde_json::Value| {
            binding(serde_json::json!({
                "metadata": {"name": "b", "labels": labels},
                "spec": {"policyName": policy, "paramRef": param, "validationActions": ["Deny"]},
            }))
        };
        let named = serde_json::json!({"name": "inventory", "namespace": "shop", "parameterNotFoundAction": "Deny"});
        let ours = serde_json::json!({"fencedlease.io/policy": h});
        assert!(is_legacy_binding(
            "fl-fencing",
            &legacy(ours.clone(), "fl-fencing", named.clone())
        ));
        // The chart's binding selects its parameters.
        let selected = serde_json::json!({"selector": {}, "parameterNotFoundAction": "Allow"});
        assert!(!is_legacy_binding(
            "fl-fencing",
            &legacy(ours.clone(), "fl-fencing", selected)
        ));
        // Another release's policy, or no label: not ours to delete.
        assert!(!is_legacy_binding(
            "fl-fencing",
            &legacy(ours, "other", named.clone())
        ));
        assert!(!is_legacy_binding(
            "fl-fencing",
            &legacy(serde_json::json!({}), "fl-fencing", named.clone())
        ));
        let theirs = serde_json::json!({"fencedlease.io/policy": policy_hash("other")});
        assert!(!is_legacy_binding(
            "fl-fencing",
            &legacy(theirs, "fl-fencing", named)
        ));
    }

    #[test]
    fn the_chart_binding_is_intact_only_as_the_chart_renders_it() {
        let chart = || {
            serde_json::json!({
                "metadata": {"name": "p"},
                "spec": {"policyName": "p", "validationActions": ["Deny"],
                         "paramRef": {"selector": {}, "parameterNotFoundAction": "Allow"}},
            })
        };
        assert_eq!(binding_problem("p", Some(&binding(chart()))), None);
        assert!(binding_problem("p", None).is_some_and(|m| m.contains("does not exist")));
        let changed = |f: &dyn Fn(&mut serde_json::Value)| {
            let mut v = chart();
            f(&mut v);
            binding_problem("p", Some(&binding(v))).expect("a problem")
        };
        let audit = changed(&|v| v["spec"]["validationActions"] = serde_json::json!(["Audit"]));
        assert!(audit.contains("without Deny"), "{audit}");
        let narrowed = changed(&|v| {
            v["spec"]["matchResources"] =
                serde_json::json!({"namespaceSelector": {"matchLabels": {"a": "b"}}})
        });
        assert!(narrowed.contains("matchResources"), "{narrowed}");
        for param in [
            serde_json::json!({"selector": {"matchLabels": {"a": "b"}}, "parameterNotFoundAction": "Allow"}),
            serde_json::json!({"name": "inventory", "parameterNotFoundAction": "Deny"}),
            serde_json::json!({"selector": {}, "namespace": "shop", "parameterNotFoundAction": "Allow"}),
        ] {
            let m = changed(&|v| v["spec"]["paramRef"] = param.clone());
            assert!(m.contains("paramRef"), "{param}: {m}");
        }
        let other = changed(&|v| v["spec"]["policyName"] = serde_json::json!("q"));
        assert!(other.contains("binds"), "{other}");
    }

    #[test]
    fn the_index_bindings_are_intact_only_as_the_chart_renders_them() {
        let [index, guard] = index_policies("rel-fencing");
        assert_eq!(
            (index.as_str(), guard.as_str()),
            ("rel-fencing-index", "rel-fencing-index-guard")
        );
        let good = serde_json::json!({"metadata": {"name": index},
            "spec": {"policyName": index, "validationActions": ["Deny"]}});
        assert_eq!(
            plain_binding_problem(&index, Some(&binding(good.clone()))),
            None
        );
        assert!(plain_binding_problem(&index, None).is_some_and(|m| m.contains("does not exist")));
        let mut audit = good.clone();
        audit["spec"]["validationActions"] = serde_json::json!(["Audit"]);
        let mut other = good.clone();
        other["spec"]["policyName"] = serde_json::json!(guard);
        let mut narrowed = good;
        narrowed["spec"]["matchResources"] = serde_json::json!({"namespaceSelector": {}});
        for bad in [audit, other, narrowed] {
            let m = plain_binding_problem(&index, Some(&binding(bad.clone())));
            assert!(
                m.is_some_and(|m| m.contains("not as the chart renders it")),
                "{bad}"
            );
        }
    }

    #[test]
    fn names_and_hashes_are_stable() {
        // Stable across builds and releases (FNV-1a, 32 bits): 0.2.0's labels are found.
        assert_eq!(policy_hash(""), "811c9dc5");
        assert_eq!(policy_hash("a"), "e40c292c");
        assert!(check_policy_name("fencedlease-fencing").is_ok());
        for bad in ["", "a.b", "-a", "A", &"x".repeat(64)] {
            assert!(check_policy_name(bad).is_err(), "{bad:?}");
        }
    }
}
