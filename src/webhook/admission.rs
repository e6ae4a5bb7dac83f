//! AdmissionReview handling for the fencing webhook: parse, decide, answer. Every input gets
//! an AdmissionReview back; nothing here panics.

use std::collections::BTreeMap;

use kube::core::admission::{AdmissionResponse, AdmissionReview, Operation};
use kube::core::{DynamicObject, Status, TypeMeta};
use serde::Deserialize;

use crate::fencing::{
    decide, LeaseView, Mode, Refusal, Verdict, WriteAttempt, LEASE_LABEL, LEASE_UID_ANNOTATION,
    MODE_ANNOTATION, TOKEN_ANNOTATION,
};

/// The largest request body read; an AdmissionReview for an update carries two objects of at
/// most 1.5 MiB each (etcd's default request limit), plus envelope.
pub const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;

/// What the webhook must decide about one request.
#[derive(Debug)]
pub enum Parsed {
    /// Not ours to judge (delete, connect, a subresource, an unlabelled object): allow.
    Pass(Box<AdmissionResponse>, &'static str),
    /// A protected write: look up the lease and decide.
    Judge(Box<Judgement>),
    /// Unreadable or impossible: answer with this refusing review.
    Invalid(Box<AdmissionReview<DynamicObject>>),
}

#[derive(Debug)]
pub struct Judgement {
    pub response: AdmissionResponse,
    pub namespace: String,
    pub lease_name: String,
    pub token: Option<String>,
    pub lease_uid: Option<String>,
    pub previous: Option<(Option<String>, Option<String>)>,
    pub mode: Mode,
}

impl Judgement {
    pub fn attempt(&self) -> WriteAttempt<'_> {
        WriteAttempt {
            lease_name: &self.lease_name,
            namespace: &self.namespace,
            token: self.token.as_deref(),
            lease_uid: self.lease_uid.as_deref(),
            previous: self
                .previous
                .as_ref()
                .map(|(t, u)| (t.as_deref(), u.as_deref())),
        }
    }
}

/// An answer that refuses a request that could not be read at all.
pub fn unreadable(reason: &str) -> AdmissionReview<DynamicObject> {
    AdmissionResponse::invalid(format!(
        "fencedlease: cannot read the AdmissionReview: {reason}"
    ))
    .into_review()
}

/// The parts of an AdmissionReview that the fencing decision reads. Everything else (the
/// objects' data, spec, status and managedFields, the user info) is skipped by the parser without
/// being built: reading the review is most of the webhook's work per request.
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
    sub_resource: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    object: Option<ObjectIn>,
    #[serde(default)]
    old_object: Option<ObjectIn>,
}

#[derive(Deserialize, Default)]
struct ObjectIn {
    #[serde(default)]
    metadata: MetaIn,
}

#[derive(Deserialize, Default)]
struct MetaIn {
    #[serde(default)]
    labels: Option<BTreeMap<String, String>>,
    #[serde(default)]
    annotations: Option<BTreeMap<String, String>>,
}

fn annotation<'a>(o: &'a ObjectIn, key: &str) -> Option<&'a str> {
    o.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
}

fn label<'a>(o: &'a ObjectIn, key: &str) -> Option<&'a str> {
    o.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(key))
        .map(String::as_str)
        .filter(|v| !v.is_empty())
}

/// An allowing answer to the request `uid`, in the review version the API server sent.
fn allowing(api_version: &str, uid: &str) -> AdmissionResponse {
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
pub fn parse(body: &[u8]) -> Parsed {
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
    if req.sub_resource.as_deref().is_some_and(|s| !s.is_empty()) {
        return Parsed::Pass(Box::new(response), "subresource");
    }
    let (new, old) = match req.operation {
        Operation::Create | Operation::Update => (req.object.as_ref(), req.old_object.as_ref()),
        _ => return Parsed::Pass(Box::new(response), "not_a_write"),
    };
    let Some(new) = new else {
        return invalid(
            response
                .deny("fencedlease: a create or update without an object")
                .into_review(),
        );
    };
    // The stored object's label decides (removing the label is itself a protected write).
    let lease_name = old
        .and_then(|o| label(o, LEASE_LABEL))
        .or_else(|| label(new, LEASE_LABEL));
    let Some(lease_name) = lease_name else {
        return Parsed::Pass(Box::new(response), "unlabelled");
    };
    let Some(namespace) = req.namespace.clone().filter(|n| !n.is_empty()) else {
        let msg = format!(
            "fencedlease: only namespaced objects can be protected (label {LEASE_LABEL} on a cluster-scoped object)"
        );
        return invalid(response.deny(msg).into_review());
    };
    // The stored object's mode decides, so a stale writer cannot switch enforcement off.
    let mode_source = old.unwrap_or(new);
    Parsed::Judge(Box::new(Judgement {
        lease_name: lease_name.to_string(),
        token: annotation(new, TOKEN_ANNOTATION).map(str::to_string),
        lease_uid: annotation(new, LEASE_UID_ANNOTATION).map(str::to_string),
        previous: old.map(|o| {
            (
                annotation(o, TOKEN_ANNOTATION).map(str::to_string),
                annotation(o, LEASE_UID_ANNOTATION).map(str::to_string),
            )
        }),
        mode: Mode::from_annotation(annotation(mode_source, MODE_ANNOTATION)),
        response,
        namespace,
    }))
}

/// The verdict as an AdmissionResponse, with the metric label of the outcome.
pub fn respond(j: &Judgement, lease: Option<&LeaseView>) -> (AdmissionResponse, &'static str) {
    let w = j.attempt();
    match decide(&w, lease) {
        Verdict::Allow => (j.response.clone(), "allowed"),
        Verdict::Refuse(r) => refuse(j, &r),
    }
}

/// Refuses (or, in warn mode, allows with a warning).
pub fn refuse(j: &Judgement, r: &Refusal) -> (AdmissionResponse, &'static str) {
    let msg = r.message(&j.attempt());
    match j.mode {
        Mode::Warn => {
            let mut resp = j.response.clone();
            resp.warnings = Some(vec![format!("{msg} (allowed: {MODE_ANNOTATION}=warn)")]);
            (resp, "warned")
        }
        Mode::Enforce => {
            let mut resp = j.response.clone();
            resp.allowed = false;
            resp.result = Status::failure(&msg, "Conflict").with_code(409);
            (resp, r.metric_label())
        }
    }
}

/// Refuses because the lease could not be read to confirm a decision (fail closed).
pub fn unconfirmed(j: &Judgement, detail: &str) -> (AdmissionResponse, &'static str) {
    let mut resp = j.response.clone();
    resp.allowed = false;
    resp.result = Status::failure(
        &format!(
            "fencedlease: could not read FencedLease {}/{} to confirm the token ({detail}); retry",
            j.namespace, j.lease_name
        ),
        "ServiceUnavailable",
    )
    .with_code(503);
    (resp, "error")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn review(op: &str, object: serde_json::Value, old: Option<serde_json::Value>) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "req-1",
                "kind": {"group": "", "version": "v1", "kind": "ConfigMap"},
                "resource": {"group": "", "version": "v1", "resource": "configmaps"},
                "name": "inventory",
                "namespace": "shop",
                "operation": op,
                "userInfo": {"username": "alice"},
                "object": object,
                "oldObject": old,
                "dryRun": false
            }
        }))
        .expect("json")
    }

    fn cm(labels: serde_json::Value, annotations: serde_json::Value) -> serde_json::Value {
        serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "inventory", "namespace": "shop", "labels": labels, "annotations": annotations}})
    }

    fn judge(body: &[u8]) -> Judgement {
        match parse(body) {
            Parsed::Judge(j) => *j,
            other => panic!("expected a judgement, got {other:?}"),
        }
    }

    #[test]
    fn unlabelled_deletes_and_subresources_pass() {
        let b = review(
            "CREATE",
            cm(serde_json::json!({}), serde_json::json!({})),
            None,
        );
        assert!(matches!(parse(&b), Parsed::Pass(_, "unlabelled")));
        let labelled = cm(
            serde_json::json!({LEASE_LABEL: "inv"}),
            serde_json::json!({}),
        );
        let b = review("DELETE", serde_json::Value::Null, Some(labelled));
        assert!(matches!(parse(&b), Parsed::Pass(_, "not_a_write")));
    }

    #[test]
    fn the_stored_label_and_mode_decide_on_update() {
        let old = cm(
            serde_json::json!({LEASE_LABEL: "inv"}),
            serde_json::json!({TOKEN_ANNOTATION: "7", LEASE_UID_ANNOTATION: "u"}),
        );
        // The new object drops the label and asks for warn mode: still judged, enforced.
        let new = cm(
            serde_json::json!({}),
            serde_json::json!({MODE_ANNOTATION: "warn", TOKEN_ANNOTATION: "3"}),
        );
        let j = judge(&review("UPDATE", new, Some(old)));
        assert_eq!(j.lease_name, "inv");
        assert_eq!(j.mode, Mode::Enforce);
        assert_eq!(j.token.as_deref(), Some("3"));
        assert_eq!(j.previous, Some((Some("7".into()), Some("u".into()))));
        assert_eq!(j.response.uid, "req-1");
    }

    #[test]
    fn refusals_are_409_with_the_message_and_warn_mode_allows_with_a_warning() {
        let new = cm(
            serde_json::json!({LEASE_LABEL: "inv"}),
            serde_json::json!({TOKEN_ANNOTATION: "3", LEASE_UID_ANNOTATION: "u"}),
        );
        let j = judge(&review("CREATE", new, None));
        let lease = LeaseView {
            uid: "u".into(),
            generation: 4,
            holder: Some("b".into()),
        };
        let (resp, label) = respond(&j, Some(&lease));
        assert!(!resp.allowed);
        assert_eq!(resp.result.code, 409);
        assert_eq!(label, "denied_stale");
        assert!(
            resp.result.message.contains("stale token 3"),
            "{}",
            resp.result.message
        );
        let mut warn = j;
        warn.mode = Mode::Warn;
        let (resp, label) = respond(&warn, Some(&lease));
        assert!(resp.allowed);
        assert_eq!(label, "warned");
        assert!(resp
            .warnings
            .is_some_and(|w| w[0].contains("stale token 3")));
    }

    #[test]
    fn the_answer_speaks_the_review_version_and_echoes_the_uid() {
        let new = cm(
            serde_json::json!({LEASE_LABEL: "inv"}),
            serde_json::json!({TOKEN_ANNOTATION: "3", LEASE_UID_ANNOTATION: "u"}),
        );
        let mut v: serde_json::Value =
            serde_json::from_slice(&review("CREATE", new, None)).expect("json");
        v["apiVersion"] = "admission.k8s.io/v1beta1".into();
        // What the decision does not read may be anything: data, managedFields, user info.
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
            parse(&serde_json::to_vec(&v).expect("json")),
            Parsed::Invalid(_)
        ));
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
            match parse(body) {
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
            let _ = parse(&body);
        }

        #[test]
        fn parse_and_respond_never_panic_on_odd_objects(
            op in prop_oneof!["CREATE", "UPDATE", "DELETE", "CONNECT", "BOGUS"],
            lease in "\\PC{0,12}", token in "\\PC{0,24}", uid in "\\PC{0,8}", mode in "\\PC{0,6}",
            with_old in any::<bool>(),
        ) {
            let obj = cm(serde_json::json!({LEASE_LABEL: lease}),
                serde_json::json!({TOKEN_ANNOTATION: token, LEASE_UID_ANNOTATION: uid, MODE_ANNOTATION: mode}));
            let b = review(&op, obj.clone(), with_old.then_some(obj));
            if let Parsed::Judge(j) = parse(&b) {
                let lv = LeaseView { uid: uid.clone(), generation: 3, holder: Some("h".into()) };
                let _ = respond(&j, Some(&lv));
                let _ = respond(&j, None);
            }
        }
    }
}
