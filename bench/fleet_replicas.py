"""Benchmark and checks: 1, 2 and 3 broker replicas on one Mosquitto and one Redis
(``bench/fleet_scale.py --replicas 1,2,3``; the campus, simulator and driver of
``bench/fleet_rig.py``, ``fleet_sim.py`` and ``fleet_driver.py``).

Each replica is its own ``sluicegate broker run`` with its own id in the policy's
``broker_signers``, its own key and certificate. Workers advertise a small capacity
(``--small-capacity``, 4) and hold each job ``--replica-service-ms`` (150 ± 20 ms), so
that the 50 workers' 200 slots fill up and the capacity check bites. For each replica
count, in a fresh set of processes over an emptied Redis:

* **placement capacity**: closed loop, ``--window`` requests outstanding, for at least
  ``--seconds`` and until its share of ``--decisions`` answers is reached; answers/s,
  placed/refused/timed out, and each replica's CPU;
* **telemetry capacity**: ``--tel-rate`` edge telemetry messages/s (the edges the policy
  can list, at 1 Hz each or faster) beside ``--rate`` open-loop placements/s, against a
  paired round without telemetry: each replica's CPU per telemetry message sent, and the
  rate at which the busiest replica's core would be full, ``rate * (1 - idle share) /
  telemetry share`` (an extrapolation from this run's CPU, on a machine whose two cores
  every process shares).

Then, with the most replicas, a **SIGKILL of broker-2** halfway through an open-loop run
(``--kill-rate``/s for ``--kill-seconds``): requests answered, refused and unanswered
(the edge's 50 ms timeout), by when they were sent: before the kill, in the two seconds
after it, and after; then,
once everything settled, **0 lost placements**: every placement an edge was granted (by
any replica, the killed one included) ends completed (its job's record in Redis says
``completed:ok``, and ``GET /jobs/{id}`` on a surviving replica says so for the killed
replica's grants and a sample of the others), no reservation is left behind (every
worker's reservation set empty, waited for), and what became of placements that replicas
granted but no edge received (Redis ``job:<id>:decision`` says placed).

Over every answer of the run (at least ``--decisions``): the **double-reservation check**:
no job id granted twice (every raw reply on the edges' reply topics is tapped), and at no
moment more jobs granted and not yet completed on a worker than its capacity (from the
grants the edges received and the completions the simulator sent, on the machine's one
monotonic clock), with Redis's reservation sets sampled every 20 ms against capacity too.

    .venv/bin/python bench/fleet_scale.py --replicas 1,2,3        # about 6 minutes
    .venv/bin/python bench/fleet_scale.py --replicas 1,2 --decisions 20000   # ~2 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import redis
import redis.asyncio as aioredis

from bench import stats
from bench.fleet_driver import Ask, Driver, summary
from bench.fleet_report import SATURATED, replicas_report
from bench.fleet_rig import (
    FleetCampus,
    Replica,
    Servers,
    Sim,
    edge_room,
    machine_busy_s,
    set_edges,
    start_replica,
    start_sims,
    stop_replica,
    wait_ready,
    write_fleet,
)
from broker import keys
from sluicegate.app.broker_http import get_json
from sluicegate.app.servers import free_port


class Sampler:
    """Every worker's live reservations in Redis (ZCOUNT of unexpired entries), sampled."""

    def __init__(self, port: int, workers: list[str], capacity: int) -> None:
        self.client = aioredis.Redis(port=port)
        self.workers = workers
        self.capacity = capacity
        self.samples = 0
        self.max_seen = 0
        self.over: list[tuple[str, int]] = []

    async def run(self, period_s: float = 0.02) -> None:
        while True:
            now_ms = int(time.time() * 1000)
            async with self.client.pipeline(transaction=False) as pipe:
                for w in self.workers:
                    pipe.zcount(keys.reservations(w), now_ms, "+inf")
                counts = await pipe.execute()
            self.samples += 1
            for w, n in zip(self.workers, counts, strict=True):
                self.max_seen = max(self.max_seen, int(n))
                if int(n) > self.capacity:
                    self.over.append((w, int(n)))
            await asyncio.sleep(period_s)


def concurrency_check(
    asks: list[Ask], completed: dict[str, float], capacity: int
) -> dict[str, Any]:
    """Per worker, the most jobs granted (edge's answer) and not yet completed (the
    simulator's Completion sent) at any moment."""
    events: dict[str, list[tuple[float, int]]] = defaultdict(list)
    missing = 0
    for a in asks:
        if a.kind != "placed":
            continue
        done = completed.get(a.job_id)
        if done is None:
            missing += 1
            continue
        events[a.worker] += [(a.answered_at, 1), (done, -1)]
    worst, over = 0, 0
    for evs in events.values():
        held = 0
        for _t, step in sorted(evs, key=lambda e: (e[0], e[1])):
            held += step
            worst = max(worst, held)
            over += held > capacity
    return {"max_held": worst, "over_capacity": over, "granted_not_completed": missing}


def double_grants(replies: dict[str, list[tuple[str, str, str]]]) -> dict[str, int]:
    placed_twice = sum(1 for notes in replies.values() if sum(n[0] == "placed" for n in notes) > 1)
    answered_twice = sum(1 for notes in replies.values() if len(notes) > 1)
    return {"jobs_placed_twice": placed_twice, "jobs_answered_twice": answered_twice}


async def start_replicas(fleet: FleetCampus, servers: Servers, count: int) -> list[Replica]:
    assert servers.redis is not None
    redis.Redis(port=servers.redis.port).flushall()
    replicas = [start_replica(fleet, f"broker-{k}", servers.root) for k in range(1, count + 1)]
    for r in replicas:
        await asyncio.to_thread(wait_ready, fleet, r)
    return replicas


def cpu_of(replicas: list[Replica]) -> dict[str, float]:
    """Each replica's CPU seconds so far, and the whole machine's (``machine``, all cores)."""
    return {r.broker_id: stats.cpu_s(r.pid) for r in replicas} | {"machine": machine_busy_s()}


def answered(asks: list[Ask]) -> int:
    return sum(a.kind in ("placed", "refused") for a in asks)


async def capacity(
    driver: Driver, replicas: list[Replica], args: argparse.Namespace, share: int
) -> dict[str, Any]:
    await driver.closed_loop(args.window, args.replica_warmup)  # warm-up, discarded
    asks: list[Ask] = []
    c0, d0, t0 = cpu_of(replicas), time.process_time(), time.monotonic()
    active = 0.0  # seconds with the window kept full (each chunk ends waiting its last out)
    while True:
        asks += await driver.closed_loop(args.window, args.chunk_seconds)
        active += args.chunk_seconds
        if active >= args.seconds and answered(asks) >= share:
            break
    dt = time.monotonic() - t0
    c1 = cpu_of(replicas)
    s = summary(asks)
    return {
        "answers_per_s": (s["placed"] + s["refused"]) / active,
        "placed_per_s": s["placed"] / active,
        "summary": s,
        "seconds": dt,
        "replica_cpu_pct": {k: 100 * (c1[k] - c0[k]) / dt for k in c0 if k != "machine"},
        "machine_cpu_pct": 100 * (c1["machine"] - c0["machine"]) / dt / (os.cpu_count() or 1),
        "driver_cpu_pct": 100 * (time.process_time() - d0) / dt,
    }


async def telemetry(
    driver: Driver,
    replicas: list[Replica],
    sims: list[Sim],
    fleet: FleetCampus,
    args: argparse.Namespace,
) -> dict[str, Any]:
    listed = len(fleet.edges)
    rounds: dict[str, list[dict[str, float]]] = {"fleet": [], "idle": []}
    sent: list[int] = []
    lat: dict[str, list[Ask]] = {"fleet": [], "idle": []}
    for mode in ("fleet", "idle", "fleet", "idle"):
        set_edges(sims, 0)
        await driver.drain(args.drain_seconds)  # what queued up in the fleet round first
        set_edges(sims, listed if mode == "fleet" else 0, args.tel_rate if mode == "fleet" else 0)
        await asyncio.sleep(args.settle)
        n0, c0, t0 = sims[0].stats()["telemetry"], cpu_of(replicas), time.monotonic()
        lat[mode] += await driver.open_loop(args.rate, args.tel_seconds)
        dt = time.monotonic() - t0
        c1 = cpu_of(replicas)
        rounds[mode].append({k: (c1[k] - c0[k]) / dt for k in c0})
        if mode == "fleet":
            sent.append(int((sims[0].stats()["telemetry"] - n0) / dt))
    set_edges(sims, 0)
    med = stats.median
    per_replica = {}
    busy = {m: med(x["machine"] for x in rounds[m]) / (os.cpu_count() or 1) for m in rounds}
    for r in replicas:
        on = med(x[r.broker_id] for x in rounds["fleet"])
        off = med(x[r.broker_id] for x in rounds["idle"])
        rate = med(sent)
        us = (on - off) / rate * 1e6 if rate else float("nan")
        full_at = rate * (1 - off) / (on - off) if on > off else float("inf")
        per_replica[r.broker_id] = {
            "cpu_pct_fleet": 100 * on,
            "cpu_pct_idle": 100 * off,
            "us_per_telemetry_sent": us,
            "core_full_at_msgs_per_s": full_at,
        }
    # Extrapolating to a full core means nothing once a replica's core or the machine's
    # cores are nearly full already (what a process got is then not what it needed).
    full = max(busy.values()) >= SATURATED or any(
        v["cpu_pct_fleet"] >= 100 * SATURATED for v in per_replica.values()
    )
    return {
        "telemetry_per_s": med(sent),
        "machine_cpu_pct": {m: 100 * v for m, v in busy.items()},
        "saturated": full,
        "listed_edges": listed,
        "replicas": per_replica,
        "capacity_msgs_per_s": None
        if full
        else min(v["core_full_at_msgs_per_s"] for v in per_replica.values()),
        "placements": {m: summary(lat[m]) for m in lat},
    }


async def until(check: Callable[[], bool], deadline: float, period_s: float = 0.2) -> bool:
    """Whether ``check()`` came true before ``deadline`` (monotonic), looking every period."""
    while not check():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(period_s)
    return True


async def kill_run(
    driver: Driver,
    replicas: list[Replica],
    sims: list[Sim],
    servers: Servers,
    fleet: FleetCampus,
    args: argparse.Namespace,
) -> dict[str, Any]:
    victim = replicas[1]
    first = len(driver.asks)
    t_start = time.monotonic()
    run = asyncio.ensure_future(driver.open_loop(args.kill_rate, args.kill_seconds))
    await asyncio.sleep(args.kill_seconds / 2)
    victim.proc.kill()
    t_kill = time.monotonic()
    victim.proc.wait(10)
    asks = await run
    periods = {
        "before": summary(asks, t_start, t_kill),
        "kill_to_2s": summary(asks, t_kill, t_kill + 2.0),
        "after": summary(asks, t_kill + 2.0, None),
    }
    by_victim = [a for a in asks if a.kind == "placed" and a.broker == victim.broker_id]
    # Settle: every completion sent, then every reservation gone.
    deadline = time.monotonic() + args.settle_timeout
    await until(lambda: not sims[0].stats()["held"], deadline)
    assert servers.redis is not None
    r = redis.Redis(port=servers.redis.port)
    t_settle = time.monotonic()

    def reserved() -> int:
        return sum(int(r.zcard(keys.reservations(w))) for w, _z, _k in fleet.workers)

    await until(lambda: reserved() == 0, deadline)
    left = reserved()
    settled_s = time.monotonic() - t_settle
    granted = [a for a in asks if a.kind == "placed"]
    pipe = r.pipeline(transaction=False)
    for a in granted:
        pipe.hget(keys.job(a.job_id), "status")
        pipe.exists(keys.inflight(a.job_id))
    replies = pipe.execute()
    statuses = [json.loads(v) if v else None for v in replies[0::2]]
    not_completed = [
        a.job_id for a, s in zip(granted, statuses, strict=True) if s != "completed:ok"
    ]
    inflight_left = sum(int(x) for x in replies[1::2])
    # What the replicas granted that no edge got in time (the decision record says placed).
    others = [a for a in asks if a.kind != "placed"]
    pipe = r.pipeline(transaction=False)
    for a in others:
        pipe.get(keys.job_decision(a.job_id))
    decided = [json.loads(v) if v else None for v in pipe.execute()]
    undelivered = [
        a for a, d in zip(others, decided, strict=True) if d and d.get("status") == "placed"
    ]
    # Asked, never answered and decided by no replica: lost with the killed one (QoS 0).
    undecided = [a for a, d in zip(others, decided, strict=True) if d is None]
    released = {j for j, _w in driver.released}
    survivor = replicas[0]
    sample = [a.job_id for a in by_victim] + random.sample(
        [a.job_id for a in granted], min(200, len(granted))
    )
    api_bad = []
    for job_id in sample:
        status, doc = await asyncio.to_thread(
            get_json, f"http://127.0.0.1:{survivor.http_port}/jobs/{job_id}", fleet.viewer
        )
        said = doc.get("status") if isinstance(doc, dict) else doc
        if status != 200 or said != "completed:ok":
            api_bad.append((job_id, status, said))
    asked = len(asks)
    return {
        "killed": victim.broker_id,
        "asked": asked,
        "periods": periods,
        "granted": len(granted),
        "granted_by_killed": len(by_victim),
        "granted_not_completed": len(not_completed),
        "not_completed_sample": not_completed[:5],
        "inflight_records_left_of_completed": inflight_left,
        "granted_undelivered": len(undelivered),
        "undelivered_released_by_edge": sum(a.job_id in released for a in undelivered),
        "undelivered_never_answered": sum(a.kind == "timeout" for a in undelivered),
        "undelivered_inflight_left": sum(
            int(r.exists(keys.inflight(a.job_id))) for a in undelivered
        ),
        "unanswered_undecided": len(undecided),
        "unanswered_undecided_by_period": {
            "before": sum(a.sent < t_kill for a in undecided),
            "kill_to_2s": sum(t_kill <= a.sent < t_kill + 2 for a in undecided),
            "after": sum(a.sent >= t_kill + 2 for a in undecided),
        },
        "reservations_left": left,
        "settled_in_s": settled_s,
        "api_checked": len(sample),
        "api_not_completed": api_bad[:5],
        "api_not_completed_count": len(api_bad),
        "first_ask": first,
    }


async def phases(
    fleet: FleetCampus,
    servers: Servers,
    sims: list[Sim],
    counts: list[int],
    args: argparse.Namespace,
) -> dict[str, Any]:
    worker0 = sims[0]
    driver = Driver(
        fleet.driver_edges,
        fleet.campus.mqtt,
        fleet.policy,
        lambda ask: worker0.done(ask.worker, ask.job_id, 1, ask.edge),
    )
    await driver.start()
    assert servers.redis is not None
    sampler = Sampler(servers.redis.port, [w for w, _z, _k in fleet.workers], args.small_capacity)
    sampling = asyncio.ensure_future(sampler.run())
    out: dict[str, Any] = {"by_replicas": {}}
    try:
        for done, count in enumerate(counts):
            # What is still missing of --decisions, shared by the capacity phases left
            # (the kill run's open loop counts too; the telemetry rounds may add nothing).
            kill = int(args.kill_rate * args.kill_seconds) if max(counts) >= 2 else 0
            share = max(0, args.decisions - answered(driver.asks) - kill) // (len(counts) - done)
            print(f"{count} replica(s) ...", flush=True)
            replicas = await start_replicas(fleet, servers, count)
            await driver.wait_brokers()
            try:
                row = {"capacity": await capacity(driver, replicas, args, share)}
                row["telemetry"] = await telemetry(driver, replicas, sims, fleet, args)
            finally:
                for r in replicas:
                    stop_replica(r)
            out["by_replicas"][str(count)] = row
        if max(counts) >= 2:
            print(f"{max(counts)} replicas, SIGKILL of broker-2 mid-run ...", flush=True)
            replicas = await start_replicas(fleet, servers, max(counts))
            await driver.wait_brokers()
            try:
                await driver.closed_loop(args.window, args.replica_warmup)  # warm-up
                out["kill"] = await kill_run(driver, replicas, sims, servers, fleet, args)
            finally:
                for r in replicas:
                    stop_replica(r)
    finally:
        sampling.cancel()
        await driver.close()
    completions = worker0.completion_log(servers.root / "completions.json")
    asks = driver.asks
    out["decisions"] = answered(asks)
    out["asked"] = len(asks)
    out["concurrency"] = concurrency_check(asks, completions, args.small_capacity)
    out["replies"] = double_grants(driver.replies)
    out["redis_samples"] = {
        "samples": sampler.samples,
        "max_live_reservations": sampler.max_seen,
        "over_capacity": len(sampler.over),
    }
    return out


def main(args: argparse.Namespace) -> None:
    counts = [int(x) for x in str(args.replicas).split(",") if x]
    servers = Servers()
    sims: list[Sim] = []
    try:
        redis_server = servers.start_redis()
        fleet = write_fleet(
            servers.root / "campus",
            edges=min(args.tel_edges, edge_room(args.driver_edges)),
            workers=args.workers,
            mqtt_port=free_port(),
            redis_url=f"redis://127.0.0.1:{redis_server.port}/0",
            replicas=max(counts),
            driver_edges=args.driver_edges,
            sim_procs=args.sim_procs,
        )
        servers.start_mosquitto(fleet.campus)
        sims = start_sims(
            fleet,
            servers.root,
            capacity=args.small_capacity,
            service_ms=args.replica_service_ms,
            jitter_ms=args.replica_jitter_ms,
        )
        out = asyncio.run(phases(fleet, servers, sims, counts, args))
    finally:
        for sim in sims:
            sim.stop()
        servers.stop()
    replicas_report(out, args)
