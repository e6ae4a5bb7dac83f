//! Sidecar injection on a real node: a Deployment with the injection annotation and
//! leader-only readiness has one leader, the only Ready pod and the only one labelled
//! `fencedlease.io/role=leader`; the injected native sidecar starts before the app and stops
//! after it.

use fencedlease_testkit as common;

use std::time::Duration;

use common::containerd::{containerd_socket, task_pid, CtrEvents};
use common::eventually;
use common::node::{
    container_id, container_names, container_statuses, describe, has_leader_label, holder,
    is_ready, name_of, ready_node,
};
use common::operator::{Injected, LEASE};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, ListParams};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_injected_deployment_has_one_leader_the_only_ready_and_labelled_pod() {
    let w = Injected::start("node-inject").await;
    let (leader, follower, lease) = w.steady(Duration::from_secs(120)).await;
    let leader_name = name_of(&leader);
    println!(
        "leader {leader_name} (token {:?}), follower {}",
        lease.token(),
        name_of(&follower)
    );
    // The sidecar was injected as a native sidecar where the server has them (1.29+: an init
    // container that runs for the pod's life, ahead of the app), else as an ordinary container.
    if common::server_minor(&w.client).await >= 29 {
        assert_eq!(container_names(&leader), ["fencedlease", "app"]);
    } else {
        assert_eq!(container_names(&leader), ["app", "fencedlease"]);
    }
    // The holder reports the token it holds; the token is the lease's generation.
    let status = lease.status.clone().unwrap_or_default();
    assert_eq!(
        status.holder_identity.as_deref(),
        Some(leader_name.as_str())
    );
    assert_eq!(
        status.token,
        lease.token(),
        "status.token vs metadata.generation"
    );

    // And it stays that way for a while: one Ready pod, the holder, alone labelled.
    for _ in 0..20 {
        let live = w.live_pods().await.expect("listing pods");
        let ready: Vec<String> = live.iter().filter(|p| is_ready(p)).map(name_of).collect();
        let labelled: Vec<String> = live
            .iter()
            .filter(|p| has_leader_label(p))
            .map(name_of)
            .collect();
        assert_eq!(
            ready.as_slice(),
            std::slice::from_ref(&leader_name),
            "Ready pods: {}",
            describe(&live)
        );
        assert_eq!(
            labelled.as_slice(),
            std::slice::from_ref(&leader_name),
            "labelled pods: {}",
            describe(&live)
        );
        assert_eq!(
            holder(&w.leases(), LEASE).await.as_deref(),
            Some(leader_name.as_str()),
            "the lease moved without a failure\n{}",
            w.sidecar_logs().await
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    from_outside_the_pods_containers_only_the_probes_answer(&w, &leader).await;
}

/// Issue 33, hole 7, on a real pod: a port-forward is a connection to the pod's loopback from
/// outside its containers (the kubelet's port-forward enters the pod's network namespace and
/// dials localhost; this node's kubelet listens on loopback only, out of the API server's
/// reach, so the test enters the namespace itself, with nsenter). From there the sidecar's API
/// and proxy refuse everything but the probes; the app container, which reads the pod's secret
/// in its token volume, gets the token, and the kubeconfig the sidecar wrote for it.
async fn from_outside_the_pods_containers_only_the_probes_answer(w: &Injected, leader: &Pod) {
    let socket = containerd_socket(&ready_node(&w.client).await);
    let pid = task_pid(&socket, &container_id(leader, "app"));
    let net = format!("--net=/proc/{pid}/ns/net");
    let curl = |extra: &[&str], url: &str| {
        let out = std::process::Command::new("nsenter")
            .args([
                net.as_str(),
                "curl",
                "-sk",
                "--max-time",
                "5",
                "-o",
                "/dev/null",
            ])
            .args(["-w", "%{http_code}"])
            .args(extra)
            .arg(url)
            .output()
            .expect("nsenter and curl");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let api = "http://127.0.0.1:8787";
    // What the pod's ServiceAccount may read: its lease.
    let proxy = format!(
        "https://127.0.0.1:8788/apis/fencedlease.io/v1alpha1/namespaces/{}/fencedleases/{LEASE}",
        w.ns.name
    );
    for url in [
        format!("{api}/v1/token"),
        format!("{api}/v1/status"),
        proxy.clone(),
    ] {
        assert_eq!(curl(&[], &url), "401", "{url} without the pod's secret");
    }
    assert_eq!(curl(&[], &format!("{api}/healthz")), "200");
    let volume = format!("/proc/{pid}/root/var/run/fencedlease");
    let secret = std::fs::read_to_string(format!("{volume}/api-secret"))
        .expect("the app container reads the pod's secret");
    let auth = format!("Authorization: Bearer {}", secret.trim());
    assert_eq!(curl(&["-H", &auth], &format!("{api}/v1/token")), "200");
    assert_eq!(curl(&["-H", &auth], &proxy), "200");
    let kubeconfig = std::fs::read_to_string(format!("{volume}/kubeconfig"))
        .expect("the app container reads the proxy's kubeconfig");
    assert!(
        kubeconfig.contains("https://127.0.0.1:8788"),
        "{kubeconfig}"
    );
}

/// Native sidecars (Kubernetes 1.29+; the injection chooses them by the server's version): the
/// kubelet starts the injected sidecar, and waits for its startup probe, before the app, and
/// stops it only after the app has exited, so the app has its token and proxy for its whole
/// life. Seen in containerd's own event stream, which orders task starts and exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_native_sidecar_starts_before_the_app_and_stops_after_it() {
    let w = Injected::start("node-native").await;
    let minor = common::server_minor(&w.client).await;
    assert!(
        minor >= 29,
        "native sidecars need Kubernetes 1.29+, this server is 1.{minor}: hack/test.sh runs the \
         node tests on the current release"
    );
    let socket = containerd_socket(&ready_node(&w.client).await);
    let (leader, follower, _) = w.steady(Duration::from_secs(120)).await;
    assert_eq!(container_names(&leader), ["fencedlease", "app"]);
    let before = [name_of(&leader), name_of(&follower)];
    let old_ids = [
        container_id(&leader, "fencedlease"),
        container_id(&leader, "app"),
    ];
    let dir = common::procs::scratch_dir("node-native");
    let events = CtrEvents::start(&socket, dir.join("ctr-events.txt"));
    w.pods()
        .delete(&before[0], &DeleteParams::default())
        .await
        .expect("deleting the leader pod");
    let replacement = eventually(
        Duration::from_secs(120),
        "the Deployment's replacement pod with both containers running, and the old pod gone",
        || async {
            let all = w.pods().list(&ListParams::default()).await;
            let all = all.map_err(|e| e.to_string())?.items;
            let old_gone = !all.iter().any(|p| name_of(p) == before[0]);
            let new = w.live_pods().await?.into_iter().find(|p| {
                !before.contains(&name_of(p))
                    && container_statuses(p)
                        .iter()
                        .all(|c| c.started == Some(true))
                    && container_statuses(p).len() == 2
            });
            match new {
                Some(p) if old_gone => Ok(p),
                _ => Err(describe(&all)),
            }
        },
    )
    .await;
    let new_ids = [
        container_id(&replacement, "fencedlease"),
        container_id(&replacement, "app"),
    ];
    let seen = events.stop();
    let at = |topic: &str, id: &str| {
        seen.iter()
            .position(|(t, c)| t == topic && c == id)
            .unwrap_or_else(|| panic!("containerd reported no {topic} of {id}: {seen:?}"))
    };
    assert!(
        at("/tasks/start", &new_ids[0]) < at("/tasks/start", &new_ids[1]),
        "the replacement's app started before its sidecar: {seen:?}"
    );
    assert!(
        at("/tasks/exit", &old_ids[1]) < at("/tasks/exit", &old_ids[0]),
        "the deleted pod's sidecar stopped before its app: {seen:?}"
    );
    println!(
        "native sidecar: started first in {}, stopped last in {}",
        name_of(&replacement),
        before[0]
    );
}
