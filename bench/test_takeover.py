"""Tables for takeover.attribute: a takeover's lateness split into its parts from the elector's
timeline. Run: python3 -m unittest discover -s bench -p 'test_*.py'"""

import json
import unittest

import takeover

T = takeover.TIMELINE
R = 1_000_000_000_000_000  # the holder's last renewTime, us since the epoch
L = 15.0


def obs(at_us, renew_us, holder="h", token=3):
    return {"target": T, "message": "observed", "at_us": at_us, "holder": holder, "token": token,
            "renew_us": renew_us}


def acq(sent_us, answered_us, outcome="ok"):
    return {"target": T, "message": "acquire answered", "sent_us": sent_us, "answered_us": answered_us,
            "outcome": outcome}


def ren(sent_us, answered_us, renew_us=None, first=False, outcome="ok"):
    return {"target": T, "message": "renewal answered", "sent_us": sent_us, "answered_us": answered_us,
            "renew_us": renew_us if renew_us is not None else sent_us, "first": first, "outcome": outcome}


def expiry(lag_us):
    """When a candidate that saw the last renewal lag_us after it counts the lease as expired."""
    return R + lag_us + int(L * 1e6)


class Attribute(unittest.TestCase):
    def test_the_parts_add_up_to_the_lateness_and_the_largest_is_named(self):
        e = expiry(40_000)
        leader = [obs(R - 5_000_000 + 30_000, R - 5_000_000), obs(R + 40_000, R),
                  acq(e + 2_000, e + 12_000), ren(e + 12_500, e + 20_000, first=True)]
        lead_ns = (e + 21_000) * 1000
        a = takeover.attribute(leader, lead_ns, R * 1000, L)
        self.assertAlmostEqual(a["watch_lag_s"], 0.040)
        self.assertAlmostEqual(a["timer_slack_s"], 0.002)
        self.assertAlmostEqual(a["acquire_s"], 0.010)
        self.assertAlmostEqual(a["to_leading_s"], 0.009)
        self.assertAlmostEqual(a["recording_renewal_s"], 0.0075)
        lateness = (lead_ns - R * 1000) / 1e9 - L
        self.assertAlmostEqual(sum(a[k] for k in takeover.PARTS), lateness, places=6)
        self.assertEqual(a["dominant"], "watch_lag_s")
        self.assertEqual(a["acquire_attempts"], 1)
        self.assertFalse(a["observed_after_conflict"])

    def test_a_late_watch_delivery_dominates_and_its_failure_is_counted(self):
        e = expiry(2_000_000)
        fail = {"message": "watch failed", "at_us": R - 100_000}
        leader = [obs(R - 4_990_000, R - 5_000_000), fail, obs(R + 2_000_000, R), acq(e + 1_000, e + 9_000)]
        a = takeover.attribute(leader, (e + 15_000) * 1000, R * 1000, L)
        self.assertEqual(a["dominant"], "watch_lag_s")
        self.assertAlmostEqual(a["watch_lag_s"], 2.0)
        self.assertEqual(a["watch_failures"], 1, "a failure since the observation before counts")
        self.assertIsNone(a["recording_renewal_s"], "no first renewal in the timeline")

    def test_the_other_candidates_lags_and_the_holder_s_answer_are_reported(self):
        e = expiry(30_000)
        leader = [obs(R + 30_000, R), acq(e, e + 5_000)]
        others = [[obs(R + 1_900_000, R)], [], [obs(R + 25_000, R - 5_000_000)]]
        holder = [ren(R - 5_000_000, R - 4_990_000), ren(R + 3, R + 1_800_000, renew_us=R)]
        a = takeover.attribute(leader, (e + 6_000) * 1000, R * 1000, L, holder=holder, others=others)
        self.assertEqual(a["watch_lag_others_s"], [1.9], "only the candidates that saw that renewal")
        self.assertAlmostEqual(a["last_renewal_answered_s"], 1.8)
        self.assertEqual(a["last_renewal_outcome"], "ok")
        a = takeover.attribute(leader, (e + 6_000) * 1000, R * 1000, L, holder=holder[:1])
        self.assertIsNone(a["last_renewal_answered_s"], "killed before the answer came")

    def test_a_refused_attempt_then_a_re_read_is_told_apart_from_the_watch(self):
        # It acted on the renewal before (the last one never came through the watch): refused,
        # it re-read the lease and counted the lease again from then.
        stale = expiry(-5_000_000)
        seen = stale + 8_000
        e = seen + int(L * 1e6)
        leader = [obs(R - 4_990_000, R - 5_000_000), acq(stale, stale + 5_000, "conflict"), obs(seen, R),
                  acq(e + 1_000, e + 6_000)]
        a = takeover.attribute(leader, (e + 9_000) * 1000, R * 1000, L)
        self.assertTrue(a["observed_after_conflict"])
        self.assertEqual(a["acquire_attempts"], 2)
        self.assertAlmostEqual(a["timer_slack_s"], 0.001)

    def test_what_cannot_be_split_says_why(self):
        self.assertIn("missing", takeover.attribute([], 1, R * 1000, L))
        self.assertIn("missing", takeover.attribute([obs(R + 1, R), acq(R + 2, R + 3, "conflict")],
                                                    (R + 10) * 1000, R * 1000, L))

    def test_the_slowest_are_those_with_the_largest_lateness(self):
        ts = [{"lateness_s": x, "attribution": {"dominant": "acquire_s"}} for x in (0.1, 2.0, 0.3)]
        ts.append({"lateness_s": 5.0, "attribution": {"missing": "no timeline"}})
        self.assertEqual([t["lateness_s"] for t in takeover.slowest(ts, 2)], [2.0, 0.3])

    def test_a_summary_counts_the_dominant_parts_and_keeps_the_slowest(self):
        def trial(late, dom, lane="fl-0"):
            parts = dict.fromkeys(takeover.PARTS, 0.001) | {dom: late}
            return {"lane": lane, "trial": 0, "lateness_s": late, "attribution": {**parts, "dominant": dom}}
        ts = [trial(0.05, "acquire_s"), trial(2.0, "watch_lag_s"), trial(0.04, "acquire_s"),
              {"lane": "fl-1", "trial": 1, "lateness_s": 0.1, "attribution": {"missing": "no timeline"}},
              {"lane": "fl-1", "trial": 2, "lateness_s": 0.1}]
        s = takeover.summarize(ts, 2)
        self.assertEqual((s["n"], s["missing"]), (3, 1))
        self.assertEqual(s["dominant"]["acquire_s"], 2)
        self.assertEqual(s["parts_s"]["watch_lag_s"]["max"], 2.0)
        self.assertEqual([(t["lateness_s"], t["dominant"]) for t in s["slowest"]],
                         [(2.0, "watch_lag_s"), (0.05, "acquire_s")])
        self.assertIsNone(takeover.summarize([{"lateness_s": 1.0}]))


class ParseLog(unittest.TestCase):
    def test_timeline_events_and_watch_failures_from_json_lines_only(self):
        lines = [json.dumps(obs(5, 4)), "not json: the command's output\n", '{"half": ',
                 json.dumps({"target": "fencedlease_elector::lease::elector", "level": "WARN",
                             "message": takeover.WATCH_FAILED, "timestamp": "2026-12-07T20:18:38.123456Z"}),
                 json.dumps({"target": "fencedlease::campaign", "message": "leading: starting the command"})]
        tl = takeover.parse_log(lines)
        self.assertEqual([e["message"] for e in tl], ["observed", "watch failed"])
        self.assertEqual(tl[1]["at_us"], 1_796_674_718_123_456)


if __name__ == "__main__":
    unittest.main()
