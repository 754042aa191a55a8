"""The edges' telemetry in the broker: taken in for almost nothing, read later, shown from
memory, written to Redis in batches.

A campus may have thousands of line PCs, each reporting once a second; none of it decides a
placement (the edges' load is for people: ``/fleet``, the console, ``/metrics``). So the MQTT
handler, :meth:`EdgeFleet.offer`, only keeps the raw payload as the node's latest unread
sample (``broker.core.intake``: a newer one replaces it unread), and :meth:`EdgeFleet.run`
reads the backlog a tick later in slices, each only once no placement request waits to be
decided or answered (``broker.inbox``), yielding to the loop between slices so that a
request, a release or a completion that arrives meanwhile is served first. Each
sample is decoded once: checked against the policy (the policy must list its sender as an
edge: a node it does not list is ignored), and against its topic, kept in :attr:`edges`,
and handed to :class:`~broker.store.BrokerStore` as the node's document, which Redis gets
with the node's expiry in batches. Replicas take the edges' telemetry on a shared
subscription, each a share: a replica's view of a node is as old as the last sample that
reached it (about one interval per replica), and Redis holds every node's latest.

What the view keeps of a sample is a plain tuple of numbers and strings (an
:class:`EdgeRow` when read), not the decoded model: thousands of models replaced every
second, a score of tracked objects each, kept Python's cyclic garbage collector busy with
pauses of 20-50 ms on the loop (the young generation grew to 40,000 objects between
collections, since every sample freed as many as it made); a tuple of atoms it stops
tracking the first time it sees it.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import logging
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from pydantic import ValidationError

from broker.core.intake import Backlog
from broker.metrics import BrokerMetrics
from broker.store import BrokerStore
from policies import Policy
from sluicegate import topics, wire
from sluicegate.transport import Message

log = logging.getLogger(__name__)

SLICE = 64  # samples read between two turns of the loop (about 1 ms of work)


class EdgeRow(NamedTuple):
    """What the broker's views (``/metrics``, the console) read of an edge's latest sample."""

    node: str
    zone: str
    ts: float
    queue_depth: int
    queue_capacity: int
    in_flight: int
    cpu_percent: float
    memory_rss_mb: float
    finished_edge: int  # jobs answered ok since start, run on the edge
    finished_pool: int  # ... run on a pool worker
    policy_version: int | None
    models: tuple[tuple[str, float], ...]  # (model, service ms)


def edge_row(tel: wire.EdgeTelemetry) -> tuple[tuple[object, ...], tuple[object, ...]]:
    """``tel`` as the two flat tuples the view keeps: the row less its models (its last
    field), and the models as (name, service ms, name, service ms...). Flat, because the
    collector stops tracking a tuple of untracked items in one pass, one level of nesting
    a pass."""
    row = (
        tel.node,
        tel.zone,
        tel.ts,
        tel.queue_depth,
        tel.queue_capacity,
        tel.in_flight,
        tel.cpu_percent,
        tel.memory_rss_mb,
        tel.finished.get("edge", 0),
        tel.finished.get("pool", 0),
        tel.policy_version,
    )
    models = tuple([v for name, load in tel.models.items() for v in (name, load.service_ms)])
    return row, models


def _read_row(row: tuple[object, ...], models: tuple[object, ...]) -> EdgeRow:
    pairs = tuple(zip(models[::2], models[1::2], strict=True))
    return EdgeRow._make((*row, pairs))  # the fields in the order edge_row wrote them


class EdgeFleet:
    """The latest telemetry of every edge the policy lists, as this replica heard it."""

    def __init__(
        self,
        policy: Callable[[], Policy | None],
        store: BrokerStore,
        metrics: BrokerMetrics,
        clock: Callable[[], float],
        *,
        interval_s: float,
        idle: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._policy = policy
        # Returns once no placement request waits to be decided or answered (None: at once).
        self._idle = idle or _at_once
        self._store = store
        self._clock = clock
        self.tick_s = min(0.1, interval_s / 10.0)  # how long samples gather before a read
        # Two intervals unread: the sample is older than the next one should already be.
        self.backlog = Backlog(shed_after_s=2.0 * interval_s)
        # Each edge's EdgeRow, as the two flat tuples of edge_row.
        self._rows: dict[str, tuple[object, ...]] = {}
        self._models: dict[str, tuple[object, ...]] = {}
        self._raw: dict[str, bytes] = {}  # each edge's sample as it came (checked JSON)
        self._listed: tuple[bytes, dict[str, str]] = (b"", {})  # policy digest, edge -> zone
        self._wanted = asyncio.Event()
        self._counted = (0, 0)  # the backlog's coalesced and shed, as last counted
        outcomes = ("read", "coalesced", "shed", "ignored", "malformed")
        self._outcome = {o: metrics.telemetry.labels(o) for o in outcomes}
        self._backlog_age = metrics.telemetry_backlog

    def offer(self, msg: Message) -> None:
        """The MQTT handler: keep the payload as its node's latest unread sample."""
        self.backlog.offer(topics.node_of(msg.topic), msg.payload, self._clock())
        self._wanted.set()

    async def run(self) -> None:
        """Read the backlog a tick after samples arrive, a slice per turn of the loop."""
        while True:
            await self._wanted.wait()
            await asyncio.sleep(self.tick_s)  # let a tick's samples gather: one batch
            self._wanted.clear()
            self._backlog_age.set(self.backlog.oldest_age(self._clock()))
            while len(self.backlog):
                await self._idle()  # never between a request and its answer
                self.read(SLICE)
                await asyncio.sleep(0)  # urgent work that arrived meanwhile goes first
            self._count()
            self._store.flush_nodes()

    def read(self, most: int) -> int:
        """Read up to ``most`` unread samples now; how many were kept."""
        taken = self.backlog.take(most, self._clock())
        listed = self._edges_listed()
        kept = 0
        for node, payload in taken.samples:
            if node not in listed:
                self._outcome["ignored"].inc()
                continue
            try:
                tel = wire.EdgeTelemetry.model_validate_json(payload)
            except ValidationError as exc:
                self._outcome["malformed"].inc()
                log.warning("ignored malformed telemetry from edge %s: %s", node, str(exc)[:300])
                continue
            if tel.node != node:  # about another node: only that node speaks for itself
                self._outcome["ignored"].inc()
                continue
            self._rows[node], self._models[node] = edge_row(tel)
            self._raw[node] = payload
            self._store.node_document(node, "telemetry", payload)
            kept += 1
        self._outcome["read"].inc(kept)
        return kept

    @property
    def edges(self) -> dict[str, EdgeRow]:
        """Each listed edge's latest sample, as read now."""
        models = self._models
        return {node: _read_row(row, models[node]) for node, row in self._rows.items()}

    def zone_of(self, node: str) -> str | None:
        """The zone the policy in force gives edge ``node`` (None: not listed)."""
        return self._edges_listed().get(node)

    def page(
        self, *, zone: str = "", after: str = "", limit: int
    ) -> tuple[list[bytes], int, str | None]:
        """Edges in id order after ``after``, in zones under ``zone``: up to ``limit`` of
        them, each a JSON object (its telemetry as the edge sent it, which was checked
        against ``EdgeTelemetry`` and holds no other field, with the policy's zone as
        ``policy_zone``), how many match in all, and the id to ask ``after`` for the next
        page (None: this is the last). No sample is decoded or encoded again: a page of
        1,000 edges took 80 ms of the loop that way (``model_dump`` and ``json.dumps``)."""
        listed = self._edges_listed()
        ids = sorted(n for n in self._rows if listed.get(n, "").startswith(zone))
        start = bisect.bisect_right(ids, after) if after else 0
        chosen = ids[start : start + limit]
        rows = [_with_zone(self._raw[n], listed[n]) for n in chosen]
        more = start + limit < len(ids)
        return rows, len(ids), (chosen[-1] if more and chosen else None)

    def _edges_listed(self) -> dict[str, str]:
        """The edges the policy in force lists, with their zones; the view forgets any it
        stopped listing."""
        policy = self._policy()
        if policy is None:
            return {}
        if self._listed[0] != policy.digest:
            listed = {e.edge_id: e.zone for e in policy.edges}
            self._listed = (policy.digest, listed)
            for gone in [n for n in self._rows if n not in listed]:
                del self._rows[gone]
                del self._models[gone]
                del self._raw[gone]
        return self._listed[1]

    def _count(self) -> None:
        coalesced, shed = self.backlog.coalesced, self.backlog.shed
        self._outcome["coalesced"].inc(coalesced - self._counted[0])
        self._outcome["shed"].inc(shed - self._counted[1])
        self._counted = (coalesced, shed)


async def _at_once() -> None:
    return None


def _with_zone(sample: bytes, zone: str) -> bytes:
    """A checked sample's JSON object with ``"policy_zone"`` added as its last member."""
    body = sample.rstrip()
    return body[:-1] + b',"policy_zone":' + json.dumps(zone).encode() + b"}"
