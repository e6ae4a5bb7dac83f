"""Shared pieces of the benchmark harness (Python 3.11 standard library only).

- log() with a heartbeat thread that prints the current step every 30 s at least;
- Kube: hack/kubeclient.py's API client as the bench cluster's admin (ApiError comes from there);
- Procs: processes started in their own session, all killed at exit (nothing left behind);
- percentiles, JSON-lines event files, result writing.
"""

from __future__ import annotations

import atexit
import base64
import calendar
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO / "hack"))
import kubeclient  # noqa: E402  (hack/kubeclient.py: the API client bench/ and hack/history/ share)
from kubeclient import ApiError  # noqa: E402  (also re-exported: benchmarks catch lib.ApiError)
import percentiles  # noqa: E402  (bench/percentiles.py, shared with report.py)

CLUSTER_DIR = Path(os.environ.get("FENCEDLEASE_CLUSTER_DIR", "/tmp/fencedlease-bench-cluster"))
API_PORT = int(os.environ.get("FL_APISERVER_PORT", "28443"))
CACHE = Path(os.environ.get("FL_BENCH_CACHE", Path.home() / ".cache/fencedlease/bench"))
WORK = Path(os.environ.get("FL_BENCH_WORK", "/tmp/fencedlease-bench-work"))
# bench/run.sh's private copies of this run's binaries (the instance's work folder: a build or
# another instance's run cannot replace them while the benchmarks run).
BIN = Path(os.environ.get("FL_BENCH_BINDIR", WORK / "bin"))
FENCEDLEASE = Path(os.environ.get("FL_BENCH_BIN", BIN / "fencedlease"))
PEER = Path(os.environ.get("FL_BENCH_PEER", CACHE / "leader-election-peer"))

# ---------------------------------------------------------------------------------------------
# progress

_last_print = time.monotonic()
_step = "starting"
_step_started = time.monotonic()
_lock = threading.Lock()


def version() -> str:
    """The project's one version: Cargo.toml's [workspace.package] version."""
    import tomllib
    with open(REPO / "Cargo.toml", "rb") as f:
        return tomllib.load(f)["workspace"]["package"]["version"]


def log(msg: str) -> None:
    global _last_print
    with _lock:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
        _last_print = time.monotonic()


def step(name: str) -> None:
    """Names what runs now; the heartbeat repeats it when nothing else was printed."""
    global _step, _step_started
    _step, _step_started = name, time.monotonic()
    log(name)


def _heartbeat() -> None:
    while True:
        time.sleep(5)
        if time.monotonic() - _last_print >= 25:
            log(f"  ... {_step} ({time.monotonic() - _step_started:.0f} s)")


threading.Thread(target=_heartbeat, daemon=True).start()

# ---------------------------------------------------------------------------------------------
# numbers (bench/percentiles.py; here so that benchmarks write lib.pct, lib.stats)

pct, stats, pct_ci, bootstrap_ci = percentiles.pct, percentiles.stats, percentiles.pct_ci, percentiles.bootstrap_ci


# ---------------------------------------------------------------------------------------------
# a process's CPU and memory, from /proc

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process (its threads, ended ones included), in seconds, at a tick's
    (10 ms) resolution; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / TICK
    except (OSError, IndexError, ValueError):
        return None


def cpu_ns(pid: int) -> int:
    """Time on a CPU of the process's live threads, from the scheduler (nanoseconds): finer than
    cpu_seconds' ticks, which an idle process barely moves in a minute. A thread that ends within
    a window takes its time with it: compare windows of a process whose threads persist."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:
            pass  # a thread that ended meanwhile
    return total


def proc_status_kib(pid: int, *keys: str, source: str = "status") -> dict[str, int]:
    """Fields given in kB of /proc/PID/status (VmRSS, VmHWM, RssAnon, RssFile, ...) or, with
    source="smaps_rollup", of the mapping totals (Pss, Pss_Anon, Pss_File, ...); 0 if absent."""
    out = dict.fromkeys(keys, 0)
    with open(f"/proc/{pid}/{source}") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in out:
                out[key] = int(line.split()[1])
    return out


def now_ns() -> int:
    return time.time_ns()


# ---------------------------------------------------------------------------------------------
# the API server


def admin_token() -> str:
    return (CLUSTER_DIR / "pki/admin.token").read_text().strip()


def ca_file() -> Path:
    return CLUSTER_DIR / "pki/ca.crt"


def kubeconfig() -> Path:
    return CLUSTER_DIR / "kubeconfig"


# Every namespace a benchmark makes carries BENCH_NS_LABEL=true (create_namespace); settle.py
# deletes them by it between benchmarks.
BENCH_NS_LABEL = "fencedlease.io/bench"


class Kube(kubeclient.Kube):
    """hack/kubeclient.py's client (a keep-alive connection per thread), authenticated as the
    bench cluster's admin: Kube() for the bench API server, Kube(port) for another port."""

    def __init__(self, port: int = API_PORT):
        super().__init__(f"https://127.0.0.1:{port}", admin_token(), ca_file().read_text())

    def create_namespace(self, name: str, labels: dict[str, str] | None = None) -> None:
        body = {"apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": name, "labels": {BENCH_NS_LABEL: "true",
                                                      "fencedlease.io/bench-ns": name,
                                                      **(labels or {})}}}
        try:
            self.request("POST", "/api/v1/namespaces", body)
        except ApiError as e:
            if e.status != 409:
                raise


def fl_path(ns: str, name: str | None = None) -> str:
    p = f"/apis/fencedlease.io/v1alpha1/namespaces/{ns}/fencedleases"
    return p if name is None else f"{p}/{name}"


def create_leases(kube: "Kube", ns: str, names: list[str], log_every: int = 1000) -> float:
    """Creates a held FencedLease (a one-hour lease, holder "holder-NAME") per name in ns, eight
    at a time (one that exists already counts); the seconds it took."""
    t0 = time.monotonic()
    done = [0]

    def one(name: str) -> None:
        body = {"apiVersion": "fencedlease.io/v1alpha1", "kind": "FencedLease", "metadata": {"name": name},
                "spec": {"holderIdentity": f"holder-{name}", "leaseDurationSeconds": 3600}}
        try:
            kube.request("POST", fl_path(ns), body)
        except ApiError as e:
            if e.status != 409:
                raise
        done[0] += 1
        if done[0] % log_every == 0:
            log(f"  created {done[0]}/{len(names)} FencedLeases")

    with ThreadPoolExecutor(8) as ex:
        list(ex.map(one, names))
    return time.monotonic() - t0


def lease_path(ns: str, name: str) -> str:
    return f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{name}"


def parse_time_ns(s: str | None) -> int | None:
    """RFC 3339 with up to nanosecond fraction, as the API server writes MicroTime, to Unix ns."""
    if not s:
        return None
    s = s.rstrip("Z")
    base, _, frac = s.partition(".")
    t = time.strptime(base, "%Y-%m-%dT%H:%M:%S")
    secs = calendar.timegm(t)
    frac_ns = int((frac + "000000000")[:9]) if frac else 0
    return secs * 1_000_000_000 + frac_ns


def kubectl(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["kubectl", "--kubeconfig", str(kubeconfig()), *args],
                          capture_output=True, text=True, check=check)


def install_crd() -> None:
    # The CRD the server takes: with validation rules from Kubernetes 1.25, without before.
    crd = subprocess.run([str(FENCEDLEASE), "crd", "--for-server"], capture_output=True, text=True,
                         check=True, env=dict(os.environ, KUBECONFIG=str(kubeconfig()))).stdout
    subprocess.run(["kubectl", "--kubeconfig", str(kubeconfig()), "apply", "--server-side",
                    "--force-conflicts", "--field-manager=fencedlease-bench", "-f", "-"],
                   input=crd, capture_output=True, text=True, check=True)
    kubectl("wait", "--for=condition=Established", "--timeout=60s",
            "crd/fencedleases.fencedlease.io")


def write_kubeconfig(path: Path, server: str, ca_pem: bytes) -> None:
    import base64

    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "c", "cluster": {
            "server": server, "certificate-authority-data": base64.b64encode(ca_pem).decode()}}],
        "users": [{"name": "u", "user": {"token": admin_token()}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "c",
    }))
    path.chmod(0o600)


# ---------------------------------------------------------------------------------------------
# processes

_procs: list["Proc"] = []


class Proc:
    """A process in a session of its own (so that a group signal reaches its children)."""

    def __init__(self, name: str, argv: list[str], logdir: Path, env: dict[str, str] | None = None,
                 events: Path | None = None, cpus: str | None = None):
        self.name = name
        self.events = events
        self.started_ns = now_ns()
        logdir.mkdir(parents=True, exist_ok=True)
        self.logfile = logdir / f"{name}.log"
        if cpus:
            argv = ["taskset", "-c", cpus, *argv]
        full_env = {**os.environ, **(env or {})}
        with open(self.logfile, "ab") as out:
            self.p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=full_env,
                                      start_new_session=True)
        _procs.append(self)
        WORK.mkdir(parents=True, exist_ok=True)
        with open(WORK / "pids", "a") as f:  # for run.sh's safety net
            f.write(f"{self.p.pid}\n")

    @property
    def pid(self) -> int:
        return self.p.pid

    def alive(self) -> bool:
        return self.p.poll() is None

    def signal(self, sig: int) -> None:
        try:
            os.kill(self.p.pid, sig)
        except ProcessLookupError:
            pass

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.p.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM (resuming it first), then SIGKILL of the whole group."""
        if self.alive():
            self.signal_group(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.signal_group(signal.SIGKILL)
        try:
            self.p.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def read_events(self) -> list[dict[str, Any]]:
        return read_jsonl(self.events) if self.events else []

    def rss_kib(self) -> tuple[int, int]:
        """(VmRSS, VmHWM) in KiB."""
        st = proc_status_kib(self.p.pid, "VmRSS", "VmHWM")
        return st["VmRSS"], st["VmHWM"]


def stop_all(procs: Iterable[Proc] | None = None) -> None:
    targets = list(procs) if procs is not None else list(_procs)
    for p in targets:
        if p.alive():
            p.signal_group(signal.SIGCONT)
            p.signal_group(signal.SIGKILL)
    for p in targets:
        try:
            p.p.wait(5)
        except subprocess.TimeoutExpired:
            pass
        if p in _procs:
            _procs.remove(p)


atexit.register(stop_all)


def _on_signal(sig, _frame):
    stop_all()
    sys.exit(128 + sig)


signal.signal(signal.SIGTERM, _on_signal)
signal.signal(signal.SIGINT, _on_signal)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        pass  # a line being written
    except FileNotFoundError:
        pass
    return out


def wait_until(pred, timeout: float, what: str, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def write_result(outdir: Path, name: str, data: dict[str, Any]) -> Path:
    outdir.mkdir(parents=True, exist_ok=True)
    p = outdir / f"{name}.json"
    p.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    log(f"wrote {p}")
    return p


def keep_samples(outdir: Path, relname: str, ms: dict[str, list[float]], extra: dict | None = None) -> str:
    """Writes per-request samples (ms by kind, rounded to 1 us) and `extra` (histograms read
    before and after) to outdir/relname, gzipped JSON, for report.py to recompute every
    percentile and interval from; returns relname, for the result to name it."""
    import gzip
    path = outdir / relname
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"ms": {k: [round(x, 3) for x in v] for k, v in ms.items()}, **(extra or {})}
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    return relname


def hist_json(h: dict) -> dict[str, float]:
    """A histogram {le: count} with string keys, as JSON keeps them."""
    return {str(k): v for k, v in h.items()}


def rand_suffix() -> str:
    return f"{random.getrandbits(32):08x}"


def webhook_certs(outdir: Path, hosts: list[str] | None = None) -> str:
    """`fencedlease certs` for `hosts` (default 127.0.0.1); returns the caBundle (base64)."""
    names = [a for h in (hosts or ["127.0.0.1"]) for a in ("--host", h)]
    r = subprocess.run([str(FENCEDLEASE), "certs", "--out", str(outdir), *names],
                       capture_output=True, text=True, check=True)
    return r.stdout.strip()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def register_webhook(kube: Kube, name: str, port: int | None, bundle: str, ns_label: str,
                     namespace_labels: dict[str, str] | None = None,
                     service: dict | None = None) -> None:
    """A ValidatingWebhookConfiguration for labelled ConfigMaps in namespaces labelled
    fencedlease.io/bench-ns=<ns_label> (or, if given, `namespace_labels`), as the project's tests
    and demo register it: at https://127.0.0.1:<port>/validate, or at `service` (a clientConfig
    service reference, as the chart registers it)."""
    target = {"service": service} if service else {"url": f"https://127.0.0.1:{port}/validate"}
    body = {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [{
            "name": "fencing.fencedlease.io",
            "admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": "Fail",
            "timeoutSeconds": 5,
            "clientConfig": {**target, "caBundle": bundle},
            "namespaceSelector": {"matchLabels": namespace_labels or {"fencedlease.io/bench-ns": ns_label}},
            "objectSelector": {"matchExpressions": [
                {"key": "fencedlease.io/lease", "operator": "Exists"}]},
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
                       "resources": ["configmaps"], "scope": "Namespaced"}],
        }],
    }
    path = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"
    try:
        kube.request("DELETE", f"{path}/{name}", ok=(200, 404))
    except ApiError:
        pass
    kube.request("POST", path, body)


def wait_webhook_effective(kube: Kube, ns: str) -> None:
    """Until a labelled ConfigMap without a token is refused by our webhook."""
    probe = {"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": "webhook-probe", "labels": {"fencedlease.io/lease": "probe"}}}

    def refused() -> bool:
        try:
            kube.request("POST", f"/api/v1/namespaces/{ns}/configmaps", probe)
            kube.request("DELETE", f"/api/v1/namespaces/{ns}/configmaps/webhook-probe")
            return False
        except ApiError as e:
            return "fencedlease" in str(e.body)

    wait_until(refused, 30, "the webhook to be in effect", interval=0.3)


def start_webhook(name: str, logdir: Path, certdir: Path, cpus: str | None = None,
                  extra_args: list[str] | None = None, host: str = "127.0.0.1",
                  cert_names: list[str] | None = None) -> tuple[Proc, int, int, str]:
    """`fencedlease webhook` on host:PORT with a certificate for `cert_names` (default: the
    host), its metrics on 127.0.0.1; (process, port, metrics port, caBundle). With certificates
    in certdir already (a second replica), it serves those."""
    if (certdir / "tls.crt").exists():
        bundle = base64.b64encode((certdir / "ca.crt").read_bytes()).decode()
    else:
        bundle = webhook_certs(certdir, cert_names or [host])
    port, mport = free_port(), free_port()
    p = Proc(name, [str(FENCEDLEASE), "webhook", "--listen", f"{host}:{port}",
                    "--tls-cert", str(certdir / "tls.crt"), "--tls-key", str(certdir / "tls.key"),
                    "--metrics-addr", f"127.0.0.1:{mport}", *(extra_args or [])],
             logdir, env={"KUBECONFIG": str(kubeconfig()), "RUST_LOG": "warn"}, cpus=cpus)

    def ready() -> bool:
        try:
            c = http.client.HTTPConnection("127.0.0.1", mport, timeout=1)
            c.request("GET", "/readyz")
            return c.getresponse().status == 200
        except OSError:
            return False

    wait_until(ready, 30, "the webhook to be ready", interval=0.2)
    return p, port, mport, bundle


def http_get(port: int, path: str) -> str:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    c.request("GET", path)
    return c.getresponse().read().decode()


def metric_values(text: str, name: str) -> dict[str, float]:
    """Prometheus text: {'label-string': value} for samples of metric `name` (exact name)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        rest = line[len(name):]
        if rest and rest[0] not in "{ ":
            continue
        key, _, val = rest.rpartition(" ")
        try:
            out[key.strip()] = float(val)
        except ValueError:
            pass
    return out


def machine_info() -> dict[str, Any]:
    def sh(cmd: str) -> str:
        r = subprocess.run(cmd, shell=True, capture_output=True, text=True)
        return r.stdout.strip()

    mem_kib = int(sh("awk '/MemTotal/{print $2}' /proc/meminfo") or 0)
    # The binaries the cluster runs: what bench/run.sh handed hack/cluster.sh, else the default.
    bins = (os.environ.get("KUBEBUILDER_ASSETS")
            or f"{Path.home()}/.cache/fencedlease/k8s-{os.environ.get('FL_K8S_VERSION', '1.37.2')}/bin")
    return {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "nproc": os.cpu_count(),
        "cpu_model": sh("awk -F': ' '/model name/{print $2; exit}' /proc/cpuinfo"),
        "mem_gib": round(mem_kib / 1024 / 1024, 1),
        "kernel": sh("uname -sr"),
        "loadavg": sh("cat /proc/loadavg"),
        "rustc": sh("rustc --version"),
        "go": sh("go version"),
        "python": sys.version.split()[0],
        "kube_apiserver": sh(f"{bins}/kube-apiserver --version"),
        # bench/build-apiserver.sh's build (finer admission latency buckets) or another one.
        "kube_apiserver_path": str(Path(bins, "kube-apiserver").resolve()),
        "etcd": sh(f"{bins}/etcd --version | head -1"),
        "fencedlease_commit": sh(f"git -C {REPO} rev-parse --short HEAD"),
        "fencedlease_dirty_files": sh(f"git -C {REPO} status --porcelain -- src elector Cargo.toml | wc -l"),
    }


def versions() -> dict[str, Any]:
    """Which server and which client-go peer this run measures: the running API server's own
    /version, and the peer's release (bench/build-peer.sh, FL_BENCH_PEER_VERSION) and Go."""
    v = Kube().request("GET", "/version")
    release = os.environ.get("FL_BENCH_PEER_VERSION", "")
    minor, _, patch = release.partition(".")[2].partition(".")
    built = subprocess.run(["go", "version", str(PEER)], capture_output=True, text=True).stdout.strip()
    return {
        "server": f"kube-apiserver {v.get('gitVersion')}",
        "server_version": v,
        "kubernetes": (v.get("gitVersion") or "").lstrip("v"),
        "peer": f"client-go v0.{minor}.{patch} (Kubernetes v{release})" if release else "client-go (unknown release)",
        "peer_release": release or None,
        "peer_binary": str(PEER),
        # `go version BINARY`: the Go release that built the peer.
        "peer_go": built.rpartition(": ")[2] or None,
    }
