"""The placer's inbox: the placement requests waiting to be decided, and whether any are.

Placement requests are the broker's urgent work: an edge waits for each answer (50 ms by
default). The placer takes whatever has arrived as one batch (:meth:`Inbox.batch`) and says
when it has answered it (:meth:`Inbox.done`); from the moment a request arrives until its
batch is answered, the inbox is *busy*. Background work that may wait, the edges' telemetry
above all, awaits :meth:`Inbox.idle` before each slice, so the loop does not run a slice
between a request's arrival, its reservation's round trip to Redis and its answer: each
such slice was a millisecond added to the answer. That work waits long only while requests
come without a pause; then the telemetry backlog ages and is shed, counted
(``broker.core.intake``). No decisions here.
"""

from __future__ import annotations

import asyncio

from broker.waiting_room import Pending


class Inbox:
    """Requests waiting for the placer, and an event set while there are none."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Pending] = asyncio.Queue()
        self._idle = asyncio.Event()
        self._idle.set()

    def put(self, item: Pending) -> None:
        """A request to decide (new, or back from the waiting room)."""
        self._queue.put_nowait(item)
        self._idle.clear()

    async def batch(self) -> list[Pending]:
        """Whatever has arrived, once something has; the inbox stays busy until
        :meth:`done`."""
        batch = [await self._queue.get()]
        while not self._queue.empty():
            batch.append(self._queue.get_nowait())
        return batch

    def done(self) -> None:
        """The batch taken last is answered (or held in the waiting room)."""
        if self._queue.empty():
            self._idle.set()

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    async def idle(self) -> None:
        """Return once no request waits to be decided or answered (at once if none)."""
        await self._idle.wait()
