#!/usr/bin/env python3
"""The history test: workers perform fenced read-modify-write updates while a nemesis injects
faults; a checker then verifies the history against the fencing rules.

  run.py --bin target/debug/fencedlease --kubeconfig K --duration 90 --seed 1 --out DIR

Expects a local Kubernetes of its own (hack/history.sh brings one up) because the nemesis
restarts its API server and etcd. Prints a summary, writes DIR/summary.json, exits 1 on any
violation."""
import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kube import Kube  # noqa: E402

NS = "history"
LEASE = "hist"
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
LEASE_SECONDS = 2


def now():
    return time.time_ns()


def say(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


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


class FreezableProxy:
    """A loopback TCP relay whose traffic can be frozen: connections stay open, nothing moves
    (a holder whose connection to the API server hangs without closing)."""

    def __init__(self, target_port):
        self.target = ("127.0.0.1", target_port)
        self.frozen = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            c, _ = self.sock.accept()
            try:
                u = socket.create_connection(self.target, timeout=5)
            except OSError:
                c.close()
                continue
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self.pump, args=(a, b), daemon=True).start()

    def pump(self, a, b):
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                while self.frozen.is_set():
                    time.sleep(0.05)
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class Run:
    def __init__(self, args):
        self.a = args
        self.rng = random.Random(args.seed)
        self.kube = Kube(args.kubeconfig)
        self.out = args.out
        os.makedirs(self.out, exist_ok=True)
        self.procs = {}  # name -> (Popen, argv, env)
        self.lease_history = []  # (t_recv_ns, uid, generation, holder)
        self.faults = {}
        self.stop = threading.Event()
        self.env = dict(os.environ, KUBECONFIG=args.kubeconfig, RUST_LOG="info,kube=warn")

    # processes -------------------------------------------------------------------------
    def start(self, name, argv, env=None):
        log = open(os.path.join(self.out, f"{name}.log"), "a")
        p = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                             env=env or self.env, start_new_session=True)
        self.procs[name] = (p, argv, env)

    def send(self, name, sig):
        """Signals a worker as a whole: every process group in its tree. `campaign` runs its
        command in a session of its own (so that it can kill the command's whole tree), so the
        worker's own group alone would miss the app."""
        for pgid in tree_groups(self.procs[name][0].pid):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass

    def restart(self, name, sig=signal.SIGKILL, delay=0.0):
        p, argv, env = self.procs[name]
        self.send(name, signal.SIGCONT)
        self.send(name, sig)
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.send(name, signal.SIGKILL)
            p.wait()
        time.sleep(delay)
        self.start(name, argv, env)

    def campaign(self, name, kubeconfig=None, server=None, prefix=()):
        env = dict(self.env)
        if kubeconfig:
            env["KUBECONFIG"] = kubeconfig
        # The worker's clock stays real even when the candidate's is faked: its timestamps
        # are compared with the lease's history.
        worker = ["env", "-u", "LD_PRELOAD", "-u", "FAKETIME", sys.executable, os.path.join(HERE, "worker.py"), "campaign", name,
                  os.path.join(self.out, f"ops-{name}.jsonl"), env["KUBECONFIG"]]
        if server:
            worker.append(server)
        argv = list(prefix) + [self.a.bin, "campaign", "--lease", LEASE, "--namespace", NS,
                               "--identity", name, "--lease-duration", str(LEASE_SECONDS),
                               "--grace-seconds", "1", "--events-file",
                               os.path.join(self.out, f"{name}.events"), "--"] + worker
        self.start(name, argv, env)

    # setup -----------------------------------------------------------------------------
    def setup(self):
        k = self.kube
        subprocess.run(["kubectl", "apply", "-f", os.path.join(REPO, "crds")], env=self.env,
                       check=True, capture_output=True)
        subprocess.run(["kubectl", "wait", "--for=condition=Established", "--timeout=60s",
                        "crd/fencedleases.fencedlease.io"], env=self.env, check=True, capture_output=True)
        k.request("POST", "/api/v1/namespaces", {"metadata": {"name": NS, "labels": {"fencedlease.io/history": NS}}})
        code, lease = k.request("POST", f"/apis/fencedlease.io/v1alpha1/namespaces/{NS}/fencedleases",
                                {"apiVersion": "fencedlease.io/v1alpha1", "kind": "FencedLease",
                                 "metadata": {"name": LEASE},
                                 "spec": {"holderIdentity": "setup", "leaseDurationSeconds": LEASE_SECONDS}})
        assert code == 201, lease
        code, cm = k.request("POST", f"/api/v1/namespaces/{NS}/configmaps", {
            "metadata": {"name": "history", "labels": {"fencedlease.io/lease": LEASE},
                         "annotations": {"fencedlease.io/token": str(lease["metadata"]["generation"]),
                                         "fencedlease.io/lease-uid": lease["metadata"]["uid"]}},
            "data": {"counter": "0", "items": ""}})
        assert code == 201, cm
        lease["spec"]["holderIdentity"] = None
        code, _ = k.request("PUT", f"/apis/fencedlease.io/v1alpha1/namespaces/{NS}/fencedleases/{LEASE}", lease)
        assert code == 200
        # Webhook and its registration.
        certs = os.path.join(self.out, "certs")
        bundle = subprocess.run([self.a.bin, "certs", "--out", certs, "--host", "127.0.0.1"],
                                check=True, capture_output=True, text=True).stdout.strip()
        s = socket.socket(); s.bind(("127.0.0.1", 0)); self.webhook_port = s.getsockname()[1]; s.close()
        self.start("webhook", [self.a.bin, "webhook", "--listen", f"127.0.0.1:{self.webhook_port}",
                               "--tls-cert", f"{certs}/tls.crt", "--tls-key", f"{certs}/tls.key",
                               "--metrics-addr", "127.0.0.1:0"])
        code, out = k.request("POST", "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations", {
            "metadata": {"name": "fencedlease-history"},
            "webhooks": [{"name": "fencing.fencedlease.io", "admissionReviewVersions": ["v1"],
                          "sideEffects": "None", "failurePolicy": "Fail", "timeoutSeconds": 5,
                          "clientConfig": {"url": f"https://127.0.0.1:{self.webhook_port}/validate", "caBundle": bundle},
                          "namespaceSelector": {"matchLabels": {"fencedlease.io/history": NS}},
                          "objectSelector": {"matchExpressions": [{"key": "fencedlease.io/lease", "operator": "Exists"}]},
                          "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
                                     "resources": ["configmaps"]}]}]})
        assert code in (201, 409), out
        self.start("controller", [self.a.bin, "controller", "--namespace", NS, "--election-namespace", NS,
                                  "--identity", "controller-0", "--metrics-addr", "127.0.0.1:0"])
        time.sleep(2)  # the API server picks the webhook configuration up
        # Workers: three campaign workers, one on a fast, offset clock, one behind a
        # freezable connection, and one sidecar-backed worker.
        for i in range(3):
            self.campaign(f"w{i}")
        self.campaign("w-skew", prefix=("faketime", "-f", "+3600 x1.5"))
        port = int(self.kube.server.rsplit(":", 1)[1])
        self.proxy = FreezableProxy(port)
        hang_kc = os.path.join(self.out, "kubeconfig-hang")
        text = open(self.a.kubeconfig).read().replace(self.kube.server, f"https://127.0.0.1:{self.proxy.port}")
        open(hang_kc, "w").write(text)
        self.campaign("w-hang", kubeconfig=hang_kc, server=f"https://127.0.0.1:{self.proxy.port}")
        s = socket.socket(); s.bind(("127.0.0.1", 0)); sp = s.getsockname()[1]; s.close()
        self.start("sidecar", [self.a.bin, "sidecar", "--lease", LEASE, "--namespace", NS, "--identity", "w-sidecar",
                               "--listen", f"127.0.0.1:{sp}", "--lease-duration", str(LEASE_SECONDS),
                               "--token-dir", os.path.join(self.out, "sidecar-token")])
        self.start("sidecar-app", [sys.executable, os.path.join(HERE, "worker.py"), "sidecar", "w-sidecar",
                                   os.path.join(self.out, "ops-w-sidecar.jsonl"), self.a.kubeconfig,
                                   f"http://127.0.0.1:{sp}"])

    # lease watcher ---------------------------------------------------------------------
    def watch_lease(self):
        path = f"/apis/fencedlease.io/v1alpha1/namespaces/{NS}/fencedleases?fieldSelector=metadata.name%3D{LEASE}"
        while not self.stop.is_set():
            try:
                for ev in self.kube.watch(path, timeout=10):
                    o = ev.get("object", {})
                    m = o.get("metadata", {})
                    if "generation" in m:
                        self.lease_history.append((now(), m["uid"], m["generation"], (o.get("spec") or {}).get("holderIdentity")))
                    if self.stop.is_set():
                        return
            except Exception:
                time.sleep(0.2)

    def holder(self):
        return self.lease_history[-1][3] if self.lease_history else None

    # nemesis ---------------------------------------------------------------------------
    def fault(self, kind):
        self.faults[kind] = self.faults.get(kind, 0) + 1

    def nemesis(self):
        cluster = os.path.join(REPO, "hack", "cluster.sh")
        names = {"w0": "w0", "w1": "w1", "w2": "w2", "w-skew": "w-skew", "w-hang": "w-hang", "w-sidecar": "sidecar"}
        end = time.time() + self.a.duration
        while time.time() < end:
            time.sleep(self.rng.uniform(1.5, 4.0))
            h = self.holder()
            target = names.get(h)
            kind = self.rng.choice(["pause_short", "pause_long", "pause_long", "pause_candidate_only", "kill",
                                    "webhook", "controller", "apiserver", "etcd", "hang"])
            say(f"nemesis: {kind} (holder {h})")
            # Tested before the whole-group pauses: "pause_candidate_only" starts with "pause" too.
            if kind == "pause_candidate_only" and target and target != "sidecar":
                # The candidate freezes but its app does not: the app keeps writing with a
                # token that goes stale once another candidate takes over.
                p = self.procs[target][0]
                os.kill(p.pid, signal.SIGSTOP)
                time.sleep(self.rng.uniform(3.0, 6.0))
                os.kill(p.pid, signal.SIGCONT)
            elif kind in ("pause_short", "pause_long") and target:
                d = self.rng.uniform(0.3, 1.2) if kind == "pause_short" else self.rng.uniform(2.5, 6.0)
                self.send(target, signal.SIGSTOP)
                time.sleep(d)
                self.send(target, signal.SIGCONT)
            elif kind == "kill" and target:
                self.restart(target, signal.SIGKILL, delay=self.rng.uniform(0.2, 2.0))
            elif kind == "webhook":
                self.restart("webhook", signal.SIGKILL, delay=self.rng.uniform(0.0, 1.5))
            elif kind == "controller":
                self.restart("controller", signal.SIGKILL, delay=self.rng.uniform(0.0, 1.0))
            elif kind in ("apiserver", "etcd"):
                comp = "kube-apiserver" if kind == "apiserver" else "etcd"
                subprocess.run([cluster, "restart", comp, "hard"], env=os.environ, capture_output=True)
                time.sleep(self.rng.uniform(1.0, 3.0))
            elif kind == "hang":
                self.proxy.frozen.set()
                time.sleep(self.rng.uniform(2.0, 5.0))
                self.proxy.frozen.clear()
            else:
                continue
            self.fault(kind)

    # run -------------------------------------------------------------------------------
    def run(self):
        self.setup()
        threading.Thread(target=self.watch_lease, daemon=True).start()
        say(f"workers running; nemesis for {self.a.duration} s (seed {self.a.seed})")
        t = threading.Thread(target=self.nemesis)
        t.start()
        while t.is_alive():
            t.join(timeout=30)
            if t.is_alive():
                say(f"... faults so far: {self.faults}")
        say("nemesis done; letting the workers settle")
        time.sleep(4)
        for name in list(self.procs):
            self.send(name, signal.SIGCONT)
            self.send(name, signal.SIGTERM)
        for name, (p, _, _) in self.procs.items():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.send(name, signal.SIGKILL)
        self.stop.set()
        # The nemesis may have just restarted the API server: retry the final read.
        cm = None
        for _ in range(120):
            try:
                code, cm = self.kube.request("GET", f"/api/v1/namespaces/{NS}/configmaps/history")
                if code == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        if not isinstance(cm, dict):
            raise SystemExit("history: the final ConfigMap could not be read: the run proves nothing")
        json.dump(cm, open(os.path.join(self.out, "final-configmap.json"), "w"))
        json.dump(self.lease_history, open(os.path.join(self.out, "lease-history.json"), "w"))
        return check(self.out, cm, self.lease_history, self.faults)


def check(out, cm, lease_history, faults):
    ops = []
    for f in os.listdir(out):
        if f.startswith("ops-") and f.endswith(".jsonl"):
            ops += [json.loads(l) for l in open(os.path.join(out, f)) if l.strip()]
    # A "sent" record without an outcome means the worker died waiting: ambiguous, like a
    # timeout or a 5xx.
    outcome = {o["item"] for o in ops if o["verdict"] != "sent"}
    ambiguous = [o for o in ops if o["verdict"] == "unknown" or (o["verdict"] == "sent" and o["item"] not in outcome)]
    ops = [o for o in ops if o["verdict"] != "sent"] + [dict(o, verdict="unknown") for o in ambiguous if o["verdict"] == "sent"]
    accepted = sorted((o for o in ops if o["verdict"] == "accepted"), key=lambda o: o["rv"])
    unknown = [o for o in ops if o["verdict"] == "unknown"]
    violations = []
    # 1. No accepted write carried a token the lease had already moved past when it was sent.
    seen = sorted(lease_history)
    for o in accepted:
        moved = [g for (t, uid, g, _) in seen if t < o["t_send"] and uid == o["uid"]]
        if moved and o["token"] < max(moved):
            violations.append(f"stale write accepted: {o['item']} token {o['token']} < {max(moved)} observed before it was sent")
    # 2. Tokens accepted by the object never went down.
    for a, b in zip(accepted, accepted[1:]):
        if a["uid"] == b["uid"] and b["token"] < a["token"]:
            violations.append(f"object token went down: {a['token']} -> {b['token']} at rv {b['rv']}")
    # 3. No acknowledged write was lost: every accepted item is in the list, in order, and the
    #    counter matches the list; only ambiguous (timed-out) writes may add extra items.
    items = [i for i in ((cm.get("data") or {}).get("items", "")).split(",") if i]
    counter = int((cm.get("data") or {}).get("counter", "0"))
    pos = {item: n for n, item in enumerate(items)}
    missing = [o["item"] for o in accepted if o["item"] not in pos]
    if missing:
        violations.append(f"{len(missing)} acknowledged writes lost, e.g. {missing[:3]}")
    order = [pos[o["item"]] for o in accepted if o["item"] in pos]
    if order != sorted(order):
        violations.append("accepted items are out of order in the list")
    extra = set(items) - {o["item"] for o in accepted} - {o["item"] for o in unknown}
    if extra:
        violations.append(f"{len(extra)} items in the list from writes nobody was told succeeded: {sorted(extra)[:3]}")
    if counter != len(items):
        violations.append(f"counter {counter} != {len(items)} items")
    # 4. Tokens were handed out strictly increasing and never twice.
    gens = {}
    for (_, uid, g, _) in seen:
        gens.setdefault(uid, []).append(g)
    for uid, gs in gens.items():
        if any(b < a for a, b in zip(gs, gs[1:])):
            violations.append(f"lease generation went down for uid {uid}")
    leading = []
    for f in os.listdir(out):
        if f.endswith(".events"):
            leading += [json.loads(l) for l in open(os.path.join(out, f)) if '"leading"' in l]
    # (The same holder may claim the same token again: it stops at its deadline while a
    # renewal it sent in time is in flight, and resumes when that renewal succeeds.)
    owners = {}
    for e in leading:
        owners.setdefault((e["lease_uid"], e["token"]), set()).add(e["identity"])
    pairs = list(owners)
    for (uid, tok), who in owners.items():
        if len(who) > 1:
            violations.append(f"token {tok} was handed to two leaders: {sorted(who)}")
    # Overlaps: how long two processes both believed they led (their own validity rule).
    claims = []
    for f in os.listdir(out):
        # w-skew's event times come from its faked wall clock: not comparable.
        if not f.endswith(".events") or f.startswith("w-skew"):
            continue
        cur = None
        for e in (json.loads(l) for l in open(os.path.join(out, f)) if l.strip()):
            if e["event"] == "leading":
                cur = [e["t_ns"], e.get("valid_until_ns", e["t_ns"]), e["identity"]]
                claims.append(cur)
            elif e["event"] == "renewed" and cur and e["t_ns"] < cur[1]:
                cur[1] = max(cur[1], e.get("valid_until_ns", cur[1]))
            elif e["event"] in ("stopped", "exited") and cur:
                cur[1] = min(cur[1], e["t_ns"])
                cur = None
    overlap_ns = 0
    for i, a in enumerate(claims):
        for b in claims[i + 1:]:
            if a[2] != b[2]:
                overlap_ns += max(0, min(a[1], b[1]) - max(a[0], b[0]))
    # Takeovers, from the lease's own history (every watch event, renewals included): from the
    # last event that showed the old holder to the first that shows a new one. Includes the
    # time a restarted API server or etcd took to come back.
    gaps, cur, cur_last = [], None, None
    for (t, _uid, _g, holder) in seen:
        if holder and holder != cur:
            if cur_last is not None:
                gaps.append((t - cur_last) / 1e9)
            cur = holder
        if holder:
            cur_last = t
    gaps.sort()
    failover = {"count": len(gaps)}
    if gaps:
        failover.update(p50_s=round(gaps[len(gaps) // 2], 3), p90_s=round(gaps[int(len(gaps) * 0.9)], 3),
                        max_s=round(gaps[-1], 3))
    verdicts = {}
    for o in ops:
        v = o["verdict"]
        if v == "error":
            m = o.get("message", "")
            v = ("error_webhook_down" if "failed calling webhook" in m else
                 "error_server_unavailable" if ("refused" in m or "reset" in m or o.get("code") in (None, 0)) else
                 f"error_http_{o.get('code')}")
        verdicts[v] = verdicts.get(v, 0) + 1
    summary = {
        "faults": faults, "fault_total": sum(faults.values()),
        "writes_attempted": len(ops), "verdicts": verdicts,
        "stale_writes_accepted": sum(1 for v in violations if v.startswith("stale write accepted")),
        "tokens_handed_out": len(pairs), "final_counter": counter,
        "overlap_seconds_total": overlap_ns / 1e9,
        "takeovers": failover,
        "violations": violations,
    }
    json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=2)
    return summary


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--duration", type=float, default=90)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    s = Run(a).run()
    print(json.dumps(s, indent=2))
    checks = 5
    failed = min(checks, len(s["violations"]))
    if s["writes_attempted"] == 0 or s["verdicts"].get("accepted", 0) == 0:
        print("history: no write was accepted: the run proves nothing", file=sys.stderr)
        failed = max(failed, 1)
    print(f"history: {checks - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
