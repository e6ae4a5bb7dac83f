"""Failover after the campaigning container exits on a real node (issue 17, "exited").

The candidates run in pods on the bench cluster's node (hack/node.sh: a kubelet with
containerd), as workloads do: pods with `restartPolicy: Always`, as a Deployment makes them.
- fencedlease: pods annotated `fencedlease.io/lease: <lease>`, into which the webhook (running
  on this machine, registered as the MutatingWebhookConfiguration for the bench namespace)
  injects its sidecar, as in a real install (on 1.29+ a native sidecar); a `fencedlease
  controller` watches the namespace. A second system, fencedlease-opted-out, runs the same pods
  on leases with `spec.revokeOnHolderDeath: false`: the same event without the early revocation.
- client-go: pods running the peer (client-go's leader-election example of the server's release,
  bench/peer-image.sh) as their only container. Its identity is a UUID per process, the
  example's default, as controller-runtime and kube-controller-manager make theirs (host name +
  UUID): a restarted process is a new candidate. (With a fixed identity, a restarted process
  would find itself the holder and carry on at once, without any failover.)

In every trial of a lane: wait until one candidate leads, every candidate's campaigning
container has run for 1.5 s, and (fencedlease) the holder's pod carries the leader label (the
controller's pod index has it); wait a random extra time; then SIGKILL the holder's campaigning
container's process (its PID from containerd, as the kernel's OOM killer would kill it; the
kubelet sees it exit and restarts it) and time until the API server records a new holder
(fencedlease: a holder with a larger token; client-go: another holderIdentity), as a watch of the
lease object on this machine sees it. Both systems are observed the same way. The killed pod is
then deleted and replaced by a new one, so that no container is killed twice (the kubelet's
restart back-off would otherwise grow from trial to trial).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import lib
from failover import PREFIX, controller_report, create_leases, finish, start_controller
from lib import Kube, log, now_ns, stats, step, version
from systems import OURS_OPT_OUT, SYSTEMS, is_ours, peer_timings

SCENARIO = "exited"
PAUSE_IMAGE = "localhost/fencedlease/pause:3.4"  # hack/node.sh imports it
OURS_IMAGE = f"fencedlease:{version()}"  # hack/image.sh
SIDECAR = "fencedlease"  # the injected container (src/webhook/inject.rs CONTAINER)
PEER_CONTAINER = "campaign"
ROLE_LABEL = "fencedlease.io/role"


# -- the objects -------------------------------------------------------------------------------
def lease_object_path(system: str, ns: str, lease: str, watch: bool = False) -> str:
    if is_ours(system):
        base = f"/apis/fencedlease.io/v1alpha1/namespaces/{ns}/fencedleases"
    else:
        base = f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
    return base if watch else f"{base}/{lease}"


def tenure(system: str, obj: dict | None) -> tuple[str | None, int | None]:
    """(holder, token): fencedlease's token is the generation; client-go has none (None)."""
    if not obj:
        return None, None
    holder = (obj.get("spec") or {}).get("holderIdentity") or None
    token = (obj.get("metadata") or {}).get("generation") if is_ours(system) else None
    return holder, token


def setup_rbac(kube: Kube, ns: str) -> None:
    """ServiceAccounts for both kinds of candidate, with what each needs and no more."""
    rules = {
        "fl-candidate": [
            {"apiGroups": ["fencedlease.io"], "resources": ["fencedleases"],
             "verbs": ["get", "list", "watch", "update"]},
            {"apiGroups": ["fencedlease.io"], "resources": ["fencedleases/status"], "verbs": ["update"]}],
        "cg-candidate": [
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
             "verbs": ["get", "create", "update"]}],
    }
    rbac = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}"
    for sa, rs in rules.items():
        kube.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts",
                     {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa}})
        kube.request("POST", f"{rbac}/roles", {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                                               "metadata": {"name": sa}, "rules": rs})
        kube.request("POST", f"{rbac}/rolebindings", {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": sa},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]})


def register_injection(kube: Kube, name: str, port: int, bundle: str, ns: str) -> None:
    """The MutatingWebhookConfiguration of the chart, for the bench namespace, by URL."""
    path = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
    kube.request("DELETE", f"{path}/{name}", ok=(200, 404))
    kube.request("POST", path, {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [{
            "name": "inject.fencedlease.io", "admissionReviewVersions": ["v1"], "sideEffects": "None",
            "failurePolicy": "Fail", "reinvocationPolicy": "Never", "timeoutSeconds": 10,
            "clientConfig": {"url": f"https://127.0.0.1:{port}/mutate", "caBundle": bundle},
            "namespaceSelector": {"matchLabels": {"fencedlease.io/bench-ns": ns}},
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                       "resources": ["pods"], "scope": "Namespaced"}]}]})


def pod_body(system: str, name: str, lane: str, ns: str, lease_s: int, peer_image: str,
             events_dir: Path) -> dict:
    meta = {"name": name, "labels": {"fencedlease.io/bench": SCENARIO, "fencedlease.io/bench-lane": lane}}
    spec: dict = {"restartPolicy": "Always", "terminationGracePeriodSeconds": 2,
                  "enableServiceLinks": False}
    if is_ours(system):
        meta["annotations"] = {"fencedlease.io/lease": lane}
        spec.update(serviceAccountName="fl-candidate",
                    containers=[{"name": "app", "image": PAUSE_IMAGE, "imagePullPolicy": "Never"}])
    else:
        d, r, p = peer_timings(lease_s)
        spec.update(serviceAccountName="cg-candidate", containers=[{
            "name": PEER_CONTAINER, "image": peer_image, "imagePullPolicy": "Never",
            "args": ["-lease-lock-name", lane, "-lease-lock-namespace", ns, "-lease-duration", f"{d}s",
                     "-renew-deadline", f"{r}s", "-retry-period", f"{p}s",
                     "-events-file", "/bench-events/$(POD_NAME).events"],
            "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
            # Which pod a UUID belongs to: the peer's events file, on this machine.
            "volumeMounts": [{"name": "events", "mountPath": "/bench-events"}]}],
            volumes=[{"name": "events", "hostPath": {"path": str(events_dir), "type": "Directory"}}])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def campaigner_status(system: str, pod: dict) -> dict | None:
    """The status of the container that campaigns (the sidecar may be a native one: an init
    container)."""
    name = SIDECAR if is_ours(system) else PEER_CONTAINER
    st = pod.get("status") or {}
    for c in (st.get("containerStatuses") or []) + (st.get("initContainerStatuses") or []):
        if c.get("name") == name:
            return c
    return None


def running_since_ns(system: str, pod: dict) -> int | None:
    c = campaigner_status(system, pod) or {}
    started = ((c.get("state") or {}).get("running") or {}).get("startedAt")
    return lib.parse_time_ns(started) if started else None


# -- containerd ---------------------------------------------------------------------------------
def containerd_socket() -> str:
    return str(lib.CLUSTER_DIR / "node/containerd/containerd.sock")


def task_pid(container_id: str) -> int:
    """The host PID of a running container's first process, as containerd reports it."""
    out = subprocess.run(["ctr", "--address", containerd_socket(), "--namespace", "k8s.io", "tasks", "ls"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    for line in out.splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 3 and parts[0] == container_id and parts[2] == "RUNNING":
            return int(parts[1])
    raise RuntimeError(f"containerd runs no task {container_id}")


# -- watching the lease -------------------------------------------------------------------------
class LeaseWatch(threading.Thread):
    """Every version of one lease object, with the time this machine received it."""

    def __init__(self, system: str, ns: str, lease: str):
        super().__init__(daemon=True)
        self.system, self.ns, self.lease = system, ns, lease
        self.seen: list[tuple[int, str | None, int | None]] = []
        self.lock = threading.Lock()
        self.stopped = False
        self.kube = Kube()

    def record(self, obj: dict | None) -> None:
        h, t = tenure(self.system, obj)
        with self.lock:
            if not self.seen or self.seen[-1][1:] != (h, t):
                self.seen.append((now_ns(), h, t))

    def last(self) -> tuple[int, str | None, int | None] | None:
        with self.lock:
            return self.seen[-1] if self.seen else None

    def since(self, t_ns: int) -> list[tuple[int, str | None, int | None]]:
        with self.lock:
            return [s for s in self.seen if s[0] > t_ns]

    def run(self) -> None:
        base = lease_object_path(self.system, self.ns, self.lease, watch=True)
        sel = f"fieldSelector=metadata.name%3D{self.lease}"
        while not self.stopped:
            try:
                listed = self.kube.request("GET", f"{base}?{sel}")
                items = listed.get("items") or []
                self.record(items[0] if items else None)
                self.stream(f"{base}?{sel}&watch=1&timeoutSeconds=240"
                            f"&resourceVersion={listed['metadata']['resourceVersion']}")
            except Exception as e:  # noqa: BLE001 - a broken watch is re-listed
                log(f"watch of {self.lease}: {e}; re-listing")
                time.sleep(0.5)

    def stream(self, path: str) -> None:
        import http.client

        c = http.client.HTTPSConnection("127.0.0.1", lib.API_PORT, context=self.kube.ctx, timeout=300)
        try:
            c.request("GET", path, headers={"Authorization": f"Bearer {self.kube.token}"})
            resp = c.getresponse()
            if resp.status != 200:
                raise lib.ApiError(resp.status, resp.read()[:300])
            while not self.stopped:
                line = resp.readline()
                if not line:
                    return
                ev = json.loads(line)
                if ev.get("type") == "DELETED":
                    self.record(None)
                elif ev.get("type") in ("ADDED", "MODIFIED"):
                    self.record(ev["object"])
                elif ev.get("type") == "ERROR":
                    raise RuntimeError(f"watch error: {ev.get('object')}")
        finally:
            c.close()


# -- one lane ------------------------------------------------------------------------------------
class Lane(threading.Thread):
    def __init__(self, system: str, idx: int, args, ns: str, events_dir: Path, results: list,
                 lock: threading.Lock):
        super().__init__(daemon=True)
        self.events_dir = events_dir
        self.system, self.args, self.ns = system, args, ns
        self.lease = f"{PREFIX[system]}-{idx}"
        self.results, self.lock = results, lock
        self.kube = Kube()
        self.gen = 0
        self.names: list[str] = []
        self.watch = LeaseWatch(system, ns, self.lease)
        self.failures = 0

    def pod_path(self, name: str = "") -> str:
        return f"/api/v1/namespaces/{self.ns}/pods" + (f"/{name}" if name else "")

    def pods(self) -> dict[str, dict]:
        listed = self.kube.request("GET", self.pod_path() + f"?labelSelector=fencedlease.io/bench-lane%3D{self.lease}")
        return {p["metadata"]["name"]: p for p in listed.get("items") or []}

    def ensure_pods(self) -> None:
        while len(self.names) < self.args.candidates:
            self.gen += 1
            name = f"{self.lease}-g{self.gen}"
            self.kube.request("POST", self.pod_path(),
                              pod_body(self.system, name, self.lease, self.ns, self.args.lease,
                                       self.args.peer_image, self.events_dir))
            self.names.append(name)

    def all_up(self) -> dict[str, dict] | None:
        """The lane's pods, once each one's campaigning container has run for 1.5 s."""
        pods = self.pods()
        for n in self.names:
            since = running_since_ns(self.system, pods.get(n, {}))
            if since is None or now_ns() - since < 1_500_000_000:
                return None
        return pods

    def holder_pod(self, pods: dict[str, dict]) -> tuple[str, str, int | None] | None:
        """(pod, identity, token) of the one holder, when it is one of the lane's pods."""
        last = self.watch.last()
        if not last or not last[1]:
            return None
        _, holder, token = last
        if is_ours(self.system):
            pod = pods.get(holder)
            labelled = ((pod or {}).get("metadata", {}).get("labels") or {}).get(ROLE_LABEL) == "leader"
            return (holder, holder, token) if pod and labelled else None
        for n in self.names:  # the peer's identity is a UUID: its events file names the pod
            if holder in self.peer_identities(n):
                return n, holder, None
        return None

    def peer_identities(self, pod: str) -> set[str]:
        return {e.get("identity") for e in lib.read_jsonl(self.events_dir / f"{pod}.events")}

    def kill_holder(self, pod: dict) -> tuple[int, int]:
        """SIGKILL of the campaigning container's first process; (t_ns of the kill, pid)."""
        cid = (campaigner_status(self.system, pod) or {}).get("containerID", "").split("://")[-1]
        if not cid:
            raise RuntimeError(f"no container ID for the holder {pod['metadata']['name']}")
        pid = task_pid(cid)
        t = now_ns()
        os.kill(pid, signal.SIGKILL)
        return t, pid

    def trial(self, n: int) -> dict:
        L = self.args.lease
        self.ensure_pods()
        pods = lib.wait_until(self.all_up, 120, f"{self.lease}: every candidate's container running", interval=0.2)
        found = lib.wait_until(lambda: self.holder_pod(self.pods()), 3 * L + 30, f"{self.lease}: one leader",
                               interval=0.1)
        renew = L / 3 if is_ours(self.system) else peer_timings(L)[2]
        time.sleep(0.5 + random.uniform(0, max(L / 3, peer_timings(L)[2])))
        pods = self.pods()
        if self.holder_pod(pods) != found:
            raise RuntimeError("the leader changed before the kill")
        old_pod, old_id, old_token = found
        t_kill, pid = self.kill_holder(pods[old_pod])

        def new_leader():
            for t, h, tok in self.watch.since(t_kill):
                if h and (tok > old_token if is_ours(self.system) else h != old_id):
                    return t, h, tok
            return None

        t_new, h_new, tok_new = lib.wait_until(new_leader, 3 * L + 30, f"{self.lease}: a new leader")
        rec = {"system": self.system, "scenario": SCENARIO, "lane": self.lease, "trial": n, "lease_s": L,
               "renew_or_retry_s": renew, "old_leader": old_pod, "killed_pid": pid, "t_signal_ns": t_kill,
               "leader_ns": t_new, "failover_s": (t_new - t_kill) / 1e9}
        # Where the time went: a revocation (the holder cleared, as the controller does after a
        # known death or an expiry) seen before the new holder.
        cleared = [t for t, h, _ in self.watch.since(t_kill) if not h and t <= t_new]
        if cleared:
            rec["revoked_seen_s"] = (cleared[0] - t_kill) / 1e9
        if is_ours(self.system):
            rec.update(new_leader=h_new, same_pod=h_new == old_pod, old_token=old_token, token=tok_new,
                       token_step=tok_new - old_token)
        else:
            rec["new_leader"] = next((p for p in self.names if h_new in self.peer_identities(p)), h_new)
            rec["same_pod"] = rec["new_leader"] == old_pod
        self.replace(old_pod)
        return rec

    def replace(self, name: str) -> None:
        """Deletes a pod (its replacement is made by the next trial)."""
        self.kube.request("DELETE", self.pod_path(name), {"gracePeriodSeconds": 0}, ok=(200, 404))
        if name in self.names:
            self.names.remove(name)

    def run(self) -> None:
        self.watch.start()
        time.sleep(random.uniform(0, 2))
        for n in range(self.args.trials):
            try:
                rec = self.trial(n)
            except Exception as e:  # noqa: BLE001 - a failed trial is a result too
                self.failures += 1
                rec = {"system": self.system, "scenario": SCENARIO, "lane": self.lease, "trial": n, "error": str(e)}
                log(f"{self.lease} trial {n}: FAILED: {e}")
                for name in list(self.names):
                    self.replace(name)
            with self.lock:
                self.results.append(rec)
        for name in list(self.names):
            self.replace(name)
        self.watch.stopped = True


# -- the run -------------------------------------------------------------------------------------
def summarize(results: list[dict], systems) -> dict:
    out = {}
    for system in systems:
        rs = [r for r in results if r["system"] == system and "failover_s" in r]
        s = {"trials_ok": len(rs),
             "trials_failed": len([r for r in results if r["system"] == system and "error" in r]),
             "failover_s": stats([r["failover_s"] for r in rs]),
             "next_leader_in_the_killed_pod": len([r for r in rs if r.get("same_pod")])}
        revoked = [r["revoked_seen_s"] for r in rs if "revoked_seen_s" in r]
        if revoked:
            s["revoked_seen_s"] = stats(revoked)
        steps = [r["token_step"] for r in rs if "token_step" in r]
        if steps:
            s["token_steps"] = {str(k): steps.count(k) for k in sorted(set(steps))}
        out[system] = s
    return out


def start_injecting_webhook(kube: Kube, ns: str, workdir: Path) -> tuple[lib.Proc, str]:
    wh, port, _, bundle = lib.start_webhook(
        f"webhook-{ns}", workdir / "logs", workdir / "certs",
        extra_args=["--sidecar-image", OURS_IMAGE, "--sidecar-image-pull-policy", "Never"])
    name = f"fencedlease-bench-inject-{ns}"
    register_injection(kube, name, port, bundle, ns)
    return wh, name


def run_lanes(lanes: list[Lane], results: list, lock: threading.Lock, total: int) -> None:
    for lane in lanes:
        lane.start()
    last = -1
    while any(lane.is_alive() for lane in lanes):
        time.sleep(1)
        with lock:
            done = len(results)
            if done != last:
                ok = [r for r in results if "failover_s" in r]
                med = {s: f"{lib.pct(v, 50):.3f}s" for s in {r['system'] for r in ok}
                       if (v := [r["failover_s"] for r in ok if r["system"] == s])}
                log(f"failover/{SCENARIO}: {done}/{total} trials, median so far {med}")
                last = done


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lease", type=int, default=15)
    ap.add_argument("--lanes", type=int, default=2, help="lanes per system")
    ap.add_argument("--trials", type=int, default=10, help="trials per lane")
    ap.add_argument("--candidates", type=int, default=3)
    ap.add_argument("--peer-image", required=True, help="the client-go peer's image (bench/peer-image.sh)")
    ap.add_argument("--no-opt-out", action="store_true",
                    help="leave out the lanes whose leases have revokeOnHolderDeath: false")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    systems = SYSTEMS if args.no_opt_out else (*SYSTEMS, OURS_OPT_OUT)

    kube = Kube()
    lib.install_crd()
    ns = f"bench-exited-{lib.rand_suffix()}"
    kube.create_namespace(ns)
    workdir = lib.WORK / ns
    events_dir = workdir / "peer-events"
    events_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(events_dir, 0o1777)  # the peer runs as 65532
    step(f"failover/{SCENARIO}: {args.lanes} lane(s) per system x {args.trials} trial(s), {args.candidates} "
         f"candidate pods per lane on the node, lease {args.lease} s, namespace {ns}")
    lib.wait_until(lambda: kube.get_opt(f"/api/v1/namespaces/{ns}/serviceaccounts/default"), 30,
                   "the namespace's default ServiceAccount", interval=0.2)
    setup_rbac(kube, ns)
    lanes_cfg = [(s, i) for i in range(args.lanes) for s in systems]
    create_leases(kube, ns, lanes_cfg, args.lease)
    wh, wh_name = start_injecting_webhook(kube, ns, workdir)
    ctl, ctl_port = start_controller(ns, workdir)

    results: list[dict] = []
    lock = threading.Lock()
    lanes = [Lane(s, i, args, ns, events_dir, results, lock) for s, i in lanes_cfg]
    started = time.monotonic()
    run_lanes(lanes, results, lock, len(lanes) * args.trials)
    controller = controller_report(ctl, ctl_port)
    kube.request("DELETE", f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{wh_name}",
                 ok=(200, 404))
    lib.stop_all([wh, ctl])
    kube.request("DELETE", f"/api/v1/namespaces/{ns}", ok=(200, 202, 404))
    out = {
        "benchmark": f"failover-{SCENARIO}",
        "config": {"lease_s": args.lease, "lanes_per_system": args.lanes, "trials_per_lane": args.trials,
                   "candidates_per_lane": args.candidates, "peer_image": args.peer_image,
                   "peer_timings_s": dict(zip(("lease", "renew_deadline", "retry_period"), peer_timings(args.lease))),
                   "ours_timings_s": {"lease": args.lease, "renew_interval": args.lease / 3},
                   "systems": list(systems)},
        "wall_s": time.monotonic() - started,
        "controller": controller,
        "summary": summarize(results, systems),
        "trials": sorted(results, key=lambda r: (r["system"], r["lane"], r["trial"])),
    }
    finish(args.out, f"failover-{SCENARIO}", out)


if __name__ == "__main__":
    main()
