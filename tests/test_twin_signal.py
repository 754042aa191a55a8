"""The twin replays announced work from the trace: the scaling signal it computes with the
broker's code rises ahead of an announced burst, and the placements stay as they were."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from sluicegate.app.twin_demo import demo_trace
from sluicegate.twin.nodes import Change, Result
from sluicegate.twin.sim import digest_of, replay
from sluicegate.twin.trace import AnnouncedRecord, Trace, read, write
from sluicegate.wire import Announced

BURST_AT = 20.0  # s into the trace


def _trace() -> Trace:
    return demo_trace(26.0, rate=4.0, bursts=((BURST_AT, 4.0),), seed=11)


def _announced(trace: Trace, *, at: float = 2.0) -> Trace:
    start = trace.header.started_at + BURST_AT
    window = Announced(
        announcement_id="batch-7",
        starts_at=start,
        ends_at=start + 4.0,
        rate_per_s=40.0,
        model="surface-det",
        data_class="part-image",
        local_per_s=5.0,
        reason="recipe change",
    )
    cleared = AnnouncedRecord(at=BURST_AT + 4.5, edge="line-1-pc")
    booked = AnnouncedRecord(at=at, edge="line-1-pc", windows=[window])
    return replace(trace, announced=(booked, cleared))


def _before_burst(trace: Trace, pool: str) -> tuple[int, float]:
    """The pool's desired workers and announced jobs/s at the last reading before the burst."""
    readings = replay(trace).signal[pool]
    last = [r for r in readings if r.at < BURST_AT][-1]
    return last.desired_workers, last.announced_jobs_s


def test_an_announced_window_leads_the_replayed_signal_and_places_nothing_differently() -> None:
    plain, told = _trace(), _announced(_trace())
    pools = set(replay(plain).signal)
    assert pools, "the replay computed no signal"
    ahead = {p: _before_burst(told, p) for p in pools}
    quiet = {p: _before_burst(plain, p) for p in pools}
    # part-image may go to both pools: the overflow (35 jobs/s) is split between them
    assert sum(a for _, a in ahead.values()) == 35.0
    assert all(a == 0.0 for _, a in quiet.values())
    assert all(ahead[p][0] >= quiet[p][0] for p in pools)
    assert any(ahead[p][0] > quiet[p][0] for p in pools)
    assert digest_of(replay(told)) == digest_of(replay(plain))


def test_a_cleared_book_stops_counting() -> None:
    told = _announced(_trace())
    after = [r for rs in replay(told).signal.values() for r in rs if r.at > BURST_AT + 4.5]
    assert after
    assert all(r.announced_jobs_s == 0.0 for r in after)


def test_announced_records_survive_the_trace_file(tmp_path: Path) -> None:
    told = _announced(_trace())
    path = tmp_path / "t.jsonl.gz"
    digest = write(path, told)
    back, again = read(path)
    assert again == digest
    assert back.announced == told.announced
    assert back.announced[0].windows[0].reason == "recipe change"


def test_a_burst_turned_away_for_want_of_a_worker_raises_the_signal_it_could_not_place() -> None:
    trace = _trace()
    gone = Change(fail=tuple((w.id, 1.0) for w in trace.header.workers))  # all lost at 1 s
    lost, kept = replay(trace, gone), replay(trace)
    assert lost.refusals.get("no_worker", 0) > 0

    def peak(result: Result) -> dict[str, int]:
        return {
            pool: max(r.desired_workers for r in readings if r.at >= BURST_AT)
            for pool, readings in result.signal.items()
        }

    # No worker was there to place the burst on, yet each pool the burst's images may reach is
    # asked for, as much as when its workers were there to take them.
    assert all(n >= 1 for n in peak(lost).values())
    assert set(peak(lost)) == set(peak(kept))
