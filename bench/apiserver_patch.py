"""The one change of the benchmarks' kube-apiserver (see bench/build-apiserver.sh).

    python3 apiserver_patch.py METRICS_GO OUT MARK

Reads Kubernetes v1.20.2's staging/src/k8s.io/apiserver/pkg/admission/metrics/metrics.go and
writes OUT with finer bucket boundaries for the admission latency histograms (20 us x 1.15^k, 85
of them, up to 2.5 s, instead of 5 ms, 25 ms, 100 ms, 0.5 s, 2.5 s) and MARK in the webhook
histogram's help text, so that /metrics (and the binary) say which build it is. Exits non-zero,
naming the line, if the file is not the expected one.
"""

import sys

EDITS = [
    ("latencyBuckets       = []float64{0.005, 0.025, 0.1, 0.5, 2.5}",
     "latencyBuckets       = metrics.ExponentialBuckets(0.00002, 1.15, 85)"),
    ('"Admission webhook %s, identified by name',
     '"Admission webhook %s ({mark}), identified by name'),
]


def main() -> None:
    src, out, mark = sys.argv[1:]
    with open(src) as f:
        text = f.read()
    for old, new in EDITS:
        if text.count(old) != 1:
            sys.exit(f"{src} does not have this text exactly once: {old!r} (is it Kubernetes v1.20.2?)")
        text = text.replace(old, new.replace("{mark}", mark))
    with open(out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
