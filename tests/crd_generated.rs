//! The committed CRD is exactly what `fencedlease crd` prints (no hand-written YAML).

use std::process::Command;

#[test]
fn committed_crd_matches_generated() {
    let out = Command::new(env!("CARGO_BIN_EXE_fencedlease"))
        .arg("crd")
        .output()
        .expect("run fencedlease crd");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let generated = String::from_utf8(out.stdout).expect("utf-8");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let path = fencedlease::crdgen::CRD_PATH;
    let committed =
        std::fs::read_to_string(root.join(path)).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    assert!(
        committed == generated,
        "{path} is out of date with src/api.rs: run `hack/gen-crd.sh` and commit the result"
    );
}

#[test]
fn crd_has_no_fields_the_1_20_server_rejects() {
    // Server-side apply of fields the 1.20 server does not know fails with HTTP 500, and CEL
    // rules are silently ignored there: the generated CRD must use neither.
    let yaml = fencedlease::crdgen::crd_yaml().expect("crd yaml");
    for field in ["x-kubernetes-validations", "selectableFields"] {
        assert!(!yaml.contains(field), "the CRD must not use {field}");
    }
    // The 1.20 server refuses an empty-string `default` ("must be of type string: null").
    assert!(
        !yaml.contains("default: ''"),
        "the CRD must not default a string to ''"
    );
}
