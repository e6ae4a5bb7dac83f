"""The history test's checker: pure functions over what a run recorded (no cluster needed).

  python3 hack/history/check.py DIR     check a kept run again (prints its summary)

The oracle is the lease's history in server order: every spec write the API server's audit log
holds (its answer time), joined with what the harness's resuming watch saw (its arrival time).
For each generation the lease reached, the earliest of those times is when it was known to
have been reached. A write is stale when its token is lower than a generation its lease had
reached before the write was sent.

With two API servers on one etcd, each writes an audit log of its own; merge_audit joins them
into one history (resourceVersions are etcd revisions, one order across the servers) and
counts, per server, the protected writes it accepted and those the fence refused."""
import bisect
import datetime
import json
import os
import sys

LEASE_RESOURCE = "fencedleases"
# The fast-clock candidate's libfaketime setting: an hour ahead, running 1.5 times too fast.
FAST_CLOCK = {"offset_s": 3600, "rate": 1.5}


def ts_ns(text):
    """RFC 3339 time with up to microseconds (the audit log's) -> ns since the epoch."""
    d = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    return int(d.timestamp()) * 10**9 + d.microsecond * 1000


def lease_point(obj, t_ns, source):
    m = obj.get("metadata") or {}
    if "generation" not in m:
        return None
    if "uid" not in m:
        return None
    return {"t": t_ns, "uid": m["uid"], "gen": int(m["generation"]), "rv": int(m.get("resourceVersion") or 0),
            "holder": (obj.get("spec") or {}).get("holderIdentity"), "src": source}


def parse_audit(lines, name):
    """(lease points, items of blind writes stored) from audit log lines. A lease point comes
    from each successful spec write (the object as stored, at the answer's time) and from each
    write's request (the generation its writer had read, at the time the request arrived)."""
    points, blind = [], set()
    for line in lines:
        if not line.strip():
            continue
        try:
            e = json.loads(line)
        except ValueError:
            continue  # a line cut short by a SIGKILL of the API server
        ref = e.get("objectRef") or {}
        if e.get("stage") != "ResponseComplete":
            continue
        ok = (e.get("responseStatus") or {}).get("code", 0) < 300
        if ref.get("resource") == "configmaps" and ref.get("name") == "blind":
            item = ((e.get("requestObject") or {}).get("data") or {}).get("last")
            if ok and item:
                blind.add(item)
            continue
        if ref.get("resource") != LEASE_RESOURCE or ref.get("name") != name:
            continue
        if e.get("requestObject"):
            p = lease_point(e["requestObject"], ts_ns(e["requestReceivedTimestamp"]), "audit-request")
            if p:
                p["holder"] = None  # what the writer read, not what it wrote
                points.append(p)
        if ok and not ref.get("subresource") and e.get("responseObject"):
            p = lease_point(e["responseObject"], ts_ns(e["stageTimestamp"]), "audit")
            if p:
                points.append(p)
    return points, blind


def served(lines):
    """{"accepted": n, "refused": n}: the writes to the protected ConfigMaps (the history shards
    and the blind object, in the history namespace) that an API server stored, and those it
    refused because the fencing webhook denied them."""
    accepted = refused = 0
    for line in lines:
        try:
            e = json.loads(line)
        except ValueError:
            continue  # a line cut short by a SIGKILL of the API server
        obj = e.get("objectRef") or {}
        name = obj.get("name") or ""
        if (e.get("stage") != "ResponseComplete" or obj.get("resource") != "configmaps"
                or obj.get("namespace") != "history" or e.get("verb") not in ("update", "patch")
                or not (name == "blind" or name.startswith("history-"))):
            continue
        status = e.get("responseStatus") or {}
        if status.get("code", 0) < 300:
            accepted += 1
        elif "denied the request" in status.get("message", ""):
            refused += 1
    return {"accepted": accepted, "refused": refused}


def merge_audit(logs, name):
    """(lease points, blind items stored, {server: served()}) from {server: audit log lines}:
    each server's points tagged with it, all of them in server order (resourceVersion, then
    time), so that the oracle's checks see one history whichever server answered."""
    points, blind, per_server = [], set(), {}
    for server, lines in logs.items():
        lines = list(lines)
        pts, b = parse_audit(lines, name)
        for p in pts:
            p["server"] = server
        points += pts
        blind |= b
        per_server[server] = served(lines)
    points.sort(key=lambda p: (p["rv"], p["t"]))
    return points, blind, per_server


def build_oracle(points):
    """(reached, problems): reached maps uid -> sorted [(t, gen)] of the first time each
    generation was known; problems lists holes and contradictions in the history."""
    first, holders, problems = {}, {}, []
    for p in points:
        k = (p["uid"], p["gen"])
        first[k] = min(first.get(k, p["t"]), p["t"])
        if p["holder"]:
            holders.setdefault(k, set()).add(p["holder"])
    reached = {}
    for (uid, gen), t in first.items():
        reached.setdefault(uid, []).append((t, gen))
    for uid, seq in reached.items():
        gens = sorted(g for _, g in seq)
        missing = sorted(set(range(gens[0], gens[-1] + 1)) - set(gens))
        if missing:
            problems.append(f"oracle incomplete: lease {uid} generations {missing[:5]} were never seen")
        seq.sort()
    for k, who in holders.items():
        if len(who) > 1:
            problems.append(f"generation {k[1]} of lease {k[0]} named two holders: {sorted(who)}")
    by_rv = sorted((p for p in points if p["src"] == "audit"), key=lambda p: p["rv"])
    for a, b in zip(by_rv, by_rv[1:]):
        if a["uid"] == b["uid"] and b["gen"] < a["gen"]:
            problems.append(f"lease generation went down in server order: {a['gen']} -> {b['gen']} at rv {b['rv']}")
    return reached, problems


class Staleness:
    """The highest generation each lease had reached by a time."""

    def __init__(self, reached):
        self.times, self.best = {}, {}
        for uid, seq in reached.items():
            best, top = [], 0
            for _, g in seq:
                top = max(top, g)
                best.append(top)
            self.times[uid] = [t for t, _ in seq]
            self.best[uid] = best

    def reached_before(self, uid, t):
        i = bisect.bisect_left(self.times.get(uid, []), t)
        return self.best[uid][i - 1] if i > 0 else None

    def is_stale(self, op):
        g = self.reached_before(op["uid"], op["t_send"])
        return g is not None and op["token"] < g

    def stale_since(self, uid, token):
        """When the lease was first known past `token`."""
        i = bisect.bisect_right(self.best.get(uid, []), token)
        return self.times[uid][i] if i < len(self.times.get(uid, [])) else None


def holder_timeline(points):
    """[(t, holder)]: who the newest generation known at each time named."""
    out, gen = [], -1
    for p in sorted((p for p in points if p["src"] in ("audit", "watch")), key=lambda p: p["t"]):
        if p["gen"] > gen:
            gen = p["gen"]
            out.append((p["t"], p["holder"]))
    return out


def fault_hits(fault_log, points):
    """How many faults aimed at the holder found it holding, by the oracle's history."""
    line = holder_timeline(points)
    times = [t for t, _ in line]
    aimed = [f for f in fault_log if f.get("target")]
    hit = 0
    for f in aimed:
        i = bisect.bisect_right(times, f["t0"])
        hit += i > 0 and line[i - 1][1] == f["target"]
    return {"aimed_at_holder": len(aimed), "holder_confirmed": hit}


def load_ops(out):
    """Every write attempt with its outcome; a "sent" record with none is ambiguous."""
    raw = []
    for f in sorted(os.listdir(out)):
        if f.startswith("ops-") and f.endswith(".jsonl"):
            with open(os.path.join(out, f)) as fh:
                for line in fh:
                    try:
                        raw.append(json.loads(line))
                    except ValueError:
                        pass  # a line cut short by a SIGKILL of its writer
    done = {o["item"] for o in raw if o["verdict"] != "sent"}
    ops = [o for o in raw if o["verdict"] != "sent"]
    ops += [dict(o, verdict="unknown", message="the writer died waiting") for o in raw
            if o["verdict"] == "sent" and o["item"] not in done]
    return [o for o in ops if o.get("phase") != "read"], len([o for o in ops if o.get("phase") == "read"])


def landed_items(objects):
    """obj name -> (list of items in order, counter) for RMW shards; blind -> its last item."""
    shards, blind_last = {}, None
    for name, cm in objects.items():
        data = (cm or {}).get("data") or {}
        if name == "blind":
            blind_last = data.get("last")
        else:
            shards[name] = ([i for i in data.get("items", "").split(",") if i], int(data.get("counter", "0")))
    return shards, blind_last


def check_objects(ops, objects, blind_stored=frozenset()):
    """(landed set of items, acknowledged_lost, violations) from the final objects and the
    blind writes the audit log says were stored."""
    shards, blind_last = landed_items(objects)
    violations, lost = [], 0
    landed = set(blind_stored)
    for name, (items, counter) in shards.items():
        landed.update(items)
        pos = {item: n for n, item in enumerate(items)}
        acc = sorted((o for o in ops if o.get("obj") == name and o["verdict"] == "accepted"), key=lambda o: o["rv"])
        missing = [o["item"] for o in acc if o["item"] not in pos]
        lost += len(missing)
        if missing:
            violations.append(f"{name}: {len(missing)} acknowledged writes lost, e.g. {missing[:3]}")
        order = [pos[o["item"]] for o in acc if o["item"] in pos]
        if order != sorted(order):
            violations.append(f"{name}: accepted items are out of order in the list")
        ambiguous = {o["item"] for o in ops if o.get("obj") == name and o["verdict"] == "unknown"}
        extra = set(items) - {o["item"] for o in acc} - ambiguous
        if extra:
            violations.append(f"{name}: {len(extra)} items from writes nobody was told succeeded: {sorted(extra)[:3]}")
        if counter != len(items):
            violations.append(f"{name}: counter {counter} != {len(items)} items")
    acc = sorted((o for o in ops if o.get("obj") == "blind" and o["verdict"] == "accepted"), key=lambda o: o["rv"])
    if blind_last:
        landed.add(blind_last)
    if acc and blind_last != acc[-1]["item"]:
        later = {o["item"] for o in ops if o.get("obj") == "blind" and o["verdict"] == "unknown"}
        if blind_last not in later:
            lost += 1
            violations.append(f"blind: the last acknowledged write {acc[-1]['item']} is not the final "
                              f"state ({blind_last}), and no ambiguous write explains it")
    return landed, lost, violations


def tokens_never_down(ops):
    out = []
    by_obj = {}
    for o in ops:
        if o["verdict"] == "accepted":
            by_obj.setdefault(o["obj"], []).append(o)
    for name, acc in by_obj.items():
        acc.sort(key=lambda o: o["rv"])
        for a, b in zip(acc, acc[1:]):
            if a["uid"] == b["uid"] and b["token"] < a["token"]:
                out.append(f"{name}: the object's token went down: {a['token']} -> {b['token']} at rv {b['rv']}")
                break
    return out


class FakeClock:
    """Real times from the fast-clock candidate's faked ones. libfaketime with "+O xR" shows
    start + O + (now - start) * R, counted from the process's start; each "started" event (a
    new process) gives the start, off by the few ms the process took to write it."""

    def __init__(self, offset_s, rate):
        self.offset, self.rate, self.start = int(offset_s * 1e9), rate, None

    def real(self, t):
        return None if self.start is None else self.start + (t - self.start - self.offset) / self.rate


def beliefs(out, fast_clock=None):
    """Leadership claims [start, end, (events file, identity), fast_clock] from the candidates' event logs,
    in real time (the fast-clock candidate's converted, when its clock is known)."""
    claims, owners = [], {}
    for f in sorted(os.listdir(out)):
        if not f.endswith(".events"):
            continue
        fast = f.startswith("w-skew")
        clock = FakeClock(**fast_clock) if fast and fast_clock else None
        cur = None
        with open(os.path.join(out, f)) as fh:
            lines = fh.readlines()
        for line in lines:
            try:
                e = json.loads(line)
            except ValueError:
                continue
            t, until = e["t_ns"], e.get("valid_until_ns", e["t_ns"])
            if clock:
                if e["event"] == "started":
                    clock.start = t - clock.offset
                t, until = clock.real(t), clock.real(until)
            if t is None or (fast and not clock):
                if e["event"] == "leading":
                    owners.setdefault((e["lease_uid"], e["token"]), set()).add(f"{e['identity']} ({f})")
                continue
            if e["event"] == "leading":
                # Keyed by process (its events file) too: two processes of one identity are two.
                owners.setdefault((e["lease_uid"], e["token"]), set()).add(f"{e['identity']} ({f})")
                cur = [t, until, (f, e["identity"]), fast]
                claims.append(cur)
            elif e["event"] == "renewed" and cur and t < cur[1]:
                cur[1] = max(cur[1], until)
            elif e["event"] in ("stopped", "exited") and cur:
                cur[1] = min(cur[1], t)
                cur = None
    return claims, owners


def overlap(claims):
    """(seconds two real-clock candidates both believed they led, seconds the fast-clock one
    believed it led while a real-clock one did too). Two processes of one identity (a reused
    identity) are two candidates: each claim is its events file's and identity's."""
    real = fast = 0
    for i, a in enumerate(claims):
        for b in claims[i + 1:]:
            if a[2] == b[2]:
                continue
            d = max(0, min(a[1], b[1]) - max(a[0], b[0]))
            if a[3] or b[3]:
                fast += d
            else:
                real += d
    return real / 1e9, fast / 1e9


def takeovers(points):
    """From the last watch event that showed the old holder to the first showing a new one."""
    gaps, cur, last = [], None, None
    for p in sorted((p for p in points if p["src"] == "watch"), key=lambda p: p["t"]):
        if p["holder"] and p["holder"] != cur:
            if last is not None:
                gaps.append((p["t"] - last) / 1e9)
            cur = p["holder"]
        if p["holder"]:
            last = p["t"]
    gaps.sort()
    res = {"count": len(gaps)}
    if gaps:
        res.update(p50_s=round(gaps[len(gaps) // 2], 3), p90_s=round(gaps[int(len(gaps) * 0.9)], 3),
                   max_s=round(gaps[-1], 3))
    return res


def verdict_counts(ops):
    counts = {}
    for o in ops:
        v = o["verdict"]
        if v == "error":
            m = o.get("message", "")
            v = ("error_webhook_down" if "failed calling webhook" in m else
                 "error_server_unavailable" if o.get("code") in (None, 0) else f"error_http_{o.get('code')}")
        counts[v] = counts.get(v, 0) + 1
    return counts


def stale_writes(ops, stale, landed):
    """(stale writes sent, those the fence judged: refused or stored, those stored)."""
    sent = [o for o in ops if o.get("uid") and stale.is_stale(o)]
    stored = [o for o in sent if o["verdict"] == "accepted" or (o["verdict"] == "unknown" and o["item"] in landed)]
    ids = {id(o) for o in stored}
    judged = [o for o in sent if o["verdict"] == "refused" or id(o) in ids]
    return sent, judged, stored


def by_worker(judged, stored, stale):
    ids, out = {id(o) for o in stored}, {}
    for o in judged:
        w = out.setdefault(o["worker"], {"attempted": 0, "refused": 0, "accepted": 0, "within_1s": 0})
        w["attempted"] += 1
        w["refused"] += o["verdict"] == "refused"
        w["accepted"] += id(o) in ids
        w["within_1s"] += o["t_send"] - stale.stale_since(o["uid"], o["token"]) < 10**9
    return out


def check(run, ops, objects, points, min_stale, reads_failed=0, blind_stored=frozenset(), fault_log=(),
          servers=None):
    """The summary of a run; its `checks` say pass or why not. `servers`: merge_audit's counts
    per API server, when the run had more than one."""
    reached, oracle_problems = build_oracle(points)
    stale = Staleness(reached)
    landed, lost, object_violations = check_objects(ops, objects, blind_stored)
    sent, judged, stored = stale_writes(ops, stale, landed)
    claims, owners = beliefs(run["out"], run.get("fast_clock", FAST_CLOCK))
    real, fast = overlap(claims)
    twice = [f"token {t} of lease {u} was handed to two leaders: {sorted(w)}" for (u, t), w in owners.items() if len(w) > 1]
    faults = run.get("faults", {})
    per_writer = by_worker(judged, stored, stale)
    writers, floor = run.get("stale_writers", []), run.get("min_stale_per_writer", 0)
    checks = {
        "no stale write accepted": [f"{o['worker']} wrote {o['item']} with token {o['token']}, below generation "
                                    f"{stale.reached_before(o['uid'], o['t_send'])} reached before it was sent"
                                    for o in stored[:5]],
        "object tokens never went down": tokens_never_down(ops),
        "no acknowledged write lost": object_violations,
        "the lease's history is complete and increasing": oracle_problems,
        "no token handed to two leaders": twice,
        "no overlap of belief on real clocks": [f"{real:.3f} s"] if real > 0 else [],
        f"at least {min_stale} stale writes judged by the fence": [] if len(judged) >= min_stale else
        [f"only {len(judged)}: the run could not have caught a fencing bug"],
        f"every writer made at least {floor} stale writes": [
            f"{w}: {per_writer.get(w, {}).get('attempted', 0)}" for w in writers
            if per_writer.get(w, {}).get("attempted", 0) < floor],
        "no writer made more than half of the stale writes": [
            f"{w}: {c['attempted']} of {len(judged)}" for w, c in per_writer.items()
            if writers and 2 * c["attempted"] > len(judged)],
        "every candidate led": [f"{c} never led" for c in run.get("candidates", [])
                                if not any(p["holder"] == c for p in points)],
        "every fault injected": [k for k in faults if k.endswith("_failed")] + [
            f"{k} never injected" for k in run.get("fault_kinds", [])
            if not any(f == k or f.startswith(k + "_") and not f.endswith("_failed") for f in faults)],
        "some writes accepted": [] if any(o["verdict"] == "accepted" for o in ops) else ["none: the run proves nothing"],
    }
    if servers and len(servers) > 1:
        # The fence is judged on every API server: each stored protected writes and refused
        # stale ones, so that no server's path to the webhook (or around it) went untested.
        checks["every API server served protected writes and refusals"] = [
            f"API server {k}: {c['accepted']} accepted, {c['refused']} refused" for k, c in sorted(servers.items())
            if not (c["accepted"] and c["refused"])]
    return {
        "seed": run.get("seed"), "duration_s": run.get("duration"), "fenced": run.get("fenced", True),
        "faults": faults, "fault_total": sum(faults.values()), "fault_targets": fault_hits(fault_log, points),
        "writes_attempted": len(ops), "reads_failed": reads_failed,
        "stale_sent": len(sent), "stale_attempted": len(judged),
        "stale_refused": sum(1 for o in judged if o["verdict"] == "refused"),
        "stale_accepted": len(stored),
        "stale_within_1s": sum(w["within_1s"] for w in per_writer.values()),
        "stale_by_worker": per_writer,
        "acknowledged_lost": lost, "lost_on_purpose": run.get("lost_on_purpose"),
        "overlap_seconds": round(real, 3), "overlap_seconds_fast_clock": round(fast, 3),
        "verdicts": verdict_counts(ops),
        "oracle": {"points": len(points), "audit": sum(p["src"] == "audit" for p in points),
                   "audit_requests": sum(p["src"] == "audit-request" for p in points),
                   "generations": sum(len(v) for v in reached.values()), "blind_stored": len(blind_stored),
                   "watch_relists": run.get("watch_relists", 0), "watch_errors": run.get("watch_errors", {})},
        "tokens_handed_out": len(owners),
        "takeovers": takeovers(points),
        **({"apiservers": {k: dict(run.get("apiservers", {}).get(k, {}), protected_writes=c)
                           for k, c in sorted(servers.items())}} if servers else {}),
        "checks": {k: ("pass" if not v else "FAIL: " + "; ".join(v)) for k, v in checks.items()},
    }


def recheck(out):
    """Checks a run again from the files it kept."""
    run = json.load(open(os.path.join(out, "run.json")))
    objects = json.load(open(os.path.join(out, "final-objects.json")))
    points = json.load(open(os.path.join(out, "watch-points.json")))
    logs = {}
    # A run on one API server kept one audit log, named audit.log.
    for server, name in run.get("audit_logs", {"1": "audit.log"}).items():
        with open(os.path.join(out, name)) as f:
            logs[server] = f.readlines()
    audit, blind, servers = merge_audit(logs, run["lease"])
    ops, reads_failed = load_ops(out)
    faults = [json.loads(line) for line in open(os.path.join(out, "faults.jsonl"))]
    return check(dict(run, out=out), ops, objects, points + audit, run["min_stale"], reads_failed, blind, faults,
                 servers if len(servers) > 1 else None)


if __name__ == "__main__":
    s = recheck(sys.argv[1])
    print(json.dumps(s, indent=2))
    sys.exit(0 if all(v == "pass" for v in s["checks"].values()) else 1)
