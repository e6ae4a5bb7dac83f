"""What one /mutate request costs the webhook in memory (issue 14): the growth of its peak RSS
(VmHWM in /proc/PID/status) over one request, for an ordinary pod and for pathological 8 MiB
AdmissionReviews. The server's byte budget assumes a request costs about its body's bytes.

Every case gets a fresh `fencedlease webhook` (VmHWM only ever grows), started as the tests
start it: `fencedlease certs` for 127.0.0.1, then `fencedlease webhook --listen 127.0.0.1:PORT
--tls-cert ... --tls-key ... --metrics-addr 127.0.0.1:0`. /mutate reads no API server, but the
webhook asks one for its version at start: the local test cluster (hack/cluster.sh up).

    cargo build --bin fencedlease            # the debug binary, as measured in 7003028
    hack/cluster.sh up
    python3 bench/webhook_memory.py [--bin target/debug/fencedlease] [--mib 8] [CASE ...]

A webhook that runs out of its address-space limit (--limit-mib, so that a pathological case
cannot take the machine's memory) is reported as "died".
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import resource
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KUBECONFIG = Path(os.environ.get("FENCEDLEASE_CLUSTER_DIR", "/tmp/fencedlease-cluster")) / "kubeconfig"
LEASE = "fencedlease.io/lease"


def review(pod: dict) -> bytes:
    """An AdmissionReview creating `pod`, compact."""
    return json.dumps({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "shop", "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            "object": pod, "dryRun": False}}, separators=(",", ":")).encode()


def pod(spec: dict, annotations: dict | None = None) -> dict:
    a = {LEASE: "db"}
    a.update(annotations or {})
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "web-1", "namespace": "shop", "annotations": a}, "spec": spec}


def filled(template: dict, item: str, size: int, members: bool = False) -> bytes:
    """The review of `template` grown to `size` bytes: its string "@X@" becomes an array of
    copies of `item`; or with `members`, its member "@X@":"" becomes members
    `item.format(i)` (distinct keys)."""
    base = review(template)
    if members:
        parts, total, i = [], len(base), 0
        while total + len(item) + 8 < size:
            parts.append(item.format(i))
            total += len(parts[-1]) + 1
            i += 1
        return base.replace(b'"@X@":""', ",".join(parts).encode())
    n = max(0, (size - len(base)) // (len(item) + 1))
    return base.replace(b'"@X@"', ("[" + ",".join([item] * n) + "]").encode())


def cases(size: int) -> dict[str, bytes]:
    app = {"name": "app", "image": "app:1"}
    one = {"containers": [app]}
    return {
        "ordinary": review(pod({"containers": [app, {"name": "b", "image": "b:1"}]})),
        # A field this build does not know, full of empty arrays or objects.
        "unknown-empty-arrays": filled(pod({**one, "future": "@X@"}), "[]", size),
        "unknown-empty-objects": filled(pod({**one, "future": "@X@"}), "{}", size),
        "tiny-annotations": filled(pod(one, {"@X@": ""}), '"{}":""', size, members=True),
        "empty-containers": filled(pod({"containers": "@X@"}), "{}", size),
        "empty-init-containers": filled(pod({**one, "initContainers": "@X@"}), "{}", size),
        "empty-volumes": filled(pod({**one, "volumes": "@X@"}), "{}", size),
        "empty-env": filled(pod({"containers": [{**app, "env": "@X@"}]}), "{}", size),
    }


def vm(pid: int, key: str) -> int:
    """A field of /proc/PID/status, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, ca: Path, body: bytes, timeout: float = 300) -> tuple[int, bytes]:
    ctx = ssl.create_default_context(cafile=str(ca))
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=timeout)
    try:
        conn.request("POST", "/mutate", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def wait_listening(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the webhook exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("the webhook did not listen")


def outcome(status: int, text: bytes) -> str:
    try:
        resp = json.loads(text)["response"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}, {len(text)} bytes"
    if resp.get("patch"):
        return f"injected, answer {len(text)} bytes"
    if resp.get("allowed"):
        return "allowed"
    return "refused: " + resp.get("status", {}).get("message", "")[:90]


def measure(binary: Path, name: str, body: bytes, limit_mib: int) -> dict:
    """One fresh webhook, one request: VmHWM before and after, in KiB."""
    with tempfile.TemporaryDirectory(prefix="fl-mem-") as tmp:
        d = Path(tmp)
        subprocess.run([str(binary), "certs", "--out", str(d), "--host", "127.0.0.1"],
                       check=True, capture_output=True)
        port = free_port()
        limit = limit_mib * 1024 * 1024

        def limited():
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

        env = {**os.environ, "KUBECONFIG": str(KUBECONFIG), "RUST_LOG": "warn"}
        with open(d / "webhook.log", "wb") as log:
            proc = subprocess.Popen(
                [str(binary), "webhook", "--listen", f"127.0.0.1:{port}",
                 "--tls-cert", str(d / "tls.crt"), "--tls-key", str(d / "tls.key"),
                 "--metrics-addr", "127.0.0.1:0"],
                env=env, stdout=log, stderr=log, preexec_fn=limited)
        try:
            wait_listening(port, proc)
            time.sleep(2)  # let the start (client, watch, first probe) settle
            before = vm(proc.pid, "VmHWM")
            try:
                status, text = post(port, d / "ca.crt", body)
                what = outcome(status, text)
            except (OSError, http.client.HTTPException) as e:
                what = f"no answer ({e.__class__.__name__})"
            time.sleep(0.5)
            if proc.poll() is not None:
                log_text = (d / "webhook.log").read_text(errors="replace")
                why = next((ln.strip() for ln in log_text.splitlines()
                            if "memory allocation" in ln or "panicked" in ln), "")
                return {"case": name, "body": len(body), "before": before, "after": None,
                        "outcome": f"died (exit {proc.returncode}) {why[:100]}"}
            after = vm(proc.pid, "VmHWM")
            return {"case": name, "body": len(body), "before": before, "after": after,
                    "outcome": what}
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", type=Path, default=ROOT / "target/debug/fencedlease")
    ap.add_argument("--mib", type=float, default=8, help="size of the pathological bodies")
    ap.add_argument("--limit-mib", type=int, default=4096,
                    help="the webhook's address-space limit (RLIMIT_AS)")
    ap.add_argument("--json", action="store_true", help="one JSON object per case")
    ap.add_argument("case", nargs="*", help="cases to run (default: all)")
    args = ap.parse_args()
    size = int(args.mib * 1024 * 1024) - 1024  # within --max-body with room for rounding
    all_cases = cases(size)
    names = args.case or list(all_cases)
    for name in names:
        r = measure(args.bin, name, all_cases[name], args.limit_mib)
        if args.json:
            print(json.dumps(r), flush=True)
            continue
        mib = lambda k: f"{k / 1024:7.1f}" if k is not None else "      -"
        grew = (r["after"] - r["before"]) / 1024 if r["after"] is not None else None
        grew_s = f"{grew:+7.1f}" if grew is not None else "      -"
        print(f"{name:24} body {r['body'] / 2**20:5.2f} MiB  VmHWM {mib(r['before'])} -> "
              f"{mib(r['after'])} MiB ({grew_s} MiB)  {r['outcome']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
