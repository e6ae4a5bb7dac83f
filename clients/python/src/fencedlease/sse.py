"""An incremental parser for Server-Sent Events (the text/event-stream format of the WHATWG
HTML standard), fed with whatever chunks the socket delivers.

Lines may end in CRLF, LF or CR, and a line ending may be split across chunks (a CR at the end
of one chunk and the LF at the start of the next are one line ending). Comment lines (starting
with ``:``) are the sidecar's keep-alives and are skipped. A line longer than ``max_line`` bytes
or an event whose data exceeds ``max_event`` bytes raises ProtocolError, so that a broken or
hostile peer cannot make the client buffer without bound.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional

from .errors import ProtocolError

_EOL = re.compile(rb"[\r\n]")
_CR, _LF = 0x0D, 0x0A
_BOM = "\ufeff"

#: Longest line accepted (bytes, without its line ending).
MAX_LINE = 64 * 1024
#: Most data one event may carry (bytes).
MAX_EVENT = 1024 * 1024


@dataclass(frozen=True)
class SSEEvent:
    """One dispatched event: its type (``message`` unless an ``event:`` field named one), its
    data (``data:`` lines joined with newlines), and the last event id seen on the stream."""

    type: str
    data: str
    id: Optional[str] = None


class SSEParser:
    """Feed bytes with :meth:`feed`; it returns the events those bytes completed."""

    def __init__(self, max_line: int = MAX_LINE, max_event: int = MAX_EVENT):
        self.max_line = max_line
        self.max_event = max_event
        self._line = bytearray()
        self._skip_lf = False  # the last chunk ended in CR: a leading LF belongs to it
        self._first_line = True
        self._event_type = ""
        self._data: List[str] = []
        self._data_bytes = 0
        self.last_event_id: Optional[str] = None
        #: Reconnection time the server asked for (``retry:``), in milliseconds.
        self.retry_ms: Optional[int] = None
        #: How many comment lines were seen (keep-alives).
        self.comments = 0

    def feed(self, chunk: bytes) -> List[SSEEvent]:
        events: List[SSEEvent] = []
        pos, n = 0, len(chunk)
        if self._skip_lf and n:
            self._skip_lf = False
            if chunk[0] == _LF:
                pos = 1
        while pos < n:
            m = _EOL.search(chunk, pos)
            end = n if m is None else m.start()
            if len(self._line) + (end - pos) > self.max_line:
                raise ProtocolError(
                    f"event stream line longer than {self.max_line} bytes: this is not the "
                    "fencedlease sidecar's /v1/watch, or the stream is corrupt"
                )
            self._line += chunk[pos:end]
            if m is None:
                break
            if chunk[end] == _CR:
                if end + 1 < n:
                    pos = end + 2 if chunk[end + 1] == _LF else end + 1
                else:
                    self._skip_lf = True
                    pos = n
            else:
                pos = end + 1
            line = self._line.decode("utf-8", errors="replace")
            self._line.clear()
            ev = self._process_line(line)
            if ev is not None:
                events.append(ev)
        return events

    def _process_line(self, line: str) -> Optional[SSEEvent]:
        if self._first_line:
            self._first_line = False
            if line.startswith(_BOM):
                line = line[1:]
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            self.comments += 1
            return None
        field, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data_bytes += len(value.encode("utf-8")) + 1
            if self._data_bytes > self.max_event:
                raise ProtocolError(
                    f"event stream event larger than {self.max_event} bytes: this is not the "
                    "fencedlease sidecar's /v1/watch, or the stream is corrupt"
                )
            self._data.append(value)
        elif field == "event":
            self._event_type = value
        elif field == "id":
            if "\0" not in value:
                self.last_event_id = value
        elif field == "retry":
            if value.isascii() and value.isdigit():
                self.retry_ms = int(value)
        # Any other field is ignored, as the standard says.
        return None

    def _dispatch(self) -> Optional[SSEEvent]:
        data, kind = self._data, self._event_type
        self._data, self._data_bytes, self._event_type = [], 0, ""
        if not data:
            return None
        return SSEEvent(type=kind or "message", data="\n".join(data), id=self.last_event_id)
