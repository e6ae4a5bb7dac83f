"""The one change of the benchmarks' kube-apiserver (see bench/build-apiserver.sh).

    python3 apiserver_patch.py VERSION METRICS_GO OUT MARK

Reads k8s.io/apiserver's pkg/admission/metrics/metrics.go of Kubernetes VERSION and writes OUT
with finer bucket boundaries for the admission latency histograms (step, controller and webhook:
20 us x 1.15^k, 85 of them, 20 us to 2.5 s) and MARK in the webhook histogram's help text, so that
/metrics (and the binary) say which build it is. Each known version has its own edits, anchored on
that version's text:

- 1.20.2: one shared `latencyBuckets` of 5 ms, 25 ms, 100 ms, 0.5 s, 2.5 s; the help text is a
  format string ("Admission webhook %s, identified by name ...");
- 1.37.2: each histogram names its buckets: step and controller 5 ms, 25 ms, 100 ms, 0.5 s, 1 s,
  2.5 s, the webhook's the same plus 10 s and 25 s (calls slower than 2.5 s land in +Inf here;
  the benchmarks read p50-p99 of calls of a few ms).

Exits non-zero, naming the text, for another version or if a text is not there as expected.
"""

import sys

FINE = "metrics.ExponentialBuckets(0.00002, 1.15, 85)"

# version -> [(old, new, how many times old must occur)]
EDITS = {
    "1.20.2": [
        ("latencyBuckets       = []float64{0.005, 0.025, 0.1, 0.5, 2.5}",
         f"latencyBuckets       = {FINE}", 1),
        ('"Admission webhook %s, identified by name',
         '"Admission webhook %s ({mark}), identified by name', 1),
    ],
    "1.37.2": [
        # step_admission_duration_seconds and controller_admission_duration_seconds
        ("Buckets:        []float64{0.005, 0.025, 0.1, 0.5, 1.0, 2.5},",
         f"Buckets:        {FINE},", 2),
        # webhook_admission_duration_seconds
        ("Buckets:        []float64{0.005, 0.025, 0.1, 0.5, 1.0, 2.5, 10, 25},",
         f"Buckets:        {FINE},", 1),
        ('Help:           "Admission webhook latency histogram in seconds, identified by name',
         'Help:           "Admission webhook latency histogram in seconds ({mark}), identified by name', 1),
    ],
}


def main() -> None:
    version, src, out, mark = sys.argv[1:]
    if version not in EDITS:
        sys.exit(f"apiserver_patch: no edits known for Kubernetes v{version} (known: "
                 f"{', '.join(sorted(EDITS))}); read its pkg/admission/metrics/metrics.go and add them")
    with open(src) as f:
        text = f.read()
    for old, new, count in EDITS[version]:
        if text.count(old) != count:
            sys.exit(f"apiserver_patch: {src} has this text {text.count(old)} times, not {count}: "
                     f"{old!r} (is it Kubernetes v{version}'s metrics.go?)")
        text = text.replace(old, new.replace("{mark}", mark))
    with open(out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
