"""Policy mode benchmarks (issue 18, issue 37): the chart's ValidatingAdmissionPolicy and its one
binding (fencing.mode: policy), beside the webhook. No controller runs: the chart's binding takes
every FencedLease of the written object's namespace as a parameter, and the policy's
matchCondition keeps only the lease the object's label names. The chart's index policy reads each
namespace's lease index (annotation fencedlease.io/leases), which the bench writes itself, as the
controller would (index()), once its leases exist; so each protected write pays for both policies.

apiserver - policy-apiserver: the same protected ConfigMap update through the API server three
          ways in one run: no fencing, the webhook, the policy. Nothing is installed or removed
          between them: the webhook (registered by URL, failurePolicy Fail), the policy and its
          binding are all in place, and one namespace label, fencedlease.io/bench-fencing=none|webhook|policy,
          which the webhook's and the policy's namespaceSelectors read, says which of them judges
          the namespace's writes (a probe checks that the API server sees the switch). In each
          mode, per round:
            * client side: a protected (labelled) and a plain (unlabelled, which neither selects)
              ConfigMap updated in turn, one by one over one keep-alive connection; the added
              latency is the difference of the percentiles (the plain one is the baseline of the
              same minutes);
            * server side: then a block of protected updates alone, between two readings of the
              API server's /metrics: apiserver_admission_step_admission_duration_seconds{type=
              "validate"} (the whole validating admission step: the same histogram whichever
              mechanism judges) and apiserver_admission_controller_admission_duration_seconds of
              the plugin that judges (ValidatingAdmissionWebhook, ValidatingAdmissionPolicy),
              with bench/build-apiserver.sh's buckets (20 us x 1.15^k); added = the mode's
              percentile minus the no-fencing mode's. Also the webhook call histogram. (The
              policy's own apiserver_validating_admission_policy_check_* series count only
              denials in v1.37, with buckets of 0.5 us, 1 ms, 10 ms...: not used.)
          Rounds rotate the order of the modes.
layout    - policy-layout (issue 37): the chart's one binding at scale. Stages: one lease; PER
          namespaces of PER leases (the measured namespace among them) with the policies removed,
          then restored (the policy machinery's memory is the difference of the API server's
          footprints: its live heap after a forced collection, and RSS), writes judged by the
          policy and, beside them, by the webhook (which reads only the lease a write names);
          then one more namespace of PER*PER leases and writes there. Each measurement keeps its per-write samples and the API server's histograms
          before and after ("raw"), so that report.py can recompute every figure.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import threading
import time
from pathlib import Path

import lib
from lib import FENCEDLEASE, Kube, log, stats, step
from webhook_bench import buckets, held_lease, hist_quantile

MODE_LABEL = "fencedlease.io/bench-fencing"
MODES = ("none", "webhook", "policy")
HOOK = "fencing.fencedlease.io"
PLUGIN = {"webhook": "ValidatingAdmissionWebhook", "policy": "ValidatingAdmissionPolicy"}
BINDINGS = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings"
POLICIES = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"
# The bench cluster's admin (hack/cluster.sh's token user): the rendered index guard lets it
# write the lease index, as it lets the controller.
BENCH_USER = "admin"
INDEX_KEY = "fencedlease.io/leases"


# -- the policy -------------------------------------------------------------------------------


def helm() -> str:
    r = subprocess.run([str(lib.REPO / "hack/helm.sh")], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"hack/helm.sh could not provide helm: {r.stderr[-2000:]}")
    return r.stdout.strip()


def install_policy(kube: Kube, release: str, ns: str, work: Path) -> str:
    """The chart's fencing policy and its binding (rendered as tests/common/policy.rs renders
    them), judging the namespaces labelled fencedlease.io/bench-fencing=policy. Returns the
    policy's name (the binding's too)."""
    sel = json.dumps({"matchLabels": {MODE_LABEL: "policy"}})
    r = subprocess.run([helm(), "template", release, str(lib.REPO / "charts/fencedlease"),
                        "--namespace", ns, "--set", "fencing.mode=policy",
                        "--set", "fencing.excludeReleaseNamespace=false",
                        "--set-json", f"fencing.namespaceSelector={sel}",
                        "--set-json", f"fencing.indexWriters={json.dumps([BENCH_USER])}",
                        "--api-versions", "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy",
                        "--show-only", "templates/fencing-policy.yaml"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"helm template of the fencing policy failed: {r.stderr[-2000:]}")
    work.mkdir(parents=True, exist_ok=True)
    (work / "policy.yaml").write_text(r.stdout)
    lib.kubectl("apply", "-f", str(work / "policy.yaml"))
    name = f"{release}-fencedlease-fencing"
    for policy in policy_names(name):
        def checked():
            st = (kube.get_opt(f"{POLICIES}/{policy}") or {}).get("status") or {}
            return st if "typeChecking" in st else None

        st = lib.wait_until(checked, 30, f"policy {policy} to be type-checked", interval=0.2)
        if (st.get("typeChecking") or {}).get("expressionWarnings"):
            raise SystemExit(f"policy {policy}'s CEL has type-checking warnings: {st}")
    return name


def policy_names(policy: str) -> list[str]:
    """The chart's three policies of policy mode (each with a binding of its name): the fencing
    policy, the lease index policy and the index's guard."""
    return [policy, f"{policy}-index", f"{policy}-index-guard"]


def index(kube: Kube, ns: str, names: list[str]) -> None:
    """Writes namespace `ns`'s lease index as the controller does (src/controller/index/mod.rs): every
    lease name between slashes, in name order."""
    value = "/" + "".join(f"{n}/" for n in sorted(names))
    kube.request("PATCH", f"/api/v1/namespaces/{ns}", {"metadata": {"annotations": {INDEX_KEY: value}}},
                 "application/merge-patch+json")


def remove_binding(kube: Kube, policy: str) -> None:
    """Deletes the chart's binding (named as the policy); install_policy's file restores it."""
    kube.request("DELETE", f"{BINDINGS}/{policy}", ok=(200, 404))


def restore_binding(work: Path) -> None:
    lib.kubectl("apply", "-f", str(work / "policy.yaml"))


def remove_policy(kube: Kube, policy: str) -> None:
    for name in policy_names(policy):
        remove_binding(kube, name)
        kube.request("DELETE", f"{POLICIES}/{name}", ok=(200, 404))


# -- switching and probing ------------------------------------------------------------------


def judged_by(kube: Kube, ns: str, lease: str) -> str:
    """Who refuses a labelled ConfigMap without a token (a dry-run create): 'webhook',
    'policy', 'index' (the index policy: the lease is not listed) or 'none' (allowed)."""
    probe = {"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": "mode-probe", "labels": {"fencedlease.io/lease": lease}}}
    try:
        kube.request("POST", f"/api/v1/namespaces/{ns}/configmaps?dryRun=All", probe)
        return "none"
    except lib.ApiError as e:
        text = str(e.body)
        if f'admission webhook "{HOOK}" denied' in text:
            return "webhook"
        if "-fencing-index' with binding" in text:
            return "index"
        if "ValidatingAdmissionPolicy" in text and "fencedlease: this object is protected" in text:
            return "policy"
        if "ValidatingAdmissionPolicy" in text:
            # Seen right after a binding appears, before the API server has its parameter (the
            # FencedLease): "failed to configure binding". Not in effect yet.
            log(f"  probe: {e.status} {text[:400]}")
            return "pending"
        raise


def switch(kube: Kube, ns: str, lease: str, mode: str) -> float:
    """Labels the namespace for `mode`; returns the seconds until the API server judges by it."""
    t0 = time.monotonic()
    kube.request("PATCH", f"/api/v1/namespaces/{ns}", {"metadata": {"labels": {MODE_LABEL: mode}}},
                 "application/merge-patch+json")
    lib.wait_until(lambda: judged_by(kube, ns, lease) == mode, 60,
                   f"the API server to judge {ns} by '{mode}'", interval=0.1)
    return time.monotonic() - t0


# -- the API server's numbers ---------------------------------------------------------------


def server_hists(text: str) -> dict:
    """The admission histograms (cumulative {le: count}) of allowed UPDATEs. (The policy's own
    apiserver_validating_admission_policy_check_* count only denials in v1.37, and their buckets
    jump from 0.5 us to 1 ms: not used.)"""
    step_ = ("apiserver_admission_step_admission_duration_seconds",
             ('type="validate"', 'operation="UPDATE"', 'rejected="false"'))
    out = {"step_validate": buckets(text, *step_)}
    for mode, plugin in PLUGIN.items():
        out[f"plugin_{mode}"] = buckets(text, "apiserver_admission_controller_admission_duration_seconds",
                                        (f'name="{plugin}"', 'type="validate"', 'operation="UPDATE"',
                                         'rejected="false"'))
    out["webhook_call"] = buckets(text, "apiserver_admission_webhook_admission_duration_seconds",
                                  (f'name="{HOOK}"', 'operation="UPDATE"', 'rejected="false"',
                                   'type="validating"'))
    return out


def hist_ms(before: dict, after: dict) -> dict:
    """Count and p50/p90/p99 (bucket upper bounds, ms) of the observations in between."""
    les = sorted(le for le in after if le != float("inf"))
    if not les:
        return {"n": 0}
    out: dict = {"n": int(after.get(float("inf"), 0) - before.get(float("inf"), 0)),
                 "smallest_bucket_ms": les[0] * 1e3, "fine_buckets": les[0] < 0.001}
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        v = hist_quantile(before, after, q)
        out[name] = None if v is None or v == float("inf") else v * 1e3
    return out


def pool(acc: dict, before: dict, after: dict) -> None:
    for le, n in after.items():
        acc[le] = acc.get(le, 0) + n - before.get(le, 0)


def proc_pid(component: str) -> int | None:
    try:
        return int((lib.CLUSTER_DIR / "pids" / component).read_text().strip())
    except (OSError, ValueError):
        return None


class Writer:
    """Protected and plain ConfigMap updates in one namespace, each with a write id of its own."""

    def __init__(self, kube: Kube, ns: str, lease: str, uid: str, token: int):
        self.kube, self.ns = kube, ns
        self.cms = f"/api/v1/namespaces/{ns}/configmaps"
        self.ann = {"fencedlease.io/token": str(token), "fencedlease.io/lease-uid": uid}
        self.seq = 0
        for name, labels in (("protected", {"fencedlease.io/lease": lease}), ("plain", {})):
            # Created while no fencing judges the namespace, or stamped so that either passes.
            kube.request("POST", self.cms, {"apiVersion": "v1", "kind": "ConfigMap",
                                            "metadata": {"name": name, "labels": labels,
                                                         "annotations": dict(self.ann, **{
                                                             "fencedlease.io/write-id": "create"})},
                                            "data": {"n": "0"}})

    def write(self, which: str) -> tuple[int, float]:
        self.seq += 1
        patch = {"metadata": {"annotations": dict(self.ann, **{"fencedlease.io/write-id": f"w{self.seq}"})},
                 "data": {"n": str(self.seq)}}
        status, ns_elapsed = self.kube.timed("PATCH", f"{self.cms}/{which}", patch,
                                             "application/merge-patch+json")
        return status, ns_elapsed / 1e6


def measure(kube: Kube, w: Writer, updates: int, warmup: int, label: str, max_s: float | None = None) -> dict:
    """Client side: protected and plain in turn; server side: protected alone between two
    readings of /metrics. With max_s, each of the two parts stops after that many seconds
    (at least 10 updates each), for writes that turn slow (many bindings)."""
    lat: dict[str, list[float]] = {"protected": [], "plain": []}
    bad = 0
    t0 = None
    for i in range(warmup + updates):
        if i == warmup:
            t0 = time.monotonic()
        if t0 is not None and max_s and i - warmup >= 10 and time.monotonic() - t0 > max_s:
            log(f"  {label}: stopped after {i - warmup} updates of each ({max_s:.0f} s)")
            break
        for which in (("protected", "plain") if i % 2 == 0 else ("plain", "protected")):
            status, ms = w.write(which)
            bad += status != 200
            if i >= warmup:
                lat[which].append(ms)
    before = server_hists(kube.request("GET", "/metrics"))
    alone = []
    t0 = time.monotonic()
    for _ in range(len(lat["protected"])):
        if max_s and len(alone) >= 10 and time.monotonic() - t0 > max_s:
            break
        status, ms = w.write("protected")
        bad += status != 200
        alone.append(ms)
    after = server_hists(kube.request("GET", "/metrics"))
    if bad:
        raise SystemExit(f"{label}: {bad} updates were not answered 200")
    sp, sl = stats(lat["protected"]), stats(lat["plain"])
    res = {"protected_ms": sp, "plain_ms": sl,
           "added_ms": {k: sp[k] - sl[k] for k in ("p50", "p90", "p99", "mean")},
           "protected_alone_ms": stats(alone),
           "server": {k: hist_ms(before[k], after[k]) for k in before},
           "_raw": {"protected": lat["protected"], "plain": lat["plain"], "alone": alone,
                    "before": before, "after": after}}
    srv = res["server"]["step_validate"]
    log(f"  {label}: protected p50 {sp['p50']:.2f} ms p99 {sp['p99']:.2f} ms; plain p50 {sl['p50']:.2f} ms "
        f"p99 {sl['p99']:.2f} ms; added p50 {res['added_ms']['p50']:.2f} ms p99 {res['added_ms']['p99']:.2f} ms; "
        f"the API server's validating step on the protected updates alone: "
        + (f"p50 <= {srv['p50']:.3f} ms, p99 <= {srv['p99']:.3f} ms ({srv['n']} observations)"
           if srv.get("p99") is not None else "no observations"))
    return res


def check_server(res: dict, updates: int, mode: str, expect_fine: bool) -> None:
    srv = res["server"]
    updates = min(updates, res["protected_alone_ms"]["n"])
    step_ = srv["step_validate"]
    if step_.get("n", 0) < updates:
        raise SystemExit(f"{mode}: the API server counted {step_.get('n', 0)} validating steps for "
                         f"{updates} protected updates: the measurement does not see what it should")
    if expect_fine and not step_.get("fine_buckets"):
        raise SystemExit("the API server's admission step histogram has Kubernetes' default buckets "
                         "(from 5 ms), not bench/build-apiserver.sh's: is the cluster running that "
                         "kube-apiserver? (bench/run.sh starts it)")
    if mode == "webhook" and srv["webhook_call"].get("n", 0) < updates:
        raise SystemExit(f"webhook mode: {srv['webhook_call'].get('n', 0)} calls to the webhook for "
                         f"{updates} protected updates")
    if mode != "webhook" and srv["webhook_call"].get("n", 0):
        raise SystemExit(f"{mode} mode: the webhook was called")


def summarize(parts: list[dict]) -> dict:
    """Pooled client-side figures of several measurements, and pooled server histograms."""
    prot = [x for p in parts for x in p["_raw"]["protected"]]
    plain = [x for p in parts for x in p["_raw"]["plain"]]
    sp, sl = stats(prot), stats(plain)
    out = {"protected_ms": sp, "plain_ms": sl,
           "added_ms": {k: sp[k] - sl[k] for k in ("p50", "p90", "p99", "mean")},
           "added_p99_ci95_ms": lib.bootstrap_ci(prot, plain, 99),
           "added_p50_ci95_ms": lib.bootstrap_ci(prot, plain, 50),
           "server": {}}
    for k in parts[0]["server"]:
        acc: dict = {}
        for p in parts:
            pool(acc, p["_raw"]["before"][k], p["_raw"]["after"][k])
        out["server"][k] = hist_ms({}, acc)
    return out


def strip(res: dict) -> dict:
    """The result as kept: the figures, and under "raw" what they were computed from (every
    write's client-side milliseconds, rounded to the microsecond, and the API server's
    cumulative histograms before and after the block of protected writes alone)."""
    out = {k: v for k, v in res.items() if k != "_raw"}
    raw = res["_raw"]
    out["raw"] = {"protected_ms": [round(x, 3) for x in raw["protected"]],
                  "plain_ms": [round(x, 3) for x in raw["plain"]],
                  "protected_alone_ms": [round(x, 3) for x in raw["alone"]],
                  "server_before": raw["before"], "server_after": raw["after"]}
    return out


def server_added(mode_srv: dict, none_srv: dict, key: str) -> dict:
    a, b = mode_srv.get(key) or {}, none_srv.get(key) or {}
    return {q: (a[q] - b[q]) if a.get(q) is not None and b.get(q) is not None else None
            for q in ("p50", "p90", "p99")}


# -- part 1: no fencing, webhook, policy ------------------------------------------------------


def apiserver(args, kube: Kube, work: Path) -> dict:
    sfx = lib.rand_suffix()
    ns = f"bench-vap-{sfx}"
    kube.create_namespace(ns, {MODE_LABEL: "none"})
    uid, gen = held_lease(kube, ns, "inventory")
    w = Writer(kube, ns, "inventory", uid, gen)
    index(kube, ns, ["inventory"])
    policy = install_policy(kube, f"bench-vap-{sfx}", ns, work)
    wh, port, _, bundle = lib.start_webhook("webhook-vap", work / "logs", work / "certs")
    hook = f"fencedlease-bench-{ns}"
    lib.register_webhook(kube, hook, port, bundle, ns, namespace_labels={MODE_LABEL: "webhook"})
    by_mode: dict[str, list[dict]] = {m: [] for m in MODES}
    switches: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        # switch() waits until the API server judges by each mode.
        for r in range(args.repeat):
            order = MODES[r % 3:] + MODES[:r % 3]
            for mode in order:
                switches[mode].append(switch(kube, ns, "inventory", mode))
                step(f"policy-apiserver round {r + 1}/{args.repeat}, {mode}: {args.updates} protected and "
                     f"{args.updates} plain updates in turn (+{args.updates_warmup} warm-up), then "
                     f"{args.updates} protected alone")
                res = measure(kube, w, args.updates, args.updates_warmup, mode)
                check_server(res, args.updates, mode, args.expect_fine_buckets)
                res["round"] = r + 1
                by_mode[mode].append(res)
    finally:
        kube.request("DELETE", f"/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{hook}",
                     ok=(200, 404))
        lib.stop_all([wh])
        remove_policy(kube, policy)
    modes = {m: summarize(by_mode[m]) for m in MODES}
    for m in MODES:
        modes[m]["runs"] = [strip(x) for x in by_mode[m]]
        modes[m]["switch_s"] = switches[m]
    none_srv = modes["none"]["server"]
    for m in ("webhook", "policy"):
        srv = modes[m]["server"]
        modes[m]["server_added_ms"] = {
            "step_validate": server_added(srv, none_srv, "step_validate"),
            "plugin": server_added({"x": srv[f"plugin_{m}"]}, {"x": none_srv[f"plugin_{m}"]}, "x")}
    for m in MODES:
        a, s = modes[m]["added_ms"], modes[m]["server"]["step_validate"]
        log(f"{m}: added p50 {a['p50']:.2f} ms p99 {a['p99']:.2f} ms (client, all rounds); the API server's "
            f"validating step p50 <= {s.get('p50') or 0:.3f} ms p99 <= {s.get('p99') or 0:.3f} ms")
    return {"namespace": ns, "policy": policy, "updates_each": args.updates, "updates_warmup": args.updates_warmup,
            "repeat": args.repeat, "modes": modes}


# -- part 2: the one binding at scale (issue 37) -------------------------------------------


def live_heap_mib(kube: Kube, readings: int = 3) -> list[float]:
    """The API server's live Go heap: `readings` times, a garbage collection forced through its
    profiling endpoint (/debug/pprof/heap?gc=1 runs one before it answers), then the heap's
    allocated bytes from /metrics. Unlike RSS, which keeps what the Go runtime has not yet given
    back to the system, and heap in use, which keeps garbage not yet collected, this is what the
    objects the server holds take."""
    out = []
    for _ in range(readings):
        kube.request("GET", "/debug/pprof/heap?gc=1")
        text = kube.request("GET", "/metrics")
        out.append(sum(lib.metric_values(text, "go_memstats_heap_alloc_bytes").values()) / 2**20)
    return out


def footprint(kube: Kube, settle: float, idle: float, label: str) -> dict:
    """After `settle` s: the API server's and etcd's RSS (five readings over the idle window,
    median and max) and CPU seconds per second while idle; the API server's Go heap, and its live
    heap after forced collections (`live_heap_mib`)."""
    api, etcd = proc_pid("kube-apiserver"), proc_pid("etcd")
    if not api or not etcd:
        raise SystemExit(f"no pid files of the cluster in {lib.CLUSTER_DIR}/pids")
    time.sleep(settle)
    c0, e0, t0 = lib.cpu_seconds(api), lib.cpu_seconds(etcd), time.monotonic()
    rss, erss = [], []
    for k in range(5):
        rss.append(lib.proc_status_kib(api, "VmRSS")["VmRSS"])
        erss.append(lib.proc_status_kib(etcd, "VmRSS")["VmRSS"])
        time.sleep(idle / 5)
    el = time.monotonic() - t0
    text = kube.request("GET", "/metrics")
    m = {n: sum(lib.metric_values(text, n).values()) for n in
         ("go_memstats_heap_inuse_bytes", "go_memstats_heap_alloc_bytes", "process_resident_memory_bytes",
          "process_cpu_seconds_total", "go_goroutines")}
    out = {"apiserver_rss_mib": sorted(rss)[2] / 1024, "apiserver_rss_max_mib": max(rss) / 1024,
           "etcd_rss_mib": sorted(erss)[2] / 1024,
           "apiserver_idle_cpu_per_s": (lib.cpu_seconds(api) - c0) / el,
           "etcd_idle_cpu_per_s": (lib.cpu_seconds(etcd) - e0) / el,
           "apiserver_cpu_s_total": lib.cpu_seconds(api),
           "apiserver_heap_inuse_mib": m["go_memstats_heap_inuse_bytes"] / 2**20,
           "apiserver_goroutines": m["go_goroutines"]}
    live = live_heap_mib(kube)
    out["apiserver_live_heap_readings_mib"] = live
    out["apiserver_live_heap_mib"] = sorted(live)[len(live) // 2]
    log(f"  {label}: kube-apiserver RSS {out['apiserver_rss_mib']:.0f} MiB (heap in use "
        f"{out['apiserver_heap_inuse_mib']:.0f} MiB, live after a collection "
        f"{out['apiserver_live_heap_mib']:.1f} MiB), idle CPU {out['apiserver_idle_cpu_per_s']:.3f} s/s; "
        f"etcd RSS {out['etcd_rss_mib']:.0f} MiB")
    return out


def unfenced(kube: Kube, *namespaces: str) -> None:
    for n in namespaces:
        kube.request("PATCH", f"/api/v1/namespaces/{n}", {"metadata": {"labels": {MODE_LABEL: "none"}}},
                     "application/merge-patch+json")


def layout_writer(kube: Kube, ns: str) -> Writer:
    """Lease "inventory" held in `ns` and its writer's two ConfigMaps, created while nothing
    judges the namespace; then the policy judges it."""
    kube.create_namespace(ns, {MODE_LABEL: "none"})
    uid, gen = held_lease(kube, ns, "inventory")
    w = Writer(kube, ns, "inventory", uid, gen)
    index(kube, ns, ["inventory"])
    kube.request("PATCH", f"/api/v1/namespaces/{ns}", {"metadata": {"labels": {MODE_LABEL: "policy"}}},
                 "application/merge-patch+json")
    return w


def cpu_profile(out: Path, seconds: int) -> threading.Thread:
    """The API server's CPU profile (Go pprof, /debug/pprof/profile) over the next `seconds`,
    written to `out`: read it with `go tool pprof -top -cum FILE`."""
    def grab() -> None:
        r = subprocess.run(["kubectl", "--kubeconfig", str(lib.kubeconfig()), "get", "--raw",
                            f"/debug/pprof/profile?seconds={seconds}"], capture_output=True)
        if r.returncode == 0:
            out.write_bytes(r.stdout)
        else:
            log(f"  the API server's CPU profile failed: {r.stderr.decode(errors='replace')[-400:]}")
    t = threading.Thread(target=grab, daemon=True)
    t.start()
    return t


def measured(kube: Kube, w: Writer, args, label: str, mode: str = "policy") -> dict:
    res = measure(kube, w, args.updates, args.updates_warmup, label, args.max_seconds)
    check_server(res, args.updates, mode, args.expect_fine_buckets)
    return strip(res)


def layout(args, kube: Kube, work: Path) -> dict:
    """policy-layout: the chart's one binding (its paramRef selects the FencedLeases of the
    written object's own namespace; the policy's matchCondition keeps the one the label names).
    Stages: (1) one lease: footprint and writes, and what a write naming a lease that does not
    exist meets; (2) the policies and bindings removed (the API server then drops its informer of
    FencedLeases), `per` namespaces of `per` leases created (the measured namespace among them):
    footprint; (3) the policies and binding back: footprint (the policy machinery's memory is the
    difference, of the live heap after a forced collection and of RSS), writes judged by the
    policy, then by the webhook (the namespace switched to it); (4) one more namespace of
    `per`*`per` leases: writes there."""
    per = args.per
    sfx = lib.rand_suffix()
    ns, big = f"bench-vaplayout-{sfx}", f"bench-vaplayout-big-{sfx}"
    others = [f"bench-vaplayout-{sfx}-{k:03d}" for k in range(1, per)]
    empty = f"bench-vaplayout-empty-{sfx}"
    for n in [*others, empty]:
        kube.create_namespace(n, {MODE_LABEL: "policy"})
    w = layout_writer(kube, ns)
    policy = install_policy(kube, f"bench-vl-{sfx}", ns, work)
    wh, port, _, bundle = lib.start_webhook("webhook-vl", work / "logs", work / "certs")
    hook = f"fencedlease-bench-{ns}"
    lib.register_webhook(kube, hook, port, bundle, ns, namespace_labels={MODE_LABEL: "webhook"})
    res: dict = {"per_namespace": per, "namespaces": per, "big_namespace_leases": per * per,
                 "updates": args.updates, "settle_s": args.settle, "idle_s": args.idle}
    try:
        lib.wait_until(lambda: judged_by(kube, ns, "inventory") == "policy", 60,
                       "the chart's binding to judge the lease's objects")
        step("policy-layout: one lease, the chart's binding")
        res["one"] = footprint(kube, args.settle, args.idle, "1 lease, the chart's binding")
        res["one"]["writes"] = measured(kube, w, args, "1 lease")
        res["missing_lease_with_leases"] = judged_by(kube, ns, "no-such-lease")
        res["missing_lease_no_leases"] = judged_by(kube, empty, "no-such-lease")
        log(f"  a write naming a missing lease: {res['missing_lease_with_leases']} where the namespace "
            f"has leases, {res['missing_lease_no_leases']} where it has none")

        # The policies go, not just the binding: the API server keeps its informer of a
        # parameter kind for as long as any policy names the kind, bound or not.
        step(f"policy-layout: {per} x {per} FencedLeases, no policy")
        remove_policy(kube, policy)
        lib.wait_until(lambda: judged_by(kube, ns, "inventory") == "none", 60, "the policies to go")
        t0 = time.monotonic()
        spread = [f"lease-{i:05d}" for i in range(1, per)]
        lib.create_leases(kube, ns, spread)
        index(kube, ns, ["inventory", *spread])
        for n in others:
            names = [f"lease-{i:05d}" for i in range(per)]
            lib.create_leases(kube, n, names, log_every=10**9)
            index(kube, n, names)
        res["create_s"] = time.monotonic() - t0
        res["leases"] = footprint(kube, args.settle, args.idle, f"{per * per} leases, no policy")

        step(f"policy-layout: the chart's policies and binding over {per * per} leases")
        t0 = time.monotonic()
        restore_binding(work)
        last = f"lease-{per - 1:05d}"
        lib.wait_until(lambda: judged_by(kube, ns, last) == "policy", 300,
                       f"the binding to judge {ns}'s objects", interval=0.5)
        res["judged_s"] = time.monotonic() - t0
        res["bound"] = footprint(kube, args.settle, args.idle, f"{per * per} leases, the chart's binding")
        # Where the time goes: the API server's CPU profile during these writes.
        prof = cpu_profile(args.out / f"policy-layout-cpu-{per}-leases.pprof", 10)
        res["bound"]["writes_spread"] = measured(kube, w, args, f"{per} leases in the namespace")
        prof.join()
        res["switch_to_webhook_s"] = switch(kube, ns, "inventory", "webhook")
        res["bound"]["webhook_spread"] = measured(kube, w, args, f"the webhook, {per * per} leases", "webhook")
        switch(kube, ns, "inventory", "policy")

        step(f"policy-layout: one more namespace, of {per * per} leases")
        wbig = layout_writer(kube, big)
        names = [f"lease-{i:05d}" for i in range(1, per * per)]
        lib.create_leases(kube, big, names, log_every=2000)
        index(kube, big, ["inventory", *names])
        lib.wait_until(lambda: judged_by(kube, big, f"lease-{per * per - 1:05d}") == "policy", 300,
                       f"the binding to judge {big}'s objects", interval=0.5)
        res["bound"]["writes_one_namespace"] = measured(kube, wbig, args, f"{per * per} leases in the namespace")
    finally:
        kube.request("DELETE", f"/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{hook}",
                     ok=(200, 404))
        lib.stop_all([wh])
        remove_policy(kube, policy)
        unfenced(kube, ns, big, empty, *others)
    base = res["one"]["writes"]["server"]["step_validate"]
    res["ratios"] = {
        f"{k}_p99_vs_one": (res["bound"][k]["server"]["step_validate"].get("p99") or 0) / base["p99"]
        for k in ("writes_spread", "writes_one_namespace", "webhook_spread") if base.get("p99")}
    res["policy_machinery_rss_mib"] = res["bound"]["apiserver_rss_mib"] - res["leases"]["apiserver_rss_mib"]
    res["policy_machinery_live_heap_mib"] = (res["bound"]["apiserver_live_heap_mib"]
                                             - res["leases"]["apiserver_live_heap_mib"])
    log(f"policy-layout: validating step p99 / one lease's: {res['ratios']}; the policies over "
        f"{per * per} leases added {res['policy_machinery_live_heap_mib']:.1f} MiB of live heap "
        f"({res['policy_machinery_rss_mib']:.0f} MiB RSS) to the API server")
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=["apiserver", "layout"])
    ap.add_argument("--updates", type=int, default=1000, help="measured updates of each kind per measurement")
    ap.add_argument("--updates-warmup", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=1, help="apiserver: rounds of the three modes")
    ap.add_argument("--per", type=int, default=100,
                    help="layout: PER namespaces of PER leases, and one namespace of PER*PER")
    ap.add_argument("--settle", type=float, default=20, help="layout: seconds before each footprint")
    ap.add_argument("--idle", type=float, default=10, help="layout: seconds of each idle CPU reading")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="layout: stop each part of a latency measurement after this many seconds")
    ap.add_argument("--expect-fine-buckets", action="store_true",
                    help="fail if the API server's admission histograms are not bench/build-apiserver.sh's")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.updates < 1 or args.per < 2:
        raise SystemExit("--updates must be at least 1 and --per at least 2")
    kube = Kube()
    name = f"policy-{args.part}"
    served = kube.get_opt("/apis/admissionregistration.k8s.io/v1") or {}
    if not any(r.get("name") == "validatingadmissionpolicybindings" for r in served.get("resources", [])):
        version = kube.request("GET", "/version").get("gitVersion")
        log(f"{name}: skipped, this API server ({version}) does not serve ValidatingAdmissionPolicy v1 (1.30+)")
        lib.write_result(args.out, name, {"benchmark": name, "skipped": (
            f"kube-apiserver {version} does not serve admissionregistration.k8s.io/v1 "
            "ValidatingAdmissionPolicy (Kubernetes 1.30 and later): policy mode cannot run there")})
        return
    lib.install_crd()
    work = lib.WORK / f"policy-{args.part}-{lib.rand_suffix()}"
    started = time.monotonic()
    parts = {"apiserver": apiserver, "layout": layout}
    data = parts[args.part](args, kube, work)
    data.update({"benchmark": name, "wall_s": time.monotonic() - started})
    lib.write_result(args.out, name, data)


if __name__ == "__main__":
    main()
