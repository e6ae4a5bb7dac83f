"""Many live leases (issue 21): N leases renewing with a 15 s lease and C candidates each, for
fencedlease (its electors: one watch per candidate, the holder renews a third of the way in)
beside client-go (its LeaderElectors: every candidate polls every retry period, the holder
renews then too), and client-go tuned for speed (a 500 ms retry period: what its polling costs
in requests), one system after the other in the same run, on the same API server.

Each system's candidates run in one process, so that N×C of them fit on this machine:
`benches/many_leases.rs` (fencedlease's elector library) and `bench/many_peer/main.go`
(client-go's leaderelection package), each built by run.sh. Per system:

1. a fresh namespace; fencedlease's N FencedLeases are created first (client-go creates its own
   Lease objects), then the candidates start;
2. once every lease has a holder, a warm-up of one lease duration;
3. a window of --window seconds, measured:
   - requests: the API server's own `apiserver_request_total`, the lease resource only
     (fencedleases for fencedlease, leases for client-go, less the kube-controller-manager's
     own lease traffic measured the same way with no candidates running), per second, by verb.
     A watch counts when it ends (long-running requests are counted at their end);
   - the API server's and etcd's CPU seconds per second and RSS, and the candidates' process's;
   - lateness: a watch of the namespace records every renewal (renewTime changes); a gap
     between two renewTimes of one holder (the holder's own clock, so the watch's delays do not
     count) longer than the renewal period (lease/3 for fencedlease, the retry period for
     client-go) is late by the difference. Percentiles over every gap; holder changes in the window are counted
     (each is a leadership lost without a crash).
4. the candidates get SIGTERM; the namespace is deleted.
"""

from __future__ import annotations

import argparse
import resource
import threading
import time
from pathlib import Path

import lib
from lib import Kube, log, now_ns, stats, step
from policy_bench import proc_pid

OURS, PEER, FAST = "fencedlease", "client-go", "client-go-500ms"
# client-go tuned for speed (issue 21): a 500 ms retry period, to show what its polling costs.
FAST_RETRY_S = 0.5
RENEW_SHARE = 3  # fencedlease renews a third of the way into the lease
BREAK = None  # in a lease's list of renewals seen: the watch was opened again here


def rss_mib(pid: int) -> float:
    return lib.proc_status_kib(pid, "VmRSS")["VmRSS"] / 1024


def lease_base(system: str, ns: str) -> str:
    if system == OURS:
        return f"/apis/fencedlease.io/v1alpha1/namespaces/{ns}/fencedleases"
    return f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"


def renewal(system: str, obj: dict) -> tuple[str, str | None, str | None]:
    """(name, holder, renewTime) of a lease object."""
    name = obj["metadata"]["name"]
    if system == OURS:
        holder = (obj.get("spec") or {}).get("holderIdentity")
        return name, holder, (obj.get("status") or {}).get("renewTime")
    spec = obj.get("spec") or {}
    return name, spec.get("holderIdentity"), spec.get("renewTime")


def lease_requests(kube: Kube, system: str) -> dict[str, float]:
    """The API server's finished requests on the system's lease resource, by verb, so far."""
    resource_ = 'resource="fencedleases"' if system == OURS else 'resource="leases"'
    out: dict[str, float] = {}
    for labels, v in lib.metric_values(kube.request("GET", "/metrics"), "apiserver_request_total").items():
        if resource_ in labels:
            verb = labels.split('verb="', 1)[1].split('"', 1)[0]
            out[verb] = out.get(verb, 0) + v
    return out


def gap_ms(a: tuple, b: tuple) -> float:
    """Between two renewals seen: by the renewTime each holder wrote (its own clock, so what the
    harness's watch delays does not count), else by when the harness saw them."""
    ra, rb = lib.parse_time_ns(a[2]), lib.parse_time_ns(b[2])
    if ra is not None and rb is not None:
        return (rb - ra) / 1e6
    return (b[0] - a[0]) / 1e6


class Renewals(threading.Thread):
    """Every renewal seen in a namespace: per lease, (arrival ns, holder, renewTime)."""

    def __init__(self, system: str, ns: str, seconds: float):
        super().__init__(daemon=True)
        self.system, self.ns, self.seconds = system, ns, seconds
        self.seen: dict[str, list[tuple[int, str | None, str | None]]] = {}
        self.events = 0
        self.restarts = 0
        self.error: str | None = None

    def run(self) -> None:
        """Watches until the window ends. A watch the API server ends early (it closes a watcher
        that falls behind) is opened again from a fresh list; the gap across that break is not
        a renewal gap and is not counted."""
        kube = Kube()
        base = lease_base(self.system, self.ns)
        deadline = time.monotonic() + self.seconds
        while (left := deadline - time.monotonic()) > 1:
            try:
                rv = kube.request("GET", base)["metadata"]["resourceVersion"]
                path = f"{base}?resourceVersion={rv}&timeoutSeconds={int(left)}&allowWatchBookmarks=false"
                for ev in kube.watch(path, timeout=left + 30):
                    self.event(ev)
            except Exception as e:  # noqa: BLE001 (counted and reported, not hidden)
                self.error = f"{type(e).__name__}: {e}"
            if deadline - time.monotonic() > 1:
                self.restarts += 1
                for runs in self.seen.values():
                    runs.append(BREAK)

    def event(self, ev: dict) -> None:
        if ev.get("type") == "ERROR":
            self.error = str(ev.get("object"))[:300]
            return
        if ev.get("type") not in ("ADDED", "MODIFIED"):
            return
        name, holder, renew = renewal(self.system, ev["object"])
        runs = self.seen.setdefault(name, [])
        if not runs or runs[-1] is BREAK or runs[-1][1:] != (holder, renew):
            runs.append((now_ns(), holder, renew))
        self.events += 1

    def pairs(self):
        """(lease, earlier, later) for consecutive renewals seen without a break between."""
        for name, runs in self.seen.items():
            for a, b in zip(runs, runs[1:]):
                if a is not BREAK and b is not BREAK:
                    yield name, a, b

    def latest(self, period_s: float, k: int = 5) -> list[dict]:
        """The `k` latest renewals: which lease, when (ns), how late (ms)."""
        gaps = [{"lease": name, "renew_time": b[2], "late_ms": round(gap_ms(a, b) - period_s * 1000, 1)}
                for name, a, b in self.pairs() if a[1] == b[1]]
        return sorted(gaps, key=lambda g: -g["late_ms"])[:k]

    def lateness_ms(self, period_s: float) -> tuple[list[float], int]:
        """Every gap between renewals past `period_s`, in ms (0 when on time); holder changes."""
        late, changes = [], 0
        for _, a, b in self.pairs():
            if a[1] != b[1]:
                changes += 1
                continue
            late.append(max(0.0, gap_ms(a, b) - period_s * 1000))
        return late, changes


def retry_of(system: str, args) -> float:
    return FAST_RETRY_S if system == FAST else args.retry


def candidates_cmd(system: str, args, ns: str) -> list[str]:
    if system == OURS:
        return [str(args.ours), "--namespace", ns, "--leases", str(args.n), "--candidates", str(args.candidates)]
    return [str(args.peer), "-kubeconfig", str(lib.kubeconfig()), "-namespace", ns, "-leases", str(args.n),
            "-candidates", str(args.candidates), "-lease-duration", f"{args.lease}s",
            "-renew-deadline", f"{args.lease * 2 // 3}s", "-retry-period", f"{retry_of(system, args)}s"]


def held(kube: Kube, system: str, ns: str) -> int:
    items = kube.request("GET", lease_base(system, ns)).get("items") or []
    return sum(1 for o in items if renewal(system, o)[1])


def baseline(kube: Kube, seconds: float) -> dict[str, float]:
    """Lease requests per second with no candidates running (the controller-manager's own)."""
    b0, t0 = lease_requests(kube, PEER), time.monotonic()
    time.sleep(seconds)
    b1, el = lease_requests(kube, PEER), time.monotonic() - t0
    return {v: (b1.get(v, 0) - b0.get(v, 0)) / el for v in b1}


def one_system(system: str, args, kube: Kube, work: Path, base: dict[str, float]) -> dict:
    if system == FAST:  # its own size: at 2.4 requests/s per lease, 1,000 would swamp 2 cores
        args = argparse.Namespace(**{**vars(args), "n": args.fast_n or args.n})
    ns = f"many-{system.replace('-', '')}-{lib.rand_suffix()}"
    kube.create_namespace(ns)
    names = [f"lease-{i}" for i in range(args.n)]
    if system == OURS:
        step(f"{system}: creating {args.n} FencedLeases ({args.lease} s)")
        for name in names:  # not held: the candidates campaign for them
            kube.request("POST", lease_base(system, ns), {
                "apiVersion": "fencedlease.io/v1alpha1", "kind": "FencedLease", "metadata": {"name": name},
                "spec": {"leaseDurationSeconds": args.lease}})
    step(f"{system}: starting {args.n}×{args.candidates} candidates in one process")
    p = lib.Proc(f"many-{system}", candidates_cmd(system, args, ns), work / "logs",
                 env={"KUBECONFIG": str(lib.kubeconfig()), "RUST_LOG": "warn"})
    try:
        t0 = time.monotonic()
        lib.wait_until(lambda: held(kube, system, ns) == args.n or not p.alive(),
                       60 + args.n / 20, f"every one of {args.n} leases held", interval=1)
        if not p.alive():
            raise SystemExit(f"the {system} candidates exited; see {p.logfile}")
        all_held_s = time.monotonic() - t0
        log(f"  all {args.n} leases held after {all_held_s:.1f} s; warm-up {args.lease} s")
        time.sleep(args.lease)
        return measure(system, args, kube, ns, p, base, all_held_s)
    finally:
        p.stop(timeout=30)
        try:
            kube.request("DELETE", f"/api/v1/namespaces/{ns}")
        except lib.ApiError:
            pass


def measure(system: str, args, kube: Kube, ns: str, p: lib.Proc, base: dict[str, float],
            all_held_s: float) -> dict:
    api, etcd = proc_pid("kube-apiserver"), proc_pid("etcd")
    if not api or not etcd:
        raise SystemExit(f"no pid files of the cluster in {lib.CLUSTER_DIR}/pids")
    step(f"{system}: measuring for {args.window} s")
    watch = Renewals(system, ns, args.window)
    watch.start()
    r0, t0 = lease_requests(kube, system), time.monotonic()
    c0 = {k: lib.cpu_seconds(pid) for k, pid in (("apiserver", api), ("etcd", etcd), ("candidates", p.pid))}
    rss: dict[str, list[float]] = {"apiserver": [], "etcd": [], "candidates": []}
    while time.monotonic() - t0 < args.window:
        for k, pid in (("apiserver", api), ("etcd", etcd), ("candidates", p.pid)):
            rss[k].append(rss_mib(pid))
        time.sleep(min(5.0, max(0.1, args.window - (time.monotonic() - t0))))
    el = time.monotonic() - t0
    cpu = {k: (lib.cpu_seconds(pid) - c0[k]) / el for k, pid in (("apiserver", api), ("etcd", etcd), ("candidates", p.pid))}
    watch.join(30)  # its watch ends at the window's end (timeoutSeconds): counted by then
    r1 = lease_requests(kube, system)
    for verb in ("LIST", "WATCH"):  # the harness's own lists and watches of the window
        r1[verb] = r1.get(verb, 0) - 1 - watch.restarts
    period = args.lease / RENEW_SHARE if system == OURS else retry_of(system, args)
    late, changes = watch.lateness_ms(period)
    own = {v: (r1.get(v, 0) - r0.get(v, 0)) / el for v in r1}
    if system != OURS:  # less the controller-manager's own lease traffic
        own = {v: max(0.0, r - base.get(v, 0)) for v, r in own.items()}
    own = {v: round(r, 2) for v, r in own.items() if r > 0.005}
    total = round(sum(own.values()), 2)
    log(f"  {system}: {total} lease requests/s ({own}); API server CPU {cpu['apiserver']:.3f} s/s; "
        f"renewal lateness p50 {lib.pct(late, 50) or 0:.0f} ms p99 {lib.pct(late, 99) or 0:.0f} ms over "
        f"{len(late)} gaps; {changes} holder changes")
    return {"namespace": ns, "leases": args.n, "candidates_per_lease": args.candidates,
            "window_s": round(el, 2), "all_held_s": round(all_held_s, 1),
            "requests_per_s": total, "requests_per_s_by_verb": own,
            "requests_per_s_per_lease": round(total / args.n, 4),
            "cpu_s_per_s": {k: round(v, 4) for k, v in cpu.items()},
            "rss_mib_median": {k: round(sorted(v)[len(v) // 2], 1) for k, v in rss.items() if v},
            "renewal_period_s": period, "renewal_gaps": len(late),
            "lateness_ms": stats(late), "lateness_p99_ci95_ms": lib.pct_ci(late, 99), "latest_renewals": watch.latest(period), "holder_changes": changes,
            "watch_events": watch.events, "watch_restarts": watch.restarts, "watch_error": watch.error}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1000, help="leases")
    ap.add_argument("--candidates", type=int, default=2, help="candidates per lease")
    ap.add_argument("--lease", type=int, default=15, help="lease duration, seconds")
    ap.add_argument("--retry", type=float, default=2.0, help="client-go's retry period, seconds")
    ap.add_argument("--fast", action=argparse.BooleanOptionalAction, default=True,
                    help=f"also client-go with a {FAST_RETRY_S} s retry period")
    ap.add_argument("--fast-n", type=int, default=None, help="leases for that one (default: --n)")
    ap.add_argument("--window", type=float, default=60.0, help="measured seconds")
    ap.add_argument("--baseline", type=float, default=20.0, help="seconds of the no-candidates baseline")
    ap.add_argument("--ours", type=Path, default=lib.BIN / "many_leases")
    ap.add_argument("--peer", type=Path, default=lib.CACHE / "many-peer")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    # One connection per fencedlease candidate's watch: room for them.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    kube = Kube()
    lib.install_crd()
    work = lib.WORK / f"many-{lib.rand_suffix()}"
    step(f"baseline: lease requests with no candidates, {args.baseline} s")
    base = baseline(kube, args.baseline)
    res = {"baseline_requests_per_s": {v: round(r, 3) for v, r in base.items() if r > 0}}
    for system in (OURS, PEER, *([FAST] if args.fast else [])):
        res[system] = one_system(system, args, kube, work, base)
    ours, peer = res[OURS]["requests_per_s"], res[PEER]["requests_per_s"]
    res["ours_share_of_peer_requests"] = round(ours / peer, 4) if peer else None
    log(f"fencedlease sends {res['ours_share_of_peer_requests']} of client-go's lease requests at N={args.n}")
    lib.write_result(args.out, "many-leases", {"benchmark": "many-leases", "args": vars(args) | {
        "ours": str(args.ours), "peer": str(args.peer), "out": str(args.out)}, **res})


if __name__ == "__main__":
    main()
