"""Pure-core tier: the clocks the edge's lifecycle keeps for each job (how long it waited
for the broker's placement answers, how long its work was out on workers), and the result
document they end up in, so an app can tell where a missed job's time went."""

from __future__ import annotations

import pytest

from edge_agent import events as ev
from edge_agent.admission import Job
from edge_agent.answers import local_result
from edge_agent.events import Life
from edge_agent.lifecycle import ASKING, AWAY, transition, waiting_on
from edge_agent.rules import Declined, Outlook, Placement
from sluicegate import wire
from sluicegate.vision.image import ImageInfo

T0 = 1_000.0
DEADLINE = T0 + 0.2
PLACED = Placement("w1", "campus/dc", "work/w1", "tok", b"")
FULL = Declined("no_capacity", "every worker is full")
LATE_HERE = Outlook("edge-1", True, T0 + 9.0, 3, 0, 4, 3, 3.0)  # offer it
ON_TIME = Outlook("edge-1", True, T0 + 0.01, 0, 32, 4, 3, 3.0)  # run it here
RETRY = LATE_HERE._replace(max_attempts=4)

Step = tuple[float, ev.Event, Outlook]  # seconds after T0, the event, the outlook then


def _run(steps: list[Step], deadline: float | None = DEADLINE) -> Life:
    life = Life("j1", deadline)
    for at, event, outlook in steps:
        life, _ = transition(life, event, T0 + at, outlook)
    return life


CASES: list[tuple[str, list[Step], str, float | None, float | None]] = [
    # name, steps, phase after, placement ms, offloaded ms (None: no reason to stamp)
    (
        "never asked: nothing to stamp",
        [(0.0, ev.Admit(False), ON_TIME), (0.005, ev.Accepted(), ON_TIME)],
        "queued",
        None,
        None,
    ),
    (
        "asked ahead, declined during the commit, expired in the queue",
        [
            (0.0, ev.Admit(False, "deadline"), LATE_HERE),
            (0.030, ev.Answered(1, FULL), LATE_HERE),
            (0.040, ev.Accepted(), LATE_HERE),
            (0.250, ev.Start(), LATE_HERE),
        ],
        "finishing",
        30.0,
        0.0,
    ),
    (
        "offered after its commit, placed, no return by its deadline",
        [
            (0.0, ev.Admit(False), LATE_HERE),
            (0.010, ev.Accepted(), LATE_HERE),
            (0.050, ev.Answered(1, PLACED), LATE_HERE),
            (0.200, ev.Overdue(), LATE_HERE),
        ],
        "finishing",
        40.0,
        150.0,
    ),
    (
        "placed ahead and sent before the commit: out from the send",
        [
            (0.0, ev.Admit(False, "deadline"), LATE_HERE),
            (0.020, ev.Answered(1, PLACED), LATE_HERE),
            (0.035, ev.Accepted(), LATE_HERE),
            (0.200, ev.Overdue(), LATE_HERE),
        ],
        "finishing",
        20.0,
        180.0,
    ),
    (
        "two attempts lost, then run here: both clocks summed",
        [
            (0.0, ev.Admit(False, "deadline"), RETRY),
            (0.010, ev.Accepted(), RETRY),
            (0.030, ev.Answered(1, PLACED), RETRY),
            (0.080, ev.WorkerLost(1, "gone"), RETRY),
            (0.090, ev.Answered(2, PLACED), RETRY),
            (0.100, ev.Returned(2, "w1", Declined("model_version", "other file")), RETRY),
            (0.150, ev.Start(), RETRY),
            (0.151, ev.RunCounted(1), RETRY),
            (0.180, ev.RunDone("ok"), RETRY),
        ],
        "finishing",
        40.0,  # 30 ms for attempt 1 (asked while committing, answered after), 10 for 2
        60.0,  # 50 ms on attempt 1's worker, 10 ms on attempt 2's
    ),
]


@pytest.mark.parametrize(
    ("name", "steps", "phase", "asked", "away"), CASES, ids=[c[0] for c in CASES]
)
def test_a_job_concluding_here_carries_its_time_asking_and_away(
    name: str, steps: list[Step], phase: str, asked: float | None, away: float | None
) -> None:
    life = _run(steps)
    assert life.phase == phase
    if asked is None:
        assert life.declined is None
        return
    assert life.declined is not None
    assert life.declined.asked_ms == pytest.approx(asked)
    assert life.declined.away_ms == pytest.approx(away)


@pytest.mark.parametrize(
    ("life", "waits"),
    [
        (Life("j", None, "offering", asking=1), ASKING),
        (Life("j", None, "admitting", asking=1), ASKING),  # its answer still to come
        (Life("j", None, "admitting", asking=1, ahead=PLACED, early=True), AWAY),
        (Life("j", None, "admitting", asking=1, ahead=PLACED), 0),  # placed, not sent yet
        (Life("j", None, "admitting", asking=1, ahead=FULL), 0),
        (Life("j", None, "offloaded", attempt=1), AWAY),
        (Life("j", None, "queued", attempt=1), 0),  # rerouted: its return may still come
        (Life("j", None, "running"), 0),
    ],
)
def test_what_a_job_waits_on(life: Life, waits: int) -> None:
    assert waiting_on(life) == waits


def _job() -> Job:
    image = ImageInfo("jpeg", 640, 480)
    return Job("j1", "surface-det", b"", image, "app/r", None, 5, "part-image", T0, DEADLINE)


EDGE = wire.RanOn(kind="edge", node="edge-1", zone="campus/line-1")


@pytest.mark.parametrize(
    ("declined", "placed_on", "placement", "offloaded"),
    [
        (None, None, None, None),  # never asked: neither field
        (FULL.timed(0.03, 0.0), None, 30.0, None),  # asked, declined: no time on workers
        (Declined("result_timeout", "x").timed(0.04, 0.15), "w1", 40.0, 150.0),
    ],
)
def test_the_result_document_carries_the_stamped_times(
    declined: Declined | None,
    placed_on: str | None,
    placement: float | None,
    offloaded: float | None,
) -> None:
    result = local_result(
        _job(), "expired", ran_on=EDGE, now=T0 + 0.25, declined=declined, placed_on=placed_on
    )
    assert result.timings_ms.queue_ms == pytest.approx(250.0)
    assert result.timings_ms.placement_ms == placement
    assert result.timings_ms.offloaded_ms == offloaded
    doc = wire.dump(result)
    assert (b'"placement_ms"' in doc) is (placement is not None)  # absent, not null
    assert wire.JobResult.model_validate_json(doc) == result
