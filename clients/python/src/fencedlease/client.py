"""The HTTP client for the sidecar's loopback API (``/v1/status``, ``/v1/token``,
``/v1/watch``, ``/v1/release``). Standard library only; every read from the socket is bounded.
"""

from __future__ import annotations

import collections
import http.client
import json
import os
import socket
import threading
from typing import Any, Deque, Iterator, Optional, Tuple, Union
from urllib.parse import urlsplit

from .errors import NotLeader, ProtocolError, SidecarUnavailable, Unauthorized
from .model import Disconnected, Status, Token, now
from .sse import SSEParser

#: The sidecar's default listen address (``fencedlease sidecar --listen``).
DEFAULT_URL = "http://127.0.0.1:8787"
#: Where the sidecar writes the pod's API secret in an injected pod (its token dir).
DEFAULT_SECRET_FILE = "/var/run/fencedlease/api-secret"
#: The environment variable that names the secret file in an injected pod's app containers.
SECRET_FILE_ENV = "FENCEDLEASE_API_SECRET_FILE"
#: The most read of the secret file (the sidecar writes 65 bytes).
MAX_SECRET = 4096
#: The largest JSON body accepted from the sidecar (its answers are a few hundred bytes).
MAX_BODY = 64 * 1024
#: The sidecar sends a keep-alive comment on /v1/watch every 15 s; a stream silent for this
#: long is taken for dead.
WATCH_IDLE_TIMEOUT = 45.0

_HINT = (
    "Is the sidecar running and is the URL right? In an injected pod FENCEDLEASE_URL is set "
    "for you (the port comes from the pod annotation fencedlease.io/port, default 8787); "
    "elsewhere start `fencedlease sidecar --lease NAME` or set FENCEDLEASE_URL."
)


class Client:
    """A client of one sidecar.

    ``url`` defaults to ``$FENCEDLEASE_URL``, else ``http://127.0.0.1:8787``. ``timeout`` (s)
    bounds connecting and each read of the short requests; watches have their own idle timeout.
    ``secret_file`` (default ``$FENCEDLEASE_API_SECRET_FILE``, else
    ``/var/run/fencedlease/api-secret``) holds the pod's API secret, read afresh for every
    request and sent as a bearer token: the sidecar answers nothing else (but its health
    endpoints). While the file does not exist, requests go without it and raise
    :class:`Unauthorized`. A Client holds no connection between calls and may be shared
    between threads.
    """

    def __init__(self, url: Optional[str] = None, *, timeout: float = 5.0, secret_file: Optional[str] = None):
        self.secret_file = secret_file or os.environ.get(SECRET_FILE_ENV) or DEFAULT_SECRET_FILE
        self.url = (url or os.environ.get("FENCEDLEASE_URL") or DEFAULT_URL).rstrip("/")
        parts = urlsplit(self.url)
        if parts.scheme != "http":
            raise ValueError(
                f"{self.url!r}: the sidecar API is plain http:// on loopback "
                f"(like {DEFAULT_URL}); got scheme {parts.scheme!r}"
            )
        if not parts.hostname:
            raise ValueError(f"{self.url!r}: no host; write http://HOST:PORT")
        try:
            self._port = parts.port or 80
        except ValueError as e:
            raise ValueError(f"{self.url!r}: {e}") from None
        if parts.query or parts.fragment or parts.username:
            raise ValueError(f"{self.url!r}: write only http://HOST:PORT (and a path prefix, if any)")
        self._host = parts.hostname
        self._prefix = parts.path.rstrip("/")
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"Client({self.url!r})"

    # -- the API ---------------------------------------------------------------------------

    def status(self, *, timeout: Optional[float] = None) -> Status:
        """``GET /v1/status``. The result's ``valid_until`` is the deadline (on ``model.now()``, CLOCK_BOOTTIME where there is one) until which
        the sidecar vouched for leadership, counted from when this request was sent.
        ``timeout`` overrides the client's for this call."""
        sent = now()
        code, body = self._request("GET", "/v1/status", timeout)
        if code != 200:
            raise self._unexpected("/v1/status", code, body)
        return Status.from_json(self._json("/v1/status", body), self._where("/v1/status"), sent)

    def token(self) -> Token:
        """``GET /v1/token``: the token while this pod leads. Raises :class:`NotLeader` (with
        ``holder``) when it does not: there is no "no token" value to forget to check."""
        code, body = self._request("GET", "/v1/token")
        where = self._where("/v1/token")
        if code == 409:
            obj = self._json("/v1/token", body)
            holder = obj.get("holder") if isinstance(obj, dict) else None
            holder = holder if isinstance(holder, str) else None
            raise NotLeader(
                f"this pod does not lead (holder: {holder or 'nobody known'}); wait for "
                "leadership (Client.watch() or fencedlease.leading()) before writing",
                holder=holder,
            )
        if code != 200:
            raise self._unexpected("/v1/token", code, body)
        obj = self._json("/v1/token", body)
        if not isinstance(obj, dict):
            raise ProtocolError(f"{where}: expected a JSON object, got {body[:200]!r}")
        generation, uid = obj.get("token"), obj.get("leaseUID")
        if isinstance(generation, bool) or not isinstance(generation, int) or not isinstance(uid, str):
            raise ProtocolError(f"{where}: expected {{\"token\": N, \"leaseUID\": \"...\"}}, got {body[:200]!r}")
        try:
            return Token(generation, uid)
        except ValueError as e:
            raise ProtocolError(f"{where}: {e}") from None

    def release(self) -> None:
        """``POST /v1/release``: step down now. The sidecar then stays out of the election for
        one lease duration. Returns once the sidecar accepted the request (202), which may be a
        moment before the lease is actually free."""
        code, body = self._request("POST", "/v1/release")
        if code != 202:
            raise self._unexpected("/v1/release", code, body)

    def acknowledge(self, token: Token) -> None:
        """``POST /v1/acknowledge``: tell the sidecar this process knows it leads with ``token``.

        After the lease was lost and acquired again, the sidecar's Kubernetes API proxy sends
        writes without a pin only once the app has acknowledged the new tenure: a write decided
        before the loss would otherwise go out under the new token. ``leading()`` does this as
        its block starts. Raises :class:`NotLeader` if ``token`` is not the current tenure's."""
        body = json.dumps({"token": token.generation, "leaseUID": token.lease_uid}).encode()
        code, answer = self._request("POST", "/v1/acknowledge", body=body)
        if code == 409:
            msg = self._json("/v1/acknowledge", answer).get("error", "not the current tenure")
            raise NotLeader(f"{self._where('/v1/acknowledge')}: {msg}")
        if code != 200:
            raise self._unexpected("/v1/acknowledge", code, answer)

    def watch(
        self,
        *,
        reconnect: bool = True,
        idle_timeout: float = WATCH_IDLE_TIMEOUT,
        backoff: Tuple[float, float] = (0.1, 2.0),
        give_up_after: Optional[float] = None,
    ) -> "Watch":
        """``GET /v1/watch``: an iterator of :class:`Status`, the current one first, then one per
        change (including the moment leadership runs out without a renewal).

        On a disconnect (the sidecar restarted, the connection broke, or nothing, not even a
        keep-alive, arrived for ``idle_timeout`` s) with ``reconnect=True`` the iterator yields one
        :class:`Disconnected` (which reads as not leading), reconnects with exponential backoff
        (``backoff`` = first and longest pause, s), and goes on with the current status, which
        the sidecar always sends first. Changes during the outage are not replayed; only the state
        after it is. With ``give_up_after`` set, an outage longer than that raises
        :class:`SidecarUnavailable`. With ``reconnect=False`` a disconnect raises
        :class:`SidecarUnavailable` at once. A response that is not the sidecar's event stream
        raises :class:`ProtocolError` either way (reconnecting would not help).

        The Watch is also a context manager; ``close()`` may be called from another thread and
        ends the iteration.
        """
        return Watch(self, reconnect, idle_timeout, backoff, give_up_after)

    # -- plumbing --------------------------------------------------------------------------

    def _where(self, path: str) -> str:
        return f"{self.url}{path}"

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout)

    def _open(self, method: str, path: str, timeout: float, body: Optional[bytes] = None) -> Tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Sends the request and reads the response head; errors become ours."""
        where = self._where(path)
        conn = self._connection(timeout)
        headers = {"Accept": "application/json, text/event-stream"}
        secret = self._secret()
        if secret is not None:
            headers["Authorization"] = f"Bearer {secret}"
        if body is not None:
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, self._prefix + path, body=body, headers=headers)
            return conn, conn.getresponse()
        except BaseException as e:
            conn.close()
            raise _translate(e, where, timeout) from e

    def _secret(self) -> Optional[str]:
        """The pod's API secret, None while its file does not exist."""
        try:
            with open(self.secret_file, "rb") as f:
                data = f.read(MAX_SECRET + 1)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise Unauthorized(
                f"reading the pod's API secret {self.secret_file}: {e}; set {SECRET_FILE_ENV} "
                "to the file the sidecar writes (its token dir's api-secret)"
            ) from None
        if len(data) > MAX_SECRET:
            raise Unauthorized(f"{self.secret_file}: over {MAX_SECRET} bytes, not the sidecar's API secret")
        return data.decode("ascii", "replace").strip()

    def _refused(self, path: str, body: bytes) -> Unauthorized:
        return Unauthorized(
            f"{self._where(path)}: the sidecar refused the request without the pod's API secret "
            f"({body[:300]!r}); this client sends the contents of {self.secret_file}: in an "
            f"injected pod {SECRET_FILE_ENV} names the file, elsewhere pass secret_file= (the "
            "sidecar's --token-dir/api-secret)"
        )

    def _request(self, method: str, path: str, timeout: Optional[float] = None, body: Optional[bytes] = None) -> Tuple[int, bytes]:
        timeout = self.timeout if timeout is None else timeout
        conn, resp = self._open(method, path, timeout, body)
        where = self._where(path)
        try:
            length = resp.getheader("Content-Length")
            if length is not None and length.isdigit() and int(length) > MAX_BODY:
                raise ProtocolError(
                    f"{where}: a {length}-byte answer is over the {MAX_BODY}-byte limit; the "
                    "sidecar's answers are small: is the URL the sidecar API?"
                )
            body = resp.read(MAX_BODY + 1)
            if len(body) > MAX_BODY:
                raise ProtocolError(f"{where}: answer over the {MAX_BODY}-byte limit; is the URL the sidecar API?")
            return resp.status, body
        except (ProtocolError, SidecarUnavailable):
            raise
        except BaseException as e:
            raise _translate(e, where, timeout) from e
        finally:
            resp.close()
            conn.close()

    def _json(self, path: str, body: bytes) -> Any:
        try:
            return json.loads(body)
        except ValueError as e:
            raise ProtocolError(
                f"{self._where(path)}: the answer is not JSON ({e}): {body[:200]!r}. Is the URL the "
                "sidecar API (not its Kubernetes API proxy or probe port)?"
            ) from None

    def _unexpected(self, path: str, code: int, body: bytes) -> Union[ProtocolError, Unauthorized]:
        if code == 401:
            return self._refused(path, body)
        hint = ""
        if code == 404:
            hint = (
                " The sidecar serves /v1/status, /v1/token, /v1/watch and /v1/release: is the "
                "URL the sidecar API (default port 8787), without a path?"
            )
        elif code == 405:
            hint = " The method is not allowed there: client and sidecar versions may differ."
        return ProtocolError(f"{self._where(path)}: unexpected HTTP {code}: {body[:200]!r}.{hint}")


def _translate(e: BaseException, where: str, timeout: float) -> BaseException:
    """Turns socket and http.client errors into SidecarUnavailable or ProtocolError."""
    if isinstance(e, (SidecarUnavailable, ProtocolError)):
        return e
    if isinstance(e, ConnectionRefusedError):
        return SidecarUnavailable(f"cannot reach the fencedlease sidecar at {where}: connection refused. {_HINT}")
    if isinstance(e, (socket.timeout, TimeoutError)):
        return SidecarUnavailable(
            f"the fencedlease sidecar at {where} did not answer within {timeout:g} s: it may be "
            "overloaded or frozen. Treat this pod as not leading, and retry."
        )
    if isinstance(e, http.client.RemoteDisconnected) or isinstance(e, ConnectionError):
        return SidecarUnavailable(
            f"the fencedlease sidecar at {where} closed the connection ({e}): it may be "
            "restarting. Treat this pod as not leading, and retry."
        )
    if isinstance(e, http.client.IncompleteRead):
        return SidecarUnavailable(
            f"the connection to the fencedlease sidecar at {where} broke in the middle of an "
            "answer: it may be restarting. Treat this pod as not leading, and retry."
        )
    if isinstance(e, http.client.HTTPException):
        return ProtocolError(
            f"{where}: not an HTTP answer the sidecar would send ({type(e).__name__}: {e}); is "
            "the URL the sidecar API?"
        )
    if isinstance(e, OSError):
        return SidecarUnavailable(f"cannot reach the fencedlease sidecar at {where}: {e}. {_HINT}")
    return e


def _close(conn: Optional[http.client.HTTPConnection], resp: Optional[http.client.HTTPResponse]) -> None:
    # A response to a request with "Connection: close" owns the socket: close both.
    for c in (resp, conn):
        if c is not None:
            try:
                c.close()
            except OSError:
                pass


Event = Union[Status, Disconnected]


class Watch(Iterator[Event]):
    """The iterator :meth:`Client.watch` returns. Not for sharing between consumers; ``close``
    is safe from any thread."""

    _CHUNK = 4096

    def __init__(
        self,
        client: Client,
        reconnect: bool,
        idle_timeout: float,
        backoff: Tuple[float, float],
        give_up_after: Optional[float],
    ):
        self._client = client
        self._reconnect = reconnect
        self._idle_timeout = idle_timeout
        self._backoff = backoff
        self._give_up_after = give_up_after
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._busy = False
        self._conn: Optional[http.client.HTTPConnection] = None
        self._resp: Optional[http.client.HTTPResponse] = None
        self._parser = SSEParser()
        self._pending: Deque[Event] = collections.deque()
        self._outage_since: Optional[float] = None
        self._pause = backoff[0]
        #: Connections made so far (1 after the first, 2 after one reconnect, ...).
        self.connections = 0

    def __iter__(self) -> "Watch":
        return self

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Ends the watch: a ``next()`` blocked in another thread returns (StopIteration)."""
        with self._lock:
            self._closed.set()
            busy, conn = self._busy, self._conn
        if not busy:
            self._drop()
        elif conn is not None and conn.sock is not None:
            # The reader closes the connection itself once woken: closing a socket under a
            # thread blocked on it could hand its descriptor to someone else meanwhile.
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def __next__(self) -> Event:
        with self._lock:
            self._busy = True
        try:
            return self._next()
        finally:
            with self._lock:
                self._busy = False
            if self._closed.is_set():
                self._drop()

    def _next(self) -> Event:
        while True:
            if self._closed.is_set():
                self._drop()
                raise StopIteration
            if self._pending:
                return self._pending.popleft()
            if self._resp is None:
                failure = self._connect()
                if failure is not None:
                    return failure
                continue
            try:
                chunk = self._resp.read1(self._CHUNK)
            except BaseException as e:
                if self._closed.is_set():
                    continue
                if isinstance(e, (socket.timeout, TimeoutError)):
                    err = SidecarUnavailable(
                        f"{self._client._where('/v1/watch')}: nothing arrived for "
                        f"{self._idle_timeout:g} s (the sidecar sends a keep-alive every 15 s): "
                        "the sidecar or the connection is stuck"
                    )
                else:
                    err = _translate(e, self._client._where("/v1/watch"), self._idle_timeout)
                if not isinstance(err, SidecarUnavailable):
                    self._drop()
                    raise err from e
                lost = self._lost(err)
                if lost is not None:
                    return lost
                continue
            if not chunk:
                if self._closed.is_set():
                    continue
                lost = self._lost(
                    SidecarUnavailable(
                        f"{self._client._where('/v1/watch')}: the sidecar ended the stream "
                        "(it may be stopping or restarting)"
                    )
                )
                if lost is not None:
                    return lost
                continue
            for ev in self._parser.feed(chunk):
                if ev.type != "status":
                    continue  # a type this client does not know: later sidecars may add some
                try:
                    obj = json.loads(ev.data)
                except ValueError as e:
                    self._drop()
                    raise ProtocolError(f"{self._client._where('/v1/watch')}: an event's data is not JSON ({e}): {ev.data[:200]!r}") from None
                try:
                    st = Status.from_json(obj, self._client._where("/v1/watch"))
                except ProtocolError:
                    self._drop()
                    raise
                self._pending.append(st)
                self._outage_since = None
                self._pause = self._backoff[0]

    def _connect(self) -> Optional[Disconnected]:
        """Connects (after a backoff pause if the last attempt failed). Returns a Disconnected
        to yield when this is the first failure of an outage, None otherwise."""
        where = self._client._where("/v1/watch")
        if self._outage_since is not None:
            if self._give_up_after is not None and now() - self._outage_since > self._give_up_after:
                raise SidecarUnavailable(
                    f"{where}: no connection to the sidecar for over {self._give_up_after:g} s; giving up"
                )
            if self._closed.wait(self._pause):
                return None
            self._pause = min(self._pause * 2, self._backoff[1])
        try:
            conn, resp = self._client._open("GET", "/v1/watch", self._client.timeout)
        except SidecarUnavailable as e:
            if not self._reconnect:
                raise
            return self._lost(e)
        try:
            ctype = (resp.getheader("Content-Type") or "").split(";")[0].strip()
            if resp.status == 401:
                body = resp.read(512)
                _close(conn, resp)
                raise self._client._refused("/v1/watch", body)
            if resp.status != 200 or ctype != "text/event-stream":
                body = resp.read(512)
                _close(conn, resp)
                raise ProtocolError(
                    f"{where}: expected 200 text/event-stream, got HTTP {resp.status} {ctype or 'without a type'}: "
                    f"{body[:200]!r}; is the URL the sidecar API?"
                )
            if conn.sock is not None:
                conn.sock.settimeout(self._idle_timeout)
        except (ProtocolError, Unauthorized):
            raise
        except BaseException as e:
            _close(conn, resp)
            err = _translate(e, where, self._client.timeout)
            if isinstance(err, SidecarUnavailable) and self._reconnect:
                return self._lost(err)
            raise err from e
        with self._lock:
            self._conn, self._resp = conn, resp
        self._parser = SSEParser()
        self.connections += 1
        if self._closed.is_set():  # closed while connecting
            self._drop()
        return None

    def _lost(self, err: BaseException) -> Optional[Disconnected]:
        self._drop()
        if not self._reconnect:
            raise err
        first = self._outage_since is None
        if first:
            self._outage_since = now()
            return Disconnected(error=str(err), since=self._outage_since)
        return None  # still the same outage: keep trying quietly

    def _drop(self) -> None:
        with self._lock:
            conn, resp, self._conn, self._resp = self._conn, self._resp, None, None
        _close(conn, resp)
