#!/usr/bin/env python3
"""A leader loop with the fencedlease Python client: wait for leadership, then write a protected
ConfigMap once a second with the token, until leadership ends; then wait again.

    FENCEDLEASE_URL   the sidecar API (default http://127.0.0.1:8787)
    CONFIGMAP         the ConfigMap to write (default: inventory), in kubectl's namespace

Writes go through kubectl here to stay within the standard library; with the `kubernetes`
package, pass merge_patch(...)'s body to patch_namespaced_config_map the same way.
"""

import json
import os
import subprocess
import sys
import time

from fencedlease import Client, LeadershipLost, leading, merge_patch

CONFIGMAP = os.environ.get("CONFIGMAP", "inventory")


def write(lead, n):
    # merge_patch() calls lead.token(): it raises LeadershipLost once leadership is over or can
    # no longer be vouched for (after a pause, say), so a stale token is never sent knowingly.
    # One already on its way is refused by the fencing webhook.
    body = merge_patch(lead, {"data": {"tick": str(n)}})
    out = subprocess.run(["kubectl", "patch", "configmap", CONFIGMAP, "--type", "merge",
                          "-p", json.dumps(body)], capture_output=True, text=True)
    if out.returncode != 0:
        print(f"write refused: {out.stderr.strip()}", flush=True)
    else:
        print(f"wrote tick {n} with token {body['metadata']['annotations']['fencedlease.io/token']}", flush=True)


def main():
    client = Client()
    while True:
        print("waiting for leadership", flush=True)
        try:
            with leading(client) as lead:
                print(f"leading with token {lead.token()}", flush=True)
                n = 0
                while not lead.lost.wait(1.0):
                    n += 1
                    write(lead, n)
            print(f"not leading any more: {lead.reason}", flush=True)
        except LeadershipLost as e:
            print(f"not leading any more: {e}", flush=True)
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
