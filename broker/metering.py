"""The broker's intake of usage records: every node's records off MQTT, screened, stored once
in Redis, countersigned, acknowledged to their node, counted; and the signed export.

Every replica subscribes to every node's usage topic (not shared): each one screens what it
hears (``broker.core.usage.Screening``: the node is the topic's sender, the policy lists it
with that key and role, its signature verifies, once for a run of records of one message
that link to each other), countersigns it with its own key, and
stores it with one atomic insert per (node, seq) (``broker.usage_store``), so whichever
replica comes first stores it and the others find it held. The replica acknowledges what
is held, new or a duplicate, so the node stops resending; it refuses, with the reason, what
fails the screen or conflicts with the record held for its seq (kept aside, counted,
audited, never stored over it): the node keeps those. Counters of new records per line and
pool are this replica's share of the campus's (sum over replicas). A message that cannot be
stored (Redis away) is not acknowledged at all: its node sends it again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable

import redis.asyncio as aioredis

from broker.core.identity import IdentityRefusal
from broker.core.usage import (
    Screening,
    UsageRefusal,
    counted,
    link_breaks,
    missing,
    outcome,
)
from broker.decision_audit import DecisionAudit, encode
from broker.gatekeeper import Gatekeeper
from broker.lua import check_cancelled
from broker.metrics import BrokerMetrics
from broker.usage_store import Stored, UsageStore
from policies import Policy, SigningKey
from sluicegate import topics
from sluicegate.errors import StoreUnavailable, TransportError
from sluicegate.metering.record import SignedUsage, countersign, export_lines
from sluicegate.metering.wire import BadLine, Refused, UsageAck, decode_batch
from sluicegate.transport import Message, Transport

log = logging.getLogger(__name__)

# Records checked and countersigned between two turns of the loop (about 0.6 ms of work for
# records of a run, 1.5 ms where each needs its own signature check: a node catching up
# sends 128 records a message, and 64 messages are taken at once).
SCREEN_SLICE = 4
STORE_SLICE = 64  # records stored in one Redis call, and counted between two turns


class UsageIngest:
    """One replica's usage intake. Subscribe :meth:`on_usage` to ``topics.usage_all()``
    and run :meth:`run` as a task."""

    def __init__(
        self,
        broker_id: str,
        transport: Transport,
        redis: aioredis.Redis,
        key: SigningKey,
        policy: Callable[[], Policy | None],
        metrics: BrokerMetrics,
        gate: Gatekeeper,
        audit: DecisionAudit,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.broker_id = broker_id
        self._transport = transport
        self.store = UsageStore(redis)
        self._key = key
        self._policy = policy
        self._metrics = metrics
        self._gate = gate
        self._audit = audit
        self._clock = clock
        self._inbox: deque[Message] = deque()
        self._wake = asyncio.Event()
        self.stored = 0  # new records this replica stored
        # Told of each record this replica stored first (the sister campuses' exchange).
        self.on_new: Callable[[SignedUsage, Policy | None], None] = lambda _s, _p: None

    def on_usage(self, msg: Message) -> None:
        self._inbox.append(msg)
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._inbox:
                batch = [self._inbox.popleft() for _ in range(min(len(self._inbox), 64))]
                try:
                    await self._take(batch)
                except Exception:  # one bad batch must not stop the intake
                    log.exception("usage intake failed for %d message(s)", len(batch))
                check_cancelled()

    async def _take(self, messages: list[Message]) -> None:
        policy = self._policy()
        now_ms = int(self._clock() * 1000)
        held: dict[str, list[int]] = defaultdict(list)
        refused: dict[str, list[Refused]] = defaultdict(list)
        taken: list[tuple[SignedUsage, bytes]] = []  # countersigned, with its digest
        screened = 0
        for msg in messages:
            sender = topics.sender(msg.topic)
            screening = Screening(sender, policy)
            mine: list[tuple[SignedUsage, bytes]] = []
            theirs: list[Refused] = []
            for item in reversed(decode_batch(msg.payload)):  # last first: see Screening
                screened += 1
                if screened % SCREEN_SLICE == 0:
                    await asyncio.sleep(0)  # placements that arrived meanwhile go first
                if isinstance(item, BadLine):
                    self._refused(sender, 0, UsageRefusal("usage.malformed", item.reason))
                    theirs.append(Refused(seq=0, code="usage.malformed", reason=item.reason))
                    continue
                seen = screening.take(item)
                if seen.refusal is not None:
                    self._refused(sender, item.record.seq, seen.refusal, policy)
                    theirs.append(_refused(item.record.seq, seen.refusal))
                    continue
                signed = countersign(
                    item, self._key, broker=self.broker_id, received_ms=now_ms, digest=seen.digest
                )
                mine.append((signed, seen.digest))
            taken += reversed(mine)
            if theirs:
                refused[sender] += reversed(theirs)
        stored: list[Stored] = []
        try:
            for start in range(0, len(taken), STORE_SLICE):  # each an await: the loop turns
                chunk = taken[start : start + STORE_SLICE]
                stored += await self.store.insert_many(chunk)
        except StoreUnavailable as exc:
            self._metrics.usage_store_failures.inc()
            log.warning("usage records not stored (%s); their nodes will send them again", exc)
            taken = taken[: len(stored)]  # what was stored before Redis failed is answered
        for done, ((signed, digest), found) in enumerate(zip(taken, stored, strict=True), 1):
            if done % STORE_SLICE == 0:
                await asyncio.sleep(0)
            r = signed.record
            verdict = outcome(digest.hex(), found.held)
            if verdict == "new":
                self._new(signed, found.before, found.after, policy)
                self._metrics.usage_missing.labels(r.node).set(missing(found.head, found.count))
                held[r.node].append(r.seq)
            elif verdict == "duplicate":
                self._metrics.usage_duplicates.inc()
                held[r.node].append(r.seq)
            else:
                reason = await self._conflict(signed)
                refused[r.node].append(Refused(seq=r.seq, code="usage.conflict", reason=reason))
        for node in set(held) | set(refused):
            self._ack(node, held.get(node, []), refused.get(node, []))

    def _new(
        self, signed: SignedUsage, before: str | None, after: str | None, policy: Policy | None
    ) -> None:
        self.stored += 1
        self.on_new(signed, policy)
        r = signed.record
        c = counted(signed, policy)
        self._metrics.usage_records.labels(c.line, c.pool, r.event).inc()
        if c.ran:
            self._metrics.usage_device_seconds.labels(c.line, c.pool).inc(c.device_s)
        if c.billed:
            self._metrics.usage_jobs_billed.labels(c.line, c.pool).inc()
        breaks = link_breaks(signed, before, after)
        if breaks:
            self._metrics.usage_chain_breaks.labels(r.node).inc(breaks)
            log.warning("usage record %d of %s does not link to its neighbours", r.seq, r.node)
            detail = {"node": r.node, "seq": r.seq, "prev": r.prev, "breaks": breaks}
            self._audit.add(r.node, encode(detail), "usage.chain_break")

    async def _conflict(self, signed: SignedUsage) -> str:
        r = signed.record
        reason = (
            f"record {r.seq} of {r.node} differs from the one the broker holds for that seq "
            "(a ledger reset or a forgery); kept aside, the one held stays"
        )
        try:
            kept = await self.store.keep_conflict(signed)
        except StoreUnavailable as exc:
            log.warning("conflicting usage record %d of %s not kept: %s", r.seq, r.node, exc)
            return reason
        if not kept:  # another replica (or an earlier resend) kept it already
            return reason
        digest = signed.digest().hex()
        self._metrics.usage_conflicts.labels(r.node).inc()
        log.error("usage conflict: %s", reason)
        detail = {"node": r.node, "seq": r.seq, "digest": digest, "at_ms": r.at_ms}
        self._audit.add(r.node, encode(detail), "usage.conflict")
        return reason

    def _refused(
        self, sender: str, seq: int, refusal: UsageRefusal, policy: Policy | None = None
    ) -> None:
        self._metrics.usage_refusals.labels(refusal.code).inc()
        if refusal.code == "usage.malformed":
            log.warning("malformed usage record from %s: %s", sender, refusal.reason)
            return
        # Counted, logged and audited once per node, code and policy, as identity refusals.
        self._gate.refuse(sender, "usage", IdentityRefusal(refusal.code, refusal.reason), policy)

    def _ack(self, node: str, held: list[int], refused: list[Refused]) -> None:
        ack = UsageAck(node=node, broker=self.broker_id, held=held, refused=refused)
        try:
            self._transport.publish_nowait(
                Message(topics.usage_acks(node), ack.model_dump_json().encode(), qos=1)
            )
        except TransportError as exc:
            log.warning("usage ack to %s not sent (it will resend): %s", node, exc)

    # -- export ---------------------------------------------------------------------------------

    async def export(self, from_ms: int, to_ms: int) -> bytes:
        """The records held whose ``at_ms`` falls in ``[from_ms, to_ms]``, a line each, then
        this replica's signed manifest (``sluicegate.metering.record.export_lines``)."""
        records = await self.store.between(from_ms, to_ms)
        lines = export_lines(
            records,
            self._key,
            broker=self.broker_id,
            exported_ms=int(self._clock() * 1000),
            from_ms=from_ms,
            to_ms=to_ms,
        )
        return b"\n".join(lines) + b"\n"


def _refused(seq: int, refusal: UsageRefusal) -> Refused:
    return Refused(seq=seq, code=refusal.code, reason=refusal.reason[:500])
