"""Running work only while leading: ``with leading(client) as lead:`` and ``@while_leading``.

What this can and cannot promise
--------------------------------
Python cannot stop your code at the instant leadership ends, and no check made before a write
rules out a pause (a GC, a frozen VM) between the check and the write. So this module does two
things and leaves the third to fencing:

1. ``lead.token()`` (and ``lead.check()``) raise :class:`LeadershipLost` once leadership is
   over *or can no longer be vouched for*: the sidecar reported a loss or a new token, the
   stream to it broke, or the deadline until which it last confirmed leadership passed. The
   deadline is measured on this process's CLOCK_BOOTTIME (suspend counts) from when the confirming request was
   *sent*, so a process that was paused finds it expired when it wakes, before the watcher
   thread has even read the news. An app that takes its token from ``lead.token()`` right
   before each write therefore never keeps using an old token *silently*.
2. ``lead.lost`` is a ``threading.Event`` set as soon as the loss is known, for loops that wait
   on it or threads that must stop.
3. A write already on its way when leadership ends is made safe only by the fencing webhook,
   which refuses the old token. Stamp every protected write with the token (``stamp()``).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Optional, TypeVar

from .client import Client
from .errors import FencedLeaseError, LeadershipLost, NotLeader, SidecarUnavailable
from .model import Disconnected, Status, Token, now

F = TypeVar("F", bound=Callable[..., Any])


class Leadership:
    """One tenure: the token this pod leads with, from the moment ``leading()`` saw it until it
    is lost. It never comes back: after a loss, enter a new ``leading()`` block."""

    def __init__(self, client: Client, token: Token, valid_until: float):
        self.client = client
        self._token = token
        self._valid_until = valid_until
        self._lock = threading.Lock()
        #: Set as soon as the loss of this tenure is known.
        self.lost = threading.Event()
        self._reason: Optional[str] = None

    def __repr__(self) -> str:
        state = f"lost: {self._reason}" if self.lost.is_set() else f"valid for {self.time_left():.3f} s"
        return f"<Leadership token={self._token.generation} {state}>"

    @property
    def reason(self) -> Optional[str]:
        """Why the tenure ended (None while it lasts)."""
        return self._reason

    def time_left(self) -> float:
        """Seconds until the sidecar's last confirmation runs out (0 once lost)."""
        if self.lost.is_set():
            return 0.0
        with self._lock:
            return max(0.0, self._valid_until - now())

    def token(self) -> Token:
        """The tenure's token, if it is still vouched for right now; else raises
        :class:`LeadershipLost`. Call it right before each write and stamp the write with it."""
        if not self.lost.is_set():
            with self._lock:
                expired = now() >= self._valid_until
            if expired:
                self._lose(
                    "the sidecar's last confirmation of leadership ran out before a new one "
                    "arrived (this process or the sidecar may have been paused)"
                )
        if self.lost.is_set():
            raise LeadershipLost(
                f"leadership with token {self._token.generation} is over: {self._reason}; stop "
                "writing with it (the fencing webhook refuses it) and wait for leadership again",
                token=self._token,
            )
        return self._token

    check = token

    def pin_headers(self) -> dict:
        """HTTP headers that pin a write sent through the sidecar's Kubernetes API proxy to this
        tenure (``fencedlease-token``, ``fencedlease-lease-uid``): the proxy refuses the write if
        the pod leads in another tenure by the time it arrives, instead of stamping it with the
        new token. Checks :meth:`token` first (raises :class:`LeadershipLost` once over)."""
        t = self.token()
        return {"fencedlease-token": str(t.generation), "fencedlease-lease-uid": t.lease_uid}

    def wait_lost(self, timeout: Optional[float] = None) -> bool:
        """Blocks until the tenure is lost (True) or ``timeout`` passes (False). Also notices a
        deadline that passes without an event."""
        end = None if timeout is None else now() + timeout
        while True:
            with self._lock:
                until = self._valid_until
            wait = until - now()
            if end is not None:
                wait = min(wait, end - now())
            if self.lost.wait(max(0.0, wait)):
                return True
            try:
                self.token()
            except LeadershipLost:
                return True
            if end is not None and now() >= end:
                return False

    def release(self) -> None:
        """Steps down now (``POST /v1/release``); the tenure is over from this call on."""
        self._lose("released by this process")
        self.client.release()

    # -- for the watcher threads -----------------------------------------------------------

    def _lose(self, reason: str) -> None:
        with self._lock:
            if self._reason is None:
                self._reason = reason
        self.lost.set()

    def _confirm(self, valid_until: float) -> None:
        with self._lock:
            if valid_until > self._valid_until:
                self._valid_until = valid_until

    def _judge(self, ev: Any) -> None:
        """Applies a watch event or a status answer to the tenure."""
        if isinstance(ev, Disconnected):
            self._lose(f"the connection to the sidecar broke ({ev.error})")
        elif not ev.leading:
            self._lose(f"the sidecar reports that this pod no longer leads (holder: {ev.holder or 'nobody known'})")
        elif ev.token != self._token:
            self._lose(
                f"the token moved on from {self._token.generation} to {ev.token.generation} "
                "(a new tenure, or the lease's spec was edited)"
            )
        elif isinstance(ev, Status) and ev.valid_until is not None:
            self._confirm(ev.valid_until)


class leading:
    """``with leading(client) as lead:`` waits until this pod leads and yields a
    :class:`Leadership` for that tenure; see the module documentation for the guarantees.

    - ``client``: a :class:`Client` (default ``Client()``, i.e. ``$FENCEDLEASE_URL``).
    - ``wait``: wait for leadership (default); with False, raise :class:`NotLeader` at once
      when this pod does not lead.
    - ``timeout``: give up waiting after this many seconds (NotLeader).

    While the block runs, a watcher thread follows ``/v1/watch`` and a second one re-confirms
    leadership with ``/v1/status`` at half the time left, moving the deadline on. Leaving the
    block stops both; it does not release the lease (``lead.release()`` does), and it does not
    swallow :class:`LeadershipLost`.
    """

    def __init__(self, client: Optional[Client] = None, *, wait: bool = True, timeout: Optional[float] = None):
        self.client = client if client is not None else Client()
        self.wait = wait
        self.timeout = timeout
        self._stop = threading.Event()
        self._threads: list = []
        self._watch: Any = None
        self.leadership: Optional[Leadership] = None

    def __enter__(self) -> Leadership:
        deadline = None if self.timeout is None else now() + self.timeout
        watch = self.client.watch(reconnect=True, idle_timeout=45.0)
        try:
            lead = self._await_leadership(watch, deadline)
        except BaseException:
            watch.close()
            raise
        self._watch, self.leadership = watch, lead
        try:
            # The app knows this tenure: the sidecar's proxy may send its unpinned writes.
            self.client.acknowledge(lead._token)
        except FencedLeaseError as e:
            # Not fatal: the proxy then refuses unpinned writes and says why (fail closed);
            # a token that moved on meanwhile ends the tenure through the watch.
            if isinstance(e, NotLeader):
                lead._lose(f"the token moved on before the tenure could be acknowledged ({e})")
        for target, name in ((self._follow, "watch"), (self._refresh, "refresh")):
            t = threading.Thread(target=target, args=(lead,), name=f"fencedlease-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return lead

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.close()
        for t in self._threads:
            t.join(timeout=5.0)
        if self.leadership is not None:
            self.leadership._lose("the leading() block was left")

    def _await_leadership(self, watch: Any, deadline: Optional[float]) -> Leadership:
        """Follows the watch until it says leading, then confirms with /v1/status (which also
        gives the first deadline, anchored on this side)."""
        if deadline is not None:
            timer = threading.Timer(max(0.0, deadline - now()), watch.close)
            timer.daemon = True
            timer.start()
        else:
            timer = None
        last: Any = None
        try:
            for ev in watch:
                last = ev
                if not ev.leading:
                    if not self.wait:
                        holder = getattr(ev, "holder", None)
                        raise NotLeader(f"this pod does not lead (holder: {holder or 'nobody known'})", holder=holder)
                    continue
                try:
                    st = self.client.status()
                except SidecarUnavailable:
                    continue
                if st.leading and st.token == ev.token and st.valid_until is not None:
                    return Leadership(self.client, st.token, st.valid_until)
                # The sidecar moved on between the event and the status: the next event says how.
        finally:
            if timer is not None:
                timer.cancel()
        holder = getattr(last, "holder", None)
        raise NotLeader(
            f"this pod did not come to lead within {self.timeout:g} s (holder: {holder or 'nobody known'})"
            if self.timeout is not None
            else "the watch ended before this pod came to lead",
            holder=holder,
        )

    def _follow(self, lead: Leadership) -> None:
        try:
            for ev in self._watch:
                lead._judge(ev)
                if lead.lost.is_set():
                    break
        except FencedLeaseError as e:
            lead._lose(f"following the sidecar failed: {e}")
        if not self._stop.is_set():
            lead._lose("the watch of the sidecar ended")

    def _refresh(self, lead: Leadership) -> None:
        while not lead.lost.is_set():
            if self._stop.wait(max(0.02, lead.time_left() / 2)):
                return
            if lead.time_left() <= 0:
                lead._lose("the sidecar's last confirmation of leadership ran out before a new one arrived")
                return
            try:
                # Bounded by the time left: a sidecar that does not answer must not hold this
                # thread past the deadline it is here to notice.
                left = lead.time_left()
                lead._judge(self.client.status(timeout=max(0.05, min(self.client.timeout, left))))
            except FencedLeaseError:
                pass  # the deadline decides; the watch reports a broken sidecar too


def while_leading(client: Any = None, *, wait: bool = True, timeout: Optional[float] = None) -> Any:
    """Decorator: each call of the function waits until this pod leads, then runs it with the
    :class:`Leadership` as first argument::

        @while_leading(Client())
        def reconcile(lead, item):
            patch = merge_patch(lead, {"data": {"item": item}})   # checks lead.token()
            ...

    The function runs while leading; if leadership ends meanwhile, ``lead.token()`` raises
    :class:`LeadershipLost` at the next call and ``lead.lost`` is set. Also usable bare
    (``@while_leading``), with a default ``Client()``.
    """
    if callable(client) and not isinstance(client, Client):
        return while_leading()(client)

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with leading(client, wait=wait, timeout=timeout) as lead:
                return fn(lead, *args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
