//! Installing as users do (issue 36): releases pushed to the test bed's OCI registry by
//! hack/release.sh, verified by hack/verify-release.sh, installed and upgraded with
//! `helm ... oci://` on the real node, which pulls the images by digest.
//!
//! - one version everywhere (no cluster needed);
//! - a release installs from the registry into a namespace enforcing `restricted` Pod Security,
//!   runs the signed digests and fences; a tampered chart, an unsigned image and an image signed
//!   by another key are each refused by the check;
//! - an upgrade from the previous release (built from its tag) and a downgrade back, while a
//!   holder keeps writing and a replaced holder keeps trying: no stale write is accepted, the
//!   lease keeps its holder and token, and the holder's refused stretches are printed (and
//!   written to $FL_UPGRADE_SAMPLES when set) as measurements, not asserted.

use fencedlease_testkit as common;

use std::time::{Duration, Instant};

use common::fencing::{fenced_merge, held_lease, move_lease, protected_meta};
use common::helm::Release;
use common::node::{describe, is_running, name_of, ready_node};
use common::operator::{wait_certificate_and_ca_bundles, wait_operator_ready};
use common::release::{
    hack_var, helm_from_registry, oci_chart, push, script, verify, ChartRef, Pushed,
};
use common::writers::{keep_writing, long_held_lease, report};
use common::{client, ensure_crd, eventually, kubectl, repo_root, try_eventually, TestNamespace};
use fencedlease::api::FencedLease;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use tokio::sync::Mutex;

const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The node tests here take turns: each installs the chart's four operator pods, and the tamper
/// test moves the registry's tags for a while.
static NODE: Mutex<()> = Mutex::const_new(());

#[test]
fn one_version_everywhere() {
    let root = repo_root();
    let read =
        |p: &str| std::fs::read_to_string(root.join(p)).unwrap_or_else(|e| panic!("{p}: {e}"));
    let chart = read("charts/fencedlease/Chart.yaml");
    assert!(
        chart.contains(&format!("\nversion: {VERSION}\n")),
        "Chart.yaml version is not {VERSION}"
    );
    assert!(
        chart.contains(&format!("\nappVersion: \"{VERSION}\"\n")),
        "Chart.yaml appVersion is not {VERSION}"
    );
    let py = read("clients/python/src/fencedlease/__init__.py");
    assert!(
        py.contains(&format!("__version__ = \"{VERSION}\"")),
        "the Python client's __version__ is not {VERSION}"
    );
    let pyproject = read("clients/python/pyproject.toml");
    assert!(
        pyproject.contains(&format!("\nversion = \"{VERSION}\"\n")),
        "pyproject.toml's version is not {VERSION}"
    );
    let changelog = read("CHANGELOG.md");
    let previous = hack_var("FL_PREVIOUS_VERSION");
    for v in [VERSION, previous.as_str()] {
        assert!(
            changelog.contains(&format!("## [{v}]"))
                || changelog.contains(&format!("## [Unreleased]: {v}")),
            "CHANGELOG.md has no section for {v}"
        );
    }
    // The tag of the previous release, when this clone has it, is the commit hack/lib.sh names.
    let (has_tag, tagged, _) = git(&[
        "rev-parse",
        "--verify",
        "--quiet",
        &format!("v{previous}^{{commit}}"),
    ]);
    if has_tag {
        assert_eq!(
            tagged.trim(),
            hack_var("FL_PREVIOUS_COMMIT"),
            "tag v{previous}"
        );
    }
}

fn git(args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new("git")
        .current_dir(repo_root())
        .args(args)
        .output()
        .expect("git runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A namespace of the test's own that enforces the `restricted` Pod Security level.
async fn restricted_namespace(client: &Client, prefix: &str) -> TestNamespace {
    let ns = TestNamespace::new(client, prefix).await;
    let labels = json!({"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/enforce-version": "latest",
    }}});
    Api::<Namespace>::all(client.clone())
        .patch(&ns.name, &PatchParams::default(), &Patch::Merge(&labels))
        .await
        .unwrap_or_else(|e| panic!("labelling namespace {}: {e}", ns.name));
    ns
}

fn registry_release(ns: &TestNamespace, prefix: &str) -> Release {
    let mut release = Release::new(ns, prefix);
    release.chart = oci_chart();
    release
}

/// Every container of the release's pods runs `image` (REF@DIGEST), and containerd resolved
/// the same digest.
async fn assert_runs(client: &Client, release: &Release, image: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &release.namespace);
    let list = pods
        .list(&ListParams::default().labels(&release.pod_selector()))
        .await
        .expect("listing the release's pods");
    let digest = image.split('@').nth(1).expect("REF@DIGEST");
    for p in list.items.iter().filter(|p| is_running(p)) {
        let spec = p.spec.as_ref().expect("pod spec");
        for c in &spec.containers {
            assert_eq!(
                c.image.as_deref(),
                Some(image),
                "image of {}/{}",
                name_of(p),
                c.name
            );
        }
        for s in p
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.clone())
            .unwrap_or_default()
        {
            assert!(
                s.image_id.ends_with(digest),
                "{} runs {}, not {digest}",
                name_of(p),
                s.image_id
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_installs_from_the_registry_only_once_verified() {
    let client = client().await;
    ready_node(&client).await;
    ensure_crd();
    let _turn = NODE.lock().await;
    let pushed = push(VERSION, None).await;
    let verified = verify(VERSION, &pushed.public_key)
        .unwrap_or_else(|e| panic!("the release does not verify:\n{e}"));
    assert!(
        verified.contains(&pushed.chart_digest()),
        "verified another chart: {verified}"
    );

    // Installed from the registry in a namespace enforcing `restricted`: both operator pods of
    // each component start (Pod Security admits them), pull the signed digests and fence.
    let ns = restricted_namespace(&client, "release-install").await;
    let release = registry_release(&ns, "flr");
    // By version, as `helm install ... --version V` (the upgrade test installs by digest).
    helm_from_registry(&release, "install", ChartRef::Version(VERSION), &[]);
    wait_operator_ready(&client, &release, 2).await;
    wait_certificate_and_ca_bundles(&client, &release).await;
    assert_runs(&client, &release, &pushed.image("fencedlease")).await;
    injected_sidecar_runs(&client, &ns.name, &pushed.image("fencedlease-sidecar")).await;
    let h = held_lease(&client, &ns.name, "app", "app-0").await;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    let cm: ConfigMap = serde_json::from_value(
        json!({"metadata": {"name": "copy", "labels": {"fencedlease.io/lease": "app"}}}),
    )
    .expect("configmap literal");
    let refusal = eventually(
        Duration::from_secs(60),
        "the installed webhook to refuse an unstamped protected write",
        || async {
            match cms.create(&PostParams::default(), &cm).await {
                Err(kube::Error::Api(s)) if s.code == 403 => Ok(s.message),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    assert!(refusal.contains("token"), "refusal: {refusal}");
    let stamped: ConfigMap =
        serde_json::from_value(json!({"metadata": protected_meta("copy", "app", &h)}))
            .expect("literal");
    cms.create(&PostParams::default(), &stamped)
        .await
        .expect("the holder's stamped create");

    tampering_is_refused(&pushed).await;
}

/// An injected sidecar in namespace `ns` runs `image` (REF@DIGEST), which the node pulled from
/// the registry: the chart's webhook injects the signed sidecar image, not a tag.
async fn injected_sidecar_runs(client: &Client, ns: &str, image: &str) {
    common::operator::opt_in_to_injection(client, ns).await;
    common::operator::wait_injection_served(client, ns).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    pods.create(
        &PostParams::default(),
        &common::operator::annotated_pod("injected", "app"),
    )
    .await
    .expect("creating an annotated pod");
    let digest = image.split('@').nth(1).expect("REF@DIGEST").to_string();
    eventually(
        Duration::from_secs(120),
        "the injected sidecar to start from the registry's image",
        || async {
            let p = pods.get("injected").await.map_err(|e| e.to_string())?;
            let spec = p.spec.as_ref().ok_or("no spec")?;
            let declared = spec
                .init_containers
                .iter()
                .flatten()
                .chain(&spec.containers)
                .find(|c| c.name == "fencedlease")
                .and_then(|c| c.image.clone());
            if declared.as_deref() != Some(image) {
                return Err(format!(
                    "the sidecar is declared with {declared:?}, not {image}"
                ));
            }
            let status = p.status.unwrap_or_default();
            let started = status
                .init_container_statuses
                .iter()
                .flatten()
                .chain(status.container_statuses.iter().flatten())
                .find(|s| s.name == "fencedlease" && s.image_id.ends_with(&digest));
            started
                .map(|_| ())
                .ok_or_else(|| format!("not started yet: {:?}", status.phase))
        },
    )
    .await;
}

/// Each tampering makes hack/verify-release.sh refuse, naming what failed; the release is
/// pushed again afterwards.
async fn tampering_is_refused(pushed: &Pushed) {
    let registry = common::release::registry();
    let crane = tool("crane");
    let insecure = "--insecure";
    // A chart changed after signing (one value), pushed under the same version.
    let work = Scratch::new();
    let package = repo_root().join(format!(
        "target/verified/{VERSION}/fencedlease-{VERSION}.tgz"
    ));
    let dir = work.path().to_str().expect("utf-8");
    run(
        "tar",
        &["-xzf", package.to_str().expect("utf-8"), "-C", dir],
    );
    let values = work.path().join("fencedlease/values.yaml");
    let text = std::fs::read_to_string(&values).expect("values.yaml");
    let tampered = text.replacen("\nreplicas: 2\n", "\nreplicas: 3\n", 1);
    assert_ne!(
        tampered, text,
        "the chart's values have no `replicas: 2` to change"
    );
    std::fs::write(&values, tampered).expect("write values");
    let helm = common::helm::helm_path()
        .to_str()
        .expect("utf-8")
        .to_string();
    run(
        &helm,
        &[
            "package",
            &format!("{dir}/fencedlease"),
            "--destination",
            dir,
        ],
    );
    run(
        &helm,
        &[
            "push",
            &format!("{dir}/fencedlease-{VERSION}.tgz"),
            &format!("oci://{registry}/charts"),
            "--plain-http",
        ],
    );
    let refused =
        verify(VERSION, &pushed.public_key).expect_err("a tampered chart must be refused");
    assert!(
        refused.contains("REFUSED: the chart") && refused.contains("no valid signature"),
        "{refused}"
    );

    // A rollback: a chart the key really signed, for another version (0.1.9 here), moved
    // under this version's tag.
    let chart_yaml = work.path().join("fencedlease/Chart.yaml");
    let text = std::fs::read_to_string(&chart_yaml).expect("Chart.yaml");
    // (helm package writes Chart.yaml in its own form: keys sorted, appVersion unquoted.)
    let older: String = text
        .lines()
        .map(|l| match l.split(':').next() {
            Some("version") => "version: 0.1.9".to_string(),
            Some("appVersion") => "appVersion: \"0.1.9\"".to_string(),
            _ => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        older.contains("\nversion: 0.1.9") && older.contains("\nappVersion: \"0.1.9\""),
        "{older}"
    );
    std::fs::write(&chart_yaml, older).expect("write Chart.yaml");
    run(
        &helm,
        &[
            "package",
            &format!("{dir}/fencedlease"),
            "--destination",
            dir,
        ],
    );
    let pushed_older = run(
        &helm,
        &[
            "push",
            &format!("{dir}/fencedlease-0.1.9.tgz"),
            &format!("oci://{registry}/charts"),
            "--plain-http",
        ],
    );
    let older_digest = run(
        &crane,
        &[
            "digest",
            insecure,
            &format!("{registry}/charts/fencedlease:0.1.9"),
        ],
    );
    let older_ref = format!("{registry}/charts/fencedlease@{}", older_digest.trim());
    let key = format!("{}/test-bed-key/cosign.key", hack_var("FL_CACHE"));
    run(
        &tool("cosign"),
        &[
            "sign",
            "--key",
            &key,
            "-a",
            "version=0.1.9",
            "--tlog-upload=false",
            "--yes",
            "--allow-http-registry",
            "--allow-insecure-registry",
            &older_ref,
        ],
    );
    run(&crane, &["tag", insecure, &older_ref, VERSION]);
    let refused = verify(VERSION, &pushed.public_key)
        .expect_err("a chart signed for another version must be refused");
    assert!(
        refused.contains(&format!(
            "no valid signature by {} for version {VERSION}",
            pushed.public_key.display()
        )),
        "{refused}\n(helm push said: {pushed_older})"
    );

    // An image whose signature is gone (as if a compromised pipeline had pushed it and the
    // signed chart named it): the tag back on the signed chart first.
    let chart = format!("{registry}/charts/fencedlease@{}", pushed.chart_digest());
    run(&crane, &["tag", insecure, &chart, VERSION]);
    verify(VERSION, &pushed.public_key).expect("the signed chart again");
    let sidecar = pushed.image("fencedlease-sidecar");
    let (repo, digest) = sidecar.split_once('@').expect("REF@DIGEST");
    let sig_tag = format!("{repo}:{}.sig", digest.replace(':', "-"));
    let sig_digest = run(&crane, &["digest", insecure, &sig_tag]);
    run(
        &crane,
        &["delete", insecure, &format!("{repo}@{}", sig_digest.trim())],
    );
    let refused =
        verify(VERSION, &pushed.public_key).expect_err("an unsigned image must be refused");
    assert!(
        refused.contains(&format!(
            "REFUSED: the image {sidecar} has no valid signature"
        )),
        "{refused}"
    );

    // The same image signed by someone else's key.
    let other = work.path().join("other");
    std::fs::create_dir(&other).expect("mkdir");
    let cosign = tool("cosign");
    run_in(&other, &cosign, &["generate-key-pair"]);
    run(
        &cosign,
        &[
            "sign",
            "--key",
            other.join("cosign.key").to_str().expect("utf-8"),
            "--tlog-upload=false",
            "--yes",
            "--allow-http-registry",
            "--allow-insecure-registry",
            &sidecar,
        ],
    );
    let refused = verify(VERSION, &pushed.public_key)
        .expect_err("an image signed by another key must be refused");
    assert!(
        refused.contains(&format!(
            "REFUSED: the image {sidecar} has no valid signature"
        )),
        "{refused}"
    );

    // Restore: the release as it was (its images and chart are reproducible, the signatures new).
    let again = push(VERSION, None).await;
    verify(VERSION, &again.public_key).expect("the release pushed again verifies");
}

/// A folder of the test's own under the system's temporary folder, removed when dropped.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new() -> Scratch {
        let dir =
            std::env::temp_dir().join(format!("fencedlease-release-{:08x}", common::rand_u32()));
        std::fs::create_dir_all(&dir).expect("creating a scratch folder");
        Scratch(dir)
    }

    fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tool(name: &str) -> String {
    let (ok, out, err) = script("gotool.sh", &[name]);
    assert!(ok, "hack/gotool.sh {name}: {err}");
    out.trim().to_string()
}

fn run(program: &str, args: &[&str]) -> String {
    run_in(repo_root(), program, args)
}

fn run_in(dir: &std::path::Path, program: &str, args: &[&str]) -> String {
    let out = std::process::Command::new(program)
        .current_dir(dir)
        .env("COSIGN_PASSWORD", "")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {} failed:\n{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Waits until the release's pods are `replicas` per component, all Ready on `image`, and no
/// other pod is left, not even a terminating one (the rollout of an upgrade or a downgrade is
/// over, and the old pods' listeners have closed while the writers were still writing).
async fn wait_rolled_out(client: &Client, release: &Release, image: &str, replicas: usize) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &release.namespace);
    let timeout = Duration::from_secs(240);
    let r = try_eventually(timeout, || async {
        let list = pods
            .list(&ListParams::default().labels(&release.pod_selector()))
            .await
            .map_err(|e| e.to_string())?
            .items;
        let live: Vec<&Pod> = list
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .collect();
        let on_image = |p: &Pod| {
            p.spec.as_ref().is_some_and(|s| {
                s.containers
                    .iter()
                    .all(|c| c.image.as_deref() == Some(image))
            })
        };
        let ready = live
            .iter()
            .filter(|p| on_image(p) && common::node::all_containers_ready(p))
            .count();
        if list.len() == 2 * replicas && live.len() == 2 * replicas && ready == 2 * replicas {
            Ok(())
        } else {
            Err(describe(&list))
        }
    })
    .await;
    if let Err(last) = r {
        panic!("the release did not roll out to {image} within {timeout:?}; pods:\n{last}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_and_downgrade_under_a_stale_writer_accept_no_stale_write() {
    let client = client().await;
    ready_node(&client).await;
    ensure_crd();
    let _turn = NODE.lock().await;
    let previous_version = hack_var("FL_PREVIOUS_VERSION");
    let previous = push(&previous_version, Some(&hack_var("FL_PREVIOUS_COMMIT"))).await;
    verify(&previous_version, &previous.public_key)
        .unwrap_or_else(|e| panic!("{previous_version} does not verify:\n{e}"));
    let current = push(VERSION, None).await;
    verify(VERSION, &current.public_key)
        .unwrap_or_else(|e| panic!("{VERSION} does not verify:\n{e}"));

    // The previous release, installed from the registry; a lease moved once, so that there is a
    // replaced holder (token t1) and a current one (t2 > t1).
    let ns = TestNamespace::new(&client, "release-upgrade").await;
    let release = registry_release(&ns, "flu");
    // By the verified digests, as the docs say (the install test goes by version).
    helm_from_registry(
        &release,
        "install",
        ChartRef::Digest(&previous.chart_digest()),
        &[],
    );
    wait_operator_ready(&client, &release, 2).await;
    wait_certificate_and_ca_bundles(&client, &release).await;
    assert_runs(&client, &release, &previous.image("fencedlease")).await;
    let replaced = long_held_lease(&client, &ns.name, "app", "app-0").await;
    let holder = move_lease(&client, &ns.name, "app", "app-1").await;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    eventually(
        Duration::from_secs(60),
        "the holder's stamped create, with the webhook judging",
        || async {
            let cm: ConfigMap =
                serde_json::from_value(json!({"metadata": protected_meta("copy", "app", &holder)}))
                    .expect("literal");
            cms.create(&PostParams::default(), &cm)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        },
    )
    .await;

    let started = Instant::now();
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let holder_writes = keep_writing(
        cms.clone(),
        holder.clone(),
        Duration::from_millis(100),
        started,
        stop.clone(),
    );
    let stale_writes = keep_writing(
        cms.clone(),
        replaced.clone(),
        Duration::from_millis(100),
        started,
        stop,
    );
    let mut marks = Vec::new();

    // Upgrade: the new CRD first (README), then the chart; then back to the previous version.
    let (ok, _, err) = kubectl(&[
        "apply",
        "--server-side",
        "-f",
        common::crd_file().to_str().expect("utf-8"),
    ]);
    assert!(ok, "applying the current CRD: {err}");
    for (to, pushed) in [(VERSION, &current), (previous_version.as_str(), &previous)] {
        marks.push((format!("helm upgrade to {to}"), started.elapsed()));
        helm_from_registry(
            &release,
            "upgrade",
            ChartRef::Digest(&pushed.chart_digest()),
            &[],
        );
        wait_rolled_out(&client, &release, &pushed.image("fencedlease"), 2).await;
        marks.push((format!("rolled out {to}"), started.elapsed()));
        // The holder writes again on the version just rolled out before the next step.
        eventually(
            Duration::from_secs(60),
            "a write of the holder accepted after the rollout",
            || async {
                fenced_merge(&cms, "copy", &holder, json!({"data": {"after": to}}))
                    .await
                    .map(|_| ())
                    .map_err(|(c, m)| format!("{c}: {m}"))
            },
        )
        .await;
    }
    stop_tx.send(true).expect("the writers listen");
    let holder_writes = holder_writes.await.expect("holder writer");
    let stale_writes = stale_writes.await.expect("stale writer");
    report(&holder_writes, &stale_writes, &marks);

    assert_eq!(
        stale_writes.accepted(),
        0,
        "stale writes accepted during upgrade or downgrade"
    );
    assert!(holder_writes.accepted() > 0, "the holder never wrote");
    let lease = Api::<FencedLease>::namespaced(client.clone(), &ns.name)
        .get("app")
        .await
        .expect("lease app");
    assert_eq!(
        lease.token(),
        Some(holder.token),
        "the lease's token changed"
    );
    assert_eq!(
        lease.spec.holder_identity.as_deref(),
        Some("app-1"),
        "the lease's holder changed"
    );
    let copy = cms.get("copy").await.expect("ConfigMap copy");
    assert_eq!(
        copy.data
            .unwrap_or_default()
            .get("writer")
            .map(String::as_str),
        Some(holder.token.to_string().as_str()),
        "the copy's last writer is not the holder"
    );
}
