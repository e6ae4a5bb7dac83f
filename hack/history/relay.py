#!/usr/bin/env python3
"""A TCP relay for the history test's network faults.

  relay.py LISTEN_HOST LISTEN_PORT TARGET_HOST TARGET_PORT     run one until killed

In run.py, `Relay` objects stand in front of the API server: `delay` holds every chunk that
long in each direction (a slow API server), `frozen` stops all traffic while connections stay
open (a connection that hangs without closing). TLS passes through untouched."""
import socket
import sys
import threading
import time


class Relay:
    def __init__(self, target, listen=("127.0.0.1", 0)):
        self.target = target
        self.frozen = threading.Event()
        self.delay = 0.0
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(listen)
        self.sock.listen(256)
        self.port = self.sock.getsockname()[1]

    def start(self):
        threading.Thread(target=self.serve, daemon=True).start()
        return self

    def serve(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                time.sleep(0.05)
                continue
            threading.Thread(target=self.connect, args=(c,), daemon=True).start()

    def connect(self, c):
        try:
            u = socket.create_connection(self.target, timeout=5)
            u.settimeout(None)
        except OSError:
            c.close()
            return
        for a, b in ((c, u), (u, c)):
            threading.Thread(target=self.pump, args=(a, b), daemon=True).start()

    def pump(self, a, b):
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                while self.frozen.is_set():
                    time.sleep(0.05)
                if self.delay:
                    time.sleep(self.delay)
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()


if __name__ == "__main__":
    lh, lp, th, tp = sys.argv[1:5]
    Relay((th, int(tp)), listen=(lh, int(lp))).serve()
