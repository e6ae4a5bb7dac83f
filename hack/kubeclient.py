"""The one small Kubernetes API client of the scripts (Python 3.11 standard library only).

bench/ and hack/history/ both use it; they import it by path, as they import their siblings
(sys.path gets this folder, hack/).

Configuring it:
- Kube(server, token, ca_pem): an API server URL, a bearer token and the CA's PEM text
  (bench/lib.py's Kube does that with the bench cluster's admin token and CA);
- Kube.from_kubeconfig(path, server=None): the kubeconfig that hack/cluster.sh writes (server,
  token, certificate-authority-data); `server` replaces the kubeconfig's (the history test
  sends some apps through relays).

Calling it, two ways, each with the semantics its users rely on:
- request(method, path, body, content_type, ok=(200, 201)) -> the parsed body; any other
  status raises ApiError. One keep-alive connection per thread; a broken connection is opened
  again and the request sent again, up to 3 attempts (the benchmarks' setup and probes, where
  a repeated request is harmless). timed() measures one request on that connection, once.
- fetch(method, path, body, timeout, content_type) -> (status, parsed body), whatever the
  status. Exactly one attempt on a fresh connection (urllib's, closed afterwards), never a
  retry: the history test's apps log each write once, and a write sent twice could land twice
  and fool its checker. Network errors and timeouts raise OSError (urllib.error.URLError is
  one), as from urllib.
- watch(path, timeout): yields the events of one watch stream (fresh connection, no retry).
"""

from __future__ import annotations

import base64
import http.client
import json
import re
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Iterator


class ApiError(Exception):
    """A status that request() was not told to accept."""

    def __init__(self, status: int, body: Any):
        super().__init__(f"HTTP {status}: {str(body)[:300]}")
        self.status = status
        self.body = body


class Kube:
    def __init__(self, server: str, token: str, ca_pem: str):
        self.server = server
        url = urllib.parse.urlsplit(server)
        self.host, self.port = url.hostname, url.port or 443
        self.token = token
        self.ctx = ssl.create_default_context(cadata=ca_pem)
        self.local = threading.local()  # request()'s connection, one per thread

    @classmethod
    def from_kubeconfig(cls, kubeconfig: str, server: str | None = None) -> Kube:
        """From the kubeconfig hack/cluster.sh writes (one cluster, one user with a token)."""
        text = open(kubeconfig).read()
        ca = base64.b64decode(re.search(r"certificate-authority-data:\s*(\S+)", text).group(1))
        return cls(server or re.search(r"server:\s*(\S+)", text).group(1),
                   re.search(r"token:\s*(\S+)", text).group(1), ca.decode())

    # -- keep-alive, raising ------------------------------------------------------------------

    def _conn(self) -> http.client.HTTPSConnection:
        c = getattr(self.local, "conn", None)
        if c is None:
            c = http.client.HTTPSConnection(self.host, self.port, context=self.ctx, timeout=30)
            self.local.conn = c
        return c

    def request(self, method: str, path: str, body: Any = None,
                content_type: str = "application/json", ok=(200, 201)) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = content_type
        for attempt in range(3):
            c = self._conn()
            try:
                c.request(method, path, body=data, headers=headers)
                resp = c.getresponse()
                raw = resp.read()
                break
            except (http.client.HTTPException, OSError):
                c.close()
                self.local.conn = None
                if attempt == 2:
                    raise
                time.sleep(0.2)
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw.decode(errors="replace")
        if resp.status not in ok:
            raise ApiError(resp.status, parsed)
        return parsed

    def timed(self, method: str, path: str, body: Any, content_type: str) -> tuple[int, int]:
        """One request; returns (status, elapsed ns) measured around the round trip."""
        data = json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json",
                   "Content-Type": content_type}
        c = self._conn()
        t0 = time.perf_counter_ns()
        c.request(method, path, body=data, headers=headers)
        resp = c.getresponse()
        resp.read()
        return resp.status, time.perf_counter_ns() - t0

    def get_opt(self, path: str) -> Any:
        """GET through request(); None when the object does not exist (404)."""
        try:
            return self.request("GET", path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    # -- one attempt per call, never raising on a status -------------------------------------

    def fetch(self, method: str, path: str, body: Any = None, timeout: float = 5,
              content_type: str = "application/json") -> tuple[int, Any]:
        """Returns (status, parsed JSON or text). Network errors raise OSError."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Authorization", "Bearer " + self.token)
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, context=self.ctx, timeout=timeout) as r:
                raw = r.read()
                code = r.status
        except urllib.error.HTTPError as e:
            raw = e.read()
            code = e.code
        try:
            return code, json.loads(raw)
        except ValueError:
            return code, raw.decode(errors="replace")

    def watch(self, path: str, timeout: float = 30) -> Iterator[dict]:
        """Yields watch events (dicts) until the stream ends or breaks."""
        sep = "&" if "?" in path else "?"
        req = urllib.request.Request(self.server + path + sep + "watch=1")
        req.add_header("Authorization", "Bearer " + self.token)
        with urllib.request.urlopen(req, context=self.ctx, timeout=timeout) as r:
            for line in r:
                if line.strip():
                    yield json.loads(line)
