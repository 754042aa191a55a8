"""Usage records between sister campuses: ours that concern a peer out to it, theirs that
concern us in, and the settlement export that holds both (``sluicegate.metering.peering``).

When this replica stores a new record of ours (``broker.metering``: once across replicas)
that concerns a peer (a run of its job here, a settlement here of a job its pool ran), the
record goes, countersigned, to that peer on ``topics.peer_usage`` (QoS 1; the bridge's
persistent session holds it through a link cut). Every replica hears each peer's records on
the peer's tree; one is kept once per (node, seq), whichever replica comes first, only as
``peering.theirs_problem`` allows (the receipt of a broker our ``[peers]`` entry pins, about
a job between us); the rest are counted by reason and logged. The export puts ours and
theirs of a period together under this replica's signed manifest. Loop thread only.
"""

from __future__ import annotations

import asyncio
import contextlib
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
        self._listening: set[str] = set()
        self._inbox: deque[Message] = deque()
        self._wake = asyncio.Event()
        self.sent: Counter[str] = Counter()  # records sent, by peer
        self.kept: Counter[str] = Counter()  # records of each peer kept (new here)
        self.refused: Counter[str] = Counter()

    def send_ours(self, signed: SignedUsage, policy: Policy | None) -> None:
        """A record of ours just stored: to each peer it concerns."""
        if policy is None or not policy.peers:
            return
        for peer in policy.peers:
            if not concerns(signed.record, peer):
                continue
            topic = topics.peer_usage(policy.campus, peer)
            try:
                self._transport.publish_nowait(Message(topic, to_line(signed), qos=1))
            except TransportError as exc:
                log.warning("usage record %d of %s not sent to %s: %s",
                            signed.record.seq, signed.record.node, peer, exc)  # fmt: skip
                continue
            self.sent[peer] += 1

    def on_message(self, msg: Message) -> None:
        """A record a peer sent: kept in order, taken by :meth:`run`."""
        self._inbox.append(msg)
        self._wake.set()

    async def _take(self, msg: Message) -> None:
        """A record a peer sent: checked, then kept once."""
        policy = self._policy()
        peer = topics.peer_of(msg.topic)
        if policy is None or peer not in policy.peers:
            return
        try:
            signed = from_line(msg.payload)
        except ValidationError as exc:
            self._refuse(peer, "malformed", f"not a usage record: {exc.error_count()} error(s)")
            return
        why = theirs_problem(policy, peer, signed)
        if why is not None:
            self._refuse(peer, "refused", why)
            return
        try:
            (new,) = await self._store.insert_theirs(peer, [signed])
        except StoreUnavailable as exc:  # the peer's broker sent it once: say so loudly
            log.error("usage record %d of %s from %s not kept: %s",
                      signed.record.seq, signed.record.node, peer, exc)  # fmt: skip
            self._refuse(peer, "store_unavailable", str(exc))
            return
        if new:
            self.kept[peer] += 1

    def _refuse(self, peer: str, reason: str, why: str) -> None:
        self.refused[f"{peer}.{reason}"] += 1
        self._on_refused(reason)
        log.warning("usage record from %s not kept [%s]: %s", peer, reason, why)

    async def listen(self) -> None:
        """Hear each listed peer's records (once each; every replica)."""
        policy = self._policy()
        if policy is None:
            return
        for peer in sorted(set(policy.peers) - self._listening):
            await self._transport.subscribe(
                topics.peer_usage(peer, policy.campus), self.on_message, qos=1
            )
            self._listening.add(peer)

    async def run(self, interval_s: float) -> None:
        """Take what peers sent as it comes; listen to newly listed peers every interval."""
        while True:
            try:
                await self.listen()
            except TransportError as exc:
                log.warning("sister campuses' usage records: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), interval_s)
            self._wake.clear()
            while self._inbox:
                await self._take(self._inbox.popleft())

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
