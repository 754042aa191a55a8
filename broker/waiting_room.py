"""The broker's waiting room: placement requests that found no worker with room, held in
multi-level-feedback order until capacity may have freed (then decided again) or their wait
is over (then answered ``no_capacity``, to run on their edge). How long one may wait is
``broker.core.service_rules.answer_by``; the order is ``broker.core.mlfq``. This is the
asyncio side of both: it holds, wakes and hands back, and decides nothing itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from broker.core import service_rules
from broker.core.mlfq import MLFQ, Waiting
from sluicegate.wire_pool import PlacementRequest

WAIT_TICK_S = 0.005  # how often waiting requests are looked at when nothing else happens


@dataclass
class Pending:
    """A placement request on its way through the broker."""

    request: PlacementRequest
    reply_topic: str
    correlation: bytes | None
    arrived: float  # perf_counter
    waiting_since: float | None = None  # unix s, when it first found no room


class WaitingRoom:
    """Requests waiting for room; ``again`` gets one back to decide, ``give_up`` one whose
    wait is over, with the reason for its answer."""

    def __init__(
        self,
        max_wait_ms: float,
        *,
        clock: Callable[[], float],
        again: Callable[[Pending], None],
        give_up: Callable[[Pending, str], None],
        gauge: Callable[[int], None],
    ) -> None:
        wait_s = max_wait_ms / 1000.0
        self._max_wait_ms = max_wait_ms
        self._queue: MLFQ[Pending] = MLFQ(max(wait_s, 1e-3), max(wait_s / 10.0, 1e-4))
        self._clock = clock
        self._again = again
        self._give_up = give_up
        self._gauge = gauge
        self._room = asyncio.Event()  # capacity may have freed: look at who waits
        self._someone_waits = asyncio.Event()

    def __len__(self) -> int:
        return len(self._queue)

    def freed(self) -> None:
        """Capacity may have freed (a completion, a release, fresh telemetry)."""
        self._room.set()

    def hold(self, item: Pending, now: float) -> bool:
        """Hold a request that found no room, if its edge waits long enough; True if held."""
        req = item.request
        since = item.waiting_since if item.waiting_since is not None else now
        answer_by = service_rules.answer_by(
            since,
            now,
            broker_max_wait_ms=self._max_wait_ms,
            edge_max_wait_ms=req.max_wait_ms,
            deadline_at=req.deadline_at,
        )
        if answer_by is None:
            return False
        item.waiting_since = since
        held = self._queue.push(Waiting(req.job_id, req.priority, answer_by, since, item), now)
        self._someone_waits.set()
        return held

    async def run(self) -> None:
        """Give waiting requests another decision whenever capacity may have freed, in
        multi-level-feedback order; answer those whose wait is over."""
        while True:
            self._gauge(len(self._queue))
            if not len(self._queue):
                self._someone_waits.clear()
                await self._someone_waits.wait()
                continue
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel. Whether
            # there is room is read off the event, not the timeout: capacity that frees
            # as the tick ends must not be cleared unseen (the request would wait it out).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(WAIT_TICK_S):
                    await self._room.wait()
            room = self._room.is_set()
            self._room.clear()
            now = self._clock()
            for gone in self._queue.expired(now):
                item = gone.item
                waited = (now - (item.waiting_since or now)) * 1000.0
                self._give_up(
                    item, f"no allowed worker had room within {waited:.0f} ms; run locally"
                )
            while room and (ready := self._queue.pop_ready(now)) is not None:
                self._again(ready.item)
