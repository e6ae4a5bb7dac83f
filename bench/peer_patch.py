"""Rewrites client-go's leader-election example for the benchmarks (see build-peer.sh).

Usage: peer_patch.py VERSION SRC_MAIN_GO OUT_MAIN_GO, VERSION the Kubernetes release of the
example (client-go v0.MINOR.PATCH for 1.MINOR.PATCH). Each change is anchored on the example's
text; the anchors below were checked against the examples of the releases in KNOWN (v1.37.2's
example differs from v1.20.2's only in its logging, a never-led check in OnStoppedLeading and an
atomic flag, none of it anchored on). Another version, or a missing anchor, fails instead of
guessing.
"""

import sys

# Our additions, in Go. Only glue: flags and one JSON line per callback.
HELPER = '''
// Added for fencedlease's benchmarks: one JSON line per leadership change.
func flEvent(path, id, ev string) {
	if path == "" {
		return
	}
	f, err := os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0644)
	if err != nil {
		return
	}
	fmt.Fprintf(f, "{\\"t_ns\\":%d,\\"identity\\":%q,\\"event\\":%q}\\n", time.Now().UnixNano(), id, ev)
	f.Close()
}

func main() {'''

EDITS = [
    ('import (\n\t"context"\n', 'import (\n\t"context"\n\t"fmt"\n'),
    ("\nfunc main() {", HELPER),
    (
        '\tflag.Parse()\n',
        '\tvar leaseDuration, renewDeadline, retryPeriod time.Duration\n'
        '\tvar eventsFile string\n'
        '\tflag.DurationVar(&leaseDuration, "lease-duration", 15*time.Second, "LeaseDuration")\n'
        '\tflag.DurationVar(&renewDeadline, "renew-deadline", 10*time.Second, "RenewDeadline")\n'
        '\tflag.DurationVar(&retryPeriod, "retry-period", 2*time.Second, "RetryPeriod")\n'
        '\tflag.StringVar(&eventsFile, "events-file", "", "append JSON lines on leadership changes")\n'
        '\tflag.Parse()\n',
    ),
    ("LeaseDuration:   60 * time.Second,", "LeaseDuration:   leaseDuration,"),
    ("RenewDeadline:   15 * time.Second,", "RenewDeadline:   renewDeadline,"),
    ("RetryPeriod:     5 * time.Second,", "RetryPeriod:     retryPeriod,"),
    (
        "OnStartedLeading: func(ctx context.Context) {\n",
        "OnStartedLeading: func(ctx context.Context) {\n"
        '\t\t\t\tflEvent(eventsFile, id, "leading")\n',
    ),
    (
        "OnStoppedLeading: func() {\n",
        "OnStoppedLeading: func() {\n" '\t\t\t\tflEvent(eventsFile, id, "stopped")\n',
    ),
]


KNOWN = ("1.20.2", "1.37.2")


def main() -> None:
    version, src, out = sys.argv[1:]
    if version not in KNOWN:
        sys.exit(f"peer_patch: the example of Kubernetes v{version} was not checked (known: "
                 f"{', '.join(KNOWN)}); compare it with those and add it to KNOWN")
    text = open(src, encoding="utf-8").read()
    for old, new in EDITS:
        if text.count(old) != 1:
            sys.exit(f"peer_patch: anchor not found exactly once in {src} (v{version}): {old!r}")
        text = text.replace(old, new)
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    main()
