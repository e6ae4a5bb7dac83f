"""fencedlease.aio against a fake sidecar whose state the test changes."""

import asyncio
import unittest

from fencedlease import Client, NotLeader, Token
from fencedlease.aio import AsyncClient, run_while_leading

from .fake import FakeSidecar


class AsyncCalls(unittest.IsolatedAsyncioTestCase):
    async def test_the_calls_of_the_client_awaitable(self):
        side = FakeSidecar(leading=True, token=7)
        self.addCleanup(side.close)
        c = AsyncClient(Client(side.url))
        self.assertEqual(await c.token(), Token(7, "uid-1"))
        self.assertTrue((await c.status()).leading)
        side.set(leading=False, token=None, holder="pod-b")
        with self.assertRaises(NotLeader):
            await c.token()


class RunWhileLeading(unittest.IsolatedAsyncioTestCase):
    async def test_work_runs_per_tenure_and_is_cancelled_when_it_ends(self):
        side = FakeSidecar(leading=True, token=4, time_left_ms=1500)
        self.addCleanup(side.close)
        started, cancelled = asyncio.Queue(), asyncio.Event()
        stop = asyncio.Event()

        async def work(lead):
            await started.put(lead.token())
            try:
                await stop.wait()  # work watches stop, as documented; else cancelled
            except asyncio.CancelledError:
                cancelled.set()
                raise

        runner = asyncio.ensure_future(run_while_leading(work, AsyncClient(Client(side.url)), stop=stop))
        self.assertEqual(await asyncio.wait_for(started.get(), 10), Token(4, "uid-1"))
        side.set(leading=False, token=None, holder="pod-b")  # the tenure ends
        await asyncio.wait_for(cancelled.wait(), 10)
        side.set(leading=True, token=6, holder=None, time_left_ms=1500)  # a new tenure
        self.assertEqual(await asyncio.wait_for(started.get(), 10), Token(6, "uid-1"))
        stop.set()
        await asyncio.wait_for(runner, 10)

    async def test_work_that_returns_releases_the_lease(self):
        side = FakeSidecar(leading=True, token=4, time_left_ms=1500)
        self.addCleanup(side.close)
        stop = asyncio.Event()
        ran = asyncio.Event()

        async def work(lead):
            ran.set()
            stop.set()  # and return at once

        await asyncio.wait_for(run_while_leading(work, AsyncClient(Client(side.url)), stop=stop), 10)
        self.assertTrue(ran.is_set())
        self.assertEqual(side.releases, 1)


if __name__ == "__main__":
    unittest.main()
