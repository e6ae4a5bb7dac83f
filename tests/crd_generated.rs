//! The committed CRDs are exactly what `fencedlease crd` prints (no hand-written YAML): the one
//! with validation rules in crds/, the one without in crds/pre-1.25/.

use std::process::Command;

use fencedlease::crdgen::{self, CRD_PATH, PRE_RULES_CRD_PATH, RULES_KEY};

fn printed(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_fencedlease"))
        .arg("crd")
        .args(args)
        .output()
        .expect("run fencedlease crd");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

#[test]
fn committed_crds_match_generated() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for (path, args) in [
        (CRD_PATH, &[][..]),
        (PRE_RULES_CRD_PATH, &["--without-validation-rules"][..]),
    ] {
        let committed = std::fs::read_to_string(root.join(path))
            .unwrap_or_else(|e| panic!("reading {path}: {e}"));
        assert!(
            committed == printed(args),
            "{path} is out of date with elector/src/api.rs: run `hack/gen-crd.sh` and commit the result"
        );
    }
}

#[test]
fn the_crd_for_old_servers_has_no_fields_the_1_20_server_rejects() {
    // kubectl's client-side validation, server-side apply and Helm 4 refuse fields the 1.20
    // server does not know (measured: "unknown field", "field not declared in schema"), and CEL
    // rules are not enforced before 1.25: the CRD for those servers must use none.
    let yaml = crdgen::crd_yaml_without_rules().expect("crd yaml");
    for field in [RULES_KEY, "selectableFields"] {
        assert!(
            !yaml.contains(field),
            "the pre-1.25 CRD must not use {field}"
        );
    }
    // The 1.20 server refuses an empty-string `default` ("must be of type string: null").
    for yaml in [yaml, crdgen::crd_yaml().expect("crd yaml")] {
        assert!(
            !yaml.contains("default: ''"),
            "the CRD must not default a string to ''"
        );
    }
}

/// Every `x-kubernetes-validations` entry in a schema, with the path of the property it sits on.
fn rules_in(path: &str, schema: &serde_json::Value, out: &mut Vec<(String, serde_json::Value)>) {
    if let Some(rules) = schema.get(RULES_KEY).and_then(|r| r.as_array()) {
        out.extend(rules.iter().map(|r| (path.to_string(), r.clone())));
    }
    if let Some(props) = schema.get("properties").and_then(|p| p.as_object()) {
        for (name, child) in props {
            rules_in(&format!("{path}.{name}"), child, out);
        }
    }
    if let Some(items) = schema.get("items") {
        rules_in(&format!("{path}[]"), items, out);
    }
}

#[test]
fn the_crd_for_current_servers_has_exactly_the_rules_of_src_api_with_fields_1_25_knows() {
    let crd = serde_json::to_value(crdgen::crd()).expect("crd json");
    let mut rules = Vec::new();
    rules_in(
        "",
        &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"],
        &mut rules,
    );
    let want = [
        (
            ".status",
            fencedlease::api::STATUS_HOLDER_AND_TOKEN_TOGETHER,
        ),
        (".status", fencedlease::api::STATUS_DURATION_NEEDS_HOLDER),
        (
            ".status.leaseTransitions",
            fencedlease::api::TRANSITIONS_NEVER_DECREASE,
        ),
    ];
    let got: Vec<(&str, &str, &str)> = rules
        .iter()
        .map(|(path, r)| {
            // `reason`, `fieldPath`, `messageExpression` and `optionalOldSelf` came after 1.25:
            // servers that do not know them refuse the CRD as the 1.20 server refuses the rules.
            let keys: Vec<&String> = r.as_object().expect("a rule is an object").keys().collect();
            assert!(
                keys.iter().all(|k| *k == "rule" || *k == "message"),
                "{path}: only `rule` and `message`, which every server from 1.25 knows: {r}"
            );
            (
                path.as_str(),
                r["rule"].as_str().unwrap_or_default(),
                r["message"].as_str().unwrap_or_default(),
            )
        })
        .collect();
    let want: Vec<(&str, &str, &str)> = want.iter().map(|(p, (r, m))| (*p, *r, *m)).collect();
    assert_eq!(got, want);
}
