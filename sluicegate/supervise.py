"""Watching a role's long-running tasks: each loop of a broker or a pool worker runs for
the life of the process and catches only the errors it expects (``StoreUnavailable``,
``TransportError``). One that ends anyway has met a fault nobody planned for; rather than
serve on without it (a broker whose reaper died recovers no lost worker's jobs), the role
stops with :class:`TaskFailed` naming the task and the fault, and its supervisor restarts
it, which every guarantee already survives.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from sluicegate.errors import SluicegateError


class TaskFailed(SluicegateError):
    """A task that should run for the life of the process ended on its own."""


async def until_stopped(stop: asyncio.Event, tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Return once ``stop`` is set; raise :class:`TaskFailed` if a task ends first."""
    waiter = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    for task in tasks:
        if task in done:
            fault = None if task.cancelled() else task.exception()
            what = repr(fault) if fault is not None else "it returned"
            raise TaskFailed(f"task {task.get_name()} ended: {what}") from fault
