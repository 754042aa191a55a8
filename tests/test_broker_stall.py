"""A worker that stops progressing, seen by a real broker process (Mosquitto, Redis): the
broker takes it out of placement at the first overdue job, hands its held job back to the
edge through the lost-worker path, and puts it back at its next completion.

The workers are played by the integration module's publishers (capabilities, telemetry);
here one of them also answers a completion, as a thawed worker would."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from sluicegate import topics, wire
from sluicegate.app.campus import Campus
from sluicegate.app.servers import ServerProcess, free_port
from sluicegate.config import Settings, load_settings
from sluicegate.wire_pool import JobNotice
from tests.support import PlainClient, ServiceThread, wait_until
from tests.test_broker_core_kit import completion
from tests.test_broker_integration import (  # noqa: F401  (fixtures)
    EDGE,
    WORKERS,
    Fleet,
    ask,
    campus,
    campus_redis,
    fleet,
    http,
    serving,
)


@pytest.fixture(scope="module")
def broker(campus: Campus) -> Iterator[tuple[ServiceThread, Settings]]:  # noqa: F811
    """A replica with the progress watch as shipped (its default settings)."""
    settings = load_settings(
        campus.node_config("broker-1"),
        broker={"http_port": free_port(), "models_dir": str(campus.root / "models")},
    )
    thread = serving(settings)
    yield thread, settings
    thread.stop()


def metric(settings: Settings, name: str) -> float:
    """A counter's value on the broker's /metrics (0 when not there yet)."""
    for line in http(settings, "/metrics")[1].splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_worker_that_completes_nothing_is_taken_out_and_its_job_handed_back(
    broker: tuple[ServiceThread, Settings],
    fleet: Fleet,  # noqa: F811
    mosquitto: ServerProcess,
) -> None:
    _thread, settings = broker
    for worker in WORKERS:
        fleet.capabilities(worker, providers=["CPUExecutionProvider"])
        if worker != "north-a":
            fleet.telemetry(worker, queue=16, capacity=16)  # full: north-a is the only room
    fleet.telemetry("north-a")
    wait_until(lambda: all(w["online"] for w in http(settings, "/fleet")[1]["workers"]), timeout=15)
    edge = PlainClient(mosquitto.port)
    edge.subscribe(topics.edge_notices(EDGE))
    placed = ask(mosquitto)
    assert placed.worker_id == "north-a"
    # North-a takes the job and completes nothing (a SIGSTOP, a hung driver). At the first
    # overdue job the broker places nothing more there; everyone else is full.
    wait_until(lambda: metric(settings, "sluicegate_worker_suspicions_total") >= 1, timeout=10)
    refused = ask(mosquitto)
    assert refused.status == "refused", refused
    # Silent on: stalled. Its job goes back to the edge as a lost worker's, to be placed
    # again as the next attempt, long before its telemetry (1 s, 3 intervals) goes stale.
    stalled_at = time.monotonic()
    notice = JobNotice.model_validate_json(edge.next(timeout=10).payload)
    assert (notice.job_id, notice.kind, notice.worker_id) == (
        placed.job_id,
        "worker_lost",
        "north-a",
    )
    assert notice.attempt == 1
    assert "completed nothing while holding work" in notice.reason
    assert time.monotonic() - stalled_at < 3 * settings.broker.telemetry_interval_s
    assert metric(settings, 'sluicegate_worker_losses_total{cause="stalled"}') == 1
    workers = {w["id"]: w for w in http(settings, "/fleet")[1]["workers"]}
    assert not workers["north-a"]["online"]
    # It thaws and answers the stale attempt: alive again, placeable at once.
    done = completion(placed.job_id, "north-a", 5.0)
    fleet.client.client.publish(topics.completion("north-a"), wire.dump(done), qos=1)
    wait_until(
        lambda: {w["id"]: w for w in http(settings, "/fleet")[1]["workers"]}["north-a"]["online"],
        timeout=10,
    )
    assert ask(mosquitto).worker_id == "north-a"
    edge.close()
