"""API load (issue 9, item 4): requests per second per candidate and per holder, idle and during
a failover, for N candidates of each system.

Every candidate gets a kubeconfig whose server is its own port of a counting proxy written here:
the proxy terminates TLS (a certificate from `fencedlease certs`, ALPN http/1.1 only, so both
clients speak HTTP/1.1 to it), parses the request heads of each connection, counts them by
candidate and verb, and relays bytes to the real API server over TLS. A watch counts as one
request when it is opened, however long it streams.

Windows:
- idle: after every candidate is up and one leads, plus a warm-up, for --idle seconds;
- failover: from the SIGKILL of the holder until the next leader's "leading" event.
"""

from __future__ import annotations

import argparse
import asyncio
import ssl
import threading
import time
from collections import defaultdict
from pathlib import Path

import apilog
import lib
from lib import API_PORT, Kube, log, now_ns, step
from systems import OURS, SYSTEMS, peer_timings, start_candidate


def classify(method: str, target: str) -> str:
    path, _, query = target.partition("?")
    if method == "GET":
        if "watch=true" in query or "watch=1" in query or "/watch/" in path:
            return "watch"
        return "get"
    return {"PUT": "update", "PATCH": "patch", "POST": "create", "DELETE": "delete"}.get(method, method.lower())


class CountingProxy:
    """Loopback TLS proxy; one listening port per client; counts request heads."""

    def __init__(self, certdir: Path):
        self.server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.server_ctx.load_cert_chain(certdir / "tls.crt", certdir / "tls.key")
        self.server_ctx.set_alpn_protocols(["http/1.1"])
        self.upstream_ctx = ssl.create_default_context(cafile=str(lib.ca_file()))
        self.upstream_ctx.set_alpn_protocols(["http/1.1"])
        self.events: list[tuple[int, int, str, str]] = []  # (t_ns, port, verb, path)
        self.lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self.servers: list = []
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def listen(self, n: int) -> list[int]:
        async def go():
            ports = []
            for _ in range(n):
                srv = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.server_ctx,
                                                 limit=1 << 20, backlog=512)
                self.servers.append(srv)
                ports.append(srv.sockets[0].getsockname()[1])
            return ports

        return asyncio.run_coroutine_threadsafe(go(), self.loop).result()

    def close(self) -> None:
        async def go():
            for s in self.servers:
                s.close()
            self.servers.clear()

        asyncio.run_coroutine_threadsafe(go(), self.loop).result()

    def reset(self) -> None:
        with self.lock:
            self.events.clear()

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        port = cw.get_extra_info("sockname")[1]
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", API_PORT, ssl=self.upstream_ctx,
                                                   server_hostname="127.0.0.1", limit=1 << 20)
        except OSError:
            cw.close()
            return

        async def requests():
            try:
                while True:
                    head = await cr.readuntil(b"\r\n\r\n")
                    lines = head.decode("latin-1").split("\r\n")
                    method, target = (lines[0].split(" ") + ["", ""])[:2]
                    length, chunked = 0, False
                    for h in lines[1:]:
                        k, _, v = h.partition(":")
                        k = k.strip().lower()
                        if k == "content-length":
                            length = int(v.strip() or 0)
                        elif k == "transfer-encoding" and "chunked" in v.lower():
                            chunked = True
                    with self.lock:
                        self.events.append((now_ns(), port, classify(method, target),
                                            target.partition("?")[0]))
                    uw.write(head)
                    if length:
                        uw.write(await cr.readexactly(length))
                    elif chunked:
                        while True:
                            size_line = await cr.readuntil(b"\r\n")
                            uw.write(size_line)
                            size = int(size_line.split(b";")[0].strip(), 16)
                            uw.write(await cr.readexactly(size + 2))
                            if size == 0:
                                break
                    await uw.drain()
            except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError, OSError,
                    ValueError):
                pass
            finally:
                uw.close()

        async def responses():
            try:
                while True:
                    data = await ur.read(1 << 16)
                    if not data:
                        break
                    cw.write(data)
                    await cw.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                cw.close()

        await asyncio.gather(requests(), responses(), return_exceptions=True)

    def window(self, t0: int, t1: int) -> list[tuple[int, int, str, str]]:
        with self.lock:
            return [e for e in self.events if t0 <= e[0] < t1]


def run_one(system: str, n: int, args, proxy: CountingProxy, proxy_ca: bytes, kube: Kube) -> dict:
    """One system with N candidates: its figures (apilog.figures) and its kept request log."""
    L = args.lease
    ns = f"bench-api-{'fl' if system == OURS else 'cg'}-{n}-{lib.rand_suffix()}"
    kube.create_namespace(ns)
    work = lib.WORK / ns
    work.mkdir(parents=True, exist_ok=True)
    step(f"apiload {system} N={n}: starting {n} candidates (lease {L} s) behind the counting proxy")
    ports = proxy.listen(n)
    procs = []
    for i, port in enumerate(ports):
        kc = work / f"kubeconfig-{i}"
        lib.write_kubeconfig(kc, f"https://127.0.0.1:{port}", proxy_ca)
        ident = f"c{i}"
        procs.append(start_candidate(system, name=ident, ns=ns, lease="load", identity=ident,
                                     lease_s=L, kubeconfig=kc, logdir=work / "logs",
                                     events=work / f"{ident}.events"))
        if i % 10 == 9:
            time.sleep(0.2)  # do not start 100 processes in one burst on 2 cores

    def leader():
        ls = []
        for i, p in enumerate(procs):
            evs = [e for e in p.read_events() if e.get("event") in ("leading", "stopped")]
            if evs and evs[-1]["event"] == "leading":
                ls.append(i)
        return ls[0] if len(ls) == 1 else None

    try:
        lib.wait_until(lambda: leader() is not None, 3 * L + 60, "one leader", interval=0.2)
        alive = lambda: all(p.alive() for p in procs)  # noqa: E731
        if not alive():
            raise RuntimeError("a candidate exited during startup; see " + str(work / "logs"))
        step(f"apiload {system} N={n}: warming up {args.warmup} s, then counting {args.idle} s idle")
        time.sleep(args.warmup)
        h = leader()
        t0 = now_ns()
        time.sleep(args.idle)
        t1 = now_ns()
        if leader() != h:
            raise RuntimeError("the leader changed during the idle window")
        # failover
        step(f"apiload {system} N={n}: SIGKILL of the holder c{h}, counting until the next leader")
        t_kill = now_ns()
        procs[h].signal_group(9)

        def next_leader():
            for i, p in enumerate(procs):
                if i == h:
                    continue
                for e in p.read_events():
                    if e.get("event") == "leading" and e["t_ns"] > t_kill:
                        return i, e["t_ns"]
            return None

        nl, t_lead = lib.wait_until(next_leader, 3 * L + 60, "the next leader", interval=0.05)
        time.sleep(0.5)  # let the answers of the race arrive before counting
        request_log = apilog.request_log(proxy.window(t0, t_lead + int(0.5e9)), ports, h, L,
                                         (t0, t1), (t_kill, t_lead), 0.5)
        res = {"system": system, "n": n, "lease_s": L, **apilog.figures(request_log)}
        res["raw_samples"] = lib.keep_samples(args.out, f"samples/apiload-{system}-{n}.json.gz", {},
                                              {"requests": request_log})
        fo_s = res["failover"]["failover_s"]
        log(f"apiload {system} N={n}: idle holder {res['idle']['holder_rps_total']:.3f} req/s "
            f"({res['idle']['holder_writes_per_lease']:.2f} writes per lease), candidate mean "
            f"{res['idle']['candidate_rps_total_mean']:.4f} req/s; failover {fo_s:.2f} s, "
            f"{res['failover']['requests_total']} requests from candidates")
        return res
    finally:
        lib.stop_all(procs)
        proxy.close()
        proxy.reset()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[2, 10, 100])
    ap.add_argument("--lease", type=int, default=15)
    ap.add_argument("--warmup", type=float, default=20.0)
    ap.add_argument("--idle", type=float, default=45.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    kube = Kube()
    lib.install_crd()
    certdir = lib.WORK / f"proxy-certs-{lib.rand_suffix()}"
    lib.webhook_certs(certdir)
    proxy_ca = (certdir / "ca.crt").read_bytes()
    proxy = CountingProxy(certdir)
    started = time.monotonic()
    runs = []
    for n in args.n:
        for system in SYSTEMS:
            runs.append(run_one(system, n, args, proxy, proxy_ca, kube))
    lib.write_result(args.out, "apiload", {
        "benchmark": "apiload",
        "config": {"n": args.n, "lease_s": args.lease, "warmup_s": args.warmup, "idle_s": args.idle,
                   "peer_timings_s": peer_timings(args.lease),
                   "how": "counting TLS proxy on loopback, one port per candidate, HTTP/1.1"},
        "wall_s": time.monotonic() - started,
        "runs": runs,
    })


if __name__ == "__main__":
    main()
