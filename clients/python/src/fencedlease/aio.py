"""asyncio: the sidecar's API for asyncio programs (kopf operators, aiohttp services).

::

    from fencedlease.aio import AsyncClient, run_while_leading

    async def work(lead):                 # runs while this pod leads; cancelled when it stops
        ...

    await run_while_leading(work, AsyncClient(), stop=stop_event)

The calls are those of :class:`fencedlease.Client`, run in worker threads (the client is
standard library only and may be shared between threads), so the event loop never blocks on
the sidecar. :func:`run_while_leading` builds on :func:`fencedlease.leading` and keeps its
promises (see :mod:`fencedlease.leadership`): a tenure ends as soon as the sidecar reports a loss
or its last confirmation runs out, and the work is then cancelled.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Optional

from .client import Client
from .errors import NotLeader
from .leadership import Leadership, leading
from .model import Status, Token

#: How long ``run_while_leading`` waits for leadership before it looks at ``stop`` again (s).
STOP_CHECK = 1.0
#: How often a tenure's end is looked at while nothing changes (s); the watcher thread of
#: :func:`fencedlease.leading` sets ``lead.lost`` as soon as the sidecar says so.
LOSS_CHECK = 0.05
#: How long work may take to finish after ``stop`` is set while still leading (s).
SHUTDOWN_GRACE = 10.0

_log = logging.getLogger("fencedlease")


class AsyncClient:
    """The sidecar client for asyncio: the same calls, awaitable. ``client`` defaults to a
    new :class:`fencedlease.Client` made with ``kwargs``."""

    def __init__(self, client: Optional[Client] = None, **kwargs: Any):
        self.client = client if client is not None else Client(**kwargs)

    def __repr__(self) -> str:
        return f"<AsyncClient {self.client.url}>"

    async def status(self, *, timeout: Optional[float] = None) -> Status:
        """``GET /v1/status``."""
        return await asyncio.to_thread(self.client.status, timeout=timeout)

    async def token(self) -> Token:
        """``GET /v1/token``; raises :class:`fencedlease.NotLeader` when this pod does not lead."""
        return await asyncio.to_thread(self.client.token)

    async def release(self) -> None:
        """``POST /v1/release``: step down now."""
        await asyncio.to_thread(self.client.release)

    async def acknowledge(self, token: Token) -> None:
        """Tells the sidecar's API proxy that the app knows this tenure."""
        await asyncio.to_thread(self.client.acknowledge, token)


async def tenure_over(lead: Leadership) -> None:
    """Completes when ``lead`` is over: lost, or its last confirmation ran out."""
    while not lead.lost.is_set() and lead.time_left() > 0:
        await asyncio.sleep(min(LOSS_CHECK, max(lead.time_left(), 0.001)))


async def run_while_leading(
    work: Callable[[Leadership], Awaitable[Any]],
    client: Optional[AsyncClient] = None,
    *,
    stop: Optional[asyncio.Event] = None,
) -> None:
    """Runs ``await work(lead)`` for each tenure of this pod until ``stop`` is set.

    The work of a tenure is cancelled as soon as the tenure is over (the sidecar reported a
    loss, or its last confirmation ran out). When ``stop`` is set while leading, the work is
    given :data:`SHUTDOWN_GRACE` seconds to return (it should watch ``stop`` itself), then
    cancelled. Work that returns on its own while still leading releases the lease (nothing
    acts on it any more): another pod takes over, and this one runs the work again in its next
    tenure. Writes made by the work must still carry ``lead.token()`` (or go through the
    sidecar's API proxy): a write already sent when the tenure ends is stopped only by the
    fencing webhook.
    """
    client = client if client is not None else AsyncClient()
    stop = stop if stop is not None else asyncio.Event()
    while not stop.is_set():
        block = leading(client.client, wait=True, timeout=STOP_CHECK)
        try:
            lead = await asyncio.to_thread(block.__enter__)
        except NotLeader:
            continue  # not leading within STOP_CHECK: look at stop, then wait again
        try:
            await _one_tenure(work, lead, stop)
        finally:
            await asyncio.to_thread(block.__exit__, None, None, None)


async def _one_tenure(work: Callable[[Leadership], Awaitable[Any]], lead: Leadership, stop: asyncio.Event) -> None:
    task = asyncio.ensure_future(work(lead))
    over = asyncio.ensure_future(tenure_over(lead))
    stopping = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait({task, over, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if task in done and over not in done:
            await asyncio.to_thread(lead.release)  # the work ended on its own: step down
        elif stopping in done and task not in done:
            await asyncio.wait({task, over}, timeout=SHUTDOWN_GRACE, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, over, stopping):
            t.cancel()
        await asyncio.gather(task, over, stopping, return_exceptions=True)
    if not task.cancelled() and task.exception() is not None:
        _log.error("the work of tenure %s failed; the lease was released", lead, exc_info=task.exception())
