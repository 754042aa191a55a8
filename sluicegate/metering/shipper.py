"""Ships a node's usage records from its ledger to the broker replicas, at least once, and
applies their acknowledgements.

Records go out QoS 1 on the node's own topic (``topics.usage(node)``, which the ACL lets
only that node write), a batch per message (``sluicegate.metering.wire``), as soon as the
ledger has them on disk (:meth:`Shipper.ship`). Every replica hears each message, dedups in
Redis and answers on ``topics.usage_acks(node)``; an acknowledged record is marked in the
ledger and never sent again. What is not acknowledged ``resend_s`` after it was sent is
sent again, and at start (a restart, a crash) and after every reconnect every record not
acknowledged is: the broker keeps exactly one copy of each, however many times it comes.
A refusal is logged with its reason; the record stays in the ledger, unacknowledged, and
is offered again at the next resend (a policy that lists the node later takes it). Nothing
here writes a record or drops one. Generic over the node: a pool worker and an edge agent
ship the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence

from pydantic import ValidationError

from sluicegate import topics
from sluicegate.errors import LedgerError, TransportError
from sluicegate.metering.ledger import Ledger
from sluicegate.metering.record import SignedUsage
from sluicegate.metering.wire import CONTENT_TYPE, UsageAck, encode_batch
from sluicegate.transport import Message, Transport

log = logging.getLogger(__name__)

BATCH = 128  # records per message at most (a record is about 1 KB)
PAGE = 500  # records read from the ledger per query when resending
PER_PASS = 4_096  # records resent per pass at most: a long backlog goes out over passes
TRACKED = 65_536  # records whose last send is remembered (a broker away for long: bounded)


class Shipper:
    """The records of ``ledger``'s node on their way to the broker. ``await start()``
    (subscribes to the acks), then run :meth:`run` as a task; :meth:`ship` what the
    ledger just wrote."""

    def __init__(
        self,
        ledger: Ledger,
        transport: Transport,
        *,
        resend_s: float = 30.0,
        prune_every_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ledger = ledger
        self.node = ledger.node
        self._transport = transport
        self._resend_s = resend_s
        self._prune_every_s = prune_every_s
        self._clock = clock
        self._topic = topics.usage(self.node)
        self._sent: dict[int, float] = {}  # seq -> when last sent, for records not acked
        self._everything = asyncio.Event()  # send every unacked record (start, reconnect)
        self._everything.set()
        self._more = False  # the last pass stopped at PER_PASS: go on at the next tick ...
        self._cursor = 0  # ... after this seq
        self._told: set[str] = set()  # refusal codes logged already
        self.sent = 0  # records published, resends included
        self.acked = 0  # records newly acknowledged
        self.refused = 0  # refusals heard
        self.ignored = 0  # acks malformed or for another node

    async def start(self) -> None:
        await self._transport.subscribe(topics.usage_acks(self.node), self.on_ack, qos=1)
        self._transport.on_connect(self._everything.set)

    # -- out ------------------------------------------------------------------------------------

    def ship(self, records: Sequence[SignedUsage]) -> None:
        """Publish records the ledger holds (loop thread); never raises. When the node is
        offline they wait for the next reconnect's pass."""
        if not records or not self._transport.connected:
            return
        now = self._clock()
        for start in range(0, len(records), BATCH):
            chunk = records[start : start + BATCH]
            message = Message(self._topic, encode_batch(chunk), qos=1, content_type=CONTENT_TYPE)
            try:
                self._transport.publish_nowait(message)
            except TransportError as exc:
                log.warning("usage records %d.. not shipped now: %s", chunk[0].record.seq, exc)
                return
            for signed in chunk:
                self._sent[signed.record.seq] = now
            self.sent += len(chunk)
        while len(self._sent) > TRACKED:  # the oldest forgotten: due again at the next pass
            del self._sent[next(iter(self._sent))]

    async def run(self) -> None:
        """Resend what was not acknowledged in time (all of it at start and after each
        reconnect), and prune the ledger now and then."""
        pruned_at = self._clock()
        tick = max(0.05, min(self._resend_s / 4.0, 5.0))
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._everything.wait(), tick)
            everything = self._everything.is_set()
            self._everything.clear()
            try:
                await self._resend(everything)
                if self._clock() - pruned_at >= self._prune_every_s:
                    pruned_at = self._clock()
                    await self.ledger.prune()
            except LedgerError as exc:
                log.error("usage shipping paused: %s", exc)

    async def _resend(self, everything: bool) -> None:
        if not self._transport.connected:
            return
        if everything:  # whatever was in flight may be lost: every record is due again
            self._sent.clear()
            self._more, self._cursor = True, 0
        stale = self._clock() - self._resend_s
        if not self._more and not any(at <= stale for at in self._sent.values()):
            return
        # A pass cut short by PER_PASS goes on from where it stopped, not from the start.
        after, budget = (self._cursor if self._more else 0), PER_PASS
        self._more, self._cursor = False, 0
        while True:
            page = await self.ledger.unacked(after=after, limit=PAGE)
            if not page:
                return
            durable = self.ledger.durable_seq  # never ship what a power loss could undo
            due = [
                s
                for s in page
                if s.record.seq <= durable and self._sent.get(s.record.seq, -math.inf) <= stale
            ]
            if len(due) >= budget:
                self.ship(due[:budget])
                self._more, self._cursor = True, due[budget - 1].record.seq
                return
            self.ship(due)
            budget -= len(due)
            after = page[-1].record.seq
            if len(page) < PAGE:
                return

    # -- in -------------------------------------------------------------------------------------

    def on_ack(self, msg: Message) -> None:
        try:
            ack = UsageAck.model_validate_json(msg.payload)
        except ValidationError as exc:
            self.ignored += 1
            log.warning("ignored a malformed usage ack on %s: %s", msg.topic, str(exc)[:200])
            return
        if ack.node != self.node:
            self.ignored += 1
            log.warning("ignored a usage ack for node %r on %s", ack.node[:64], msg.topic)
            return
        for refusal in ack.refused:
            self.refused += 1
            if refusal.code not in self._told:
                self._told.add(refusal.code)
                log.error(
                    "broker %s refused usage record %d [%s]: %s (kept; offered again)",
                    ack.broker,
                    refusal.seq,
                    refusal.code,
                    refusal.reason,
                )
        if ack.held:
            for seq in ack.held:
                self._sent.pop(seq, None)
            done = self.ledger.acknowledge(ack.held)
            done.add_done_callback(self._applied)

    def _applied(self, fut: asyncio.Future[int]) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            log.error("usage acknowledgements not recorded: %s", exc)
            return
        self.acked += fut.result()

    @property
    def in_flight(self) -> int:
        """Records sent since this process started and not acknowledged yet."""
        return len(self._sent)
