"""Between two benchmarks: deletes every namespace a benchmark made (label fencedlease.io/bench)
and waits until the API server has removed them and all they held, so that the next benchmark
starts on a server without the last one's objects or processes' pods.

Why: the first complete `bench/run.sh --full` in one go (2026-12-02,
bench/results/full-20261202T000756Z) ran its last benchmarks beside the 21,010 FencedLeases that
policy-scale and controller-scale had left, and many-leases flapped there as it had not alone
(BENCHMARKS.md, at its top).

Usage: settle.py [--timeout SECONDS]   exits 1 if namespaces remain after the timeout
"""

from __future__ import annotations

import argparse
import sys
import time

import lib
from lib import ApiError, Kube, log

SELECTOR = f"{lib.BENCH_NS_LABEL}=true"


def bench_namespaces(kube: Kube) -> list[tuple[str, str]]:
    """(name, phase) of every namespace a benchmark made."""
    items = kube.request("GET", f"/api/v1/namespaces?labelSelector={SELECTOR}")["items"]
    return [(n["metadata"]["name"], n.get("status", {}).get("phase", "")) for n in items]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args()
    kube = Kube()
    t0 = time.monotonic()
    left = bench_namespaces(kube)
    for name, phase in left:
        if phase != "Terminating":
            try:
                kube.request("DELETE", f"/api/v1/namespaces/{name}", ok=(200, 202))
            except ApiError as e:
                if e.status != 404:
                    raise
    last_note = t0
    while left:
        if time.monotonic() - t0 > args.timeout:
            log(f"settle: {len(left)} namespace(s) still there after {args.timeout:.0f} s: "
                f"{', '.join(n for n, _ in left)}; see why with kubectl get ns NAME -o yaml "
                f"(status.conditions), KUBECONFIG={lib.kubeconfig()}")
            return 1
        if time.monotonic() - last_note >= 30:
            log(f"settle: waiting for {len(left)} namespace(s) to go "
                f"({time.monotonic() - t0:.0f} s): {', '.join(n for n, _ in left[:4])}")
            last_note = time.monotonic()
        time.sleep(1)
        left = bench_namespaces(kube)
    log(f"settle: the benchmarks' namespaces are gone ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
