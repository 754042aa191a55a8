"""Benchmark: what a fleet of N edge agents' telemetry costs one campus broker, and what it
does to placements, for N in 100, 500, 2,000 and 5,000 line PCs and 50 pool workers.

Processes, all on this machine: a secured Mosquitto (TLS 1.3, a certificate per identity,
the ACL from the policy) and a Redis started for the run; one ``sluicegate broker run``
(broker-1; a fresh process and an emptied Redis for each N); ``bench/fleet_sim.py``, the
N simulated edges' telemetry (1 Hz each, spread over the second) and the 50 simulated
workers (retained capabilities, telemetry at 1 Hz, a Completion 20 ± 5 ms after each
placement), all of them nodes of the signed policy (``bench/fleet_rig.py``); and this
process, the driver (``bench/fleet_driver.py``): line-1-pc and line-2-pc asking through
the edge agent's own PlacementClient, open-loop at ``--rate`` placements/s in total, each
granted placement completed by its simulated worker (not released).

For each N, on a fresh broker: first the fleet's telemetry alone against a round with
nothing at all (no placements yet, so no audit records for the broker's periodic chain
check to verify): the broker's CPU per telemetry message when nothing else wakes it.
Then, after a discarded warm-up pair, ``--rounds`` pairs of rounds alternate *fleet load
on* (the N edges' telemetry) and *no fleet load* (the same placements and workers, no edge
telemetry): broker CPU per telemetry message = (broker CPU in the fleet round - broker
CPU in its paired idle round, at the same duration) / telemetry messages sent in the
fleet round (median over the pairs); placement-answer p50/p99/max and the share answered
within the edge's 50 ms, fleet against idle; broker RSS and Redis ``used_memory`` (and
the node documents it holds) at the end of the fleet rounds; ``GET /fleet`` (and
``/fleet?limit=100``) timed outside the counted windows; each process's CPU. Every round
starts once the broker answers placements promptly again with no fleet load (a saturated
broker's backlog would otherwise spill into the idle round after a fleet round). A request
not answered within the edge's 50 ms counts as never answered: infinitely late in the
percentiles. Targets at the largest N (5,000 edges, one broker): every placement answered
within 50 ms, p99 at most 2 x idle p99, at most 50 µs of broker CPU per telemetry message
(met only if the paired figure and the fleet-alone one both are, and the broker's one
core was not saturated: then the pair's difference is capped by the core, not the cost).

The policy format lists at most 4,096 edges (``policies.schema``); past that the edges it
can list send N messages/s between them (4,094 edges at 1.22 Hz for N = 5,000), and the
report says so. ``--read-gap-ms 0,2,0,2`` runs, for each N, one broker per value of the
broker's ``read_gap_ms`` setting in that order (arms of an A/B, alternated), each row
labelled with its gap; ``--pin 0,1,0,1`` likewise alternates brokers sharing the machine's
cores with every other process of the run and brokers with CPU 0 to themselves (the rest
confined to the other CPUs: the broker as on a campus, where the simulated fleet, the
driver, Mosquitto and Redis run on other machines), rows labelled ``/pin``; ``--base DIR
--code this,base,this,base`` alternates brokers run from this checkout and from another
(a baseline commit: ``git worktree add /tmp/base COMMIT``), rows labelled ``/base``;
given together, the arm lists pair up value by value. ``--replicas 1,2,3`` runs the
replica checks instead
(``bench/fleet_replicas.py``).

    .venv/bin/python bench/fleet_scale.py                   # about 9 minutes on 2 cores
    .venv/bin/python bench/fleet_scale.py --edges 100,500   # about 4 minutes
    .venv/bin/python bench/fleet_scale.py --edges 2000 --seconds 5 --rounds 2   # ~1.5 min
    .venv/bin/python bench/fleet_scale.py --edges 5000 --read-gap-ms 0,2,0,2  # ~9 minutes
    .venv/bin/python bench/fleet_scale.py --edges 5000 --pin 0,1,0,1  # ~9 minutes
    .venv/bin/python bench/fleet_scale.py --replicas 1,2,3  # about 6 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import stats
from bench.fleet_driver import Ask, Driver, summary
from bench.fleet_report import report
from bench.fleet_rig import (
    BROKER,
    FleetCampus,
    Servers,
    Sim,
    confine,
    edge_room,
    machine_busy_s,
    rss_mb,
    set_edges,
    speed_reference,
    start_replica,
    start_sims,
    stop_replica,
    wait_ready,
    write_fleet,
)
from broker import keys
from sluicegate.app.broker_http import get
from sluicegate.app.servers import free_port

ALL_CPUS = frozenset(os.sched_getaffinity(0))  # what this run may use, pinned or not


class Meter:
    """CPU seconds of named processes, of the whole machine (``machine``: all cores) and
    of everything else on it (``others``: the machine less the named processes)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids

    def read(self) -> dict[str, float]:
        out = {name: stats.cpu_s(pid) for name, pid in self.pids.items()}
        machine = machine_busy_s()
        return out | {"machine": machine, "others": machine - sum(out.values())}


def time_fleet(fleet: FleetCampus, port: int) -> dict[str, Any]:
    """``GET /fleet`` three times (median ms, size, edges listed), ``/fleet?limit=100`` and
    ``/metrics`` (its edges: the samples naming an edge of the policy)."""
    out: dict[str, Any] = {}
    paths = (("fleet", "/fleet"), ("fleet_limit_100", "/fleet?limit=100"), ("metrics", "/metrics"))
    for label, path in paths:
        times, size, edges, status = [], 0, -1, 0
        for _ in range(3):
            t0 = time.perf_counter()
            status, body = get(f"http://127.0.0.1:{port}{path}", fleet.viewer, timeout=30)
            times.append((time.perf_counter() - t0) * 1000.0)
            size = len(body)
        if status == 200 and label == "metrics":
            edges = sum(
                1 for line in body.splitlines() if b'edge="' in line or b'kind="edge"' in line
            )
        elif status == 200:
            doc = json.loads(body)
            edges = len(doc.get("edges", []))
        out[label] = {
            "ms": stats.median(times),
            "bytes": size,
            "edges": edges,
            "status": status,
        }
    return out


async def one_round(
    driver: Driver,
    sims: list[Sim],
    meter: Meter,
    fleet: tuple[int, float],
    args: argparse.Namespace,
    *,
    placements: bool = True,
) -> dict[str, Any]:
    """One round: ``fleet`` = (edges on, their telemetry messages/s in all), the
    placements (or none), and what each process used meanwhile. It starts once the
    broker answers placements promptly with no fleet load (a saturated broker's backlog
    would otherwise spill into the round after a fleet round), then turns the load on."""
    set_edges(sims, 0)
    drained = await driver.drain()
    set_edges(sims, *fleet)
    await asyncio.sleep(args.settle)
    sent0 = sum(s.stats()["telemetry"] for s in sims)
    cpu0, t0 = meter.read(), time.monotonic()
    if placements:
        asks = await driver.open_loop(args.rate, args.seconds)
    else:
        asks = []
        await asyncio.sleep(args.seconds)
    cpu1, t1 = meter.read(), time.monotonic()
    sent1 = sum(s.stats()["telemetry"] for s in sims)
    dt = t1 - t0
    return {
        "drained_s": drained,
        "seconds": dt,
        "telemetry": sent1 - sent0,
        "cpu": {k: (cpu1[k] - cpu0[k]) / dt for k in cpu0},  # cores busy
        "asks": asks,
    }


async def one_n(
    n: int,
    fleet: FleetCampus,
    servers: Servers,
    driver: Driver,
    sims: list[Sim],
    args: argparse.Namespace,
    gap_ms: float | None,
    pin: bool,
    code: Path | None,
) -> dict[str, Any]:
    assert servers.redis is not None
    assert servers.mosquitto is not None
    r = redis.Redis(port=servers.redis.port)
    r.flushall()
    env = {} if gap_ms is None else {"SLUICEGATE_BROKER__READ_GAP_MS": f"{gap_ms:g}"}
    broker_cpus, rest = ({0}, ALL_CPUS - {0}) if pin else (ALL_CPUS, ALL_CPUS)
    others = {"mosquitto": servers.mosquitto.pid, "redis": servers.redis.pid}
    others |= {s.name: s.pid for s in sims} | {"driver": os.getpid()}
    for pid in others.values():
        confine(pid, rest)
    replica = start_replica(fleet, BROKER, servers.root, env, code)
    try:
        confine(replica.pid, broker_cpus)
        await asyncio.to_thread(wait_ready, fleet, replica)
        confine(replica.pid, broker_cpus)  # and the threads it started meanwhile
        await driver.wait_brokers()
        pids = {"broker": replica.pid} | others
        meter = Meter(pids)
        # Past the policy's room, the edges it lists send N messages/s between them.
        load, idle = (min(n, len(fleet.edges)), float(n)), (0, 0.0)
        # First the fleet alone against nothing at all, before any placement: telemetry's
        # cost without the placements' batching moving with it, and before the audit log
        # has records for the broker's periodic check to verify (a pass every 15 s).
        await one_round(driver, sims, meter, load, args, placements=False)  # warm-up
        nothing = await one_round(driver, sims, meter, idle, args, placements=False)
        alone = await one_round(driver, sims, meter, load, args, placements=False)
        for pair in (load, idle):  # warm-up pair, discarded
            await one_round(driver, sims, meter, pair, args)
        fleet_rounds, idle_rounds, gets = [], [], []
        for _ in range(args.rounds):
            on = await one_round(driver, sims, meter, load, args)
            on["rss_mb"] = rss_mb(replica.pid)
            on["redis_mb"] = int(r.info("memory")["used_memory"]) / 2**20
            fleet_rounds.append(on)
            redis_nodes = node_documents(r, fleet)
            gets.append(await asyncio.to_thread(time_fleet, fleet, replica.http_port))
            off = await one_round(driver, sims, meter, idle, args)
            off["rss_mb"] = rss_mb(replica.pid)
            off["redis_mb"] = int(r.info("memory")["used_memory"]) / 2**20
            idle_rounds.append(off)
    finally:
        set_edges(sims, 0)
        stop_replica(replica)
    row = figures(n, fleet_rounds, idle_rounds, gets)
    row["read_gap_ms"] = gap_ms
    row["pinned"] = pin
    row["base"] = code is not None
    row["listed_edges"] = load[0]
    row["redis_nodes"] = redis_nodes
    cpu_alone, cpu_nothing = alone["cpu"]["broker"], nothing["cpu"]["broker"]
    row["alone"] = {
        "broker_cpu_pct": 100 * cpu_alone,
        "nothing_cpu_pct": 100 * cpu_nothing,
        "us_per_telemetry": (cpu_alone - cpu_nothing)
        * alone["seconds"]
        / max(alone["telemetry"], 1)
        * 1e6,
    }
    return row


def node_documents(r: redis.Redis, fleet: FleetCampus) -> dict[str, Any]:
    """How many node documents Redis holds now, and what a simulated edge's costs."""
    count = sum(1 for _ in r.scan_iter(match=keys.node("*"), count=2000))
    sample = [keys.node(e) for e, _z in fleet.edges[:20]]
    sizes = [int(r.memory_usage(k) or 0) for k in sample]
    return {"keys": count, "edge_doc_bytes": stats.median(sizes) if sizes else 0}


def figures(
    n: int,
    fleet_rounds: list[dict[str, Any]],
    idle_rounds: list[dict[str, Any]],
    gets: list[dict[str, Any]],
) -> dict[str, Any]:
    per_msg = [
        (on["cpu"]["broker"] - off["cpu"]["broker"]) * on["seconds"] / max(on["telemetry"], 1) * 1e6
        for on, off in zip(fleet_rounds, idle_rounds, strict=True)
    ]
    fleet_asks: list[Ask] = [a for rnd in fleet_rounds for a in rnd["asks"]]
    idle_asks: list[Ask] = [a for rnd in idle_rounds for a in rnd["asks"]]
    s_on, s_off = summary(fleet_asks), summary(idle_asks)
    med = stats.median
    procs = sorted(fleet_rounds[0]["cpu"])
    return {
        "edges": n,
        "telemetry_per_s": med(r["telemetry"] / r["seconds"] for r in fleet_rounds),
        "broker_us_per_telemetry": med(per_msg),
        "broker_us_rounds": per_msg,
        "pairs": [
            {
                mode: {
                    "timeout": summary(r["asks"])["timeout"],
                    "p99_ms": round(summary(r["asks"])["p99_ms"], 1),
                    "broker_pct": round(100 * r["cpu"]["broker"], 1),
                    "drained_s": round(r["drained_s"], 2),
                }
                for mode, r in (("fleet", on), ("idle", off))
            }
            for on, off in zip(fleet_rounds, idle_rounds, strict=True)
        ],
        "broker_cpu_pct": {
            "fleet": 100 * med(r["cpu"]["broker"] for r in fleet_rounds),
            "idle": 100 * med(r["cpu"]["broker"] for r in idle_rounds),
        },
        "cpu_pct": {
            mode: {p: round(100 * med(r["cpu"][p] for r in rounds), 1) for p in procs}
            for mode, rounds in (("fleet", fleet_rounds), ("idle", idle_rounds))
        },
        "broker_rss_mb": max(r["rss_mb"] for r in fleet_rounds),
        "broker_rss_mb_idle": max(r["rss_mb"] for r in idle_rounds),
        "redis_used_mb": max(r["redis_mb"] for r in fleet_rounds),
        "redis_used_mb_idle": max(r["redis_mb"] for r in idle_rounds),
        "placements": {"fleet": s_on, "idle": s_off},
        "p99_over_idle": s_on["p99_ms"] / s_off["p99_ms"] if s_off["p99_ms"] else float("nan"),
        "get_fleet": {
            label: {
                "ms": med(g[label]["ms"] for g in gets),
                "bytes": gets[-1][label]["bytes"],
                "edges": gets[-1][label]["edges"],
                "status": gets[-1][label]["status"],
            }
            for label in gets[0]
        },
    }


async def sweep(
    fleet: FleetCampus, servers: Servers, sims: list[Sim], args: argparse.Namespace
) -> list[dict[str, Any]]:
    campus = fleet.campus
    worker0 = sims[0]
    driver = Driver(
        fleet.driver_edges,
        campus.mqtt,
        fleet.policy,
        lambda ask: worker0.done(ask.worker, ask.job_id, 1, ask.edge),
    )
    await driver.start()
    rows = []
    try:
        for n in args.edges:
            for gap, pin, base in arms(args):
                print(
                    f"N={n}"
                    + ("" if gap is None else f", read gap {gap:g} ms")
                    + (", broker pinned to CPU 0" if pin else "")
                    + (f", broker from {args.base}" if base else "")
                    + " ...",
                    flush=True,
                )
                code = Path(args.base) if base else None
                rows.append(await one_n(n, fleet, servers, driver, sims, args, gap, pin, code))
    finally:
        await driver.close()
    return rows


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--edges", default="100,500,2000,5000", help="fleet sizes N, comma-separated")
    ap.add_argument("--workers", type=int, default=50)
    ap.add_argument("--rate", type=float, default=200.0, help="placements/s, in total")
    ap.add_argument("--seconds", type=float, default=8.0, help="counted length of a round")
    ap.add_argument("--settle", type=float, default=1.5, help="uncounted start of a round")
    ap.add_argument("--rounds", type=int, default=3, help="pairs of rounds per N")
    ap.add_argument("--capacity", type=int, default=1000, help="each worker's capacity")
    ap.add_argument("--service-ms", type=float, default=20.0)
    ap.add_argument("--jitter-ms", type=float, default=5.0)
    ap.add_argument("--driver-edges", type=int, default=2, help="edge identities placing")
    ap.add_argument("--sim-procs", type=int, default=1, help="simulator processes")
    ap.add_argument(
        "--read-gap-ms",
        default="",
        help="e.g. 0,2,0,2: for each N, one broker per value of [broker] read_gap_ms, in "
        "this order (A/B arms); default: the broker's own setting",
    )
    ap.add_argument(
        "--pin",
        default="",
        help="e.g. 0,1,0,1: for each N, one broker per value, in this order (A/B arms): 1 "
        "runs the broker alone on CPU 0 and every other process of the run on the other "
        "CPUs (the broker with a core to itself), 0 lets all of them run anywhere; paired "
        "with --read-gap-ms value by value when both are given",
    )
    ap.add_argument(
        "--base",
        default="",
        help="another checkout (git worktree add /tmp/base COMMIT) for --code base arms",
    )
    ap.add_argument(
        "--code",
        default="",
        help="e.g. this,base,this,base: for each N, one broker per value, run from this "
        "checkout or from --base (A/B arms); paired with the other arm lists value by value",
    )
    ap.add_argument("--replicas", default="", help="e.g. 1,2,3: the replica checks instead")
    rep = ap.add_argument_group("--replicas mode (bench/fleet_replicas.py)")
    rep.add_argument("--small-capacity", type=int, default=4, help="each worker's capacity")
    rep.add_argument("--replica-service-ms", type=float, default=150.0)
    rep.add_argument("--replica-jitter-ms", type=float, default=20.0)
    rep.add_argument("--window", type=int, default=8, help="closed loop: requests outstanding")
    rep.add_argument(
        "--chunk-seconds", type=float, default=10.0, help="closed loop: a capacity stretch"
    )
    rep.add_argument(
        "--replica-warmup", type=float, default=3.0, help="closed loop: uncounted seconds first"
    )
    rep.add_argument(
        "--drain-seconds", type=float, default=15.0, help="telemetry: most s to wait out a backlog"
    )
    rep.add_argument("--decisions", type=int, default=100_000, help="answers checked, at least")
    rep.add_argument("--tel-edges", type=int, default=5000, help="edges for telemetry capacity")
    rep.add_argument("--tel-rate", type=float, default=5000.0, help="their messages/s in all")
    rep.add_argument("--tel-seconds", type=float, default=5.0)
    rep.add_argument("--kill-rate", type=float, default=300.0, help="placements/s, kill run")
    rep.add_argument("--kill-seconds", type=float, default=20.0)
    rep.add_argument("--settle-timeout", type=float, default=60.0)
    args = ap.parse_args()
    args.edges = [int(x) for x in str(args.edges).split(",") if x]
    args.read_gap_ms = [float(x) for x in str(args.read_gap_ms).split(",") if x]
    args.pin = [x.strip() == "1" for x in str(args.pin).split(",") if x.strip()]
    args.code = [x.strip() == "base" for x in str(args.code).split(",") if x.strip()]
    lengths = {len(a) for a in (args.read_gap_ms, args.pin, args.code) if a}
    if len(lengths) > 1:
        ap.error("--read-gap-ms, --pin and --code pair up value by value: give as many of each")
    if any(args.code) and not (args.base and Path(args.base, "broker").is_dir()):
        ap.error("--code base needs --base, a checkout of the project")
    if any(args.pin) and len(os.sched_getaffinity(0)) < 2:
        ap.error("--pin 1 needs at least two CPUs")
    return args


def arms(args: argparse.Namespace) -> list[tuple[float | None, bool, bool]]:
    """Each N's brokers, in order: (read gap or the broker's own, pinned, from --base)."""
    count = max(len(args.read_gap_ms), len(args.pin), len(args.code), 1)
    gaps = args.read_gap_ms or [None] * count
    pins = args.pin or [False] * count
    codes = args.code or [False] * count
    return list(zip(gaps, pins, codes, strict=True))


def main() -> None:
    args = parse_args()
    if args.replicas:
        from bench.fleet_replicas import main as replicas_main

        replicas_main(args)
        return
    servers = Servers()
    sims: list[Sim] = []
    try:
        redis_server = servers.start_redis()
        t0 = time.monotonic()
        fleet = write_fleet(
            servers.root / "campus",
            edges=min(max(args.edges), edge_room(args.driver_edges)),
            workers=args.workers,
            mqtt_port=free_port(),
            redis_url=f"redis://127.0.0.1:{redis_server.port}/0",
            driver_edges=args.driver_edges,
            sim_procs=args.sim_procs,
        )
        setup: dict[str, Any] = {"write_s": time.monotonic() - t0, "speed_us": [speed_reference()]}
        servers.start_mosquitto(fleet.campus)
        sims = start_sims(
            fleet,
            servers.root,
            capacity=args.capacity,
            service_ms=args.service_ms,
            jitter_ms=args.jitter_ms,
        )
        rows = asyncio.run(sweep(fleet, servers, sims, args))
        setup["speed_us"].append(speed_reference())
    finally:
        for sim in sims:
            sim.stop()
        servers.stop()
    report(rows, args, setup)


if __name__ == "__main__":
    main()
