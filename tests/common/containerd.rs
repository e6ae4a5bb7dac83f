//! The node's containerd, driven with `ctr` (Debian's containerd package; hack/node.sh installs
//! it) for what the Kubernetes API cannot do: freeze a pod (containerd's task pause, the freezer
//! cgroup: a stalled VM), kill one container, read a container's files, and record the order in
//! which the runtime started and stopped tasks.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use k8s_openapi::api::core::v1::{Node, Pod};

use super::node::{container_id, name_of, SOCKET_ANNOTATION};

/// The node's containerd socket: the Node's annotation (hack/node.sh), else where hack/node.sh
/// puts it beside the test cluster's kubeconfig.
pub fn containerd_socket(node: &Node) -> PathBuf {
    let from_node = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(SOCKET_ANNOTATION))
        .map(PathBuf::from);
    let beside = super::kubeconfig_path()
        .parent()
        .map(|d| d.join("node/containerd/containerd.sock"));
    from_node
        .into_iter()
        .chain(beside)
        .find(|p| p.exists())
        .unwrap_or_else(|| {
            panic!(
                "cannot find the node's containerd socket (Node annotation {SOCKET_ANNOTATION}, or \
                 node/containerd/containerd.sock beside {}): freezing a pod needs `ctr` on the \
                 node's machine",
                super::kubeconfig_path().display()
            )
        })
}

pub fn ctr(socket: &Path, args: &[&str]) -> String {
    let out = Command::new("ctr")
        .arg("--address")
        .arg(socket)
        .args(["--namespace", "k8s.io"])
        .args(args)
        .output()
        .expect("running ctr (Debian's containerd package; hack/node.sh installs it)");
    assert!(
        out.status.success(),
        "ctr {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// containerd's event stream (`ctr events`), recorded to a file while it lives: the order in
/// which the node started and stopped tasks, as the runtime saw it.
pub struct CtrEvents {
    child: std::process::Child,
    out: PathBuf,
}

impl CtrEvents {
    pub fn start(socket: &Path, out: PathBuf) -> CtrEvents {
        let file = std::fs::File::create(&out).expect("creating the events file");
        let child = Command::new("ctr")
            .arg("--address")
            .arg(socket)
            .args(["--namespace", "k8s.io", "events"])
            .stdout(file)
            .spawn()
            .expect("running ctr events (Debian's containerd package; hack/node.sh installs it)");
        CtrEvents { child, out }
    }

    /// Stops recording; returns (topic, container id) of every container's task start and exit,
    /// in order.
    pub fn stop(mut self) -> Vec<(String, String)> {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let text = std::fs::read_to_string(&self.out).unwrap_or_default();
        text.lines()
            .filter_map(|l| {
                let topic = ["/tasks/start", "/tasks/exit"]
                    .into_iter()
                    .find(|t| l.contains(&format!(" {t} ")))?;
                let body = &l[l.find(topic)? + topic.len()..];
                let v: serde_json::Value = serde_json::from_str(body.trim()).ok()?;
                let container = v["container_id"].as_str()?;
                // An exec'd process (an exec probe) exits as a task of the container too, under
                // an id of its own: only the container's own task counts.
                if topic == "/tasks/exit" && v["id"].as_str() != Some(container) {
                    return None;
                }
                Some((topic.to_string(), container.to_string()))
            })
            .collect()
    }
}

impl Drop for CtrEvents {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The host pid of a container's task.
pub fn task_pid(socket: &Path, id: &str) -> u32 {
    let list = ctr(socket, &["tasks", "ls"]);
    list.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            (f.next()? == id).then(|| f.next()?.parse().ok())?
        })
        .next()
        .unwrap_or_else(|| panic!("containerd runs no task {id}:\n{list}"))
}

/// The token file as the pod's app container sees it (None when absent), read through the
/// container's root on the host.
pub fn token_file(socket: &Path, pod: &Pod) -> Option<String> {
    let pid = task_pid(socket, &container_id(pod, "app"));
    std::fs::read_to_string(format!("/proc/{pid}/root/var/run/fencedlease/token"))
        .ok()
        .map(|s| s.trim().to_string())
}

/// Every container of a pod, its sandbox included, paused (frozen) until `thaw` or drop.
pub struct Frozen {
    socket: PathBuf,
    ids: Vec<String>,
    pub since: Instant,
}

impl Frozen {
    pub fn freeze(socket: &Path, pod: &Pod) -> Frozen {
        let uid = pod.metadata.uid.as_deref().expect("pod uid");
        let filter = format!("labels.\"io.kubernetes.pod.uid\"=={uid}");
        let ids: Vec<String> = ctr(socket, &["containers", "ls", "-q", &filter])
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect();
        // The sandbox and the two containers.
        assert!(
            ids.len() >= 3,
            "containers of pod {} in containerd: {ids:?}",
            name_of(pod)
        );
        let mut frozen = Frozen {
            socket: socket.to_path_buf(),
            ids: vec![],
            since: Instant::now(),
        };
        for id in ids {
            ctr(socket, &["tasks", "pause", &id]);
            frozen.ids.push(id);
        }
        for id in &frozen.ids {
            let list = ctr(socket, &["tasks", "ls"]);
            let line = list
                .lines()
                .find(|l| l.starts_with(id.as_str()))
                .unwrap_or_default();
            assert!(line.contains("PAUSED"), "task {id} is not paused: {line:?}");
        }
        frozen
    }

    pub fn thaw(&mut self) {
        for id in std::mem::take(&mut self.ids) {
            let _ = Command::new("ctr")
                .arg("--address")
                .arg(&self.socket)
                .args(["--namespace", "k8s.io", "tasks", "resume", &id])
                .output();
        }
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        // Never leave a frozen pod behind: the kubelet could not stop it.
        self.thaw();
    }
}
