"""Failover benchmarks (issue 9, items 1-3): SIGKILL, SIGSTOP past the lease, SIGTERM; and
(issue 17) SIGKILL of the holder together with the force-deletion of its pod ("podgone").

Each system runs in several independent *lanes* at once (a lane = one lease and its candidates),
fencedlease lanes and client-go lanes side by side in the same run, so both see the same load.
In every trial of a lane: wait until one candidate leads and every candidate has been up for a
while, wait a random extra time (so the signal falls at a random point of the renewal cycle),
signal the holder, and time until another candidate writes its "leading" event. For fencedlease
the command run while leading does one fenced write through the API server and the webhook; its
answer time is "first accepted fenced write".

Measured per trial (seconds):
- failover: signal -> the next leader's "leading" event (its own clock, same machine);
- lateness (kill, stop): the next leader's event minus (the holder's last renewTime as stored in
  the lease, read min(1 s, lease/4) after the signal so that a renewal already in flight is
  included, + the lease duration): how long after the earliest moment the protocol allows;
- first_write (fencedlease): signal -> the next leader's first accepted (HTTP 200) fenced write.

podgone: every candidate's identity is the name of a Pod created for it before it starts (stored,
never run: the bench cluster has no node; for fencedlease annotated `fencedlease.io/lease: <lease>`,
as the injected sidecar's pod is), and a `fencedlease controller` watches the namespace. Once the
holder's pod carries the leader label (the controller's pod index has it), the event is: SIGKILL of
the holder's process group and, at once, the force-deletion (grace 0) of its pod; the signal time
is the start of that DELETE. client-go lanes get the same event (their pods have no annotation:
client-go knows nothing of pods). A third system, fencedlease-opted-out, runs the same lanes on
leases with `spec.revokeOnHolderDeath: false`: the same event without the early revocation.

Under load (issue 21; --load-writes, --load-lists, --delay-ms; the result is then named
failover-load-<scenario>): bench/load.py's load generator sends writes and lists to the API server
at the stated rates for the whole run, and every candidate of both systems (their kubeconfig, and
fencedlease's fenced write) reaches the API server through one delay proxy that adds --delay-ms to
every chunk each way. The harness's own reads (the lease's last renewTime, pods) go straight to the
API server, so the timing is not delayed. The result adds the load's configuration and what it
achieved (requests/s sent, errors, latency, the API server's CPU) and the proxy's delay.

Under a list-heavy load (issue 38; --load-list-clients N, the result then named
failover-lists-<scenario>): N closed-loop clients each LIST all of the load namespace's
ConfigMaps back to back for the whole run (bench/load.py), beside any open-loop load; with no
--delay-ms the candidates reach the API server straight, without the proxy. Every request of the
load is kept (samples/<name>-load.json.gz).

Where each fencedlease takeover's time went (kill, stop; issue 38): the candidates log the
elector's timeline (bench/takeover.py), and each trial with a lateness carries `attribution`:
watch lag + timer slack + the acquiring write + answer -> leading, which add up to the lateness,
with the part that dominated; the summary has their spread and the slowest takeovers. client-go
lanes keep the lateness alone (the peer logs only its leadership changes).
"""

from __future__ import annotations

import argparse
import random
import signal
import threading
import time
from pathlib import Path

import lib
import takeover
from lib import Kube, log, now_ns, stats, step
from load import CLOSED_LIST, DelayProxyProcess, LoadGenerator, probe_delay
from systems import (OURS, OURS_OPT_OUT, PEER_NAME, SYSTEMS, holder_of, is_ours, object_path,
                     peer_timings, renew_time, start_candidate)

SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM,
           "podgone": signal.SIGKILL}
PREFIX = {OURS: "fl", PEER_NAME: "cg", OURS_OPT_OUT: "fo"}
ROLE_LABEL = "fencedlease.io/role"


def pod_body(name: str, lease: str | None) -> dict:
    """A Pod named like a candidate's identity. Nothing runs it (no node); for fencedlease lanes
    it names the lease and the container that campaigns, as a `campaign` user's pod would."""
    ann = {"fencedlease.io/lease": lease, "fencedlease.io/campaign-container": "campaign"} if lease else {}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"fencedlease.io/bench": "podgone"}, "annotations": ann},
            "spec": {"automountServiceAccountToken": False,
                     "containers": [{"name": "campaign", "image": "fencedlease-bench:never-run"}]}}


class Lane(threading.Thread):
    def __init__(self, system: str, idx: int, scenario: str, args, ns: str, workdir: Path,
                 results: list, lock: threading.Lock):
        super().__init__(daemon=True)
        self.system, self.idx, self.scenario, self.args = system, idx, scenario, args
        self.ns = ns
        self.lease = f"{PREFIX[system]}-{idx}"
        self.cm = f"cm-{self.lease}"
        self.dir = workdir / self.lease
        self.dir.mkdir(parents=True, exist_ok=True)
        self.results, self.lock = results, lock
        self.kube = Kube()
        self.slots: list[lib.Proc | None] = [None] * args.candidates
        self.gen = 0
        self.failures = 0

    # -- candidates --------------------------------------------------------------------------
    def ensure_running(self) -> None:
        for i, p in enumerate(self.slots):
            if p is not None and p.alive():
                continue
            if p is not None:
                lib.stop_all([p])
            self.gen += 1
            ident = f"{self.lease}-c{i}-g{self.gen}"
            if self.scenario == "podgone":
                self.kube.request("POST", f"/api/v1/namespaces/{self.ns}/pods",
                                  pod_body(ident, self.lease if is_ours(self.system) else None))
            self.slots[i] = start_candidate(
                self.system, name=ident, ns=self.ns, lease=self.lease, identity=ident,
                lease_s=self.args.lease, kubeconfig=self.args.candidate_kubeconfig or lib.kubeconfig(),
                logdir=self.dir / "logs", events=self.dir / f"{ident}.events",
                writes=self.dir / "writes.jsonl", cm=self.cm, api=self.args.candidate_api, timeline=True)

    def leaders(self) -> list[tuple[lib.Proc, dict]]:
        out = []
        for p in self.slots:
            if p is None or not p.alive():
                continue
            evs = [e for e in p.read_events() if e.get("event") in ("leading", "stopped")]
            if evs and evs[-1]["event"] == "leading":
                out.append((p, evs[-1]))
        return out

    def writes_after(self, identity: str, after_ns: int) -> list[dict]:
        return [w for w in lib.read_jsonl(self.dir / "writes.jsonl")
                if w.get("identity") == identity and w.get("t_ns", 0) > after_ns]

    def pod_path(self, name: str) -> str:
        return f"/api/v1/namespaces/{self.ns}/pods/{name}"

    def delete_pod(self, name: str) -> None:
        """Force-deletion: grace period 0, the pod object is gone at once."""
        self.kube.request("DELETE", self.pod_path(name), {"gracePeriodSeconds": 0}, ok=(200, 404))

    def leader_labelled(self, name: str) -> bool:
        pod = self.kube.get_opt(self.pod_path(name)) or {}
        return ((pod.get("metadata") or {}).get("labels") or {}).get(ROLE_LABEL) == "leader"

    def attribution(self, holder: lib.Proc, leader: lib.Proc, others: list[lib.Proc], rec: dict) -> dict:
        """Where this takeover's lateness went (bench/takeover.py), from the candidates' logs."""
        return takeover.attribute(
            takeover.read_log(leader.logfile), rec["leader_ns"], rec["last_renew_ns"], self.args.lease,
            holder=takeover.read_log(holder.logfile),
            others=[takeover.read_log(o.logfile) for o in others if o is not leader])

    def restart_lane(self) -> None:
        # podgone: the stopped candidates' pods stay (a lease still held by one is waited out),
        # so that the controller's early revocations are those of the trials alone.
        lib.stop_all([p for p in self.slots if p is not None])
        self.slots = [None] * self.args.candidates

    # -- one trial ---------------------------------------------------------------------------
    def trial(self, n: int) -> dict:
        L = self.args.lease
        self.ensure_running()
        lead = lib.wait_until(lambda: (ls := self.leaders()) and len(ls) == 1 and ls[0],
                              3 * L + 30, f"{self.lease}: one leader")
        holder, ev = lead
        if self.scenario == "podgone" and is_ours(self.system):
            # The controller's pod index has the holder's pod (it put the leader label on it); a
            # pod deleted before the index listed it would leave no trace of its death.
            lib.wait_until(lambda: self.leader_labelled(holder.name), 15,
                           f"{self.lease}: the leader label on {holder.name}", interval=0.05)
        # Every candidate up for at least 1.5 s (it has seen the lease), then a random phase.
        youngest = max(p.started_ns for p in self.slots if p is not None)
        wait = max(0.0, 1.5 - (now_ns() - youngest) / 1e9)
        renew_every = L / 3 if is_ours(self.system) else peer_timings(L)[2]
        time.sleep(wait + 0.5 + random.uniform(0, max(L / 3, peer_timings(L)[2])))
        if not holder.alive() or self.leaders() != [(holder, ev)]:
            raise RuntimeError("the leader changed before the signal")
        sig = SIGNALS[self.scenario]
        extra: dict = {}
        if self.scenario == "podgone":
            # The holder dies with its pod: its processes are killed, and its pod is force-deleted
            # at once. Timed from the DELETE (what the controller can learn of), sent right after
            # the SIGKILL (which no one observes).
            t_kill = now_ns()
            holder.signal_group(sig)
            t_sig = now_ns()
            self.delete_pod(holder.name)
            extra = {"t_kill_ns": t_kill, "delete_roundtrip_s": (now_ns() - t_sig) / 1e9}
        else:
            t_sig = now_ns()
            if self.scenario == "term":
                holder.signal(sig)  # campaign / the peer handle SIGTERM themselves
            else:
                holder.signal_group(sig)
        rec: dict = {"system": self.system, "scenario": self.scenario, "lane": self.lease,
                     "trial": n, "lease_s": L, "renew_or_retry_s": renew_every,
                     "old_leader": holder.name, "t_signal_ns": t_sig, **extra}
        if "token" in ev:
            rec["old_token"] = ev["token"]
        if self.scenario in ("kill", "stop", "podgone"):
            # The holder's last renewal as stored. Read a little later than the signal: a renewal
            # the holder had already sent may still land (a slow write under load), and the
            # candidates count from it. Nobody can take over this early by the lease (it is
            # longer); after a pod's deletion fencedlease's controller may have revoked it already,
            # and then there is no lateness to compute (the next leader did not wait for expiry).
            time.sleep(min(1.0, L / 4))
            obj = self.kube.get_opt(object_path(self.system, self.ns, self.lease))
            if holder_of(self.system, obj) == holder.name:
                rec["last_renew_ns"] = lib.parse_time_ns(renew_time(self.system, obj))
        others = [p for p in self.slots if p is not None and p is not holder]

        def new_leader():
            for p in others:
                for e in p.read_events():
                    if e.get("event") == "leading" and e["t_ns"] > t_sig:
                        return p, e
            return None

        try:
            p, e = lib.wait_until(new_leader, 3 * L + 20, f"{self.lease}: a new leader")
        finally:
            if self.scenario == "stop":
                # Keep it stopped past the lease (from the signal), then let it run on.
                rest = (t_sig + int((L + self.args.stop_extra) * 1e9) - now_ns()) / 1e9
                if rest > 0:
                    time.sleep(rest)
                holder.signal_group(signal.SIGCONT)
                rec["stopped_for_s"] = (now_ns() - t_sig) / 1e9
        rec["new_leader"] = p.name
        rec["leader_ns"] = e["t_ns"]
        rec["failover_s"] = (e["t_ns"] - t_sig) / 1e9
        if rec.get("last_renew_ns"):
            rec["lateness_s"] = (e["t_ns"] - rec["last_renew_ns"]) / 1e9 - L
            if is_ours(self.system) and self.scenario in ("kill", "stop"):
                rec["attribution"] = self.attribution(holder, p, others, rec)
        if "token" in e:
            rec["token"] = e["token"]
            if "old_token" in rec:
                # 1: the next leader took the lease over from the old holder; 2: someone (the
                # controller) revoked it first, and the next leader acquired it free.
                rec["token_step"] = e["token"] - rec["old_token"]
        if is_ours(self.system):
            try:
                w = lib.wait_until(lambda: [x for x in self.writes_after(p.name, t_sig)
                                            if x.get("code") == 200], 15, "the fenced write")
                rec["first_write_s"] = (w[0]["t_ns"] - t_sig) / 1e9
                rec["write_roundtrip_s"] = (w[0]["t_ns"] - w[0]["start_ns"]) / 1e9
            except TimeoutError:
                rec["first_write_s"] = None
                codes = [x.get("code") for x in self.writes_after(p.name, t_sig)]
                rec["write_codes"] = codes
        if self.scenario == "stop":
            # The resumed process must notice it lost: fencedlease writes "stopped" (and
            # campaigns again), the peer exits; either way wait for that before going on.
            if self.system == OURS:
                lib.wait_until(lambda: any(x.get("event") == "stopped" and x["t_ns"] > t_sig
                                           for x in holder.read_events()) or not holder.alive(),
                               2 * L + 10, f"{self.lease}: the resumed holder to step down")
            else:
                lib.wait_until(lambda: not holder.alive(), 2 * L + 10,
                               f"{self.lease}: the resumed peer to exit")
        if self.scenario == "term":
            lib.wait_until(lambda: not holder.alive(), 15, f"{self.lease}: the holder to exit")
            rec["exit_code"] = holder.p.returncode
        return rec

    def run(self) -> None:
        time.sleep(random.uniform(0, 2))
        for n in range(self.args.trials):
            try:
                rec = self.trial(n)
            except Exception as e:  # noqa: BLE001 - a failed trial is a result too
                self.failures += 1
                rec = {"system": self.system, "scenario": self.scenario, "lane": self.lease,
                       "trial": n, "error": str(e)}
                log(f"{self.lease} trial {n}: FAILED: {e}")
                self.restart_lane()
            with self.lock:
                self.results.append(rec)
        self.restart_lane()


def summarize(results: list[dict], systems=SYSTEMS) -> dict:
    out = {}
    for system in systems:
        rs = [r for r in results if r["system"] == system and "failover_s" in r]
        s = {"trials_ok": len(rs),
             "trials_failed": len([r for r in results if r["system"] == system and "error" in r]),
             "failover_s": stats([r["failover_s"] for r in rs])}
        late = [r["lateness_s"] for r in rs if r.get("lateness_s") is not None]
        if late:
            s["lateness_s"] = stats(late)
        fw = [r["first_write_s"] for r in rs if r.get("first_write_s") is not None]
        if fw:
            s["first_write_s"] = stats(fw)
            s["write_roundtrip_s"] = stats([r["write_roundtrip_s"] for r in rs
                                            if r.get("write_roundtrip_s") is not None])
        if is_ours(system):
            s["writes_missing"] = len([r for r in rs if r.get("first_write_s") is None])
            steps = [r["token_step"] for r in rs if "token_step" in r]
            if steps:
                s["token_steps"] = {str(k): steps.count(k) for k in sorted(set(steps))}
            att = takeover.summarize(rs)
            if att:
                s["attribution"] = att
        out[system] = s
    return out


def start_controller(ns: str, workdir: Path) -> tuple[lib.Proc, int]:
    """`fencedlease controller` for the namespace (its election lease there too), once active."""
    mport = lib.free_port()
    p = lib.Proc(f"controller-{ns}", [str(lib.FENCEDLEASE), "controller", "--namespace", ns,
                                      "--election-namespace", ns, "--identity", "bench-controller",
                                      "--metrics-addr", f"127.0.0.1:{mport}"],
                 workdir / "logs", env={"KUBECONFIG": str(lib.kubeconfig()), "RUST_LOG": "info"})

    def active() -> bool:
        if not p.alive():
            raise RuntimeError(f"the controller exited; see {p.logfile}")
        try:
            text = lib.http_get(mport, "/metrics")
        except OSError:
            return False
        return lib.metric_values(text, "fencedlease_controller_leading").get("", 0) == 1

    lib.wait_until(active, 60, "the controller to be active", interval=0.2)
    return p, mport


def create_leases(kube: Kube, ns: str, lanes_cfg: list[tuple[str, int]], lease_s: int) -> None:
    """podgone: the FencedLeases, created before their candidates, opted out where the lane says."""
    for s, i in lanes_cfg:
        if is_ours(s):
            kube.request("POST", lib.fl_path(ns), {
                "apiVersion": "fencedlease.io/v1alpha1", "kind": "FencedLease",
                "metadata": {"name": f"{PREFIX[s]}-{i}"},
                "spec": {"leaseDurationSeconds": lease_s, "revokeOnHolderDeath": s != OURS_OPT_OUT}})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=list(SIGNALS))
    ap.add_argument("--lease", type=int, default=15)
    ap.add_argument("--lanes", type=int, default=4, help="lanes per system")
    ap.add_argument("--trials", type=int, default=10, help="trials per lane")
    ap.add_argument("--candidates", type=int, default=3)
    ap.add_argument("--stop-extra", type=float, default=3.0,
                    help="SIGSTOP lasts the lease plus this many seconds")
    ap.add_argument("--no-opt-out", action="store_true",
                    help="podgone: leave out the lanes whose leases have revokeOnHolderDeath: false")
    ap.add_argument("--load-writes", type=float, default=0,
                    help="under load: ConfigMap writes per second to the API server during the run")
    ap.add_argument("--load-lists", type=float, default=0,
                    help="under load: LISTs per second of the load namespace's ConfigMaps")
    ap.add_argument("--load-objects", type=int, default=500, help="under load: ConfigMaps in the load namespace")
    ap.add_argument("--load-object-bytes", type=int, default=1024, help="under load: bytes of data per ConfigMap")
    ap.add_argument("--load-workers", type=int, default=32, help="under load: the load generator's threads")
    ap.add_argument("--load-list-clients", type=int, default=0,
                    help="under load: clients each LISTing the load namespace's ConfigMaps back to back "
                         "(closed loop; the result is then named failover-lists-<scenario>)")
    ap.add_argument("--delay-ms", type=float, default=0,
                    help="under load: every candidate reaches the API server through a proxy adding this "
                         "many ms to each chunk, each way")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    loaded = bool(args.load_writes or args.load_lists or args.load_list_clients or args.delay_ms)
    name = (f"failover-lists-{args.scenario}" if args.load_list_clients
            else f"failover-load-{args.scenario}" if loaded else f"failover-{args.scenario}")
    label = name.replace("-", "/", 1)  # failover/kill, failover/load-kill: for the log
    args.candidate_kubeconfig = args.candidate_api = None
    systems = SYSTEMS
    if args.scenario == "podgone" and not args.no_opt_out:
        systems = (*SYSTEMS, OURS_OPT_OUT)

    kube = Kube()
    lib.install_crd()
    ns = f"bench-{'load-' if loaded else ''}{args.scenario}-{lib.rand_suffix()}"
    kube.create_namespace(ns)
    workdir = lib.WORK / ns
    step(f"{label}: {args.lanes} lane(s) per system x {args.trials} trial(s), "
         f"{args.candidates} candidates per lane, lease {args.lease} s, namespace {ns}")
    lanes_cfg = [(s, i) for i in range(args.lanes) for s in systems]
    # The protected ConfigMaps (created before the webhook is registered), then the webhook.
    for s, i in lanes_cfg:
        if is_ours(s):
            lease = f"{PREFIX[s]}-{i}"
            kube.request("POST", f"/api/v1/namespaces/{ns}/configmaps", {
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": f"cm-{lease}", "labels": {"fencedlease.io/lease": lease}},
                "data": {"writer": ""}})
    wh, port, _, bundle = lib.start_webhook(f"webhook-{ns}", workdir / "logs", workdir / "certs")
    wh_name = f"fencedlease-bench-{ns}"
    lib.register_webhook(kube, wh_name, port, bundle, ns)
    lib.wait_webhook_effective(kube, ns)
    ctl = None
    if args.scenario == "podgone":
        create_leases(kube, ns, lanes_cfg, args.lease)
        # The ServiceAccount admission plugin refuses pods until the namespace's default
        # ServiceAccount exists (the pods mount no token, so its token Secret is not needed).
        lib.wait_until(lambda: kube.get_opt(f"/api/v1/namespaces/{ns}/serviceaccounts/default"), 30,
                       "the namespace's default ServiceAccount", interval=0.2)
        ctl, ctl_port = start_controller(ns, workdir)

    gen = proxy = None
    load_cfg: dict | None = None
    if loaded:
        gen, proxy, load_cfg = start_load(args, kube, workdir, label)

    results: list[dict] = []
    lock = threading.Lock()
    lanes = [Lane(s, i, args.scenario, args, ns, workdir, results, lock) for s, i in lanes_cfg]
    started = time.monotonic()
    total = len(lanes) * args.trials
    step(f"{label}: {total} trials")  # the heartbeat names this, not the step before
    for lane in lanes:
        lane.start()
    last = -1
    while any(lane.is_alive() for lane in lanes):
        time.sleep(1)
        with lock:
            done = len(results)
            if done != last and (done % max(1, total // 10) == 0 or done == total):
                ok = [r for r in results if "failover_s" in r]
                by = {s: [r["failover_s"] for r in ok if r["system"] == s] for s in systems}
                med = {s: (f"{lib.pct(v, 50):.3f}s" if v else "-") for s, v in by.items()}
                log(f"{label}: {done}/{total} trials, median so far {med}")
                last = done
    kube.request("DELETE",
                 f"/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{wh_name}",
                 ok=(200, 404))
    lib.stop_all([wh])
    load_out = stop_load(gen, proxy, kube, label, args.out, name) if gen is not None else None
    controller = None
    if ctl is not None:
        # One revoked_holder_dead per fencedlease trial that got as far as the deletion, and
        # none for the opted-out leases.
        controller = controller_report(ctl, ctl_port)
        lib.stop_all([ctl])
    out = {
        "benchmark": name,
        "config": {"lease_s": args.lease, "lanes_per_system": args.lanes, "trials_per_lane": args.trials,
                   "candidates_per_lane": args.candidates,
                   "peer_timings_s": dict(zip(("lease", "renew_deadline", "retry_period"),
                                              peer_timings(args.lease))),
                   "ours_timings_s": {"lease": args.lease, "renew_interval": args.lease / 3,
                                      "safety_margin": min(max(args.lease / 5, 0.05), 2.0)},
                   "stop_extra_s": args.stop_extra if args.scenario == "stop" else None,
                   "systems": list(systems), **({"load": load_cfg} if loaded else {})},
        "wall_s": time.monotonic() - started,
        **({"load": load_out} if loaded else {}),
        "controller": controller,
        "summary": summarize(results, systems),
        "trials": sorted(results, key=lambda r: (r["system"], r["lane"], r["trial"])),
    }
    finish(args.out, name, out)


def start_delay(args, workdir: Path) -> tuple[DelayProxyProcess, dict]:
    """The delay proxy, which every candidate's kubeconfig and fenced write go through, and its
    added latency measured before the load (GET /version with a fresh TLS connection, straight
    vs through it)."""
    proxy = DelayProxyProcess(args.delay_ms, workdir)
    args.candidate_api = f"https://127.0.0.1:{proxy.port}"
    args.candidate_kubeconfig = workdir / "kubeconfig-delayed"
    workdir.mkdir(parents=True, exist_ok=True)
    lib.write_kubeconfig(args.candidate_kubeconfig, args.candidate_api, lib.ca_file().read_bytes())
    probe = {"direct": probe_delay(lib.API_PORT), "through_proxy": probe_delay(proxy.port)}
    return proxy, {"delay_ms_each_way": args.delay_ms,
                   "delay_how": "loopback TCP relay (a Python process of its own), every chunk held delay_ms "
                                "each way, in order; "
                                "TLS end to end (the API server's certificate); all candidates of both "
                                "systems and fencedlease's fenced write through it; the harness's reads "
                                "straight to the API server",
                   "delay_probe_s": {k: {q: round(v[q], 4) for q in ("p50", "max")} for k, v in probe.items()}}


def start_load(args, kube: Kube, workdir: Path, label: str) -> tuple[LoadGenerator, DelayProxyProcess | None, dict]:
    """The delay proxy first (with --delay-ms), then the load, running before the candidates
    start and until every lane is done; (the load, the proxy, their configuration)."""
    proxy, load_cfg = None, {"delay_ms_each_way": 0, "delay_how": "none: the candidates reach the API "
                                                                  "server straight, as the harness does"}
    if args.delay_ms:
        proxy, load_cfg = start_delay(args, workdir)
    gen = LoadGenerator(args.load_writes, args.load_lists, args.load_objects, args.load_object_bytes,
                        args.load_workers, list_clients=args.load_list_clients)
    step(f"{label}: creating {args.load_objects} ConfigMaps for the load")
    gen.setup(kube)
    load_cfg["generator"] = gen.config()
    gen.start()
    time.sleep(2)  # let the API server feel it before the first candidate starts
    return gen, proxy, load_cfg


def stop_load(gen: LoadGenerator, proxy: DelayProxyProcess | None, kube: Kube, label: str, out_dir: Path,
              name: str) -> dict:
    """Stops the load (and the proxy): what it achieved, every request kept, the delay again."""
    # The delay again, with the load still on.
    end_probe = {"direct": probe_delay(lib.API_PORT)}
    if proxy is not None:
        end_probe["through_proxy"] = probe_delay(proxy.port)
    load_out = {"achieved": gen.stop(),
                "delay_probe_s_under_load": {k: {q: round(v[q], 4) for q in ("p50", "max")}
                                             for k, v in end_probe.items()}}
    if proxy is not None:
        load_out["delay_proxy"] = proxy.close()
    kept = gen.samples()
    load_out["raw_samples"] = lib.keep_samples(out_dir, f"samples/{name}-load.json.gz", kept["ms"],
                                               {"t0_ns": kept["t0_ns"], "requests": kept["requests"]})
    a = load_out["achieved"]
    closed = a.get(CLOSED_LIST)
    errors = sum(a[k]["errors"] for k in ("write", "list", CLOSED_LIST) if k in a)
    log(f"{label}: load achieved {a['write']['sent_per_s']:.1f} writes/s, {a['list']['sent_per_s']:.1f} lists/s"
        + (f", {closed['sent_per_s']:.1f} lists/s from {closed['clients']} closed-loop clients (p50 "
           f"{(closed['latency_from_due_s'].get('p50') or 0) * 1000:.0f} ms)" if closed else "")
        + f", {errors} errors, write p99 {(a['write']['latency_from_due_s'].get('p99') or 0) * 1000:.0f} ms; "
        f"CPU s/s {a['cpu_s_per_s']}")
    gen.cleanup(kube)
    return load_out


def controller_report(ctl: lib.Proc, port: int) -> dict:
    """What the controller did: its lease events by kind (revoked_holder_dead: early
    revocations after a known death), and whether it was alive at the end."""
    alive = ctl.alive()
    events = {}
    if alive:
        events = lib.metric_values(lib.http_get(port, "/metrics"), "fencedlease_lease_events_total")
    return {"alive_at_end": alive, "lease_events": events, "log": str(ctl.logfile)}


def finish(out_dir: Path, name: str, out: dict) -> None:
    """Writes the result (NAME.json: failover-<scenario>, failover-load-<scenario> or
    failover-lists-<scenario>), logs each system's figures, and fails the benchmark when a system
    had no successful trial or the controller (if any) died."""
    lib.write_result(out_dir, name, out)
    label = name.replace("-", "/", 1)
    for s, v in out["summary"].items():
        f = v["failover_s"]
        if f.get("n"):
            log(f"{label} {s}: n={f['n']} p50={f['p50']:.3f}s p99={f['p99']:.3f}s "
                f"max={f['max']:.3f}s failed={v['trials_failed']}")
        else:
            log(f"{label} {s}: no successful trial")
    bad = [s for s, v in out["summary"].items() if not v["failover_s"].get("n")]
    controller = out.get("controller")
    if controller is not None and not controller["alive_at_end"]:
        raise SystemExit(f"{label}: the controller exited during the run; see {controller['log']}")
    if bad:
        raise SystemExit(f"{label}: no successful trial for {bad}")


if __name__ == "__main__":
    main()
