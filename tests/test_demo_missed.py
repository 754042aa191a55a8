"""Pure tier: where a missed job's time went (``sluicegate.app.missed``), told from the
result documents the demo's apps receive, and the live view's words for it."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from sluicegate import wire
from sluicegate.app.demo import render
from sluicegate.app.missed import PARTS, Missed, Misses, Part, missed, shares, split, summary
from sluicegate.app.traffic import LABELS, WAFERS, Sample, Tally

EDGE = wire.RanOn(kind="edge", node="line-1-pc", zone="campus/fab-north/line-1")
POOL = wire.RanOn(kind="pool", node="north-cpu-1", zone="campus/fab-north/dc")
ASKED = wire.Offload(requested=True, placed=False, code="no_capacity", reason="full")
LOST = wire.Offload(requested=True, placed=True, worker="north-cpu-1", code="result_timeout")
PLACED = wire.Offload(requested=True, placed=True, worker="north-cpu-1")


def _doc(
    status: wire.Status,
    ran_on: wire.RanOn = EDGE,
    offload: wire.Offload | None = None,
    **ms: float,
) -> wire.JobResult:
    outputs = wire.Outputs(scores={}) if status == "ok" else None
    code = None if status == "ok" else status
    return wire.JobResult(
        job_id="j1",
        status=status,
        code=code,
        outputs=outputs,
        ran_on=ran_on,
        timings_ms=wire.Timings(**ms),
        offload=offload,
    )


CASES = [
    # name, document, ms the app measured, deadline, (part, ms) or None
    ("in time", _doc("ok", queue_ms=20, total_ms=60), 70.0, 200.0, None),
    ("refused: wrong, not late", _doc("rejected", total_ms=1), 300.0, 200.0, None),
    ("failed: wrong, not late", _doc("failed", queue_ms=5, total_ms=9), 300.0, 200.0, None),
    (
        "expired in the line PC's queue, never asked",
        _doc("expired", queue_ms=230, total_ms=230),
        240.0,
        200.0,
        ("line_pc", 230.0),
    ),
    (
        "asked, declined, expired in the queue",
        _doc("expired", offload=ASKED, queue_ms=220, total_ms=220, placement_ms=40),
        230.0,
        200.0,
        ("line_pc", 180.0),
    ),
    (
        "the broker's answers took most of it",
        _doc("expired", offload=ASKED, queue_ms=210, total_ms=210, placement_ms=150),
        215.0,
        200.0,
        ("placement", 150.0),
    ),
    (
        "placed, no return by the deadline",
        _doc(
            "expired", offload=LOST, queue_ms=215, total_ms=215, placement_ms=25, offloaded_ms=185
        ),
        225.0,
        200.0,
        ("worker", 185.0),
    ),
    (
        "an older edge's expired offload: no clocks, all counted queued",
        _doc("expired", offload=LOST, queue_ms=215, total_ms=215),
        225.0,
        200.0,
        ("line_pc", 215.0),
    ),
    (
        "ran here, late: the run was the longest part",
        _doc("ok", queue_ms=90, decode_ms=2, inference_ms=120, total_ms=215),
        230.0,
        200.0,
        ("compute", 125.0),
    ),
    (
        "answered in time by the edge, late to the app",
        _doc("ok", queue_ms=10, total_ms=50),
        260.0,
        200.0,
        ("transit", 210.0),
    ),
    (
        "a worker's answer, late: queued on the worker",
        _doc("ok", POOL, PLACED, queue_ms=180, inference_ms=30, total_ms=215),
        260.0,
        200.0,
        ("worker", 180.0),
    ),
    (
        "a worker's expiry: the deadline passed before the job arrived",
        _doc("expired", POOL, PLACED, total_ms=17),
        527.0,
        200.0,
        ("around", 510.0),
    ),
    (
        "a late label, computing on the worker",
        _doc("ok", POOL, PLACED, queue_ms=100, inference_ms=900, total_ms=1010),
        1100.0,
        1000.0,
        ("compute", 910.0),
    ),
]


@pytest.mark.parametrize(
    ("name", "doc", "app_ms", "deadline_ms", "expected"), CASES, ids=[c[0] for c in CASES]
)
def test_where_a_missed_job_s_time_went(
    name: str,
    doc: wire.JobResult,
    app_ms: float,
    deadline_ms: float,
    expected: tuple[str, float] | None,
) -> None:
    miss = missed(doc, app_ms, deadline_ms)
    if expected is None:
        assert miss is None
        return
    assert miss is not None
    assert miss.part == expected[0]
    assert miss.ms == pytest.approx(expected[1])


@pytest.mark.parametrize(("name", "doc", "app_ms", "deadline_ms", "expected"), CASES)
def test_the_parts_never_add_up_to_more_than_the_app_waited(
    name: str,
    doc: wire.JobResult,
    app_ms: float,
    deadline_ms: float,
    expected: tuple[str, float] | None,
) -> None:
    parts = split(doc, app_ms)
    assert set(parts) <= set(PARTS)
    assert all(ms >= 0.0 for ms in parts.values())
    assert sum(parts.values()) <= max(app_ms, doc.timings_ms.total_ms) + 1e-9


def test_a_tie_goes_to_the_earlier_part() -> None:
    doc = _doc("expired", offload=ASKED, queue_ms=200, total_ms=200, placement_ms=100)
    miss = missed(doc, 200.0, 200.0)
    assert miss is not None
    assert (miss.part, miss.ms) == ("line_pc", 100.0)
    assert dict(miss.parts) == {
        "line_pc": 100.0,
        "placement": 100.0,
        "worker": 0.0,
        "compute": 0.0,
        "transit": 0.0,
    }


def test_the_shares_add_up_every_part_of_every_missed_job_largest_first() -> None:
    """A placement's wait that is never a job's largest part still shows in the shares."""
    kept = Misses()
    assert shares(kept) == ""
    for _ in range(3):
        kept.add(Missed("worker", 150.0, {"worker": 150.0, "placement": 45.0, "line_pc": 5.0}))
    kept.add(Missed("transit", 10.0, {"transit": 10.0, "compute": 1.0}))
    assert shares(kept) == (
        "their time: 74% on the worker, 22% waited for a placement, 2% queued on the line PC"
        ", 2% in transit"  # computing, at 0.2%, left out
    )


@pytest.mark.parametrize(
    ("misses", "answered", "text"),
    [
        ([], 0, "missed 0 of 0"),
        ([], 300, "missed 0 of 300 (0.0%)"),
        (
            [("line_pc", 150.0), ("line_pc", 180.0), ("line_pc", 250.0), ("placement", 60.0)],
            100,
            "missed 4 of 100 (4.0%): 3 queued on the line PC (p50 180 ms), "
            "1 waited for a placement (p50 60 ms), 0 on the worker",
        ),
        (
            [("worker", 190.0), ("transit", 30.0), ("worker", 170.0)],
            50,
            "missed 3 of 50 (6.0%): 0 queued on the line PC, 0 waited for a placement, "
            "2 on the worker (p50 180 ms), 1 in transit (p50 30 ms)",
        ),
    ],
)
def test_the_summary_says_the_headline_parts_always_and_others_once_seen(
    misses: list[tuple[Part, float]], answered: int, text: str
) -> None:
    kept = Misses()
    for part, ms in misses:
        kept.add(Missed(part, ms))
    assert summary(kept, answered) == text


def _screen(tally: Tally) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(render(tally))
    return out.getvalue()


def test_the_live_view_says_where_the_missed_jobs_time_went() -> None:
    tally = Tally()
    wafer = Sample(WAFERS, b"", frozenset())
    label = Sample(LABELS, b"", ("SN 1",))
    read = wire.Outputs(
        scores={}, texts=[wire.TextLine(text="SN1", score=0.9, box=(0, 0, 1, 1), quad=[(0, 0)])]
    )
    for ms in (230.0, 250.0):  # two wafers expired in line 1's queue
        tally.record("line-1-pc", wafer, _doc("expired", queue_ms=ms, total_ms=ms), ms + 5)
    lost = _doc(
        "expired", offload=LOST, queue_ms=210, total_ms=210, placement_ms=20, offloaded_ms=185
    )
    tally.record("line-1-pc", wafer, lost, 215.0)  # out on a worker past its deadline
    tally.record("line-2-pc", wafer, _doc("ok", queue_ms=5, total_ms=40), 45.0)  # in time
    ok_label = _doc("ok", queue_ms=100, inference_ms=400, total_ms=520)
    tally.record("line-2-pc", label, ok_label.model_copy(update={"outputs": read}), 540.0)

    screen = _screen(tally)

    assert "where the missed jobs' time went" in screen
    said = [line.strip("│ ") for line in screen.splitlines()]
    said = [line for line in said if re.match(r"(\w+ +missed |their time)", line)]
    assert said == [
        "wafers missed 3 of 4 (75.0%): 2 queued on the line PC (p50 240 ms), 0 waited for a "
        "placement, 1 on the worker (p50 185 ms)",
        "their time: 69% queued on the line PC, 26% on the worker, 3% waited for a placement"
        ", 2% in transit",
        "parts  missed 0 of 0",
        "labels missed 0 of 1 (0.0%)",
    ]
