//! Sidecar token files left by an earlier run (a crash, an OOM kill, a liveness restart) are
//! gone before the new run can lead, and before anything at start-up can fail: the token dir is
//! an emptyDir the app shares, and a stale file would tell the app it leads.

use fencedlease_testkit as common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::procs::scratch_dir;
use common::sidecars::sidecar;
use common::webhook::free_port;
use common::{client, ensure_crd, eventually, TestNamespace};
use fencedlease::api::{FencedLease, FencedLeaseSpec};
use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;
use serde_json::json;

/// What a previous incarnation that led with `token` left behind.
fn leave_stale_files(token_dir: &Path, token: i64, uid: &str) {
    std::fs::create_dir_all(token_dir).expect("token dir");
    std::fs::write(token_dir.join("token"), format!("{token}\n")).expect("token");
    std::fs::write(token_dir.join("lease-uid"), format!("{uid}\n")).expect("lease-uid");
    std::fs::write(token_dir.join("token.tmp"), "half").expect("token.tmp");
}

fn token_files_in(token_dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(token_dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// `fencedlease sidecar` with `args`, run to its end (it must fail at start-up).
fn sidecar_that_fails(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fencedlease"))
        .arg("sidecar")
        .args(args)
        // Nowhere to connect: if the process got that far, it would fail there.
        .env("KUBECONFIG", "/nonexistent/kubeconfig")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .expect("running fencedlease sidecar");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn stale_token_files_are_removed_before_anything_at_start_up_can_fail() {
    let dir = scratch_dir("stale-early");
    let token_dir = dir.join("token");
    leave_stale_files(&token_dir, 7, "uid-of-a-past-life");
    // The first check after the removal refuses this address.
    let (code, err) = sidecar_that_fails(&[
        "--lease",
        "db",
        "--listen",
        "0.0.0.0:8787",
        "--token-dir",
        token_dir.to_str().expect("utf-8"),
    ]);
    assert_ne!(code, Some(0), "{err}");
    assert!(err.contains("not a loopback address"), "{err}");
    assert_eq!(token_files_in(&token_dir), Vec::<String>::new(), "{err}");
}

#[test]
fn a_stale_token_file_that_cannot_be_removed_keeps_the_sidecar_from_starting() {
    let dir = scratch_dir("stale-stuck");
    let token_dir = dir.join("token");
    // A non-empty directory where the token file goes: it cannot be removed (not even by root).
    std::fs::create_dir_all(token_dir.join("token").join("x")).expect("dir");
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let (code, err) = sidecar_that_fails(&[
        "--lease",
        "db",
        "--listen",
        &listen,
        "--token-dir",
        token_dir.to_str().expect("utf-8"),
    ]);
    assert_ne!(code, Some(0), "{err}");
    let path = token_dir.join("token").display().to_string();
    assert!(err.contains(&path), "the error names the file: {err}");
    assert!(
        err.contains("left by an earlier run") && err.contains("make the token dir writable"),
        "the error says why and what to do: {err}"
    );
    assert!(
        !err.contains("connecting to Kubernetes"),
        "it stopped before connecting: {err}"
    );
}

/// pod-a's sidecar crashed while it led; pod-b leads now. The restarted sidecar of pod-a finds
/// its old token files: they are gone by the time it answers at all, stay gone while it
/// follows, and when it leads again the file holds its new token.
#[tokio::test]
async fn a_restarted_sidecar_shows_no_token_file_until_it_leads_again() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "stale-token").await;
    let dir = scratch_dir("stale-token");
    let api: Api<FencedLease> = Api::namespaced(client.clone(), &ns.name);
    let mut spec = FencedLeaseSpec::free();
    spec.holder_identity = Some("pod-b".into());
    spec.lease_duration_seconds = 3600;
    let lease = api
        .create(&PostParams::default(), &FencedLease::new("db", spec))
        .await
        .expect("create a lease that pod-b holds");
    let current = lease.token().expect("generation");
    let uid = lease.metadata.uid.clone().expect("uid");
    // The file pod-a's last run left: a real token of this lease, one pod-b's replaced.
    let token_dir = dir.join("pod-a-token");
    leave_stale_files(&token_dir, current - 1, &uid);

    let car = sidecar(&dir, &ns.name, "db", "pod-a", &[]);
    assert_eq!(
        car.token_dir, token_dir,
        "the sidecar uses the folder the stale files are in"
    );
    let a = &car.proc;
    // The first answer the sidecar gives comes after the removal.
    let first = eventually(Duration::from_secs(20), "the sidecar API", || async {
        car.status()
    })
    .await;
    assert_eq!(
        token_files_in(&token_dir),
        [fencedlease::api::API_SECRET_FILE],
        "stale files at the first answer ({first}), or other than the API secret:\n{}",
        a.log_tail()
    );
    // While it follows pod-b, there is no token file.
    let follows = eventually(
        Duration::from_secs(20),
        "pod-a to see pod-b lead",
        || async { car.status().filter(|s| s["holder"] == "pod-b") },
    )
    .await;
    assert_eq!(follows["leading"], false, "{follows}");
    for _ in 0..10 {
        assert!(!token_dir.join("token").exists(), "{}", a.log_tail());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // pod-b lets go; pod-a leads, and only now is there a token file: with the new token.
    api.patch(
        "db",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"holderIdentity": null}})),
    )
    .await
    .expect("release the lease for pod-b");
    let led = eventually(Duration::from_secs(20), "pod-a to lead", || async {
        car.status().filter(|s| s["leading"] == true)
    })
    .await;
    let token = led["token"].as_i64().expect("token");
    assert!(token > current, "{led}");
    let file = eventually(Duration::from_secs(30), "pod-a's token file", || async {
        std::fs::read_to_string(token_dir.join("token")).ok()
    })
    .await;
    assert_eq!(file, format!("{token}\n"));
}
