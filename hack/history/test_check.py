"""Tables for the history checker (python3 -m unittest discover -s hack/history -p 'test_*.py').

Each case builds a tiny recorded run and asserts which checks the checker fails."""
import json
import os
import tempfile
import unittest

import check

UID = "u1"


def point(t, gen, holder, src="audit", rv=None):
    return {"t": t, "uid": UID, "gen": gen, "rv": rv or t, "holder": holder, "src": src}


def op(worker, item, token, t_send, verdict, obj="history-0", rv=None, **kw):
    o = {"worker": worker, "style": "rmw", "token": token, "uid": UID, "item": item, "obj": obj,
         "t_send": t_send, "t_ack": t_send + 1, "verdict": verdict, **kw}
    if rv is not None:
        o["rv"] = rv
    return o


# The lease: generation 1 at t=0 (a), 2 at t=100 (b), 3 at t=200 (a again).
POINTS = [point(0, 1, "a"), point(100, 2, "b"), point(200, 3, "a")]


def run_check(ops, objects, points=POINTS, min_stale=1, events=(), faults=None, kinds=None, candidates=None,
              writers=None):
    """`events`: one candidate's events, or {events file name: events} for several processes."""
    with tempfile.TemporaryDirectory() as out:
        with open(os.path.join(out, "ops-x.jsonl"), "w") as f:
            for o in ops:
                f.write(json.dumps(o) + "\n")
        for name, evs in (events if isinstance(events, dict) else {"w.events": events}).items():
            with open(os.path.join(out, name), "w") as f:
                for e in evs:
                    f.write(json.dumps(e) + "\n")
        loaded, failed_reads = check.load_ops(out)
        run = {"out": out, **({"faults": faults} if faults is not None else {}),
               **({"fault_kinds": kinds} if kinds is not None else {}),
               **({"candidates": candidates} if candidates is not None else {}),
               **({"stale_writers": writers, "min_stale_per_writer": 2} if writers is not None else {})}
        s = check.check(run, loaded, objects, points, min_stale, failed_reads)
    return s, {k for k, v in s["checks"].items() if v != "pass"}


def shard(*items):
    return {"data": {"items": ",".join(items), "counter": str(len(items))}}


class CheckerTables(unittest.TestCase):
    def test_fenced_history_passes(self):
        ops = [op("a", "i1", 1, 50, "accepted", rv=10),
               op("a", "i2", 1, 150, "refused"),  # token 1 after generation 2: stale, refused
               op("b", "i3", 2, 160, "accepted", rv=11)]
        s, failed = run_check(ops, {"history-0": shard("i1", "i3")})
        self.assertEqual(failed, set())
        self.assertEqual((s["stale_attempted"], s["stale_refused"], s["stale_accepted"]), (1, 1, 0))

    def test_stale_accepted_fails(self):
        ops = [op("b", "i3", 2, 160, "accepted", rv=11), op("b", "i4", 2, 250, "accepted", rv=12)]
        s, failed = run_check(ops, {"history-0": shard("i3", "i4")})
        self.assertIn("no stale write accepted", failed)
        self.assertEqual(s["stale_accepted"], 1)

    def test_ambiguous_stale_write_that_landed_counts(self):
        ops = [op("b", "i4", 2, 250, "unknown")]
        s, failed = run_check(ops, {"history-0": shard("i4")})
        self.assertEqual(s["stale_accepted"], 1)
        self.assertIn("no stale write accepted", failed)

    def test_sent_before_the_lease_moved_is_not_stale(self):
        ops = [op("a", "i1", 1, 99, "accepted", rv=10)]
        s, failed = run_check(ops, {"history-0": shard("i1")}, min_stale=0)
        self.assertEqual((s["stale_attempted"], failed), (0, set()))

    def test_token_going_down_fails(self):
        ops = [op("b", "i3", 2, 90, "accepted", rv=11), op("a", "i4", 1, 95, "accepted", rv=12)]
        _, failed = run_check(ops, {"history-0": shard("i3", "i4")}, min_stale=0)
        self.assertEqual(failed, {"object tokens never went down"})

    def test_lost_acknowledged_write_fails(self):
        ops = [op("a", "i1", 1, 50, "accepted", rv=10), op("a", "i2", 1, 60, "accepted", rv=11)]
        s, failed = run_check(ops, {"history-0": shard("i2")}, min_stale=0)
        self.assertEqual((s["acknowledged_lost"], failed), (1, {"no acknowledged write lost"}))

    def test_blind_last_write_must_be_the_final_state(self):
        ops = [op("a", "b1", 1, 50, "accepted", obj="blind", rv=10),
               op("a", "b2", 1, 60, "accepted", obj="blind", rv=11)]
        _, failed = run_check(ops, {"blind": {"data": {"last": "b1"}}}, min_stale=0)
        self.assertEqual(failed, {"no acknowledged write lost"})
        ops.append(op("a", "b3", 1, 70, "unknown", obj="blind"))
        _, failed = run_check(ops, {"blind": {"data": {"last": "b3"}}}, min_stale=0)
        self.assertEqual(failed, set())

    def test_hole_in_the_oracle_fails(self):
        ops = [op("a", "i1", 1, 50, "accepted", rv=10)]
        points = [point(0, 1, "a"), point(200, 3, "a")]
        _, failed = run_check(ops, {"history-0": shard("i1")}, points=points, min_stale=0)
        self.assertEqual(failed, {"the lease's history is complete and increasing"})

    def test_earliest_sighting_counts(self):
        # The watch saw generation 2 at t=90, before the audit log's answer time.
        points = POINTS + [point(90, 2, "b", src="watch")]
        ops = [op("a", "i1", 1, 95, "refused")]
        s, _ = run_check(ops, {"history-0": shard()}, points=points)
        self.assertEqual(s["stale_refused"], 1)

    def test_too_few_stale_attempts_fail(self):
        ops = [op("a", "i1", 1, 50, "accepted", rv=10)]
        _, failed = run_check(ops, {"history-0": shard("i1")}, min_stale=1)
        self.assertEqual(failed, {"at least 1 stale writes judged by the fence"})

    def test_overlap_on_real_clocks_fails(self):
        events = [{"event": "leading", "identity": "a", "lease_uid": UID, "token": 1, "t_ns": 0, "valid_until_ns": 10**10},
                  {"event": "leading", "identity": "b", "lease_uid": UID, "token": 2, "t_ns": 5 * 10**9, "valid_until_ns": 15 * 10**9}]
        ops = [op("a", "i1", 1, 50, "accepted", rv=10)]
        s, failed = run_check(ops, {"history-0": shard("i1")}, min_stale=0, events=events)
        self.assertEqual(failed, {"no overlap of belief on real clocks"})
        self.assertGreater(s["overlap_seconds"], 0)

    def test_two_processes_of_one_identity_that_overlap_fail(self):
        # A reused identity: the second process of `a` led while the first still believed it did.
        first = {"event": "leading", "identity": "a", "lease_uid": UID, "token": 1, "t_ns": 0, "valid_until_ns": 10**10}
        second = {"event": "leading", "identity": "a", "lease_uid": UID, "token": 2, "t_ns": 5 * 10**9,
                  "valid_until_ns": 15 * 10**9}
        ops, objects = [op("a", "i1", 1, 50, "accepted", rv=10)], {"history-0": shard("i1")}
        _, failed = run_check(ops, objects, min_stale=0, events={"a.events": [first], "a-twin.events": [second]})
        self.assertEqual(failed, {"no overlap of belief on real clocks"})
        # The first one stopped before the second led: no overlap.
        stopped = {"event": "stopped", "identity": "a", "t_ns": 4 * 10**9}
        _, failed = run_check(ops, objects, min_stale=0,
                              events={"a.events": [first, stopped], "a-twin.events": [second]})
        self.assertEqual(failed, set())

    def test_a_candidate_that_never_led_fails(self):
        ops, objects = [op("a", "i1", 1, 50, "accepted", rv=10)], {"history-0": shard("i1")}
        s, failed = run_check(ops, objects, min_stale=0, candidates=["a", "b", "c"])
        self.assertEqual(failed, {"every candidate led"})
        self.assertEqual(s["checks"]["every candidate led"], "FAIL: c never led")
        _, failed = run_check(ops, objects, min_stale=0, candidates=["a", "b"])
        self.assertEqual(failed, set())

    def test_every_writer_must_go_stale_and_none_may_dominate(self):
        objects = {"history-0": shard("i1")}
        ok = [op("a", "i1", 1, 50, "accepted", rv=10)]
        stale = lambda w, n: [op(w, f"{w}{i}", 1, 150, "refused") for i in range(n)]  # noqa: E731
        # b made too few, and a more than half (4 of 6).
        s, failed = run_check(ok + stale("a", 4) + stale("b", 1) + stale("c", 1), objects, min_stale=0,
                              writers=["a", "b"])
        self.assertEqual(failed, {"every writer made at least 2 stale writes",
                                  "no writer made more than half of the stale writes"})
        self.assertEqual(s["checks"]["every writer made at least 2 stale writes"], "FAIL: b: 1")
        self.assertIn("a: 4 of 6", s["checks"]["no writer made more than half of the stale writes"])
        # Half exactly is not more than half; c is counted but not required.
        _, failed = run_check(ok + stale("a", 3) + stale("b", 2) + stale("c", 1), objects, min_stale=0,
                              writers=["a", "b"])
        self.assertEqual(failed, set())

    def test_the_fast_clock_is_read_back_in_real_time(self):
        clock = check.FakeClock(offset_s=3600, rate=1.5)
        start = 10**18
        clock.start = start  # the "started" event said start + 3600 s on its clock
        self.assertEqual(clock.real(start + 3600 * 10**9 + 3 * 10**9), start + 2 * 10**9)

    def test_audit_parsing_keeps_spec_writes_only(self):
        def line(sub, code, gen):
            ref = {"resource": "fencedleases", "name": "hist", **({"subresource": sub} if sub else {})}
            return json.dumps({"stage": "ResponseComplete", "objectRef": ref, "responseStatus": {"code": code},
                               "stageTimestamp": "2026-12-01T03:00:00.000001Z",
                               "requestReceivedTimestamp": "2026-12-01T03:00:00.000000Z",
                               "requestObject": {"metadata": {"uid": UID, "generation": 3, "resourceVersion": "6"}},
                               "responseObject": {"metadata": {"uid": UID, "generation": gen, "resourceVersion": "7"},
                                                  "spec": {"holderIdentity": "a"}}})
        pts, blind = check.parse_audit([line(None, 200, 4), line("status", 200, 4), line(None, 409, 5), "{cut"], "hist")
        answers = [(p["gen"], p["t"] % 10**9) for p in pts if p["src"] == "audit"]
        self.assertEqual(answers, [(4, 1000)])
        # Every write's request tells the generation its writer had read (status ones too).
        self.assertEqual(sorted(p["gen"] for p in pts if p["src"] == "audit-request"), [3, 3, 3])
        self.assertEqual(blind, set())

    def test_two_audit_logs_merge_into_one_server_order(self):
        def lease(rv, gen, second):
            return json.dumps({"stage": "ResponseComplete", "verb": "update", "responseStatus": {"code": 200},
                               "objectRef": {"resource": "fencedleases", "name": "hist"},
                               "stageTimestamp": f"2026-12-01T03:00:{second:02d}.000000Z",
                               "requestReceivedTimestamp": f"2026-12-01T03:00:{second:02d}.000000Z",
                               "responseObject": {"metadata": {"uid": UID, "generation": gen, "resourceVersion": str(rv)},
                                                  "spec": {"holderIdentity": "a"}}})

        def blind(item):
            return json.dumps({"stage": "ResponseComplete", "verb": "patch", "responseStatus": {"code": 200},
                               "objectRef": {"resource": "configmaps", "namespace": "history", "name": "blind"},
                               "requestObject": {"data": {"last": item}}})
        # Generations 1 and 3 went through server 1, 2 through server 2 (whose log is read last).
        logs = {"1": [lease(5, 1, 1), lease(9, 3, 3), blind("b1")], "2": [lease(7, 2, 2), blind("b2"), "{cut"]}
        pts, stored, per_server = check.merge_audit(logs, "hist")
        answers = [(p["rv"], p["gen"], p["server"]) for p in pts if p["src"] == "audit"]
        self.assertEqual(answers, [(5, 1, "1"), (7, 2, "2"), (9, 3, "1")])
        self.assertEqual(stored, {"b1", "b2"})
        self.assertEqual(per_server, {"1": {"accepted": 1, "refused": 0}, "2": {"accepted": 1, "refused": 0}})
        self.assertEqual(check.build_oracle(pts)[1], [])
        # Server 2 stored generation 2 at an etcd revision before server 1's generation 1: the
        # merged history goes down, which neither log shows alone.
        logs["2"][0] = lease(4, 2, 2)
        pts, _, _ = check.merge_audit(logs, "hist")
        self.assertEqual(check.build_oracle(pts)[1], ["lease generation went down in server order: 2 -> 1 at rv 5"])

    def test_every_api_server_must_serve_protected_writes_and_refusals(self):
        def write(name, code, message="", verb="update", ns="history"):
            return json.dumps({"stage": "ResponseComplete", "verb": verb,
                               "objectRef": {"resource": "configmaps", "namespace": ns, "name": name},
                               "responseStatus": {"code": code, "message": message}})
        denied = 'admission webhook "fencing.fencedlease.io" denied the request: fencedlease: stale token'
        lines = [write("history-0", 200), write("blind", 200, verb="patch"), write("history-1", 403, denied),
                 write("history-1", 409, "the object has been modified"), write("other", 200),
                 write("history-0", 200, ns="default"), write("history-2", 201, verb="create"), "{cut"]
        self.assertEqual(check.served(lines), {"accepted": 2, "refused": 1})
        name = "every API server served protected writes and refusals"
        ops, objects = [op("a", "i1", 1, 50, "accepted", rv=10)], {"history-0": shard("i1")}
        cases = [  # (per-server counts, the check's verdict)
            ({"1": {"accepted": 3, "refused": 2}, "2": {"accepted": 1, "refused": 1}}, "pass"),
            ({"1": {"accepted": 3, "refused": 2}, "2": {"accepted": 0, "refused": 1}},
             "FAIL: API server 2: 0 accepted, 1 refused"),
            ({"1": {"accepted": 3, "refused": 0}, "2": {"accepted": 4, "refused": 1}},
             "FAIL: API server 1: 3 accepted, 0 refused"),
            ({"1": {"accepted": 3, "refused": 2}}, None),  # one API server: no such check
        ]
        for servers, verdict in cases:
            with tempfile.TemporaryDirectory() as out:
                s = check.check({"out": out}, ops, objects, POINTS, 0, servers=servers)
            self.assertEqual(s["checks"].get(name), verdict, servers)

    def test_a_request_that_read_a_generation_fills_the_hole(self):
        points = [point(0, 1, "a"), point(150, 2, None, src="audit-request"), point(200, 3, "a")]
        _, failed = run_check([op("a", "i1", 1, 50, "accepted", rv=10)], {"history-0": shard("i1")},
                              points=points, min_stale=0)
        self.assertEqual(failed, set())

    def test_blind_writes_stored_by_the_audit_log_count_as_landed(self):
        ops = [op("b", "b1", 2, 250, "unknown", obj="blind")]
        s, failed = run_check(ops, {"blind": {"data": {"last": "x"}}}, min_stale=0)
        self.assertEqual(s["stale_accepted"], 0)
        with tempfile.TemporaryDirectory() as out:
            s = check.check({"out": out}, ops, {"blind": {"data": {"last": "x"}}}, POINTS, 0, 0, {"b1"})
        self.assertEqual(s["stale_accepted"], 1)

    def test_a_token_handed_to_two_leaders_fails(self):
        # a leads with token 1 and stops; later b claims the same token: never two at once,
        # but one token for two owners.
        events = [{"event": "leading", "identity": "a", "lease_uid": UID, "token": 1, "t_ns": 0, "valid_until_ns": 10**9},
                  {"event": "stopped", "identity": "a", "t_ns": 10**9},
                  {"event": "leading", "identity": "b", "lease_uid": UID, "token": 1, "t_ns": 5 * 10**9,
                   "valid_until_ns": 6 * 10**9}]
        ops = [op("a", "i1", 1, 50, "accepted", rv=10)]
        s, failed = run_check(ops, {"history-0": shard("i1")}, min_stale=0, events=events)
        self.assertEqual(failed, {"no token handed to two leaders"})
        self.assertIn("['a (w.events)', 'b (w.events)']", s["checks"]["no token handed to two leaders"])
        # Two processes of one identity (a reused identity) given the same token: two leaders.
        first, second = events[:2], [dict(events[2], identity="a")]
        s, failed = run_check(ops, {"history-0": shard("i1")}, min_stale=0,
                              events={"a.events": first, "a-twin.events": second})
        self.assertEqual(failed, {"no token handed to two leaders"})
        self.assertIn("['a (a-twin.events)', 'a (a.events)']", s["checks"]["no token handed to two leaders"])

    def test_a_generation_naming_two_holders_fails(self):
        points = POINTS + [point(110, 2, "c")]
        ops = [op("a", "i1", 1, 50, "accepted", rv=10)]
        s, failed = run_check(ops, {"history-0": shard("i1")}, points=points, min_stale=0)
        self.assertEqual(failed, {"the lease's history is complete and increasing"})
        self.assertIn("named two holders", s["checks"]["the lease's history is complete and increasing"])

    def test_a_generation_going_down_in_server_order_fails(self):
        # Server order (resourceVersion) has generation 2 stored before generation 1.
        points = [point(10, 2, "b", rv=5), point(20, 1, "a", rv=6)]
        ops = [op("b", "i1", 2, 50, "accepted", rv=10)]
        s, failed = run_check(ops, {"history-0": shard("i1")}, points=points, min_stale=0)
        self.assertEqual(failed, {"the lease's history is complete and increasing"})
        self.assertIn("went down", s["checks"]["the lease's history is complete and increasing"])

    def test_a_counter_that_disagrees_with_the_items_fails(self):
        ops = [op("a", "i1", 1, 50, "accepted", rv=10)]
        objects = {"history-0": {"data": {"items": "i1", "counter": "2"}}}
        s, failed = run_check(ops, objects, min_stale=0)
        self.assertEqual(failed, {"no acknowledged write lost"})
        self.assertIn("counter 2 != 1 items", s["checks"]["no acknowledged write lost"])

    def test_a_fault_that_failed_to_inject_fails(self):
        ops = [op("a", "i1", 1, 50, "accepted", rv=10)]
        _, failed = run_check(ops, {"history-0": shard("i1")}, min_stale=0, faults={"kill": 2, "partition_failed": 1})
        self.assertEqual(failed, {"every fault injected"})
        _, failed = run_check(ops, {"history-0": shard("i1")}, min_stale=0, faults={"kill": 2})
        self.assertEqual(failed, set())

    def test_a_fault_kind_that_never_came_fails(self):
        ops, objects = [op("a", "i1", 1, 50, "accepted", rv=10)], {"history-0": shard("i1")}
        kinds = ["kill", "partition", "hang"]
        s, failed = run_check(ops, objects, min_stale=0, faults={"kill": 1, "partition_in": 2}, kinds=kinds)
        self.assertEqual(failed, {"every fault injected"})
        self.assertIn("hang never injected", s["checks"]["every fault injected"])
        # A partition that failed to take is no partition.
        s, failed = run_check(ops, objects, min_stale=0, faults={"kill": 1, "hang": 1, "partition_out_failed": 1},
                              kinds=kinds)
        self.assertIn("partition never injected", s["checks"]["every fault injected"])
        _, failed = run_check(ops, objects, min_stale=0, faults={"kill": 1, "hang": 1, "partition_both": 1},
                              kinds=kinds)
        self.assertEqual(failed, set())

    def test_the_seed_chooses_only_the_order_of_the_faults(self):
        import random
        import run
        faults = {"a": 2, "b": 1, "c": 3}
        for seed in range(20):
            rounds = run.fault_rounds(faults, random.Random(seed))
            first = [next(rounds) for _ in range(6)]
            self.assertEqual(sorted(first), ["a", "a", "b", "c", "c", "c"], seed)

    def test_no_accepted_write_fails(self):
        _, failed = run_check([op("a", "i1", 1, 50, "refused")], {"history-0": shard()}, min_stale=0)
        self.assertEqual(failed, {"some writes accepted"})

    def test_conflicts_and_errors_are_not_judged_by_the_fence(self):
        ops = [op("a", "i2", 1, 150, "conflict"), op("a", "i3", 1, 150, "error")]
        s, _ = run_check(ops, {"history-0": shard()}, min_stale=0)
        self.assertEqual((s["stale_sent"], s["stale_attempted"]), (2, 0))


if __name__ == "__main__":
    unittest.main()
