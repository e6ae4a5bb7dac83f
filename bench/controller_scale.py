"""Controller scale (issue 9, item 6): N FencedLeases in one namespace, each held (by a holder
that does not renew: leaseDurationSeconds 3600, so nothing expires during the run), then:

- cold start: `fencedlease controller` started; time until it is the active replica and until it
  has reconciled N leases (its own counter fencedlease_controller_reconciles_total{result="ok"}),
  then checked with a LIST that every lease's status.observedGeneration is current;
- resident memory (VmRSS, and the peak VmHWM) after that and after 10 s more;
- idle CPU: the controller's CPU over --idle-window s with the N leases idle (nothing expires,
  nothing renews), and how many reconciles it ran meanwhile (none expected);
- restart: SIGTERM (it releases its election lease), start again, time until it reconciled all;
- expiry notice: with the N leases present, a probe lease is created held with a 3 s lease and
  never renewed; the time from (creation + 3 s) to the moment a poll (every 10 ms) sees the
  controller's revocation.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import lib
from lib import FENCEDLEASE, Kube, log, now_ns, stats, step


def ok_count(mport: int) -> tuple[float, float, float]:
    try:
        text = lib.http_get(mport, "/metrics")
    except OSError:
        return 0, 0, 0
    rec = lib.metric_values(text, "fencedlease_controller_reconciles_total")
    ok = rec.get('{result="ok"}', 0)
    err = sum(v for k, v in rec.items() if k != '{result="ok"}')
    leading = lib.metric_values(text, "fencedlease_controller_leading").get("", 0)
    return ok, err, leading


def start_controller(ns: str, ctl_ns: str, ident: str, work: Path) -> tuple[lib.Proc, int]:
    mport = lib.free_port()
    p = lib.Proc(ident, [str(FENCEDLEASE), "controller", "--namespace", ns,
                         "--election-namespace", ctl_ns, "--identity", ident,
                         "--metrics-addr", f"127.0.0.1:{mport}"],
                 work / "logs", env={"KUBECONFIG": str(lib.kubeconfig()), "RUST_LOG": "warn"})
    return p, mport


def wait_reconciled(p: lib.Proc, mport: int, n: int, t0: float, timeout: float, label: str) -> dict:
    t_lead = None
    next_log = 10.0
    while True:
        ok, err, leading = ok_count(mport)
        el = time.monotonic() - t0
        if leading and t_lead is None:
            t_lead = el
        if ok >= n:
            return {"active_after_s": t_lead, "reconciled_after_s": el, "reconciles_ok": ok,
                    "reconcile_errors": err}
        if not p.alive():
            raise RuntimeError(f"the controller exited; see {p.logfile}")
        if el > timeout:
            raise TimeoutError(f"{label}: only {ok:.0f}/{n} reconciled after {timeout:.0f} s")
        if el >= next_log:
            log(f"  {label}: {ok:.0f}/{n} reconciled, {err:.0f} errors ({el:.0f} s)")
            next_log += 10
        time.sleep(0.1)


def idle_cpu(p: lib.Proc, mport: int, window: float) -> dict:
    """The controller's CPU while its N leases are idle (held, an hour from expiry, no pods): the
    scheduler's time of its threads over the window, ticks beside it, and the reconciles it ran."""
    ok0, err0, _ = ok_count(mport)
    ns0, ticks0, t0 = lib.cpu_ns(p.pid), lib.cpu_seconds(p.pid), time.monotonic()
    time.sleep(window)
    ns1, ticks1, el = lib.cpu_ns(p.pid), lib.cpu_seconds(p.pid), time.monotonic() - t0
    ok1, err1, _ = ok_count(mport)
    return {"window_s": el, "cpu_ms_per_s": (ns1 - ns0) / 1e6 / el,
            "cpu_ms_per_s_ticks": (ticks1 - ticks0) * 1000 / el,
            "reconciles": ok1 - ok0, "reconcile_errors": err1 - err0}


def all_current(kube: Kube, ns: str, n: int) -> int:
    """How many leases have status.observedGeneration == metadata.generation (paged LIST)."""
    count, cont = 0, ""
    while True:
        q = "?limit=2000" + (f"&continue={cont}" if cont else "")
        lst = kube.request("GET", lib.fl_path(ns) + q)
        for o in lst["items"]:
            if (o.get("status") or {}).get("observedGeneration") == o["metadata"].get("generation"):
                count += 1
        cont = lst["metadata"].get("continue")
        if not cont:
            return count


def expiry_probe(kube: Kube, ns: str, k: int, duration: int) -> dict:
    name = f"probe-{k}"
    body = {"apiVersion": "fencedlease.io/v1alpha1", "kind": "FencedLease",
            "metadata": {"name": name},
            "spec": {"holderIdentity": "ghost", "leaseDurationSeconds": duration}}
    kube.request("POST", lib.fl_path(ns), body)
    t_created = now_ns()
    expiry = t_created + duration * 1_000_000_000

    def revoked():
        o = kube.request("GET", lib.fl_path(ns, name))
        return not (o.get("spec") or {}).get("holderIdentity")

    lib.wait_until(revoked, duration + 60, f"the revocation of {name}", interval=0.01)
    t_seen = now_ns()
    return {"probe": name, "lease_s": duration, "noticed_after_expiry_s": (t_seen - expiry) / 1e9}


def run_one(n: int, args, kube: Kube) -> dict:
    sfx = lib.rand_suffix()
    ns, ctl_ns = f"bench-scale-{n}-{sfx}", f"bench-scale-ctl-{n}-{sfx}"
    kube.create_namespace(ns)
    kube.create_namespace(ctl_ns)
    work = lib.WORK / ns
    step(f"controller scale N={n}: creating {n} held FencedLeases")
    create_s = lib.create_leases(kube, ns, [f"lease-{i:05d}" for i in range(n)])
    res: dict = {"n": n, "create_s": create_s}
    step(f"controller scale N={n}: cold start")
    t0 = time.monotonic()
    p, mport = start_controller(ns, ctl_ns, "ctl-1", work)
    procs = [p]
    try:
        res["cold"] = wait_reconciled(p, mport, n, t0, args.timeout, "cold start")
        res["cold"]["status_current"] = lib.wait_until(
            lambda: (c := all_current(kube, ns, n)) >= n and c, args.timeout,
            "every status to be current", interval=1.0)
        res["cold"]["status_current_after_s"] = time.monotonic() - t0
        res["cold"]["rss_mib"], res["cold"]["peak_rss_mib"] = [x / 1024 for x in p.rss_kib()]
        time.sleep(10)
        res["steady_rss_mib"] = p.rss_kib()[0] / 1024
        log(f"  cold: active after {res['cold']['active_after_s']:.2f} s, {n} reconciled after "
            f"{res['cold']['reconciled_after_s']:.2f} s; RSS {res['steady_rss_mib']:.1f} MiB "
            f"(peak {res['cold']['peak_rss_mib']:.1f} MiB)")
        step(f"controller scale N={n}: {args.idle_window:.0f} s idle")
        res["idle"] = idle_cpu(p, mport, args.idle_window)
        log(f"  idle: {res['idle']['cpu_ms_per_s']:.3f} ms of CPU per s, "
            f"{res['idle']['reconciles']:.0f} reconciles in {args.idle_window:.0f} s")

        step(f"controller scale N={n}: restart")
        p.signal(15)
        lib.wait_until(lambda: not p.alive(), 30, "the controller to stop")
        t0 = time.monotonic()
        p, mport = start_controller(ns, ctl_ns, "ctl-2", work)
        procs.append(p)
        res["restart"] = wait_reconciled(p, mport, n, t0, args.timeout, "restart")
        res["restart"]["rss_mib"], res["restart"]["peak_rss_mib"] = [x / 1024 for x in p.rss_kib()]
        log(f"  restart: active after {res['restart']['active_after_s']:.2f} s, {n} reconciled "
            f"after {res['restart']['reconciled_after_s']:.2f} s")

        step(f"controller scale N={n}: {args.probes} expiry probe(s) of {args.probe_lease} s")
        probes = [expiry_probe(kube, ns, k, args.probe_lease) for k in range(args.probes)]
        res["expiry_probes"] = probes
        res["expiry_noticed_s"] = stats([x["noticed_after_expiry_s"] for x in probes])
        res["final_rss_mib"], res["final_peak_rss_mib"] = [x / 1024 for x in p.rss_kib()]
        log(f"  expiry noticed after {res['expiry_noticed_s']['p50']:.3f} s (median), "
            f"max {res['expiry_noticed_s']['max']:.3f} s; RSS {res['final_rss_mib']:.1f} MiB")
    finally:
        lib.stop_all(procs)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--probes", type=int, default=5)
    ap.add_argument("--probe-lease", type=int, default=3)
    ap.add_argument("--idle-window", type=float, default=60,
                    help="seconds over which the controller's CPU is measured with N idle leases")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    kube = Kube()
    lib.install_crd()
    started = time.monotonic()
    runs = [run_one(n, args, kube) for n in args.n]
    lib.write_result(args.out, "controller-scale", {
        "benchmark": "controller-scale",
        "config": {"n": args.n, "probes": args.probes, "probe_lease_s": args.probe_lease,
                   "idle_window_s": args.idle_window},
        "wall_s": time.monotonic() - started, "runs": runs})


if __name__ == "__main__":
    main()
