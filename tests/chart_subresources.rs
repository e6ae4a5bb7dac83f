//! The chart routes exactly the subresource writes that the one table of judged subresources
//! (`fencedlease::webhook::subresources::TABLE`) names, to the webhook that judges them as the
//! table says: writes judged like the object to the webhook that selects by label (and to the
//! policy), writes judged by their parent to the webhook that reads the parent. Chart templates
//! cannot read Rust, so this test renders the chart (`helm template`; no cluster needed) and
//! compares. Adding a row to the table without the chart makes it fail, saying what is missing.

use fencedlease_testkit as common;

use std::collections::BTreeSet;

use common::helm::{chart, helm_ok};
use common::policy::render_policy_with;
use common::webhook::table_rules;
use serde::Deserialize;
use serde_json::Value;

/// The fenced types the renders use: a core type, pods (which have rows of their own), an apps
/// type and a custom resource.
const FENCED: &str = r#"[{"group":"","resource":"configmaps"},{"group":"","resource":"pods"},{"group":"apps","resource":"deployments"},{"group":"example.com","resource":"widgets"}]"#;

fn fenced() -> Vec<(&'static str, Vec<&'static str>)> {
    vec![
        ("", vec!["configmaps"]),
        ("", vec!["pods"]),
        ("apps", vec!["deployments"]),
        ("example.com", vec!["widgets"]),
    ]
}

fn docs(yaml: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(yaml)
        .map(|d| Value::deserialize(d).expect("rendered YAML"))
        .filter(|v| !v.is_null())
        .collect()
}

/// (operation, group, resource) for every rule, autoscalers left out (not a subresource).
fn routed(rules: &[Value]) -> BTreeSet<(String, String, String)> {
    let s = |v: &Value| v.as_str().expect("a string").to_string();
    let mut out = BTreeSet::new();
    for r in rules {
        for g in r["apiGroups"].as_array().expect("apiGroups") {
            for res in r["resources"].as_array().expect("resources") {
                for op in r["operations"].as_array().expect("operations") {
                    if s(res) != "horizontalpodautoscalers" {
                        out.insert((s(op), s(g), s(res)));
                    }
                }
            }
        }
    }
    out
}

fn rules_of(webhook: &Value) -> Vec<Value> {
    webhook["rules"].as_array().expect("rules").clone()
}

#[test]
fn the_chart_routes_each_judged_subresource_as_the_table_says() {
    let c = chart();
    let set = format!("fencing.resources={FENCED}");
    let out = helm_ok(&[
        "template",
        "subs",
        &c,
        "--namespace",
        "ops",
        "--set-json",
        &set,
        "--show-only",
        "templates/webhooks.yaml",
    ]);
    let config = docs(&out)
        .into_iter()
        .find(|d| d["kind"] == "ValidatingWebhookConfiguration")
        .expect("a ValidatingWebhookConfiguration rendered");
    let hooks = config["webhooks"].as_array().expect("webhooks");
    let named = |name: &str| {
        hooks
            .iter()
            .find(|w| w["name"] == name)
            .unwrap_or_else(|| panic!("no webhook {name} rendered"))
    };
    let (judged, parents) = table_rules(&fenced());
    let (want_judged, want_parents) = (routed(&judged), routed(&parents));
    let got_judged = routed(&rules_of(named("fencing.fencedlease.io")));
    let got_parents = routed(&rules_of(named("scale.fencing.fencedlease.io")));
    assert_eq!(
        (
            want_judged.difference(&got_judged).collect::<Vec<_>>(),
            got_judged.difference(&want_judged).collect::<Vec<_>>()
        ),
        (vec![], vec![]),
        "the label-selecting webhook's rules differ from the table: (missing, extra)"
    );
    assert_eq!(
        (
            want_parents.difference(&got_parents).collect::<Vec<_>>(),
            got_parents.difference(&want_parents).collect::<Vec<_>>()
        ),
        (vec![], vec![]),
        "the parent-reading webhook's rules differ from the table: (missing, extra)"
    );
}

#[test]
fn the_policy_judges_the_subresources_the_table_judges_like_the_object() {
    let set = format!("fencing.resources={FENCED}");
    let out = render_policy_with("subs", "ops", &["--set-json", &set]);
    let policy = docs(&out)
        .into_iter()
        .find(|d| d["kind"] == "ValidatingAdmissionPolicy")
        .expect("a ValidatingAdmissionPolicy rendered");
    let rules = policy["spec"]["matchConstraints"]["resourceRules"]
        .as_array()
        .expect("resourceRules")
        .clone();
    let (judged, _) = table_rules(&fenced());
    let (want, got) = (routed(&judged), routed(&rules));
    assert_eq!(
        (
            want.difference(&got).collect::<Vec<_>>(),
            got.difference(&want).collect::<Vec<_>>()
        ),
        (vec![], vec![]),
        "the policy's rules differ from the table: (missing, extra)"
    );
}
