"""The twin's replay: deterministic, built on the production decision code (a change to one
of those functions changes what the twin says), every arrival ending in one outcome, and
each kind of change doing what it says. Runs on the synthetic demo-campus trace and on a
trace read back from a file; no campus is started."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

import broker.core.batch
import center_pool.batching
import edge_agent.lifecycle
import edge_agent.rules
import edge_agent.sequencer
from broker.core.decision import Candidates, Refused
from broker.core.params import PlacementParams
from edge_agent import events as ev
from edge_agent.events import Life, Move, Phase, Rule
from edge_agent.rules import Declined, Outlook
from policies.loader import parse_policy
from sluicegate.app.twin_demo import demo_policy, demo_trace
from sluicegate.twin import campus_broker, events, trace
from sluicegate.twin.draws import Draws
from sluicegate.twin.report import compare, render, strategy_table, summarise
from sluicegate.twin.sim import STRATEGIES, Change, Result, digest_of, replay
from sluicegate.twin.trace import JobRecord, TraceError

BURSTS = ((3.0, 4.0),)


@pytest.fixture(scope="module")
def demo() -> trace.Trace:
    return demo_trace(12.0, bursts=BURSTS)


def _ids(result: Result) -> list[str]:
    return [o.job_id for o in result.outcomes]


def test_the_same_trace_change_and_seed_give_the_same_report(demo: trace.Trace) -> None:
    change = Change(burst=2, fail=(("north-cpu-1", 5.0),))
    first = compare(replay(demo), replay(demo, change))
    second = compare(replay(demo), replay(demo, change))
    assert first.to_json() == second.to_json()
    assert render(first) == render(second)


def test_a_trace_read_back_from_its_file_replays_the_same(
    demo: trace.Trace, tmp_path: Path
) -> None:
    path = tmp_path / "demo.jsonl.gz"
    written = trace.write(path, demo)
    again, digest = trace.read(path)
    assert digest == written
    assert trace.write(tmp_path / "again.jsonl.gz", again) == written
    assert digest_of(replay(again, seed=3)) == digest_of(replay(demo, seed=3))


def test_every_arrival_ends_in_exactly_one_outcome(demo: trace.Trace) -> None:
    result = replay(demo, Change(burst=5, fail=(("north-cpu-1", 4.0),)))
    ids = _ids(result)
    assert len(ids) == len(set(ids)) == 5 * len(demo.jobs)
    assert {o.status for o in result.outcomes} <= {"ok", "expired", "rejected"}


def test_the_twin_runs_the_production_sequencing_not_a_copy() -> None:
    # The very objects the edge agent, the broker and the worker run; the replay's own
    # module calls no edge rule and no lifecycle move of its own.
    names = vars(events) | vars(campus_broker)
    assert names["Sequencer"] is edge_agent.sequencer.Sequencer
    assert names["decide_turn"] is broker.core.batch.decide_turn
    assert names["settle"] is broker.core.batch.settle
    assert names["Waiting"] is center_pool.batching.Entry
    assert not {"rules", "transition", "decide", "lifecycle"} & set(names)
    assert vars(edge_agent.sequencer)["transition"] is edge_agent.lifecycle.transition


def test_a_patched_lifecycle_table_changes_the_replay(
    demo: trace.Trace, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = summarise(replay(demo))
    assert before.offload_ratio > 0.3
    # The table's rows for the broker's answer: every placement is handed back unused.
    table = edge_agent.lifecycle.TABLE
    keep = Declined("patched", "the patched table keeps every job here")

    def refuse_ahead(life: Life, event: ev.Event, now: float, o: Outlook) -> Move:
        return life._replace(ahead=keep), ()

    def refuse(life: Life, event: ev.Event, now: float, o: Outlook) -> Move:
        after = life._replace(phase="queued", asking=0, declined=keep)
        return after, (ev.Enqueue(),)

    rows: list[tuple[tuple[Phase, type[object]], Rule]] = [
        (("admitting", ev.Answered), refuse_ahead),
        (("offering", ev.Answered), refuse),
    ]
    for row, rule in rows:
        monkeypatch.setitem(table, row, rule)
    after = summarise(replay(demo))
    assert after.offload_ratio == 0.0
    assert after.attainment < before.attainment


def test_a_patched_broker_turn_changes_the_replay(
    demo: trace.Trace, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert summarise(replay(demo)).offload_ratio > 0.3

    def nobody(fleet: object, request: object, policy: object, **_kw: object) -> Refused:
        return Refused("no_worker", "patched: the broker places nothing", Candidates((), 0, ()))

    monkeypatch.setattr(broker.core.batch, "decide", nobody)
    result = replay(demo)
    assert summarise(result).offload_ratio == 0.0
    assert result.refusals.get("no_worker", 0) > 0


def test_changing_a_production_rule_changes_the_twins_answer(
    demo: trace.Trace, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = summarise(replay(demo))
    assert before.offload_ratio > 0.3
    monkeypatch.setattr(edge_agent.rules, "offer_reason", lambda deadline, outlook: None)
    after = summarise(replay(demo))
    assert after.offload_ratio == 0.0
    assert after.attainment < before.attainment


def test_offloading_beats_the_edges_alone_through_a_burst(demo: trace.Trace) -> None:
    results: dict[str, Result] = {s: replay(demo, Change(strategy=s)) for s in STRATEGIES}
    ours, alone = summarise(results["ours"]), summarise(results["edge-only"])
    assert alone.offload_ratio == 0.0
    assert ours.attainment > alone.attainment + 0.3
    table = strategy_table(results)
    assert [line.split()[0] for line in table.splitlines()[1:]] == list(STRATEGIES)


def test_no_placement_breaks_the_policy_and_wafers_stay_on_campus(demo: trace.Trace) -> None:
    for strategy in STRATEGIES:
        s = summarise(replay(demo, Change(strategy=strategy, burst=2)))
        assert s.violations == 0
        assert not [z for z in s.zones.get("wafer-image", {}) if z.startswith("offsite/")]


def _policy_text(demo: trace.Trace, old: str, new: str) -> str:
    text = demo_policy()  # the policy file of the campus the trace holds
    assert parse_policy(text).digest == trace.policy_of(demo.header).digest
    assert old in text
    return text.replace(old, new)


WAFER_RULE = 'allow = ["campus/**"]\ndeny = ["offsite/**"]'
WAFER_LEAVES = 'allow = ["campus/**", "campus/** -> offsite/cloud-east"]'


def test_a_candidate_policy_that_lets_wafers_leave_shows_them_off_site(
    demo: trace.Trace,
) -> None:
    leaky = parse_policy(_policy_text(demo, WAFER_RULE, WAFER_LEAVES))
    result = replay(demo, Change(policy=leaky, burst=2))
    s = summarise(result)
    assert s.zones["wafer-image"].get("offsite/cloud-east", 0) > 0
    assert s.violations == 0  # the candidate's own policy allows what it did


def test_losing_the_only_campus_pool_keeps_wafers_local(demo: trace.Trace) -> None:
    c = compare(replay(demo), replay(demo, Change(fail=(("north-cpu-1", 0.5),))))
    after = c.candidate
    assert "campus/fab-north/dc" not in {
        z for z, n in after.zones.get("wafer-image", {}).items() if n > 5
    }
    assert after.refusals.get("policy_denied", 0) > 0
    assert after.by_class["wafer-image"] < c.baseline.by_class["wafer-image"]
    assert c.changed > 0


def test_a_removed_worker_gets_nothing_and_an_added_one_takes_work(
    demo: trace.Trace,
) -> None:
    removed = replay(demo, Change(remove=("cloud-cpu-1",)))
    assert "cloud-cpu-1" not in {o.where for o in removed.outcomes}
    spare = demo.header.workers[0].model_copy(update={"id": "north-cpu-2"})
    unlisted = replay(demo, Change(add=(spare,), burst=2))
    assert "north-cpu-2" not in {o.where for o in unlisted.outcomes}
    assert unlisted.warnings == (
        "north-cpu-2 is in no pool of the policy: nothing is placed there",
    )
    key = trace.policy_of(demo.header).worker("north-cpu-1")
    assert key is not None
    listed = _policy_text(
        demo,
        "workers = { north-cpu-1 = ",
        'workers = { north-cpu-2 = "ed25519:' + "A" * 43 + '", north-cpu-1 = ',
    )
    added = replay(demo, Change(policy=parse_policy(listed), add=(spare,), burst=2))
    assert "north-cpu-2" in {o.where for o in added.outcomes}
    assert added.warnings == ()


def test_a_degraded_worker_is_busier_for_the_same_work(demo: trace.Trace) -> None:
    base = summarise(replay(demo, Change(remove=("cloud-cpu-1",))))
    slow = summarise(replay(demo, Change(remove=("cloud-cpu-1",), degrade=(("north-cpu-1", 4.0),))))
    assert slow.utilisation["north-cpu-1"] > 2.0 * base.utilisation["north-cpu-1"]


# -- bad trace files -------------------------------------------------------------------------


def _write_lines(path: Path, lines: list[str]) -> Path:
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")
    return path


def test_a_bad_line_is_named(demo: trace.Trace, tmp_path: Path) -> None:
    header = demo.header.model_dump_json()
    job = demo.jobs[0].model_dump_json()
    path = _write_lines(tmp_path / "t.gz", [header, job, '{"type": "job", "at": -1}'])
    with pytest.raises(TraceError, match="line 3"):
        trace.read(path)


def test_a_trace_without_its_header_first_is_refused(demo: trace.Trace, tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "t.gz", [demo.jobs[0].model_dump_json()])
    with pytest.raises(TraceError, match="starts with its header"):
        trace.read(path)


def test_a_job_at_an_edge_the_header_does_not_list_is_refused(
    demo: trace.Trace, tmp_path: Path
) -> None:
    stray = json.loads(demo.jobs[0].model_dump_json())
    stray["edge"] = "line-9-pc"
    path = _write_lines(tmp_path / "t.gz", [demo.header.model_dump_json(), json.dumps(stray)])
    with pytest.raises(TraceError, match="line-9-pc"):
        trace.read(path)


def test_a_file_that_is_not_gzip_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"type": "header"}\n')
    with pytest.raises(TraceError, match="not a gzip"):
        trace.read(path)


def test_a_policy_that_does_not_parse_is_named(demo: trace.Trace) -> None:
    broken = trace.Trace(demo.header.model_copy(update={"policy": "format = 3"}), demo.jobs)
    with pytest.raises(TraceError, match="policy cannot be read"):
        replay(broken)


def _ran(at: float, job_id: str, batch: int, span: float, worker: str = "north-cpu-1") -> JobRecord:
    return JobRecord(
        at=at,
        edge="line-1-pc",
        job_id=job_id,
        model="surface-det",
        data_class="part-image",
        deadline_ms=200.0,
        bytes=50_000,
        status="ok",
        ran_on=worker,
        offloaded=True,
        worker=worker,
        worker_done_ms=20.0 + span,
        latency_ms=30.0 + span,
        service_ms=span,
        batch=batch,
    )


def test_a_workers_batches_follow_the_shape_and_the_moments_the_trace_measured() -> None:
    # Batches of 1 took 40 ms and of 4 took 70 ms, early on; twice that later (a slow spell).
    early = [_ran(0.1 * i, f"e{i}", 1 if i % 2 else 4, 40.0 if i % 2 else 70.0) for i in range(20)]
    late = [
        _ran(30 + 0.1 * i, f"l{i}", 1 if i % 2 else 4, 80.0 if i % 2 else 140.0) for i in range(20)
    ]
    recorded = trace.Trace(demo_trace(1.0).header, tuple(early + late))
    draws = Draws(recorded, PlacementParams(), seed=1)
    assert draws.pool_batch_ms("x86-cpu-dc", "surface-det", 8, None, at=1.0) == pytest.approx(110.0)
    assert draws.pool_batch_ms("x86-cpu-dc", "surface-det", 1, None, at=31.0) == pytest.approx(80.0)
    # The way there: to when the worker finished, less its wait and its batch.
    assert draws.there_ms("campus/fab-north/line-1", "campus/fab-north/dc", 50_000, 1.0) == 20.0


def _line_job(
    at: float,
    job_id: str,
    deadline_ms: float,
    *,
    accepted_ms: float | None = None,
    data_class: str = "part-image",
) -> JobRecord:
    """An arrival at line-1-pc for the detector (38.8 ms there in the demo's header)."""
    return JobRecord(
        at=at,
        edge="line-1-pc",
        job_id=job_id,
        model="surface-det",
        data_class=data_class,
        deadline_ms=deadline_ms,
        bytes=50_000,
        accepted_ms=accepted_ms,
    )


def test_a_job_offered_while_it_is_admitted_is_not_work_ahead_here() -> None:
    # As the edge counts it (edge_agent.jobs.ahead_kind): "o" cannot meet 20 ms here
    # (38.8 ms a detector image) and is offered at once; "k", a millisecond later with
    # 50 ms, would be late behind it (19.4 + 38.8 ms) but not on its own: it stays here.
    jobs = (
        _line_job(0.0, "o", 20.0, accepted_ms=1.0),
        _line_job(0.001, "k", 50.0, accepted_ms=1.0),
    )
    recorded = trace.Trace(demo_trace(1.0).header, jobs)
    outcomes = {o.job_id: o for o in replay(recorded).outcomes}
    assert outcomes["o"].offloaded
    assert not outcomes["k"].offloaded
    assert outcomes["k"].in_time


def test_a_job_kept_at_intake_is_offered_once_its_commit_shows_it_would_be_late() -> None:
    # As the edge does (lifecycle's rules for Admit and Accepted): the first jobs find the
    # edge's compute slots free and run at once, each run counted in its acceptance commit
    # (150 ms). Job "b", just behind them, would meet its 250 ms here at intake and stays;
    # while its acceptance commits, eight more arrive for the same edge, and routed then,
    # behind them, it would finish past its deadline: it is offered.
    header = demo_trace(1.0).header
    (line,) = [e for e in header.edges if e.id == "line-1-pc"]
    firsts = [
        _line_job(0.0001 * i, f"a{i}", 1000.0, accepted_ms=150.0) for i in range(line.concurrency)
    ]
    second = _line_job(0.001, "b", 250.0, accepted_ms=150.0)
    later = [_line_job(0.01 * (i + 1), f"c{i}", 1000.0, accepted_ms=150.0) for i in range(8)]
    recorded = trace.Trace(header, (*firsts, second, *later))
    outcomes = {o.job_id: o for o in replay(recorded).outcomes}
    assert not any(outcomes[a.job_id].offloaded for a in firsts)
    assert all(outcomes[a.job_id].in_time for a in firsts)
    assert outcomes["b"].offloaded
    assert outcomes["b"].status == "ok"


def test_the_brokers_answer_takes_the_wait_the_trace_measured_and_a_timeout_keeps_the_job() -> None:
    # Line 1's detector jobs (38.8 ms there) with 35 ms deadlines are offered. Where the
    # trace recorded 20 ms waits for their placement answers, they reach the worker that
    # much later. Where it recorded that the edge gave up waiting (broker_timeout), the edge
    # keeps each job at its placement timeout: past its deadline by then, it ends expired
    # on the line PC, as it did live.
    def jobs(wait_ms: float, code: str | None = None) -> tuple[JobRecord, ...]:
        asked = {"placement_ms": wait_ms, "offload_code": code}
        return tuple(_line_job(0.5 * i, f"j{i}", 35.0).model_copy(update=asked) for i in range(6))

    header = demo_trace(1.0).header
    prompt = replay(trace.Trace(header, jobs(0.0))).outcomes
    waited = replay(trace.Trace(header, jobs(20.0))).outcomes
    assert all(o.offloaded and o.in_time for o in waited)
    assert [round(w.latency_ms - p.latency_ms, 3) for p, w in zip(prompt, waited, strict=True)] == [
        20.0
    ] * 6
    # A long wait is not a timeout by itself: the edge had the answer in time.
    assert "broker_timeout" not in replay(trace.Trace(header, jobs(60.0))).refusals
    gave_up = replay(trace.Trace(header, jobs(50.0, "broker_timeout")))
    assert gave_up.refusals == {"broker_timeout": 6}
    assert [(o.offloaded, o.status) for o in gave_up.outcomes] == [(False, "expired")] * 6


def test_an_edges_estimate_learns_from_the_compute_the_agent_measures_not_the_thread_time() -> None:
    # Ten detector jobs ran on line 1, 100 ms each on a compute thread; the agent measured
    # 40 ms of it as compute (the rest: the thread waiting for a share of a slow CPU), and
    # its service-time estimate learns that. A job with an 80 ms deadline then looks in
    # time here and stays, as it did live; traces without the figure learn the 100 ms.
    def jobs(device_ms: float | None) -> tuple[JobRecord, ...]:
        ran = {"status": "ok", "ran_on": "line-1-pc", "service_ms": 100.0, "device_ms": device_ms}
        trained = [_line_job(0.3 * i, f"t{i}", 10_000.0).model_copy(update=ran) for i in range(10)]
        return (*trained, _line_job(3.5, "k", 80.0).model_copy(update=ran))

    header = demo_trace(1.0).header
    measured = {o.job_id: o for o in replay(trace.Trace(header, jobs(40.0))).outcomes}
    assert measured["k"].where == "line-1-pc"
    assert not measured["k"].in_time  # 100 ms on the thread, as it was
    unmeasured = {o.job_id: o for o in replay(trace.Trace(header, jobs(None))).outcomes}
    assert unmeasured["k"].offloaded


def test_a_request_that_finds_every_worker_full_waits_in_the_brokers_waiting_room() -> None:
    # One campus worker that holds two jobs; three wafer images arrive at once, each late
    # if run on its line PC. The third finds the worker full: the broker holds it (25 ms at
    # most, half the edge's placement timeout) and places it when the first completes.
    header = demo_trace(1.0).header
    (north,) = [w for w in header.workers if w.id == "north-cpu-1"]
    small = north.model_copy(
        update={"capacity": 1, "max_batch": 1, "concurrency": 1, "service_ms": {"surface-det": 8.0}}
    )
    header = header.model_copy(update={"workers": [small]})
    jobs = tuple(_line_job(0.001 * i, f"w{i}", 35.0, data_class="wafer-image") for i in range(3))
    result = replay(trace.Trace(header, jobs))
    outcomes = {o.job_id: o for o in result.outcomes}
    assert all(outcomes[f"w{i}"].offloaded for i in range(3)), outcomes
    assert "no_capacity" not in result.refusals


def test_a_recorded_job_replays_with_its_own_figures_and_a_bursts_copy_draws() -> None:
    # Six jobs a second apart ran on line 1, each with its own acceptance commit, compute
    # and commit after: replayed as recorded, each takes exactly what it took live. Their
    # copies under a 2x burst draw among those figures instead.
    def ran(i: int) -> JobRecord:
        accepted, compute, after = 2.0 + i, 20.0 + 10.0 * i, 3.0 + 2.0 * i
        return _line_job(1.0 * i, f"j{i}", 5000.0, accepted_ms=accepted).model_copy(
            update={
                "status": "ok",
                "ran_on": "line-1-pc",
                "queue_ms": accepted,  # a run starts once its acceptance is committed
                "service_ms": compute,
                "device_ms": compute,
                "latency_ms": accepted + compute + after,
            }
        )

    jobs = tuple(ran(i) for i in range(6))
    recorded = trace.Trace(demo_trace(1.0).header, jobs)
    latency = {o.job_id: o.latency_ms for o in replay(recorded).outcomes}
    assert latency == {j.job_id: pytest.approx(j.latency_ms) for j in jobs}
    burst = {o.job_id: o.latency_ms for o in replay(recorded, Change(burst=2)).outcomes}
    assert {k: v for k, v in burst.items() if "#" not in k} == latency
    copies = [v for k, v in burst.items() if "#" in k]
    assert len(copies) == 6
    assert copies != [latency[f"j{i}"] for i in range(6)]


def test_a_jobs_latency_counts_from_its_apps_send_where_the_trace_recorded_it() -> None:
    # Two identical jobs, run on line 1 in 180 ms against a 200 ms deadline; the second
    # spent 25 ms on its way from its app (its sent-at): the app had it 205 ms after
    # sending, late, and the twin says so.
    def ran(job_id: str, at: float, inbound: float | None) -> JobRecord:
        return _line_job(at, job_id, 200.0, accepted_ms=1.0).model_copy(
            update={
                "status": "ok",
                "ran_on": "line-1-pc",
                "queue_ms": 1.0,
                "service_ms": 178.0,
                "device_ms": 178.0,
                "latency_ms": 180.0,
                "inbound_ms": inbound,
            }
        )

    recorded = trace.Trace(demo_trace(1.0).header, (ran("near", 0.0, None), ran("far", 1.0, 25.0)))
    outcomes = {o.job_id: o for o in replay(recorded).outcomes}
    assert outcomes["near"].where == outcomes["far"].where == "line-1-pc"
    assert (outcomes["near"].latency_ms, outcomes["near"].in_time) == (180.0, True)
    assert (outcomes["far"].latency_ms, outcomes["far"].in_time) == (205.0, False)


def test_a_recorded_job_placed_where_it_ran_takes_its_own_way_there_and_back() -> None:
    # Three offloaded jobs half a second apart, each with its own transfer to north-cpu-1
    # and its own way back. Replayed on the same worker, each takes its own legs: their
    # latencies differ from the live ones by the same amount (the worker's batch window),
    # where draws would hand one job another's legs.
    def offloaded(job_id: str, at: float, there: float, back: float) -> JobRecord:
        done = 2.0 + there + 10.0  # placement answer, the way there, its batch
        return _line_job(at, job_id, 35.0).model_copy(
            update={
                "status": "ok",
                "ran_on": "north-cpu-1",
                "offloaded": True,
                "worker": "north-cpu-1",
                "placement_ms": 2.0,
                "worker_done_ms": done,
                "service_ms": 10.0,
                "latency_ms": done + back,
            }
        )

    jobs = (
        offloaded("a", 0.0, 3.0, 4.0),
        offloaded("b", 0.5, 9.0, 1.0),
        offloaded("c", 1.0, 6.0, 6.0),
    )
    outcomes = replay(trace.Trace(demo_trace(1.0).header, jobs)).outcomes
    assert [o.where for o in outcomes] == ["north-cpu-1"] * 3
    offsets = {round(o.latency_ms - j.latency_ms, 3) for o, j in zip(outcomes, jobs, strict=True)}
    assert len(offsets) == 1, offsets
