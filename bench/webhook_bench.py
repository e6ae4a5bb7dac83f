"""Webhook benchmarks (issue 9, item 5), the two that need a running server:

server  - `fencedlease webhook` alone under load, pinned to one core (taskset -c 0), with the
          load generator (benches/webhook_load.rs) on the other core, for two reviews: an UPDATE
          of a protected ConfigMap with the current token (allowed, after a fresh read of the
          lease through the API server, issue 14) and one with the token of a lease that moved
          on (refused from the cache, after a read of the namespace's fencing mode). Closed loop
          for each one's maximum rate; open loops at fractions of it (0.5 and 0.8) for latency.
          Also read: the server's own histogram (fencedlease_webhook_admission_seconds) and its
          CPU time per review.
apiserver - a protected ConfigMap update through the API server (so through the webhook)
          against the same update of an unlabelled ConfigMap (which the objectSelector keeps away
          from the webhook), interleaved one by one over one keep-alive connection; the added
          latency is the difference of the percentiles.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import lib
from lib import BIN, Kube, log, stats, step

LOADER = Path(os.environ.get("FL_BENCH_LOADER", BIN / "webhook_load"))


def held_lease(kube: Kube, ns: str, name: str) -> tuple[str, int]:
    body = {"apiVersion": "fencedlease.io/v1alpha1", "kind": "FencedLease",
            "metadata": {"name": name},
            "spec": {"holderIdentity": "worker-b", "leaseDurationSeconds": 3600}}
    o = kube.request("POST", lib.fl_path(ns), body)
    return o["metadata"]["uid"], o["metadata"]["generation"]


def review_body(ns: str, lease: str, uid: str, token: int) -> bytes:
    def cm(tok: int, write_id: str) -> dict:
        return {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "inventory", "namespace": ns, "uid": "7d1b1c8e-0f0a-4b9a",
                             "resourceVersion": "1234",
                             "labels": {"fencedlease.io/lease": lease, "app": "shop"},
                             "annotations": {"fencedlease.io/token": str(tok),
                                             "fencedlease.io/lease-uid": uid,
                                             "fencedlease.io/write-id": write_id}},
                "data": {"items": "1", "reservations": "worker-b"}}

    return json.dumps({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "ConfigMap"},
            "resource": {"group": "", "version": "v1", "resource": "configmaps"},
            "name": "inventory", "namespace": ns, "operation": "UPDATE",
            "userInfo": {"username": "system:serviceaccount:shop:worker"},
            "object": cm(token, "w2"), "oldObject": cm(token, "w1"), "dryRun": False,
        }}).encode()


def buckets(text: str, metric: str, labels: tuple[str, ...] = ()) -> dict[float, float]:
    """Cumulative bucket counts {le: count} of histogram `metric` (its _bucket samples whose
    label string contains every one of `labels`)."""
    out = {}
    for k, v in lib.metric_values(text, f"{metric}_bucket").items():
        if all(label in k for label in labels):
            le = k.split('le="')[1].split('"')[0]
            out[float("inf") if le == "+Inf" else float(le)] = v
    return out


def histogram(text: str) -> dict[float, float]:
    """The webhook's own fencedlease_webhook_admission_seconds."""
    return buckets(text, "fencedlease_webhook_admission_seconds")


def hist_quantile(before: dict, after: dict, q: float) -> float | None:
    """The upper bound (seconds) of the bucket holding quantile q of the requests in between."""
    les = sorted(after)
    total = after[les[-1]] - before.get(les[-1], 0)
    if total <= 0:
        return None
    for le in les:
        if after[le] - before.get(le, 0) >= q * total:
            return le
    return None


HOOK = "fencing.fencedlease.io"
# The loader's connections in open-loop runs (the webhook admits 48 from one address,
# Limits::max_connections_per_peer).
PER_PEER_CONNECTIONS = 8


def apiserver_webhook_histogram(text: str) -> dict[float, float]:
    """The API server's own timing of its calls to our webhook on UPDATE (allowed), from
    apiserver_admission_webhook_admission_duration_seconds."""
    return buckets(text, "apiserver_admission_webhook_admission_duration_seconds",
                   (f'name="{HOOK}"', 'operation="UPDATE"', 'rejected="false"', 'type="validating"'))


def webhook_call_ms(before: dict, after: dict) -> dict:
    """p50/p90/p99 (the upper bound of the bucket that holds each, ms) of the API server's calls
    to the webhook between two readings of its histogram. Kubernetes' own buckets start at 5 ms;
    bench/build-apiserver.sh builds the benchmarks' API server with 20 us x 1.15^k ones."""
    les = sorted(le for le in after if le != float("inf"))
    if not les:
        return {"calls": 0, "fine_buckets": None,
                "note": "the API server's metrics have no latency histogram for this webhook"}
    out: dict = {"calls": int(after.get(float("inf"), 0) - before.get(float("inf"), 0)),
                 "smallest_bucket_ms": les[0] * 1e3,
                 "fine_buckets": les[0] < 0.001}
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        v = hist_quantile(before, after, q)
        out[name] = None if v is None or v == float("inf") else v * 1e3
    if not out["fine_buckets"]:
        out["note"] = ("this kube-apiserver has Kubernetes' default buckets (from 5 ms): the "
                       "figures are only upper bounds; bench/run.sh uses bench/build-apiserver.sh")
    return out


def server(args, kube: Kube, work: Path) -> dict:
    ns = f"bench-wh-{lib.rand_suffix()}"
    kube.create_namespace(ns)
    uid, gen = held_lease(kube, ns, "inventory")
    # The refused path: a review with the token of a lease that then moved on, refused from the
    # cache (the token is below a generation the lease reached) without a read. An allowed
    # review is answered only after a fresh read of the lease through the API server (issue 14).
    old_uid, old_gen = held_lease(kube, ns, "moved")
    kube.request("PATCH", lib.fl_path(ns, "moved"), {"spec": {"holderIdentity": "worker-c"}},
                 "application/merge-patch+json")
    wh, port, mport, _ = lib.start_webhook("webhook-server", work / "logs", work / "certs", cpus="0")
    bodies = {"allowed": work / "allowed.json", "refused": work / "refused.json"}
    bodies["allowed"].write_bytes(review_body(ns, "inventory", uid, gen))
    bodies["refused"].write_bytes(review_body(ns, "moved", old_uid, old_gen))
    ca = work / "certs/ca.crt"
    runs = []
    # Connections: this loader speaks HTTP/1.1, one request per connection at a time, at most
    # PER_PEER_CONNECTIONS, well within the webhook's bound per address.
    # Each path's closed loop first (its most reviews/s); then open loops at fractions of it:
    # every review now waits for a read through the API server (the lease, or the namespace's
    # fencing mode before a refusal), so a fixed rate (the old 5,000/s) would only measure a
    # growing backlog.
    plan = [("closed", None, args.connections_closed, path) for path in ("refused", "allowed")] + [
        ("open", f, PER_PEER_CONNECTIONS, path) for path in ("refused", "allowed")
        for f in args.fractions for _ in range(args.repeat)]
    most: dict[str, float] = {}
    try:
        for i, (mode, share, conns, path) in enumerate(plan):
            rate = round(share * most[path]) if share else None
            body = bodies[path]
            step(f"webhook server, {path} path: {mode} loop" + (f" at {rate}/s" if rate else f", {conns} connections")
                 + f", {args.seconds} s (+{args.warmup} s warm-up)")
            before = lib.http_get(mport, "/metrics")
            cpu0 = lib.cpu_seconds(wh.pid)
            argv = ["taskset", "-c", "1", str(LOADER), "--url", f"https://127.0.0.1:{port}/validate",
                    "--ca", str(ca), "--body", str(body), "--seconds", str(args.seconds),
                    "--warmup", str(args.warmup), "--connections", str(conns), "--expect", path,
                    "--samples", str(work / f"samples-{i}.json")]
            if rate:
                argv += ["--rate", str(rate)]
            r = subprocess.run(argv, capture_output=True, text=True, timeout=args.seconds + args.warmup + 60)
            if r.returncode != 0:
                raise RuntimeError(f"webhook_load failed: {r.stderr[-2000:]}")
            res = json.loads(r.stdout)
            raw = json.loads((work / f"samples-{i}.json").read_text())
            res["raw_samples"] = lib.keep_samples(
                args.out, f"webhook-server-raw/{i:02d}-{path}-{mode}-{rate or 'most'}.json.gz",
                {k.removesuffix("_ns"): [x / 1e6 for x in v] for k, v in raw.items()})
            cpu = lib.cpu_seconds(wh.pid) - cpu0
            after = lib.http_get(mport, "/metrics")
            hb, ha = histogram(before), histogram(after)
            served = (sum(lib.metric_values(after, "fencedlease_webhook_admissions_total").values())
                      - sum(lib.metric_values(before, "fencedlease_webhook_admissions_total").values()))
            res["path"] = path
            if mode == "closed":
                most[path] = res["achieved_rps"]
            res["server_cpu_s"] = cpu
            res["server_reviews_total"] = served  # includes the warm-up
            res["reviews_per_cpu_second"] = served / cpu if cpu > 0 else None
            res["in_server_p50_bucket_s"] = hist_quantile(hb, ha, 0.50)
            res["in_server_p99_bucket_s"] = hist_quantile(hb, ha, 0.99)
            lat = res["latency"]
            log(f"  {res['achieved_rps']:.0f} reviews/s, client-side p50 {lat['p50_us']:.0f} us "
                f"p99 {lat['p99_us']:.0f} us, not as expected {res['unexpected']}, errors {res['errors']}; "
                f"server {res['reviews_per_cpu_second'] or 0:.0f} reviews per CPU-second, in-server p99 "
                f"<= {(res['in_server_p99_bucket_s'] or 0) * 1e6:.0f} us")
            runs.append(res)
    finally:
        rss = wh.rss_kib() if wh.alive() else (0, 0)
        lib.stop_all([wh])
    return {"namespace": ns, "pinned": {"webhook": "cpu 0", "loader": "cpu 1"},
            "webhook_rss_kib": rss[0], "webhook_peak_rss_kib": rss[1], "runs": runs}


def apiserver(args, kube: Kube, work: Path) -> dict:
    ns = f"bench-whapi-{lib.rand_suffix()}"
    kube.create_namespace(ns)
    uid, gen = held_lease(kube, ns, "inventory")
    ann = {"fencedlease.io/token": str(gen), "fencedlease.io/lease-uid": uid}
    cms = f"/api/v1/namespaces/{ns}/configmaps"
    kube.request("POST", cms, {"apiVersion": "v1", "kind": "ConfigMap",
                               "metadata": {"name": "protected", "annotations": ann,
                                            "labels": {"fencedlease.io/lease": "inventory"}},
                               "data": {"n": "0"}})
    kube.request("POST", cms, {"apiVersion": "v1", "kind": "ConfigMap",
                               "metadata": {"name": "plain", "annotations": ann}, "data": {"n": "0"}})
    # The refused path: a ConfigMap whose lease then moved on, written with the old token. The
    # webhook refuses it from its cache (the token is below a generation the lease reached)
    # without reading the lease; an allow always reads it first.
    old_uid, old_gen = held_lease(kube, ns, "moved")
    stale_ann = {"fencedlease.io/token": str(old_gen), "fencedlease.io/lease-uid": old_uid}
    kube.request("POST", cms, {"apiVersion": "v1", "kind": "ConfigMap",
                               "metadata": {"name": "stale", "annotations": stale_ann,
                                            "labels": {"fencedlease.io/lease": "moved"}},
                               "data": {"n": "0"}})
    kube.request("PATCH", lib.fl_path(ns, "moved"), {"spec": {"holderIdentity": "worker-c"}},
                 "application/merge-patch+json")
    wh, port, mport, bundle = lib.start_webhook("webhook-apiserver", work / "logs", work / "certs")
    name = f"fencedlease-bench-{ns}"
    lib.register_webhook(kube, name, port, bundle, ns)
    lib.wait_webhook_effective(kube, ns)
    runs = []
    bad = 0
    before = lib.http_get(mport, "/metrics")
    pooled: dict[float, float] = {}
    every = {"protected": [], "plain": [], "refused": []}
    anns = {"protected": ann, "plain": ann, "refused": stale_ann}
    target = {"protected": "protected", "plain": "plain", "refused": "stale"}
    want = {"protected": 200, "plain": 200, "refused": 403}
    try:
        for r in range(args.repeat):
            step(f"webhook through the API server, run {r + 1}/{args.repeat}: {args.updates} updates "
                 f"each of a protected, a plain and a refused (stale token) ConfigMap, interleaved "
                 f"(+{args.updates_warmup} warm-up)")
            lat = {"protected": [], "plain": [], "refused": []}
            for i in range(args.updates_warmup + args.updates):
                if i == args.updates_warmup:
                    api_before = apiserver_webhook_histogram(kube.request("GET", "/metrics"))
                order = ("protected", "plain", "refused")
                for which in order[i % 3:] + order[:i % 3]:
                    patch = {"metadata": {"annotations": dict(anns[which], **{"fencedlease.io/write-id": f"{r}-{i}"})},
                             "data": {"n": f"{r}-{i}"}}
                    status, ns_elapsed = kube.timed("PATCH", f"{cms}/{target[which]}", patch,
                                                    "application/merge-patch+json")
                    if status != want[which]:
                        bad += 1
                    if i >= args.updates_warmup:
                        lat[which].append(ns_elapsed / 1e6)
                if i and i % 500 == 0:
                    log(f"  {i} updates of each")
            api_after = apiserver_webhook_histogram(kube.request("GET", "/metrics"))
            for k in every:
                every[k] += lat[k]
            sp, sl, sr = stats(lat["protected"]), stats(lat["plain"]), stats(lat["refused"])
            run = {"protected_ms": sp, "plain_ms": sl, "refused_ms": sr,
                   "added_ms": {k: sp[k] - sl[k] for k in ("p50", "p90", "p99", "mean")},
                   "refused_added_ms": {k: sr[k] - sl[k] for k in ("p50", "p90", "p99", "mean")},
                   "apiserver_webhook_call_ms": webhook_call_ms(api_before, api_after)}
            run["raw_samples"] = lib.keep_samples(
                args.out, f"webhook-apiserver-raw/run-{len(runs) + 1}.json.gz", lat,
                {"apiserver_webhook_call": {"before": lib.hist_json(api_before), "after": lib.hist_json(api_after)}})
            for le, n in api_after.items():
                pooled[le] = pooled.get(le, 0) + n - api_before.get(le, 0)
            runs.append(run)
            call = run["apiserver_webhook_call_ms"]
            # At least one call per protected update. More happen: when the API server's watch
            # cache is behind the update before, its first attempt conflicts in etcd and it runs
            # admission again on the fresh object (both sides retry; only the protected one calls
            # the webhook twice).
            if call["fine_buckets"] is None:
                raise SystemExit(f"the API server's /metrics has no {HOOK} series in "
                                 "apiserver_admission_webhook_admission_duration_seconds: was the "
                                 "webhook called at all?")
            if args.expect_fine_buckets and not call["fine_buckets"]:
                raise SystemExit("the API server's webhook latency histogram has Kubernetes' default "
                                 "buckets (from 5 ms), not bench/build-apiserver.sh's: is the cluster "
                                 "running that kube-apiserver? (bench/run.sh starts it)")
            if call["calls"] < args.updates:
                raise SystemExit(f"the API server counted {call['calls']} calls to the webhook for "
                                 f"{args.updates} protected updates: the measurement does not see "
                                 "what it should")
            log(f"  protected p50 {sp['p50']:.2f} ms p99 {sp['p99']:.2f} ms; plain p50 {sl['p50']:.2f} ms "
                f"p99 {sl['p99']:.2f} ms; refused p50 {sr['p50']:.2f} ms p99 {sr['p99']:.2f} ms; "
                f"added p50 {run['added_ms']['p50']:.2f} ms "
                f"p99 {run['added_ms']['p99']:.2f} ms; the API server's call to the webhook: "
                + (f"p50 <= {call['p50']:.3f} ms, p99 <= {call['p99']:.3f} ms ({call['calls']} calls for "
                   f"{args.updates} updates)"
                   if call.get("p99") is not None else "not measurable"))
        after = lib.http_get(mport, "/metrics")
    finally:
        kube.request("DELETE",
                     f"/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{name}",
                     ok=(200, 404))
        lib.stop_all([wh])
    allowed = (lib.metric_values(after, "fencedlease_webhook_admissions_total").get('{result="allowed"}', 0)
               - lib.metric_values(before, "fencedlease_webhook_admissions_total").get('{result="allowed"}', 0))
    # The protocol the API server's webhook client chose for a URL-registered webhook (ALPN).
    opened = lib.metric_values(after, "fencedlease_webhook_connections_accepted_total")
    log(f"  connections accepted by the webhook, by protocol: {opened}")
    # All runs together: the difference of the pooled percentiles, with a bootstrap interval
    # (how much of it is sampling: a p99 rests on the slowest 1 % of each side).
    sp, sl, sr = stats(every["protected"]), stats(every["plain"]), stats(every["refused"])
    added = {k: sp[k] - sl[k] for k in ("p50", "p90", "p99", "mean")}
    refused_added = {k: sr[k] - sl[k] for k in ("p50", "p90", "p99", "mean")}
    # The API server's own timing of the webhook call, over all runs together.
    calls = webhook_call_ms({}, pooled)
    res = {"namespace": ns, "updates_each": args.updates, "repeat": args.repeat, "non_200": bad,
           "webhook_allowed_reviews": allowed, "connections_accepted": opened, "runs": runs,
           "protected_ms": sp, "plain_ms": sl, "added_ms": added,
           "refused_ms": sr, "refused_added_ms": refused_added,
           "refused_added_p99_ci95_ms": lib.bootstrap_ci(every["refused"], every["plain"], 99),
           "added_p99_ci95_ms": lib.bootstrap_ci(every["protected"], every["plain"], 99),
           "apiserver_webhook_call_ms": calls}
    if bad:
        raise SystemExit(f"{bad} updates were not answered as expected (200, or 403 for the stale token)")
    return res


def positive_int(v: str) -> int:
    n = int(v)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{v} is not a whole number of at least 1")
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=["server", "apiserver"])
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--warmup", type=float, default=3)
    ap.add_argument("--fractions", type=float, nargs="*", default=[0.5, 0.8],
                    help="open-loop rates, as fractions of each path's closed-loop reviews/s")
    ap.add_argument("--connections-closed", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=1, help="runs of each open-loop rate")
    ap.add_argument("--updates", type=positive_int, default=1000,
                    help="measured updates of each ConfigMap per run (at least 1)")
    ap.add_argument("--updates-warmup", type=int, default=50)
    ap.add_argument("--expect-fine-buckets", action="store_true",
                    help="fail if the API server's webhook histogram is not bench/build-apiserver.sh's")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    kube = Kube()
    lib.install_crd()
    work = lib.WORK / f"webhook-{args.part}-{lib.rand_suffix()}"
    started = time.monotonic()
    data = server(args, kube, work) if args.part == "server" else apiserver(args, kube, work)
    data.update({"benchmark": f"webhook-{args.part}", "wall_s": time.monotonic() - started})
    lib.write_result(args.out, f"webhook-{args.part}", data)


if __name__ == "__main__":
    main()
