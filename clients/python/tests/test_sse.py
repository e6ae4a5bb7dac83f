"""The event-stream parser, fed the way a socket delivers bytes: in arbitrary pieces."""

import unittest

from fencedlease import ProtocolError, SSEEvent, SSEParser


def feed_all(pieces, parser=None):
    p = parser or SSEParser()
    out = []
    for piece in pieces:
        out.extend(p.feed(piece))
    return out


STREAM = (
    b": keep-alive\n\n"
    b"event: status\ndata: {\"a\": 1}\n\n"
    b":\n"
    b"event: status\r\ndata: line one\r\ndata: line two\r\n\r\n"
    b"event: status\rdata: {\"c\": 3}\r\r"
)
EXPECTED = [
    SSEEvent("status", '{"a": 1}'),
    SSEEvent("status", "line one\nline two"),
    SSEEvent("status", '{"c": 3}'),
]


class SplitChunks(unittest.TestCase):
    def test_whole_stream_at_once(self):
        self.assertEqual(feed_all([STREAM]), EXPECTED)

    def test_every_split_point_gives_the_same_events(self):
        for i in range(len(STREAM) + 1):
            with self.subTest(split=i):
                self.assertEqual(feed_all([STREAM[:i], STREAM[i:]]), EXPECTED)

    def test_byte_by_byte(self):
        self.assertEqual(feed_all([STREAM[i : i + 1] for i in range(len(STREAM))]), EXPECTED)

    def test_crlf_split_across_chunks_is_one_line_ending(self):
        # Were the LF taken for a line of its own, it would be a blank line and dispatch "a"
        # alone, then "b" as a second event.
        events = feed_all([b"data: a\r", b"\ndata: b\r\n\r\n"])
        self.assertEqual(events, [SSEEvent("message", "a\nb")])

    def test_empty_chunks_do_not_disturb_a_pending_cr(self):
        events = feed_all([b"data: a\r", b"", b"\n", b"data: b\n\n"])
        self.assertEqual(events, [SSEEvent("message", "a\nb")])

    def test_a_multibyte_character_split_across_chunks(self):
        data = "data: caf\u00e9 \u2713\n\n".encode()
        cut = data.index(b"\xc3") + 1
        self.assertEqual(feed_all([data[:cut], data[cut:]]), [SSEEvent("message", "caf\u00e9 \u2713")])


class Fields(unittest.TestCase):
    def test_comments_are_counted_and_never_dispatch(self):
        p = SSEParser()
        self.assertEqual(p.feed(b": ping\n\n:\n\n:x\n"), [])
        self.assertEqual(p.comments, 3)

    def test_default_type_is_message_and_event_names_it(self):
        self.assertEqual(feed_all([b"data: x\n\nevent: status\ndata: y\n\n"]),
                         [SSEEvent("message", "x"), SSEEvent("status", "y")])

    def test_the_event_type_does_not_leak_into_the_next_event(self):
        self.assertEqual(feed_all([b"event: status\ndata: x\n\ndata: y\n\n"]),
                         [SSEEvent("status", "x"), SSEEvent("message", "y")])

    def test_only_one_space_after_the_colon_is_removed(self):
        self.assertEqual(feed_all([b"data:x\n\ndata:  y\n\n"]),
                         [SSEEvent("message", "x"), SSEEvent("message", " y")])

    def test_a_field_without_colon_has_an_empty_value(self):
        self.assertEqual(feed_all([b"data\ndata\n\n"]), [SSEEvent("message", "\n")])

    def test_an_event_without_data_is_not_dispatched(self):
        self.assertEqual(feed_all([b"event: status\n\n"]), [])

    def test_unknown_fields_are_ignored_and_id_retry_kept(self):
        p = SSEParser()
        events = p.feed(b"foo: bar\nid: 7\nretry: 1500\nretry: soon\ndata: z\n\n")
        self.assertEqual(events, [SSEEvent("message", "z", id="7")])
        self.assertEqual(p.retry_ms, 1500)

    def test_a_leading_bom_is_ignored(self):
        self.assertEqual(feed_all([b"\xef\xbb", b"\xbfdata: x\n\n"]), [SSEEvent("message", "x")])

    def test_an_unfinished_event_is_not_dispatched(self):
        self.assertEqual(feed_all([b"data: x\n", b"data: y"]), [])


class Bounds(unittest.TestCase):
    def test_a_line_without_end_is_bounded(self):
        p = SSEParser(max_line=100)
        p.feed(b"data: " + b"x" * 90)
        with self.assertRaisesRegex(ProtocolError, "longer than 100 bytes"):
            p.feed(b"x" * 20)

    def test_an_event_is_bounded_across_lines(self):
        p = SSEParser(max_line=100, max_event=250)
        line = b"data: " + b"x" * 80 + b"\n"
        p.feed(line * 3)
        with self.assertRaisesRegex(ProtocolError, "larger than 250 bytes"):
            p.feed(line)


if __name__ == "__main__":
    unittest.main()
