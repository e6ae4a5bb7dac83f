//! The module graph keeps its layers (ARCHITECTURE.md, "Layers"): a file of `src/` names
//! `crate::X` only for an X of a lower layer or of its own folder. From the bottom:
//!
//! 0. the elector crate, re-exported as `api`, `lease` and `stamp`;
//! 1. the shared plumbing: `runtime`, `probe`, `crdgen`;
//! 2. the roles: `campaign`, `controller`, `sidecar`, `webhook`, `plugin`; no role names another;
//! 3. `cli` and `main`, which wire the roles.
//!
//! A source scan, no cluster needed. It reads `crate::` paths in code (comments left out), so a
//! layer crossed by a `use` or by a path written out in full fails alike.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn layer(module: &str) -> Option<u8> {
    match module {
        "api" | "lease" | "stamp" => Some(0),
        "runtime" | "probe" | "crdgen" => Some(1),
        "campaign" | "controller" | "sidecar" | "webhook" | "plugin" => Some(2),
        "cli" | "main" | "lib" => Some(3),
        _ => None,
    }
}

/// The top-level module a file of `src/` belongs to: its folder, or its own name.
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("under src/");
    let first = rel.components().next().expect("a component");
    let name = first.as_os_str().to_string_lossy();
    name.strip_suffix(".rs").unwrap_or(&name).to_string()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src/") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level modules named by `crate::` paths in `code`, line comments and doc comments
/// left out.
fn named(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in code.lines() {
        let line = line.split("//").next().unwrap_or("");
        let mut rest = line;
        while let Some(i) = rest.find("crate::") {
            let after = &rest[i + "crate::".len()..];
            let ident = |s: &str| -> String {
                s.trim_start()
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect()
            };
            // `use crate::{a::X, b}` names a and b.
            let names: Vec<String> = match after.strip_prefix('{') {
                Some(group) => group
                    .split('}')
                    .next()
                    .unwrap_or("")
                    .split(',')
                    .map(ident)
                    .collect(),
                None => vec![ident(after)],
            };
            // `fencedlease_elector::...` and `$crate::` are other crates' paths.
            let before = &rest[..i];
            if !before.ends_with('$') && !before.ends_with('_') {
                out.extend(names.into_iter().filter(|n| !n.is_empty()));
            }
            rest = after;
        }
    }
    out
}

/// Every (file, module it names) that crosses the layers upward or sideways.
fn crossings(src: &Path) -> Vec<String> {
    let mut files = vec![];
    rust_files(src, &mut files);
    files.sort();
    let mut bad = vec![];
    for file in &files {
        let own = module_of(src, file);
        let Some(own_layer) = layer(&own) else {
            bad.push(format!(
                "{}: module {own} has no layer here",
                file.display()
            ));
            continue;
        };
        let code = std::fs::read_to_string(file).expect("read a source file");
        for target in named(&code) {
            if target == own {
                continue;
            }
            match layer(&target) {
                Some(l) if l < own_layer => {}
                Some(l) => bad.push(format!(
                    "{}: {own} (layer {own_layer}) names crate::{target} (layer {l})",
                    file.display()
                )),
                None => bad.push(format!(
                    "{}: crate::{target} is in no layer (add it to this test and ARCHITECTURE.md)",
                    file.display()
                )),
            }
        }
    }
    bad
}

#[test]
fn no_module_names_one_of_its_own_layer_or_above() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let bad = crossings(&src);
    assert!(bad.is_empty(), "layers crossed:\n{}", bad.join("\n"));
}

#[test]
fn the_scan_sees_a_crossing_and_ignores_comments() {
    let code = "use crate::controller::pods::PodIndex;\n// crate::webhook in a comment\nlet x = crate::api::KEY; $crate::x; fencedlease_crate::y\nuse crate::{sidecar::proxy, runtime};";
    assert_eq!(
        named(code),
        ["controller", "api", "sidecar", "runtime"]
            .map(String::from)
            .into()
    );
}
