//! Sidecar: injection by the mutating webhook, and `fencedlease sidecar` processes as
//! candidates, against the real API server.

use fencedlease_testkit as common;

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::fencing::holders_until;
use common::procs::{now_ns, scratch_dir};
use common::sidecars::{curl, curl_with_secret, sidecar, Sidecar};
use common::webhook::{free_port, Webhook};
use common::{client, ensure_crd, eventually, kubectl, TestNamespace};
use fencedlease::stamp::LEASE_LABEL;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ListParams, PostParams};
use kube::Api;
use nix::sys::signal::Signal;
use serde_json::{json, Value};

fn pod(name: &str, annotations: Value) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": annotations},
        "spec": {"containers": [{"name": "app", "image": "busybox", "command": ["sleep", "3600"]}]}
    }))
    .expect("pod literal")
}

fn sidecars(p: &Pod) -> usize {
    let spec = p.spec.as_ref().expect("spec");
    spec.containers
        .iter()
        .filter(|c| c.name == "fencedlease")
        .count()
        + spec.init_containers.as_ref().map_or(0, |ic| {
            ic.iter().filter(|c| c.name == "fencedlease").count()
        })
}

#[tokio::test]
async fn pods_and_deployments_get_the_sidecar_exactly_once() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "inject").await;
    let dir = scratch_dir("inject");
    let wh = Webhook::start(&client, &dir, &ns.name).await;
    wh.register_mutating(&client, &ns.name).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    let created = eventually(
        Duration::from_secs(20),
        "the mutating webhook to be in effect",
        || async {
            let p = pods
                .create(
                    &PostParams::default(),
                    &pod(
                        &format!("web-{:06x}", common::rand_u32() & 0xffffff),
                        json!({"fencedlease.io/lease": "web"}),
                    ),
                )
                .await
                .ok()?;
            (sidecars(&p) == 1).then_some(p)
        },
    )
    .await;
    // Before 1.29 (no native sidecars) an ordinary container; from 1.29 a native sidecar: an
    // init container with restartPolicy Always, which the kubelet starts before the app and
    // stops after it. Hardened either way, with the app container wired to it.
    let spec = created.spec.as_ref().expect("spec");
    let native = common::server_minor(&client).await >= 29;
    let inits = spec.init_containers.as_deref().unwrap_or_default();
    let sc = if native {
        assert!(!spec.containers.iter().any(|c| c.name == "fencedlease"));
        let sc = inits
            .iter()
            .find(|c| c.name == "fencedlease")
            .expect("the native sidecar among the init containers");
        assert_eq!(sc.restart_policy.as_deref(), Some("Always"));
        sc
    } else {
        assert!(spec.init_containers.is_none());
        spec.containers
            .iter()
            .find(|c| c.name == "fencedlease")
            .expect("sidecar")
    };
    let sec = sc.security_context.as_ref().expect("securityContext");
    assert_eq!(sec.read_only_root_filesystem, Some(true));
    assert_eq!(sec.run_as_non_root, Some(true));
    assert_eq!(sec.allow_privilege_escalation, Some(false));
    assert!(sc
        .resources
        .as_ref()
        .and_then(|r| r.limits.as_ref())
        .is_some());
    let app = spec
        .containers
        .iter()
        .find(|c| c.name == "app")
        .expect("app");
    let env: Vec<&str> = app.env.iter().flatten().map(|e| e.name.as_str()).collect();
    assert!(
        env.contains(&"FENCEDLEASE_URL") && env.contains(&"FENCEDLEASE_TOKEN_FILE"),
        "{env:?}"
    );

    // Untouched without the annotation, and with the opt-out.
    let plain = pods
        .create(&PostParams::default(), &pod("plain", json!({})))
        .await
        .expect("create");
    assert_eq!(sidecars(&plain), 0);
    assert_eq!(plain.spec.as_ref().map(|s| s.containers.len()), Some(1));
    let out = pods
        .create(
            &PostParams::default(),
            &pod(
                "optout",
                json!({"fencedlease.io/lease": "web", "fencedlease.io/inject": "false"}),
            ),
        )
        .await
        .expect("create");
    assert_eq!(sidecars(&out), 0);
    // Bad options are refused with a message naming the annotation.
    match pods
        .create(
            &PostParams::default(),
            &pod(
                "bad",
                json!({"fencedlease.io/lease": "web", "fencedlease.io/lease-duration": "15s"}),
            ),
        )
        .await
    {
        Err(kube::Error::Api(s)) => assert!(
            s.message.contains("fencedlease.io/lease-duration"),
            "{}",
            s.message
        ),
        other => panic!("a bad annotation must be refused, got {other:?}"),
    }

    // A Deployment's pods (created by kube-controller-manager) get it exactly once too.
    let deploy: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}, "annotations": {"fencedlease.io/lease": "web"}},
                "spec": {"containers": [{"name": "app", "image": "busybox", "command": ["sleep", "3600"]}]}
            }
        }
    }))
    .expect("deployment literal");
    Api::<Deployment>::namespaced(client.clone(), &ns.name)
        .create(&PostParams::default(), &deploy)
        .await
        .expect("create deployment");
    let made = eventually(
        Duration::from_secs(30),
        "the Deployment's two pods",
        || async {
            let list = pods
                .list(&ListParams::default().labels("app=web"))
                .await
                .ok()?;
            (list.items.len() == 2).then_some(list.items)
        },
    )
    .await;
    for p in made {
        assert_eq!(sidecars(&p), 1, "{:?}", p.metadata.name);
    }
}

async fn the_leader(cars: &[&Sidecar]) -> (usize, Value) {
    eventually(
        Duration::from_secs(20),
        "exactly one sidecar leading",
        || async {
            let st: Vec<Value> = cars
                .iter()
                .map(|c| c.status().unwrap_or(Value::Null))
                .collect();
            let leading: Vec<usize> = (0..st.len())
                .filter(|i| st[*i]["leading"] == true)
                .collect();
            (leading.len() == 1).then(|| (leading[0], st[leading[0]].clone()))
        },
    )
    .await
}

#[tokio::test]
async fn sidecars_agree_on_the_leader_over_http_sse_and_the_token_file_and_hand_over_on_sigterm() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "sidecar").await;
    let dir = scratch_dir("sidecar");
    let a = sidecar(&dir, &ns.name, "db", "pod-a", &["--ready-only-when-leader"]);
    let b = sidecar(&dir, &ns.name, "db", "pod-b", &["--ready-only-when-leader"]);
    let c = sidecar(&dir, &ns.name, "db", "pod-c", &["--ready-only-when-leader"]);
    let cars = [&a, &b, &c];
    let (i, st) = the_leader(&cars).await;
    let token = st["token"].as_i64().expect("token");
    let uid = st["leaseUID"].as_str().expect("uid").to_string();
    let lease = Api::<fencedlease::api::FencedLease>::namespaced(client.clone(), &ns.name)
        .get("db")
        .await
        .expect("lease");
    assert_eq!(lease.token(), Some(token));
    assert_eq!(lease.metadata.uid.as_deref(), Some(uid.as_str()));
    assert_eq!(lease.holder(), st["identity"].as_str());
    for (j, car) in cars.iter().enumerate() {
        let (code, body) = car.curl(&[&format!("http://127.0.0.1:{}/v1/token", car.port)]);
        let (ready, _) = curl(&[&format!("http://127.0.0.1:{}/readyz", car.port)]);
        let file = std::fs::read_to_string(car.token_dir.join("token")).ok();
        if j == i {
            assert_eq!(code, 200, "{body}");
            let v: Value = serde_json::from_str(&body).expect("json");
            assert_eq!(v["token"].as_i64(), Some(token));
            assert_eq!(ready, 200, "the leader is ready");
            assert_eq!(file.as_deref(), Some(format!("{token}\n").as_str()));
        } else {
            assert_eq!(code, 409, "{body}");
            assert_eq!(
                ready, 503,
                "a follower is not ready with leader-only readiness"
            );
            assert_eq!(file, None, "only the leader has a token file");
        }
    }
    // Followers learn the holder from their watch of the lease, which may trail the leader's
    // own write by a moment.
    eventually(
        Duration::from_secs(30),
        "every follower to name the holder",
        || async {
            cars.iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .all(|(_, car)| car.status().is_some_and(|s| s["holder"] == st["identity"]))
                .then_some(())
        },
    )
    .await;
    // Follow one follower's SSE stream across a SIGTERM of the leader.
    let follower = cars[(i + 1) % 3];
    let sse_out = dir.join("sse.txt");
    let mut sse = Command::new("curl")
        .args([
            "-sN",
            "--max-time",
            "60",
            "-H",
            &format!("Authorization: Bearer {}", follower.secret()),
            &format!("http://127.0.0.1:{}/v1/watch", follower.port),
        ])
        .stdout(std::fs::File::create(&sse_out).expect("sse file"))
        .spawn()
        .expect("curl sse");
    eventually(
        Duration::from_secs(30),
        "the SSE stream's first event",
        || async {
            let text = std::fs::read_to_string(&sse_out).unwrap_or_default();
            text.contains("data:").then_some(())
        },
    )
    .await;
    let t0 = now_ns();
    // Handed over by the leader's release, not by waiting out the lease: the lease's watch sees
    // it free before another sidecar holds it.
    let leases = Api::<fencedlease::api::FencedLease>::namespaced(client.clone(), &ns.name);
    let old = st["identity"].as_str().expect("identity").to_string();
    let holders = holders_until(&leases, "db", |h| h.is_some_and(|h| h != old), async {
        cars[i].proc.signal(Signal::SIGTERM)
    })
    .await;
    assert!(
        holders.contains(&None),
        "another sidecar took the lease without a release before it: holders seen {holders:?}"
    );
    let others: Vec<&Sidecar> = cars
        .iter()
        .enumerate()
        .filter(|(j, _)| *j != i)
        .map(|(_, c)| *c)
        .collect();
    let (_, next) = the_leader(&others).await;
    let handover_ms = (now_ns() - t0) as f64 / 1e6;
    eprintln!("sidecar SIGTERM handover observed within {handover_ms:.0} ms");
    assert!(next["token"].as_i64() > Some(token));
    assert!(
        !cars[i].token_dir.join("token").exists(),
        "the old leader removed its token file"
    );
    // The follower's stream reports the new holder a moment after /v1/status polling sees it.
    // (A leader reports itself as the holder, so this holds whichever sidecar won.)
    let holder_json = format!("\"holder\":{}", next["identity"]);
    eventually(
        Duration::from_secs(30),
        "the SSE stream to report the new holder",
        || async {
            let text = std::fs::read_to_string(&sse_out).unwrap_or_default();
            text.contains(&holder_json).then_some(())
        },
    )
    .await;
    let _ = sse.kill();
    let _ = sse.wait();
    let stream = std::fs::read_to_string(&sse_out).unwrap_or_default();
    let events: Vec<Value> = stream
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .filter_map(|d| serde_json::from_str(d.trim()).ok())
        .collect();
    assert!(events.len() >= 2, "{stream}");
    assert_eq!(events[0]["leading"], false);
    assert!(
        events.iter().any(|e| e["holder"] == next["identity"]),
        "the stream saw the new holder: {stream}"
    );
}

/// An app whose health endpoint answers 200 until told to hang.
async fn app_server(hang: Arc<AtomicBool>) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = l.local_addr().expect("addr").port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let hang = hang.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                if hang.load(Ordering::Relaxed) {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                } else {
                    let _ = s
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                        .await;
                }
            });
        }
    });
    port
}

#[tokio::test]
async fn a_hung_app_loses_the_lease() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "health").await;
    let dir = scratch_dir("health");
    let hang_a = Arc::new(AtomicBool::new(false));
    let port_a = app_server(hang_a.clone()).await;
    let port_b = app_server(Arc::new(AtomicBool::new(false))).await;
    let url_a = format!("http://127.0.0.1:{port_a}/healthz");
    let url_b = format!("http://127.0.0.1:{port_b}/healthz");
    let health = |u: &str| {
        vec![
            "--app-health-url".to_string(),
            u.to_string(),
            "--app-health-interval-seconds".into(),
            "0.3".into(),
        ]
    };
    let ha = health(&url_a);
    let a = sidecar(
        &dir,
        &ns.name,
        "db",
        "pod-a",
        &ha.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let (_, first) = the_leader(&[&a]).await;
    let hb = health(&url_b);
    let b = sidecar(
        &dir,
        &ns.name,
        "db",
        "pod-b",
        &hb.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    eventually(Duration::from_secs(10), "pod-b to follow pod-a", || async {
        b.status().filter(|s| s["holder"] == "pod-a")
    })
    .await;
    let t0 = now_ns();
    hang_a.store(true, Ordering::Relaxed);
    let next = eventually(
        Duration::from_secs(10),
        "pod-b to take over from the hung pod-a",
        || async { b.status().filter(|s| s["leading"] == true) },
    )
    .await;
    let took = (now_ns() - t0) as f64 / 1e6;
    eprintln!("hung app detected and lease handed over in {took:.0} ms");
    assert!(next["token"].as_i64() > first["token"].as_i64());
    let sa = a.status().expect("pod-a still answers");
    assert_eq!(sa["leading"], false);
    assert_eq!(sa["appHealthy"], false);
    // It stays out while its app hangs: with the lease released by pod-b, pod-a sees it free
    // and declines it (its log says so), and takes it only once its app answers again (the
    // lease's acquireTime comes after).
    // (It also declined the lease when it gave it up itself, before pod-b took it: count from
    // when it has seen pod-b hold it.)
    eventually(
        Duration::from_secs(30),
        "pod-a to see pod-b hold the lease",
        || async { a.status().filter(|s| s["holder"] == "pod-b") },
    )
    .await;
    let declined = || {
        std::fs::read_to_string(&a.proc.log)
            .unwrap_or_default()
            .matches("the lease is free, and this participant is not eligible")
            .count()
    };
    let before = declined();
    b.proc.signal(Signal::SIGTERM);
    eventually(
        Duration::from_secs(30),
        "pod-a to decline the free lease",
        || async { (declined() > before).then_some(()) },
    )
    .await;
    let leases = Api::<fencedlease::api::FencedLease>::namespaced(client.clone(), &ns.name);
    let lease = leases.get("db").await.expect("the lease");
    assert_eq!(
        lease.holder(),
        None,
        "the lease was taken while pod-a's app hung"
    );
    let free_token = lease.token().expect("a token");
    let answering_again = now_ns();
    hang_a.store(false, Ordering::Relaxed);
    let back = eventually(Duration::from_secs(30), "pod-a to lead again", || async {
        a.status().filter(|s| s["leading"] == true)
    })
    .await;
    // One acquisition since the lease was free: pod-a's, after its app answered again (an
    // ineligible pod that took the lease and gave it back would have moved the token on).
    assert_eq!(back["token"].as_i64(), Some(free_token + 1), "{back}");
    let lease = leases.get("db").await.expect("the lease");
    let acquired = lease
        .status
        .as_ref()
        .and_then(|s| s.acquire_time.as_ref())
        .expect("acquireTime")
        .0
        .as_nanosecond();
    assert!(
        acquired >= answering_again,
        "pod-a took the lease while its app hung: acquired at {acquired} ns, its app answered again at {answering_again} ns"
    );
}

#[test]
fn sidecar_refuses_a_non_loopback_listen_address() {
    let out = Command::new(env!("CARGO_BIN_EXE_fencedlease"))
        .args(["sidecar", "--lease", "x", "--listen", "0.0.0.0:8787"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a loopback address"), "{err}");
}

/// Creates ConfigMap `name` with `data`, protected by lease "db" and stamped with the token of
/// the sidecar status `st` (the leader's).
async fn create_protected(
    cms: &Api<k8s_openapi::api::core::v1::ConfigMap>,
    name: &str,
    st: &Value,
    data: Value,
) {
    let token = st["token"].as_i64().expect("a leader's status has a token");
    let cm = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"fencedlease.io/lease": "db"},
            "annotations": {"fencedlease.io/token": token.to_string(),
                            "fencedlease.io/lease-uid": st["leaseUID"]}},
        "data": data
    }))
    .expect("literal");
    cms.create(&PostParams::default(), &cm)
        .await
        .expect("create the protected ConfigMap");
}

/// An app that knows nothing of tokens writes a protected ConfigMap through the sidecar's API
/// proxy: accepted while its pod leads, refused by the proxy itself once it does not.
#[tokio::test]
async fn the_api_proxy_fences_an_app_that_knows_nothing_of_tokens() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "proxy").await;
    let dir = scratch_dir("proxy");
    let _wh = Webhook::start(&client, &dir, &ns.name).await;
    let proxy_port = free_port();
    let proxy_addr = format!("127.0.0.1:{proxy_port}");
    let a = sidecar(
        &dir,
        &ns.name,
        "db",
        "pod-a",
        &["--proxy-listen", &proxy_addr],
    );
    let (_, st) = the_leader(&[&a]).await;
    let b = sidecar(&dir, &ns.name, "db", "pod-b", &[]);
    // The protected object, created with pod-a's token.
    let cms = Api::namespaced(client.clone(), &ns.name);
    create_protected(&cms, "inventory", &st, json!({"v": "0"})).await;
    // The app: plain kubectl with the kubeconfig the sidecar writes for its proxy (the proxy's
    // address and CA, the pod's secret), and no fencing token.
    let kubectl_via_proxy = |args: &[&str], stdin: Option<&str>| {
        let mut child = Command::new("kubectl")
            .args(["--kubeconfig", &a.proxy_kubeconfig(), "-n", &ns.name])
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("kubectl");
        if let (Some(text), Some(mut input)) = (stdin, child.stdin.take()) {
            use std::io::Write as _;
            input.write_all(text.as_bytes()).expect("kubectl's stdin");
        }
        let out = child.wait_with_output().expect("kubectl");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let app = |value: &str| {
        let patch = format!("{{\"data\":{{\"v\":\"{value}\"}}}}");
        kubectl_via_proxy(
            &[
                "patch",
                "configmap",
                "inventory",
                "--type",
                "merge",
                "-p",
                &patch,
            ],
            None,
        )
    };
    let stored_v = || async {
        let stored = cms.get("inventory").await.expect("get");
        stored.data.and_then(|d| d.get("v").cloned())
    };
    // A JSON patch and a server-side apply (kubectl sends the applied configuration as JSON)
    // are stamped too.
    let json_patch = r#"[{"op":"replace","path":"/data/v","value":"j"}]"#;
    let (ok, err) = kubectl_via_proxy(
        &[
            "patch",
            "configmap",
            "inventory",
            "--type",
            "json",
            "-p",
            json_patch,
        ],
        None,
    );
    assert!(ok, "a JSON patch through the leading pod's proxy: {err}");
    assert_eq!(stored_v().await.as_deref(), Some("j"));
    let applied = format!(
        "{{\"apiVersion\":\"v1\",\"kind\":\"ConfigMap\",\"metadata\":{{\"name\":\"inventory\",\
         \"labels\":{{\"{LEASE_LABEL}\":\"db\"}}}},\"data\":{{\"v\":\"s\"}}}}"
    );
    let (ok, err) = kubectl_via_proxy(
        &["apply", "--server-side", "--force-conflicts", "-f", "-"],
        Some(&applied),
    );
    assert!(
        ok,
        "a server-side apply through the leading pod's proxy: {err}"
    );
    assert_eq!(stored_v().await.as_deref(), Some("s"));
    let (ok, err) = app("1");
    assert!(
        ok,
        "the leading pod's write through the proxy must land: {err}"
    );
    assert_eq!(stored_v().await.as_deref(), Some("1"));
    // pod-a steps down; pod-b leads; pod-a's proxy refuses the app's next write itself.
    let (code, _) = a.curl(&[
        "-X",
        "POST",
        &format!("http://127.0.0.1:{}/v1/release", a.port),
    ]);
    assert_eq!(code, 202);
    eventually(Duration::from_secs(10), "pod-b to lead", || async {
        b.status().filter(|s| s["leading"] == true)
    })
    .await;
    let (ok, err) = app("2");
    assert!(
        !ok,
        "a write through a non-leading pod's proxy must be refused"
    );
    assert!(err.contains("does not lead FencedLease"), "{err}");
    assert_eq!(stored_v().await.as_deref(), Some("1"));
    // Reads still pass through.
    let out = Command::new("kubectl")
        .args([
            "--kubeconfig",
            &a.proxy_kubeconfig(),
            "-n",
            &ns.name,
            "get",
            "configmap",
            "inventory",
        ])
        .output()
        .expect("kubectl");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Deletes are fenced, and the proxy takes the two steps for the app: `kubectl delete` of a
/// protected object through the leading pod's proxy announces the delete under the pod's token
/// and then deletes; the same delete sent straight to the API server is refused.
#[tokio::test]
async fn the_api_proxy_announces_a_protected_delete_for_the_app() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "proxydel").await;
    let dir = scratch_dir("proxydel");
    let _wh = Webhook::start(&client, &dir, &ns.name).await;
    let proxy_addr = format!("127.0.0.1:{}", free_port());
    let a = sidecar(
        &dir,
        &ns.name,
        "db",
        "pod-a",
        &["--proxy-listen", &proxy_addr],
    );
    let (_, st) = the_leader(&[&a]).await;
    let cms = Api::namespaced(client.clone(), &ns.name);
    for name in ["inventory", "orders"] {
        create_protected(&cms, name, &st, json!({})).await;
    }
    let r = cms.delete("orders", &Default::default()).await;
    assert!(
        r.is_err(),
        "a delete that does not go through the proxy is unannounced: {r:?}"
    );
    let (ok, out, err) = kubectl(&[
        "--kubeconfig",
        &a.proxy_kubeconfig(),
        "-n",
        &ns.name,
        "delete",
        "configmap",
        "inventory",
    ]);
    assert!(ok, "the app's delete through the proxy: {out}{err}");
    assert!(
        cms.get_opt("inventory").await.expect("get").is_none(),
        "inventory is gone"
    );
    assert!(
        cms.get_opt("orders").await.expect("get").is_some(),
        "orders stays"
    );
}

/// A sidecar that led and was restarted (its container killed, as the OOM killer would) while
/// the app ran on: the app may hold writes it decided under the earlier run's tenure, so the
/// restarted proxy does not take its own first tenure for the app's first. Unpinned writes wait
/// until the app acknowledges the tenure; the token directory, which outlives the restart,
/// tells the new run that the pod had led.
#[tokio::test]
async fn a_restarted_sidecar_waits_for_the_app_to_acknowledge_its_first_tenure() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "restarted").await;
    let dir = scratch_dir("restarted");
    let _wh = Webhook::start(&client, &dir, &ns.name).await;
    let proxy_addr = format!("127.0.0.1:{}", free_port());
    let proxy = ["--proxy-listen", proxy_addr.as_str()];
    let mut a = sidecar(&dir, &ns.name, "db", "pod-a", &proxy);
    let (_, st) = the_leader(&[&a]).await;
    let cms = Api::namespaced(client.clone(), &ns.name);
    create_protected(&cms, "inventory", &st, json!({})).await;
    let url = format!(
        "https://{proxy_addr}/api/v1/namespaces/{}/configmaps/inventory",
        ns.name
    );
    let token_dir = a.token_dir.clone();
    let write = |value: &str| {
        let body = format!("{{\"data\":{{\"v\":\"{value}\"}}}}");
        curl_with_secret(
            &token_dir,
            &[
                "-X",
                "PATCH",
                "-H",
                "Content-Type: application/merge-patch+json",
                "--data",
                &body,
                &url,
            ],
        )
    };
    let (code, body) = write("a1");
    assert_eq!(
        code, 200,
        "the pod's first tenure needs no acknowledgement: {body}"
    );
    a.proc.signal(Signal::SIGKILL);
    a.proc.wait_exit(Duration::from_secs(10));
    let a2 = sidecar(&dir, &ns.name, "db", "pod-a", &proxy);
    let again = eventually(
        Duration::from_secs(20),
        "the restarted sidecar to lead",
        || async { a2.status().filter(|s| s["leading"] == true) },
    )
    .await;
    let (code, body) = write("a2");
    assert_eq!(code, 403, "{body}");
    assert!(body.contains("POST /v1/acknowledge"), "{body}");
    let token = again["token"].as_i64().expect("token");
    let ack = format!("{{\"token\":{token}}}");
    let (code, body) = a2.curl(&[
        "-X",
        "POST",
        "-H",
        "Content-Type: application/json",
        "--data",
        &ack,
        &format!("{}/v1/acknowledge", a2.url),
    ]);
    assert_eq!(code, 200, "{body}");
    let (code, body) = write("a3");
    assert_eq!(code, 200, "{body}");
}

#[tokio::test]
async fn the_sidecar_api_answers_bad_requests_with_4xx() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "sidecar-bad").await;
    let dir = scratch_dir("sidecar-bad");
    let a = sidecar(&dir, &ns.name, "db", "pod-a", &[]);
    the_leader(&[&a]).await;
    let base = format!("http://127.0.0.1:{}", a.port);
    for (args, want) in [
        (vec!["-X", "POST", "/v1/token"], 405),
        (vec!["-X", "DELETE", "/v1/status"], 405),
        (vec!["-X", "GET", "/v1/release"], 405),
        (vec!["-X", "GET", "/v2/token"], 404),
        (vec!["-X", "GET", "/%ff%fe"], 404),
    ] {
        let url = format!("{base}{}", args[2]);
        let (code, _) = a.curl(&[args[0], args[1], &url]);
        assert_eq!(code, want, "{args:?}");
    }
    assert!(
        a.status().is_some_and(|s| s["leading"] == true),
        "still serving and leading"
    );
}

/// Issue 33, hole 7: the pod's loopback is not private (`kubectl port-forward` reaches it), so
/// the sidecar's API and proxy answer only requests with the pod's secret, a file in the token
/// dir. Without it (or with a wrong one) nothing that tells the token or writes gets through,
/// nor does the proxy read with the pod's credentials; the health endpoints stay open; the
/// secret outlives a restart of the sidecar, so that the app's copy stays good.
#[tokio::test]
async fn without_the_pods_secret_the_sidecar_gives_neither_the_token_nor_the_pods_rights() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "secret").await;
    let dir = scratch_dir("secret");
    let proxy_addr = format!("127.0.0.1:{}", free_port());
    let proxy = ["--proxy-listen", proxy_addr.as_str()];
    let mut a = sidecar(&dir, &ns.name, "db", "pod-a", &proxy);
    let (_, st) = the_leader(&[&a]).await;
    let cms = Api::namespaced(client.clone(), &ns.name);
    create_protected(&cms, "inventory", &st, json!({"v": "0"})).await;
    let secret = a.secret();
    assert_eq!(secret.len(), 64, "{secret:?}");
    let cm = format!(
        "https://{proxy_addr}/api/v1/namespaces/{}/configmaps/inventory",
        ns.name
    );
    let patch = [
        "-X",
        "PATCH",
        "-H",
        "Content-Type: application/merge-patch+json",
    ];
    let guarded: Vec<Vec<String>> = [
        vec!["-X", "GET", "/v1/token"],
        vec!["-X", "GET", "/v1/status"],
        vec!["-X", "GET", "/v1/watch"],
        vec!["-X", "GET", "/metrics"],
        vec!["-X", "POST", "/v1/release"],
        vec![
            "-X",
            "POST",
            "-H",
            "Content-Type: application/json",
            "--data",
            "{\"token\":1}",
            "/v1/acknowledge",
        ],
    ]
    .into_iter()
    .map(|mut args| {
        let path = args.pop().expect("path");
        let mut args: Vec<String> = args.into_iter().map(String::from).collect();
        args.push(format!("{}{path}", a.url));
        args
    })
    .chain([
        vec!["-X".to_string(), "GET".to_string(), cm.clone()],
        patch
            .iter()
            .map(|s| s.to_string())
            .chain([
                "--data".into(),
                "{\"data\":{\"v\":\"pf\"}}".into(),
                cm.clone(),
            ])
            .collect(),
    ])
    .collect();
    let wrong = format!("Authorization: Bearer {}", "0".repeat(64));
    for args in &guarded {
        // As a port-forward from outside would: no secret, and no need of the proxy's CA.
        let args: Vec<&str> = ["-k"]
            .into_iter()
            .chain(args.iter().map(String::as_str))
            .collect();
        let (code, body) = curl(&args);
        assert_eq!(code, 401, "without the secret: {args:?}: {body}");
        assert!(
            body.contains("api-secret"),
            "the refusal names the file: {body}"
        );
        let with_wrong: Vec<&str> = ["-H", wrong.as_str()]
            .into_iter()
            .chain(args.iter().copied())
            .collect();
        let (code, body) = curl(&with_wrong);
        assert_eq!(code, 401, "with a wrong secret: {args:?}: {body}");
    }
    assert_eq!(
        cms.get("inventory")
            .await
            .expect("get")
            .data
            .and_then(|d| d.get("v").cloned()),
        Some("0".to_string()),
        "nothing was written through the proxy"
    );
    assert!(
        a.status().is_some_and(|s| s["leading"] == true),
        "the refused release released nothing"
    );
    for probe in ["/healthz", "/readyz", "/livez"] {
        let (code, body) = curl(&[&format!("{}{probe}", a.url)]);
        assert_eq!(code, 200, "{probe} stays open: {body}");
    }
    // With the secret: the token and the pod's rights.
    let (code, body) = a.curl(&[&format!("{}/v1/token", a.url)]);
    assert_eq!(code, 200, "{body}");
    let mut with_secret: Vec<&str> = patch.to_vec();
    with_secret.extend(["--data", "{\"data\":{\"v\":\"app\"}}", cm.as_str()]);
    let (code, body) = a.curl(&with_secret);
    assert_eq!(code, 200, "{body}");
    // A restarted sidecar keeps the pod's secret.
    a.proc.signal(Signal::SIGKILL);
    a.proc.wait_exit(Duration::from_secs(10));
    let a2 = sidecar(&dir, &ns.name, "db", "pod-a", &proxy);
    eventually(
        Duration::from_secs(20),
        "the restarted sidecar to answer",
        || async { a2.status() },
    )
    .await;
    assert_eq!(a2.secret(), secret, "the secret changed across a restart");
}

/// The value of the one sample of `metric` in an exposition text (with its `lease` label).
fn sample(text: &str, metric: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(&format!("{metric}{{lease=\"db\"}} ")))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test]
async fn the_probe_port_serves_metrics_without_the_token_and_renewals_move_their_gauge() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "sidecar-metrics").await;
    let dir = scratch_dir("sidecar-metrics");
    let probe = format!("127.0.0.1:{}", free_port());
    let a = sidecar(&dir, &ns.name, "db", "pod-a", &["--probe-listen", &probe]);
    let (_, st) = the_leader(&[&a]).await;
    let token = st["token"].as_f64().expect("token");
    let (code, all) = a.curl(&[&format!("http://127.0.0.1:{}/metrics", a.port)]);
    assert_eq!(code, 200, "{all}");
    assert_eq!(
        sample(&all, "fencedlease_sidecar_token"),
        Some(token),
        "{all}"
    );
    assert_eq!(
        sample(&all, "fencedlease_sidecar_leading"),
        Some(1.0),
        "{all}"
    );
    let (code, public) = curl(&[&format!("http://{probe}/metrics")]);
    assert_eq!(code, 200, "{public}");
    assert_eq!(
        sample(&public, "fencedlease_sidecar_leading"),
        Some(1.0),
        "{public}"
    );
    assert!(
        !public.contains("token"),
        "the probe port's metrics name the token:\n{public}"
    );
    // The last renewal is recent, and moves on with the next ones (a 2 s lease is renewed
    // well within its duration).
    let renewed = |text: &str| {
        sample(text, "fencedlease_sidecar_last_renewal_timestamp_seconds").expect("renewal gauge")
    };
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs_f64()
    };
    let first = renewed(&public);
    assert!(
        first > 0.0 && first <= now(),
        "last renewal {first} is not a time of this run's past"
    );
    // The gauge moves with the next renewal.
    eventually(
        Duration::from_secs(30),
        "a later renewal on the gauge",
        || async {
            let (_, later) = curl(&[&format!("http://{probe}/metrics")]);
            (renewed(&later) > first).then_some(())
        },
    )
    .await;
}

/// Issue 33, hole 2, the hand-back story: pod A leads and its app decides a write under token
/// T1 (pinning it with the `fencedlease-token` header), then stalls; B leads and writes; A leads
/// again under T3. The stalled write, sent only now through A's proxy, must not go out under
/// T3: the proxy refuses it, saying which tenure it was decided in. A write decided under T3
/// lands.
#[tokio::test]
async fn a_write_pinned_to_an_earlier_tenure_is_refused_when_the_lease_comes_back() {
    let client = client().await;
    ensure_crd();
    let ns = TestNamespace::new(&client, "handback").await;
    let dir = scratch_dir("handback");
    let _wh = Webhook::start(&client, &dir, &ns.name).await;
    let proxy_addr = format!("127.0.0.1:{}", free_port());
    let a = sidecar(
        &dir,
        &ns.name,
        "db",
        "pod-a",
        &["--proxy-listen", &proxy_addr],
    );
    let (_, first) = the_leader(&[&a]).await;
    let t1 = first["token"].as_i64().expect("token");
    let cms = Api::namespaced(client.clone(), &ns.name);
    create_protected(&cms, "inventory", &first, json!({"v": "a1"})).await;
    let write = |pin: Option<i64>, value: &str| {
        let url = format!(
            "https://{proxy_addr}/api/v1/namespaces/{}/configmaps/inventory",
            ns.name
        );
        let body = format!("{{\"data\":{{\"v\":\"{value}\"}}}}");
        let pin = pin.map(|t| format!("fencedlease-token: {t}"));
        let mut args = vec![
            "-X",
            "PATCH",
            "-H",
            "Content-Type: application/merge-patch+json",
        ];
        if let Some(p) = &pin {
            args.extend(["-H", p.as_str()]);
        }
        args.extend(["--data", body.as_str(), url.as_str()]);
        a.curl(&args)
    };
    let stored = || async {
        let c = cms.get("inventory").await.expect("get");
        c.data.and_then(|d| d.get("v").cloned()).unwrap_or_default()
    };
    // A's app decided "a-stale" under T1 and stalls. A hands the lease to B.
    let b = sidecar(
        &dir,
        &ns.name,
        "db",
        "pod-b",
        &["--proxy-listen", &format!("127.0.0.1:{}", free_port())],
    );
    let (code, _) = a.curl(&["-X", "POST", &format!("{}/v1/release", a.url)]);
    assert_eq!(code, 202);
    let on_b = eventually(Duration::from_secs(10), "pod-b to lead", || async {
        b.status().filter(|s| s["leading"] == true)
    })
    .await;
    let fenced_b = json!({"metadata": {"annotations": {
        "fencedlease.io/token": on_b["token"].as_i64().expect("token").to_string(),
        "fencedlease.io/lease-uid": on_b["leaseUID"],
        "fencedlease.io/write-id": common::new_write_id()}}, "data": {"v": "b"}});
    cms.patch(
        "inventory",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&fenced_b),
    )
    .await
    .expect("B's fenced write");
    // B hands it back: A leads again, with a larger token.
    let (code, _) = b.curl(&["-X", "POST", &format!("{}/v1/release", b.url)]);
    assert_eq!(code, 202);
    let again = eventually(Duration::from_secs(20), "pod-a to lead again", || async {
        a.status().filter(|s| s["leading"] == true)
    })
    .await;
    let t3 = again["token"].as_i64().expect("token");
    assert!(t3 > t1 + 1, "{t3} after {t1}");
    // The stalled write goes out only now, pinned to T1: refused by the proxy.
    let (code, body) = write(Some(t1), "a-stale");
    assert_eq!(code, 403, "{body}");
    assert!(
        body.contains(&format!("decided under token {t1}")),
        "{body}"
    );
    // Unpinned, it is refused too: the app has not shown it knows the new tenure.
    let (code, body) = write(None, "a-stale");
    assert_eq!(code, 403, "{body}");
    assert!(body.contains("POST /v1/acknowledge"), "{body}");
    assert_eq!(stored().await, "b", "B's work stands");
    // Acknowledging an old tenure is refused and opens nothing.
    let ack = |t: i64| {
        a.curl(&[
            "-X",
            "POST",
            "-H",
            "Content-Type: application/json",
            "--data",
            &format!("{{\"token\":{t}}}"),
            &format!("{}/v1/acknowledge", a.url),
        ])
    };
    let (code, body) = ack(t1);
    assert_eq!(code, 409, "{body}");
    let (code, body) = write(None, "a-stale");
    assert_eq!(code, 403, "{body}");
    // A write decided in the current tenure lands.
    let (code, body) = write(Some(t3), "a3");
    assert_eq!(code, 200, "{body}");
    assert_eq!(stored().await, "a3");
    // Pinned to the current tenure, it showed the app knows it: unpinned writes go out again,
    // as after an explicit acknowledgement.
    let (code, body) = write(None, "a4");
    assert_eq!(code, 200, "{body}");
    let (code, body) = ack(t3);
    assert_eq!(code, 200, "{body}");
}
