"""Integration test of the Python client against real `fencedlease sidecar` processes, the real
API server and the real fencing webhook. It is driven by tests/client_python.rs, which starts
them and passes what it knows in the environment; run it through

    KUBECONFIG=... cargo test --test client_python

It fails (never skips) when that environment is missing.

The story: pod-a leads, pod-b follows. (1) token(), status() and the token files agree with the
lease as the Rust side read it from the API server. (2) Writes stamped with stamp() and
merge_patch() pass the webhook; pod-a releases, its leading() block reports the loss, pod-b's
watch() sees itself take over, and pod-a's old token is refused. (3) The Rust side SIGKILLs
pod-b on request: its leading() block reports the loss, pod-a's watch() sees pod-a take over
once pod-b's lease runs out, and pod-b's token file, left behind by the kill, holds a token the
webhook refuses.
"""

import json
import os
import subprocess
import threading
import time
import unittest

from fencedlease import (
    LEASE_LABEL,
    LEASE_UID_ANNOTATION,
    TOKEN_ANNOTATION,
    WRITE_ID_ANNOTATION,
    Client,
    Disconnected,
    LeadershipLost,
    NotLeader,
    Status,
    Token,
    leading,
    merge_patch,
    read_token_files,
    stamp,
)

ENV = {}
NEEDED = [
    "FL_PY_NAMESPACE", "FL_PY_LEASE", "FL_PY_LEADER_ID", "FL_PY_FOLLOWER_ID", "FL_PY_LEADER_URL",
    "FL_PY_FOLLOWER_URL", "FL_PY_LEADER_TOKEN_DIR", "FL_PY_FOLLOWER_TOKEN_DIR",
    "FL_PY_EXPECT_TOKEN", "FL_PY_EXPECT_LEASE_UID", "FL_PY_RUST_KEYS", "FL_PY_SYNC_DIR", "KUBECONFIG",
]


def setUpModule():
    missing = [k for k in NEEDED if not os.environ.get(k)]
    if missing:
        raise RuntimeError(
            f"missing {', '.join(missing)}: this test needs real sidecars; run it with "
            "`cargo test --test client_python` (KUBECONFIG pointing at a test cluster)"
        )
    ENV.update({k: os.environ[k] for k in NEEDED})


def kubectl(*args, stdin=None):
    out = subprocess.run(["kubectl", "-n", ENV["FL_PY_NAMESPACE"], *args], input=stdin,
                         capture_output=True, text=True, timeout=30)
    return out.returncode == 0, out.stdout, out.stderr


def patch(body):
    return kubectl("patch", "configmap", "orders-state", "--type", "merge", "-p", json.dumps(body))


def stored():
    ok, out, err = kubectl("get", "configmap", "orders-state", "-o", "json")
    assert ok, err
    return json.loads(out)


def eventually(what, fn, timeout=10.0):
    end = time.monotonic() + timeout
    while True:
        v = fn()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for: {what}")
        time.sleep(0.05)


class Collector:
    """Follows a watch in a thread, keeping every event."""

    def __init__(self, client):
        self.watch = client.watch(backoff=(0.05, 0.2))
        self.events = []
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        try:
            for ev in self.watch:
                self.events.append(ev)
        except Exception as e:  # kept for the assertion message
            self.events.append(e)

    def first(self, what, pred, timeout=10.0):
        return eventually(what, lambda: next((e for e in list(self.events) if pred(e)), None), timeout)

    def close(self):
        self.watch.close()
        self._t.join(5)


class Story(unittest.TestCase):
    """Numbered: unittest runs them in name order, each phase starting where the last ended."""

    state = {}

    @classmethod
    def setUpClass(cls):
        secret = lambda which: os.path.join(ENV[f"FL_PY_{which}_TOKEN_DIR"], "api-secret")
        cls.a = Client(ENV["FL_PY_LEADER_URL"], secret_file=secret("LEADER"))
        cls.b = Client(ENV["FL_PY_FOLLOWER_URL"], secret_file=secret("FOLLOWER"))
        cls.a_id, cls.b_id = ENV["FL_PY_LEADER_ID"], ENV["FL_PY_FOLLOWER_ID"]

    def test_1_token_status_and_files_match_the_lease(self):
        rust = json.loads(ENV["FL_PY_RUST_KEYS"])
        self.assertEqual(
            {"token": TOKEN_ANNOTATION, "leaseUid": LEASE_UID_ANNOTATION, "writeId": WRITE_ID_ANNOTATION,
             "leaseLabel": LEASE_LABEL},
            rust, "the Python constants differ from elector/src/api.rs",
        )
        want = Token(int(ENV["FL_PY_EXPECT_TOKEN"]), ENV["FL_PY_EXPECT_LEASE_UID"])
        self.assertEqual(self.a.token(), want, "token() differs from the lease's generation and UID")
        st = self.a.status()
        self.assertTrue(st.leading)
        self.assertEqual((st.token, st.identity, st.holder, st.lease, st.namespace),
                         (want, self.a_id, self.a_id, ENV["FL_PY_LEASE"], ENV["FL_PY_NAMESPACE"]))
        self.assertGreater(st.valid_until, time.monotonic())
        with self.assertRaises(NotLeader) as cm:
            self.b.token()
        self.assertEqual(cm.exception.holder, self.a_id)
        self.assertFalse(self.b.status().leading)
        # The sidecar writes its files right after its state changes, not with it: a moment.
        eventually("pod-a's token files", lambda: read_token_files(ENV["FL_PY_LEADER_TOKEN_DIR"]) == want, 2)
        self.assertIsNone(read_token_files(ENV["FL_PY_FOLLOWER_TOKEN_DIR"]))
        self.state["t1"] = want

    def test_2_stamped_writes_pass_the_webhook_then_a_release_hands_over(self):
        t1 = self.state["t1"]
        with leading(self.a, wait=False) as lead:
            self.assertEqual(lead.token(), t1)
            # The real sidecar takes an acknowledgement of the current tenure only.
            self.a.acknowledge(t1)
            with self.assertRaises(NotLeader):
                self.a.acknowledge(Token(t1.generation + 1, t1.lease_uid))
            cm = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"name": "orders-state", "labels": {LEASE_LABEL: ENV["FL_PY_LEASE"]}},
                  "data": {"step": "0"}}
            stamp(cm, lead)
            ok, _, err = kubectl("create", "-f", "-", stdin=json.dumps(cm))
            self.assertTrue(ok, f"a stamped create was refused: {err}")
            # Two updates in a row: each needs a write id of its own.
            for step in ("1", "2"):
                body = merge_patch(lead, {"data": {"step": step}})
                ok, _, err = patch(body)
                self.assertTrue(ok, f"a stamped merge patch (step {step}) was refused: {err}")
            self.assertEqual(stored()["data"]["step"], "2")
            self.assertEqual(stored()["metadata"]["annotations"][TOKEN_ANNOTATION], str(t1.generation))
            # The webhook is really judging: the same stamp again does not present the token.
            ok, _, err = patch(body)
            self.assertFalse(ok, "a write id reused was accepted: the webhook is not in effect")
            self.assertIn("does not present a token of its own", err)

            watch_b = Collector(self.b)
            try:
                watch_b.first("pod-b's watch to start", lambda e: isinstance(e, Status))
                lead.release()
                self.assertTrue(lead.lost.is_set())
                with self.assertRaises(LeadershipLost):
                    lead.token()
                took = watch_b.first("pod-b's watch to report pod-b leading",
                                     lambda e: isinstance(e, Status) and e.leading, timeout=5.0)
            finally:
                watch_b.close()
        t2 = took.token
        self.assertEqual(t2.lease_uid, t1.lease_uid)
        self.assertGreater(t2.generation, t1.generation)
        self.assertEqual(self.b.token(), t2)
        with self.assertRaises(NotLeader):
            self.a.token()
        eventually("pod-a's token files to go", lambda: read_token_files(ENV["FL_PY_LEADER_TOKEN_DIR"]) is None, 5)
        self.assertEqual(read_token_files(ENV["FL_PY_FOLLOWER_TOKEN_DIR"]), t2)
        ok, _, err = patch(merge_patch(t1, {"data": {"step": "stale"}}))
        self.assertFalse(ok, "the released token was accepted")
        self.assertIn(f"stale token {t1.generation}", err)
        ok, _, err = patch(merge_patch(self.b.token(), {"data": {"step": "3"}}))
        self.assertTrue(ok, f"the new leader's write was refused: {err}")
        self.state["t2"] = t2

    def test_3_a_killed_leader_is_replaced_and_its_leftover_token_refused(self):
        t2 = self.state["t2"]
        sync = ENV["FL_PY_SYNC_DIR"]
        with leading(self.b, wait=False) as lead_b:
            self.assertEqual(lead_b.token(), t2)
            watch_a = Collector(self.a)
            watch_b = Collector(self.b)
            try:
                watch_a.first("pod-a's watch to start", lambda e: isinstance(e, Status))
                watch_b.first("pod-b's watch to start", lambda e: isinstance(e, Status))
                with open(os.path.join(sync, "kill.tmp"), "w") as f:
                    f.write(self.b_id)
                os.rename(os.path.join(sync, "kill.tmp"), os.path.join(sync, "kill"))
                self.assertTrue(lead_b.wait_lost(10), "leading() did not notice its sidecar killed")
                self.assertRegex(lead_b.reason, "connection to the sidecar broke|watch .* ended|ran out")
                with self.assertRaises(LeadershipLost):
                    lead_b.token()
                gone = watch_b.first("pod-b's watch to report the disconnect",
                                     lambda e: isinstance(e, Disconnected), timeout=5.0)
                self.assertFalse(gone.leading)
                took = watch_a.first("pod-a's watch to report pod-a leading after pod-b's lease ran out",
                                     lambda e: isinstance(e, Status) and e.leading, timeout=15.0)
            finally:
                watch_a.close()
                watch_b.close()
        t3 = took.token
        self.assertGreater(t3.generation, t2.generation)
        self.assertEqual(self.a.token(), t3)
        # SIGKILL left pod-b's token files behind: a hint, not the truth, as the webhook shows.
        left = read_token_files(ENV["FL_PY_FOLLOWER_TOKEN_DIR"])
        self.assertEqual(left, t2, "SIGKILL should have left pod-b's token file")
        ok, _, err = patch(merge_patch(left, {"data": {"step": "from-a-dead-leader"}}))
        self.assertFalse(ok, "the dead leader's leftover token was accepted")
        self.assertIn(f"stale token {t2.generation}", err)
        ok, _, err = patch(merge_patch(self.a.token(), {"data": {"step": "4"}}))
        self.assertTrue(ok, f"the new leader's write was refused: {err}")
        self.assertEqual(stored()["data"]["step"], "4")
        with open(os.path.join(sync, "result.json"), "w") as f:
            json.dump({"token": t3.generation, "leaseUID": t3.lease_uid, "holder": self.a_id}, f)


if __name__ == "__main__":
    unittest.main()
