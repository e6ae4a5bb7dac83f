"""The values the sidecar hands out: tokens and status snapshots."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .errors import ProtocolError

#: The largest fencing token: a Kubernetes generation is an int64.
MAX_TOKEN = 2**63 - 1


@dataclass(frozen=True)
class Token:
    """A fencing token: the FencedLease's ``metadata.generation`` while this pod holds it, and
    the lease's UID (a re-created lease starts again at generation 1, so the pair is the token).

    ``str(token)`` is the decimal generation, as the ``fencedlease.io/token`` annotation wants.
    """

    generation: int
    lease_uid: str

    def __post_init__(self) -> None:
        if (
            isinstance(self.generation, bool)
            or not isinstance(self.generation, int)
            or not 1 <= self.generation <= MAX_TOKEN
        ):
            raise ValueError(f"a fencing token is an integer from 1 to 2^63-1, not {self.generation!r}")
        if not isinstance(self.lease_uid, str) or not self.lease_uid:
            raise ValueError(f"a token needs its lease UID (a non-empty string), not {self.lease_uid!r}")

    def __str__(self) -> str:
        return str(self.generation)


def parse_token(text: str) -> int:
    """Parses a token the way the fencing webhook does: a canonical positive decimal that fits
    64 bits (no sign, spaces or leading zeros). Raises ValueError saying why not."""
    if text == "":
        raise ValueError("it is empty")
    if not text.isascii() or not text.isdigit():
        raise ValueError(f"{text!r} is not a decimal number")
    if len(text) > 1 and text[0] == "0":
        raise ValueError(f"{text!r} has leading zeros")
    n = int(text)
    if n == 0:
        raise ValueError("tokens start at 1")
    if n > MAX_TOKEN:
        raise ValueError(f"{text} is larger than a 64-bit generation can be")
    return n


@dataclass(frozen=True)
class Status:
    """One answer of ``/v1/status``, or one event of ``/v1/watch``.

    ``token`` is set exactly when ``leading`` is. ``valid_until`` is a ``now()``
    deadline until which the sidecar vouched for this leadership, counted conservatively from
    when the request was *sent*; it is set only on :meth:`Client.status` results. Watch events
    leave it None: an event may have waited in the socket while this process was paused, so
    the time left it reports cannot be anchored to a moment on this side.
    """

    lease: str
    namespace: str
    identity: str
    leading: bool
    token: Optional[Token]
    holder: Optional[str]
    time_left_ms: Optional[int]
    app_healthy: bool
    valid_until: Optional[float] = None

    @property
    def connected(self) -> bool:
        """Always True: this came from the sidecar (see :class:`Disconnected`)."""
        return True

    @classmethod
    def from_json(cls, obj: Any, where: str, sent_at: Optional[float] = None) -> "Status":
        """Validates the sidecar's JSON strictly; ProtocolError names the field that is wrong."""
        if not isinstance(obj, Mapping):
            raise ProtocolError(f"{where}: expected a JSON object, got {type(obj).__name__}")

        def field(name: str, kinds: tuple, optional: bool = False) -> Any:
            if name not in obj:
                if optional:
                    return None
                raise ProtocolError(f"{where}: field {name!r} is missing (is this the fencedlease sidecar?)")
            v = obj[name]
            if v is None and optional:
                return None
            if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
                raise ProtocolError(f"{where}: field {name!r} is {v!r}, not of type {'/'.join(k.__name__ for k in kinds)}")
            return v

        leading = field("leading", (bool,))
        generation = field("token", (int,), optional=True)
        uid = field("leaseUID", (str,), optional=True)
        time_left = field("timeLeftMs", (int,), optional=True)
        token = None
        if leading:
            if generation is None or uid is None:
                raise ProtocolError(f"{where}: says leading but carries no token and lease UID: {dict(obj)!r}")
            try:
                token = Token(generation, uid)
            except ValueError as e:
                raise ProtocolError(f"{where}: {e}") from None
        elif generation is not None:
            raise ProtocolError(f"{where}: says not leading but carries token {generation!r}")
        valid_until = None
        if leading and sent_at is not None and time_left is not None:
            valid_until = sent_at + max(0, time_left) / 1000.0
        return cls(
            lease=field("lease", (str,)),
            namespace=field("namespace", (str,)),
            identity=field("identity", (str,)),
            leading=leading,
            token=token,
            holder=field("holder", (str,), optional=True),
            time_left_ms=time_left,
            app_healthy=field("appHealthy", (bool,)),
            valid_until=valid_until,
        )


@dataclass(frozen=True)
class Disconnected:
    """Yielded by :meth:`Client.watch` (with ``reconnect=True``) when the stream to the sidecar
    broke: from now until the next :class:`Status`, nothing is known. It reads as "not leading"
    (``leading`` is False, ``token`` None), so a loop written for Status events stops work on
    it. ``error`` says what happened; ``since`` is the ``now()`` of the break."""

    error: str
    since: float
    leading: bool = False
    token: Optional[Token] = None

    @property
    def connected(self) -> bool:
        return False


_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)


def now() -> float:
    """Seconds on the clock every deadline is on: CLOCK_BOOTTIME where there is one (Linux),
    which keeps counting while the machine is suspended, so a deadline that passed during a
    suspend has passed on resuming; else the monotonic clock."""
    if _BOOTTIME is not None:
        return time.clock_gettime(_BOOTTIME)
    return time.monotonic()
