#!/usr/bin/env python3
"""A history worker: repeated fenced read-modify-write updates of the ConfigMap `history`
(a counter and an append-only list), each logged with its token and the API server's verdict.

  worker.py campaign NAME LOG KUBECONFIG [SERVER]   token from FENCEDLEASE_TOKEN (run by campaign)
  worker.py sidecar  NAME LOG KUBECONFIG URL        token from the sidecar's /v1/token
"""
import json
import os
import signal
import sys
import time
import urllib.request
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kube import Kube  # noqa: E402

NS = "history"
PATH = f"/api/v1/namespaces/{NS}/configmaps/history"


def now():
    return time.time_ns()


def sidecar_token(url):
    try:
        with urllib.request.urlopen(url + "/v1/token", timeout=1) as r:
            v = json.loads(r.read())
            return str(v["token"]), v["leaseUID"]
    except Exception:
        return None, None


STOP = False


def on_term(_sig, _frame):
    # Like a real app, finish the operation under way, then stop.
    global STOP
    STOP = True


def main():
    signal.signal(signal.SIGTERM, on_term)
    mode, name, log_path, kubeconfig = sys.argv[1:5]
    extra = sys.argv[5] if len(sys.argv) > 5 else None
    kube = Kube(kubeconfig, server=extra if mode == "campaign" and extra else None)
    log = open(log_path, "a", buffering=1)
    seq = 0
    while not STOP:
        if mode == "campaign":
            token, uid = os.environ["FENCEDLEASE_TOKEN"], os.environ["FENCEDLEASE_LEASE_UID"]
        else:
            token, uid = sidecar_token(extra)
            if token is None:
                time.sleep(0.05)
                continue
        seq += 1
        item = f"{name}-{os.getpid()}-{seq}"
        rec = {"worker": name, "mode": mode, "token": int(token), "uid": uid, "item": item}
        try:
            code, cm = kube.request("GET", PATH, timeout=3)
            if code != 200:
                rec.update(verdict="error", code=code, t_send=now(), t_ack=now(), message=str(cm)[:200])
                log.write(json.dumps(rec) + "\n")
                time.sleep(0.1)
                continue
            data = cm.get("data") or {}
            counter = int(data.get("counter", "0"))
            items = data.get("items", "")
            cm["data"] = {"counter": str(counter + 1), "items": (items + "," + item) if items else item}
            ann = cm["metadata"].setdefault("annotations", {})
            ann["fencedlease.io/token"] = token
            ann["fencedlease.io/lease-uid"] = uid
            ann["fencedlease.io/write-id"] = uuid.uuid4().hex
            rec["read_rv"] = int(cm["metadata"]["resourceVersion"])
            rec["t_send"] = now()
            # The intent first: if this process dies before the answer, the write is ambiguous.
            log.write(json.dumps(dict(rec, verdict="sent")) + "\n")
            code, out = kube.request("PUT", PATH, cm, timeout=5)
            rec["t_ack"] = now()
            rec["code"] = code
            if code == 200:
                rec["verdict"] = "accepted"
                rec["rv"] = int(out["metadata"]["resourceVersion"])
            else:
                msg = out.get("message", "") if isinstance(out, dict) else str(out)
                rec["message"] = msg[:300]
                if "fencedlease: " in msg and "denied the request" in msg:
                    rec["verdict"] = "refused"
                elif code == 409:
                    rec["verdict"] = "conflict"
                elif code >= 500:
                    rec["verdict"] = "unknown"  # the server may have stored it anyway
                else:
                    rec["verdict"] = "error"
        except OSError as e:
            rec.setdefault("t_send", now())
            # A timeout after sending is ambiguous: the write may or may not have landed.
            rec.update(verdict="unknown" if "t_ack" not in rec and "read_rv" in rec else "error",
                       t_ack=now(), message=str(e)[:200])
        log.write(json.dumps(rec) + "\n")
        if rec["verdict"] in ("error", "unknown", "refused"):
            time.sleep(0.1)


if __name__ == "__main__":
    main()
