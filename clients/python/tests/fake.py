"""A tiny fake sidecar for the unit tests: a raw TCP server, so that each test decides exactly
which bytes go out, in which pieces, and when the connection closes."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Callable, List, Optional


class Request:
    def __init__(self, method: str, path: str, headers: dict, body: bytes = b""):
        self.method, self.path, self.headers, self.body = method, path, headers, body

    def __repr__(self) -> str:
        return f"{self.method} {self.path}"


Handler = Callable[[Request, socket.socket], None]


class FakeServer:
    """Calls ``handler(request, conn)`` for each connection, in a thread of its own; closes the
    connection when the handler returns."""

    def __init__(self, handler: Handler):
        self.handler = handler
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.requests: List[Request] = []
        self._stopped = threading.Event()
        self._conns: List[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def __enter__(self) -> "FakeServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stopped.set()
        try:
            self.sock.close()
        except OSError:
            pass
        self.drop_connections()

    def drop_connections(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            head = b""
            while b"\r\n\r\n" not in head:
                piece = conn.recv(4096)
                if not piece:
                    return
                head += piece
            lines = head.split(b"\r\n\r\n")[0].decode().split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
            body = head.split(b"\r\n\r\n", 1)[1]
            want = int(headers.get("content-length", "0") or 0)
            while len(body) < want:
                piece = conn.recv(4096)
                if not piece:
                    return
                body += piece
            req = Request(method, path, headers, body)
            self.requests.append(req)
            self.handler(req, conn)
        except OSError:
            pass
        finally:
            try:
                conn.close()
            except OSError:
                pass


def respond(conn: socket.socket, code: int, body: bytes, ctype: str = "application/json", extra: str = "") -> None:
    reason = {200: "OK", 202: "Accepted", 404: "Not Found", 409: "Conflict", 500: "Internal Server Error"}.get(code, "X")
    head = (
        f"HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
        f"Connection: close\r\n{extra}\r\n"
    )
    conn.sendall(head.encode() + body)


def respond_json(conn: socket.socket, code: int, obj: object) -> None:
    respond(conn, code, json.dumps(obj).encode())


def sse_head(conn: socket.socket, ctype: str = "text/event-stream") -> None:
    conn.sendall(
        f"HTTP/1.1 200 OK\r\nContent-Type: {ctype}\r\nCache-Control: no-cache\r\n"
        "Transfer-Encoding: chunked\r\n\r\n".encode()
    )


def chunk(conn: socket.socket, data: bytes) -> None:
    """One HTTP chunk (of the chunked transfer encoding) carrying ``data``."""
    conn.sendall(b"%x\r\n%s\r\n" % (len(data), data))


def end_chunks(conn: socket.socket) -> None:
    conn.sendall(b"0\r\n\r\n")


def status_json(leading: bool, token: Optional[int] = None, uid: Optional[str] = "uid-1",
                holder: Optional[str] = None, time_left_ms: Optional[int] = None,
                identity: str = "pod-a") -> dict:
    return {
        "lease": "db",
        "namespace": "shop",
        "identity": identity,
        "leading": leading,
        "token": token if leading else None,
        "leaseUID": uid if leading else None,
        "holder": identity if leading else holder,
        "timeLeftMs": (1500 if time_left_ms is None else time_left_ms) if leading else None,
        "appHealthy": True,
    }


def sse_event(obj: dict, kind: str = "status") -> bytes:
    return f"event: {kind}\ndata: {json.dumps(obj)}\n\n".encode()


class FakeSidecar:
    """A stateful fake of the sidecar API: ``set(...)`` changes its status, and every open
    /v1/watch stream gets an event, as the real one does."""

    def __init__(self, leading: bool = False, token: Optional[int] = None, uid: str = "uid-1",
                 holder: Optional[str] = "pod-b", time_left_ms: int = 1500):
        self._cond = threading.Condition()
        self._state = dict(leading=leading, token=token, uid=uid, holder=holder, time_left_ms=time_left_ms)
        self._version = 0
        self.status_hangs = False
        self.status_polls = 0
        self.releases = 0
        self.acknowledged: list = []
        self.server = FakeServer(self._handle)
        self.url = self.server.url

    def close(self) -> None:
        with self._cond:
            self._version = -1
            self._cond.notify_all()
        self.server.close()

    def set(self, **kw: object) -> None:
        with self._cond:
            self._state.update(kw)
            self._version += 1
            self._cond.notify_all()

    def drop_watches(self) -> None:
        self.server.drop_connections()

    def _status(self) -> dict:
        s = self._state
        return status_json(s["leading"], s["token"], s["uid"], s["holder"], s["time_left_ms"])

    def _handle(self, req: Request, conn: socket.socket) -> None:
        if req.path == "/v1/status":
            self.status_polls += 1
            if self.status_hangs:
                time.sleep(30)
                return
            with self._cond:
                respond_json(conn, 200, self._status())
        elif req.path == "/v1/token":
            with self._cond:
                st = self._status()
            if st["leading"]:
                respond_json(conn, 200, {"token": st["token"], "leaseUID": st["leaseUID"]})
            else:
                respond_json(conn, 409, {"error": "not leading", "holder": st["holder"]})
        elif req.path == "/v1/release" and req.method == "POST":
            self.releases += 1
            self.set(leading=False, holder=None)
            respond_json(conn, 202, {"releasing": True})
        elif req.path == "/v1/acknowledge" and req.method == "POST":
            ack = json.loads(req.body or b"{}")
            with self._cond:
                st = self._status()
            if st["leading"] and ack.get("token") == st["token"] and ack.get("leaseUID") in (None, st["leaseUID"]):
                self.acknowledged.append(ack["token"])
                respond_json(conn, 200, {"acknowledged": ack["token"]})
            else:
                respond_json(conn, 409, {"error": "not the current tenure"})
        elif req.path == "/v1/watch":
            sse_head(conn)
            seen = None
            while True:
                with self._cond:
                    while self._version == seen:
                        self._cond.wait(timeout=1.0)
                    if self._version < 0:
                        return
                    seen = self._version
                    ev = sse_event(self._status())
                chunk(conn, ev)
        else:
            respond_json(conn, 404, {"error": "not found"})
