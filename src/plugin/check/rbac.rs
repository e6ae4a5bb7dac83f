//! `check`, for a workload namespace: may each ServiceAccount whose pods campaign (through the
//! injected sidecar) do to its lease what the sidecar does? The API server answers, with one
//! SubjectAccessReview per right; the verdicts are pure functions of the workloads and the
//! answers, and [`gather`] does the reads.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, StatefulSet};
use k8s_openapi::api::authorization::v1::SubjectAccessReview;
use k8s_openapi::api::core::v1::{Pod, PodSpec, PodTemplateSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, ListParams, PostParams};
use kube::{Client, ResourceExt};

use super::Finding;
use crate::api::{valid_name, INJECT_ANNOTATION, LEASE_ANNOTATION};

/// At most this many (ServiceAccount, lease) pairs are asked about, five reviews each; the
/// report says how many more there were.
pub(crate) const MAX_PAIRS: usize = 20;
/// At most this many workloads are named in a finding.
const NAMED_WORKLOADS: usize = 3;
/// The chart's broad ClusterRole for workloads (value `sidecarRole.name`, this by default).
pub(crate) const SIDECAR_CLUSTER_ROLE: &str = "fencedlease-sidecar";

/// One right on a lease: `verb` on `fencedleases`, or on its subresource when there is one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Need {
    pub verb: &'static str,
    pub subresource: Option<&'static str>,
}

impl Need {
    const fn on_lease(verb: &'static str) -> Need {
        Need {
            verb,
            subresource: None,
        }
    }

    /// "update fencedleases/status".
    pub(crate) fn label(&self) -> String {
        match self.subresource {
            Some(sub) => format!("{} fencedleases/{sub}", self.verb),
            None => format!("{} fencedleases", self.verb),
        }
    }
}

/// What the injected sidecar does to its lease (`lease::elector`): it lists and watches it by
/// name (fieldSelector `metadata.name`, which RBAC matches against resourceNames), re-reads it
/// after a conflict (get), writes its holder (update) and renews (update of the status). It
/// creates the lease only where it may (the README's Role cannot: create the lease first), and
/// writes no Events, so neither is asked for.
pub(crate) const SIDECAR_NEEDS: [Need; 5] = [
    Need::on_lease("get"),
    Need::on_lease("list"),
    Need::on_lease("watch"),
    Need::on_lease("update"),
    Need {
        verb: "update",
        subresource: Some("status"),
    },
];

/// A workload whose pods campaign: `kind/name`, their ServiceAccount, and the lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Campaigner {
    pub workload: String,
    pub service_account: String,
    pub lease: String,
}

/// The campaign of a pod (or pod template) with this metadata and spec: its lease annotation,
/// unless it opted out of injection (label or annotation `fencedlease.io/inject: "false"`, as
/// the webhook reads them), and its ServiceAccount (`default` when none is named).
fn campaigner(workload: String, meta: &ObjectMeta, spec: Option<&PodSpec>) -> Option<Campaigner> {
    let annotations = meta.annotations.as_ref()?;
    let lease = annotations.get(LEASE_ANNOTATION)?;
    let label = meta.labels.as_ref().and_then(|l| l.get(INJECT_ANNOTATION));
    if label.map(String::as_str) == Some("false")
        || annotations.get(INJECT_ANNOTATION).map(String::as_str) == Some("false")
    {
        return None;
    }
    // `serviceAccount` is the deprecated spelling the API server still copies over.
    let named = spec.and_then(|s| {
        let deprecated = s.service_account.as_deref();
        s.service_account_name.as_deref().or(deprecated)
    });
    let service_account = named.filter(|n| !n.is_empty()).unwrap_or("default");
    Some(Campaigner {
        workload,
        service_account: service_account.to_string(),
        lease: lease.clone(),
    })
}

fn from_template(kind: &str, name: &str, t: Option<&PodTemplateSpec>) -> Option<Campaigner> {
    let t = t?;
    let meta = t.metadata.as_ref()?;
    campaigner(format!("{kind}/{name}"), meta, t.spec.as_ref())
}

/// The workloads of a namespace that campaign through an injected sidecar: pods, and the pod
/// templates of Deployments, StatefulSets and DaemonSets (templates first, so that findings
/// name the workload rather than one of its pods).
pub(crate) fn campaigners(
    pods: &[Pod],
    deployments: &[Deployment],
    statefulsets: &[StatefulSet],
    daemonsets: &[DaemonSet],
) -> Vec<Campaigner> {
    let d = deployments.iter().filter_map(|d| {
        let t = d.spec.as_ref().map(|s| &s.template);
        from_template("deployment", &d.name_any(), t)
    });
    let s = statefulsets.iter().filter_map(|s| {
        let t = s.spec.as_ref().map(|s| &s.template);
        from_template("statefulset", &s.name_any(), t)
    });
    let ds = daemonsets.iter().filter_map(|d| {
        let t = d.spec.as_ref().map(|s| &s.template);
        from_template("daemonset", &d.name_any(), t)
    });
    let p = pods.iter().filter_map(|p| {
        campaigner(
            format!("pod/{}", p.name_any()),
            &p.metadata,
            p.spec.as_ref(),
        )
    });
    d.chain(s).chain(ds).chain(p).collect()
}

/// One ServiceAccount campaigning for one lease, and the workloads that do it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Pair {
    pub service_account: String,
    pub lease: String,
    pub workloads: Vec<String>,
}

/// The distinct (ServiceAccount, lease) pairs, sorted; at most `max`, and how many more there
/// were.
pub(crate) fn pairs(campaigners: Vec<Campaigner>, max: usize) -> (Vec<Pair>, usize) {
    let mut by_pair: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for c in campaigners {
        let workloads = by_pair.entry((c.service_account, c.lease)).or_default();
        if !workloads.contains(&c.workload) {
            workloads.push(c.workload);
        }
    }
    let skipped = by_pair.len().saturating_sub(max);
    let kept = by_pair.into_iter().take(max).map(|((sa, lease), w)| Pair {
        service_account: sa,
        lease,
        workloads: w,
    });
    (kept.collect(), skipped)
}

/// The review asking whether ServiceAccount `ns/sa` (with the groups the API server gives every
/// ServiceAccount) may do `need` to FencedLease `ns/lease`.
pub(crate) fn access_review(ns: &str, sa: &str, lease: &str, need: Need) -> SubjectAccessReview {
    let mut review = SubjectAccessReview::default();
    review.spec.user = Some(format!("system:serviceaccount:{ns}:{sa}"));
    review.spec.groups = Some(vec![
        "system:serviceaccounts".to_string(),
        format!("system:serviceaccounts:{ns}"),
        "system:authenticated".to_string(),
    ]);
    review.spec.resource_attributes =
        Some(k8s_openapi::api::authorization::v1::ResourceAttributes {
            namespace: Some(ns.to_string()),
            verb: Some(need.verb.to_string()),
            group: Some(crate::api::GROUP.to_string()),
            resource: Some("fencedleases".to_string()),
            subresource: need.subresource.map(str::to_string),
            name: Some(lease.to_string()),
            ..Default::default()
        });
    review
}

/// The API server's answers for one pair: each need and whether it is allowed.
pub(crate) type Answers = Result<Vec<(Need, bool)>, kube::Error>;

/// Whether the answer is the API server refusing the reviews themselves to this user.
pub(crate) fn review_forbidden(answers: &Answers) -> bool {
    matches!(answers, Err(kube::Error::Api(s)) if s.code == 403)
}

/// The verdicts on a namespace's campaigning ServiceAccounts. `answered` holds the pairs asked
/// about (in order; asking stops at the first refused review), `skipped` how many pairs were
/// not asked about.
pub(crate) fn rbac_findings(
    ns: &str,
    answered: &[(Pair, Answers)],
    skipped: usize,
) -> Vec<Finding> {
    if answered.is_empty() {
        return vec![Finding::ok(format!(
            "no pod, Deployment, StatefulSet or DaemonSet in namespace {ns} is annotated {LEASE_ANNOTATION}: no sidecar's rights to check there (pass -n NAMESPACE of a workload's namespace)"
        ))];
    }
    let mut out = Vec::new();
    for (pair, answers) in answered {
        if review_forbidden(answers) {
            out.push(reviews_forbidden(ns, pair, answers));
            return out;
        }
        out.push(pair_finding(ns, pair, answers));
    }
    if skipped > 0 {
        out.push(Finding::ok(format!(
            "{skipped} more (ServiceAccount, lease) pair(s) campaign in namespace {ns}: not checked (at most {MAX_PAIRS})"
        )));
    }
    out
}

/// "deployment/a, pod/b and 2 more".
fn workloads(pair: &Pair) -> String {
    let named = pair.workloads.iter().take(NAMED_WORKLOADS);
    let mut s = named.cloned().collect::<Vec<_>>().join(", ");
    let more = pair.workloads.len().saturating_sub(NAMED_WORKLOADS);
    if more > 0 {
        s.push_str(&format!(" and {more} more"));
    }
    s
}

fn pair_finding(ns: &str, pair: &Pair, answers: &Answers) -> Finding {
    let (sa, lease) = (&pair.service_account, &pair.lease);
    let who = format!("ServiceAccount {ns}/{sa}");
    if !valid_name(lease) {
        return Finding::fail(
            format!("{}: annotation {LEASE_ANNOTATION}={lease:?} is not a valid FencedLease name: the injection webhook refuses such pods", workloads(pair)),
            "name a FencedLease: lowercase letters, digits, '-' and '.', starting and ending with a letter or digit",
        );
    }
    let answers = match answers {
        Ok(a) => a,
        Err(e) => {
            return Finding::fail(
                format!(
                    "could not ask whether {who} may campaign for lease {lease}: {}",
                    reason(e)
                ),
                "run check again; if it persists, read the API server's log",
            )
        }
    };
    let missing: Vec<String> = SIDECAR_NEEDS
        .iter()
        .filter(|n| !answers.iter().any(|(a, allowed)| a == *n && *allowed))
        .map(Need::label)
        .collect();
    if missing.is_empty() {
        return Finding::ok(format!(
            "{who} may campaign for lease {lease} ({})",
            workloads(pair)
        ));
    }
    Finding::fail(
        format!(
            "{who} may not campaign for lease {lease} ({}): missing {}",
            workloads(pair),
            missing.join(", ")
        ),
        grant(ns, sa, lease),
    )
}

/// The README's recipe for one lease, or the chart's broad ClusterRole.
pub(crate) fn grant(ns: &str, sa: &str, lease: &str) -> String {
    format!(
        "let it campaign for this lease only: kubectl -n {ns} create role {lease}-lease --verb=get,list,watch,update \
         --resource=fencedleases.fencedlease.io,fencedleases.fencedlease.io/status --resource-name={lease} && \
         kubectl -n {ns} create rolebinding {lease}-lease-{sa} --role={lease}-lease --serviceaccount={ns}:{sa}; \
         or for every lease of the namespace, bind the chart's ClusterRole: \
         kubectl -n {ns} create rolebinding {sa}-fencedlease --clusterrole={SIDECAR_CLUSTER_ROLE} --serviceaccount={ns}:{sa}"
    )
}

fn reviews_forbidden(ns: &str, pair: &Pair, answers: &Answers) -> Finding {
    let why = match answers {
        Err(e) => reason(e),
        Ok(_) => String::new(),
    };
    let (sa, lease) = (&pair.service_account, &pair.lease);
    Finding::fail(
        format!("could not check whether the ServiceAccounts of namespace {ns} may campaign: your user may not create subjectaccessreviews.authorization.k8s.io ({why})"),
        format!("ask for create on subjectaccessreviews.authorization.k8s.io (cluster-wide; the ClusterRole system:auth-delegator grants it); \
                 or, where you may impersonate, ask by hand: kubectl -n {ns} auth can-i update fencedleases.fencedlease.io/{lease} --subresource=status --as=system:serviceaccount:{ns}:{sa}"),
    )
}

/// The API server's message, or the error (kube's Display of an API error repeats the whole
/// Status).
fn reason(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => s.message.clone(),
        e => e.to_string(),
    }
}

/// A finding for a workload list this user may not read.
pub(crate) fn unreadable(ns: &str, what: &str, e: &kube::Error) -> Finding {
    Finding::fail(
        format!("could not list {what} in namespace {ns} to find the ServiceAccounts that campaign: {}", reason(e)),
        format!("check needs list on pods, deployments, statefulsets and daemonsets there (`kubectl -n {ns} auth can-i list {what}`); or pass -n NAMESPACE"),
    )
}

async fn list<K>(client: &Client, ns: &str) -> Result<Vec<K>, kube::Error>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
    K::DynamicType: Default,
{
    let api: Api<K> = Api::namespaced(client.clone(), ns);
    Ok(api.list(&ListParams::default()).await?.items)
}

/// The campaigning workloads of `ns`; on a list this user may not read: which, and why.
async fn list_campaigners(
    client: &Client,
    ns: &str,
) -> Result<Vec<Campaigner>, (&'static str, kube::Error)> {
    let pods = list::<Pod>(client, ns).await.map_err(|e| ("pods", e))?;
    let deployments = list::<Deployment>(client, ns)
        .await
        .map_err(|e| ("deployments", e))?;
    let statefulsets = list::<StatefulSet>(client, ns)
        .await
        .map_err(|e| ("statefulsets", e))?;
    let daemonsets = list::<DaemonSet>(client, ns)
        .await
        .map_err(|e| ("daemonsets", e))?;
    Ok(campaigners(&pods, &deployments, &statefulsets, &daemonsets))
}

/// Asks the API server about each need of one pair; stops at the first error.
async fn ask(client: &Client, ns: &str, pair: &Pair) -> Answers {
    let api: Api<SubjectAccessReview> = Api::all(client.clone());
    let mut answers = Vec::with_capacity(SIDECAR_NEEDS.len());
    for need in SIDECAR_NEEDS {
        let review = access_review(ns, &pair.service_account, &pair.lease, need);
        let answered = api.create(&PostParams::default(), &review).await?;
        let allowed = answered.status.is_some_and(|s| s.allowed);
        answers.push((need, allowed));
    }
    Ok(answers)
}

/// Finds the pairs of `ns`, asks about each (at most [`MAX_PAIRS`]) and returns the findings.
pub(crate) async fn gather(client: &Client, ns: &str) -> Vec<Finding> {
    let found = match list_campaigners(client, ns).await {
        Ok(found) => found,
        Err((what, e)) => return vec![unreadable(ns, what, &e)],
    };
    let (pairs, skipped) = pairs(found, MAX_PAIRS);
    let mut answered = Vec::with_capacity(pairs.len());
    for pair in pairs {
        let answers = if valid_name(&pair.lease) {
            ask(client, ns, &pair).await
        } else {
            Ok(Vec::new())
        };
        let forbidden = review_forbidden(&answers);
        answered.push((pair, answers));
        if forbidden {
            break;
        }
    }
    rbac_findings(ns, &answered, skipped)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(name: &str, annotations: serde_json::Value, spec: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "annotations": annotations}, "spec": spec
        }))
        .unwrap()
    }

    fn template(
        annotations: serde_json::Value,
        labels: serde_json::Value,
        sa: &str,
    ) -> serde_json::Value {
        json!({"selector": {}, "template": {
            "metadata": {"annotations": annotations, "labels": labels},
            "spec": {"serviceAccountName": sa, "containers": []}}})
    }

    fn c(workload: &str, sa: &str, lease: &str) -> Campaigner {
        Campaigner {
            workload: workload.into(),
            service_account: sa.into(),
            lease: lease.into(),
        }
    }

    #[test]
    fn campaigners_are_annotated_pods_and_templates_that_did_not_opt_out() {
        let lease = json!({LEASE_ANNOTATION: "inventory"});
        let containers = json!({"containers": []});
        let pods = [
            pod("bare", lease.clone(), containers.clone()),
            pod(
                "named",
                lease.clone(),
                json!({"serviceAccountName": "inventory", "containers": []}),
            ),
            pod(
                "old-field",
                lease.clone(),
                json!({"serviceAccount": "legacy", "containers": []}),
            ),
            pod("plain", json!({}), containers.clone()),
            pod(
                "out",
                json!({LEASE_ANNOTATION: "inventory", INJECT_ANNOTATION: "false"}),
                containers,
            ),
        ];
        let d: Deployment = serde_json::from_value(json!({"metadata": {"name": "inventory"},
            "spec": template(lease.clone(), json!({}), "inventory")}))
        .unwrap();
        let off: Deployment = serde_json::from_value(json!({"metadata": {"name": "off"},
            "spec": template(lease.clone(), json!({INJECT_ANNOTATION: "false"}), "inventory")}))
        .unwrap();
        let s: StatefulSet = serde_json::from_value(json!({"metadata": {"name": "db"},
            "spec": template(json!({LEASE_ANNOTATION: "db"}), json!({}), "")}))
        .unwrap();
        let ds: DaemonSet = serde_json::from_value(json!({"metadata": {"name": "agent"},
            "spec": template(json!({}), json!({}), "agent")}))
        .unwrap();
        assert_eq!(
            campaigners(&pods, &[d, off], &[s], &[ds]),
            vec![
                c("deployment/inventory", "inventory", "inventory"),
                c("statefulset/db", "default", "db"),
                c("pod/bare", "default", "inventory"),
                c("pod/named", "inventory", "inventory"),
                c("pod/old-field", "legacy", "inventory"),
            ]
        );
    }

    #[test]
    fn pairs_are_distinct_sorted_and_bounded() {
        let found = vec![
            c("deployment/b", "sb", "lb"),
            c("pod/b-1", "sb", "lb"),
            c("deployment/a", "sa", "la"),
            c("deployment/a", "sa", "la"),
            c("pod/c", "sc", "lc"),
        ];
        let (kept, skipped) = pairs(found.clone(), 10);
        assert_eq!(skipped, 0);
        let keys: Vec<_> = kept
            .iter()
            .map(|p| (p.service_account.as_str(), p.lease.as_str()))
            .collect();
        assert_eq!(keys, [("sa", "la"), ("sb", "lb"), ("sc", "lc")]);
        assert_eq!(kept[0].workloads, ["deployment/a"]);
        assert_eq!(kept[1].workloads, ["deployment/b", "pod/b-1"]);
        let (kept, skipped) = pairs(found, 2);
        assert_eq!((kept.len(), skipped), (2, 1));
    }

    #[test]
    fn the_review_asks_as_the_service_account_about_the_named_lease() {
        let r = access_review("shop", "inventory", "stock", SIDECAR_NEEDS[4]);
        assert_eq!(
            r.spec.user.as_deref(),
            Some("system:serviceaccount:shop:inventory")
        );
        let groups = r.spec.groups.unwrap();
        assert!(groups.contains(&"system:serviceaccounts".to_string()));
        assert!(groups.contains(&"system:serviceaccounts:shop".to_string()));
        let a = r.spec.resource_attributes.unwrap();
        assert_eq!(
            (
                a.namespace.as_deref(),
                a.verb.as_deref(),
                a.group.as_deref()
            ),
            (Some("shop"), Some("update"), Some("fencedlease.io"))
        );
        assert_eq!(
            (
                a.resource.as_deref(),
                a.subresource.as_deref(),
                a.name.as_deref()
            ),
            (Some("fencedleases"), Some("status"), Some("stock"))
        );
    }

    fn pair(sa: &str, lease: &str) -> Pair {
        Pair {
            service_account: sa.into(),
            lease: lease.into(),
            workloads: vec![format!("deployment/{sa}")],
        }
    }

    /// Every need, allowed unless named in `denied` ("update fencedleases/status").
    fn answers(denied: &[&str]) -> Answers {
        Ok(SIDECAR_NEEDS
            .iter()
            .map(|n| (*n, !denied.contains(&n.label().as_str())))
            .collect())
    }

    fn api_error(code: u16, message: &str) -> Answers {
        Err(kube::Error::Api(Box::new(
            kube::core::Status::failure(message, "").with_code(code),
        )))
    }

    #[test]
    fn each_pair_is_ok_only_when_every_right_of_the_sidecar_is_allowed() {
        let all = [
            "get fencedleases",
            "list fencedleases",
            "watch fencedleases",
            "update fencedleases",
            "update fencedleases/status",
        ];
        let cases: Vec<(Answers, bool, &str)> = vec![
            (answers(&[]), true, "ServiceAccount shop/inventory may campaign for lease inventory (deployment/inventory)"),
            (answers(&["update fencedleases/status"]), false, "may not campaign for lease inventory (deployment/inventory): missing update fencedleases/status"),
            (answers(&all), false, "missing get fencedleases, list fencedleases, watch fencedleases, update fencedleases, update fencedleases/status"),
            // A need the server was not asked about is not allowed.
            (Ok(Vec::new()), false, "missing get fencedleases"),
            (api_error(500, "etcd is away"), false, "could not ask whether ServiceAccount shop/inventory may campaign"),
        ];
        for (answer, ok, says) in cases {
            let f = rbac_findings("shop", &[(pair("inventory", "inventory"), answer)], 0);
            assert_eq!(f.len(), 1, "{f:?}");
            assert_eq!(f[0].ok, ok, "{f:?}");
            assert!(f[0].what.contains(says), "{says:?} not in {f:?}");
            assert!(ok || f[0].fix.is_some(), "a failure says what to do: {f:?}");
        }
    }

    #[test]
    fn a_missing_right_says_how_to_grant_it_as_the_readme_does() {
        let f = rbac_findings(
            "shop",
            &[(
                pair("inventory", "inventory"),
                answers(&["watch fencedleases"]),
            )],
            0,
        );
        let fix = f[0].fix.as_deref().unwrap();
        for part in [
            "kubectl -n shop create role inventory-lease --verb=get,list,watch,update --resource=fencedleases.fencedlease.io,fencedleases.fencedlease.io/status --resource-name=inventory",
            "kubectl -n shop create rolebinding inventory-lease-inventory --role=inventory-lease --serviceaccount=shop:inventory",
            "--clusterrole=fencedlease-sidecar --serviceaccount=shop:inventory",
        ] {
            assert!(fix.contains(part), "{part:?} not in {fix}");
        }
    }

    #[test]
    fn refused_reviews_give_one_failure_naming_the_missing_right() {
        let answered = [
            (pair("a", "la"), api_error(403, "subjectaccessreviews.authorization.k8s.io is forbidden: User \"dev\" cannot create resource")),
            (pair("b", "lb"), api_error(403, "forbidden")),
        ];
        let f = rbac_findings("shop", &answered, 3);
        assert_eq!(f.len(), 1, "{f:?}");
        assert!(!f[0].ok);
        assert!(
            f[0].what
                .contains("may not create subjectaccessreviews.authorization.k8s.io"),
            "{f:?}"
        );
        let fix = f[0].fix.as_deref().unwrap();
        assert!(
            fix.contains("create on subjectaccessreviews.authorization.k8s.io"),
            "{fix}"
        );
        assert!(fix.contains("--as=system:serviceaccount:shop:a"), "{fix}");
    }

    #[test]
    fn no_campaigners_is_no_failure_and_skipped_pairs_are_counted() {
        let f = rbac_findings("shop", &[], 0);
        assert_eq!(f.len(), 1);
        assert!(
            f[0].ok && f[0].what.contains("no sidecar's rights to check"),
            "{f:?}"
        );
        let f = rbac_findings("shop", &[(pair("a", "la"), answers(&[]))], 7);
        assert!(f.iter().all(|f| f.ok), "{f:?}");
        assert!(
            f[1].what.contains("7 more (ServiceAccount, lease) pair(s)"),
            "{f:?}"
        );
    }

    #[test]
    fn an_unreadable_workload_list_says_which_right_is_missing() {
        let Err(e) = api_error(
            403,
            "statefulsets.apps is forbidden: User \"dev\" cannot list",
        ) else {
            unreachable!()
        };
        let f = unreadable("shop", "statefulsets", &e);
        assert!(
            !f.ok
                && f.what
                    .contains("could not list statefulsets in namespace shop"),
            "{f:?}"
        );
        assert!(
            f.what.ends_with("cannot list"),
            "the server's message, not the whole Status: {f:?}"
        );
        assert!(f
            .fix
            .unwrap()
            .contains("kubectl -n shop auth can-i list statefulsets"));
    }

    #[test]
    fn an_invalid_lease_name_fails_without_asking() {
        let f = rbac_findings("shop", &[(pair("a", "Not_A_Name"), Ok(Vec::new()))], 0);
        assert!(
            !f[0].ok && f[0].what.contains("not a valid FencedLease name"),
            "{f:?}"
        );
    }

    #[test]
    fn many_workloads_are_named_up_to_a_bound() {
        let mut p = pair("a", "la");
        p.workloads = (0..5).map(|i| format!("pod/p{i}")).collect();
        assert_eq!(workloads(&p), "pod/p0, pod/p1, pod/p2 and 2 more");
    }
}
