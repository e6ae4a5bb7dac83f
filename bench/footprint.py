"""Footprints (issue 21): what one sidecar costs, and what its API proxy adds to a write.

1. Sidecar RSS and CPU. One FencedLease and `--sidecars` sidecars (`fencedlease sidecar`, the
   command the injected container runs, here as processes on this machine with the bench
   cluster's kubeconfig): once one leads and every sidecar has been up for `--warmup` s, each
   process's CPU time (its threads' time on a CPU from /proc/PID/task/*/schedstat; utime + stime
   from /proc/PID/stat, at a 10 ms resolution, beside it) is read at the start and the end of a
   `--window` s idle window, and its resident memory (VmRSS, and the peak VmHWM) at the end,
   split into the process's own (RssAnon: heap, stacks) and the pages of files it maps (RssFile:
   its binary's code and data, clean and shared with other processes of the same file).
   Reported per role: the leader (renewing every lease/3) and the followers (watching). Nothing
   asks the sidecars anything during the window. With `--sidecar-binary`, the same again, after
   part 2, for that binary (the sidecar's build, `--no-default-features`: the workload-side
   commands alone) on a second FencedLease, then with `--keep-startup-memory` on a third (every
   sidecar otherwise gives back, 10 s after its start, the memory only start-up used:
   src/sidecar/memtrim.rs), and both binaries' sizes. The webhook runs the
   default binary throughout, so the default sidecars' PSS shares its file pages with one more
   process than the build's does; RSS is unaffected.
2. The API proxy's added latency. The leader sidecar runs with `--proxy-listen`; `--writes`
   merge patches of a protected ConfigMap (through the API server and the fencing webhook, the
   write an app makes) alternate between the two ways an app can send them: straight to the API
   server with the token it read from the sidecar's `/v1/token` stamped on by the app, and through
   the proxy, which stamps the token itself. Both on a keep-alive TLS connection (the proxy's
   certificate checked against the CA the sidecar writes, as the pod's kubeconfig does), one write
   at a time; the difference of the percentiles is what the proxy adds.
"""

from __future__ import annotations

import argparse
import http.client
import json
import ssl
import time
from pathlib import Path

import lib
from lib import Kube, log, now_ns, step
from percentiles import paired_figures

def start_sidecar(i: int, ns: str, lease: str, lease_s: int, workdir: Path, proxy_port: int | None,
                  binary: Path = lib.FENCEDLEASE, name: str = "sidecar",
                  extra: tuple[str, ...] = ()) -> tuple[lib.Proc, int]:
    port = lib.free_port()
    tokens = workdir / f"tokens-{name}-{i}"
    tokens.mkdir(parents=True, exist_ok=True)
    argv = [str(binary), "sidecar", "--lease", lease, "--namespace", ns, "--identity", f"{name}-{i}",
            "--listen", f"127.0.0.1:{port}", "--lease-duration", str(lease_s), "--token-dir", str(tokens)]
    if proxy_port:
        argv += ["--proxy-listen", f"127.0.0.1:{proxy_port}"]
    argv += list(extra)
    p = lib.Proc(f"{name}-{i}", argv, workdir / "logs",
                 env={"KUBECONFIG": str(lib.kubeconfig()), "RUST_LOG": "warn"})
    SECRETS[port] = tokens / "api-secret"
    if proxy_port:
        SECRETS[proxy_port] = tokens / "api-secret"
        PROXY_CAS[proxy_port] = tokens / "proxy-ca.crt"
    return p, port


#: The API secret file of the sidecar serving each port (its API and its proxy).
SECRETS: dict[int, Path] = {}
#: The CA each proxy's certificate is signed by (the sidecar writes it beside its kubeconfig).
PROXY_CAS: dict[int, Path] = {}


def auth(port: int) -> dict[str, str]:
    """The header that the pod's own containers send: the sidecar's API and proxy want it."""
    try:
        return {"Authorization": "Bearer " + SECRETS[port].read_text().strip()}
    except OSError:
        return {}


def status(port: int) -> dict:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        c.request("GET", "/v1/status", headers=auth(port))
        return json.loads(c.getresponse().read())
    finally:
        c.close()


def leader_of(sidecars: list[tuple[lib.Proc, int, int | None]]):
    for sc in sidecars:
        try:
            if status(sc[1]).get("leading"):
                return sc
        except (OSError, ValueError):
            pass
    return None


def measure_idle(sidecars, window: float) -> dict:
    """CPU over the window and RSS at its end, per role."""
    lead = leader_of(sidecars)
    if lead is None:
        raise RuntimeError("no sidecar leads")
    before = {p.pid: (lib.cpu_seconds(p.pid), lib.cpu_ns(p.pid)) for p, _, _ in sidecars}
    t0 = time.monotonic()
    time.sleep(window)
    elapsed = time.monotonic() - t0
    if leader_of(sidecars) is not lead:
        raise RuntimeError("the leader changed during the idle window")
    out: dict = {"window_s": elapsed, "leader": [], "follower": []}
    for p, _, _ in sidecars:
        if not p.alive():
            raise RuntimeError(f"{p.name} exited; see {p.logfile}")
        rss, hwm = p.rss_kib()
        split = lib.proc_status_kib(p.pid, "RssAnon", "RssFile")
        role = "leader" if p is lead[0] else "follower"
        ticks_s, sched_ns = before[p.pid]
        out[role].append({"name": p.name, "cpu_ms_per_s": (lib.cpu_ns(p.pid) - sched_ns) / 1e6 / elapsed,
                          "cpu_ms_per_s_ticks": (lib.cpu_seconds(p.pid) - ticks_s) * 1000 / elapsed,
                          "rss_mib": rss / 1024, "peak_rss_mib": hwm / 1024,
                          "rss_anon_mib": split["RssAnon"] / 1024, "rss_file_mib": split["RssFile"] / 1024,
                          **pss_mib(p.pid)})
    return out


def pss_mib(pid: int) -> dict[str, float]:
    """The proportional set: each page shared with other processes counted as a share (the
    binary's pages split between the sidecars that run the same file, as on a node where every
    sidecar runs the same image layer)."""
    k = lib.proc_status_kib(pid, "Pss", "Pss_Anon", "Pss_File", source="smaps_rollup")
    return {"pss_mib": k["Pss"] / 1024, "pss_anon_mib": k["Pss_Anon"] / 1024, "pss_file_mib": k["Pss_File"] / 1024}


def token_of(port: int) -> tuple[int, str]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    c.request("GET", "/v1/token", headers=auth(port))
    body = json.loads(c.getresponse().read())
    return body["token"], body["leaseUID"]


def measure_proxy(kube: Kube, ns: str, cm: str, api_port: int, proxy_port: int, writes: int, warmup: int,
                  out: Path) -> dict:
    """Protected writes in pairs, one straight to the API server and one through the proxy; the
    pairs where both succeeded are kept (out/samples/footprint-proxy.json.gz) and give every
    figure, the per-pair difference included."""
    path = f"/api/v1/namespaces/{ns}/configmaps/{cm}"
    # The API server may have closed the keep-alive connection during the idle window: a read
    # (which reconnects) first, so that no timed write pays for a new connection.
    kube.request("GET", path)
    token, uid = token_of(api_port)
    # The proxy speaks TLS, as the API server does: both ways pay for encryption, the handshake
    # happens once per keep-alive connection, before the first (warm-up) write.
    tls = ssl.create_default_context(cafile=str(PROXY_CAS[proxy_port]))
    proxy = http.client.HTTPSConnection("127.0.0.1", proxy_port, timeout=10, context=tls)
    proxy_headers = {"Content-Type": "application/merge-patch+json", **auth(proxy_port)}
    lat: dict[str, list[float]] = {"direct": [], "proxy": []}
    codes: dict[str, dict[int, int]] = {"direct": {}, "proxy": {}}
    for i in range(warmup + writes):
        pair = {}
        for way in ("direct", "proxy"):
            data = {"data": {"n": str(i), "way": way}}
            if way == "direct":
                data["metadata"] = {"annotations": {"fencedlease.io/token": str(token), "fencedlease.io/lease-uid": uid,
                                                    "fencedlease.io/write-id": f"{now_ns()}-{i}"}}
                code, ns_ = kube.timed("PATCH", path, data, "application/merge-patch+json")
            else:
                body = json.dumps(data).encode()
                t0 = time.perf_counter_ns()
                proxy.request("PATCH", path, body=body, headers=proxy_headers)
                r = proxy.getresponse()
                r.read()
                code, ns_ = r.status, time.perf_counter_ns() - t0
            if i >= warmup:
                codes[way][code] = codes[way].get(code, 0) + 1
                if code == 200:
                    pair[way] = ns_ / 1e6
        if len(pair) == 2:
            for way, ms in pair.items():
                lat[way].append(ms)
    proxy.close()
    res = proxy_figures(lat)
    res.update(writes_per_way=writes, codes={w: {str(k): v for k, v in c.items()} for w, c in codes.items()},
               raw_samples=lib.keep_samples(out, "samples/footprint-proxy.json.gz", lat))
    return res


def proxy_figures(lat: dict[str, list[float]]) -> dict:
    """The proxy's figures from the paired samples {"direct": [...], "proxy": [...]}."""
    f = paired_figures(lat["proxy"], lat["direct"])
    f["latency_ms"] = {"direct": f["latency_ms"]["b"], "proxy": f["latency_ms"]["a"]}
    return f


def setup(kube: Kube, ns: str, lease: str, cm: str, lease_s: int, workdir: Path) -> lib.Proc:
    """The FencedLease, its protected ConfigMap, and the fencing webhook for the namespace."""
    kube.request("POST", lib.fl_path(ns), {"apiVersion": "fencedlease.io/v1alpha1", "kind": "FencedLease",
                                           "metadata": {"name": lease}, "spec": {"leaseDurationSeconds": lease_s}})
    kube.request("POST", f"/api/v1/namespaces/{ns}/configmaps", {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": cm, "labels": {"fencedlease.io/lease": lease}}, "data": {}})
    wh, port, _, bundle = lib.start_webhook(f"webhook-{ns}", workdir / "logs", workdir / "certs")
    lib.register_webhook(kube, f"fencedlease-bench-{ns}", port, bundle, ns)
    lib.wait_webhook_effective(kube, ns)
    return wh


# The sidecar's build as it runs (it gives back start-up's memory, src/sidecar/memtrim.rs), and with
# --keep-startup-memory: what that gives back.
BUILD_PARTS = (("idle_sidecar_build", "sidecar-build", ()),
               ("idle_sidecar_build_kept", "sidecar-build-kept", ("--keep-startup-memory",)))


def measure_build(kube: Kube, ns: str, args, workdir: Path, name: str, extra: tuple[str, ...]) -> dict:
    """Part 1 again for the sidecar's build, on a FencedLease of its own."""
    lease = f"footprint-{name}"
    kube.request("POST", lib.fl_path(ns), {"apiVersion": "fencedlease.io/v1alpha1", "kind": "FencedLease",
                                           "metadata": {"name": lease}, "spec": {"leaseDurationSeconds": args.lease}})
    step(f"footprint: {args.sidecars} sidecars of the sidecar's build ({args.sidecar_binary}) "
         f"{' '.join(extra)}, {args.window:.0f} s idle window")
    sidecars = []
    for i in range(args.sidecars):
        pp = lib.free_port()
        p, port = start_sidecar(i, ns, lease, args.lease, workdir, pp, args.sidecar_binary, name, extra)
        sidecars.append((p, port, pp))
    try:
        lib.wait_until(lambda: leader_of(sidecars), 3 * args.lease + 30, "a leading sidecar", interval=0.2)
        time.sleep(args.warmup)
        idle = measure_idle(sidecars, args.window)
    finally:
        lib.stop_all([p for p, _, _ in sidecars])
    for role in ("leader", "follower"):
        for r in idle[role]:
            log(f"footprint: {name}, {role} {r['name']}: {r['cpu_ms_per_s']:.3f} ms CPU/s, "
                f"RSS {r['rss_mib']:.1f} MiB (peak {r['peak_rss_mib']:.1f})")
    return idle


def binaries(sidecar_binary: Path | None) -> dict:
    """Each measured binary's path and size (its code is most of a sidecar's RSS)."""
    out = {"default": {"path": str(lib.FENCEDLEASE), "bytes": lib.FENCEDLEASE.stat().st_size}}
    if sidecar_binary:
        out["sidecar_build"] = {"path": str(sidecar_binary), "bytes": sidecar_binary.stat().st_size}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sidecars", type=int, default=3)
    ap.add_argument("--lease", type=int, default=15)
    ap.add_argument("--warmup", type=float, default=20, help="seconds every sidecar runs before the window")
    ap.add_argument("--window", type=float, default=120, help="idle window, seconds")
    ap.add_argument("--writes", type=int, default=2000, help="writes per way (direct, proxy)")
    ap.add_argument("--writes-warmup", type=int, default=50)
    ap.add_argument("--sidecar-binary", type=Path, help="the sidecar's build, measured idle like the default one")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    kube = Kube()
    lib.install_crd()
    ns = f"bench-footprint-{lib.rand_suffix()}"
    kube.create_namespace(ns)
    workdir = lib.WORK / ns
    lease, cm = "footprint", "protected"
    step(f"footprint: {args.sidecars} sidecars on one lease ({args.lease} s), {args.window:.0f} s idle window; "
         f"then {args.writes} writes each way, direct and through the proxy; namespace {ns}")
    wh = setup(kube, ns, lease, cm, args.lease, workdir)
    sidecars = []
    for i in range(args.sidecars):
        pp = lib.free_port()
        p, port = start_sidecar(i, ns, lease, args.lease, workdir, pp)
        sidecars.append((p, port, pp))
    lib.wait_until(lambda: leader_of(sidecars), 3 * args.lease + 30, "a leading sidecar", interval=0.2)
    time.sleep(args.warmup)
    idle = measure_idle(sidecars, args.window)
    for role in ("leader", "follower"):
        for r in idle[role]:
            log(f"footprint: {role} {r['name']}: {r['cpu_ms_per_s']:.3f} ms CPU/s, RSS {r['rss_mib']:.1f} MiB "
                f"(peak {r['peak_rss_mib']:.1f})")
    lead = leader_of(sidecars)
    step(f"footprint: {args.writes} + {args.writes_warmup} writes each way through {lead[0].name}")
    proxy = measure_proxy(kube, ns, cm, lead[1], lead[2], args.writes, args.writes_warmup, args.out)
    log(f"footprint: proxy adds p50 {proxy['added_ms'].get('p50', float('nan')):.2f} ms, "
        f"p99 {proxy['added_ms'].get('p99', float('nan')):.2f} ms per write (codes {proxy['codes']})")
    lib.stop_all([p for p, _, _ in sidecars])
    builds, build_error = {}, None
    for key, name, extra in BUILD_PARTS if args.sidecar_binary else ():
        try:
            builds[key] = measure_build(kube, ns, args, workdir, name, extra)
        except (RuntimeError, OSError, TimeoutError) as e:
            build_error = f"the sidecar's build ({name}): {e}"
            break
    lib.stop_all([wh])
    kube.request("DELETE", f"/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/fencedlease-bench-{ns}",
                 ok=(200, 404))
    out = {"benchmark": "footprint",
           "config": {"sidecars": args.sidecars, "lease_s": args.lease, "warmup_s": args.warmup,
                      "window_s": args.window, "writes_per_way": args.writes, "writes_warmup": args.writes_warmup},
           "idle": idle, "proxy": proxy, "binaries": binaries(args.sidecar_binary)}
    out.update(builds)
    if build_error:
        out["error"] = build_error
    lib.write_result(args.out, "footprint", out)
    if build_error:
        raise SystemExit(f"footprint: {build_error}")
    bad = [w for w, c in proxy["codes"].items() if set(c) != {"200"}]
    if bad:
        raise SystemExit(f"footprint: writes other than 200 for {bad}: {proxy['codes']}")


if __name__ == "__main__":
    main()
