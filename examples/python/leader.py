#!/usr/bin/env python3
"""A Python app beside the fencedlease sidecar (standard library only).

It follows /v1/watch (Server-Sent Events) to know at once when it starts or stops leading,
and writes a protected ConfigMap with the token through the Kubernetes API: the fencing
webhook refuses the write if the token went stale meanwhile.

    FENCEDLEASE_URL  sidecar API (default http://127.0.0.1:8787)
    FENCEDLEASE_API_SECRET_FILE  the pod's API secret, sent with every request (default
                     /var/run/fencedlease/api-secret)
"""
import json
import os
import threading
import time
import urllib.request

URL = os.environ.get("FENCEDLEASE_URL", "http://127.0.0.1:8787")
SECRET_FILE = os.environ.get("FENCEDLEASE_API_SECRET_FILE", "/var/run/fencedlease/api-secret")
state = {"leading": False, "token": None, "leaseUID": None}
lock = threading.Lock()


def follow():
    """Keeps `state` in step with the sidecar's event stream, reconnecting on errors."""
    while True:
        try:
            # The sidecar answers only requests with the pod's secret (read afresh: the
            # sidecar writes it at start).
            with open(SECRET_FILE) as f:
                auth = {"Authorization": "Bearer " + f.read().strip()}
            request = urllib.request.Request(URL + "/v1/watch", headers=auth)
            with urllib.request.urlopen(request, timeout=60) as stream:
                for raw in stream:
                    line = raw.decode().strip()
                    if line.startswith("data:"):
                        status = json.loads(line[5:])
                        with lock:
                            state.update(leading=status["leading"], token=status["token"],
                                         leaseUID=status["leaseUID"])
                        print("leading" if status["leading"] else f"following {status['holder']}", flush=True)
        except OSError:
            time.sleep(1)


def work(token, lease_uid):
    # Replace with your write. With kubectl, for a protected object:
    #   kubectl annotate ... fencedlease.io/token=<token> fencedlease.io/lease-uid=<uid> \
    #       fencedlease.io/write-id=<something new, e.g. uuid.uuid4().hex>
    print(f"work with token {token} (lease uid {lease_uid})", flush=True)


def main():
    threading.Thread(target=follow, daemon=True).start()
    while True:
        with lock:
            leading, token, uid = state["leading"], state["token"], state["leaseUID"]
        if leading:
            work(token, uid)
        time.sleep(1)


if __name__ == "__main__":
    main()
