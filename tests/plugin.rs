//! `kubectl fencedlease` against a real API server: the binary run as `fencedlease kubectl ...`
//! (and once by its plugin name), leases held by real `fencedlease campaign` processes.

use fencedlease_testkit as common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::procs::{campaign, following, scratch_dir};
use common::{client, ensure_crd, eventually, kubeconfig_path, kubectl, TestNamespace};
use fencedlease::api::{FencedLease, FencedLeaseSpec};
use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use kube::Api;

struct Run {
    ok: bool,
    stdout: String,
    stderr: String,
}

/// Runs `program` with `args` against the test cluster, stdin not a terminal.
fn run_program(program: &std::path::Path, args: &[&str]) -> Run {
    run_with_kubeconfig(program, &kubeconfig_path(), args)
}

/// [`run_program`] with another kubeconfig (one acting as another user, say).
fn run_with_kubeconfig(
    program: &std::path::Path,
    kubeconfig: &std::path::Path,
    args: &[&str],
) -> Run {
    let out = Command::new(program)
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .stdin(Stdio::null())
        .output()
        .expect("running fencedlease");
    Run {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// `fencedlease kubectl -n NS ARGS...`.
fn plugin(ns: &str, args: &[&str]) -> Run {
    let mut all = vec!["kubectl", "-n", ns];
    all.extend_from_slice(args);
    run_program(env!("CARGO_BIN_EXE_fencedlease").as_ref(), &all)
}

/// Waits until `who` names a holder; returns (holder, token).
async fn holder(ns: &str, lease: &str) -> (String, i64) {
    eventually(Duration::from_secs(30), "who to name a holder", || async {
        let r = plugin(ns, &["who", lease]);
        let mut parts = r.stdout.split_whitespace();
        match (
            r.ok,
            parts.next(),
            parts.next().and_then(|t| t.parse().ok()),
        ) {
            (true, Some(h), Some(t)) => Some((h.to_string(), t)),
            _ => None,
        }
    })
    .await
}

async fn candidate_pod(client: &kube::Client, ns: &str, name: &str, lease: &str) {
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "annotations": {"fencedlease.io/lease": lease}},
        "spec": {"containers": [{"name": "app", "image": "registry.invalid/app"}]}
    }))
    .expect("pod literal");
    Api::<Pod>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &pod)
        .await
        .expect("create pod");
}

#[tokio::test]
async fn status_and_who_show_the_holder_its_token_and_candidates() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "plugin-status").await;
    let dir = scratch_dir("plugin-status");
    candidate_pod(&client, &ns.name, "a", "db").await;
    let _a = campaign(&dir, &ns.name, "db", "a", 10);
    let (who, token) = holder(&ns.name, "db").await;
    assert_eq!(who, "a");
    let lease = Api::<FencedLease>::namespaced(client.clone(), &ns.name)
        .get("db")
        .await
        .expect("get");
    assert_eq!(lease.status.and_then(|s| s.token), Some(token));

    let json = plugin(&ns.name, &["status", "-o", "json"]);
    assert!(json.ok, "{}", json.stderr);
    let v: serde_json::Value = serde_json::from_str(&json.stdout).expect("status JSON");
    let item = &v["items"][0];
    assert_eq!(item["name"], "db");
    assert_eq!(item["holder"], "a");
    assert_eq!(item["token"], token);
    assert_eq!(item["leaseDurationSeconds"], 10);
    assert_eq!(item["candidates"][0]["name"], "a");
    assert_eq!(item["candidates"][0]["ready"], false, "no kubelet runs it");

    let table = plugin(&ns.name, &["status"]);
    assert!(table.ok, "{}", table.stderr);
    eprintln!("{}", table.stdout);
    let row = table.stdout.lines().nth(1).expect("a row");
    for part in ["db", " a ", &format!(" {token} "), "10s", "a (not ready)"] {
        assert!(row.contains(part), "{part:?} missing from {row:?}");
    }
    let all = plugin(&ns.name, &["status", "-A"]);
    assert!(all.stdout.starts_with("NAMESPACE"), "{}", all.stdout);
    assert!(all.stdout.contains(&ns.name), "{}", all.stdout);
}

#[tokio::test]
async fn who_on_a_free_lease_fails_and_says_so() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "plugin-free").await;
    Api::<FencedLease>::namespaced(client.clone(), &ns.name)
        .create(
            &PostParams::default(),
            &FencedLease::new("db", FencedLeaseSpec::free()),
        )
        .await
        .expect("create lease");
    let r = plugin(&ns.name, &["who", "db"]);
    assert!(!r.ok, "who must fail on a free lease: {}", r.stdout);
    assert!(r.stdout.is_empty(), "{}", r.stdout);
    assert!(r.stderr.contains("nobody holds lease"), "{}", r.stderr);
    let r = plugin(&ns.name, &["who", "absent"]);
    assert!(!r.ok && r.stderr.contains("not found"), "{}", r.stderr);
}

#[tokio::test]
async fn handover_moves_the_lease_to_the_named_candidate() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "plugin-handover").await;
    let dir = scratch_dir("plugin-handover");
    let a = campaign(&dir, &ns.name, "db", "a", 30);
    let (first, token) = holder(&ns.name, "db").await;
    let b = campaign(&dir, &ns.name, "db", "b", 30);
    let (other, follower) = if first == "a" { ("b", &b) } else { ("a", &a) };
    let r = plugin(&ns.name, &["handover", "db"]);
    assert!(!r.ok && r.stderr.contains("--to"), "{}", r.stderr);
    following(follower, &first).await;
    let r = plugin(&ns.name, &["handover", "db", "--to", other]);
    assert!(r.ok, "{}", r.stderr);
    let (second, new_token) = eventually(Duration::from_secs(15), "the handover", || async {
        let r = plugin(&ns.name, &["who", "db"]);
        let line = r.stdout.trim().to_string();
        line.starts_with(&format!("{other} ")).then_some(line)
    })
    .await
    .split_once(' ')
    .map(|(h, t)| (h.to_string(), t.parse::<i64>().expect("token")))
    .expect("who line");
    assert_eq!(second, other);
    assert!(new_token > token, "{new_token} after {token}");
}

#[tokio::test]
async fn release_revokes_and_the_token_goes_up_but_not_without_yes_off_a_tty() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "plugin-release").await;
    let dir = scratch_dir("plugin-release");
    let _a = campaign(&dir, &ns.name, "db", "a", 30);
    let (_, token) = holder(&ns.name, "db").await;
    let api = Api::<FencedLease>::namespaced(client.clone(), &ns.name);
    let before = api.get("db").await.expect("get").metadata.generation;

    let r = plugin(&ns.name, &["release", "db"]);
    assert!(!r.ok, "release without --yes off a terminal must refuse");
    assert!(r.stderr.contains("pass --yes"), "{}", r.stderr);
    let lease = api.get("db").await.expect("get");
    assert_eq!(lease.metadata.generation, before, "nothing was written");
    assert_eq!(lease.holder(), Some("a"));

    let r = plugin(&ns.name, &["release", "db", "--yes"]);
    assert!(r.ok, "{}\n{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("revoked"), "{}", r.stdout);
    let revoked_to: i64 = r
        .stdout
        .trim()
        .rsplit(' ')
        .next()
        .and_then(|t| t.parse().ok())
        .expect("the new token at the end");
    assert!(revoked_to > token, "{revoked_to} after {token}");
    // The candidate competes again and takes the lease with a higher token still. (Until its
    // status write follows its spec write, `who` can still show the tenure before: the status
    // names the same holder. So: eventually, not at once.)
    eventually(
        Duration::from_secs(30),
        "who to show a token above the revocation's",
        || async {
            let r = plugin(&ns.name, &["who", "db"]);
            let t: Option<i64> = r
                .stdout
                .split_whitespace()
                .nth(1)
                .and_then(|t| t.parse().ok());
            t.filter(|t| *t > revoked_to)
        },
    )
    .await;
}

#[tokio::test]
async fn check_reports_the_crd_and_the_binary_answers_by_its_plugin_name() {
    let client = client().await;
    ensure_crd();
    let dir = scratch_dir("plugin-check");
    let link = dir.join(fencedlease::plugin::PLUGIN_BINARY);
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_fencedlease"), &link).expect("symlink");
    let _ = client;
    let r = run_program(&link, &["check"]);
    eprintln!("{}", r.stdout);
    for line in [
        "✓ CRD fencedleases.fencedlease.io is installed",
        "✓ CRD fencedleases.fencedlease.io is established",
        "✓ CRD fencedleases.fencedlease.io is the one this fencedlease",
    ] {
        assert!(r.stdout.contains(line), "{line:?} missing:\n{}", r.stdout);
    }
    // Every failure (no chart on the test cluster) says what to do, and fails the command.
    let failures = r.stdout.lines().filter(|l| l.starts_with('✗')).count();
    let fixes = r
        .stdout
        .lines()
        .filter(|l| l.trim_start().starts_with('→'))
        .count();
    assert_eq!(failures, fixes, "{}", r.stdout);
    assert_eq!(r.ok, failures == 0, "{}", r.stdout);
}

/// Runs kubectl and panics with its output unless it succeeds.
fn kubectl_ok(args: &[&str]) {
    let (ok, out, err) = kubectl(args);
    assert!(ok, "kubectl {} failed:\n{err}\n{out}", args.join(" "));
}

/// The line of `check`'s report that contains `part`, and the line after it (the fix).
fn report_line<'a>(report: &'a str, part: &str) -> Option<(&'a str, &'a str)> {
    let mut lines = report.lines();
    let line = lines.by_ref().find(|l| l.contains(part))?;
    Some((line, lines.next().unwrap_or_default()))
}

#[tokio::test]
async fn check_says_whether_the_service_account_of_a_campaigning_deployment_may_campaign() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "plugin-rbac").await;
    let n = ns.name.as_str();
    let r = plugin(n, &["check"]);
    let none = format!("✓ no pod, Deployment, StatefulSet or DaemonSet in namespace {n} is annotated fencedlease.io/lease");
    assert!(r.stdout.contains(&none), "{}\n{}", r.stdout, r.stderr);

    kubectl_ok(&["-n", n, "create", "serviceaccount", "inventory"]);
    let deployment = serde_json::json!({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "inventory"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "inventory"}},
            "template": {
                "metadata": {"labels": {"app": "inventory"},
                             "annotations": {"fencedlease.io/lease": "inventory"}},
                "spec": {"serviceAccountName": "inventory",
                         "containers": [{"name": "app", "image": "registry.invalid/app"}]}}}
    });
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> =
        Api::namespaced(client.clone(), n);
    deployments
        .create(
            &PostParams::default(),
            &serde_json::from_value(deployment).expect("deployment literal"),
        )
        .await
        .expect("create deployment");

    let r = plugin(n, &["check"]);
    eprintln!("{}", r.stdout);
    let (line, fix) = report_line(&r.stdout, &format!("ServiceAccount {n}/inventory"))
        .unwrap_or_else(|| panic!("no finding on the ServiceAccount:\n{}", r.stdout));
    assert!(line.starts_with("✗"), "{line}");
    assert!(
        line.contains("may not campaign for lease inventory (deployment/inventory"),
        "{line}"
    );
    assert!(line.contains("missing get fencedleases, list fencedleases, watch fencedleases, update fencedleases, update fencedleases/status"), "{line}");
    let role = format!("kubectl -n {n} create role inventory-lease --verb=get,list,watch,update --resource=fencedleases.fencedlease.io,fencedleases.fencedlease.io/status --resource-name=inventory");
    assert!(
        fix.trim_start().starts_with('→') && fix.contains(&role),
        "{fix}"
    );
    assert!(!r.ok, "a failed finding fails the command");

    // The README's Role and RoleBinding.
    kubectl_ok(&[
        "-n",
        n,
        "create",
        "role",
        "inventory-lease",
        "--verb=get,list,watch,update",
        "--resource=fencedleases.fencedlease.io,fencedleases.fencedlease.io/status",
        "--resource-name=inventory",
    ]);
    kubectl_ok(&[
        "-n",
        n,
        "create",
        "rolebinding",
        "inventory-lease",
        "--role=inventory-lease",
        &format!("--serviceaccount={n}:inventory"),
    ]);
    let ok = format!(
        "✓ ServiceAccount {n}/inventory may campaign for lease inventory (deployment/inventory"
    );
    // RBAC takes a moment to see the new binding.
    let r = eventually(
        Duration::from_secs(15),
        "check to find the rights",
        || async {
            let r = plugin(n, &["check"]);
            r.stdout.contains(&ok).then_some(r)
        },
    )
    .await;
    eprintln!("{}", r.stdout);
    assert!(
        !r.stdout
            .lines()
            .any(|l| l.starts_with('✗') && l.contains("ServiceAccount")),
        "{}",
        r.stdout
    );
    let failures = r.stdout.lines().filter(|l| l.starts_with('✗')).count();
    assert_eq!(r.ok, failures == 0, "{}", r.stdout);
}

/// Cluster-scoped objects of one test, deleted (in the background) when dropped.
struct ClusterObjects(Vec<(&'static str, String)>);

impl Drop for ClusterObjects {
    fn drop(&mut self) {
        for (kind, name) in &self.0 {
            let _ = kubectl(&["delete", kind, name, "--ignore-not-found", "--wait=false"]);
        }
    }
}

#[tokio::test]
async fn check_by_a_user_who_may_not_ask_about_rights_says_so_instead_of_crashing() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "plugin-rbac-forbidden").await;
    let n = ns.name.as_str();
    candidate_pod(&client, n, "a", "inventory").await;
    // A user who may read everything check reads, but not create SubjectAccessReviews.
    let user = format!("{n}-viewer");
    let _cleanup = ClusterObjects(vec![
        ("clusterrole", user.clone()),
        ("clusterrolebinding", user.clone()),
    ]);
    kubectl_ok(&["create", "clusterrole", &user, "--verb=get,list",
        "--resource=customresourcedefinitions.apiextensions.k8s.io,validatingwebhookconfigurations.admissionregistration.k8s.io,mutatingwebhookconfigurations.admissionregistration.k8s.io,deployments.apps,statefulsets.apps,daemonsets.apps,pods"]);
    kubectl_ok(&[
        "create",
        "clusterrolebinding",
        &user,
        &format!("--clusterrole={user}"),
        &format!("--user={user}"),
    ]);
    let dir = scratch_dir("plugin-rbac-forbidden");
    let kubeconfig = common::helm::kubeconfig_as(&user, &dir);
    let line = "✗ could not check whether the ServiceAccounts of namespace";
    let r = eventually(
        Duration::from_secs(15),
        "check to run as the viewer",
        || async {
            let r = run_with_kubeconfig(
                env!("CARGO_BIN_EXE_fencedlease").as_ref(),
                &kubeconfig,
                &["kubectl", "-n", n, "check"],
            );
            r.stdout.contains(line).then_some(r)
        },
    )
    .await;
    eprintln!("{}", r.stdout);
    let (found, fix) = report_line(&r.stdout, line).expect("the line");
    assert!(
        found.contains("may not create subjectaccessreviews.authorization.k8s.io"),
        "{found}"
    );
    assert!(
        fix.contains(&format!("--as=system:serviceaccount:{n}:default")),
        "{fix}"
    );
    assert!(!r.ok, "{}", r.stdout);
}

/// Deletes are fenced, so a person deletes a protected object as the holder:
/// `kubectl fencedlease delete` takes the lease (asking the holder to hand it over), announces
/// the delete under its token, deletes, and gives the lease back.
#[tokio::test]
async fn delete_takes_the_lease_announces_and_deletes_a_protected_object() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "plugin-delete").await;
    let dir = scratch_dir("plugin-delete");
    let _wh = common::webhook::Webhook::start(&client, &dir, &ns.name).await;
    let _a = campaign(&dir, &ns.name, "db", "a", 30);
    let (_, token) = holder(&ns.name, "db").await;
    let lease = Api::<FencedLease>::namespaced(client.clone(), &ns.name)
        .get("db")
        .await
        .expect("lease");
    let uid = lease.metadata.uid.clone().expect("uid");
    let cms: Api<k8s_openapi::api::core::v1::ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    for (name, labels) in [
        (
            "inventory",
            serde_json::json!({"fencedlease.io/lease": "db"}),
        ),
        ("plain", serde_json::json!({})),
    ] {
        let cm = serde_json::from_value(serde_json::json!({"metadata": {
            "name": name, "labels": labels,
            "annotations": {"fencedlease.io/token": token.to_string(), "fencedlease.io/lease-uid": uid}}}))
        .expect("literal");
        cms.create(&PostParams::default(), &cm)
            .await
            .expect("create");
    }
    let (ok, _, err) = kubectl(&["-n", &ns.name, "delete", "configmap", "inventory"]);
    assert!(
        !ok && err.contains("did not announce a delete"),
        "kubectl delete: {err}"
    );
    let r = plugin(&ns.name, &["delete", "configmap/plain"]);
    assert!(
        !r.ok && r.stderr.contains("is not protected"),
        "{}",
        r.stderr
    );
    let r = plugin(&ns.name, &["delete", "no-such-kind/x"]);
    assert!(!r.ok && r.stderr.contains("api-resources"), "{}", r.stderr);
    // The holder keeps renewing: without --handover the command never gets the lease.
    let r = plugin(
        &ns.name,
        &["delete", "configmap/inventory", "--timeout-seconds", "2"],
    );
    assert!(!r.ok && r.stderr.contains("--handover"), "{}", r.stderr);
    assert!(cms.get_opt("inventory").await.expect("get").is_some());
    let r = plugin(&ns.name, &["delete", "configmap/inventory", "--handover"]);
    assert!(r.ok, "{}{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("deleted under token"), "{}", r.stdout);
    assert!(
        cms.get_opt("inventory").await.expect("get").is_none(),
        "inventory is gone"
    );
    // The lease was given back: free, or the campaign's again, never the command's.
    let r = plugin(&ns.name, &["who", "db"]);
    assert!(!r.stdout.contains("kubectl-fencedlease-"), "{}", r.stdout);
}

/// `check` names protected objects whose controller is not protected, and autoscalers of
/// protected objects that nothing judges (here no fencing webhook is installed, as in policy
/// mode): whoever may edit those changes the protected object through Kubernetes' exempt
/// controllers.
#[tokio::test]
async fn check_says_where_protection_does_not_follow_control() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "plugin-control").await;
    let n = ns.name.as_str();
    let deploys: Api<k8s_openapi::api::apps::v1::Deployment> = Api::namespaced(client.clone(), n);
    let deployment = |name: &str, labels: serde_json::Value| {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "labels": labels},
            "spec": {"replicas": 0, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}},
                                  "spec": {"containers": [{"name": "c", "image": "registry.invalid/x"}]}}}
        }))
        .expect("deployment literal")
    };
    let api = deploys
        .create(
            &PostParams::default(),
            &deployment("api", serde_json::json!({})),
        )
        .await
        .expect("create api");
    deploys
        .create(
            &PostParams::default(),
            &deployment("web", serde_json::json!({"fencedlease.io/lease": "inv"})),
        )
        .await
        .expect("create web");
    let conf: k8s_openapi::api::core::v1::ConfigMap = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "conf", "labels": {"fencedlease.io/lease": "inv"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "api",
                                 "uid": api.metadata.uid, "controller": true}]}
    }))
    .expect("configmap literal");
    Api::namespaced(client.clone(), n)
        .create(&PostParams::default(), &conf)
        .await
        .expect("create conf");
    let (ok, _, err) = kubectl(&[
        "-n",
        n,
        "autoscale",
        "deployment",
        "web",
        "--min=1",
        "--max=3",
    ]);
    assert!(ok, "kubectl autoscale: {err}");
    let r = plugin(n, &["check"]);
    assert!(!r.ok, "{}", r.stdout);
    let owner = format!("ConfigMap {n}/conf is protected by FencedLease inv, but its controller Deployment {n}/api is not");
    assert!(r.stdout.contains(&owner), "{}", r.stdout);
    let hpa = format!("HorizontalPodAutoscaler {n}/web scales Deployment {n}/web, protected by FencedLease inv, and nothing judges");
    assert!(r.stdout.contains(&hpa), "{}", r.stdout);
    // Protect the controller: that finding goes.
    let (ok, _, err) = kubectl(&[
        "-n",
        n,
        "label",
        "deployment",
        "api",
        "fencedlease.io/lease=inv",
    ]);
    assert!(ok, "{err}");
    let r = plugin(n, &["check"]);
    assert!(
        !r.stdout.contains(&owner) && r.stdout.contains(&hpa),
        "{}",
        r.stdout
    );
}
