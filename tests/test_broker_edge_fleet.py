"""The broker's view of the edges' telemetry (``broker.edge_fleet``): what it keeps of a
sample, that a newer one replaces it, and that a sample from a node the policy does not
list as an edge, or about another node, changes nothing, and that the view reads only while
no placement request waits in the placer's inbox (``broker.inbox``). No I/O: the node
documents wait in the store's queue, which these tests never flush."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time

import pytest

from broker.edge_fleet import EdgeFleet, EdgeRow
from broker.inbox import Inbox
from broker.metrics import BrokerMetrics
from broker.store import BrokerStore
from broker.waiting_room import Pending
from sluicegate import topics, wire
from sluicegate.transport import Message
from tests.pool_kit import EDGE, ORIGIN, POLICY, SPARE_EDGES
from tests.support import live_request


def sample(node: str = EDGE, **fields: object) -> wire.EdgeTelemetry:
    base: dict[str, object] = {
        "node": node,
        "zone": ORIGIN,
        "ts": 1000.0,
        "queue_depth": 3,
        "queue_capacity": 64,
        "in_flight": 1,
        "concurrency": 2,
        "models": {"defect-v1": wire.ModelLoad(service_ms=12.5, completed=9)},
        "cpu_percent": 41.0,
        "memory_rss_mb": 310.0,
        "memory_percent": 2.0,
        "results": {"ok": 9},
        "dropped_no_response_topic": 0,
        "finished": {"edge": 7, "pool": 2},
        "policy_version": POLICY.version,
    }
    return wire.EdgeTelemetry.model_validate(base | fields)


@pytest.fixture
def view() -> EdgeFleet:
    store = BrokerStore(None, node_ttl_ms=30_000)  # type: ignore[arg-type]  # never flushed
    return EdgeFleet(lambda: POLICY, store, BrokerMetrics(), lambda: 1000.0, interval_s=1.0)


def offer(view: EdgeFleet, tel: wire.EdgeTelemetry, *, sender: str | None = None) -> int:
    view.offer(Message(topics.edge_telemetry(sender or tel.node), wire.dump(tel)))
    return view.read(64)


def test_the_view_keeps_what_the_console_and_metrics_read(view: EdgeFleet) -> None:
    assert offer(view, sample()) == 1
    assert view.edges == {
        EDGE: EdgeRow(
            node=EDGE,
            zone=ORIGIN,
            ts=1000.0,
            queue_depth=3,
            queue_capacity=64,
            in_flight=1,
            cpu_percent=41.0,
            memory_rss_mb=310.0,
            models=(("defect-v1", 12.5),),
            finished_edge=7,
            finished_pool=2,
            policy_version=POLICY.version,
        )
    }
    assert offer(view, sample(queue_depth=9, finished={"edge": 8})) == 1
    row = view.edges[EDGE]
    assert (row.queue_depth, row.finished_edge, row.finished_pool) == (9, 8, 0)


def test_samples_of_unlisted_nodes_or_about_another_node_change_nothing(
    view: EdgeFleet,
) -> None:
    assert offer(view, sample("not-in-policy")) == 0
    assert offer(view, sample(SPARE_EDGES[0]), sender=SPARE_EDGES[1]) == 0
    assert view.edges == {}


def test_what_the_view_keeps_leaves_the_garbage_collector_nothing_to_trace(
    view: EdgeFleet,
) -> None:
    """Thousands of edges replacing their samples every second must not leave the cyclic
    collector thousands of objects to trace (pauses of tens of ms on the loop): a decoded
    sample is a score of tracked objects, what the view keeps of one none."""
    offer(view, sample())  # the view's own first-use state (the policy's edge list)
    gc.collect()
    before = len(gc.get_objects())
    for edge in SPARE_EDGES:
        assert offer(view, sample(edge)) == 1
    gc.collect()
    assert len(gc.get_objects()) - before < len(SPARE_EDGES)
    assert set(view.edges) == {EDGE, *SPARE_EDGES}


def _pending(job_id: str) -> Pending:
    return Pending(live_request(EDGE, job_id), "reply", None, 0.0)


async def test_the_inbox_is_busy_from_a_requests_arrival_until_its_batch_is_answered() -> None:
    inbox = Inbox()
    await asyncio.wait_for(inbox.idle(), 1)  # nothing has arrived: idle at once
    inbox.put(_pending("a"))
    inbox.put(_pending("b"))
    assert inbox.busy
    batch = await inbox.batch()
    assert [p.request.job_id for p in batch] == ["a", "b"]
    assert inbox.busy  # taken, not answered yet
    inbox.put(_pending("c"))  # arrived while the batch was being placed
    inbox.done()
    assert inbox.busy  # "c" still waits
    assert [p.request.job_id for p in await inbox.batch()] == ["c"]
    inbox.done()
    assert not inbox.busy
    await asyncio.wait_for(inbox.idle(), 1)


async def test_the_edges_telemetry_is_read_only_while_no_placement_request_waits() -> None:
    inbox = Inbox()
    wants, passed = asyncio.Event(), asyncio.Event()

    async def idle() -> None:  # the inbox's, marking when the view asks and when it may go
        wants.set()
        await inbox.idle()
        passed.set()  # the view reads its slice now, before it yields again

    store = BrokerStore(None, node_ttl_ms=30_000)  # type: ignore[arg-type]  # never flushed
    view = EdgeFleet(lambda: POLICY, store, BrokerMetrics(), time.time, interval_s=0.01, idle=idle)
    inbox.put(_pending("urgent"))
    reader = asyncio.create_task(view.run())
    view.offer(Message(topics.edge_telemetry(EDGE), wire.dump(sample())))
    await asyncio.wait_for(wants.wait(), 5)  # a tick passed; the request still waits
    assert (len(view.backlog), view.edges, passed.is_set()) == (1, {}, False)
    await inbox.batch()
    inbox.done()  # answered: the view reads what waited
    await asyncio.wait_for(passed.wait(), 5)
    assert (len(view.backlog), list(view.edges)) == (0, [EDGE])
    reader.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reader
