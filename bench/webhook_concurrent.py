"""The webhook at concurrency (issue 21): W writers at once through the API server, each with
its own connection and its own ConfigMaps, each writing in turn a protected one (current token:
allowed, after the webhook's fresh read of the lease), a plain one (no webhook) and a stale one
(its lease moved on: refused, 403). The writers are benches/apiserver_writers.rs (one thread per
writer, blocking HTTPS/1.1), so that Python's interpreter is not what is timed.

The webhook is registered as the chart registers it, by a Service: the API server then calls it
over HTTP/1.1 (Kubernetes does so for Service references, to spread calls over replicas), one
connection per call in flight, and, with --enable-aggregator-routing (as the bench cluster runs,
having no kube-proxy), picks an endpoint of the Service for each call. The Service has no
selector; one EndpointSlice per replica names this machine's non-loopback address and the
replica's port. With 2 replicas the calls are spread over two webhook processes.

Reported per (replicas, writers): each kind's p50/p90/p99/p99.9, the added latency (protected
minus plain, refused minus plain, difference of the percentiles) with a 95 % bootstrap interval
of the added p99, the ratio of the protected write's p99 to the plain write's (the same writers,
in turn, so the same load) with its interval, every status code counted (an answer other than the expected one is a failed
write, counted, never dropped), the API server's own timing of its calls to the webhook, and
how the calls were spread over the replicas (each replica's own admission counter), and how
long the webhook's fresh reads took (its own histogram, fencedlease_webhook_fresh_read_seconds).
`--paced-rate half` paces the second run of each setting at half the rate its writers reached
back to back (the saturating rate, measured just before): a load the API server carries with
room to spare, neither one writer's nor saturation's, where the ratio targets are judged.
`--fence policy` (the result policy-concurrent): the same writers in a namespace the chart's
fencing policy judges (policy mode; its index written by the bench, as the controller would),
no webhook: the policy's ratio beside the webhook's, in the same conditions.
Before the writers, the lease's read alone on the idle API server (--lease-reads): as the
webhook sends it (a quorum read) and from the API server's watch cache, for the floor of the
read every allow waits for.

With `--reads shared per-request`, each replica count runs twice against the same cluster and
namespace: once as the webhook runs (concurrent writes of one lease share the next fresh read,
src/webhook/coalesce.rs), once with `--no-shared-reads` (every write sends a read of its own), so
that what sharing saves or costs is measured in the same conditions; each run says which.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import lib
from lib import BIN, Kube, log, stats, step
from percentiles import ratio_ci
from webhook_bench import apiserver_webhook_histogram, buckets, held_lease, hist_quantile, webhook_call_ms
import policy_bench

WRITERS = Path(os.environ.get("FL_BENCH_WRITERS", BIN / "apiserver_writers"))
SERVICE = "fencedlease-bench-webhook"
KINDS = ("protected", "plain", "stale")


def host_address() -> str:
    """This machine's address on the interface a packet to a non-local address would leave by
    (no packet is sent): the API server must call the webhook at a non-loopback address, since
    it keeps HTTP/2 for webhooks on localhost."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.254", 9))
        addr = s.getsockname()[0]
    if addr.startswith("127."):
        raise SystemExit("this machine has no non-loopback IPv4 address for the webhook to "
                         "listen on; the API server would speak HTTP/2 to a loopback one")
    return addr


def create_configmaps(kube: Kube, ns: str, writers: int, ann: dict, stale_ann: dict) -> None:
    cms = f"/api/v1/namespaces/{ns}/configmaps"
    for w in range(writers):
        for kind, labels, a in (("protected", {"fencedlease.io/lease": "inventory"}, ann),
                                ("plain", {}, ann),
                                ("stale", {"fencedlease.io/lease": "moved"}, stale_ann)):
            kube.request("POST", cms, {"apiVersion": "v1", "kind": "ConfigMap",
                                       "metadata": {"name": f"{kind}-{w}", "annotations": a,
                                                    "labels": labels},
                                       "data": {"n": "0"}})


def register_by_service(kube: Kube, ns: str, addr: str, ports: list[int], bundle: str) -> str:
    """A selector-less Service with one EndpointSlice per replica, and the webhook registered by
    that Service (as the chart does). Returns the configuration's name."""
    kube.request("POST", f"/api/v1/namespaces/{ns}/services", {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": SERVICE},
        "spec": {"ports": [{"name": "https", "port": 443, "targetPort": 443}]}})
    for i, port in enumerate(ports):
        kube.request("POST", f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", {
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": f"{SERVICE}-{i}", "labels": {"kubernetes.io/service-name": SERVICE}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [addr], "conditions": {"ready": True}}],
            "ports": [{"name": "https", "port": port, "protocol": "TCP"}]})
    name = f"fencedlease-bench-{ns}"
    lib.register_webhook(kube, name, None, bundle, ns, service={
        "namespace": ns, "name": SERVICE, "port": 443, "path": "/validate"})
    return name


def unregister(kube: Kube, ns: str, name: str) -> None:
    kube.request("DELETE", f"/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{name}",
                 ok=(200, 404))
    kube.request("DELETE", f"/api/v1/namespaces/{ns}/services/{SERVICE}", ok=(200, 404))
    kube.request("DELETE", f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
                 f"?labelSelector=kubernetes.io/service-name={SERVICE}", ok=(200, 404))


COUNTERS = ("fencedlease_webhook_admissions_total", "fencedlease_webhook_connections_accepted_total",
            "fencedlease_webhook_connections_refused_total",
            "fencedlease_webhook_connections_closed_total", "fencedlease_webhook_fresh_reads_total",
            "fencedlease_webhook_fresh_reads_shared_total")
# The counters that say what the webhook read (src/webhook/coalesce.rs), apart from its connections.
READ_COUNTERS = ("admissions", "fresh_reads")


def counters(text: str) -> dict[str, float]:
    """A replica's admissions, its fresh reads (sent, and shared by several writes), its
    connections accepted by protocol (what ALPN chose), and refused and closed by reason, from
    its metrics page."""
    out = {}
    for name in COUNTERS:
        for labels, v in lib.metric_values(text, name).items():
            out[name.removeprefix("fencedlease_webhook_").removesuffix("_total") + labels] = v
    return out


# What the webhook's fresh reads read (fencedlease_webhook_fresh_read_seconds{object}); a /scale
# read ("scaled") does not happen here.
READ_OBJECTS = ("lease", "namespace")


def read_histograms(pages: list[str]) -> dict[str, dict[float, float]]:
    """The replicas' fresh-read histograms, by object, their buckets summed over the replicas'
    metrics pages."""
    out: dict[str, dict[float, float]] = {o: {} for o in READ_OBJECTS}
    for text in pages:
        for o in READ_OBJECTS:
            for le, n in buckets(text, "fencedlease_webhook_fresh_read_seconds", (f'object="{o}"',)).items():
                out[o][le] = out[o].get(le, 0) + n
    return out


def read_ms(before: dict[str, dict[float, float]], after: dict[str, dict[float, float]]) -> dict:
    """Per object, the reads between two readings and their p50/p90/p99 in ms: the upper bound of
    the bucket that holds each (buckets 50 us x 1.25^k, src/webhook/mod.rs FRESH_READ_BUCKETS)."""
    out = {}
    for o in READ_OBJECTS:
        a, b = after[o], before[o]
        n = a.get(float("inf"), 0) - b.get(float("inf"), 0)
        if n <= 0:
            continue
        out[o] = {"reads": int(n)}
        for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
            v = hist_quantile(b, a, q)
            out[o][name] = None if v is None or v == float("inf") else v * 1e3
    return out


def read_line(read_times: dict) -> str:
    """The fresh reads' times for the log."""
    if not read_times:
        return "no fresh read timed"
    return "the webhook's fresh reads, p50 / p99 (ms, bucket bounds): " + ", ".join(
        f"{o} {v['p50']:.2f} / {v['p99']:.2f}" if v.get("p99") else f"{o} (over the largest bucket)"
        for o, v in read_times.items())


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def stats999(ms: list[float]) -> dict:
    s = stats(ms)
    if ms:
        s["p999"] = lib.pct(ms, 99.9)
    return s


def run_writers(args, kube: Kube, ns: str, writers: int, ann: dict, stale_ann: dict,
                work: Path, mports: list[int], rate: float | None, reads: str) -> dict:
    """One run of the writers: back to back (rate None) or paced at `rate` writes/s in all."""
    token = work / "token"
    token.write_text(lib.admin_token())
    writes = args.paced_writes if rate else args.writes
    out = work / f"writers-{len(mports)}-{writers}-{rate or 'closed'}.json"
    pages0 = [lib.http_get(p, "/metrics") for p in mports]
    counts0 = [counters(page) for page in pages0]
    reads0 = read_histograms(pages0)
    api_before = apiserver_webhook_histogram(kube.request("GET", "/metrics"))
    argv = [str(WRITERS), "--server", f"https://127.0.0.1:{lib.API_PORT}", "--ca", str(lib.ca_file()),
            "--token-file", str(token), "--namespace", ns, "--writers", str(writers),
            "--writes", str(writes), "--warmup", str(args.warmup), "--rate", str(rate or 0),
            "--annotations", json.dumps(ann), "--stale-annotations", json.dumps(stale_ann),
            "--out", str(out)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout)
    if r.returncode != 0:
        raise RuntimeError(f"apiserver_writers failed ({r.returncode}): {r.stderr[-2000:]}")
    raw = json.loads(out.read_text())
    api_after = apiserver_webhook_histogram(kube.request("GET", "/metrics"))
    pages = [lib.http_get(p, "/metrics") for p in mports]
    per_replica = [delta(counters(page), c) for page, c in zip(pages, counts0)]
    read_times = read_ms(reads0, read_histograms(pages))
    spread = [sum(v for k, v in r.items() if k.startswith("admissions")) for r in per_replica]
    ms = {k: [v / 1e6 for v in raw["kinds"][k]["ns"]] for k in KINDS}
    s = {k: stats999(ms[k]) for k in KINDS}
    diff = {k: {q: s[k][q] - s["plain"][q] for q in ("p50", "p90", "p99", "p999", "mean")}
            for k in ("protected", "stale")}
    expected = {"protected": "200", "plain": "200", "stale": "403"}
    failed = {k: sum(n for code, n in raw["kinds"][k]["status"].items() if code != expected[k])
              for k in KINDS}
    res = {"replicas": len(mports), "writers": writers, "writes_each": writes, "rate": rate,
           "reads": reads,
           "p99_ratio": s["protected"]["p99"] / s["plain"]["p99"] if s["plain"].get("p99") else None,
           "p99_ratio_ci95": ratio_ci(ms["protected"], ms["plain"], 99),
           "wall_s": raw["wall_s"], "writes_per_s": 3 * writers * (writes + args.warmup) / raw["wall_s"],
           "ms": s, "added_ms": diff["protected"], "refused_added_ms": diff["stale"],
           "added_p99_ci95_ms": lib.bootstrap_ci(ms["protected"], ms["plain"], 99),
           "refused_added_p99_ci95_ms": lib.bootstrap_ci(ms["stale"], ms["plain"], 99),
           "status": {k: raw["kinds"][k]["status"] for k in KINDS}, "failed": failed,
           "first_unexpected": {k: raw["kinds"][k]["first_unexpected"] for k in KINDS},
           "apiserver_webhook_call_ms": webhook_call_ms(api_before, api_after),
           "fresh_read_ms": read_times, "reviews_per_replica": spread, "replica_counters": per_replica}
    res["raw_samples"] = lib.keep_samples(
        args.out, f"{args.name}-raw/r{len(mports)}-w{writers}-{rate or 'closed'}-{reads}.json.gz", ms,
        {"apiserver_webhook_call": {"before": lib.hist_json(api_before), "after": lib.hist_json(api_after)}})
    log(f"  {len(mports)} replica(s), {writers} writers, {f'paced at {rate:g}/s' if rate else 'back to back'}, "
        f"reads {reads}: "
        f"{res['writes_per_s']:.0f} writes/s; "
        f"allowed p50 {s['protected']['p50']:.2f} p99 {s['protected']['p99']:.2f} ms, plain p50 "
        f"{s['plain']['p50']:.2f} p99 {s['plain']['p99']:.2f} ms, refused p99 {s['stale']['p99']:.2f} ms; "
        f"added p50 {diff['protected']['p50']:.2f} p99 {diff['protected']['p99']:.2f} ms "
        f"(95 % {res['added_p99_ci95_ms'][0]:.2f}-{res['added_p99_ci95_ms'][1]:.2f}); failed {failed}; "
        f"reviews per replica {[int(x) for x in spread]}; {read_line(read_times)}; fresh reads sent, shared: "
        f"{[(int(r.get('fresh_reads', 0)), int(r.get('fresh_reads_shared', 0))) for r in per_replica]}; "
        f"connections accepted, refused or closed: "
        f"{[{k: int(v) for k, v in r.items() if not k.startswith(READ_COUNTERS)} for r in per_replica]}")
    return res


def lease_reads(kube: Kube, ns: str, lease: str, n: int) -> dict:
    """The read every allow waits for, alone on the idle API server: n GETs of the lease without a
    resourceVersion (what the webhook sends: a quorum read from etcd) and n with resourceVersion=0
    (served from the API server's watch cache, which may lag), alternating, one after another on
    this process's keep-alive connection; ms per GET, this Python client's own time included."""
    path = lib.fl_path(ns, lease)
    ms: dict[str, list[float]] = {"quorum": [], "cache": []}
    for _ in range(n):
        for kind, query in (("quorum", ""), ("cache", "?resourceVersion=0")):
            t = time.perf_counter()
            kube.request("GET", path + query)
            ms[kind].append((time.perf_counter() - t) * 1e3)
    out = {"gets_each": n, **{k: stats999(v) for k, v in ms.items()},
           "quorum_minus_cache_p50_ci95_ms": lib.bootstrap_ci(ms["quorum"], ms["cache"], 50),
           "quorum_minus_cache_p99_ci95_ms": lib.bootstrap_ci(ms["quorum"], ms["cache"], 99)}
    log(f"  a GET of the lease, {n} each, idle: quorum p50 {out['quorum']['p50']:.2f} p99 "
        f"{out['quorum']['p99']:.2f} ms; from the watch cache p50 {out['cache']['p50']:.2f} p99 "
        f"{out['cache']['p99']:.2f} ms")
    return out


def writer_runs(args, kube: Kube, ns: str, ann: dict, stale_ann: dict, work: Path, mports: list[int],
                reads: str, label: str) -> list[dict]:
    """Each number of writers back to back, then (with --paced-rate) paced."""
    runs = []
    for writers in args.writers:
        for rate in [None] + ([args.paced_rate] if args.paced_rate else []):
            if rate == "half":  # half the rate these writers reached back to back, just now
                saturated = runs[-1]["writes_per_s"]
                rate = round(saturated / 2, 1)
            step(f"{label}, {writers} writers x {args.paced_writes if rate else args.writes} rounds of 3 writes "
                 f"(+{args.warmup} warm-up), " + (f"paced at {rate:g} writes/s in all" if rate else "back to back"))
            runs.append(run_writers(args, kube, ns, writers, ann, stale_ann, work, mports, rate, reads))
            if rate and args.paced_rate == "half":
                runs[-1]["rate_basis"] = {"half_of_writes_per_s": saturated}
    return runs


def policy_setup(args, kube: Kube, ns: str, ann: dict, stale_ann: dict, work: Path) -> list[dict]:
    """The chart's policies judge the namespace (no webhook): the same writers."""
    name = policy_bench.install_policy(kube, "bench", ns, work / "policy")
    try:
        policy_bench.index(kube, ns, ["inventory", "moved"])
        policy_bench.switch(kube, ns, "inventory", "policy")
        return writer_runs(args, kube, ns, ann, stale_ann, work, [], "policy", "the fencing policy")
    finally:
        policy_bench.remove_policy(kube, name)


def one_setup(args, kube: Kube, ns: str, replicas: int, ann: dict, stale_ann: dict,
              work: Path, addr: str, reads: str) -> list[dict]:
    certs = work / "certs"
    procs, ports, mports, bundle = [], [], [], ""
    extra = ["--no-shared-reads"] if reads == "per-request" else []
    try:
        for i in range(replicas):
            p, port, mport, bundle = lib.start_webhook(
                f"webhook-concurrent-{replicas}-{reads}-{i}", work / "logs", certs, host=addr,
                extra_args=extra, cert_names=[f"{SERVICE}.{ns}.svc"])
            procs.append(p)
            ports.append(port)
            mports.append(mport)
        name = register_by_service(kube, ns, addr, ports, bundle)
        try:
            lib.wait_webhook_effective(kube, ns)
            return writer_runs(args, kube, ns, ann, stale_ann, work, mports, reads,
                               f"webhook at concurrency: {replicas} replica(s), reads {reads}")
        finally:
            unregister(kube, ns, name)
    finally:
        lib.stop_all(procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--writers", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--writes", type=int, default=300, help="measured rounds per writer")
    ap.add_argument("--warmup", type=int, default=10, help="warm-up rounds per writer")
    ap.add_argument("--paced-rate", type=lambda v: v if v == "half" else float(v),
                    help="also a run with all writers together pacing to this many writes/s, or `half`: "
                         "half the rate the same writers reached back to back")
    ap.add_argument("--paced-writes", type=int, default=100, help="measured rounds per writer when paced")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one writers' run may take")
    ap.add_argument("--reads", nargs="+", choices=("shared", "per-request"), default=["shared"],
                    help="how the webhook's fresh reads are sent: shared by concurrent writes (as the "
                         "webhook runs), per request (--no-shared-reads), or both, one after the other")
    ap.add_argument("--lease-reads", type=int, default=2000,
                    help="GETs of the lease each way (quorum, from the cache) on the idle API server "
                         "before the writers; 0: none")
    ap.add_argument("--name", default="webhook-concurrent",
                    help="the result's name (NAME.json in --out): webhook-sharing for the reads' A/B")
    ap.add_argument("--fence", choices=("webhook", "policy"), default="webhook",
                    help="what judges the writes: webhook replicas (--replicas), or the chart's fencing policy")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    kube = Kube()
    lib.install_crd()
    addr = host_address()
    work = lib.WORK / f"webhook-concurrent-{lib.rand_suffix()}"
    started = time.monotonic()
    ns = f"bench-whc-{lib.rand_suffix()}"
    kube.create_namespace(ns)
    uid, gen = held_lease(kube, ns, "inventory")
    ann = {"fencedlease.io/token": str(gen), "fencedlease.io/lease-uid": uid}
    old_uid, old_gen = held_lease(kube, ns, "moved")
    stale_ann = {"fencedlease.io/token": str(old_gen), "fencedlease.io/lease-uid": old_uid}
    step(f"creating {3 * max(args.writers)} ConfigMaps (protected, plain, stale per writer)")
    create_configmaps(kube, ns, max(args.writers), ann, stale_ann)
    kube.request("PATCH", lib.fl_path(ns, "moved"), {"spec": {"holderIdentity": "worker-c"}},
                 "application/merge-patch+json")
    reads_alone = None
    if args.lease_reads:
        step(f"the lease's read alone: {args.lease_reads} GETs each, quorum and from the watch cache")
        reads_alone = lease_reads(kube, ns, "inventory", args.lease_reads)
    runs = []
    if args.fence == "policy":
        runs = policy_setup(args, kube, ns, ann, stale_ann, work / "policy")
    for replicas in args.replicas if args.fence == "webhook" else ():
        for reads in args.reads:
            runs += one_setup(args, kube, ns, replicas, ann, stale_ann,
                              work / f"r{replicas}-{reads}", addr, reads)
    failed = sum(sum(r["failed"].values()) for r in runs)
    data = {"benchmark": args.name, "namespace": ns, "webhook_address": addr, "warmup": args.warmup,
            "fence": args.fence,
            "registration": "service (HTTP/1.1 from the API server), endpoints resolved by the API server"
            if args.fence == "webhook" else "the chart's policies (policy mode), index written by the bench",
            "lease_read_alone_ms": reads_alone, "runs": runs, "failed_writes": failed, "wall_s": time.monotonic() - started}
    lib.write_result(args.out, args.name, data)
    if failed:
        raise SystemExit(f"{failed} writes were not answered as expected (200, or 403 for a stale "
                         f"token): see first_unexpected in {args.out}/{args.name}.json")


if __name__ == "__main__":
    main()
