"""Percentiles and their bootstrap intervals: the benchmarks' numbers, and the report's (which
must not import lib.py: lib starts a progress thread and reads the bench cluster's settings).
Python 3.11 standard library only."""

from __future__ import annotations

import random
from typing import Any, Iterable


def pct(values: Iterable[float], p: float) -> float | None:
    """Percentile with linear interpolation between closest ranks (numpy's default)."""
    v = sorted(values)
    if not v:
        return None
    k = (len(v) - 1) * p / 100.0
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def stats(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "min": min(values),
        "p50": pct(values, 50),
        "p90": pct(values, 90),
        "p99": pct(values, 99),
        "max": max(values),
        "mean": sum(values) / len(values),
    }


BOOTSTRAP_RESAMPLES = 400
BOOTSTRAP_SEED = 20261130  # fixed: the same data always gives the same interval


def pct_ci(values: list[float], p: float, n: int = BOOTSTRAP_RESAMPLES) -> list[float] | None:
    """95 % percentile-bootstrap interval of pct(values, p). With ~100 trials the p99's interval
    runs from about the 96th value to the largest: say so rather than trust the point."""
    if len(values) < 2:
        return None
    rng = random.Random(BOOTSTRAP_SEED)
    qs = sorted(pct(rng.choices(values, k=len(values)), p) for _ in range(n))
    return [pct(qs, 2.5), pct(qs, 97.5)]


def bootstrap_ci(a: list[float], b: list[float], p: float, n: int = BOOTSTRAP_RESAMPLES) -> list[float]:
    """95 % percentile-bootstrap interval of pct(a, p) - pct(b, p), resampling each side."""
    rng = random.Random(BOOTSTRAP_SEED)
    diffs = sorted(pct(rng.choices(a, k=len(a)), p) - pct(rng.choices(b, k=len(b)), p)
                   for _ in range(n))
    return [pct(diffs, 2.5), pct(diffs, 97.5)]


def ratio_ci(a: list[float], b: list[float], p: float, n: int = BOOTSTRAP_RESAMPLES) -> list[float] | None:
    """95 % percentile-bootstrap interval of pct(a, p) / pct(b, p), resampling each side."""
    if len(a) < 2 or len(b) < 2:
        return None
    rng = random.Random(BOOTSTRAP_SEED)
    rs = sorted(pct(rng.choices(a, k=len(a)), p) / max(pct(rng.choices(b, k=len(b)), p), 1e-9)
                for _ in range(n))
    return [pct(rs, 2.5), pct(rs, 97.5)]


def paired_figures(a: list[float], b: list[float]) -> dict[str, Any]:
    """What `a` adds over `b`, measured in pairs (a[i] and b[i] back to back): each side's
    figures, the difference of their percentiles with the p99's interval, and the percentiles
    of the per-pair difference (the added time itself) with its p99's interval."""
    if len(a) != len(b):
        raise ValueError(f"paired samples of unequal length: {len(a)} and {len(b)}")
    qs = ("p50", "p90", "p99")
    sa, sb = stats(a), stats(b)
    diff = [x - y for x, y in zip(a, b)]
    sd = stats(diff)
    return {"latency_ms": {"a": sa, "b": sb},
            "added_ms": {q: sa[q] - sb[q] for q in qs} if a and b else {},
            "added_p99_ci95_ms": bootstrap_ci(a, b, 99) if a and b else None,
            "paired_added_ms": {q: sd[q] for q in qs} if diff else {},
            "paired_added_p99_ci95_ms": pct_ci(diff, 99)}


def hist_upper_ms(before: dict, after: dict, q: float) -> float | None:
    """From two readings of a cumulative Prometheus histogram ({le: count}; keys as numbers or as
    the strings JSON made of them): the upper bound, in ms, of the bucket holding quantile q of
    the observations in between. None when there are none, or when it is the +Inf bucket."""
    a = {float(k): v for k, v in after.items()}
    b = {float(k): v for k, v in before.items()}
    les = sorted(a)
    if not les:
        return None
    total = a[les[-1]] - b.get(les[-1], 0)
    if total <= 0:
        return None
    for le in les:
        if a[le] - b.get(le, 0) >= q * total:
            return None if le == float("inf") else le * 1e3
    return None
