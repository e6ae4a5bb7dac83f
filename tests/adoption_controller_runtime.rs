//! A controller-runtime operator fenced in a few lines (issue 35), against the real API server
//! and the real fencing webhook:
//!
//! - the Go FencedLease lock (clients/go/kube) meets client-go's expectations of a
//!   `resourcelock.Interface` (create, get, update, identity, describe; a reused identity
//!   never inherits a token) and elects through `leaderelection.RunOrDie`: its Go integration
//!   tests run here, with a namespace of their own;
//! - two replicas of the sample operator (examples/controller-runtime: the manager elects
//!   through the lock and writes through `fencedkube.NewClient`) play the frozen-leader story
//!   of tests/common/samples.rs.
//!
//! Go (1.26 or later, as the modules' go.mod says) must be on PATH; the modules come from the
//! Go module proxy into Go's own caches on the first run. Without Go the test fails.

use fencedlease_testkit as common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::procs::scratch_dir;
use common::{client, ensure_crd, repo_root, TestNamespace};

/// `go ARGS` in `dir`, with `env`; its combined output, or a failure that shows it.
fn go(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> String {
    let out = Command::new("go")
        .args(args)
        .current_dir(dir)
        .envs(env.iter().copied())
        .output()
        .unwrap_or_else(|e| panic!("running go (is Go 1.26 or later on PATH?): {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "go {}: {text}", args.join(" "));
    text
}

#[tokio::test]
async fn the_go_lock_meets_client_gos_expectations_and_elects_through_run_or_die() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "go-lock").await;
    let kubeconfig = common::kubeconfig_path();
    let out = go(
        &repo_root().join("clients/go/kube"),
        &["test", "-count=1", "-v", "-run", "Integration", "./..."],
        &[
            ("KUBECONFIG", kubeconfig.to_str().expect("utf-8")),
            ("FENCEDKUBE_IT_NAMESPACE", &ns.name),
            ("FENCEDKUBE_IT_REQUIRED", "1"),
        ],
    );
    for test in [
        "TestIntegrationLockMeetsClientGosExpectations",
        "TestIntegrationRunOrDieElectsThroughTheLock",
        "TestIntegrationALeaseBeingDeletedElectsNobody",
    ] {
        assert!(
            out.contains(&format!("--- PASS: {test}")),
            "{test} did not pass: {out}"
        );
    }
}

#[tokio::test]
async fn a_frozen_leaders_stamped_write_is_refused_and_the_new_leaders_lands() {
    let bin: PathBuf = scratch_dir("controller-runtime-build").join("fenced-operator");
    go(
        &repo_root().join("examples/controller-runtime"),
        &["build", "-o", bin.to_str().expect("utf-8"), "./cmd"],
        &[],
    );
    common::samples::frozen_leader_story(&bin, "controller-runtime").await;
}
