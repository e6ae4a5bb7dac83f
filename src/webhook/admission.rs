//! AdmissionReview handling for the fencing webhook: parse, decide, answer. Every input gets
//! an AdmissionReview back; nothing here panics.

use std::collections::BTreeMap;

use kube::core::admission::{AdmissionResponse, AdmissionReview, Operation};
use kube::core::{DynamicObject, Status, TypeMeta};
use serde::Deserialize;

use crate::api::{
    DELETE_INTENT_ANNOTATION, KEY_PREFIX, LEASE_LABEL, LEASE_UID_ANNOTATION, MODE_ANNOTATION,
    TOKEN_ANNOTATION, WRITE_ID_ANNOTATION,
};
use crate::stamp::{REFUSAL_CODE, REFUSAL_REASON};
use crate::webhook::decision::{Answer, Outcome};
use crate::webhook::fence::{
    decide, Exemptions, LeaseView, Mode, Refusal, Stamp, Verdict, WriteAttempt,
};
use crate::webhook::subresources::{self, Judged, Via};

pub(super) use crate::runtime::MAX_BODY_BYTES;

/// What the webhook must decide about one request.
#[derive(Debug)]
pub enum Parsed {
    /// Not ours to judge (connect, an unlabelled object, an exempt writer): allow.
    Pass(Box<AdmissionResponse>, &'static str),
    /// A protected write: look up the lease and decide.
    Judge(Box<Judgement>),
    /// A write through /scale, or a pod's binding: allowed only if the object it acts on is
    /// not protected.
    Parent(Box<ParentCheck>),
    /// A write to a HorizontalPodAutoscaler: judged by the lease of the object it scales, if
    /// that object is protected (the autoscaler's exempt /scale writes act for whoever edits
    /// it).
    Autoscaler(Box<AutoscalerCheck>),
    /// Unreadable or impossible: answer with this refusing review.
    Invalid(Box<AdmissionReview<DynamicObject>>),
}

/// The object an autoscaler scales (`spec.scaleTargetRef`).
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ScaleTarget {
    #[serde(default)]
    pub api_version: String,
    #[serde(default)]
    pub kind: String,
    #[serde(default)]
    pub name: String,
}

/// A write to an autoscaler: the judgement it gets if a target is protected (its
/// `lease_name` is filled in from the target's label), and the targets to read: the new one,
/// and on update the old one if it differs (both must pass).
#[derive(Debug)]
pub struct AutoscalerCheck {
    pub judgement: Judgement,
    pub targets: Vec<ScaleTarget>,
    /// The lease the autoscaler itself is labelled for, if any: it judges the write first, as
    /// for any protected object.
    pub own_lease: Option<String>,
}

/// The fencing metadata of an object, owned.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct OwnedStamp {
    pub token: Option<String>,
    pub lease_uid: Option<String>,
    pub write_id: Option<String>,
    pub delete_intent: Option<String>,
}

impl OwnedStamp {
    fn of(o: &ObjectIn) -> OwnedStamp {
        let a = |k| annotation(o, k).map(str::to_string);
        OwnedStamp {
            token: a(TOKEN_ANNOTATION),
            lease_uid: a(LEASE_UID_ANNOTATION),
            write_id: a(WRITE_ID_ANNOTATION),
            delete_intent: a(DELETE_INTENT_ANNOTATION),
        }
    }

    fn borrow(&self) -> Stamp<'_> {
        Stamp {
            token: self.token.as_deref(),
            lease_uid: self.lease_uid.as_deref(),
            write_id: self.write_id.as_deref(),
            delete_intent: self.delete_intent.as_deref(),
        }
    }
}

#[derive(Debug)]
pub struct Judgement {
    pub response: AdmissionResponse,
    pub namespace: String,
    pub lease_name: String,
    pub stamp: OwnedStamp,
    pub previous: Option<OwnedStamp>,
    /// The subresource written, if any (`status`): named in refusals.
    pub subresource: Option<String>,
    /// A delete, judged on the stored object's stamp (`previous` is then None).
    pub deleting: bool,
    /// The protected object this write acts on, when it is not the written object itself (an
    /// autoscaler's target): named in refusals.
    pub acts_on: Option<String>,
}

impl Judgement {
    /// The fencing rule's verdict on this write, given `lease` (None: it does not exist).
    pub fn verdict(&self, lease: Option<&LeaseView>) -> Verdict {
        decide(&self.attempt(), lease)
    }

    pub(super) fn attempt(&self) -> WriteAttempt<'_> {
        WriteAttempt {
            lease_name: &self.lease_name,
            namespace: &self.namespace,
            stamp: self.stamp.borrow(),
            previous: self.previous.as_ref().map(OwnedStamp::borrow),
            deleting: self.deleting,
        }
    }
}

/// A write through a /scale subresource or a binding (see [`Via`]).
#[derive(Debug)]
pub struct ParentCheck {
    pub response: AdmissionResponse,
    pub via: Via,
    pub namespace: String,
    pub name: String,
    pub group: String,
    pub version: String,
    /// The parent's resource (`pods` for a binding).
    pub resource: String,
}

impl ParentCheck {
    /// The refusal for a protected object.
    pub(super) fn refuse(&self, lease: &str) -> AdmissionResponse {
        let (path, what) = (self.via.path(), self.what_to_do());
        let msg = format!(
            "fencedlease: {}/{path} {}/{} is protected by FencedLease {}/{lease} (label {LEASE_LABEL}); a write through /{path} cannot carry a fencing token, so it is refused; {what}",
            self.resource, self.namespace, self.name, self.namespace
        );
        let mut resp = self.response.clone();
        resp.allowed = false;
        resp.result = Status::failure(&msg, REFUSAL_REASON).with_code(REFUSAL_CODE);
        resp
    }
}

impl ParentCheck {
    fn what_to_do(&self) -> String {
        match self.via {
            Via::Scale => format!("change the replicas with a fenced write of the object itself ({TOKEN_ANNOTATION}, {LEASE_UID_ANNOTATION} and a new {WRITE_ID_ANNOTATION})"),
            Via::Binding => "only the scheduler (an exempt writer) binds a protected pod; set spec.nodeName in a fenced create of the pod instead".into(),
        }
    }
}

/// An answer that refuses a request that could not be read at all.
pub(super) fn unreadable(reason: &str) -> AdmissionReview<DynamicObject> {
    AdmissionResponse::invalid(format!(
        "fencedlease: cannot read the AdmissionReview: {reason}"
    ))
    .into_review()
}

/// The parts of an AdmissionReview that the fencing decision reads. Everything else (the
/// objects' data, spec, status and managedFields, the user's extra info) is skipped by the
/// parser without being built: reading the review is most of the webhook's work per request.
#[derive(Deserialize)]
struct ReviewIn {
    #[serde(rename = "apiVersion", default)]
    api_version: Option<String>,
    #[serde(default)]
    request: Option<RequestIn>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RequestIn {
    uid: String,
    operation: Operation,
    #[serde(default)]
    resource: ResourceIn,
    #[serde(default)]
    sub_resource: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    user_info: UserIn,
    #[serde(default)]
    object: Option<ObjectIn>,
    #[serde(default)]
    old_object: Option<ObjectIn>,
}

#[derive(Deserialize, Default)]
struct ResourceIn {
    #[serde(default)]
    group: String,
    #[serde(default)]
    version: String,
    #[serde(default)]
    resource: String,
}

#[derive(Deserialize, Default)]
struct UserIn {
    #[serde(default)]
    username: String,
    #[serde(default)]
    groups: Vec<String>,
}

#[derive(Deserialize, Default)]
struct ObjectIn {
    #[serde(default)]
    metadata: MetaIn,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct MetaIn {
    /// Set once a delete has been accepted (the object waits for finalizers or, a pod, for its
    /// containers to stop): only whether it is there is read.
    #[serde(default)]
    deletion_timestamp: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    labels: Option<OurKeys>,
    #[serde(default)]
    annotations: Option<OurKeys>,
}

/// The `fencedlease.io/` entries of a label or annotation map, and nothing else: the others
/// are skipped as they are read, so a body of millions of tiny labels costs no more memory
/// than its bytes (it would cost some 12 times that as a map of Strings). Injection reads
/// pods' labels and annotations through it too.
#[derive(Debug, Default)]
pub(crate) struct OurKeys(BTreeMap<String, String>);

impl OurKeys {
    /// The value of `key`, one of ours (`fencedlease.io/...`: no other key is kept).
    pub(crate) fn get(&self, key: &str) -> Option<&str> {
        debug_assert!(key.starts_with(KEY_PREFIX), "{key} is not kept");
        self.0.get(key).map(String::as_str)
    }
}

impl<'de> Deserialize<'de> for OurKeys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = OurKeys;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a map of strings")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut m: A,
            ) -> Result<OurKeys, A::Error> {
                let mut ours = BTreeMap::new();
                while let Some(k) = m.next_key::<String>()? {
                    if k.starts_with(KEY_PREFIX) {
                        ours.insert(k, m.next_value::<String>()?);
                    } else {
                        m.next_value::<serde::de::IgnoredAny>()?;
                    }
                }
                Ok(OurKeys(ours))
            }
        }
        d.deserialize_map(Visit)
    }
}

fn annotation<'a>(o: &'a ObjectIn, key: &str) -> Option<&'a str> {
    o.metadata.annotations.as_ref().and_then(|a| a.get(key))
}

fn label<'a>(o: &'a ObjectIn, key: &str) -> Option<&'a str> {
    o.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(key))
        .filter(|v| !v.is_empty())
}

/// An allowing answer to the request `uid`, in the review version the API server sent.
pub(crate) fn allowing(api_version: &str, uid: &str) -> AdmissionResponse {
    let mut r = AdmissionResponse::invalid("");
    r.types = TypeMeta {
        api_version: api_version.to_string(),
        kind: "AdmissionReview".to_string(),
    };
    r.uid = uid.to_string();
    r.allowed = true;
    r.result = Status::default();
    r
}

/// Parses a request body into what must be decided, or the review to answer at once.
pub fn parse(body: &[u8], exempt: &Exemptions) -> Parsed {
    let invalid = |r: AdmissionReview<DynamicObject>| Parsed::Invalid(Box::new(r));
    let review: ReviewIn = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => return invalid(unreadable(&e.to_string())),
    };
    let Some(req) = review.request else {
        return invalid(unreadable("it has no request"));
    };
    let api_version = review
        .api_version
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "admission.k8s.io/v1".to_string());
    let response = allowing(&api_version, &req.uid);
    let pass = |why| Parsed::Pass(Box::new(response.clone()), why);
    if req.operation == Operation::Delete {
        let writer_exempt = exempt.covers(&req.user_info.username, &req.user_info.groups);
        return parse_delete(req, response, writer_exempt);
    }
    if is_autoscaler_write(&req) {
        let writer_exempt = exempt.covers(&req.user_info.username, &req.user_info.groups);
        return parse_autoscaler(body, req, response, writer_exempt);
    }
    if !matches!(req.operation, Operation::Create | Operation::Update) {
        return pass("not_a_write");
    }
    let sub = req.sub_resource.clone().filter(|s| !s.is_empty());
    let writer_exempt = exempt.covers(&req.user_info.username, &req.user_info.groups)
        || kubelet_pod_status(&req, sub.as_deref());
    if let Some(Judged::ByItsParent(via)) = subresources::route(
        &req.resource.group,
        &req.resource.resource,
        sub.as_deref(),
        &req.operation,
    ) {
        return if writer_exempt {
            pass("exempt")
        } else {
            parent_check(req, via, response)
        };
    }
    parse_write(req, sub, response, writer_exempt)
}

/// A create or update of a HorizontalPodAutoscaler itself (its /status is the autoscaler
/// controller's report, and changes no replicas).
fn is_autoscaler_write(req: &RequestIn) -> bool {
    req.resource.group == "autoscaling"
        && req.resource.resource == "horizontalpodautoscalers"
        && req.sub_resource.as_deref().is_none_or(str::is_empty)
        && matches!(req.operation, Operation::Create | Operation::Update)
}

/// The scale targets of an autoscaler review, read in a second pass over the body (only
/// autoscalers have one, so the first pass does not look for it).
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct AutoscalerReviewIn {
    #[serde(default)]
    request: AutoscalerRequestIn,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct AutoscalerRequestIn {
    #[serde(default)]
    object: Option<AutoscalerIn>,
    #[serde(default)]
    old_object: Option<AutoscalerIn>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct AutoscalerIn {
    #[serde(default)]
    spec: AutoscalerSpecIn,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct AutoscalerSpecIn {
    #[serde(default)]
    scale_target_ref: Option<ScaleTarget>,
}

fn parse_autoscaler(
    body: &[u8],
    req: RequestIn,
    response: AdmissionResponse,
    writer_exempt: bool,
) -> Parsed {
    let review: AutoscalerReviewIn = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => return Parsed::Invalid(Box::new(unreadable(&e.to_string()))),
    };
    let target = |o: Option<AutoscalerIn>| o.and_then(|o| o.spec.scale_target_ref);
    let mut targets: Vec<ScaleTarget> = target(review.request.object).into_iter().collect();
    if let Some(old) = target(review.request.old_object) {
        if !targets.contains(&old) {
            targets.push(old);
        }
    }
    targets.retain(|t| !t.name.is_empty() && !t.kind.is_empty());
    let Some(namespace) = req.namespace.clone().filter(|n| !n.is_empty()) else {
        return Parsed::Pass(Box::new(response), "cluster_scoped");
    };
    let (Some(new), old) = (req.object.as_ref(), req.old_object.as_ref()) else {
        let msg = "fencedlease: a create or update without an object";
        return Parsed::Invalid(Box::new(response.deny(msg).into_review()));
    };
    let own_lease = old
        .and_then(|o| label(o, LEASE_LABEL))
        .or_else(|| label(new, LEASE_LABEL))
        .map(str::to_string);
    // Kubernetes' own writers pass, as long as they leave a labelled autoscaler's fencing alone.
    if writer_exempt
        && (own_lease.is_none() || old.is_some_and(|o| fencing_metadata_unchanged(new, o)))
    {
        return Parsed::Pass(Box::new(response), "exempt");
    }
    let judgement = Judgement {
        lease_name: String::new(),
        stamp: OwnedStamp::of(new),
        previous: old.map(OwnedStamp::of),
        subresource: None,
        deleting: false,
        acts_on: None,
        response,
        namespace,
    };
    Parsed::Autoscaler(Box::new(AutoscalerCheck {
        judgement,
        targets,
        own_lease,
    }))
}

/// A kubelet's status update of a pod (a node identity may never be exempt in general, but
/// the kubelet must report the pods it runs; NodeRestriction limits it to its own node's). Like
/// an exempt writer's, it passes only while it leaves the fencing label and annotations alone.
fn kubelet_pod_status(req: &RequestIn, sub: Option<&str>) -> bool {
    req.resource.group.is_empty()
        && req.resource.resource == "pods"
        && sub == Some("status")
        && req.user_info.username.starts_with("system:node:")
}

fn parent_check(req: RequestIn, via: Via, response: AdmissionResponse) -> Parsed {
    let (Some(namespace), Some(name)) = (
        req.namespace.filter(|n| !n.is_empty()),
        req.name.filter(|n| !n.is_empty()),
    ) else {
        return Parsed::Pass(Box::new(response), "cluster_scoped");
    };
    // A binding acts on the pod of the same name (the legacy `bindings` resource too).
    let resource = match via {
        Via::Binding => "pods".to_string(),
        Via::Scale => req.resource.resource,
    };
    Parsed::Parent(Box::new(ParentCheck {
        response,
        via,
        namespace,
        name,
        group: req.resource.group,
        version: req.resource.version,
        resource,
    }))
}

/// Do the two objects carry the same lease label and the same stamp?
fn fencing_metadata_unchanged(new: &ObjectIn, old: &ObjectIn) -> bool {
    label(new, LEASE_LABEL) == label(old, LEASE_LABEL) && OwnedStamp::of(new) == OwnedStamp::of(old)
}

fn parse_write(
    req: RequestIn,
    sub: Option<String>,
    response: AdmissionResponse,
    writer_exempt: bool,
) -> Parsed {
    let (Some(new), old) = (req.object.as_ref(), req.old_object.as_ref()) else {
        let msg = "fencedlease: a create or update without an object";
        return Parsed::Invalid(Box::new(response.deny(msg).into_review()));
    };
    // The stored object's label decides (removing the label is itself a protected write).
    let lease_name = old
        .and_then(|o| label(o, LEASE_LABEL))
        .or_else(|| label(new, LEASE_LABEL));
    let Some(lease_name) = lease_name else {
        return Parsed::Pass(Box::new(response), "unlabelled");
    };
    // Kubernetes' own controllers may update without a token, but not touch the fencing.
    if writer_exempt && old.is_some_and(|o| fencing_metadata_unchanged(new, o)) {
        return Parsed::Pass(Box::new(response), "exempt");
    }
    let Some(namespace) = req.namespace.clone().filter(|n| !n.is_empty()) else {
        let msg = format!(
            "fencedlease: only namespaced objects can be protected (label {LEASE_LABEL} on a cluster-scoped object)"
        );
        return Parsed::Invalid(Box::new(response.deny(msg).into_review()));
    };
    Parsed::Judge(Box::new(Judgement {
        lease_name: lease_name.to_string(),
        stamp: OwnedStamp::of(new),
        previous: old.map(OwnedStamp::of),
        subresource: sub,
        deleting: false,
        acts_on: None,
        response,
        namespace,
    }))
}

/// A delete (one object, or each object of a deletecollection): judged on the stored object,
/// which must announce it. Kubernetes' own deleters (the garbage collector, the namespace
/// controller: exempt) pass, and so does a kubelet's delete of a pod whose deletion was already
/// accepted (it removes the pod once its containers stopped; a fenced delete decided it). The
/// API server itself removes an object once its last finalizer is gone, with no admission.
fn parse_delete(req: RequestIn, response: AdmissionResponse, writer_exempt: bool) -> Parsed {
    let Some(old) = req.old_object.as_ref() else {
        let msg = "fencedlease: a delete without the stored object (oldObject): cannot tell whether it is protected";
        return Parsed::Invalid(Box::new(response.deny(msg).into_review()));
    };
    let Some(lease_name) = label(old, LEASE_LABEL) else {
        return Parsed::Pass(Box::new(response), "unlabelled");
    };
    if writer_exempt {
        return Parsed::Pass(Box::new(response), "exempt");
    }
    // The kubelet removes a pod whose deletion was accepted once its containers stopped (its
    // final delete); anyone else's delete of a terminating object is judged (a force delete
    // would cut its grace period short).
    if old.metadata.deletion_timestamp.is_some()
        && req.user_info.username.starts_with("system:node:")
    {
        return Parsed::Pass(Box::new(response), "already_deleting");
    }
    let Some(namespace) = req.namespace.clone().filter(|n| !n.is_empty()) else {
        return Parsed::Pass(Box::new(response), "cluster_scoped");
    };
    Parsed::Judge(Box::new(Judgement {
        lease_name: lease_name.to_string(),
        stamp: OwnedStamp::of(old),
        previous: None,
        subresource: None,
        deleting: true,
        acts_on: None,
        response,
        namespace,
    }))
}

/// The refusal's message, with what a subresource write adds to it.
fn message(j: &Judgement, r: &Refusal) -> String {
    let mut msg = r.message(&j.attempt());
    if let Some(target) = &j.acts_on {
        msg = format!("{msg}; this autoscaler scales {target}, which that lease protects, so its writes are judged by the lease like the object's (stamp them the same way)");
    }
    match (&j.subresource, r) {
        (Some(sub), Refusal::NotPresented | Refusal::MissingToken) => format!(
            "{msg}; this was a write to /{sub}: where the type's /{sub} keeps metadata from the stored object (custom resources do), no token can be presented there, and only the exempt writers (Kubernetes' controllers) may write it"
        ),
        _ => msg,
    }
}

/// The answer to a protected write: allowed, or refused (allowed with a warning where the
/// namespace says warn). `mode` matters only to a refusal, so the caller may read it then.
pub fn answer(j: &Judgement, verdict: &Verdict, mode: Mode) -> Answer {
    let r = match verdict {
        Verdict::Allow => return Answer::new(j.response.clone(), Outcome::Allowed),
        Verdict::Refuse(r) => r,
    };
    let msg = message(j, r);
    let mut resp = j.response.clone();
    match mode {
        Mode::Warn => {
            resp.warnings = Some(vec![format!(
                "{msg} (allowed: the namespace is annotated {MODE_ANNOTATION}=warn)"
            )]);
            Answer::new(resp, Outcome::Warned)
        }
        Mode::Enforce => {
            resp.allowed = false;
            resp.result = Status::failure(&msg, REFUSAL_REASON).with_code(REFUSAL_CODE);
            Answer::new(resp, Outcome::Denied(r.denial()))
        }
    }
}

/// Refuses because the lease (or the scaled object) could not be read to decide (fail closed).
pub(super) fn unconfirmed(response: &AdmissionResponse, what: &str, detail: &str) -> Answer {
    let mut resp = response.clone();
    resp.allowed = false;
    resp.result = Status::failure(
        &format!("fencedlease: could not read {what} to decide on this write ({detail}); writes to protected objects are refused until the webhook can read from the API server again; retry"),
        "ServiceUnavailable",
    )
    .with_code(503);
    Answer::new(resp, Outcome::Unconfirmed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The production path: the verdict on `lease`, answered in `mode`; with the outcome's label.
    fn respond(
        j: &Judgement,
        lease: Option<&LeaseView>,
        mode: Mode,
    ) -> (AdmissionResponse, &'static str) {
        let a = answer(j, &j.verdict(lease), mode);
        (a.response, a.outcome.label())
    }

    fn review_as(
        op: &str,
        sub: Option<&str>,
        user: &str,
        object: serde_json::Value,
        old: Option<serde_json::Value>,
    ) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "req-1",
                "kind": {"group": "", "version": "v1", "kind": "ConfigMap"},
                "resource": {"group": "", "version": "v1", "resource": "configmaps"},
                "subResource": sub,
                "name": "inventory",
                "namespace": "shop",
                "operation": op,
                "userInfo": {"username": user, "groups": ["system:authenticated"]},
                "object": object,
                "oldObject": old,
                "dryRun": false
            }
        }))
        .expect("json")
    }

    fn review(op: &str, object: serde_json::Value, old: Option<serde_json::Value>) -> Vec<u8> {
        review_as(op, None, "alice", object, old)
    }

    fn cm(labels: serde_json::Value, annotations: serde_json::Value) -> serde_json::Value {
        serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "inventory", "namespace": "shop", "labels": labels, "annotations": annotations}})
    }

    fn exemptions() -> Exemptions {
        let users = [
            "system:serviceaccount:kube-system:gc",
            "system:kube-scheduler",
        ];
        Exemptions::new(users.map(String::from).to_vec(), vec![]).expect("exemptions")
    }

    fn parsed(body: &[u8]) -> Parsed {
        parse(body, &exemptions())
    }

    fn judge(body: &[u8]) -> Judgement {
        match parsed(body) {
            Parsed::Judge(j) => *j,
            other => panic!("expected a judgement, got {other:?}"),
        }
    }

    fn stamped(token: &str, id: &str) -> serde_json::Value {
        cm(
            serde_json::json!({LEASE_LABEL: "inv"}),
            serde_json::json!({TOKEN_ANNOTATION: token, LEASE_UID_ANNOTATION: "u", WRITE_ID_ANNOTATION: id}),
        )
    }

    #[test]
    fn unlabelled_objects_and_connects_pass() {
        let b = review(
            "CREATE",
            cm(serde_json::json!({}), serde_json::json!({})),
            None,
        );
        assert!(matches!(parsed(&b), Parsed::Pass(_, "unlabelled")));
        let b = review("CONNECT", serde_json::Value::Null, None);
        assert!(matches!(parsed(&b), Parsed::Pass(_, "not_a_write")));
        let b = review(
            "DELETE",
            serde_json::Value::Null,
            Some(cm(serde_json::json!({}), serde_json::json!({}))),
        );
        assert!(matches!(parsed(&b), Parsed::Pass(_, "unlabelled")));
    }

    #[test]
    fn a_protected_delete_is_judged_on_the_stored_stamp_and_kubernetes_own_deleters_pass() {
        let announced = serde_json::json!({TOKEN_ANNOTATION: "5", LEASE_UID_ANNOTATION: "u1",
            WRITE_ID_ANNOTATION: "w9", DELETE_INTENT_ANNOTATION: "w9"});
        let labelled = cm(serde_json::json!({LEASE_LABEL: "inv"}), announced);
        let b = review("DELETE", serde_json::Value::Null, Some(labelled.clone()));
        let j = judge(&b);
        assert!(j.deleting && j.previous.is_none(), "{j:?}");
        assert_eq!(j.lease_name, "inv");
        assert_eq!(j.stamp.delete_intent.as_deref(), Some("w9"));
        let view = LeaseView {
            uid: "u1".into(),
            generation: 5,
            holder: Some("b".into()),
            deleting: false,
        };
        assert!(respond(&j, Some(&view), Mode::Enforce).0.allowed);
        let moved_on = LeaseView {
            generation: 6,
            ..view
        };
        let (resp, label) = respond(&j, Some(&moved_on), Mode::Enforce);
        assert!(!resp.allowed && label == "denied_stale", "{label}");
        // The garbage collector (exempt) deletes without an announcement.
        let bare = cm(
            serde_json::json!({LEASE_LABEL: "inv"}),
            serde_json::json!({}),
        );
        let b = review_as(
            "DELETE",
            None,
            "system:serviceaccount:kube-system:gc",
            serde_json::Value::Null,
            Some(bare.clone()),
        );
        assert!(matches!(parsed(&b), Parsed::Pass(_, "exempt")));
        // Anyone else's is judged, and refused unannounced.
        let b = review("DELETE", serde_json::Value::Null, Some(bare.clone()));
        let j = judge(&b);
        let (resp, label) = respond(&j, Some(&moved_on), Mode::Enforce);
        assert!(
            !resp.allowed && label == "denied_unannounced_delete",
            "{label}"
        );
        let msg = resp.result.message;
        assert!(
            msg.contains(DELETE_INTENT_ANNOTATION) && msg.contains("absent"),
            "{msg}"
        );
        // A deletion already accepted is finished by the kubelet; anyone else is judged (a
        // force delete of a terminating pod cuts its grace period short).
        let mut terminating = bare;
        terminating["metadata"]["deletionTimestamp"] = serde_json::json!("2026-12-04T01:00:00Z");
        let b = review_as(
            "DELETE",
            None,
            "system:node:n1",
            serde_json::Value::Null,
            Some(terminating.clone()),
        );
        assert!(matches!(parsed(&b), Parsed::Pass(_, "already_deleting")));
        let b = review("DELETE", serde_json::Value::Null, Some(terminating));
        assert!(matches!(parsed(&b), Parsed::Judge(_)));
        // No stored object: nothing can tell whether it is protected; refused.
        let b = review("DELETE", serde_json::Value::Null, None);
        assert!(matches!(parsed(&b), Parsed::Invalid(_)));
    }

    #[test]
    fn an_autoscaler_write_names_its_targets_to_be_judged_by_their_lease() {
        let hpa = |target: &str, annotations: serde_json::Value| {
            serde_json::json!({"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                "metadata": {"name": "web", "namespace": "shop", "annotations": annotations},
                "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target},
                         "minReplicas": 1, "maxReplicas": 9, "metrics": []}})
        };
        let review = |user: &str,
                      sub: Option<&str>,
                      new: serde_json::Value,
                      old: Option<serde_json::Value>| {
            let mut v: serde_json::Value =
                serde_json::from_slice(&review_as("UPDATE", sub, user, new, old)).expect("json");
            v["request"]["resource"] = serde_json::json!({"group": "autoscaling", "version": "v2", "resource": "horizontalpodautoscalers"});
            serde_json::to_vec(&v).expect("json")
        };
        let stamped = serde_json::json!({TOKEN_ANNOTATION: "5", LEASE_UID_ANNOTATION: "u1", WRITE_ID_ANNOTATION: "w2"});
        let b = review(
            "alice",
            None,
            hpa("web", stamped),
            Some(hpa("api", serde_json::json!({}))),
        );
        let Parsed::Autoscaler(c) = parsed(&b) else {
            panic!("an autoscaler check")
        };
        let names: Vec<&str> = c.targets.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(
            names,
            ["web", "api"],
            "the new target, then the old one it leaves"
        );
        assert_eq!(
            (
                c.targets[0].api_version.as_str(),
                c.targets[0].kind.as_str()
            ),
            ("apps/v1", "Deployment")
        );
        assert_eq!(c.judgement.stamp.token.as_deref(), Some("5"));
        assert!(c.judgement.previous.is_some());
        // Retargeting nothing: one target.
        let b = review(
            "alice",
            None,
            hpa("web", serde_json::json!({})),
            Some(hpa("web", serde_json::json!({}))),
        );
        let Parsed::Autoscaler(c) = parsed(&b) else {
            panic!("an autoscaler check")
        };
        assert_eq!(c.targets.len(), 1);
        // Exempt writers pass, and the autoscaler controller's /status is no write of replicas.
        let b = review(
            "system:serviceaccount:kube-system:gc",
            None,
            hpa("web", serde_json::json!({})),
            None,
        );
        assert!(matches!(parsed(&b), Parsed::Pass(_, "exempt")));
        let b = review(
            "alice",
            Some("status"),
            hpa("web", serde_json::json!({})),
            Some(hpa("web", serde_json::json!({}))),
        );
        assert!(matches!(parsed(&b), Parsed::Pass(_, "unlabelled")));
        // A refusal names the target the autoscaler acts on.
        let mut j = c.judgement;
        j.lease_name = "inv".into();
        j.acts_on = Some("Deployment shop/web".into());
        let (resp, _) = respond(&j, None, Mode::Enforce);
        assert!(
            resp.result
                .message
                .contains("this autoscaler scales Deployment shop/web"),
            "{}",
            resp.result.message
        );
    }

    #[test]
    fn the_stored_label_decides_and_the_object_cannot_choose_warn() {
        let old = stamped("7", "w1");
        // The new object drops the label and asks for warn mode: still judged.
        let new = cm(
            serde_json::json!({}),
            serde_json::json!({MODE_ANNOTATION: "warn", TOKEN_ANNOTATION: "3", WRITE_ID_ANNOTATION: "w2"}),
        );
        let j = judge(&review("UPDATE", new, Some(old)));
        assert_eq!(j.lease_name, "inv");
        assert_eq!(j.stamp.token.as_deref(), Some("3"));
        assert_eq!(j.stamp.write_id.as_deref(), Some("w2"));
        let prev = j.previous.clone().expect("previous");
        assert_eq!(
            (prev.token.as_deref(), prev.write_id.as_deref()),
            (Some("7"), Some("w1"))
        );
        assert_eq!(j.response.uid, "req-1");
        // The object's own mode annotation is data: the refusal is enforced.
        let lease = LeaseView {
            uid: "u".into(),
            generation: 7,
            holder: Some("b".into()),
            deleting: false,
        };
        let (resp, _) = respond(&j, Some(&lease), Mode::Enforce);
        assert!(!resp.allowed);
    }

    #[test]
    fn exempt_writers_pass_only_while_the_fencing_metadata_stays() {
        let gc = "system:serviceaccount:kube-system:gc";
        let old = stamped("7", "w1");
        let mut new = old.clone();
        new["metadata"]["finalizers"] = serde_json::json!(["foregroundDeletion"]);
        let b = review_as("UPDATE", None, gc, new.clone(), Some(old.clone()));
        assert!(matches!(parsed(&b), Parsed::Pass(_, "exempt")));
        // The same write by anyone else is judged (and refused: the token is inherited).
        let b = review_as("UPDATE", None, "alice", new, Some(old.clone()));
        assert!(matches!(parsed(&b), Parsed::Judge(_)));
        // An exempt writer that changes the stamp or the label is judged like anyone.
        for changed in [stamped("9", "w9"), {
            let mut o = old.clone();
            o["metadata"]["labels"][LEASE_LABEL] = "other".into();
            o
        }] {
            let b = review_as("UPDATE", Some("status"), gc, changed, Some(old.clone()));
            assert!(matches!(parsed(&b), Parsed::Judge(_)));
        }
        // Creates are always judged.
        let b = review_as("CREATE", None, gc, old.clone(), None);
        assert!(matches!(parsed(&b), Parsed::Judge(_)));
    }

    #[test]
    fn status_writes_are_judged_and_scale_writes_are_checked_against_the_object() {
        let old = stamped("7", "w1");
        let j = judge(&review_as(
            "UPDATE",
            Some("status"),
            "alice",
            old.clone(),
            Some(old.clone()),
        ));
        let lease = LeaseView {
            uid: "u".into(),
            generation: 7,
            holder: Some("b".into()),
            deleting: false,
        };
        let (resp, label) = respond(&j, Some(&lease), Mode::Enforce);
        assert_eq!(label, "denied_not_presented");
        assert!(
            resp.result.message.contains("/status"),
            "{}",
            resp.result.message
        );
        let scale = serde_json::json!({"apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {"name": "inventory", "namespace": "shop"}, "spec": {"replicas": 3}});
        match parsed(&review_as(
            "UPDATE",
            Some("scale"),
            "alice",
            scale.clone(),
            Some(scale.clone()),
        )) {
            Parsed::Parent(c) => {
                assert_eq!(
                    (c.name.as_str(), c.resource.as_str()),
                    ("inventory", "configmaps")
                );
                let r = c.refuse("inv");
                assert!(
                    !r.allowed && r.result.code == 403 && r.result.message.contains("/scale"),
                    "{:?}",
                    r.result
                );
            }
            other => panic!("expected a scale check, got {other:?}"),
        }
        let hpa = "system:serviceaccount:kube-system:gc";
        let b = review_as("UPDATE", Some("scale"), hpa, scale.clone(), Some(scale));
        assert!(matches!(parsed(&b), Parsed::Pass(_, "exempt")));
    }

    #[test]
    fn a_kubelet_reports_a_protected_pod_s_status_but_writes_nothing_else_unfenced() {
        let pod = |annotations| {
            let mut v = cm(serde_json::json!({LEASE_LABEL: "inv"}), annotations);
            v["kind"] = "Pod".into();
            v
        };
        let as_pod = |sub: Option<&str>, user: &str, new: serde_json::Value| {
            let old = pod(serde_json::json!({TOKEN_ANNOTATION: "3", WRITE_ID_ANNOTATION: "w"}));
            let mut v: serde_json::Value =
                serde_json::from_slice(&review_as("UPDATE", sub, user, new, Some(old)))
                    .expect("json");
            v["request"]["resource"]["resource"] = "pods".into();
            serde_json::to_vec(&v).expect("json")
        };
        let same = pod(serde_json::json!({TOKEN_ANNOTATION: "3", WRITE_ID_ANNOTATION: "w"}));
        let node = "system:node:node-1";
        assert!(matches!(
            parsed(&as_pod(Some("status"), node, same.clone())),
            Parsed::Pass(_, "exempt")
        ));
        // Not the pod itself, nor the status of anything else, nor a change of the fencing.
        assert!(matches!(
            parsed(&as_pod(None, node, same.clone())),
            Parsed::Judge(_)
        ));
        let restamped = pod(serde_json::json!({TOKEN_ANNOTATION: "9", WRITE_ID_ANNOTATION: "x"}));
        assert!(matches!(
            parsed(&as_pod(Some("status"), node, restamped)),
            Parsed::Judge(_)
        ));
        let cm_status = review_as("UPDATE", Some("status"), node, same.clone(), Some(same));
        assert!(matches!(parsed(&cm_status), Parsed::Judge(_)));
    }

    #[test]
    fn a_binding_is_checked_against_its_pod_and_the_scheduler_passes() {
        let binding = |sub: Option<&str>, resource: &str, user: &str| {
            let mut v: serde_json::Value = serde_json::from_slice(&review_as(
                "CREATE",
                sub,
                user,
                serde_json::json!({"apiVersion": "v1", "kind": "Binding",
                    "metadata": {"name": "inventory", "namespace": "shop"},
                    "target": {"kind": "Node", "name": "n1"}}),
                None,
            ))
            .expect("json");
            v["request"]["resource"]["resource"] = resource.into();
            serde_json::to_vec(&v).expect("json")
        };
        for (sub, resource) in [(Some("binding"), "pods"), (None, "bindings")] {
            match parsed(&binding(sub, resource, "alice")) {
                Parsed::Parent(c) => {
                    assert_eq!((c.via, c.resource.as_str()), (Via::Binding, "pods"));
                    let r = c.refuse("inv");
                    assert!(r.result.message.contains("/binding"), "{:?}", r.result);
                    assert!(r.result.message.contains("scheduler"), "{:?}", r.result);
                }
                other => panic!("{resource} {sub:?}: expected a parent check, got {other:?}"),
            }
            let b = binding(sub, resource, "system:kube-scheduler");
            assert!(matches!(parsed(&b), Parsed::Pass(_, "exempt")));
        }
    }

    #[test]
    fn refusals_are_403_with_the_message_and_warn_mode_allows_with_a_warning() {
        let j = judge(&review("CREATE", stamped("3", "w"), None));
        let lease = LeaseView {
            uid: "u".into(),
            generation: 4,
            holder: Some("b".into()),
            deleting: false,
        };
        let (resp, label) = respond(&j, Some(&lease), Mode::Enforce);
        assert!(!resp.allowed);
        assert_eq!(
            resp.result.code, 403,
            "Forbidden, which clients do not retry"
        );
        assert_eq!(resp.result.reason, "Forbidden");
        assert_eq!(label, "denied_stale");
        assert!(
            resp.result.message.contains("stale token 3"),
            "{}",
            resp.result.message
        );
        let (resp, label) = respond(&j, Some(&lease), Mode::Warn);
        assert!(resp.allowed);
        assert_eq!(label, "warned");
        assert!(resp
            .warnings
            .is_some_and(|w| w[0].contains("stale token 3") && w[0].contains("namespace")));
    }

    #[test]
    fn the_answer_speaks_the_review_version_and_echoes_the_uid() {
        let new = stamped("3", "w");
        let mut v: serde_json::Value =
            serde_json::from_slice(&review("CREATE", new, None)).expect("json");
        v["apiVersion"] = "admission.k8s.io/v1beta1".into();
        // What the decision does not read may be anything: data, managedFields, user extras.
        v["request"]["object"]["data"] = serde_json::json!({"big": "x".repeat(4096)});
        v["request"]["object"]["metadata"]["managedFields"] =
            serde_json::json!([{"manager": "m", "fieldsV1": {"f:data": {}}}]);
        v["request"]["userInfo"] = serde_json::json!({"username": "u", "extra": {"a": ["b"]}});
        let j = judge(&serde_json::to_vec(&v).expect("json"));
        let out = serde_json::to_value(j.response.clone().into_review()).expect("json");
        assert_eq!(out["apiVersion"], "admission.k8s.io/v1beta1");
        assert_eq!(out["kind"], "AdmissionReview");
        assert_eq!(out["response"]["uid"], "req-1");
        assert_eq!(out["response"]["allowed"], true);
        // Wrong types in what it does read are refused, not guessed at.
        v["request"]["object"]["metadata"]["labels"] = serde_json::json!({LEASE_LABEL: 7});
        assert!(matches!(
            parsed(&serde_json::to_vec(&v).expect("json")),
            Parsed::Invalid(_)
        ));
    }

    #[test]
    fn only_our_labels_and_annotations_are_kept_and_only_ours_must_be_strings() {
        let mut labels = serde_json::Map::new();
        for i in 0..2000 {
            labels.insert(format!("k{i}"), serde_json::json!({"any": [i]}));
        }
        labels.insert(LEASE_LABEL.into(), "inv".into());
        let new = cm(
            serde_json::Value::Object(labels),
            serde_json::json!({TOKEN_ANNOTATION: "3", LEASE_UID_ANNOTATION: "u", "other": 7}),
        );
        let body = review("CREATE", new, None);
        let v: ReviewIn = serde_json::from_slice(&body).expect("parses");
        let obj = v.request.and_then(|r| r.object).expect("object");
        let kept = obj.metadata.labels.as_ref().map(|l| l.0.len());
        assert_eq!(kept, Some(1), "only the fencedlease.io/ label is kept");
        assert_eq!(label(&obj, LEASE_LABEL), Some("inv"));
        assert_eq!(annotation(&obj, TOKEN_ANNOTATION), Some("3"));
        // Escaped keys are matched by what they say.
        let escaped = br#"{"apiVersion":"admission.k8s.io/v1","request":{"uid":"1","operation":"CREATE","namespace":"shop","object":{"metadata":{"labels":{"fencedlease.io\/lease":"inv"}}}}}"#;
        assert!(matches!(parsed(escaped), Parsed::Judge(_)));
    }

    #[test]
    fn unreadable_input_gets_a_denying_review() {
        for body in [
            &b""[..],
            b"{",
            b"null",
            b"[]",
            b"{\"kind\":\"AdmissionReview\"}",
            b"\xff\xfe",
        ] {
            match parsed(body) {
                Parsed::Invalid(r) => assert!(r.response.is_some_and(|r| !r.allowed)),
                p => panic!("{body:?} parsed as {p:?}"),
            }
        }
    }

    proptest! {
        // 2,000 cases per test run; FL_FUZZ_CASES=N for a deeper run (RELIABILITY.md).
        #![proptest_config(ProptestConfig::with_cases(
            std::env::var("FL_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(2000)
        ))]
        #[test]
        fn parse_never_panics_on_bytes(body in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = parsed(&body);
        }

        #[test]
        fn parse_and_respond_never_panic_on_odd_objects(
            op in prop_oneof!["CREATE", "UPDATE", "DELETE", "CONNECT", "BOGUS"],
            sub in proptest::option::of(prop_oneof!["status", "scale", "", "x"]),
            lease in "\\PC{0,12}", token in "\\PC{0,24}", uid in "\\PC{0,8}", id in "\\PC{0,6}",
            with_old in any::<bool>(),
        ) {
            let obj = cm(serde_json::json!({LEASE_LABEL: lease}),
                serde_json::json!({TOKEN_ANNOTATION: token, LEASE_UID_ANNOTATION: uid, WRITE_ID_ANNOTATION: id}));
            let b = review_as(&op, sub.as_deref(), "u", obj.clone(), with_old.then_some(obj));
            if let Parsed::Judge(j) = parsed(&b) {
                let lv = LeaseView { uid: uid.clone(), generation: 3, holder: Some("h".into()), deleting: false };
                let _ = respond(&j, Some(&lv), Mode::Enforce);
                let _ = respond(&j, None, Mode::Warn);
            }
        }
    }
}
