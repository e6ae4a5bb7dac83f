"""Policy mode benchmarks (issue 18): the chart's ValidatingAdmissionPolicy (fencing.mode: policy)
with the bindings `fencedlease controller --fencing-policy` keeps, beside the webhook.

apiserver - policy-apiserver: the same protected ConfigMap update through the API server three
          ways in one run: no fencing, the webhook, the policy. Nothing is installed or removed
          between them: the webhook (registered by URL, failurePolicy Fail), the policy, its
          binding for the lease (made by the controller, running with --fencing-policy) are all
          in place, and one namespace label, fencedlease.io/bench-fencing=none|webhook|policy,
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
layout    - policy-layout (issue 37, measured before building it): one binding for every lease, its
          paramRef selecting the FencedLeases of the written object's own namespace; PER x PER
          leases and one namespace of PER*PER: the validating step's percentiles against one
          lease's, and the API server's memory for the binding. See layout().
scale     - policy-scale: the API server's cost of N FencedLeases, each with its binding (the
          controller's). Stages: one lease with its binding; N leases (controller stopped, so
          still one binding); N leases and N bindings (controller started, binds them all). At
          each stage after a settling pause: the API server's (and etcd's) resident memory from
          /proc, its CPU seconds per second while idle, Go heap from its /metrics; from stage 1
          and 3, protected writes judged by the policy as above (one binding vs N). Also the time
          and the API server's CPU seconds for binding all N.
"""

from __future__ import annotations

import argparse
import json
import subprocess
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


# -- the policy -------------------------------------------------------------------------------


def policy_hash(policy: str) -> str:
    """src/controller/policy.rs policy_hash: FNV-1a, 32 bits, hex."""
    h = 0x811C9DC5
    for b in policy.encode():
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return f"{h:08x}"


def binding_name(policy: str, ns: str, lease: str) -> str:
    return f"{ns}.{lease}.fencedlease-{policy_hash(policy)}"


def helm() -> str:
    r = subprocess.run([str(lib.REPO / "hack/helm.sh")], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"hack/helm.sh could not provide helm: {r.stderr[-2000:]}")
    return r.stdout.strip()


def install_policy(kube: Kube, release: str, ns: str, work: Path) -> str:
    """The chart's fencing policy (rendered as tests/common/policy.rs renders it), judging the
    namespaces labelled fencedlease.io/bench-fencing=policy. Returns its name."""
    sel = json.dumps({"matchLabels": {MODE_LABEL: "policy"}})
    r = subprocess.run([helm(), "template", release, str(lib.REPO / "charts/fencedlease"),
                        "--namespace", ns, "--set", "fencing.mode=policy",
                        "--set", "fencing.excludeReleaseNamespace=false",
                        "--set-json", f"fencing.namespaceSelector={sel}",
                        "--api-versions", "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy",
                        "--show-only", "templates/fencing-policy.yaml"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"helm template of the fencing policy failed: {r.stderr[-2000:]}")
    work.mkdir(parents=True, exist_ok=True)
    (work / "policy.yaml").write_text(r.stdout)
    lib.kubectl("apply", "-f", str(work / "policy.yaml"))
    name = f"{release}-fencedlease-fencing"

    def checked():
        st = (kube.get_opt(f"{POLICIES}/{name}") or {}).get("status") or {}
        return st if "typeChecking" in st else None

    st = lib.wait_until(checked, 30, "the policy to be type-checked", interval=0.2)
    if (st.get("typeChecking") or {}).get("expressionWarnings"):
        raise SystemExit(f"the fencing policy's CEL has type-checking warnings: {st}")
    return name


def remove_policy(kube: Kube, policy: str) -> None:
    kube.request("DELETE", f"{BINDINGS}?labelSelector=fencedlease.io/policy%3D{policy_hash(policy)}",
                 ok=(200, 404))
    kube.request("DELETE", f"{POLICIES}/{policy}", ok=(200, 404))


def start_controller(ns: str, ctl_ns: str, ident: str, policy: str, work: Path) -> tuple[lib.Proc, int]:
    mport = lib.free_port()
    p = lib.Proc(ident, [str(FENCEDLEASE), "controller", "--namespace", ns,
                         "--election-namespace", ctl_ns, "--identity", ident,
                         "--metrics-addr", f"127.0.0.1:{mport}", "--fencing-policy", policy],
                 work / "logs", env={"KUBECONFIG": str(lib.kubeconfig()), "RUST_LOG": "warn"})
    return p, mport


def count_bindings(kube: Kube, policy: str) -> int:
    n, cont = 0, ""
    while True:
        q = f"?labelSelector=fencedlease.io/policy%3D{policy_hash(policy)}&limit=5000"
        lst = kube.request("GET", BINDINGS + q + (f"&continue={cont}" if cont else ""))
        n += len(lst["items"])
        cont = lst["metadata"].get("continue")
        if not cont:
            return n


# -- switching and probing ------------------------------------------------------------------


def judged_by(kube: Kube, ns: str, lease: str) -> str:
    """Who refuses a labelled ConfigMap without a token (a dry-run create): 'webhook',
    'policy' or 'none' (allowed)."""
    probe = {"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": "mode-probe", "labels": {"fencedlease.io/lease": lease}}}
    try:
        kube.request("POST", f"/api/v1/namespaces/{ns}/configmaps?dryRun=All", probe)
        return "none"
    except lib.ApiError as e:
        text = str(e.body)
        if f'admission webhook "{HOOK}" denied' in text:
            return "webhook"
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
           "_raw": {"protected": lat["protected"], "plain": lat["plain"], "before": before, "after": after}}
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
    return {k: v for k, v in res.items() if k != "_raw"}


def server_added(mode_srv: dict, none_srv: dict, key: str) -> dict:
    a, b = mode_srv.get(key) or {}, none_srv.get(key) or {}
    return {q: (a[q] - b[q]) if a.get(q) is not None and b.get(q) is not None else None
            for q in ("p50", "p90", "p99")}


# -- part 1: no fencing, webhook, policy ------------------------------------------------------


def apiserver(args, kube: Kube, work: Path) -> dict:
    sfx = lib.rand_suffix()
    ns, ctl_ns = f"bench-vap-{sfx}", f"bench-vap-ctl-{sfx}"
    kube.create_namespace(ns, {MODE_LABEL: "none"})
    kube.create_namespace(ctl_ns)
    uid, gen = held_lease(kube, ns, "inventory")
    w = Writer(kube, ns, "inventory", uid, gen)
    policy = install_policy(kube, f"bench-vap-{sfx}", ns, work)
    ctl, _ = start_controller(ns, ctl_ns, "ctl-vap", policy, work)
    wh, port, _, bundle = lib.start_webhook("webhook-vap", work / "logs", work / "certs")
    hook = f"fencedlease-bench-{ns}"
    lib.register_webhook(kube, hook, port, bundle, ns, namespace_labels={MODE_LABEL: "webhook"})
    by_mode: dict[str, list[dict]] = {m: [] for m in MODES}
    switches: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        # The binding (the controller's) and the webhook in effect, each in its mode.
        lib.wait_until(lambda: kube.get_opt(f"{BINDINGS}/{binding_name(policy, ns, 'inventory')}"), 60,
                       "the controller to bind the lease")
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
        if not ctl.alive():
            raise SystemExit(f"the controller exited; see {ctl.logfile}")
    finally:
        kube.request("DELETE", f"/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{hook}",
                     ok=(200, 404))
        lib.stop_all([wh, ctl])
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


# -- part 2: N leases, N bindings -------------------------------------------------------------


def footprint(kube: Kube, settle: float, idle: float, label: str) -> dict:
    """After `settle` s: the API server's and etcd's RSS (five readings over the idle window,
    median and max) and CPU seconds per second while idle; the API server's Go heap."""
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
    log(f"  {label}: kube-apiserver RSS {out['apiserver_rss_mib']:.0f} MiB (heap in use "
        f"{out['apiserver_heap_inuse_mib']:.0f} MiB), idle CPU {out['apiserver_idle_cpu_per_s']:.3f} s/s; "
        f"etcd RSS {out['etcd_rss_mib']:.0f} MiB")
    return out


def wait_reconciled(p: lib.Proc, mport: int, n: int, timeout: float) -> float:
    t0 = time.monotonic()
    next_log = 10.0
    while True:
        try:
            rec = lib.metric_values(lib.http_get(mport, "/metrics"), "fencedlease_controller_reconciles_total")
        except OSError:
            rec = {}
        ok = sum(rec.values())
        el = time.monotonic() - t0
        if ok >= n:
            return el
        if not p.alive():
            raise SystemExit(f"the controller exited; see {p.logfile}")
        if el > timeout:
            raise SystemExit(f"only {ok:.0f}/{n} leases reconciled after {timeout:.0f} s")
        if el >= next_log:
            log(f"  {ok:.0f}/{n} leases reconciled ({el:.0f} s)")
            next_log += 10
        time.sleep(0.2)


def binding_applies(kube: Kube) -> float:
    """Server-side apply requests on bindings so far (the API server's apiserver_request_total)."""
    return sum(v for k, v in lib.metric_values(kube.request("GET", "/metrics"), "apiserver_request_total").items()
               if 'resource="validatingadmissionpolicybindings"' in k and 'verb="APPLY"' in k)


def wait_quiet(kube: Kube, timeout: float) -> float:
    """Until the controller has stopped applying bindings (no apply for 5 s); returns the count."""
    last, since, t0 = binding_applies(kube), time.monotonic(), time.monotonic()
    while time.monotonic() - since < 5:
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"the controller still applies bindings after {timeout:.0f} s")
        time.sleep(1)
        now = binding_applies(kube)
        if now != last:
            last, since = now, time.monotonic()
    return last


def scale(args, kube: Kube, work: Path) -> dict:
    n = args.n
    sfx = lib.rand_suffix()
    ns, ctl_ns = f"bench-vapscale-{sfx}", f"bench-vapscale-ctl-{sfx}"
    kube.create_namespace(ns, {MODE_LABEL: "none"})
    kube.create_namespace(ctl_ns)
    uid, gen = held_lease(kube, ns, "inventory")
    w = Writer(kube, ns, "inventory", uid, gen)
    kube.request("PATCH", f"/api/v1/namespaces/{ns}", {"metadata": {"labels": {MODE_LABEL: "policy"}}},
                 "application/merge-patch+json")
    policy = install_policy(kube, f"bench-vs-{sfx}", ns, work)
    res: dict = {"n": n, "namespace": ns, "policy": policy, "updates": args.updates,
                 "settle_s": args.settle, "idle_s": args.idle}
    ctl, mport = start_controller(ns, ctl_ns, "ctl-vs-1", policy, work)
    procs = [ctl]
    api = proc_pid("kube-apiserver")
    try:
        lib.wait_until(lambda: judged_by(kube, ns, "inventory") == "policy", 60,
                       "the policy to judge the lease's objects (its binding)")
        step("policy-scale: one lease, one binding")
        res["one"] = footprint(kube, args.settle, args.idle, "1 lease, 1 binding")
        one = measure(kube, w, args.updates, args.updates_warmup, "1 binding", args.max_seconds)
        check_server(one, args.updates, "policy", args.expect_fine_buckets)
        res["one"]["writes"] = strip(one)

        step(f"policy-scale: {n} FencedLeases (controller stopped: one binding)")
        ctl.signal(15)
        lib.wait_until(lambda: not ctl.alive(), 30, "the controller to stop")
        names = [f"lease-{i:05d}" for i in range(1, n)]
        c0 = lib.cpu_seconds(api)
        res["create_s"] = lib.create_leases(kube, ns, names, log_every=2000)
        res["create_apiserver_cpu_s"] = lib.cpu_seconds(api) - c0
        res["leases"] = footprint(kube, args.settle, args.idle, f"{n} leases, 1 binding")

        step(f"policy-scale: the controller binds {n} leases")
        a0 = binding_applies(kube)
        c0, t0 = lib.cpu_seconds(api), time.monotonic()
        ctl, mport = start_controller(ns, ctl_ns, "ctl-vs-2", policy, work)
        procs.append(ctl)
        res["reconciled_s"] = wait_reconciled(ctl, mport, n, args.timeout)
        got = lib.wait_until(lambda: (c := count_bindings(kube, policy)) >= n and c, args.timeout,
                             f"{n} bindings", interval=2.0)
        res["bound_s"] = time.monotonic() - t0
        # The API server has loaded the last ones: a write labelled for the last lease is judged.
        lib.wait_until(lambda: judged_by(kube, ns, names[-1]) == "policy", 300,
                       "the API server to judge by the newest bindings", interval=0.5)
        res["judged_s"] = time.monotonic() - t0
        # Then until the controller is done: at the start of its term it applies every binding
        # from its reconciles and again from its first sweep.
        res["binding_applies"] = wait_quiet(kube, args.timeout) - a0
        res["quiet_s"] = time.monotonic() - t0 - 5
        res["bind_apiserver_cpu_s"] = lib.cpu_seconds(api) - c0
        res["bindings"] = got
        log(f"  {got} bindings after {res['bound_s']:.1f} s, in effect after {res['judged_s']:.1f} s, "
            f"the controller done after {res['quiet_s']:.1f} s ({res['binding_applies']:.0f} applies); "
            f"the API server spent {res['bind_apiserver_cpu_s']:.1f} CPU seconds meanwhile")
        res["bound"] = footprint(kube, args.settle, args.idle, f"{n} leases, {got} bindings")
        many = measure(kube, w, args.updates, args.updates_warmup, f"{got} bindings", args.max_seconds)
        check_server(many, args.updates, "policy", args.expect_fine_buckets)
        res["bound"]["writes"] = strip(many)
        if not ctl.alive():
            raise SystemExit(f"the controller exited; see {ctl.logfile}")
    finally:
        lib.stop_all(procs)
        remove_policy(kube, policy)
        # No fencing left on the namespace (its leases stay, as controller-scale's do).
        kube.request("PATCH", f"/api/v1/namespaces/{ns}", {"metadata": {"labels": {MODE_LABEL: "none"}}},
                     "application/merge-patch+json")
    a, b = res["one"], res["bound"]
    res["delta"] = {
        "apiserver_rss_mib_leases": res["leases"]["apiserver_rss_mib"] - a["apiserver_rss_mib"],
        "apiserver_rss_mib_bindings": b["apiserver_rss_mib"] - res["leases"]["apiserver_rss_mib"],
        "apiserver_heap_mib_bindings": b["apiserver_heap_inuse_mib"] - res["leases"]["apiserver_heap_inuse_mib"],
        "apiserver_idle_cpu_per_s_bindings": b["apiserver_idle_cpu_per_s"] - res["leases"]["apiserver_idle_cpu_per_s"],
        "write_added_p50_ms": b["writes"]["added_ms"]["p50"] - a["writes"]["added_ms"]["p50"],
        "write_added_p99_ms": b["writes"]["added_ms"]["p99"] - a["writes"]["added_ms"]["p99"],
    }
    log(f"policy-scale: bindings added {res['delta']['apiserver_rss_mib_bindings']:.0f} MiB RSS to the API "
        f"server ({n} leases alone: {res['delta']['apiserver_rss_mib_leases']:.0f} MiB)")
    return res


# -- part 3: a layout with no binding per lease (issue 37) ----------------------------------


def selector_binding(kube: Kube, policy: str, name: str) -> None:
    """One binding for every lease: paramRef without a namespace (the written object's own) and
    with an empty selector (every FencedLease there), a namespace without any refusing
    (parameterNotFoundAction Deny). The policy judges only the lease the object's label names
    (variables.judged); each of the namespace's leases is evaluated, and the results ANDed."""
    kube.request("POST", BINDINGS, {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name, "labels": {"fencedlease.io/policy": policy_hash(policy)}},
        "spec": {"policyName": policy, "validationActions": ["Deny"],
                 "paramRef": {"selector": {}, "parameterNotFoundAction": "Deny"}}})


def layout(args, kube: Kube, work: Path) -> dict:
    """policy-layout: the binding layout issue 37 proposes, measured before it is built. Stages:
    (1) one lease, the selector binding: writes; (2) the binding removed, leases added in two
    layouts, `per` namespaces of `per` leases (the measured namespace among them) and one
    namespace of `per`*`per`: the API server's footprint; (3) the binding back: footprint (the
    policy machinery's memory is the difference) and writes in each layout. Also what a write
    naming a lease that does not exist meets, in a namespace with leases and in one without."""
    per = args.per
    sfx = lib.rand_suffix()
    ns, big = f"bench-vaplayout-{sfx}", f"bench-vaplayout-big-{sfx}"
    others = [f"bench-vaplayout-{sfx}-{k:03d}" for k in range(1, per)]
    for n in [ns, big, *others]:
        kube.create_namespace(n, {MODE_LABEL: "policy"})
    empty = f"bench-vaplayout-empty-{sfx}"
    kube.create_namespace(empty, {MODE_LABEL: "policy"})
    uid, gen = held_lease(kube, ns, "inventory")
    buid, bgen = held_lease(kube, big, "inventory")
    kube.request("PATCH", f"/api/v1/namespaces/{ns}", {"metadata": {"labels": {MODE_LABEL: "none"}}},
                 "application/merge-patch+json")
    kube.request("PATCH", f"/api/v1/namespaces/{big}", {"metadata": {"labels": {MODE_LABEL: "none"}}},
                 "application/merge-patch+json")
    w, wbig = Writer(kube, ns, "inventory", uid, gen), Writer(kube, big, "inventory", buid, bgen)
    for n in (ns, big):
        kube.request("PATCH", f"/api/v1/namespaces/{n}", {"metadata": {"labels": {MODE_LABEL: "policy"}}},
                     "application/merge-patch+json")
    policy = install_policy(kube, f"bench-vl-{sfx}", ns, work)
    bname = f"bench-vl-{sfx}"
    res: dict = {"per_namespace": per, "namespaces": per, "big_namespace_leases": per * per,
                 "updates": args.updates, "settle_s": args.settle, "idle_s": args.idle}
    try:
        selector_binding(kube, policy, bname)
        lib.wait_until(lambda: judged_by(kube, ns, "inventory") == "policy", 60,
                       "the selector binding to judge the lease's objects")
        step("policy-layout: one lease, one binding for all")
        res["one"] = footprint(kube, args.settle, args.idle, "1 lease, the selector binding")
        one = measure(kube, w, args.updates, args.updates_warmup, "1 lease", args.max_seconds)
        check_server(one, args.updates, "policy", args.expect_fine_buckets)
        res["one"]["writes"] = strip(one)
        res["missing_lease_with_leases"] = judged_by(kube, ns, "no-such-lease")
        res["missing_lease_no_leases"] = judged_by(kube, empty, "no-such-lease")
        log(f"  a write naming a missing lease: {res['missing_lease_with_leases']} where the namespace "
            f"has leases, {res['missing_lease_no_leases']} where it has none")

        step(f"policy-layout: {per} x {per} and 1 x {per * per} FencedLeases, no binding")
        kube.request("DELETE", f"{BINDINGS}/{bname}", ok=(200, 404))
        lib.wait_until(lambda: judged_by(kube, ns, "inventory") == "none", 60, "the binding to go")
        t0 = time.monotonic()
        lib.create_leases(kube, ns, [f"lease-{i:05d}" for i in range(1, per)])
        for n in others:
            lib.create_leases(kube, n, [f"lease-{i:05d}" for i in range(per)], log_every=10**9)
        lib.create_leases(kube, big, [f"lease-{i:05d}" for i in range(1, per * per)], log_every=2000)
        res["create_s"] = time.monotonic() - t0
        res["leases"] = footprint(kube, args.settle, args.idle, f"{2 * per * per} leases, no binding")

        step("policy-layout: the selector binding over them all")
        t0 = time.monotonic()
        selector_binding(kube, policy, bname)
        for n, lease in ((ns, f"lease-{per - 1:05d}"), (big, f"lease-{per * per - 1:05d}")):
            lib.wait_until(lambda: judged_by(kube, n, lease) == "policy", 300,
                           f"the selector binding to judge {n}'s objects", interval=0.5)
        res["judged_s"] = time.monotonic() - t0
        res["bound"] = footprint(kube, args.settle, args.idle, f"{2 * per * per} leases, the selector binding")
        spread = measure(kube, w, args.updates, args.updates_warmup, f"{per} leases in the namespace",
                         args.max_seconds)
        check_server(spread, args.updates, "policy", args.expect_fine_buckets)
        res["bound"]["writes_spread"] = strip(spread)
        one_ns = measure(kube, wbig, args.updates, args.updates_warmup, f"{per * per} leases in the namespace",
                         args.max_seconds)
        check_server(one_ns, args.updates, "policy", args.expect_fine_buckets)
        res["bound"]["writes_one_namespace"] = strip(one_ns)
    finally:
        kube.request("DELETE", f"{BINDINGS}/{bname}", ok=(200, 404))
        remove_policy(kube, policy)
        for n in (ns, big, empty, *others):
            kube.request("PATCH", f"/api/v1/namespaces/{n}", {"metadata": {"labels": {MODE_LABEL: "none"}}},
                         "application/merge-patch+json")
    base = res["one"]["writes"]["server"]["step_validate"]
    res["ratios"] = {
        f"{k}_p99_vs_one": (res["bound"][k]["server"]["step_validate"].get("p99") or 0) / base["p99"]
        for k in ("writes_spread", "writes_one_namespace") if base.get("p99")}
    res["policy_machinery_rss_mib"] = res["bound"]["apiserver_rss_mib"] - res["leases"]["apiserver_rss_mib"]
    log(f"policy-layout: validating step p99 / one lease's: {res['ratios']}; the binding over "
        f"{2 * per * per} leases added {res['policy_machinery_rss_mib']:.0f} MiB RSS to the API server")
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=["apiserver", "scale", "layout"])
    ap.add_argument("--updates", type=int, default=1000, help="measured updates of each kind per measurement")
    ap.add_argument("--updates-warmup", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=1, help="apiserver: rounds of the three modes")
    ap.add_argument("--n", type=int, default=10000, help="scale: FencedLeases (and bindings)")
    ap.add_argument("--per", type=int, default=100,
                    help="layout: PER namespaces of PER leases, and one namespace of PER*PER")
    ap.add_argument("--settle", type=float, default=20, help="scale: seconds before each footprint")
    ap.add_argument("--idle", type=float, default=10, help="scale: seconds of each idle CPU reading")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="scale: stop each part of a latency measurement after this many seconds")
    ap.add_argument("--expect-fine-buckets", action="store_true",
                    help="fail if the API server's admission histograms are not bench/build-apiserver.sh's")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.updates < 1 or args.n < 2:
        raise SystemExit("--updates must be at least 1 and --n at least 2")
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
    parts = {"apiserver": apiserver, "scale": scale, "layout": layout}
    data = parts[args.part](args, kube, work)
    data.update({"benchmark": name, "wall_s": time.monotonic() - started})
    lib.write_result(args.out, name, data)


if __name__ == "__main__":
    main()
