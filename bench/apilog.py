"""The API-load benchmark's request log and the figures computed from it: apiload.py keeps the
log of every request head the counting proxy saw in its two windows, and both it and report.py
compute the figures from that log with `figures` (so every rate in BENCHMARKS.md can be
recomputed from the kept log)."""

from __future__ import annotations

from collections import defaultdict

WRITES = {"update", "patch", "create", "delete"}


def request_log(events, ports: list[int], holder: int, lease_s: int, idle: tuple[int, int],
                failover: tuple[int, int], tail_s: float) -> dict:
    """The log of one run: each request as [ms since its window began, candidate index, verb].
    `events` are the proxy's (t_ns, port, verb, target); `idle` is the idle window (t0, t1) and
    `failover` (t_kill, t_lead) in ns; the failover window runs `tail_s` past the new leader's
    `leading`, for the race's answers."""
    index = {p: i for i, p in enumerate(ports)}

    def window(t0: int, t1: int) -> list[list]:
        return [[round((t - t0) / 1e6, 3), index[p], verb]
                for t, p, verb, _ in events if p in index and t0 <= t < t1]

    (t0, t1), (t_kill, t_lead) = idle, failover
    return {"n": len(ports), "holder": holder, "lease_s": lease_s,
            "idle": {"seconds": (t1 - t0) / 1e9, "requests": window(t0, t1)},
            "failover": {"failover_s": (t_lead - t_kill) / 1e9, "tail_s": tail_s,
                         "requests": window(t_kill, t_lead + int(tail_s * 1e9))}}


def counts(requests: list[list], n: int) -> list[dict[str, int]]:
    """Requests by verb, per candidate."""
    out: list[dict[str, int]] = [defaultdict(int) for _ in range(n)]
    for _, cand, verb in requests:
        out[cand][verb] += 1
    return out


def total(d: dict[str, float], writes_only: bool = False) -> float:
    return sum(v for k, v in d.items() if not writes_only or k in WRITES)


def mean_of(rs: list[dict[str, float]]) -> dict[str, float]:
    verbs = sorted({k for r in rs for k in r})
    n = max(1, len(rs))
    return {v: sum(r.get(v, 0.0) for r in rs) / n for v in verbs}


def figures(log: dict) -> dict:
    """The run's idle and failover figures, from its request log."""
    n, h, lease_s = log["n"], log["holder"], log["lease_s"]
    others = [c for c in range(n) if c != h]
    idle_s = log["idle"]["seconds"]
    idle = counts(log["idle"]["requests"], n)
    rate = [{v: c / idle_s for v, c in d.items()} for d in idle]
    per_cand = [rate[c] for c in others]
    fo = log["failover"]
    fo_s = fo["failover_s"] + fo["tail_s"]
    fo_counts = counts(fo["requests"], n)
    fo_rate = [{v: c / fo_s for v, c in fo_counts[c].items()} for c in others]
    verbs = sorted({v for c in others for v in fo_counts[c]})
    return {
        "idle_window_s": idle_s,
        "idle": {
            "holder_rps": dict(rate[h]),
            "holder_rps_total": total(rate[h]),
            "holder_writes_per_lease": total(rate[h], True) * lease_s,
            "candidate_rps_mean": mean_of(per_cand),
            "candidate_rps_total_mean": sum(total(r) for r in per_cand) / max(1, len(per_cand)),
            "candidate_rps_max": max((total(r) for r in per_cand), default=0.0),
            "candidate_nonwatch_requests": sum(k for c in others for v, k in idle[c].items() if v != "watch"),
            "all_rps": sum(total(r) for r in rate),
        },
        "failover": {
            "window_s": fo_s,
            "failover_s": fo["failover_s"],
            "candidate_rps_mean": mean_of(fo_rate),
            "candidate_rps_total_mean": sum(total(r) for r in fo_rate) / max(1, len(fo_rate)),
            "requests_total": sum(sum(fo_counts[c].values()) for c in others),
            "requests_by_verb": {v: sum(fo_counts[c].get(v, 0) for c in others) for v in verbs},
            "conflicts_note": "PUTs that lost the race are answered 409 and counted as updates",
        },
    }
