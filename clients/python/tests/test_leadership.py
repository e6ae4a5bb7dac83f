"""leading() / while_leading against a fake sidecar whose state the test changes."""

import threading
import time
import unittest
from unittest import mock

import fencedlease.leadership as leadership_mod
from fencedlease import Client, LeadershipLost, NotLeader, Token, leading, merge_patch, while_leading

from .fake import FakeSidecar


def eventually(cond, timeout=3.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


class Leading(unittest.TestCase):
    def setUp(self):
        self.side = FakeSidecar(leading=False, holder="pod-b")
        self.client = Client(self.side.url)

    def tearDown(self):
        self.side.close()

    def lead_now(self, token=4, time_left_ms=1500):
        self.side.set(leading=True, token=token, holder=None, time_left_ms=time_left_ms)

    def test_waits_for_leadership_then_hands_out_its_token(self):
        threading.Timer(0.2, self.lead_now).start()
        t0 = time.monotonic()
        with leading(self.client) as lead:
            self.assertGreaterEqual(time.monotonic() - t0, 0.15)
            self.assertEqual(lead.token(), Token(4, "uid-1"))
            self.assertGreater(lead.time_left(), 1.0)
            self.assertFalse(lead.lost.is_set())

    def test_without_waiting_a_follower_gets_not_leader(self):
        with self.assertRaises(NotLeader) as cm:
            with leading(self.client, wait=False):
                self.fail("entered without leading")
        self.assertEqual(cm.exception.holder, "pod-b")

    def test_waiting_can_time_out(self):
        t0 = time.monotonic()
        with self.assertRaisesRegex(NotLeader, "did not come to lead within 0.3 s"):
            with leading(self.client, timeout=0.3):
                self.fail("entered without leading")
        self.assertLess(time.monotonic() - t0, 2)

    def test_a_reported_loss_sets_lost_and_stops_the_token(self):
        self.lead_now()
        with leading(self.client) as lead:
            self.side.set(leading=False, token=None, holder="pod-b")
            self.assertTrue(lead.lost.wait(2), "the loss was not signalled")
            with self.assertRaisesRegex(LeadershipLost, "token 4 is over: the sidecar reports that this pod no longer leads \\(holder: pod-b\\)"):
                lead.token()
            with self.assertRaises(LeadershipLost):
                merge_patch(lead, {"data": {}})

    def test_a_new_token_ends_the_tenure(self):
        self.lead_now(token=4)
        with leading(self.client) as lead:
            self.side.set(token=5)
            self.assertTrue(lead.wait_lost(2))
            self.assertIn("moved on from 4 to 5", lead.reason)

    def test_a_broken_stream_ends_the_tenure(self):
        self.lead_now()
        with leading(self.client) as lead:
            self.side.drop_watches()
            self.assertTrue(lead.lost.wait(2))
            self.assertIn("connection to the sidecar broke", lead.reason)

    def test_confirmations_keep_a_tenure_alive_past_the_first_deadline(self):
        self.lead_now(time_left_ms=1000)
        with leading(self.client) as lead:
            time.sleep(2.5)
            self.assertEqual(lead.token(), Token(4, "uid-1"))
            self.assertGreater(self.side.status_polls, 2)

    def test_without_confirmation_the_deadline_ends_it_even_with_no_event(self):
        self.lead_now(time_left_ms=300)
        with leading(self.client) as lead:
            self.side.status_hangs = True  # a frozen sidecar: no events, no answers
            t0 = time.monotonic()
            # The Event itself, for threads that only wait on it: no token() call helps here.
            # The deadline is 0.3 s away; the refresh request's own 5 s timeout is not waited out.
            self.assertTrue(lead.lost.wait(2.5), "lost was not set by the deadline")
            self.assertLess(time.monotonic() - t0, 2.5)
            self.assertIn("ran out", lead.reason)
            with self.assertRaises(LeadershipLost):
                lead.token()

    def test_a_paused_process_finds_its_token_expired_before_any_thread_runs(self):
        self.lead_now(time_left_ms=5000)
        with leading(self.client) as lead:
            self.assertEqual(lead.token().generation, 4)
            real = time.monotonic
            # As if the process had been stopped for a minute: only the clock moved on, the
            # watcher threads have had no chance to learn anything.
            with mock.patch.object(leadership_mod, "now", lambda: real() + 60):
                with self.assertRaisesRegex(LeadershipLost, "ran out"):
                    lead.token()
            self.assertTrue(lead.lost.is_set())

    def test_release_steps_down(self):
        self.lead_now()
        with leading(self.client) as lead:
            lead.release()
            self.assertTrue(lead.lost.is_set())
            self.assertEqual(self.side.releases, 1)
            with self.assertRaisesRegex(LeadershipLost, "released by this process"):
                lead.token()

    def test_leaving_the_block_stops_the_threads_and_the_tenure(self):
        self.lead_now()
        ours = lambda: {t.name for t in threading.enumerate() if t.name.startswith("fencedlease-")}
        self.assertEqual(ours(), set())
        with leading(self.client) as lead:
            self.assertEqual(ours(), {"fencedlease-watch", "fencedlease-refresh"})
        self.assertTrue(eventually(lambda: not ours()), f"still running: {ours()}")
        with self.assertRaisesRegex(LeadershipLost, "block was left"):
            lead.token()

    def test_while_leading_runs_the_function_with_the_tenure(self):
        self.lead_now(token=9)

        @while_leading(self.client)
        def work(lead, x):
            return lead.token().generation * x

        self.assertEqual(work(2), 18)

    def test_while_leading_bare_uses_the_env(self):
        self.lead_now(token=3)
        with mock.patch.dict("os.environ", {"FENCEDLEASE_URL": self.side.url}):
            @while_leading
            def work(lead):
                return lead.token()

            self.assertEqual(work(), Token(3, "uid-1"))


if __name__ == "__main__":
    unittest.main()


class Acknowledgement(unittest.TestCase):
    def setUp(self):
        self.side = FakeSidecar(leading=True, token=4, holder=None)
        self.client = Client(self.side.url)

    def tearDown(self):
        self.side.close()

    def test_a_leading_block_acknowledges_its_tenure_and_pins_writes_to_it(self):
        with leading(self.client) as lead:
            self.assertEqual(self.side.acknowledged, [4])
            self.assertEqual(lead.pin_headers(), {"fencedlease-token": "4", "fencedlease-lease-uid": "uid-1"})
            self.side.set(leading=False, token=None, holder="pod-b")
            self.assertTrue(lead.lost.wait(2))
            with self.assertRaises(LeadershipLost):
                lead.pin_headers()

    def test_only_the_current_tenure_can_be_acknowledged(self):
        self.client.acknowledge(Token(4, "uid-1"))
        with self.assertRaises(NotLeader):
            self.client.acknowledge(Token(3, "uid-1"))
