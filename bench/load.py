"""A busy and slowed API server, for failover under load (issue 21).

- LoadGenerator: open-loop writes and lists against the bench API server, at stated rates, from
  threads of this process, straight to the API server (not through the delay proxy). Writes are
  merge patches of the `data` of ConfigMaps (one chosen at random each time) in a namespace of
  their own, holding --objects ConfigMaps of about --object-bytes each; lists are LISTs of all of
  that namespace's ConfigMaps (the whole body read, not parsed). Each request is due at a fixed
  time of a schedule (rate r: one every 1/r s); a pool of workers sends them, and a request's
  latency is measured from its due time (so a server that falls behind shows in the figures
  instead of slowing the schedule down: no coordinated omission), and also from when it was sent
  (service time). What it achieved is recorded: requests sent per second, answered, errors by
  code, latency p50/p99, how far behind the schedule it fell; and the API server's and etcd's CPU
  over the same window.
  Beside the schedule, --list-clients N closed-loop clients (kind "closed_list"): each a thread
  that LISTs all of the namespace's ConfigMaps back to back, the next request as soon as the
  answer is read (after an error, 100 ms later), so the API server's answers set the rate; each
  request is kept like the scheduled ones, its due time its send time.
- DelayProxy: a loopback TCP relay that delays every chunk it relays by --delay-ms, each way, in
  order (the bytes are TLS: both clients speak TLS to the API server through it, with the API
  server's own certificate, so it is the same for both systems); one listening port, all
  candidates of both systems through it; DelayProxyProcess runs it in a process of its own.

Alone, for sizing the load on this machine against a running bench cluster:
  python3 load.py --writes 100 --lists 10 --objects 500 --seconds 30
  python3 load.py --writes 0 --lists 0 --list-clients 4 --objects 1000 --seconds 30
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import queue
import random
import resource
import ssl
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lib
from lib import API_PORT, CLUSTER_DIR, Kube, log, stats


def cluster_pids() -> dict[str, int]:
    """The bench cluster's etcd and kube-apiserver, from hack/cluster.sh's pid files."""
    out = {}
    for name in ("kube-apiserver", "etcd"):
        try:
            out[name] = int((CLUSTER_DIR / "pids" / name).read_text().strip())
        except (OSError, ValueError):
            pass
    return out


CLOSED_LIST = "closed_list"
ERROR_PAUSE_S = 0.1  # a closed-loop client's pause after an error (no answer, 429, 5xx)


class LoadGenerator:
    def __init__(self, writes_per_s: float, lists_per_s: float, objects: int, object_bytes: int = 1024,
                 workers: int = 32, timeout: float = 30.0, list_clients: int = 0):
        self.writes_per_s, self.lists_per_s = writes_per_s, lists_per_s
        self.list_clients = list_clients
        self.objects, self.object_bytes, self.workers = objects, object_bytes, workers
        self.timeout = timeout
        self.ns = f"bench-load-{lib.rand_suffix()}"
        self.token = lib.admin_token()
        self.ctx = ssl.create_default_context(cafile=str(lib.ca_file()))
        self.q: queue.Queue = queue.Queue()
        self.stop_ev = threading.Event()
        self.lock = threading.Lock()
        # (kind, due_ns, sent_ns, latency from due s, service s, code)
        self.done: list[tuple[str, int, int, float, float, int]] = []
        self.threads: list[threading.Thread] = []
        self.local = threading.local()
        self.t0 = self.t1 = 0
        self.cpu0: dict[str, float | None] = {}
        self.setup_s = 0.0

    # -- setup ---------------------------------------------------------------------------------
    def setup(self, kube: Kube) -> None:
        """The namespace and its ConfigMaps, eight creates at a time."""
        t = time.monotonic()
        kube.create_namespace(self.ns)
        filler = "x" * self.object_bytes

        def one(i: int) -> None:
            try:
                Kube().request("POST", f"/api/v1/namespaces/{self.ns}/configmaps", {
                    "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"load-{i}"},
                    "data": {"filler": filler, "n": "0"}})
            except lib.ApiError as e:
                if e.status != 409:
                    raise

        with ThreadPoolExecutor(8) as ex:
            list(ex.map(one, range(self.objects)))
        self.setup_s = time.monotonic() - t

    # -- running -------------------------------------------------------------------------------
    def _conn(self) -> http.client.HTTPSConnection:
        c = getattr(self.local, "conn", None)
        if c is None:
            c = http.client.HTTPSConnection("127.0.0.1", API_PORT, context=self.ctx, timeout=self.timeout)
            self.local.conn = c
        return c

    def _send(self, kind: str) -> int:
        if kind == "write":
            i = random.randrange(self.objects)
            body = json.dumps({"data": {"n": str(time.time_ns())}}).encode()
            method, path = "PATCH", f"/api/v1/namespaces/{self.ns}/configmaps/load-{i}"
            headers = {"Content-Type": "application/merge-patch+json"}
        else:
            method, path, body, headers = "GET", f"/api/v1/namespaces/{self.ns}/configmaps", None, {}
        headers = {**headers, "Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        for attempt in (0, 1):
            c = self._conn()
            try:
                c.request(method, path, body=body, headers=headers)
                r = c.getresponse()
                r.read()
                return r.status
            except (OSError, http.client.HTTPException):
                c.close()
                self.local.conn = None
                if attempt:
                    return 0  # no answer: counted as an error with code 0
        return 0

    def _worker(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            kind, due = item
            sent = time.time_ns()
            code = self._send(kind)
            end = time.time_ns()
            with self.lock:
                self.done.append((kind, due, sent, (end - due) / 1e9, (end - sent) / 1e9, code))

    def _closed_list(self) -> None:
        """One closed-loop client: a LIST as soon as the last one's answer is read."""
        while not self.stop_ev.is_set():
            sent = time.time_ns()
            code = self._send(CLOSED_LIST)
            end = time.time_ns()
            with self.lock:
                self.done.append((CLOSED_LIST, sent, sent, (end - sent) / 1e9, (end - sent) / 1e9, code))
            if not 200 <= code < 300:
                self.stop_ev.wait(ERROR_PAUSE_S)

    def _schedule(self, kind: str, rate: float) -> None:
        """Puts one request every 1/rate s on the queue, at its due time, whatever is pending."""
        if rate <= 0:
            return
        period = 1e9 / rate
        n = 0
        start = self.t0 + int(random.uniform(0, period))
        while not self.stop_ev.is_set():
            due = start + int(n * period)
            wait = (due - time.time_ns()) / 1e9
            if wait > 0 and self.stop_ev.wait(wait):
                return
            self.q.put((kind, due))
            n += 1

    @staticmethod
    def _self_cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    def start(self) -> None:
        self.cpu0 = {k: lib.cpu_seconds(p) for k, p in cluster_pids().items()}
        self.cpu0["this process (load generator, harness)"] = self._self_cpu()
        self.t0 = time.time_ns()
        for _ in range(self.workers):
            self.threads.append(threading.Thread(target=self._worker, daemon=True))
        self.threads += [threading.Thread(target=self._schedule, args=("write", self.writes_per_s), daemon=True),
                         threading.Thread(target=self._schedule, args=("list", self.lists_per_s), daemon=True)]
        self.threads += [threading.Thread(target=self._closed_list, daemon=True) for _ in range(self.list_clients)]
        for t in self.threads:
            t.start()
        log(f"load: {self.writes_per_s:g} writes/s and {self.lists_per_s:g} lists/s"
            + (f", {self.list_clients} clients listing back to back" if self.list_clients else "")
            + f" of {self.objects} ConfigMaps (~{self.object_bytes} B each) in {self.ns}, {self.workers} workers")

    def stop(self) -> dict:
        """Stops the schedule, lets the pending requests finish (up to the timeout), and reports."""
        self.stop_ev.set()
        self.t1 = time.time_ns()
        cpu1 = {k: lib.cpu_seconds(p) for k, p in cluster_pids().items()}
        cpu1["this process (load generator, harness)"] = self._self_cpu()
        pending = self.q.qsize()
        for _ in range(self.workers):
            self.q.put(None)
        for t in self.threads:
            t.join(self.timeout + 5)
        return self.report(pending, cpu1)

    def report(self, pending_at_stop: int, cpu1: dict[str, float | None]) -> dict:
        window = (self.t1 - self.t0) / 1e9
        with self.lock:
            done = list(self.done)
        # pending_at_stop: due but not yet sent when the schedule stopped (the generator or the
        # server fell behind); they are sent after, and counted in the latencies, not in sent_per_s.
        out: dict = {"window_s": round(window, 3), "pending_at_stop": pending_at_stop}
        kinds = [("write", self.writes_per_s), ("list", self.lists_per_s)]
        if self.list_clients:
            kinds.append((CLOSED_LIST, None))  # closed loop: no target rate, as fast as answered
        for kind, rate in kinds:
            ds = [d for d in done if d[0] == kind]
            in_window = [d for d in ds if d[2] < self.t1]
            codes = Counter(d[5] for d in ds)
            ok = [d for d in ds if 200 <= d[5] < 300]
            lat = stats([d[3] for d in ok])
            svc = stats([d[4] for d in ok])
            out[kind] = {
                "target_per_s": rate,
                "sent_per_s": round(len(in_window) / window, 3) if window else None,
                "ok_per_s": round(len([d for d in in_window if 200 <= d[5] < 300]) / window, 3) if window else None,
                "due": len(ds), "ok": len(ok), "errors": len(ds) - len(ok),
                "codes": {str(k): v for k, v in sorted(codes.items())},
                "latency_from_due_s": {q: lat.get(q) for q in ("n", "p50", "p90", "p99", "max")},
                "service_s": {q: svc.get(q) for q in ("n", "p50", "p99", "max")},
            }
        if self.list_clients:
            out[CLOSED_LIST]["clients"] = self.list_clients
        out["cpu_s_per_s"] = {k: (round((cpu1[k] - self.cpu0[k]) / window, 3)
                                  if cpu1.get(k) is not None and self.cpu0.get(k) is not None and window else None)
                              for k in self.cpu0}
        return out

    def config(self) -> dict:
        return {"writes_per_s": self.writes_per_s, "lists_per_s": self.lists_per_s,
                "list_clients": self.list_clients,
                "objects": self.objects, "object_bytes": self.object_bytes, "workers": self.workers,
                "namespace": self.ns, "setup_s": round(self.setup_s, 2),
                "how": "open loop, straight to the API server: writes are merge patches of a random "
                       "ConfigMap's data; lists are LISTs of all the namespace's ConfigMaps; latency "
                       "from each request's due time on the schedule"
                       + ("; beside it, list_clients closed-loop clients (closed_list), each LISTing "
                          "all the namespace's ConfigMaps back to back, the whole body read, "
                          f"{ERROR_PAUSE_S * 1000:.0f} ms pause after an error; latency from the send"
                          if self.list_clients else "")}

    def samples(self) -> dict:
        """Every request kept, for a result's raw samples: latency (ms, from the due time) of the
        answered ones by kind, and per request [kind, sent (ms from t0_ns, the load's start on the
        wall clock, as the trials' times are), latency from due (ms), service (ms), code]."""
        with self.lock:
            done = list(self.done)
        ms: dict[str, list[float]] = {}
        for d in done:
            if 200 <= d[5] < 300:
                ms.setdefault(d[0], []).append(d[3] * 1000)
        rows = [[d[0], round((d[2] - self.t0) / 1e6, 3), round(d[3] * 1000, 3), round(d[4] * 1000, 3), d[5]]
                for d in sorted(done, key=lambda d: d[2])]
        return {"ms": ms, "t0_ns": self.t0, "requests": rows}

    def cleanup(self, kube: Kube) -> None:
        kube.request("DELETE", f"/api/v1/namespaces/{self.ns}", ok=(200, 202, 404))


class DelayProxy:
    """Loopback TCP relay to the API server: each chunk read is written on after delay_ms, each
    way, in order (a pipe with added latency, not a throttle)."""

    def __init__(self, delay_ms: float, upstream_port: int = API_PORT):
        self.delay = delay_ms / 1000.0
        self.upstream_port = upstream_port
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = None
        self.connections = 0
        self.bytes = [0, 0]  # to the API server, from it

        async def go():
            self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0, backlog=512)
            return self.server.sockets[0].getsockname()[1]

        self.port = asyncio.run_coroutine_threadsafe(go(), self.loop).result()

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, way: int) -> None:
        q: asyncio.Queue = asyncio.Queue()

        async def read():
            try:
                while True:
                    data = await r.read(1 << 16)
                    q.put_nowait((self.loop.time() + self.delay, data))
                    if not data:
                        return
            except (ConnectionError, OSError):
                q.put_nowait((self.loop.time() + self.delay, b""))

        reader = asyncio.ensure_future(read())
        try:
            while True:
                at, data = await q.get()
                wait = at - self.loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    break
                self.bytes[way] += len(data)
                w.write(data)
                await w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            reader.cancel()
            try:
                w.close()
            except (ConnectionError, OSError):
                pass

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            cw.close()
            return
        await asyncio.gather(self._pipe(cr, uw, 0), self._pipe(ur, cw, 1), return_exceptions=True)

    def stats(self) -> dict:
        return {"delay_ms_each_way": self.delay * 1000, "connections": self.connections,
                "bytes_to_apiserver": self.bytes[0], "bytes_from_apiserver": self.bytes[1]}

    def close(self) -> dict:
        async def go():
            self.server.close()

        asyncio.run_coroutine_threadsafe(go(), self.loop).result()
        return {"delay_ms_each_way": self.delay * 1000, "connections": self.connections,
                "bytes_to_apiserver": self.bytes[0], "bytes_from_apiserver": self.bytes[1]}


class DelayProxyProcess:
    """DelayProxy in a Python process of its own (`load.py --proxy-only`), so that the harness's
    threads and the load generator's do not hold up the relaying (one GIL, a busy process):
    the delay stays what it says. Same interface: .port, .close() -> its figures."""

    def __init__(self, delay_ms: float, workdir: Path):
        workdir.mkdir(parents=True, exist_ok=True)
        self.port_file, self.stats_file = workdir / "delay-proxy.port", workdir / "delay-proxy.json"
        for f in (self.port_file, self.stats_file):
            f.unlink(missing_ok=True)
        self.proc = lib.Proc("delay-proxy", [sys.executable, str(lib.BENCH / "load.py"), "--proxy-only",
                                             "--delay-ms", str(delay_ms), "--port-file", str(self.port_file),
                                             "--stats-file", str(self.stats_file)], workdir / "logs")

        def port() -> int | None:
            if not self.proc.alive():
                raise RuntimeError(f"the delay proxy exited; see {self.proc.logfile}")
            try:
                return int(self.port_file.read_text())
            except (OSError, ValueError):
                return None

        self.port = lib.wait_until(port, 20, "the delay proxy to listen", interval=0.05)

    def close(self) -> dict:
        time.sleep(1.2)  # one more stats write
        try:
            out = json.loads(self.stats_file.read_text())
        except (OSError, ValueError):
            out = {}
        out["alive_at_end"] = self.proc.alive()
        out["cpu_s"] = lib.cpu_seconds(self.proc.pid)  # over its life: the whole run
        lib.stop_all([self.proc])
        return out


def probe_delay(port: int, n: int = 5) -> dict:
    """GET /version through a port, n times (fresh TLS connection each: handshake + request)."""
    ctx = ssl.create_default_context(cafile=str(lib.ca_file()))
    token = lib.admin_token()
    ts = []
    for _ in range(n):
        t = time.monotonic()
        c = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10)
        c.request("GET", "/version", headers={"Authorization": f"Bearer {token}"})
        c.getresponse().read()
        c.close()
        ts.append(time.monotonic() - t)
    return stats(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description="size the load alone against a running bench cluster")
    ap.add_argument("--writes", type=float, default=100)
    ap.add_argument("--lists", type=float, default=10)
    ap.add_argument("--objects", type=int, default=500)
    ap.add_argument("--object-bytes", type=int, default=1024)
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--list-clients", type=int, default=0,
                    help="closed-loop clients, each LISTing the namespace's ConfigMaps back to back")
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--delay-ms", type=float, default=0)
    ap.add_argument("--proxy-only", action="store_true",
                    help="run only the delay proxy (DelayProxyProcess starts it so): its port to "
                         "--port-file, its figures to --stats-file every second")
    ap.add_argument("--port-file", type=Path)
    ap.add_argument("--stats-file", type=Path)
    args = ap.parse_args()
    if args.proxy_only:
        px = DelayProxy(args.delay_ms)
        args.port_file.write_text(str(px.port))
        while True:
            tmp = args.stats_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(px.stats()))
            tmp.replace(args.stats_file)
            time.sleep(1)
    kube = Kube()
    gen = LoadGenerator(args.writes, args.lists, args.objects, args.object_bytes, args.workers,
                        list_clients=args.list_clients)
    gen.setup(kube)
    try:
        if args.delay_ms:
            px = DelayProxy(args.delay_ms)
            print(json.dumps({"direct": probe_delay(API_PORT), "proxied": probe_delay(px.port)}, indent=1))
        gen.start()
        time.sleep(args.seconds)
        print(json.dumps({"config": gen.config(), "achieved": gen.stop()}, indent=1))
    finally:
        gen.cleanup(kube)


if __name__ == "__main__":
    main()
