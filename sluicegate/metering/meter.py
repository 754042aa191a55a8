"""A node's metering, put together: its :class:`~sluicegate.metering.ledger.Ledger` and
:class:`~sluicegate.metering.shipper.Shipper`, started and stopped with the node, and the
one call a node's shell makes per batch of attempts (:meth:`Meter.record`): the records on
disk (what the caller waits for before it sends the results), then, once they would survive
a power loss too, on their way: the records made durable within :data:`SHIP_EVERY_S` share
one message (and one acknowledgement, one commit of it), so a busy node sends a few usage
messages a second, not one per job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, Protocol

from policies.keys import SigningKey
from sluicegate.metering.ledger import Ledger
from sluicegate.metering.record import NodeKind, SignedUsage, Usage
from sluicegate.metering.shipper import Shipper
from sluicegate.sqlite_writer import Writer
from sluicegate.transport import Transport

log = logging.getLogger(__name__)

SHIP_EVERY_S = 0.05  # a durable record waits at most this long for others to share its message


class UsageSettings(Protocol):
    """The ``usage_*`` settings an edge's and a worker's sections share."""

    @property
    def usage_resend_s(self) -> float: ...
    @property
    def usage_retention_s(self) -> float: ...
    @property
    def usage_synchronous(self) -> Literal["FULL", "NORMAL"]: ...


def node_meter(
    path: Path | str,
    key: SigningKey,
    transport: Transport,
    *,
    node: str,
    kind: NodeKind,
    settings: UsageSettings,
    log: Writer | None = None,
    synchronous: Literal["FULL", "NORMAL"] | None = None,
    legacy: Path | None = None,
) -> Meter:
    """A node's meter (not started): its ledger at ``path``, signed with ``key``; with
    ``log``, in that writer's file and commits (an edge's outbox: ``synchronous`` is the
    file's), taking over the chain of a ``legacy`` file of its own."""
    ledger = Ledger(
        path,
        key,
        node=node,
        kind=kind,
        retention_s=settings.usage_retention_s,
        synchronous=synchronous or settings.usage_synchronous,
        log=log,
        legacy=legacy,
    )
    return Meter(ledger, transport, resend_s=settings.usage_resend_s)


class Meter:
    def __init__(self, ledger: Ledger, transport: Transport, *, resend_s: float = 30.0) -> None:
        self.ledger = ledger
        self.shipper = Shipper(ledger, transport, resend_s=resend_s)
        self._task: asyncio.Task[None] | None = None
        self._due: list[SignedUsage] = []  # durable, to go out in the next message
        self._shipping: asyncio.TimerHandle | None = None
        self.written = 0  # records committed by this process
        self.failed = 0  # appends (batches) whose commit failed

    async def start(self) -> None:
        """Open the ledger (the chain goes on from its head), subscribe to the acks and
        start shipping: every record not acknowledged before goes out again."""
        head = await self.ledger.open()
        if head.unacked:
            log.info(
                "usage ledger of %s: %d record(s) not acknowledged yet, shipping them again",
                self.ledger.node,
                head.unacked,
            )
        await self.shipper.start()
        self._task = asyncio.create_task(self.shipper.run(), name="usage shipper")

    def record(self, drafts: Sequence[Usage]) -> asyncio.Future[list[SignedUsage]]:
        """Append ``drafts`` (one transaction) and ship them once durable; the future
        resolves once they are on disk (or with the ``LedgerError``)."""
        done = self.ledger.append(drafts)
        done.add_done_callback(self._written)
        return done

    def _written(self, fut: asyncio.Future[list[SignedUsage]]) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self.failed += 1
            return
        signed = fut.result()
        self.written += len(signed)
        if signed:  # shipped once it would survive power loss (ledger.durable)
            durable = self.ledger.durable(signed[-1].record.seq)
            durable.add_done_callback(lambda _done: self._ship_soon(signed))

    def _ship_soon(self, signed: list[SignedUsage]) -> None:
        self._due.extend(signed)
        if self._shipping is None:
            loop = asyncio.get_running_loop()
            self._shipping = loop.call_later(SHIP_EVERY_S, self._ship_due)

    def _ship_due(self) -> None:
        self._shipping = None
        due, self._due = self._due, []
        self.shipper.ship(due)

    async def stop(self) -> None:
        """Stop shipping (what was due goes out again after the next start: it is in the
        ledger, unacknowledged) and close the ledger."""
        if self._shipping is not None:
            self._shipping.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.ledger.close()
