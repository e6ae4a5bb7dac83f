"""A sample kopf operator, fenced (issue 35): it copies each ConfigMap labelled
``sample.fencedlease.io/source`` into a protected ConfigMap ``<name>-copy``, runs kopf only
while its pod leads, and sends every API call (kopf's own patches included) through the
fencedlease sidecar's API proxy, which stamps each write with the current token and refuses
writes while the pod does not lead.

    SAMPLE_NAMESPACE=ns SAMPLE_LEASE=sample SAMPLE_IDENTITY=pod-a \\
    FENCEDLEASE_URL=http://127.0.0.1:8787 FENCEDLEASE_TOKEN_DIR=/var/run/fencedlease \\
    python3 kopf_operator.py

In an injected pod (annotations ``fencedlease.io/lease`` and ``fencedlease.io/proxy-port``)
the sidecar sets ``FENCEDLEASE_URL`` and writes the proxy's kubeconfig into the token dir. The
fencing is the three pieces marked "fencing" below: the login handler (kopf's API calls go
through the proxy), the diff base that ignores the stamp, and ``run_while_leading`` around
``kopf.operator``. It prints one JSON line
per event on stdout, as the repository's other samples do (tests/adoption_kopf.rs reads them).
For that test only: while the file named by ``$FENCEDLEASE_SAMPLE_STALL_FILE`` exists, the next
copy stops the process (SIGSTOP) just before its write, as a long pause would.
"""

import asyncio
import json
import logging
import os
import signal
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import kopf  # noqa: E402

from fencedlease import (  # noqa: E402
    DELETE_INTENT_ANNOTATION,
    LEASE_LABEL,
    LEASE_UID_ANNOTATION,
    TOKEN_ANNOTATION,
    WRITE_ID_ANNOTATION,
)
from fencedlease.aio import AsyncClient, run_while_leading  # noqa: E402

NAMESPACE = os.environ["SAMPLE_NAMESPACE"]
LEASE = os.environ["SAMPLE_LEASE"]
IDENTITY = os.environ["SAMPLE_IDENTITY"]
TOKEN_DIR = os.environ.get("FENCEDLEASE_TOKEN_DIR", "/var/run/fencedlease")
STALL = os.environ.get("FENCEDLEASE_SAMPLE_STALL_FILE")
SOURCE_LABEL = "sample.fencedlease.io/source"


def emit(event, **fields):
    line = {"t_ns": time.time_ns(), "identity": IDENTITY, "event": event, **fields}
    print(json.dumps(line), flush=True)


def proxy():
    """The sidecar's API proxy, from the kubeconfig the sidecar writes: URL, CA file, token."""
    with open(os.path.join(TOKEN_DIR, "kubeconfig")) as f:
        kc = json.load(f)
    cluster, user = kc["clusters"][0]["cluster"], kc["users"][0]["user"]
    with open(os.path.join(TOKEN_DIR, user["tokenFile"])) as f:
        token = f.read().strip()
    return cluster["server"], os.path.join(TOKEN_DIR, cluster["certificate-authority"]), token


@kopf.on.login()
def login(**_):  # fencing: every API call of kopf goes through the sidecar's proxy
    server, ca, token = proxy()
    return kopf.ConnectionInfo(server=server, ca_path=ca, token=token, default_namespace=NAMESPACE)


def settings():
    """kopf's settings for a fenced operator."""
    s = kopf.OperatorSettings()
    s.posting.enabled = False  # the sample speaks in events on stdout
    # fencing: the stamp changes with every write (kopf's own included), so kopf must not take
    # it for a change of the object, or each of its patches would trigger the next.
    stamp = (TOKEN_ANNOTATION, LEASE_UID_ANNOTATION, WRITE_ID_ANNOTATION, DELETE_INTENT_ANNOTATION)
    s.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        ignored_fields=[("metadata", "annotations", key) for key in stamp],
    )
    return s


def apply_copy(name, value):
    """Server-side apply of the copy through the proxy (which stamps it): (status, message)."""
    server, ca, token = proxy()
    body = json.dumps({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "labels": {LEASE_LABEL: LEASE}},
        "data": {"value": value, "by": IDENTITY},
    }).encode()
    req = urllib.request.Request(
        f"{server}/api/v1/namespaces/{NAMESPACE}/configmaps/{name}?fieldManager=fenced-kopf&force=true",
        data=body, method="PATCH",
        headers={"Content-Type": "application/apply-patch+yaml", "Authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(req, context=ssl.create_default_context(cafile=ca), timeout=10) as r:
            return r.status, ""
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")[:500]


@kopf.on.resume("configmaps", labels={SOURCE_LABEL: kopf.PRESENT})
@kopf.on.create("configmaps", labels={SOURCE_LABEL: kopf.PRESENT})
@kopf.on.update("configmaps", labels={SOURCE_LABEL: kopf.PRESENT})
async def copy(body, name, **_):
    """Copies the source; kopf then records that it handled it (a patch of the source's
    annotations, through the proxy, stamped like the copy)."""
    value = (body.get("data") or {}).get("value")
    emit("reconcile-start", name=name)
    stalled = bool(STALL) and os.path.exists(STALL)
    if stalled:
        os.remove(STALL)
        emit("stalling")
        # To this thread itself: a stop sent to the process may be taken by another thread
        # first, and this one would run on, its write sent before the pause.
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
    code, message = await asyncio.to_thread(apply_copy, f"{name}-copy", value)
    if stalled:
        emit("late-answer", status=code, message=message)
    emit("wrote" if code < 300 else "refused", name=f"{name}-copy", value=value, status=code, message=message)
    emit("reconcile-end", name=name)
    if code >= 300:
        raise kopf.TemporaryError(f"the copy was refused ({code})", delay=1)


async def main():
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)

    async def operate(lead):  # fencing: kopf runs only while this pod leads
        emit("leading", token=lead.token().generation)
        kopf_stop = asyncio.Event()
        op = asyncio.ensure_future(kopf.operator(
            standalone=True, namespaces=[NAMESPACE], settings=settings(), stop_flag=kopf_stop,
        ))
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({op, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if op.done():
                stop.set()  # kopf ended by itself (it handles SIGTERM and SIGINT too): exit
        finally:
            kopf_stop.set()
            stopping.cancel()
            op.cancel()
            await asyncio.gather(op, stopping, return_exceptions=True)
            emit("stopped")

    await run_while_leading(operate, AsyncClient(), stop=stop)


if __name__ == "__main__":
    asyncio.run(main())
