"""The broker's view of the edges' telemetry (``broker.edge_fleet``): what it keeps of a
sample, that a newer one replaces it, and that a sample from a node the policy does not
list as an edge, or about another node, changes nothing. No I/O: the node documents wait
in the store's queue, which these tests never flush."""

from __future__ import annotations

import gc

import pytest

from broker.edge_fleet import EdgeFleet, EdgeRow
from broker.metrics import BrokerMetrics
from broker.store import BrokerStore
from sluicegate import topics, wire
from sluicegate.transport import Message
from tests.pool_kit import EDGE, ORIGIN, POLICY, SPARE_EDGES


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
