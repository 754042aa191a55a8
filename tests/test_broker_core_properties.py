"""Properties: the indexed fast path decides exactly what the brute-force reference does.

Random fleets (zones, device classes, models, providers, memory, concurrency, workers
outside the policy or claiming the wrong zone) go through random event sequences
(telemetry with random load and health, reservations, releases, workers found full by a
shared reservation, completions, Last Wills,
silence long enough to expire, new capabilities), and at random points both
implementations decide a random request. Decisions must be equal: the same worker or
refusal code, the same sentence, the same ranked candidates and the same filter counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from broker.core.decision import Decision
from broker.core.fleet import Fleet
from broker.core.params import FleetParams, PlacementParams
from broker.core.placement import decide
from broker.core.reference import decide_reference
from sluicegate.vision.manifest import Requirements
from tests.test_broker_core_kit import (
    NOW,
    ZONES,
    campus_policy,
    caps,
    completion,
    request,
    telemetry,
)

MODELS = ("m-a", "m-b", "m-c")
DEVICES = ("gpu", "npu", "cpu")
PROVIDERS = ("CUDA", "CANN", "CPU")
CLASSES = ("wafer-image", "ocr-crop", "recipe-overlay", "unknown-class")
SUBHEALTH = [
    {
        "name": "memory-bound",
        "when": [
            {"metric": "utilisation", "op": ">=", "value": 0.7},
            {"metric": "memory_bandwidth", "op": ">=", "value": 0.9},
        ],
    },
    {"name": "hot", "when": [{"metric": "temperature_c", "op": ">=", "value": 85}]},
]
CHECKED = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@dataclass(frozen=True)
class Worker:
    worker_id: str
    zone: str
    pool_zone: str | None  # where the policy says it is (None: in no pool)
    device_class: str
    models: tuple[str, ...]
    providers: tuple[str, ...]
    memory_total_mb: int
    concurrency: int


VERSIONS: tuple[str | None, ...] = ("0a" * 32, "1b" * 32, None)


@st.composite
def workers(draw: st.DrawFn) -> list[Worker]:
    out = []
    for i in range(draw(st.integers(1, 10))):
        zone = draw(st.sampled_from(ZONES))
        pool_zone = draw(st.sampled_from([*([zone] * 10), None, *ZONES]))
        out.append(
            Worker(
                worker_id=f"w{i}",
                zone=zone,
                pool_zone=pool_zone,
                device_class=draw(st.sampled_from(DEVICES)),
                models=tuple(draw(st.sets(st.sampled_from(MODELS), min_size=1))),
                providers=tuple(draw(st.sets(st.sampled_from(PROVIDERS), min_size=1))),
                memory_total_mb=draw(st.sampled_from([4_000, 16_000, 40_000])),
                concurrency=draw(st.integers(1, 3)),
            )
        )
    return out


requirements_st = st.dictionaries(
    st.sampled_from(MODELS),
    st.builds(
        Requirements,
        providers=st.lists(st.sampled_from(PROVIDERS), max_size=2, unique=True).map(tuple),
        memory_mb=st.sampled_from([0, 2_000, 8_000, 20_000]),
    ),
)

tel_st = st.fixed_dictionaries(
    {
        "queue_depth": st.sampled_from([0, 0, 1, 2, 6]),  # idle workers tie often
        "in_flight": st.sampled_from([0, 0, 1, 3]),
        "capacity": st.integers(1, 12),
        "utilisation": st.sampled_from([0.1, 0.5, 0.8]),
        "memory_bandwidth": st.sampled_from([None, 0.2, 0.95]),
        "temperature_c": st.sampled_from([None, 40.0, 90.0]),
        "memory_used_mb": st.sampled_from([0.0, 2_000.0, 12_000.0, 30_000.0]),
        "service_ms": st.dictionaries(st.sampled_from(MODELS), st.sampled_from([5.0, 20.0])),
    }
)

decide_st = st.tuples(
    st.just("decide"),
    st.sampled_from((*ZONES[:4], "campus/fab-west/line-9")),
    st.sampled_from((*CLASSES[:3], *CLASSES)),
    st.sampled_from((*MODELS, *MODELS, "m-none")),
    st.integers(0, 2_000_000),
    st.sampled_from([None, None, 0.005, 0.05, 0.5]),
    st.sampled_from([None, None, 10.0, 60.0, 500.0]),
)
event_st = st.one_of(
    st.tuples(st.just("telemetry"), st.integers(0, 9), tel_st, st.sampled_from([0.1, 0.5, 1.0])),
    st.tuples(st.just("reserve"), st.integers(0, 9), st.integers(0, 5)),
    st.tuples(st.just("reserve_placed"), st.integers(0, 5)),
    st.tuples(st.just("release"), st.integers(0, 5)),
    st.tuples(st.just("complete"), st.integers(0, 9), st.sampled_from(MODELS), st.floats(1, 80)),
    st.tuples(st.just("offline"), st.integers(0, 9)),
    st.tuples(st.just("mark_full"), st.integers(0, 9)),
    st.tuples(st.just("cordon"), st.integers(0, 9), st.booleans()),
    st.tuples(st.just("silence"), st.sampled_from([0.5, 2.5, 4.0])),
    st.tuples(st.just("recap"), st.integers(0, 9), st.sets(st.sampled_from(MODELS), min_size=1)),
)


def run_scenario(
    fleet_workers: list[Worker],
    needs: dict[str, Requirements],
    events: list[tuple[Any, ...]],
    top_k: int,
    penalty: float,
) -> int:
    pools: dict[str, list[str]] = {}
    for w in fleet_workers:
        if w.pool_zone is not None:
            pools.setdefault(w.pool_zone, []).append(w.worker_id)
    policy = campus_policy(pools, subhealth=SUBHEALTH)
    params = PlacementParams(top_k=top_k, stale_after_s=3.0)
    fleet = Fleet(FleetParams(forecast_penalty=penalty, trend_min_samples=2), needs, policy)
    now = NOW
    ts = {w.worker_id: NOW - 10.0 for w in fleet_workers}

    def cap(w: Worker, models: tuple[str, ...]) -> Any:
        # Workers hold one of two versions of their models, or do not say which.
        version = VERSIONS[int(w.worker_id[1:]) % len(VERSIONS)]
        return caps(
            w.worker_id,
            w.zone,
            device_class=w.device_class,
            models=models,
            providers=w.providers,
            memory_total_mb=w.memory_total_mb,
            concurrency=w.concurrency,
            shas=dict.fromkeys(models, version) if version else None,
        )

    for w in fleet_workers:
        fleet.apply_capabilities(cap(w, w.models), now)
    decisions = 0
    last: Decision | None = None
    for step in events:
        kind = step[0]
        if kind == "telemetry":
            w = fleet_workers[step[1] % len(fleet_workers)]
            now += step[3]
            ts[w.worker_id] += step[3]
            tel = telemetry(w.worker_id, ts[w.worker_id], zone=w.zone, **step[2])
            fleet.apply_telemetry(tel, now)
        elif kind == "reserve":
            w = fleet_workers[step[1] % len(fleet_workers)]
            fleet.reserve(w.worker_id, f"job-{step[2]}", now)
        elif kind == "reserve_placed":
            if last is not None and last.status == "placed":
                fleet.reserve(last.worker_id, f"job-{step[1]}", now)
        elif kind == "release":
            fleet.release(f"job-{step[1]}")
        elif kind == "complete":
            w = fleet_workers[step[1] % len(fleet_workers)]
            fleet.apply_completion(completion("job-x", w.worker_id, step[3], model=step[2]), now)
        elif kind == "mark_full":
            fleet.mark_full(fleet_workers[step[1] % len(fleet_workers)].worker_id, now)
        elif kind == "cordon":
            fleet.cordon(fleet_workers[step[1] % len(fleet_workers)].worker_id, step[2])
        elif kind == "offline":
            fleet.mark_offline(fleet_workers[step[1] % len(fleet_workers)].worker_id, now)
        elif kind == "silence":
            now += step[1]
        elif kind == "recap":
            w = fleet_workers[step[1] % len(fleet_workers)]
            fleet.apply_capabilities(cap(w, tuple(sorted(step[2]))), now)
        else:
            _, origin, data_class, model, size, deadline_s, local_ms = step
            req = request(
                f"r{decisions}",
                origin_zone=origin,
                data_class=data_class,
                model=model,
                payload_bytes=size,
                deadline_at=None if deadline_s is None else now + deadline_s,
                local_estimate_ms=local_ms,
                model_sha256=VERSIONS[decisions % len(VERSIONS)],  # asks for each in turn
            )
            fast = decide(fleet, req, policy, now=now, params=params)
            slow = decide_reference(fleet, req, policy, now=now, params=params)
            assert fast == slow, (fast, slow)
            event(fast.status if fast.status == "placed" else fast.code)
            last = fast
            decisions += 1
    return decisions


@CHECKED
@given(
    fleet_workers=workers(),
    needs=requirements_st,
    loads=st.lists(tel_st, min_size=10, max_size=10),
    events=st.lists(st.tuples(event_st, decide_st), min_size=1, max_size=30),
    top_k=st.integers(1, 4),
    penalty=st.sampled_from([1.0, 1.5, 3.0]),
)
def test_fast_path_decides_as_the_brute_force_reference(
    fleet_workers: list[Worker],
    needs: dict[str, Requirements],
    loads: list[dict[str, Any]],
    events: list[tuple[tuple[Any, ...], tuple[Any, ...]]],
    top_k: int,
    penalty: float,
) -> None:
    """Every worker reports once, then each random event is followed by a decision."""
    steps = [("telemetry", i, loads[i], 0.1) for i in range(len(fleet_workers))]
    for change, decision in events:
        steps += [change, decision]
    run_scenario(fleet_workers, needs, steps, top_k, penalty)


@CHECKED
@given(
    fleet_workers=workers(),
    loads=st.lists(tel_st, min_size=10, max_size=10),
    requests_=st.lists(
        st.tuples(st.sampled_from(CLASSES[:3]), st.sampled_from(MODELS)), min_size=1, max_size=20
    ),
)
def test_reserving_every_placement_agrees_step_by_step(
    fleet_workers: list[Worker],
    loads: list[dict[str, Any]],
    requests_: list[tuple[str, str]],
) -> None:
    """A burst: every placed job is reserved at once, so heads move between decisions."""
    events: list[tuple[Any, ...]] = [
        ("telemetry", i, loads[i], 0.1) for i in range(len(fleet_workers))
    ]
    for i, (data_class, model) in enumerate(requests_):
        events.append(("decide", ZONES[0], data_class, model, 100_000, None, None))
        events.append(("reserve_placed", i))
    run_scenario(fleet_workers, {}, events, 3, 1.5)


reservation_st = st.one_of(
    st.tuples(st.just("reserve"), st.integers(0, 3), st.integers(0, 3)),
    st.tuples(st.just("reserve_placed"), st.integers(0, 3)),
    st.tuples(st.just("release"), st.integers(0, 3)),
    st.tuples(st.just("mark_full"), st.integers(0, 3)),
    st.tuples(st.just("telemetry"), st.integers(0, 3), tel_st, st.sampled_from([0.05, 0.5])),
)


@CHECKED
@given(
    fleet_workers=workers().map(lambda ws: ws[:4]),
    loads=st.lists(tel_st, min_size=4, max_size=4),
    events=st.lists(st.tuples(reservation_st, decide_st), min_size=1, max_size=30),
)
def test_reservations_releases_and_absorption_agree(
    fleet_workers: list[Worker],
    loads: list[dict[str, Any]],
    events: list[tuple[tuple[Any, ...], tuple[Any, ...]]],
) -> None:
    """Few workers, many reservations: every release and every absorbing telemetry
    sample must move the worker in the index exactly as the reference sees it."""
    steps = [("telemetry", i, loads[i], 0.1) for i in range(len(fleet_workers))]
    for change, decision in events:
        steps += [change, decision]
    run_scenario(fleet_workers, {}, steps, 2, 1.5)
