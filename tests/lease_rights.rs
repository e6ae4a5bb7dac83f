//! A workload's ServiceAccount may campaign for its own FencedLeases and touch no other lease of
//! its namespace: neither take one over (write its holder) nor keep a dead one alive (write its
//! status.renewTime). Shown for the chart's per-lease Roles (value `workloads`, rendered with
//! `helm template` and applied with kubectl) and for the documented `kubectl create role
//! --resource-name` recipe, against the real API server, by impersonation: `kubectl auth can-i`,
//! the full list of what each identity may write, real reads and writes, and a real
//! `fencedlease campaign` acting as the workload (it leads its own lease, never another).
//!
//! What RBAC cannot do, and this does not claim: tell apart two pods of the same ServiceAccount.
//! Each may renew the other's tenure of their shared lease.

use fencedlease_testkit as common;

use std::collections::BTreeSet;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::helm::{denied, eventually_allowed, extra_writes, spawn_as, Release};
use common::procs::{scratch_dir, Proc};
use common::{client, ensure_crd, kubectl, try_eventually, TestNamespace};
use serde_json::{json, Value};

const LEASES: &str = "fencedleases.fencedlease.io";

/// Runs kubectl and panics with its output unless it succeeds; returns stdout.
fn kubectl_ok(args: &[&str]) -> String {
    let (ok, out, err) = kubectl(args);
    assert!(ok, "kubectl {} failed:\n{err}\n{out}", args.join(" "));
    out
}

/// Writes `content` to a file of its own for `kubectl -f`.
fn temp_file(ns: &str, what: &str, content: &str) -> String {
    let dir = std::env::temp_dir().join(format!("fencedlease-{ns}"));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join(format!("{what}-{}.json", common::rand_u32()));
    std::fs::write(&file, content).expect("writing a temp file");
    file.to_str().expect("utf-8 path").to_string()
}

/// The workloads' Roles and RoleBindings as `helm template` renders them for `workloads`.
fn workload_rbac(release: &Release, workloads: &Value) -> Vec<Value> {
    use serde::Deserialize;
    let rendered = release.run(
        "template",
        &[
            "--set-json",
            &format!("workloads={workloads}"),
            "--show-only",
            "templates/rbac.yaml",
        ],
    );
    serde_yaml_ng::Deserializer::from_str(&rendered)
        .map(|d| Value::deserialize(d).unwrap_or_else(|e| panic!("rendered YAML: {e}")))
        .filter(|d| d["metadata"]["labels"]["app.kubernetes.io/component"] == "workload")
        .collect()
}

/// `kubectl replace` of `obj` (or of its status) as `who`: whether the server allowed it. Any
/// refusal but RBAC's fails the test, so that a conflict cannot pass for a denial.
fn replace_as(ns: &str, who: &str, obj: &Value, status: bool) -> bool {
    let file = temp_file(ns, "replace", &obj.to_string());
    let mut args = vec!["replace", "--as", who, "-n", ns, "-f", &file];
    if status {
        args.push("--subresource=status");
    }
    let (ok, _, err) = kubectl(&args);
    assert!(
        ok || err.contains("forbidden"),
        "kubectl {}: {err}",
        args.join(" ")
    );
    ok
}

fn lease_json(ns: &str, lease: &str) -> Value {
    serde_json::from_str(&kubectl_ok(&["get", LEASES, lease, "-n", ns, "-o", "json"]))
        .expect("lease JSON")
}

/// As `who`, sets the lease's holder (a takeover) and then its renewTime (a renewal), with
/// real requests; returns whether each was allowed.
fn try_takeover_and_renewal(ns: &str, who: &str, lease: &str) -> (bool, bool) {
    let mut obj = lease_json(ns, lease);
    obj["spec"]["holderIdentity"] = json!(format!("{}-pod", who.rsplit(':').next().unwrap()));
    let took_over = replace_as(ns, who, &obj, false);
    // Read again: a takeover moved resourceVersion on.
    let mut obj = lease_json(ns, lease);
    obj["status"]["renewTime"] = json!("2030-01-01T00:00:00.000000Z");
    let renewed = replace_as(ns, who, &obj, true);
    (took_over, renewed)
}

/// Whether `who` may list the lease by name (the candidate's watch lists, then watches, with
/// fieldSelector metadata.name).
fn lists_by_name(ns: &str, who: &str, lease: &str) -> bool {
    let selector = format!("metadata.name={lease}");
    let args = [
        "get",
        LEASES,
        "--as",
        who,
        "-n",
        ns,
        "--field-selector",
        &selector,
        "-o",
        "jsonpath={.items[*].metadata.name}",
    ];
    let (ok, out, err) = kubectl(&args);
    assert!(
        ok || err.contains("forbidden"),
        "kubectl {}: {err}",
        args.join(" ")
    );
    ok && out.trim() == lease
}

/// `who` may do to `own` all a candidate does, and nothing to `others` or the namespace.
async fn check(ns: &str, who: &str, own: &[&str], others: &[&str]) {
    for lease in own {
        let named = format!("{LEASES}/{lease}");
        for args in [
            &["get", &named, "-n", ns][..],
            &["list", &named, "-n", ns],
            &["watch", &named, "-n", ns],
            &["update", &named, "-n", ns],
            &["update", &named, "--subresource=status", "-n", ns],
        ] {
            eventually_allowed(who, args).await;
        }
        assert!(lists_by_name(ns, who, lease), "{who} cannot list {lease}");
        assert_eq!(
            try_takeover_and_renewal(ns, who, lease),
            (true, true),
            "{who} must be able to acquire and renew {lease}"
        );
        for args in [
            &["delete", &named, "-n", ns][..],
            &["patch", &named, "-n", ns],
        ] {
            denied(who, args);
        }
    }
    for lease in others {
        let named = format!("{LEASES}/{lease}");
        for args in [
            &["get", &named, "-n", ns][..],
            &["list", &named, "-n", ns],
            &["watch", &named, "-n", ns],
            &["update", &named, "-n", ns],
            &["update", &named, "--subresource=status", "-n", ns],
            &["patch", &named, "-n", ns],
            &["patch", &named, "--subresource=status", "-n", ns],
            &["delete", &named, "-n", ns],
        ] {
            denied(who, args);
        }
        assert!(!lists_by_name(ns, who, lease), "{who} lists {lease}");
        assert_eq!(
            try_takeover_and_renewal(ns, who, lease),
            (false, false),
            "{who} took over or renewed {lease}, which is not its own"
        );
    }
    for args in [
        &["list", LEASES, "-n", ns][..],
        &["watch", LEASES, "-n", ns],
        &["update", LEASES, "-n", ns],
        &["create", LEASES, "-n", ns],
        &["deletecollection", LEASES, "-n", ns],
        &["get", "secrets", "-n", ns],
        &["patch", "pods", "-n", ns],
    ] {
        denied(who, args);
    }
}

/// A real `fencedlease campaign` for `lease`, acting as `who`; its command writes the token it
/// was given to the returned file and then waits.
fn campaign_as(dir: &Path, ns: &str, who: &str, lease: &str) -> (Proc, PathBuf) {
    let name = format!("{}-{lease}", who.rsplit(':').next().unwrap());
    let token_file = dir.join(format!("{name}.token"));
    let proc = spawn_as(
        who,
        &name,
        dir,
        &[
            "campaign",
            "--lease",
            lease,
            "--namespace",
            ns,
            "--identity",
            &name,
            "--lease-duration",
            "15",
            "--",
            "sh",
            "-c",
            "echo \"$FENCEDLEASE_TOKEN\" > \"$0\"; sleep 60",
            token_file.to_str().expect("utf-8"),
        ],
    );
    (proc, token_file)
}

/// Waits up to `timeout` for the campaign's command to have run; returns the token it got.
async fn token_within(token_file: &Path, timeout: Duration) -> Option<String> {
    try_eventually(timeout, || async {
        match std::fs::read_to_string(token_file) {
            Ok(t) if !t.trim().is_empty() => Ok(t.trim().to_string()),
            _ => Err(()),
        }
    })
    .await
    .ok()
}

/// Exactly the writes `check` expects, as `kubectl auth can-i --list` shows them.
fn expected_writes(own: &[&str]) -> BTreeSet<String> {
    own.iter()
        .flat_map(|l| {
            [
                format!("update {LEASES}/{l}"),
                format!("update {LEASES}/status/{l}"),
            ]
        })
        .collect()
}

#[tokio::test]
async fn a_workload_may_campaign_only_for_its_own_leases() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "lease-rights").await;
    let release = Release::new(&ns, "flw");
    let n = ns.name.as_str();

    // Leases, and the ServiceAccounts of three workloads sharing the namespace.
    for lease in ["mine", "mine-too", "theirs", "recipes"] {
        let obj = json!({"apiVersion": "fencedlease.io/v1alpha1", "kind": "FencedLease",
            "metadata": {"name": lease}, "spec": {"leaseDurationSeconds": 15}});
        kubectl_ok(&[
            "create",
            "-n",
            n,
            "-f",
            &temp_file(n, lease, &obj.to_string()),
        ]);
    }
    for sa in ["worker", "neighbour", "cook"] {
        kubectl_ok(&["create", "serviceaccount", sa, "-n", n]);
    }

    // worker and neighbour through the chart's `workloads` value (helm template | kubectl
    // apply: only these namespaced objects, gone with the namespace).
    let workloads = json!([
        {"namespace": n, "serviceAccount": "worker", "leases": ["mine", "mine-too"]},
        {"namespace": n, "serviceAccount": "neighbour", "leases": ["theirs"]},
    ]);
    let docs = workload_rbac(&release, &workloads);
    let mut kinds: Vec<String> = docs
        .iter()
        .map(|d| {
            format!(
                "{}/{}",
                d["kind"].as_str().unwrap(),
                d["metadata"]["name"].as_str().unwrap()
            )
        })
        .collect();
    kinds.sort();
    let full = release.fullname();
    assert_eq!(
        kinds,
        [
            format!("Role/{full}-neighbour"),
            format!("Role/{full}-worker"),
            format!("RoleBinding/{full}-neighbour"),
            format!("RoleBinding/{full}-worker"),
        ]
    );
    let list = json!({"apiVersion": "v1", "kind": "List", "items": docs});
    kubectl_ok(&[
        "apply",
        "-n",
        n,
        "-f",
        &temp_file(n, "rbac", &list.to_string()),
    ]);

    // cook through the recipe the README gives, word for word.
    kubectl_ok(&[
        "-n",
        n,
        "create",
        "role",
        "cook-lease",
        "--verb=get,list,watch,update",
        "--resource=fencedleases.fencedlease.io,fencedleases.fencedlease.io/status",
        "--resource-name=recipes",
    ]);
    kubectl_ok(&[
        "-n",
        n,
        "create",
        "rolebinding",
        "cook-lease",
        "--role=cook-lease",
        &format!("--serviceaccount={n}:cook"),
    ]);

    let sa = |name: &str| format!("system:serviceaccount:{n}:{name}");
    let (worker, neighbour, cook) = (sa("worker"), sa("neighbour"), sa("cook"));

    // The real candidate, acting as worker: it leads its own free lease, and never the
    // neighbour's (free too).
    eventually_allowed(&worker, &["update", &format!("{LEASES}/mine"), "-n", n]).await;
    let dir = scratch_dir("lease-rights");
    let (own, own_token) = campaign_as(&dir, n, &worker, "mine");
    let (other, other_token) = campaign_as(&dir, n, &worker, "theirs");
    assert!(
        token_within(&own_token, Duration::from_secs(30))
            .await
            .is_some(),
        "worker's campaign did not lead its own lease:\n{}",
        own.log_tail()
    );
    assert_eq!(
        token_within(&other_token, Duration::from_secs(3)).await,
        None,
        "worker's campaign led the neighbour's lease"
    );
    assert!(
        std::fs::read_to_string(&other.log)
            .unwrap_or_default()
            .to_lowercase()
            .contains("forbidden"),
        "worker's campaign for theirs was not refused:\n{}",
        other.log_tail()
    );
    assert_eq!(
        kubectl_ok(&[
            "get",
            LEASES,
            "theirs",
            "-n",
            n,
            "-o",
            "jsonpath={.spec.holderIdentity}"
        ]),
        "",
        "the neighbour's lease got a holder"
    );
    drop((own, other));
    check(n, &worker, &["mine", "mine-too"], &["theirs", "recipes"]).await;
    check(n, &neighbour, &["theirs"], &["mine", "mine-too", "recipes"]).await;
    check(n, &cook, &["recipes"], &["mine", "theirs"]).await;

    // And nothing else to write, beyond what any authenticated identity may.
    assert_eq!(
        extra_writes(&worker, n),
        expected_writes(&["mine", "mine-too"])
    );
    assert_eq!(extra_writes(&neighbour, n), expected_writes(&["theirs"]));
    assert_eq!(extra_writes(&cook, n), expected_writes(&["recipes"]));
}
