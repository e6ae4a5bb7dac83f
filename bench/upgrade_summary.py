#!/usr/bin/env python3
"""Summarizes bench/upgrade.sh's runs: python3 bench/upgrade_summary.py RUN.json...

Per run: the holder's writes and how many were refused, the longest stretch from the holder's
last accepted write before a refusal to its next accepted one, the refusals' reasons, and the
stale writes sent and accepted (which must be 0). Prints a Markdown table.
"""
import json
import sys


def stretches(writes):
    """(start_ms, length_ms, refused) of each run of refused writes between accepted ones."""
    out, last_ok, refused = [], None, 0
    for w in writes:
        if w["error"] is None:
            if last_ok is not None and refused:
                out.append((last_ok, w["at_ms"] - last_ok, refused))
            last_ok, refused = w["at_ms"], 0
        else:
            refused += 1
    return out


def reason(error):
    if "connection refused" in error:
        return "webhook not answering (connection refused)"
    if "stale token" in error or "token" in error:
        return "fencing refusal"
    return error[:80]


def main(paths):
    print("| run | holder writes | refused | longest refused stretch | reasons | stale writes | stale accepted | rollout up / down |")
    print("|---|---|---|---|---|---|---|---|")
    for path in paths:
        doc = json.load(open(path))
        holder, stale = doc["holder"], doc["stale"]
        refused = [w for w in holder if w["error"]]
        longest = max((s[1] for s in stretches(holder)), default=0.0)
        reasons = sorted({reason(w["error"]) for w in refused}) or ["-"]
        marks = {m["mark"]: m["at_ms"] for m in doc["marks"]}
        up = [v for k, v in marks.items() if k.startswith("rolled out")]
        starts = [v for k, v in marks.items() if k.startswith("helm upgrade")]
        rollouts = " / ".join(f"{(u - s) / 1000:.1f} s" for s, u in zip(starts, up))
        stale_ok = sum(1 for w in stale if w["error"] is None)
        print(f"| {path.rsplit('/', 1)[-1]} | {len(holder)} | {len(refused)} | {longest:.0f} ms | "
              f"{'; '.join(reasons)} | {len(stale)} | {stale_ok} | {rollouts} |")


if __name__ == "__main__":
    main(sys.argv[1:])
