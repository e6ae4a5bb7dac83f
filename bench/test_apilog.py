"""Tables for apilog.figures: the API-load figures recomputed from a request log.
Run: python3 -m unittest discover -s bench -p 'test_*.py'"""

import unittest

import apilog


def log(idle, failover, n=3, holder=0, idle_s=10.0, fo_s=1.5, tail_s=0.5):
    return {"n": n, "holder": holder, "lease_s": 15,
            "idle": {"seconds": idle_s, "requests": idle},
            "failover": {"failover_s": fo_s, "tail_s": tail_s, "requests": failover}}


class Figures(unittest.TestCase):
    def test_idle_rates_are_per_candidate_and_the_holder_apart(self):
        idle = [[t * 1000.0, 0, "update"] for t in range(5)]  # the holder: 5 updates in 10 s
        idle += [[1.0, 1, "watch"], [2.0, 2, "watch"], [3.0, 2, "get"]]
        f = apilog.figures(log(idle, []))
        i = f["idle"]
        self.assertAlmostEqual(i["holder_rps_total"], 0.5)
        self.assertAlmostEqual(i["holder_writes_per_lease"], 7.5)
        # candidates 1 and 2: 0.1 and 0.2 req/s
        self.assertAlmostEqual(i["candidate_rps_total_mean"], 0.15)
        self.assertAlmostEqual(i["candidate_rps_max"], 0.2)
        self.assertEqual(i["candidate_nonwatch_requests"], 1, "a watch is not polling; a get is")
        self.assertAlmostEqual(i["all_rps"], 0.8)
        self.assertEqual(f["idle_window_s"], 10.0)

    def test_failover_counts_the_candidates_only_over_the_window_and_its_tail(self):
        fo = [[100.0, 1, "update"], [120.0, 2, "update"], [130.0, 2, "get"], [50.0, 0, "update"]]
        f = apilog.figures(log([], fo))["failover"]
        self.assertEqual(f["requests_total"], 3, "the killed holder's own requests are not counted")
        self.assertEqual(f["requests_by_verb"], {"get": 1, "update": 2})
        self.assertAlmostEqual(f["window_s"], 2.0)
        self.assertAlmostEqual(f["candidate_rps_total_mean"], (0.5 + 1.0) / 2)

    def test_the_log_keeps_each_window_relative_to_its_start(self):
        ports = [7000, 7001]
        events = [(1_000_000_000, 7000, "update", "/x"), (1_500_000_000, 7001, "watch", "/y"),
                  (3_000_000_000, 7001, "update", "/x"), (9_000_000_000, 7001, "get", "/late"),
                  (1_200_000_000, 9999, "get", "/another-run")]
        rl = apilog.request_log(events, ports, 0, 15, (1_000_000_000, 2_000_000_000),
                                (2_500_000_000, 3_200_000_000), 0.5)
        self.assertEqual(rl["idle"]["requests"], [[0.0, 0, "update"], [500.0, 1, "watch"]])
        self.assertEqual(rl["failover"]["requests"], [[500.0, 1, "update"]])
        self.assertAlmostEqual(rl["idle"]["seconds"], 1.0)
        self.assertAlmostEqual(rl["failover"]["failover_s"], 0.7)


if __name__ == "__main__":
    unittest.main()
