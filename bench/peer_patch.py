"""Rewrites client-go's leader-election example for the benchmarks (see build-peer.sh).

Usage: peer_patch.py SRC_MAIN_GO OUT_MAIN_GO. Each change is anchored on text of the v1.20.2
example; if an anchor is missing (another version), it fails instead of guessing.
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


def main() -> None:
    src, out = sys.argv[1], sys.argv[2]
    text = open(src, encoding="utf-8").read()
    for old, new in EDITS:
        if text.count(old) != 1:
            sys.exit(f"peer_patch: anchor not found exactly once in {src}: {old!r}")
        text = text.replace(old, new)
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    main()
