"""Usage records between sister campuses: ours that concern a peer out to it, theirs that
concern us in, and the settlement export that holds both (``sluicegate.metering.peering``).

When this replica stores a new record of ours (``broker.metering``: once across replicas)
that concerns a peer (a run of its job here, a settlement here of a job its pool ran), the
record goes, countersigned, to that peer on ``topics.peer_usage`` (QoS 1, a line each, those
stored in the same turn of the loop in one message; the bridge's persistent session holds
them through a link cut). Every replica hears each peer's records on the peer's tree; one is
kept once per (node, seq), whichever replica comes first, only as
``peering.theirs_problem`` allows (the receipt of a broker our ``[peers]`` entry pins, about
a job between us); the rest are counted by reason and logged. The export puts ours and
theirs of a period together under this replica's signed manifest. Loop thread only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable

from pydantic import ValidationError

from broker.usage_store import UsageStore
from policies import Policy, SigningKey
from sluicegate import topics
from sluicegate.errors import StoreUnavailable, TransportError
from sluicegate.metering.peering import concerns, peer_export, theirs_problem
from sluicegate.metering.record import SignedUsage, from_line, to_line
from sluicegate.transport import Message, Transport

log = logging.getLogger(__name__)


class PeerUsage:
    """This replica's share of the usage records crossing to and from sister campuses."""

    def __init__(
        self,
        broker_id: str,
        transport: Transport,
        store: UsageStore,
        key: SigningKey,
        policy: Callable[[], Policy | None],
        *,
        clock: Callable[[], float] = time.time,
        on_refused: Callable[[str], None] = lambda _reason: None,
    ) -> None:
        self._broker_id = broker_id
        self._transport = transport
        self._store = store
        self._key = key
        self._policy = policy
        self._clock = clock
        self._on_refused = on_refused  # the service's counter: kind "usage", the reason
        self._inbox: deque[Message] = deque()
        self._outbox: dict[str, list[bytes]] = {}  # lines to each peer, this turn
        self._wake = asyncio.Event()
        self.sent: Counter[str] = Counter()  # records sent, by peer
        self.kept: Counter[str] = Counter()  # records of each peer kept (new here)
        self.refused: Counter[str] = Counter()

    def send_ours(self, signed: SignedUsage, policy: Policy | None) -> None:
        """A record of ours just stored: to each peer it concerns, with the others stored in
        the same turn of the loop (one message a peer, a record a line)."""
        if policy is None or not policy.peers:
            return
        for peer in policy.peers:
            if not concerns(signed.record, peer):
                continue
            if not self._outbox:
                asyncio.get_running_loop().call_soon(self._flush, policy.campus)
            self._outbox.setdefault(peer, []).append(to_line(signed))

    def _flush(self, campus: str) -> None:
        outbox, self._outbox = self._outbox, {}
        for peer, lines in outbox.items():
            topic = topics.peer_usage(campus, peer)
            try:
                self._transport.publish_nowait(Message(topic, b"\n".join(lines), qos=1))
            except TransportError as exc:
                log.warning("%d usage records not sent to %s: %s", len(lines), peer, exc)
                continue
            self.sent[peer] += len(lines)

    def on_message(self, msg: Message) -> None:
        """Records a peer sent: kept in order, taken by :meth:`run`."""
        self._inbox.append(msg)
        self._wake.set()

    async def _take(self, messages: list[Message]) -> None:
        """Records peers sent: each checked, then those that pass kept once, one round
        trip to Redis a peer."""
        policy = self._policy()
        if policy is None:
            return
        keep: dict[str, list[SignedUsage]] = {}
        for msg in messages:
            peer = topics.peer_of(msg.topic)
            if peer not in policy.peers:
                continue
            for line in msg.payload.split(b"\n"):
                try:
                    signed = from_line(line)
                except ValidationError as exc:
                    bad = f"not a usage record: {exc.error_count()} error(s)"
                    self._refuse(peer, "malformed", bad)
                    continue
                why = theirs_problem(policy, peer, signed)
                if why is not None:
                    self._refuse(peer, "refused", why)
                    continue
                keep.setdefault(peer, []).append(signed)
        for peer, records in keep.items():
            try:
                new = await self._store.insert_theirs(peer, records)
            except StoreUnavailable as exc:  # the peer's broker sent them once: say so loudly
                log.error("%d usage records from %s not kept: %s", len(records), peer, exc)
                self._refuse(peer, "store_unavailable", str(exc))
                continue
            self.kept[peer] += sum(new)

    def _refuse(self, peer: str, reason: str, why: str) -> None:
        self.refused[f"{peer}.{reason}"] += 1
        self._on_refused(reason)
        log.warning("usage record from %s not kept [%s]: %s", peer, reason, why)

    async def run(self) -> None:
        """Take what peers sent as it comes (``on_message``: subscribed by
        ``broker.peers.Peers.hear``)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._inbox:
                batch = [self._inbox.popleft() for _ in range(min(len(self._inbox), 64))]
                await self._take(batch)

    async def export(self, peer: str, from_ms: int, to_ms: int) -> bytes:
        """The settlement export with ``peer`` of ``[from_ms, to_ms]``."""
        policy = self._policy()
        campus_peers = policy.peers if policy is not None else {}
        if peer not in campus_peers:
            raise KeyError(peer)
        ours = [s for s in await self._store.between(from_ms, to_ms) if concerns(s.record, peer)]
        theirs = await self._store.theirs_between(peer, from_ms, to_ms)
        return peer_export(
            ours,
            theirs,
            self._key,
            broker=self._broker_id,
            peer=peer,
            exported_ms=int(self._clock() * 1000),
            from_ms=from_ms,
            to_ms=to_ms,
        )
