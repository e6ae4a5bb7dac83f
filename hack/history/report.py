#!/usr/bin/env python3
"""Markdown tables for RELIABILITY.md from kept history runs' summary.json files.

  python3 hack/history/report.py long bench/results/history/long-*/summary.json
  python3 hack/history/report.py runs bench/results/history/*/summary.json
"""
import json
import sys


def n(x):
    return f"{x:,}"


def faults_line(f):
    return ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in sorted(f.items(), key=lambda kv: -kv[1]))


def long(path):
    s = json.load(open(path))
    v, t = s["verdicts"], s["takeovers"]
    rows = [
        ("run", f"seed {s['seed']}, {s['duration_s']:.0f} s of faults, fencing {'on' if s['fenced'] else 'OFF'}"),
        ("faults injected", f"**{n(s['fault_total'])}**: {faults_line(s['faults'])}"),
        ("writes attempted", n(s["writes_attempted"])),
        ("accepted", n(v.get("accepted", 0))),
        ("**stale writes attempted**", f"**{n(s['stale_attempted'])}**, by app: "
         + ", ".join(f"{w} {n(c['attempted'])}" for w, c in sorted(s["stale_by_worker"].items()))),
        ("stale writes refused by the webhook", n(s["stale_refused"])),
        ("**stale writes accepted**", f"**{n(s['stale_accepted'])}**"),
        ("other outcomes", ", ".join(f"{k} {n(c)}" for k, c in sorted(v.items()) if k not in ("accepted", "refused"))),
        ("acknowledged writes lost", n(s["acknowledged_lost"])),
        ("lease generations in the oracle", f"{n(s['oracle']['generations'])} (audit log entries {n(s['oracle']['audit'])}, "
         f"watch relists {s['oracle']['watch_relists']}), none missing"
         if s["checks"]["the lease's history is complete and increasing"] == "pass" else "INCOMPLETE"),
        ("overlap of belief, real clocks", f"{s['overlap_seconds']} s"),
        ("overlap of belief with the fast-clock candidate (reported)", f"{s['overlap_seconds_fast_clock']} s"),
        ("takeovers (last renewal seen → new holder)", f"{n(t['count'])}: p50 {t.get('p50_s')} s, p90 {t.get('p90_s')} s, max {t.get('max_s')} s"),
    ]
    print("| | |\n| --- | --- |")
    for k, val in rows:
        print(f"| {k} | {val} |")
    failed = [k for k, c in s["checks"].items() if c != "pass"]
    print(f"\nChecks: {len(s['checks']) - len(failed)} passed" + (f", FAILED: {', '.join(failed)}" if failed else ", none failed"))


def runs(paths):
    print("| run | fencing | faults | writes | stale attempted | stale refused | stale accepted | acknowledged lost | checks |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for p in paths:
        s = json.load(open(p))
        failed = [k for k, c in s["checks"].items() if c != "pass"]
        print(f"| `{p.rsplit('/', 2)[-2]}` | {'on' if s['fenced'] else 'OFF'} | {n(s['fault_total'])} | {n(s['writes_attempted'])} "
              f"| {n(s['stale_attempted'])} | {n(s['stale_refused'])} | **{n(s['stale_accepted'])}** | {s['acknowledged_lost']} "
              f"| {'all passed' if not failed else 'failed: ' + ', '.join(failed)} |")


if __name__ == "__main__":
    if sys.argv[1] == "long":
        long(sys.argv[2])
    else:
        runs(sys.argv[2:])
