"""Failover benchmarks (issue 9, items 1-3): SIGKILL, SIGSTOP past the lease, SIGTERM.

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
"""

from __future__ import annotations

import argparse
import random
import signal
import threading
import time
from pathlib import Path

import lib
from lib import Kube, log, now_ns, stats, step
from systems import OURS, SYSTEMS, holder_of, object_path, peer_timings, renew_time, start_candidate

SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}


class Lane(threading.Thread):
    def __init__(self, system: str, idx: int, scenario: str, args, ns: str, workdir: Path,
                 results: list, lock: threading.Lock):
        super().__init__(daemon=True)
        self.system, self.idx, self.scenario, self.args = system, idx, scenario, args
        self.ns = ns
        self.lease = f"{'fl' if system == OURS else 'cg'}-{idx}"
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
            self.slots[i] = start_candidate(
                self.system, name=ident, ns=self.ns, lease=self.lease, identity=ident,
                lease_s=self.args.lease, kubeconfig=lib.kubeconfig(), logdir=self.dir / "logs",
                events=self.dir / f"{ident}.events", writes=self.dir / "writes.jsonl", cm=self.cm)

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

    def restart_lane(self) -> None:
        lib.stop_all([p for p in self.slots if p is not None])
        self.slots = [None] * self.args.candidates

    # -- one trial ---------------------------------------------------------------------------
    def trial(self, n: int) -> dict:
        L = self.args.lease
        self.ensure_running()
        lead = lib.wait_until(lambda: (ls := self.leaders()) and len(ls) == 1 and ls[0],
                              3 * L + 30, f"{self.lease}: one leader")
        holder, ev = lead
        # Every candidate up for at least 1.5 s (it has seen the lease), then a random phase.
        youngest = max(p.started_ns for p in self.slots if p is not None)
        wait = max(0.0, 1.5 - (now_ns() - youngest) / 1e9)
        renew_every = L / 3 if self.system == OURS else peer_timings(L)[2]
        time.sleep(wait + 0.5 + random.uniform(0, max(L / 3, peer_timings(L)[2])))
        if not holder.alive() or self.leaders() != [(holder, ev)]:
            raise RuntimeError("the leader changed before the signal")
        sig = SIGNALS[self.scenario]
        t_sig = now_ns()
        if self.scenario == "term":
            holder.signal(sig)  # campaign / the peer handle SIGTERM themselves
        else:
            holder.signal_group(sig)
        rec: dict = {"system": self.system, "scenario": self.scenario, "lane": self.lease,
                     "trial": n, "lease_s": L, "renew_or_retry_s": renew_every,
                     "old_leader": holder.name, "t_signal_ns": t_sig}
        if self.scenario in ("kill", "stop"):
            # The holder's last renewal as stored. Read a little later than the signal: a renewal
            # the holder had already sent may still land (a slow write under load), and the
            # candidates count from it. Nobody can take over this early (the lease is longer).
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
        if "token" in e:
            rec["token"] = e["token"]
        if self.system == OURS:
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


def summarize(results: list[dict]) -> dict:
    out = {}
    for system in SYSTEMS:
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
        if system == OURS:
            s["writes_missing"] = len([r for r in rs if r.get("first_write_s") is None])
        out[system] = s
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=list(SIGNALS))
    ap.add_argument("--lease", type=int, default=15)
    ap.add_argument("--lanes", type=int, default=4, help="lanes per system")
    ap.add_argument("--trials", type=int, default=10, help="trials per lane")
    ap.add_argument("--candidates", type=int, default=3)
    ap.add_argument("--stop-extra", type=float, default=3.0,
                    help="SIGSTOP lasts the lease plus this many seconds")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    kube = Kube()
    lib.install_crd()
    ns = f"bench-{args.scenario}-{lib.rand_suffix()}"
    kube.create_namespace(ns)
    workdir = lib.WORK / ns
    step(f"failover/{args.scenario}: {args.lanes} lane(s) per system x {args.trials} trial(s), "
         f"{args.candidates} candidates per lane, lease {args.lease} s, namespace {ns}")
    lanes_cfg = [(s, i) for i in range(args.lanes) for s in SYSTEMS]
    # The protected ConfigMaps (created before the webhook is registered), then the webhook.
    for s, i in lanes_cfg:
        if s == OURS:
            kube.request("POST", f"/api/v1/namespaces/{ns}/configmaps", {
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": f"cm-fl-{i}", "labels": {"fencedlease.io/lease": f"fl-{i}"}},
                "data": {"writer": ""}})
    wh, port, _, bundle = lib.start_webhook(f"webhook-{ns}", workdir / "logs", workdir / "certs")
    wh_name = f"fencedlease-bench-{ns}"
    lib.register_webhook(kube, wh_name, port, bundle, ns)
    lib.wait_webhook_effective(kube, ns)

    results: list[dict] = []
    lock = threading.Lock()
    lanes = [Lane(s, i, args.scenario, args, ns, workdir, results, lock) for s, i in lanes_cfg]
    started = time.monotonic()
    for lane in lanes:
        lane.start()
    total = len(lanes) * args.trials
    last = -1
    while any(lane.is_alive() for lane in lanes):
        time.sleep(1)
        with lock:
            done = len(results)
            if done != last and (done % max(1, total // 10) == 0 or done == total):
                ok = [r for r in results if "failover_s" in r]
                by = {s: [r["failover_s"] for r in ok if r["system"] == s] for s in SYSTEMS}
                med = {s: (f"{lib.pct(v, 50):.3f}s" if v else "-") for s, v in by.items()}
                log(f"failover/{args.scenario}: {done}/{total} trials, median so far {med}")
                last = done
    kube.request("DELETE",
                 f"/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{wh_name}",
                 ok=(200, 404))
    lib.stop_all([wh])
    out = {
        "benchmark": f"failover-{args.scenario}",
        "config": {"lease_s": args.lease, "lanes_per_system": args.lanes, "trials_per_lane": args.trials,
                   "candidates_per_lane": args.candidates,
                   "peer_timings_s": dict(zip(("lease", "renew_deadline", "retry_period"),
                                              peer_timings(args.lease))),
                   "ours_timings_s": {"lease": args.lease, "renew_interval": args.lease / 3,
                                      "safety_margin": min(max(args.lease / 5, 0.05), 2.0)},
                   "stop_extra_s": args.stop_extra if args.scenario == "stop" else None},
        "wall_s": time.monotonic() - started,
        "summary": summarize(results),
        "trials": sorted(results, key=lambda r: (r["system"], r["lane"], r["trial"])),
    }
    lib.write_result(args.out, f"failover-{args.scenario}", out)
    for s, v in out["summary"].items():
        f = v["failover_s"]
        if f.get("n"):
            log(f"failover/{args.scenario} {s}: n={f['n']} p50={f['p50']:.3f}s p99={f['p99']:.3f}s "
                f"max={f['max']:.3f}s failed={v['trials_failed']}")
        else:
            log(f"failover/{args.scenario} {s}: no successful trial")
    bad = [s for s, v in out["summary"].items() if not v["failover_s"].get("n")]
    if bad:
        raise SystemExit(f"failover/{args.scenario}: no successful trial for {bad}")


if __name__ == "__main__":
    main()
