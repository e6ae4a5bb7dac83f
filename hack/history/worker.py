#!/usr/bin/env python3
"""A history worker: an app that writes to the protected ConfigMaps with a fencing token, each
write logged with its token and the API server's verdict.

  worker.py --name N --log FILE --kubeconfig K --token SOURCE --style STYLE [options]

SOURCE is where the token comes from before each write:
  env             FENCEDLEASE_TOKEN and FENCEDLEASE_LEASE_UID (the app runs under campaign)
  http:URL        the sidecar's URL/v1/token
  file:DIR        the sidecar's token files DIR/token and DIR/lease-uid

STYLE is how it writes:
  rmw     read the shard, append an item, write it back with the resourceVersion it read
          (the API server refuses a write based on a stale read: 409)
  blind   a merge patch of the ConfigMap `blind` with no resourceVersion: only fencing can
          refuse it (the articles' story)
  mixed   one of the two at random

--deaf: an app that ignores the loss of leadership: when its source has no token any more,
it goes on writing with the last one it had (re-reading the object first in rmw style: a
fresh resourceVersion with a stale token). It writes with a kept token every --deaf-pace
seconds (default 1.0), so that it does not drown the other writers' stale writes in the count.
--gc-pause P: with probability P, the app stalls 0.5-3 s between taking its token (and reading
the object) and sending its write, like a long garbage collection.

RMW writes go to the shard history-<k>, k = (now - --shard-start) // --shard-seconds, so that no
object grows without bound. Every attempt is logged before it is sent (an app that dies
waiting leaves an ambiguous record, not a missing one) and again with its outcome.
"""
import argparse
import json
import os
import random
import signal
import sys
import time
import urllib.request
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # hack/kubeclient.py
from kubeclient import Kube  # noqa: E402

NS = "history"
CM = f"/api/v1/namespaces/{NS}/configmaps"
STOP = False


def now():
    return time.time_ns()


def on_term(_sig, _frame):
    # Like a well-behaved app, finish the operation under way, then stop.
    global STOP
    STOP = True


def token_from(source, secret_file=None):
    """(token, lease uid), or (None, None) when the source says this app does not lead. The
    sidecar's API wants the pod's secret (the file `secret_file`)."""
    try:
        if source == "env":
            return os.environ["FENCEDLEASE_TOKEN"], os.environ["FENCEDLEASE_LEASE_UID"]
        if source.startswith("http:"):
            req = urllib.request.Request(source[5:] + "/v1/token")
            if secret_file:
                with open(secret_file) as f:
                    req.add_header("Authorization", "Bearer " + f.read().strip())
            with urllib.request.urlopen(req, timeout=1) as r:
                v = json.loads(r.read())
                return str(v["token"]), v["leaseUID"]
        if source.startswith("file:"):
            d = source[5:]
            token = open(os.path.join(d, "token")).read().strip()
            uid = open(os.path.join(d, "lease-uid")).read().strip()
            return (token, uid) if token and uid else (None, None)
    except (OSError, ValueError, KeyError):
        pass
    return None, None


def verdict_of(code, out):
    if code in (200, 201):
        return "accepted", None
    msg = out.get("message", "") if isinstance(out, dict) else str(out)
    if "fencedlease: " in msg and "denied the request" in msg:
        return "refused", msg[:300]
    if "failed calling webhook" in msg:
        return "error", msg[:300]  # refused for want of an answer (fail closed): not stored
    if code == 409:
        return "conflict", msg[:300]
    if code >= 500:
        return "unknown", msg[:300]  # the server may have stored it anyway
    return "error", msg[:300]


class App:
    def __init__(self, a):
        self.a = a
        self.kube = Kube.from_kubeconfig(a.kubeconfig, server=a.server)
        self.log = open(a.log, "a", buffering=1)
        self.rng = random.Random()
        self.seq = 0
        self.tag = uuid.uuid4().hex[:10]  # items stay unique when process ids are reused
        self.kept = (None, None)  # the last token this app had (for --deaf)

    def token(self):
        tok, uid = token_from(self.a.token, self.a.api_secret_file)
        if tok is not None:
            self.kept = (tok, uid)
            return tok, uid, False
        if self.a.deaf and self.kept[0] is not None:
            return self.kept[0], self.kept[1], True
        return None, None, False

    def shard(self):
        k = int((time.time() - self.a.shard_start) // self.a.shard_seconds)
        return f"history-{max(0, min(k, self.a.shards - 1))}"

    def stall(self, rec):
        if self.a.gc_pause and self.rng.random() < self.a.gc_pause:
            d = self.rng.uniform(0.5, 3.0)
            rec["stall_s"] = round(d, 3)
            time.sleep(d)

    def stamp(self, meta, tok, uid):
        ann = meta.setdefault("annotations", {})
        ann["fencedlease.io/token"] = tok
        ann["fencedlease.io/lease-uid"] = uid
        ann["fencedlease.io/write-id"] = uuid.uuid4().hex

    def rmw(self, rec, tok, uid):
        obj = self.shard()
        rec["obj"] = obj
        code, cm = self.kube.fetch("GET", f"{CM}/{obj}", timeout=3)
        if code != 200:
            return None, code, cm
        data = cm.get("data") or {}
        items = data.get("items", "")
        cm["data"] = {"counter": str(int(data.get("counter", "0")) + 1),
                      "items": (items + "," + rec["item"]) if items else rec["item"]}
        self.stamp(cm["metadata"], tok, uid)
        rec["read_rv"] = int(cm["metadata"]["resourceVersion"])
        return ("PUT", f"{CM}/{obj}", cm, "application/json"), code, cm

    def blind(self, rec, tok, uid):
        rec["obj"] = "blind"
        meta = {}
        self.stamp(meta, tok, uid)
        patch = {"metadata": meta, "data": {"last": rec["item"], "token": tok}}
        return ("PATCH", f"{CM}/blind", patch, "application/merge-patch+json"), 200, None

    def once(self):
        tok, uid, kept = self.token()
        if tok is None:
            time.sleep(0.05)
            return
        self.seq += 1
        style = self.a.style if self.a.style != "mixed" else self.rng.choice(["rmw", "blind"])
        rec = {"worker": self.a.name, "style": style, "token": int(tok), "uid": uid,
               "item": f"{self.a.name}.{self.tag}.{self.seq}"}
        if kept:
            rec["kept"] = True  # the source had no token: a deaf app's leftover
        try:
            req, code, body = (self.rmw if style == "rmw" else self.blind)(rec, tok, uid)
            if req is None:
                self.record(dict(rec, verdict="error", phase="read", code=code, message=str(body)[:200]))
                return
            self.stall(rec)
            rec["t_send"] = now()
            self.record(dict(rec, verdict="sent"))
            method, path, body, ctype = req
            code, out = self.kube.fetch(method, path, body, timeout=5, content_type=ctype)
            rec["t_ack"] = now()
            rec["code"] = code
            rec["verdict"], msg = verdict_of(code, out)
            if msg:
                rec["message"] = msg
            if code in (200, 201):
                rec["rv"] = int(out["metadata"]["resourceVersion"])
        except OSError as e:
            # A timeout after sending is ambiguous: the write may or may not have landed.
            if "t_send" in rec:
                rec.update(verdict="unknown", t_ack=now(), message=str(e)[:200])
            else:
                rec.update(verdict="error", phase="read", message=str(e)[:200])
        self.record(rec)
        if kept:
            time.sleep(self.a.deaf_pace)

    def record(self, rec):
        self.log.write(json.dumps(rec, separators=(",", ":")) + "\n")
        if rec["verdict"] in ("error", "unknown"):
            time.sleep(0.1)
        elif rec["verdict"] == "refused":
            time.sleep(0.05)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--server", help="API server URL (default: the kubeconfig's)")
    ap.add_argument("--token", required=True, help="env, http:URL or file:DIR")
    ap.add_argument("--api-secret-file", help="with http:URL: the file with the pod's API secret")
    ap.add_argument("--style", choices=["rmw", "blind", "mixed"], required=True)
    ap.add_argument("--deaf", action="store_true")
    ap.add_argument("--deaf-pace", type=float, default=1.0)
    ap.add_argument("--gc-pause", type=float, default=0.0)
    ap.add_argument("--shard-start", type=float, required=True)
    ap.add_argument("--shard-seconds", type=float, required=True)
    ap.add_argument("--shards", type=int, required=True)
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, on_term)
    app = App(a)
    while not STOP:
        app.once()


if __name__ == "__main__":
    main()
