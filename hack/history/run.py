#!/usr/bin/env python3
"""The history test: apps write to protected ConfigMaps with fencing tokens while a nemesis
injects faults; the checker (check.py) then judges the history against the fencing rules.

  run.py --bin B --kubeconfig K --audit-log L --kubeconfig-2 K2 --audit-log-2 L2 --duration S
         --seed N --out DIR [--unfenced [--lose-a-write]] [--min-stale N]

Expects a local Kubernetes of its own with two API servers on one etcd (K and L: the first's
kubeconfig and audit log, K2 and L2 the second's), with auditing of FencedLease writes
(hack/history.sh brings one up), because the nemesis restarts its API servers and etcd. The
apps and candidates are spread across the two (APP_SERVER, CANDIDATE_SERVER), so that a token
read through one server fences writes sent through the other. Writes DIR/summary.json
and exits 1 unless every check passed. --unfenced leaves the webhook out of the path: the
same workload, and the checker must then fail; --lose-a-write also takes an acknowledged write
out of its object at the end, and the checker must see that too."""
import argparse
import glob
import http.client
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # hack/kubeclient.py
import check  # noqa: E402
from kubeclient import Kube  # noqa: E402
from relay import Relay  # noqa: E402

NS = "history"
LEASE = "hist"
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
LEASE_SECONDS = 2
SHARD_SECONDS = 120
LEASES = f"/apis/fencedlease.io/v1alpha1/namespaces/{NS}/fencedleases"
CMS = f"/api/v1/namespaces/{NS}/configmaps"
SELECT = f"fieldSelector=metadata.name%3D{LEASE}"
# Who leads (the lease's holderIdentity) -> its processes: the whole "pod", and the candidate
# alone. The sidecar-backed apps are other containers of the sidecar's pod.
SIDECAR_POD = ["sidecar", "s-http", "s-file", "s-deaf"]
# Every identity that campaigns; the checker fails a run in which one of them never led.
CANDIDATES = ["w-sidecar", "w0", "w1", "w2", "w-skew", "w-hang"]
# The apps that must each make at least MIN_STALE_PER_WRITER stale writes the fence judges, and
# none of them more than half of all. Not s-http: it asks the sidecar before each write (and
# the sidecar answers nothing while frozen), so it goes stale only when one of its own stalls
# straddles a takeover; it is counted, not required.
STALE_WRITERS = ["w0", "w1", "w2", "w-skew", "w-hang", "s-file", "s-deaf"]
MIN_STALE_PER_WRITER = 3
# The nemesis: two threads, so that faults also overlap (a pause during an API server restart,
# a partition while the webhook restarts). Each plays its faults in rounds where every kind comes
# as often as its weight; the seed chooses only the order, so every run injects every kind.
# pause_candidate_only: a candidate is handed the lease (each in turn) and frozen while its
# apps write on, stale once another takes over: every kind of writer makes stale writes.
# handover: the lease goes to the candidate that led least (every candidate leads, so every
# one's apps are made stale); hand_back: to the holder before the current one, which leads again
# under a new token; identity_reused: a second process of the paused holder's identity takes
# the lease, and the first one resumes.
HOLDER_FAULTS = {"pause_short": 2, "pause_long": 2, "pause_candidate_only": 3, "kill": 2,
                 "handover": 2, "hand_back": 1, "identity_reused": 1}
# Which API server each app writes through and each candidate campaigns through ("1":
# kube-apiserver, "2": kube-apiserver-2), each by a front door of its own (w2 through the first's,
# from its network namespace; w-hang through a hanging relay in front of the second's). Some
# candidates' apps write through the other server than their candidate's (the sidecar's s-http
# and s-deaf, w-skew's app), so that a token taken on one server fences writes on the other.
APP_SERVER = {"w0": "1", "w2": "1", "s-http": "1", "s-deaf": "1", "w-skew": "1",
              "w1": "2", "s-file": "2", "w-hang": "2"}
CANDIDATE_SERVER = {"w0": "1", "w2": "1", "w1": "2", "w-skew": "2", "w-sidecar": "2", "w-hang": "2"}
# The webhook reads leases (and namespaces) from the server fewer apps write through: the write
# it judges has mostly come through the other, whose watch cache it never sees.
WRITES_MOSTLY = max(("1", "2"), key=lambda k: sum(v == k for v in APP_SERVER.values()))
WEBHOOK_SERVER = "2" if WRITES_MOSTLY == "1" else "1"
CONTROLLER_SERVER = "1"  # the harness (setup, the oracle's watch, handovers) talks to "1" directly
CLUSTER_FAULTS = {"webhook": 1, "controller": 1, "apiserver": 1, "etcd": 1, "hang": 1, "slow": 1, "partition": 2}


def now():
    return time.time_ns()


def say(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def proc_state(pid: int):
    """The state letter of `pid` in /proc (R, S, T, Z, ...); None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def signal_pid(pid: int, sig) -> None:
    """Signals one process; one that is gone (reaped, or dying) is no error."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def tree_groups(root: int) -> list[int]:
    """The process groups of `root` and of all its descendants, `root`'s first."""
    children: dict[int, list[int]] = {}
    groups: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid, ppid, pgid = int(d), int(fields[1]), int(fields[2])
        children.setdefault(ppid, []).append(pid)
        groups[pid] = pgid
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        g = groups.get(pid, root if pid == root else None)
        if g is not None and g not in out:
            out.append(g)
        todo.extend(children.get(pid, []))
    return out


def sh(*argv):
    return subprocess.run(list(argv), capture_output=True, text=True)


class Partition:
    """A network namespace of its own for one candidate ("w2"): a veth pair to the host, the API
    server reached through a relay on the host's end, and iptables rules that cut it."""

    def __init__(self, tag, api_port, front_port):
        n = int(tag) % 250
        self.ns, self.host_if, self.ns_if = f"flh{tag}", f"flh{tag}h", f"flh{tag}n"
        self.host_ip, self.ns_ip = f"10.203.{n}.1", f"10.203.{n}.2"
        self.api_port = api_port
        self.close()
        steps = [["ip", "netns", "add", self.ns],
                 ["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if],
                 ["ip", "link", "set", self.ns_if, "netns", self.ns],
                 ["ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if],
                 ["ip", "link", "set", self.host_if, "up"],
                 self.inside("ip", "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if),
                 self.inside("ip", "link", "set", self.ns_if, "up"),
                 self.inside("ip", "link", "set", "lo", "up")]
        for s in steps:
            r = sh(*s)
            if r.returncode:
                raise SystemExit(f"history: network namespace set-up failed: {' '.join(s)}: {r.stderr.strip()}")
        self.host_relay = Relay(("127.0.0.1", front_port), listen=(self.host_ip, api_port)).start()

    def inside(self, *argv):
        return ["ip", "netns", "exec", self.ns, *argv]

    def ns_relay(self):
        """argv of the relay inside: the candidate dials 127.0.0.1:<API port> as everyone does."""
        return self.inside(sys.executable, os.path.join(HERE, "relay.py"), "127.0.0.1", str(self.api_port),
                           self.host_ip, str(self.api_port))

    def cut(self, direction):
        rules = {"both": [("INPUT", "-i"), ("OUTPUT", "-o")], "in": [("INPUT", "-i")], "out": [("OUTPUT", "-o")]}
        for chain, flag in rules[direction]:
            r = sh(*self.inside("iptables", "-A", chain, flag, self.ns_if, "-j", "DROP"))
            if r.returncode:
                raise SystemExit(f"history: iptables failed: {r.stderr.strip()}")

    def drops(self):
        """Whether the cut drops traffic: a connection from inside to the host's relay fails."""
        probe = (f"import socket; socket.create_connection(('{self.host_ip}', {self.api_port}), timeout=1)")
        return sh(*self.inside(sys.executable, "-c", probe)).returncode != 0

    def heal(self):
        sh(*self.inside("iptables", "-F"))

    def close(self):
        sh("ip", "netns", "del", self.ns)
        sh("ip", "link", "del", self.host_if)


class Run:
    def __init__(self, a):
        self.a = a
        self.kube = Kube.from_kubeconfig(a.kubeconfig)
        self.out = a.out
        os.makedirs(self.out, exist_ok=True)
        self.procs = {}  # name -> (Popen, argv, env)
        self.campaigns = {}  # candidate name -> campaign()'s arguments, to start a second process
        self.points = []  # the lease as the watch saw it (check.lease_point)
        self.rv = None
        self.watch_relists = 0
        self.watch_errors = {}  # message -> count
        self.faults = {}
        self.stale_made = {}  # candidate -> stale writes its app sent while pause_candidate_only froze it
        self.fault_log = open(os.path.join(self.out, "faults.jsonl"), "a", buffering=1)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.api_port = int(self.kube.server.rsplit(":", 1)[1])
        self.api2_port = int(Kube.from_kubeconfig(a.kubeconfig_2).server.rsplit(":", 1)[1])
        self.shards = int(a.duration // SHARD_SECONDS) + 3
        self.shard_start = time.time() + 60  # set again when the workers start

    # processes -------------------------------------------------------------------------
    def start(self, name, argv, env=None):
        log = open(os.path.join(self.out, f"{name}.log"), "a")
        p = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                             env=env or self.env, start_new_session=True)
        self.procs[name] = (p, argv, env)

    def send(self, name, sig):
        """Signals a process as a whole: every process group in its tree (`campaign` runs its
        command in a session of its own, so the worker's own group alone would miss the app).
        Returns how many groups it reached: 0 means the process is gone and the signal hit
        nothing."""
        reached = 0
        for pgid in tree_groups(self.procs[name][0].pid):
            try:
                os.killpg(pgid, sig)
                reached += 1
            except ProcessLookupError:
                pass
        return reached

    def stopped(self, name):
        """Whether the process `name` is stopped (state T in /proc): a pause that took."""
        pid = self.procs[name][0].pid
        for _ in range(100):  # a stop takes effect at the next return to user space
            if proc_state(pid) in ("T", "t"):
                return True
            time.sleep(0.01)
        return False

    def running(self, name):
        """Whether the process `name` runs (exists and is neither a zombie nor gone)."""
        p = self.procs[name][0]
        return p.poll() is None and proc_state(p.pid) not in (None, "Z", "X")

    def restart(self, name, sig=signal.SIGKILL, delay=0.0):
        """Kills `name` with `sig` and starts it again after `delay`; whether the fault took:
        it ran before, and the new process still runs a moment after its start."""
        p, argv, env = self.procs[name]
        was = self.running(name)
        self.send(name, signal.SIGCONT)
        self.send(name, sig)
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.send(name, signal.SIGKILL)
            p.wait()
        time.sleep(delay)
        self.start(name, argv, env)
        time.sleep(0.5)
        came_back = self.running(name)
        if not (was and came_back):
            say(f"restart of {name}: it ran before: {was}; the new process runs: {came_back}")
        return was and came_back

    def app(self, name, token, style, *extra, server=None, kubeconfig=None):
        argv = [sys.executable, os.path.join(HERE, "worker.py"), "--name", name, "--log",
                os.path.join(self.out, f"ops-{name}.jsonl"), "--kubeconfig", kubeconfig or self.front_kc,
                "--token", token, "--style", style, "--shard-start", str(self.shard_start),
                "--shard-seconds", str(SHARD_SECONDS), "--shards", str(self.shards), *extra]
        return argv + (["--server", server] if server else [])

    def campaign(self, name, style, kubeconfig=None, server=None, prefix=(), extra_env=None, identity=None,
                 app_kubeconfig=None):
        """Starts the candidate `name` (its identity unless `identity` says otherwise) with an app
        (through `app_kubeconfig`, when it writes through another API server than its candidate's)."""
        if identity is None:  # a second process of an identity is no candidate of its own
            self.campaigns[name] = dict(style=style, kubeconfig=kubeconfig, server=server, prefix=prefix,
                                        extra_env=extra_env, app_kubeconfig=app_kubeconfig)
        env = dict(self.env, KUBECONFIG=kubeconfig or self.front_kc, **(extra_env or {}))
        # The app's clock stays real when the candidate's is faked: its times are compared
        # with the lease's history.
        worker = ["env", "-u", "LD_PRELOAD", "-u", "FAKETIME"] + self.app(name, "env", style, server=server,
                                                                          kubeconfig=app_kubeconfig or kubeconfig)
        argv = list(prefix) + [self.a.bin, "campaign", "--lease", LEASE, "--namespace", NS,
                               "--identity", identity or name, "--lease-duration", str(LEASE_SECONDS),
                               "--grace-seconds", "1", "--events-file",
                               os.path.join(self.out, f"{name}.events"), "--"] + worker
        self.start(name, argv, env)

    # setup -----------------------------------------------------------------------------
    def objects(self):
        k = self.kube
        code, lease = k.fetch("POST", LEASES, {
            "apiVersion": "fencedlease.io/v1alpha1", "kind": "FencedLease", "metadata": {"name": LEASE},
            "spec": {"holderIdentity": "setup", "leaseDurationSeconds": LEASE_SECONDS}})
        assert code == 201, lease
        ann = {"fencedlease.io/token": str(lease["metadata"]["generation"]),
               "fencedlease.io/lease-uid": lease["metadata"]["uid"]}
        names = [f"history-{i}" for i in range(self.shards)] + ["blind"]
        for name in names:
            data = {"last": "", "token": ""} if name == "blind" else {"counter": "0", "items": ""}
            code, cm = k.fetch("POST", CMS, {"metadata": {"name": name, "labels": {"fencedlease.io/lease": LEASE},
                                                             "annotations": ann}, "data": data})
            assert code == 201, cm
        lease["spec"]["holderIdentity"] = None
        code, _ = k.fetch("PUT", f"{LEASES}/{LEASE}", lease)
        assert code == 200

    def webhook(self):
        certs = os.path.join(self.out, "certs")
        bundle = subprocess.run([self.a.bin, "certs", "--out", certs, "--host", "127.0.0.1"],
                                check=True, capture_output=True, text=True).stdout.strip()
        port = free_port()
        # Both API servers call it; it reads through WEBHOOK_SERVER's front door.
        self.start("webhook", [self.a.bin, "webhook", "--listen", f"127.0.0.1:{port}",
                               "--tls-cert", f"{certs}/tls.crt", "--tls-key", f"{certs}/tls.key",
                               "--metrics-addr", "127.0.0.1:0"],
                   env=dict(self.env, KUBECONFIG=self.kc[WEBHOOK_SERVER]))
        if self.a.unfenced:
            say("UNFENCED: the webhook runs but is not registered; stale writes meet no check")
            return
        code, out = self.kube.fetch("POST", "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations", {
            "metadata": {"name": "fencedlease-history"},
            "webhooks": [{"name": "fencing.fencedlease.io", "admissionReviewVersions": ["v1"],
                          "sideEffects": "None", "failurePolicy": "Fail", "timeoutSeconds": 5,
                          "clientConfig": {"url": f"https://127.0.0.1:{port}/validate", "caBundle": bundle},
                          "namespaceSelector": {"matchLabels": {"fencedlease.io/history": NS}},
                          "objectSelector": {"matchExpressions": [{"key": "fencedlease.io/lease", "operator": "Exists"}]},
                          "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
                                     "resources": ["configmaps"]}]}]})
        assert code in (201, 409), out

    def network(self):
        """Everyone but the harness reaches an API server through its front door (which the
        nemesis slows down); w-hang through a relay that hangs (to the second's); w2 from its
        own namespace (to the first's)."""
        self.front = Relay(("127.0.0.1", self.api_port)).start()
        self.front_kc = self.kubeconfig_for(self.front.port, "front")
        self.front2 = Relay(("127.0.0.1", self.api2_port)).start()
        self.kc = {"1": self.front_kc, "2": self.kubeconfig_for(self.front2.port, "front-2")}
        self.hang = Relay(("127.0.0.1", self.front2.port)).start()
        self.hang_kc = self.kubeconfig_for(self.hang.port, "hang")
        self.part = Partition(self.a.tag, self.api_port, self.front.port)
        self.start("w2-net", self.part.ns_relay())

    def kubeconfig_for(self, port, name):
        path = os.path.join(self.out, f"kubeconfig-{name}")
        text = open(self.a.kubeconfig).read().replace(self.kube.server, f"https://127.0.0.1:{port}")
        open(path, "w").write(text)
        return path

    def setup(self):
        # FL_HISTORY_RUN marks every process of this run (inherited by the apps), so that
        # hack/history.sh can find what a crashed run left without trusting old pids.
        self.env = dict(os.environ, KUBECONFIG=self.a.kubeconfig, RUST_LOG="info,kube=warn",
                        FL_HISTORY_RUN=os.path.abspath(self.out))
        # The CRD the server takes: with validation rules from Kubernetes 1.25, without before.
        crd = subprocess.run([self.a.bin, "crd", "--for-server"], env=self.env, check=True,
                             capture_output=True, text=True).stdout
        subprocess.run(["kubectl", "apply", "-f", "-"], input=crd, env=self.env, check=True,
                       capture_output=True, text=True)
        subprocess.run(["kubectl", "wait", "--for=condition=Established", "--timeout=60s",
                        "crd/fencedleases.fencedlease.io"], env=self.env, check=True, capture_output=True)
        self.kube.fetch("POST", "/api/v1/namespaces", {"metadata": {"name": NS, "labels": {"fencedlease.io/history": NS}}})
        self.objects()
        self.network()
        self.env["KUBECONFIG"] = self.front_kc
        self.webhook()
        self.start("controller", [self.a.bin, "controller", "--namespace", NS, "--election-namespace", NS,
                                  "--identity", "controller-0", "--metrics-addr", "127.0.0.1:0"],
                   env=dict(self.env, KUBECONFIG=self.kc[CONTROLLER_SERVER]))
        time.sleep(2)  # the API servers pick the webhook configuration up
        self.shard_start = time.time()
        self.sidecar_pod()
        kc = lambda name, servers=CANDIDATE_SERVER: self.kc[servers[name]]  # noqa: E731
        self.campaign("w0", "rmw", kubeconfig=kc("w0"), app_kubeconfig=kc("w0", APP_SERVER))
        self.campaign("w1", "blind", kubeconfig=kc("w1"), app_kubeconfig=kc("w1", APP_SERVER))
        # Inside its namespace, 127.0.0.1:<API port> is the relay out through the veth pair.
        self.campaign("w2", "rmw", kubeconfig=self.a.kubeconfig, prefix=self.part.inside())
        # libfaketime preloaded directly: the `faketime` wrapper forks, and a SIGSTOP of the
        # candidate would stop only the wrapper.
        self.campaign("w-skew", "rmw", kubeconfig=kc("w-skew"), app_kubeconfig=kc("w-skew", APP_SERVER),
                      extra_env={"LD_PRELOAD": faketime_lib(),
                                 "FAKETIME": "+{offset_s} x{rate}".format(**check.FAST_CLOCK)})
        self.campaign("w-hang", "blind", kubeconfig=self.hang_kc, server=f"https://127.0.0.1:{self.hang.port}")

    def sidecar_pod(self):
        """A sidecar and three apps of its pod: one asks the HTTP API before each write, one
        reads the token files, one ignores the loss of leadership. It leads first (the others
        start once it does), so that its apps hold a token the nemesis can make stale."""
        port = free_port()
        url, tokens = f"http://127.0.0.1:{port}", os.path.join(self.out, "sidecar-token")
        self.start("sidecar", [self.a.bin, "sidecar", "--lease", LEASE, "--namespace", NS, "--identity", "w-sidecar",
                               "--listen", f"127.0.0.1:{port}", "--lease-duration", str(LEASE_SECONDS),
                               "--token-dir", tokens], env=dict(self.env, KUBECONFIG=self.kc[CANDIDATE_SERVER["w-sidecar"]]))
        secret = ["--api-secret-file", os.path.join(tokens, "api-secret")]
        self.start("s-http", self.app("s-http", f"http:{url}", "rmw", "--gc-pause", "0.1", *secret,
                                      kubeconfig=self.kc[APP_SERVER["s-http"]]))
        self.start("s-file", self.app("s-file", f"file:{tokens}", "blind", "--gc-pause", "0.1",
                                      kubeconfig=self.kc[APP_SERVER["s-file"]]))
        self.start("s-deaf", self.app("s-deaf", f"http:{url}", "mixed", "--deaf", *secret,
                                      kubeconfig=self.kc[APP_SERVER["s-deaf"]]))
        for _ in range(150):
            if check_token(url, secret[1]):
                return
            time.sleep(0.1)
        say("the sidecar did not lead within 15 s; going on")

    # the oracle's watch ----------------------------------------------------------------
    def watch_lease(self):
        """Watches the lease from the last resourceVersion seen; when the server cannot resume
        (410 Gone, e.g. after its restart), lists it again and counts a relist: the audit log
        covers what the watch missed, and the checker fails the run on a hole."""
        while not self.stop.is_set():
            try:
                if self.rv is None:
                    # A list, not a GET: the list's resourceVersion is now, while the object's
                    # may lie before a restarted API server's watch window (410 again).
                    code, items = self.kube.fetch("GET", f"{LEASES}?{SELECT}", timeout=3)
                    if code != 200:
                        raise OSError(f"list leases: {code}")
                    for lease in items["items"]:
                        self.note(lease)
                    self.rv = items["metadata"]["resourceVersion"]
                path = f"{LEASES}?{SELECT}&resourceVersion={self.rv}&allowWatchBookmarks=true&timeoutSeconds=20"
                for ev in self.kube.watch(path, timeout=30):
                    if ev.get("type") == "ERROR":
                        self.rv = None
                        self.watch_relists += 1
                        msg = str((ev.get("object") or {}).get("message", ev))[:120]
                        self.watch_errors[msg] = self.watch_errors.get(msg, 0) + 1
                        break
                    self.note(ev.get("object", {}), bookmark=ev.get("type") == "BOOKMARK")
                    if self.stop.is_set():
                        return
            except Exception:
                time.sleep(0.2)

    def note(self, obj, bookmark=False):
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if rv:
            self.rv = rv
        p = None if bookmark else check.lease_point(obj, now(), "watch")
        if p:
            self.points.append(p)

    def holder(self):
        return self.points[-1]["holder"] if self.points else None

    def generation(self):
        return self.points[-1]["gen"] if self.points else 0

    def holders(self):
        """The holders in the order the watch saw them, a holder that followed itself once."""
        out = []
        for p in list(self.points):
            if p["holder"] and (not out or out[-1] != p["holder"]):
                out.append(p["holder"])
        return out

    def unled(self):
        """The candidates the watch has not yet seen hold the lease."""
        return sorted(set(CANDIDATES) - set(self.holders()))

    def unfrozen(self):
        """The candidates whose apps pause_candidate_only has not yet made send enough stale
        writes (a partition of the same moment can keep an app from writing at all)."""
        return [c for c in CANDIDATES if self.stale_made.get(c, 0) < MIN_STALE_PER_WRITER]

    def stale_sent(self, app, g):
        """How many writes `app` sent with a token at most `g` once the watch saw a generation
        above `g` (the fence judges them; the checker counts them again from the oracle)."""
        moved = min((p["t"] for p in list(self.points) if p["gen"] > g), default=None)
        n = 0
        try:
            with open(os.path.join(self.out, f"ops-{app}.jsonl")) as f:
                for line in f:
                    try:
                        o = json.loads(line)
                    except ValueError:
                        continue
                    n += (moved is not None and o.get("t_send", 0) >= moved and o["token"] <= g
                          and o["verdict"] in ("refused", "accepted"))
        except OSError:
            pass
        return n

    def holds(self, who, above, timeout):
        """Whether the watch sees `who` hold the lease with a generation above `above` within
        `timeout` seconds."""
        end = time.time() + timeout
        while time.time() < end:
            if any(p["holder"] == who and p["gen"] > above for p in list(self.points)):
                return True
            time.sleep(0.05)
        return False

    def prefer(self, who):
        """Asks for a handover to `who` (spec.preferredHolder); whether `who` took the lease.
        When it did not (it was cut off, another won the race), the wish is withdrawn."""
        g0 = self.generation()
        try:
            code, out = self.kube.fetch("PATCH", f"{LEASES}/{LEASE}", {"spec": {"preferredHolder": who}},
                                        content_type="application/merge-patch+json")
        except (OSError, http.client.HTTPException) as e:  # the other nemesis may be restarting the API server
            code, out = None, e
        if code != 200:
            say(f"nemesis: preferredHolder {who} not set ({code} {str(out)[:200]}); trying again later")
            return False
        if self.holds(who, g0, 2 * LEASE_SECONDS + 3):
            return True
        try:
            self.kube.fetch("PATCH", f"{LEASES}/{LEASE}", {"spec": {"preferredHolder": None}},
                            content_type="application/merge-patch+json")
        except (OSError, http.client.HTTPException):
            pass  # the acquiring write clears it too; a wish left standing only hands over later
        say(f"nemesis: {who} did not take the lease handed to it; trying again later")
        return False

    def reuse_identity(self, h, r):
        """A second process of the holder's identity (the first one paused whole, its app
        included) takes the lease; it is killed, and the first resumes, its app a second before
        its candidate, so that the app writes on with the old tenure's token.
        The other candidates' own processes pause meanwhile (their apps run on), so that the
        second process, not a faster clock, wins the expired lease. Whether it took: the
        second process said it led, under a generation above the first's."""
        twin, g0 = f"{h}-twin", self.generation()
        others = [c for c in self.campaigns if c != h] + ["sidecar"]
        events = os.path.join(self.out, f"{twin}.events")
        offset = os.path.getsize(events) if os.path.exists(events) else 0  # an earlier twin's lines
        if not (self.send(h, signal.SIGSTOP) and self.stopped(h)):
            self.send(h, signal.SIGCONT)
            return False
        took = False
        try:
            for c in others:
                signal_pid(self.procs[c][0].pid, signal.SIGSTOP)
            self.campaign(twin, identity=h, **self.campaigns[h])
            took = self.holds(h, g0, 3 * LEASE_SECONDS + 10) and self.led_since(events, offset, g0, 5)
            if took:
                time.sleep(r.uniform(0.5, 2.0))  # its app writes under the new tenure
        finally:
            if twin in self.procs:
                self.send(twin, signal.SIGKILL)
                self.procs.pop(twin)[0].wait()
            for c in others:
                signal_pid(self.procs[c][0].pid, signal.SIGCONT)
            pid = self.procs[h][0].pid
            for pgid in tree_groups(pid):
                if pgid != pid:  # the candidate is its group's leader (a session of its own)
                    try:
                        os.killpg(pgid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass
            time.sleep(1.0)
            self.send(h, signal.SIGCONT)
        return took

    def app_writes(self, app, since, timeout):
        """Whether the app `app` has a write accepted that it sent after `since` (ns), within
        `timeout` seconds."""
        path, end = os.path.join(self.out, f"ops-{app}.jsonl"), time.time() + timeout
        while time.time() < end:
            try:
                with open(path, "rb") as f:
                    f.seek(max(0, os.path.getsize(path) - 65536))
                    tail = f.read().decode(errors="replace").splitlines()[1:]
            except OSError:
                tail = []
            for line in reversed(tail):
                try:
                    o = json.loads(line)
                except ValueError:
                    continue
                if o.get("verdict") == "accepted" and o.get("t_send", 0) > since:
                    return True
            time.sleep(0.05)
        return False

    def led_since(self, events, offset, above, timeout):
        """Whether the events file `events` says, past byte `offset` and within `timeout`
        seconds, that its process led with a token above `above`."""
        end = time.time() + timeout
        while time.time() < end:
            try:
                with open(events, "rb") as f:
                    f.seek(offset)
                    lines = f.read().decode(errors="replace").splitlines()
            except OSError:
                lines = []
            for line in lines:
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if e.get("event") == "leading" and (e.get("token") or 0) > above:
                    return True
            time.sleep(0.05)
        return False

    # nemesis ---------------------------------------------------------------------------
    def nemesis(self, faults, rng):
        try:
            self.faults_from(faults, rng)
        except Exception:  # the run must not pass with a nemesis that stopped early
            traceback.print_exc()
            with self.lock:
                self.faults["nemesis_failed"] = 1

    def faults_from(self, faults, rng):
        """Injects faults for the run's duration and, past it, until every kind has come once
        (at most twice the duration more; the check then names the kinds that never came). A
        kind that does not apply now (no holder to hit) waits for the next turn."""
        end, cap = time.time() + self.a.duration, time.time() + 3 * self.a.duration
        order, missing, kind = fault_rounds(faults, rng), set(faults), None
        # The holder's nemesis also goes on until every candidate has led and has been frozen
        # while its apps wrote on.
        more = (lambda: self.unled() or self.unfrozen()) if faults is HOLDER_FAULTS else (lambda: [])
        while time.time() < cap and (time.time() < end or missing or more()):
            if kind is None:
                # Past the duration, only the kinds that have not come yet, then what `more` needs.
                kind = (next(order) if time.time() < end else rng.choice(sorted(missing)) if missing
                        else "handover" if self.unled() else "pause_candidate_only")
            time.sleep(rng.uniform(0.5, 2.0))
            h, t0 = self.holder(), now()
            aim = {}
            done = self.inject(kind, h, rng, aim)
            if not done:
                continue
            missing.discard(kind)
            kind = None
            h, t0 = aim.get("holder", h), aim.get("t0", t0)
            say(f"nemesis: {done} (holder {h})")
            target = h if faults is HOLDER_FAULTS else None
            with self.lock:
                self.faults[done] = self.faults.get(done, 0) + 1
                self.fault_log.write(json.dumps({"kind": done, "target": target, "t0": t0, "t1": now()}) + "\n")

    def inject(self, kind, h, r, aim):
        """Injects one fault and returns its name; None when it does not apply now (no holder
        to hit). A fault that first moves the lease to its target says in `aim` whom it hit
        and when ("holder", "t0")."""
        pod = SIDECAR_POD if h == "w-sidecar" else [h] if h in self.procs else None
        if kind in ("pause_short", "pause_long", "pause_candidate_only", "kill", "handover", "hand_back") and not pod:
            return None
        if kind == "handover":
            # To the candidate that led least (ties: the seed's choice).
            led = self.holders()
            rest = [c for c in CANDIDATES if c != h]
            fewest = min(led.count(c) for c in rest)
            return kind if self.prefer(r.choice([c for c in rest if led.count(c) == fewest])) else None
        if kind == "hand_back":
            before = [c for c in self.holders() if c != h and c in CANDIDATES]
            return kind if before and self.prefer(before[-1]) else None
        if kind == "identity_reused":
            # Campaign candidates only (the sidecar's apps take no part in its identity's story):
            # the lease goes to one first when the sidecar holds it.
            if h not in self.campaigns:
                target = r.choice(sorted(self.campaigns))
                if not self.prefer(target):
                    return None
                h = target
            aim.update(holder=h, t0=now())
            return kind if self.reuse_identity(h, r) else None
        # Each fault is seen to take effect, or the run records it as failed: a pause stops the
        # process (state T), a restart brings a new process that runs.
        if kind == "pause_candidate_only":
            # The candidate freezes but its apps do not: they keep writing with a token that
            # goes stale once another candidate takes over. First the lease goes to the
            # candidate whose app made the fewest such writes, so that every writer goes stale.
            fewest = min(self.stale_made.get(c, 0) for c in CANDIDATES)
            target = r.choice([c for c in CANDIDATES if self.stale_made.get(c, 0) == fewest])
            if target != h and not self.prefer(target):
                return None
            # Its app must be writing under this tenure, or the freeze leaves nothing stale.
            app = "s-file" if target == "w-sidecar" else target
            if not self.app_writes(app, now(), 5):
                say(f"nemesis: {target}'s app did not write while it held the lease; trying again later")
                return None
            aim.update(holder=target, t0=now())
            pod = SIDECAR_POD if target == "w-sidecar" else [target]
            g = self.generation()
            pid = self.procs[pod[0]][0].pid
            os.kill(pid, signal.SIGSTOP)
            took = self.stopped(pod[0])
            time.sleep(r.uniform(2.5, 5.0))
            os.kill(pid, signal.SIGCONT)
            if not took:
                return kind + "_failed"
            time.sleep(0.5)  # the app's last writes of the freeze come back
            self.stale_made[target] = self.stale_made.get(target, 0) + self.stale_sent(app, g)
        elif kind in ("pause_short", "pause_long"):
            reached = [self.send(name, signal.SIGSTOP) for name in pod]
            took = all(reached) and all(self.stopped(name) for name in pod)
            time.sleep(r.uniform(0.3, 1.2) if kind == "pause_short" else r.uniform(2.5, 5.0))
            for name in pod:
                self.send(name, signal.SIGCONT)
            if not took:
                say(f"nemesis: {kind} of {pod} did not stop it")
                return kind + "_failed"
        elif kind == "kill":
            # Down long enough, at times, for a candidate on a real clock to win the race
            # that the fast-clock one would win.
            if not self.restart(pod[0], signal.SIGKILL, delay=r.uniform(0.2, 4.0)):
                return kind + "_failed"
        elif kind in ("webhook", "controller"):
            if not self.restart(kind, signal.SIGKILL, delay=r.uniform(0.0, 1.5)):
                return kind + "_failed"
        elif kind == "apiserver":
            # Either API server (the seed's choice): apiserver_1 or apiserver_2.
            server = r.choice(["1", "2"])
            kind += "_" + server
            if not self.restart_component("kube-apiserver" if server == "1" else "kube-apiserver-2",
                                          self.api_port if server == "1" else self.api2_port):
                return kind + "_failed"
            time.sleep(r.uniform(0.0, 1.0))
        elif kind == "etcd":
            if not self.restart_component("etcd", int(os.environ.get("FL_ETCD_PORT", "12379"))):
                return kind + "_failed"
            time.sleep(r.uniform(0.0, 1.0))
        elif kind == "hang":
            self.hang.frozen.set()
            time.sleep(r.uniform(1.5, 4.0))
            self.hang.frozen.clear()
        elif kind == "slow":
            self.front.delay = self.front2.delay = r.uniform(0.1, 0.6)
            time.sleep(r.uniform(2.0, 5.0))
            self.front.delay = self.front2.delay = 0.0
        elif kind == "partition":
            way = r.choice(["both", "in", "out"])
            kind += "_" + way
            self.part.cut(way)
            took = self.part.drops()
            time.sleep(r.uniform(2.0, 5.0))
            self.part.heal()
            if not took:
                say(f"nemesis: {kind} let a connection through")
                return kind + "_failed"
        return kind

    def restart_component(self, comp, port):
        """Kills a control-plane component (hack/cluster.sh restart COMP hard) and starts it
        again; whether the fault took, as Run.restart tells: the process of its pid file ran
        before, is gone, and another process serving `port` runs a moment after the start."""
        pidfile = os.path.join(self.a.cluster_dir, "pids", comp)

        def pid():
            try:
                return int(open(pidfile).read().strip())
            except (OSError, ValueError):
                return None
        before = pid()
        was = before is not None and proc_state(before) not in (None, "Z", "X")
        done = sh(os.path.join(REPO, "hack", "cluster.sh"), "restart", comp, "hard")
        if done.returncode:
            say(f"restarting {comp} failed: {done.stderr.strip()[-300:]}")
            return False
        time.sleep(0.5)
        after = pid()
        try:
            with open(f"/proc/{after}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
            # --secure-port=P (an API server), --listen-client-urls=http://127.0.0.1:P (etcd)
            serves = any(arg.endswith((f"={port}", f":{port}")) for arg in args)
        except (OSError, TypeError):
            serves = False
        came_back = after not in (None, before) and proc_state(after) not in (None, "Z", "X") and serves
        gone = before is None or proc_state(before) in (None, "Z", "X")
        if not (was and gone and came_back):
            say(f"restart of {comp}: it ran before: {was}; the old process is gone: {gone}; "
                f"a new one serves :{port}: {came_back}")
        return was and gone and came_back

    # run -------------------------------------------------------------------------------
    def run(self):
        try:
            self.setup()
            threading.Thread(target=self.watch_lease, daemon=True).start()
            say(f"workers running; nemesis for {self.a.duration} s (seed {self.a.seed})")
            threads = [threading.Thread(target=self.nemesis, args=(f, random.Random(f"{self.a.seed}/{n}")))
                       for n, f in enumerate((HOLDER_FAULTS, CLUSTER_FAULTS))]
            for t in threads:
                t.start()
            for t in threads:
                while t.is_alive():
                    t.join(timeout=30)
                    say(f"... faults so far: {sum(self.faults.values())} {self.faults}")
            say("nemesis done; letting the workers settle")
            time.sleep(4)
            self.wind_down()
            if self.a.lose_a_write:
                self.lose_a_write()
            return self.judge()
        finally:
            # Only processes not yet reaped: a reaped one's pid may belong to anyone by now.
            for name, (p, _, _) in list(self.procs.items()):
                if p.poll() is None:
                    self.send(name, signal.SIGCONT)
                    self.send(name, signal.SIGKILL)
            if hasattr(self, "part"):
                self.part.close()

    def wind_down(self):
        for name in list(self.procs):
            self.send(name, signal.SIGCONT)
            self.send(name, signal.SIGTERM)
        for name, (p, _, _) in self.procs.items():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.send(name, signal.SIGKILL)
        self.stop.set()

    def lose_a_write(self):
        """The end-to-end negative control of "no acknowledged write lost": takes one
        acknowledged item out of its shard, the counter down with it, as a store that dropped
        a write would (unfenced runs only: nothing checks the harness's own write)."""
        ops, _ = check.load_ops(self.out)
        acked = {o["item"] for o in ops if o["verdict"] == "accepted" and o.get("style") == "rmw"}
        for name in [f"history-{i}" for i in range(self.shards)]:
            cm = self.final(f"{CMS}/{name}")
            items = [i for i in (cm.get("data") or {}).get("items", "").split(",") if i]
            gone = next((i for i in reversed(items) if i in acked), None)
            if gone:
                items.remove(gone)
                cm["data"] = {"counter": str(len(items)), "items": ",".join(items)}
                code, out = self.kube.fetch("PUT", f"{CMS}/{name}", cm)
                if code != 200:
                    raise SystemExit(f"history: could not lose {gone} on purpose: {code} {str(out)[:200]}")
                say(f"lost on purpose (the checker must see it): {gone} from {name}")
                self.lost_on_purpose = gone
                return
        raise SystemExit("history: no acknowledged write to lose on purpose: the control proves nothing")

    def final(self, path):
        """GET with retries: the nemesis may have just restarted the API server."""
        for _ in range(120):
            try:
                code, obj = self.kube.fetch("GET", path)
                if code == 200:
                    return obj
            except OSError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"history: {path} could not be read at the end: the run proves nothing")

    def judge(self):
        objects = {n: self.final(f"{CMS}/{n}") for n in [f"history-{i}" for i in range(self.shards)] + ["blind"]}
        self.note(self.final(f"{LEASES}/{LEASE}"))
        shutil.copy(self.a.audit_log, os.path.join(self.out, "audit.log"))
        shutil.copy(self.a.audit_log_2, os.path.join(self.out, "audit-2.log"))
        servers = {k: {"port": port, "audit_log": log,
                       "apps": sorted(n for n, v in APP_SERVER.items() if v == k),
                       "candidates": sorted(c for c, v in CANDIDATE_SERVER.items() if v == k),
                       "webhook_reads": WEBHOOK_SERVER == k, "controller": CONTROLLER_SERVER == k,
                       "harness": k == "1"}
                   for k, port, log in (("1", self.api_port, "audit.log"), ("2", self.api2_port, "audit-2.log"))}
        run = {"seed": self.a.seed, "duration": self.a.duration, "fenced": not self.a.unfenced, "lease": LEASE,
               "faults": self.faults, "fault_kinds": sorted([*HOLDER_FAULTS, *CLUSTER_FAULTS]),
               "candidates": CANDIDATES, "stale_writers": STALE_WRITERS,
               "min_stale_per_writer": MIN_STALE_PER_WRITER,
               "lost_on_purpose": getattr(self, "lost_on_purpose", None),
               "watch_relists": self.watch_relists, "watch_errors": self.watch_errors,
               "fast_clock": check.FAST_CLOCK,
               "min_stale": self.a.min_stale,
               "audit_logs": {k: v["audit_log"] for k, v in servers.items()}, "apiservers": servers}
        for name, value in (("run.json", run), ("watch-points.json", self.points), ("final-objects.json", objects)):
            json.dump(value, open(os.path.join(self.out, name), "w"))
        self.fault_log.close()
        return check.recheck(self.out)


def fault_rounds(faults, rng):
    """Fault kinds without end: rounds in which each kind comes as often as its weight, in an
    order `rng` chooses."""
    while True:
        kinds = [k for k, w in faults.items() for _ in range(w)]
        rng.shuffle(kinds)
        yield from kinds


def faketime_lib():
    found = glob.glob("/usr/lib/*/faketime/libfaketime.so.1")
    if not found:
        raise SystemExit("history: libfaketime.so.1 not found (Debian package libfaketime)")
    return found[0]


def free_port():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def check_token(url, secret_file):
    import urllib.request
    try:
        with open(secret_file) as f:
            req = urllib.request.Request(url + "/v1/token", headers={"Authorization": "Bearer " + f.read().strip()})
        with urllib.request.urlopen(req, timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--audit-log", required=True)
    ap.add_argument("--kubeconfig-2", required=True, help="the second API server's kubeconfig")
    ap.add_argument("--audit-log-2", required=True, help="the second API server's audit log")
    ap.add_argument("--cluster-dir", default=os.environ.get("FENCEDLEASE_CLUSTER_DIR", "/tmp/fencedlease-cluster"),
                    help="hack/cluster.sh's folder (its pid files tell whether a restart took)")
    ap.add_argument("--duration", type=float, default=90)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--unfenced", action="store_true")
    ap.add_argument("--lose-a-write", action="store_true",
                    help="with --unfenced: take an acknowledged write out at the end (the checker must fail)")
    ap.add_argument("--min-stale", type=int, default=100)
    ap.add_argument("--tag", default="0", help="names this run's network namespace (two runs at once)")
    ap.add_argument("--summary")
    a = ap.parse_args()
    if a.lose_a_write and not a.unfenced:
        ap.error("--lose-a-write needs --unfenced (the fence refuses the harness's tokenless write)")
    s = Run(a).run()
    text = json.dumps(s, indent=2)
    print(text)
    for path in filter(None, [os.path.join(a.out, "summary.json"), a.summary]):
        open(path, "w").write(text + "\n")
    failed = [k for k, v in s["checks"].items() if v != "pass"]
    print(f"history: {len(s['checks']) - len(failed)} checks passed, {len(failed)} failed"
          + (": " + ", ".join(failed) if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
