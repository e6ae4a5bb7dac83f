"""Client against a fake sidecar: parsing, errors with advice, bounded reads, and the watch
stream's edge cases (split chunks, comments, disconnects and reconnects, silence)."""

import os
import socket
import threading
import time
import unittest
from unittest import mock

from fencedlease import (
    Client,
    Disconnected,
    NotLeader,
    ProtocolError,
    SidecarUnavailable,
    Status,
    Token,
    Unauthorized,
)

from .fake import (
    FakeServer,
    chunk,
    end_chunks,
    respond,
    respond_json,
    sse_event,
    sse_head,
    status_json,
)


def serve(handler):
    return FakeServer(handler)


def closed_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Urls(unittest.TestCase):
    def test_default_is_the_env_then_the_sidecar_default(self):
        with mock.patch.dict(os.environ, {"FENCEDLEASE_URL": "http://127.0.0.1:9999/"}):
            self.assertEqual(Client().url, "http://127.0.0.1:9999")
        with mock.patch.dict(os.environ, {}, clear=True):
            self.assertEqual(Client().url, "http://127.0.0.1:8787")

    def test_bad_urls_are_refused_with_the_way_to_write_them(self):
        for url, says in [("https://127.0.0.1:8787", "plain http://"), ("127.0.0.1:8787", "plain http://"),
                          ("http://", "no host"), ("http://h:99999", "out of range"),
                          ("http://h:1/?x=1", "only http://HOST:PORT")]:
            with self.subTest(url=url), self.assertRaisesRegex(ValueError, says):
                Client(url)


class Requests(unittest.TestCase):
    def test_status_parses_and_anchors_the_deadline_before_sending(self):
        def h(req, conn):
            time.sleep(0.2)  # the answer takes a while: the deadline must not start after it
            respond_json(conn, 200, status_json(True, 7, time_left_ms=1000))

        with serve(h) as s:
            before = time.monotonic()
            st = Client(s.url).status()
            after = time.monotonic()
        self.assertTrue(st.leading)
        self.assertEqual(st.token, Token(7, "uid-1"))
        self.assertEqual(str(st.token), "7")
        self.assertEqual((st.lease, st.namespace, st.identity, st.holder), ("db", "shop", "pod-a", "pod-a"))
        self.assertGreaterEqual(st.valid_until, before + 1.0)
        self.assertLessEqual(st.valid_until, after + 1.0 - 0.2)

    def test_a_follower_status_has_no_token(self):
        with serve(lambda r, c: respond_json(c, 200, status_json(False, holder="pod-b"))) as s:
            st = Client(s.url).status()
        self.assertEqual((st.leading, st.token, st.holder, st.valid_until), (False, None, "pod-b", None))

    def test_token_while_leading(self):
        with serve(lambda r, c: respond_json(c, 200, {"token": 12, "leaseUID": "u-9"})) as s:
            self.assertEqual(Client(s.url).token(), Token(12, "u-9"))
            self.assertEqual(s.requests[0].path, "/v1/token")

    def test_token_when_not_leading_raises_not_leader_with_the_holder(self):
        with serve(lambda r, c: respond_json(c, 409, {"error": "not leading", "holder": "pod-b"})) as s:
            with self.assertRaises(NotLeader) as cm:
                Client(s.url).token()
        self.assertEqual(cm.exception.holder, "pod-b")
        self.assertIn("does not lead (holder: pod-b)", str(cm.exception))

    def test_release_posts(self):
        with serve(lambda r, c: respond_json(c, 202, {"releasing": True})) as s:
            Client(s.url).release()
            self.assertEqual((s.requests[0].method, s.requests[0].path), ("POST", "/v1/release"))

    def test_a_path_prefix_is_kept(self):
        with serve(lambda r, c: respond_json(c, 200, {"token": 1, "leaseUID": "u"})) as s:
            Client(s.url + "/sidecar/").token()
            self.assertEqual(s.requests[0].path, "/sidecar/v1/token")


class Secret(unittest.TestCase):
    """The sidecar answers only requests with the pod's API secret (a port-forward reaches its
    loopback): the client sends the secret file's contents, read afresh each time."""

    def test_the_secret_file_is_sent_as_a_bearer_token(self):
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "api-secret")
            with open(path, "w") as f:
                f.write("ab" * 32 + "\n")
            with serve(lambda r, c: respond_json(c, 200, {"token": 1, "leaseUID": "u"})) as s:
                Client(s.url, secret_file=path).token()
                with mock.patch.dict(os.environ, {"FENCEDLEASE_API_SECRET_FILE": path}):
                    Client(s.url).token()
                Client(s.url, secret_file=os.path.join(d, "absent")).token()
            sent = [r.headers.get("authorization") for r in s.requests]
        self.assertEqual(sent, ["Bearer " + "ab" * 32] * 2 + [None])

    def test_a_refusal_raises_unauthorized_naming_the_file(self):
        def h(req, conn):
            respond_json(conn, 401, {"error": "send the contents of api-secret"})

        with serve(h) as s:
            c = Client(s.url, secret_file="/nowhere/api-secret")
            for call in (c.status, c.token, c.release, lambda: next(iter(c.watch()))):
                with self.subTest(call=call), self.assertRaises(Unauthorized) as cm:
                    call()
                self.assertIn("/nowhere/api-secret", str(cm.exception))
                self.assertIn("FENCEDLEASE_API_SECRET_FILE", str(cm.exception))


class Errors(unittest.TestCase):
    def test_connection_refused_says_what_to_check(self):
        c = Client(f"http://127.0.0.1:{closed_port()}")
        for call in (c.status, c.token, c.release):
            with self.subTest(call=call.__name__), self.assertRaises(SidecarUnavailable) as cm:
                call()
            msg = str(cm.exception)
            self.assertIn("connection refused", msg)
            self.assertIn("FENCEDLEASE_URL", msg)

    def test_a_silent_sidecar_times_out(self):
        with serve(lambda r, c: time.sleep(3)) as s:
            t0 = time.monotonic()
            with self.assertRaisesRegex(SidecarUnavailable, "did not answer within 0.3 s"):
                Client(s.url, timeout=0.3).status()
            self.assertLess(time.monotonic() - t0, 2)

    def test_a_connection_closed_without_answer(self):
        with serve(lambda r, c: None) as s:
            with self.assertRaisesRegex(SidecarUnavailable, "closed the connection"):
                Client(s.url).status()

    def test_bad_json(self):
        with serve(lambda r, c: respond(c, 200, b"<html>hello</html>", "text/html")) as s:
            with self.assertRaisesRegex(ProtocolError, "not JSON.*<html>hello"):
                Client(s.url).status()

    def test_json_of_the_wrong_shape(self):
        cases = [
            ([1, 2], "expected a JSON object"),
            ({**status_json(True, 3), "token": None}, "says leading but carries no token"),
            ({**status_json(True, 3), "token": True}, "field 'token' is True"),
            ({**status_json(True, 3), "token": "3"}, "field 'token' is '3'"),
            ({**status_json(True, 3), "token": 0}, "from 1 to 2\\^63-1"),
            ({**status_json(False), "token": 4}, "says not leading but carries token 4"),
            ({k: v for k, v in status_json(False).items() if k != "leading"}, "'leading' is missing"),
        ]
        for body, says in cases:
            with self.subTest(body=body), serve(lambda r, c, b=body: respond_json(c, 200, b)) as s:
                with self.assertRaisesRegex(ProtocolError, says):
                    Client(s.url).status()
        for body in [{"token": "5", "leaseUID": "u"}, {"token": 5}, {"token": -1, "leaseUID": "u"}]:
            with self.subTest(body=body), serve(lambda r, c, b=body: respond_json(c, 200, b)) as s:
                with self.assertRaises(ProtocolError):
                    Client(s.url).token()

    def test_not_found_hints_at_the_right_port(self):
        with serve(lambda r, c: respond(c, 404, b"")) as s:
            with self.assertRaisesRegex(ProtocolError, "HTTP 404.*sidecar API \\(default port 8787\\)"):
                Client(s.url).token()

    def test_release_refused(self):
        with serve(lambda r, c: respond(c, 500, b"boom")) as s:
            with self.assertRaisesRegex(ProtocolError, "unexpected HTTP 500"):
                Client(s.url).release()

    def test_a_huge_announced_body_is_refused_without_reading_it(self):
        sent = []

        def h(req, conn):
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000000\r\n\r\n")
            try:
                for _ in range(100000):
                    conn.sendall(b" " * 1000)
                    sent.append(1)
            except OSError:
                pass

        with serve(h) as s:
            with self.assertRaisesRegex(ProtocolError, "over the 65536-byte limit"):
                Client(s.url).status()
        self.assertLess(len(sent), 100000, "the client read the whole body")

    def test_a_huge_body_without_length_is_read_only_up_to_the_limit(self):
        def h(req, conn):
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n")
            try:
                for _ in range(100000):
                    conn.sendall(b"[" * 1000)
            except OSError:
                pass

        with serve(h) as s:
            with self.assertRaisesRegex(ProtocolError, "over the 65536-byte limit"):
                Client(s.url).status()

    def test_endless_headers_are_bounded(self):
        def h(req, conn):
            conn.sendall(b"HTTP/1.1 200 OK\r\n")
            try:
                for i in range(1000):
                    conn.sendall(b"X-%d: y\r\n" % i)
            except OSError:
                pass

        with serve(h) as s:
            with self.assertRaisesRegex(ProtocolError, "not an HTTP answer the sidecar would send"):
                Client(s.url).status()


def sse_server(script):
    """A server whose n-th /v1/watch connection runs script[n](conn) after the head; later ones
    are refused with 500."""
    calls = []

    def h(req, conn):
        n = len(calls)
        calls.append(n)
        if n >= len(script):
            respond(conn, 500, b"no more")
            return
        sse_head(conn)
        script[n](conn)

    return serve(h)


def dribble(conn, data, size=3):
    """Sends data in tiny chunks (each its own HTTP chunk and TCP segment)."""
    for i in range(0, len(data), size):
        chunk(conn, data[i : i + size])
        time.sleep(0.001)


class Watching(unittest.TestCase):
    def test_events_split_in_tiny_pieces_with_comments_between(self):
        a, b = status_json(False, holder="pod-b"), status_json(True, 5)

        def script(conn):
            dribble(conn, b":\n\n" + sse_event(a) + b": keep-alive\n\n" + sse_event(b).replace(b"\n", b"\r\n"))
            time.sleep(5)

        with sse_server([script]) as s, Client(s.url).watch(reconnect=False) as w:
            first, second = next(w), next(w)
        self.assertIsInstance(first, Status)
        self.assertEqual((first.leading, first.holder, first.valid_until), (False, "pod-b", None))
        self.assertEqual((second.leading, second.token), (True, Token(5, "uid-1")))

    def test_unknown_event_types_are_skipped(self):
        def script(conn):
            chunk(conn, b"event: future\ndata: {}\n\ndata: plain message\n\n" + sse_event(status_json(True, 2)))
            time.sleep(5)

        with sse_server([script]) as s, Client(s.url).watch(reconnect=False) as w:
            self.assertEqual(next(w).token, Token(2, "uid-1"))

    def test_a_disconnect_yields_disconnected_then_reconnects_to_the_current_status(self):
        def first(conn):
            chunk(conn, sse_event(status_json(True, 5)))
            time.sleep(0.1)
            end_chunks(conn)  # the stream ends cleanly: the sidecar stopped

        def second(conn):
            chunk(conn, sse_event(status_json(False, holder="pod-b")))
            time.sleep(5)

        with sse_server([first, second]) as s, Client(s.url).watch(backoff=(0.05, 0.1)) as w:
            events = [next(w), next(w), next(w)]
            self.assertEqual(w.connections, 2)
        self.assertEqual(events[0].token, Token(5, "uid-1"))
        self.assertIsInstance(events[1], Disconnected)
        self.assertFalse(events[1].leading, "a disconnect reads as not leading")
        self.assertIsNone(events[1].token)
        self.assertIn("ended the stream", events[1].error)
        self.assertEqual((events[2].leading, events[2].holder), (False, "pod-b"))

    def test_an_outage_yields_one_disconnected_however_many_retries_it_takes(self):
        refused_until = time.monotonic() + 0.5
        calls = []

        def h(req, conn):
            calls.append(1)
            if time.monotonic() < refused_until:
                return  # closes without an answer: like a sidecar starting up
            sse_head(conn)
            chunk(conn, sse_event(status_json(True, 8)))
            time.sleep(5)

        with serve(h) as s, Client(s.url).watch(backoff=(0.02, 0.05)) as w:
            first, second = next(w), next(w)
        self.assertIsInstance(first, Disconnected)
        self.assertEqual(second.token, Token(8, "uid-1"))
        self.assertGreater(len(calls), 3, "it retried")

    def test_without_reconnect_a_disconnect_raises(self):
        def first(conn):
            chunk(conn, sse_event(status_json(True, 5)))
            time.sleep(0.1)

        with sse_server([first]) as s, Client(s.url).watch(reconnect=False) as w:
            next(w)
            with self.assertRaisesRegex(SidecarUnavailable, "closed the connection|ended the stream|broke in the middle"):
                next(w)

    def test_a_silent_stream_counts_as_broken(self):
        def script(conn):
            chunk(conn, sse_event(status_json(True, 5)))
            time.sleep(5)  # not even a keep-alive

        with sse_server([script]) as s, Client(s.url).watch(reconnect=False, idle_timeout=0.3) as w:
            next(w)
            t0 = time.monotonic()
            with self.assertRaisesRegex(SidecarUnavailable, "nothing arrived for 0.3 s"):
                next(w)
            self.assertLess(time.monotonic() - t0, 2)

    def test_keep_alives_keep_a_quiet_stream_alive(self):
        def script(conn):
            chunk(conn, sse_event(status_json(True, 5)))
            for _ in range(6):
                time.sleep(0.1)
                chunk(conn, b":\n\n")
            chunk(conn, sse_event(status_json(False)))
            time.sleep(5)

        with sse_server([script]) as s, Client(s.url).watch(reconnect=False, idle_timeout=0.3) as w:
            self.assertTrue(next(w).leading)
            self.assertFalse(next(w).leading)

    def test_give_up_after_a_long_outage(self):
        with Client(f"http://127.0.0.1:{closed_port()}").watch(backoff=(0.02, 0.05), give_up_after=0.3) as w:
            self.assertIsInstance(next(w), Disconnected)
            with self.assertRaisesRegex(SidecarUnavailable, "no connection to the sidecar for over 0.3 s"):
                next(w)

    def test_not_an_event_stream(self):
        with serve(lambda r, c: respond_json(c, 200, {"hello": 1})) as s:
            with Client(s.url).watch() as w, self.assertRaisesRegex(ProtocolError, "expected 200 text/event-stream"):
                next(w)

    def test_bad_json_in_an_event(self):
        def script(conn):
            chunk(conn, b"event: status\ndata: {not json\n\n")
            time.sleep(5)

        with sse_server([script]) as s, Client(s.url).watch() as w:
            with self.assertRaisesRegex(ProtocolError, "an event's data is not JSON"):
                next(w)

    def test_an_endless_line_is_bounded(self):
        def script(conn):
            try:
                for _ in range(1000):
                    chunk(conn, b"data: " + b"x" * 4096)
            except OSError:
                pass

        with sse_server([script]) as s, Client(s.url).watch() as w:
            with self.assertRaisesRegex(ProtocolError, "longer than 65536 bytes"):
                next(w)

    def test_close_from_another_thread_ends_a_blocked_iteration(self):
        def script(conn):
            chunk(conn, sse_event(status_json(True, 5)))
            time.sleep(5)

        with sse_server([script]) as s:
            w = Client(s.url).watch()
            next(w)
            threading.Timer(0.2, w.close).start()
            t0 = time.monotonic()
            self.assertEqual(list(w), [])
            self.assertLess(time.monotonic() - t0, 2)


if __name__ == "__main__":
    unittest.main()
