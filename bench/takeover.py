"""Where a fencedlease takeover's time went (issue 38), from the elector's timeline.

A fencedlease candidate counts a held lease as expired one lease duration after *it observed*
the lease's last change (a renewal), on its own monotonic clock; then it sends the acquiring
write, and, once that is answered, a first renewal that records the tenure's duration; only
then does `fencedlease campaign` log "leading". So the lateness the failover benchmarks measure,
next leader's "leading" minus (the holder's last renewTime + the lease), is exactly the sum of:

- watch_lag_s: the candidate's observation of the holder's last renewal minus its renewTime
  (the renewal's own trip to the API server, the commit, the watch's delivery, the candidate
  taking it in);
- timer_slack_s: the acquiring write's send minus (that observation + the lease): the timer
  firing late, the step before the send;
- acquire_s: the acquiring write, send to answer;
- to_leading_s: that answer to the "leading" event: the first renewal (recording_renewal_s,
  send to answer) and the campaign command taking the new state in.

The elector writes its timeline as DEBUG events of the tracing target TIMELINE (see
elector/src/lease/elector.rs): "observed" (at_us, holder, token, renew_us), "acquire answered"
and "renewal answered" (sent_us, answered_us, outcome; a renewal's renew_us and first). The
failover benchmarks run `fencedlease campaign` with RUST_LOG enabling it and JSON log lines
(systems.start_candidate(timeline=True)); every time is wall-clock, the candidates' and the
holder's, on the machine the harness runs on. Pure functions, no I/O but read_log.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Iterable

from percentiles import stats

TIMELINE = "fencedlease_elector::timeline"
# The elector's warning when its watch of the lease fails (kube's watcher retries, with backoff).
WATCH_FAILED = "watching the FencedLease failed; retrying"
PARTS = ("watch_lag_s", "timer_slack_s", "acquire_s", "to_leading_s")
PART_LABEL = {"watch_lag_s": "watch lag (renewTime -> candidate saw it)",
              "timer_slack_s": "timer slack (saw it + lease -> acquire sent)",
              "acquire_s": "acquiring write (sent -> answered)",
              "to_leading_s": "answer -> leading (first renewal, campaign)"}


def _us_of_rfc3339(s: str | None) -> int | None:
    if not s:
        return None
    try:
        t = datetime.fromisoformat(s.replace("Z", "+00:00"))
    except ValueError:
        return None
    return int(t.timestamp()) * 1_000_000 + t.microsecond


def parse_log(lines: Iterable[str]) -> list[dict]:
    """A `fencedlease campaign` log's timeline events, in order, and its watch failures (as
    {"message": "watch failed", "at_us": ...}); JSON lines only, anything else skipped."""
    out = []
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            ev = json.loads(line)
        except ValueError:
            continue  # a line being written, or the command's own output
        if not isinstance(ev, dict):
            continue
        if ev.get("target") == TIMELINE:
            out.append(ev)
        elif ev.get("message") == WATCH_FAILED and (at := _us_of_rfc3339(ev.get("timestamp"))):
            out.append({"message": "watch failed", "at_us": at})
    return out


def read_log(path: Path) -> list[dict]:
    try:
        with open(path, errors="replace") as f:
            return parse_log(f)
    except FileNotFoundError:
        return []


def observed(timeline: list[dict], renew_us: int) -> dict | None:
    """The first observation of the renewal written at renew_us (status.renewTime, in us)."""
    return next((e for e in timeline if e.get("message") == "observed" and e.get("renew_us") == renew_us),
                None)


def _answers(timeline: list[dict], what: str, after_us: float, until_us: float) -> list[dict]:
    return [e for e in timeline if e.get("message") == what
            and after_us <= e.get("sent_us", 0) and e.get("answered_us", 0) <= until_us]


def _holder_side(holder: list[dict] | None, renew_us: int) -> dict:
    """The holder's own timing of its last renewal: answered_s is an upper bound of when the
    API server stored it, counted from renewTime (None: killed before the answer came)."""
    if not holder:
        return {}
    r = next((e for e in holder if e.get("message") == "renewal answered" and e.get("renew_us") == renew_us),
             None)
    if r is None:
        return {"last_renewal_answered_s": None}
    return {"last_renewal_answered_s": round((r["answered_us"] - renew_us) / 1e6, 6),
            "last_renewal_outcome": r.get("outcome")}


def attribute(leader: list[dict], leader_ns: int, last_renew_ns: int, lease_s: float,
              holder: list[dict] | None = None, others: Iterable[list[dict]] = ()) -> dict:
    """Splits one takeover's lateness (leader_ns - last_renew_ns - lease) into PARTS, from the
    next leader's timeline (and, for context, the old holder's and the other candidates').
    A dict with the parts (seconds), `dominant` (the largest) and details; or {"missing": why}."""
    renew_us = last_renew_ns // 1000  # renewTime is stored to the microsecond
    lead_us = leader_ns / 1000
    obs = observed(leader, renew_us)
    if obs is None:
        return {"missing": "the next leader's timeline has no observation of the holder's last renewal"}
    o = obs["at_us"]
    ok = [e for e in _answers(leader, "acquire answered", renew_us, lead_us) if e.get("outcome") == "ok"]
    if not ok:
        return {"missing": "the next leader's timeline has no answered acquiring write before it led"}
    s, a = ok[-1]["sent_us"], ok[-1]["answered_us"]
    parts = {"watch_lag_s": (o - renew_us) / 1e6, "timer_slack_s": (s - o) / 1e6 - lease_s,
             "acquire_s": (a - s) / 1e6, "to_leading_s": (lead_us - a) / 1e6}
    out: dict = {k: round(v, 6) for k, v in parts.items()}
    out["dominant"] = max(PARTS, key=lambda k: parts[k])
    first = [e for e in _answers(leader, "renewal answered", a, lead_us) if e.get("first")]
    out["recording_renewal_s"] = (round((first[0]["answered_us"] - first[0]["sent_us"]) / 1e6, 6)
                                  if first else None)
    tried = _answers(leader, "acquire answered", renew_us, lead_us)
    out["acquire_attempts"] = len(tried)
    # Seen through a re-read after a refused acquiring write rather than through the watch.
    out["observed_after_conflict"] = any(e.get("outcome") == "conflict" and e["answered_us"] <= o for e in tried)
    before = [e["at_us"] for e in leader if e.get("message") == "observed" and e["at_us"] < o]
    since = before[-1] if before else renew_us - lease_s * 1e6
    out["watch_failures"] = len([e for e in leader if e.get("message") == "watch failed"
                                 and since < e["at_us"] <= o])
    lags = [(x["at_us"] - renew_us) / 1e6 for x in (observed(t, renew_us) for t in others) if x]
    out["watch_lag_others_s"] = sorted(round(v, 6) for v in lags)
    out.update(_holder_side(holder, renew_us))
    return out


def slowest(trials: list[dict], n: int = 5) -> list[dict]:
    """The n trials with the largest lateness that carry an attribution, slowest first."""
    done = [t for t in trials if t.get("lateness_s") is not None and "dominant" in (t.get("attribution") or {})]
    return sorted(done, key=lambda t: t["lateness_s"], reverse=True)[:n]


def summarize(trials: list[dict], n_slowest: int = 5) -> dict | None:
    """One system's attributions: each part's spread, how often each part was the largest, and
    the slowest takeovers with their parts (None when no trial carries an attribution)."""
    tried = [t for t in trials if t.get("attribution") is not None]
    if not tried:
        return None
    split = [t["attribution"] for t in tried if "dominant" in t["attribution"]]
    out: dict = {"n": len(split), "missing": len(tried) - len(split),
                 "parts_s": {k: {q: v for q, v in stats([a[k] for a in split]).items()
                                 if q in ("n", "p50", "p90", "p99", "max")} for k in PARTS},
                 "dominant": {k: sum(1 for a in split if a["dominant"] == k) for k in PARTS}}
    out["slowest"] = [{"lane": t.get("lane"), "trial": t.get("trial"), "lateness_s": t["lateness_s"],
                       **t["attribution"]} for t in slowest(trials, n_slowest)]
    return out
