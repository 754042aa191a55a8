"""What the fleet benchmarks print: the human tables, the targets met or not, and the
``RESULT {json}`` last line (BENCHMARKS.md), for ``bench/fleet_scale.py``'s sweep of N and
``bench/fleet_replicas.py``'s replica checks. Formatting only: it measures nothing.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from bench import stats

TARGET = {"within_50ms": 1.0, "p99_over_idle": 2.0, "broker_us_per_telemetry": 50.0}


SATURATED = 0.9  # of a core: past it, the paired CPU difference no longer measures cost


def saturated(row: dict[str, Any]) -> bool:
    """The broker (one event loop: one core at most) was nearly full in the fleet rounds."""
    return bool(row["broker_cpu_pct"]["fleet"] >= 100 * SATURATED)


def verdict(row: dict[str, Any]) -> dict[str, bool]:
    """Targets met or not. CPU per message is met only if both figures are within it (the
    paired one and the fleet's alone) and the broker was not saturated (then the pair's
    difference is capped by the core, not by the cost)."""
    fleet = row["placements"]["fleet"]
    worst_us = max(row["broker_us_per_telemetry"], row["alone"]["us_per_telemetry"])
    return {
        "within_50ms": fleet["within_timeout"] >= TARGET["within_50ms"],
        "p99_over_idle": row["p99_over_idle"] <= TARGET["p99_over_idle"],
        "broker_us_per_telemetry": worst_us <= TARGET["broker_us_per_telemetry"]
        and not saturated(row),
    }


def label(row: dict[str, Any]) -> str:
    """The row's N and its arm: the broker's read gap where the run set one, ``pin`` where
    the broker had a core to itself, ``base`` where it ran from the baseline checkout:
    ``5000``, ``5000/g2``, ``5000/pin``, ``5000/pin/base``."""
    return str(row["edges"]) + arm(row)


def arm(row: dict[str, Any]) -> str:
    gap = row.get("read_gap_ms")
    pinned, base = row.get("pinned"), row.get("base")
    return (
        ("" if gap is None else f"/g{gap:g}")
        + ("/pin" if pinned else "")
        + ("/base" if base else "")
    )


COLUMNS = (
    ("edges", 8),
    ("tel/s", 6),
    ("µs/msg pair|alone", 17),
    ("brk% fl|id", 11),
    ("RSS MB", 7),
    ("redis MB", 9),
    ("p50 ms fl|id", 13),
    ("p99 ms fl|id", 13),
    ("max ms fl|id", 13),
    ("<50ms % fl|id", 14),
    ("p99 x", 6),
)
TIMED_OUT = ">50"  # a latency past the edge's timeout: never answered in time


def _ms(value: float, fmt: str) -> str:
    return TIMED_OUT if value == float("inf") else f"{value:{fmt}}"


def _pair(a: float, b: float, fmt: str) -> str:
    return f"{_ms(a, fmt)}|{_ms(b, fmt)}"


def table_row(row: dict[str, Any]) -> str:
    on, off = row["placements"]["fleet"], row["placements"]["idle"]
    cells = [
        label(row),
        f"{row['telemetry_per_s']:.0f}",
        _pair(row["broker_us_per_telemetry"], row["alone"]["us_per_telemetry"], ".1f")
        + ("*" if saturated(row) else ""),
        _pair(row["broker_cpu_pct"]["fleet"], row["broker_cpu_pct"]["idle"], ".1f"),
        f"{row['broker_rss_mb']:.1f}",
        f"{row['redis_used_mb']:.1f}",
        _pair(on["p50_ms"], off["p50_ms"], ".2f"),
        _pair(on["p99_ms"], off["p99_ms"], ".2f"),
        _pair(on["max_ms"], off["max_ms"], ".1f"),
        _pair(100 * on["within_timeout"], 100 * off["within_timeout"], ".2f"),
        _ms(row["p99_over_idle"], ".2f"),
    ]
    return " ".join(f"{c:>{w}}" for c, (_h, w) in zip(cells, COLUMNS, strict=True))


def details(row: dict[str, Any]) -> list[str]:
    out = [f"  N={label(row)}: µs/msg by pair {[round(x, 1) for x in row['broker_us_rounds']]}"]
    if row["listed_edges"] < row["edges"]:
        out[0] += f"; played by the {row['listed_edges']} edges the policy can list"
    alone = row["alone"]
    out.append(
        f"    telemetry alone (no placements): broker {alone['broker_cpu_pct']:.1f} % against "
        f"{alone['nothing_cpu_pct']:.1f} % with nothing: {alone['us_per_telemetry']:.1f} µs/msg"
    )
    nodes = row["redis_nodes"]
    if nodes:
        out.append(
            f"    Redis: {nodes['keys']} node documents, an edge's {nodes['edge_doc_bytes']} B "
            f"(used_memory {row['redis_used_mb']:.1f} MB fleet, "
            f"{row['redis_used_mb_idle']:.1f} idle)"
        )
    for i, pair in enumerate(row["pairs"]):
        on, off = pair["fleet"], pair["idle"]
        out.append(
            f"    pair {i + 1}: broker {on['broker_pct']}|{off['broker_pct']} %, p99 "
            f"{_pair(on['p99_ms'], off['p99_ms'], '.1f')} ms, timeouts "
            f"{on['timeout']}|{off['timeout']}; idle round began {off['drained_s']:.1f} s "
            "after the fleet went quiet (the broker answering promptly again)"
        )
    for path, g in row["get_fleet"].items():
        out.append(
            f"    GET /{path.replace('_limit_', '?limit=')}: {g['ms']:.1f} ms, "
            f"{g['bytes'] / 1024:.0f} KiB, {g['edges']} "
            f"{'samples of edges' if path == 'metrics' else 'edges'} (HTTP {g['status']})"
        )
    cpu = row["cpu_pct"]
    out.append(
        "    CPU % fl|id: "
        + "  ".join(f"{p} {cpu['fleet'][p]}|{cpu['idle'][p]}" for p in cpu["fleet"])
    )
    for mode in ("fleet", "idle"):
        s = row["placements"][mode]
        out.append(
            f"    {mode}: {s['requests']} asked, {s['placed']} placed, {s['refused']} refused "
            f"{s['codes'] or ''}, {s['timeout']} timed out"
        )
    return out


def report(rows: list[dict[str, Any]], args: argparse.Namespace, setup: dict[str, Any]) -> None:
    print(
        f"\nfleet scale: {args.workers} workers, {args.rate:g} placements/s, {args.rounds} pairs "
        f"of {args.seconds:g} s rounds (+{args.settle:g} s settle); nproc {os.cpu_count()}, "
        f"load avg {os.getloadavg()[0]:.2f}; campus written in {setup['write_s']:.1f} s"
    )
    first, last_speed = setup["speed_us"]
    print(
        f"machine speed: the broker's decode of one edge sample took {first:.1f} µs of CPU "
        f"at the start, {last_speed:.1f} at the end (compare runs made at other hours by it)"
    )
    print(" ".join(f"{h:>{w}}" for h, w in COLUMNS))
    for row in rows:
        print(table_row(row))
    print(
        "(CPU %: of one core; machine: all its cores together, every user's; others: the "
        "machine less this run's processes)"
    )
    print(
        "(fl: fleet load on, id: no fleet load; µs/msg: broker CPU per telemetry message, "
        "paired against no fleet load | the fleet alone against nothing; *: broker saturated "
        f"(>= {100 * SATURATED:.0f} % of its one core) in the fleet rounds; {TIMED_OUT}: past "
        "the 50 ms timeout, timeouts counted as never answered)"
    )
    for row in rows:
        print("\n".join(details(row)))
    if args.read_gap_ms or args.pin or args.code:
        print("\n".join(arms_ab(rows)))
    last = rows[-1]
    met = verdict(last)
    print(f"\ntargets at N={label(last)} (the brief's are for 5,000 edges, one broker):")
    for key, ok in met.items():
        print(f"  {key:<26} target {TARGET[key]:<6g} {'met' if ok else 'NOT met'}")
    for row in rows[:-1]:
        print(
            f"  N={label(row)}: "
            + ", ".join(f"{k} {'met' if v else 'not met'}" for k, v in verdict(row).items())
        )
    result = {
        "bench": "fleet_scale",
        "subject": {label(r): _plain(r, "fleet") for r in rows},
        "baseline": {label(r): _plain(r, "idle") for r in rows},
        "ratio": {label(r): {"p99_over_idle": r["p99_over_idle"]} for r in rows},
        "target": TARGET,
        "met": all(met.values()),
        "met_by_n": {label(r): verdict(r) for r in rows},
        "measured": stats.require(
            {
                "placed with fleet load": sum(r["placements"]["fleet"]["placed"] for r in rows),
                "placed without fleet load": sum(r["placements"]["idle"]["placed"] for r in rows),
                "telemetry messages/s": sum(r["telemetry_per_s"] for r in rows),
            }
        ),
        "params": dict(vars(args)),
        "machine": stats.machine("redis") | {"sample_decode_us": setup["speed_us"]},
    }
    print(stats.result_line(result))


def arms_ab(rows: list[dict[str, Any]]) -> list[str]:
    """Each N's arms (read gap, pinned): the broker's µs per telemetry message (paired |
    alone), the fleet rounds' placement p50, p99 and share within 50 ms, one value per arm
    run, in run order."""
    out = ["\nA/B by arm (one value per arm run, in run order):"]
    for n in dict.fromkeys(r["edges"] for r in rows):
        for name in dict.fromkeys(arm(r) for r in rows if r["edges"] == n):
            arms = [r for r in rows if r["edges"] == n and arm(r) == name]
            fl = [a["placements"]["fleet"] for a in arms]
            out.append(
                f"  N={n}{name}: µs/msg "
                + ", ".join(
                    f"{a['broker_us_per_telemetry']:.1f}|{a['alone']['us_per_telemetry']:.1f}"
                    for a in arms
                )
                + "; p50 ms "
                + ", ".join(_ms(f["p50_ms"], ".2f") for f in fl)
                + "; p99 ms "
                + ", ".join(_ms(f["p99_ms"], ".2f") for f in fl)
                + "; within 50 ms "
                + ", ".join(f"{100 * f['within_timeout']:.2f} %" for f in fl)
                + "; broker % "
                + ", ".join(f"{a['broker_cpu_pct']['fleet']:.0f}" for a in arms)
            )
    return out


def _plain(row: dict[str, Any], mode: str) -> dict[str, Any]:
    out = {
        k: row["placements"][mode][k]
        for k in ("p50_ms", "p99_ms", "max_ms", "answered_p99_ms", "within_timeout", "timeout")
    }
    out["broker_cpu_pct"] = row["broker_cpu_pct"][mode]
    out["cpu_pct"] = row["cpu_pct"][mode]
    if mode == "fleet":
        out |= {
            "broker_us_per_telemetry": row["broker_us_per_telemetry"],
            "broker_us_per_telemetry_alone": row["alone"]["us_per_telemetry"],
            "broker_saturated": saturated(row),
            "listed_edges": row["listed_edges"],
            "redis_node_documents": row["redis_nodes"],
            "telemetry_per_s": row["telemetry_per_s"],
            "broker_rss_mb": row["broker_rss_mb"],
            "redis_used_mb": row["redis_used_mb"],
            "get_fleet": row["get_fleet"],
        }
    else:
        out |= {
            "broker_rss_mb": row["broker_rss_mb_idle"],
            "redis_used_mb": row["redis_used_mb_idle"],
        }
    return out


def _capacity_lines(out: dict[str, Any]) -> list[str]:
    lines = [
        f"{'replicas':>8} {'answers/s':>9} {'placed/s':>8} {'refused':>7} {'timeouts':>8} "
        f"{'p99 ms':>7}  replica CPU % / driver CPU % / machine % of all cores"
    ]
    for k, row in out["by_replicas"].items():
        c, s = row["capacity"], row["capacity"]["summary"]
        cpu = " ".join(f"{v:.0f}" for v in c["replica_cpu_pct"].values())
        lines.append(
            f"{k:>8} {c['answers_per_s']:>9.0f} {c['placed_per_s']:>8.0f} {s['refused']:>7} "
            f"{s['timeout']:>8} {_ms(s['p99_ms'], '.1f'):>7}  {cpu} / {c['driver_cpu_pct']:.0f}"
            f" / {c['machine_cpu_pct']:.0f}"
        )
    lines.append("telemetry (CPU % with telemetry|without, per replica):")
    for k, row in out["by_replicas"].items():
        t, p = row["telemetry"], row["telemetry"]["placements"]
        reps = "; ".join(
            f"{b} {v['cpu_pct_fleet']:.0f}|{v['cpu_pct_idle']:.0f} "
            f"({v['us_per_telemetry_sent']:.0f} µs/msg)"
            for b, v in t["replicas"].items()
        )
        lines.append(
            f"  {k}: {t['telemetry_per_s']:.0f} msgs/s from {t['listed_edges']} edges: {reps}"
        )
        cap = t["capacity_msgs_per_s"]
        full = "n/a (saturated)" if cap is None else f"~{cap:.0f} msgs/s"
        lines.append(
            f"     machine {t['machine_cpu_pct']['fleet']:.0f}|{t['machine_cpu_pct']['idle']:.0f} "
            f"% of its cores; a replica's core full at {full}; placements "
            f"p99 {_pair(p['fleet']['p99_ms'], p['idle']['p99_ms'], '.1f')} ms, timeouts "
            f"{p['fleet']['timeout']}|{p['idle']['timeout']}"
        )
    return lines


def _kill_lines(k: dict[str, Any]) -> list[str]:
    lines = [f"SIGKILL of {k['killed']} mid-run: {k['asked']} asked"]
    for name, s in k["periods"].items():
        lines.append(
            f"  {name:<11} {s['requests']:>5} asked, {s['placed']} placed, {s['refused']} "
            f"refused {s['codes'] or ''}, {s['timeout']} unanswered (edge timeout)"
        )
    lines += [
        f"  granted {k['granted']} ({k['granted_by_killed']} by {k['killed']}); not completed "
        f"{k['granted_not_completed']}; GET /jobs/<id> checked {k['api_checked']}, not "
        f"completed {k['api_not_completed_count']} {k['api_not_completed'] or ''}",
        f"  reservations left {k['reservations_left']} (settled in {k['settled_in_s']:.1f} s); "
        f"in-flight records left of completed jobs {k['inflight_records_left_of_completed']}",
        f"  granted by a replica, not received in time: {k['granted_undelivered']} (released "
        f"by the edge {k['undelivered_released_by_edge']}, timed out "
        f"{k['undelivered_never_answered']}; their in-flight records left "
        f"{k['undelivered_inflight_left']})",
        f"  unanswered and decided by no replica (lost with the killed one): "
        f"{k['unanswered_undecided']} {k['unanswered_undecided_by_period']}",
    ]
    return lines


def replicas_report(out: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\nbroker replicas: {args.workers} workers of capacity {args.small_capacity}, service "
        f"{args.replica_service_ms:g} ms; window {args.window}; nproc {os.cpu_count()}, "
        f"load avg {os.getloadavg()[0]:.2f}"
    )
    print("\n".join(_capacity_lines(out)))
    conc, redis = out["concurrency"], out["redis_samples"]
    checks = {
        "no_double_grant": out["replies"]["jobs_placed_twice"] == 0,
        "within_capacity": conc["over_capacity"] == 0 and redis["over_capacity"] == 0,
        "decisions_ge_target": out["decisions"] >= args.decisions,
    }
    print(
        f"double-reservation check over {out['decisions']} decisions ({out['asked']} asked): "
        f"{out['replies']}; most held on one worker at once {conc['max_held']} (capacity "
        f"{args.small_capacity}), over capacity {conc['over_capacity']} times, granted and "
        f"never completed {conc['granted_not_completed']}; Redis {redis['samples']} samples, "
        f"most live reservations {redis['max_live_reservations']}, over capacity "
        f"{redis['over_capacity']}"
    )
    if "kill" in out:
        k = out["kill"]
        print("\n".join(_kill_lines(k)))
        checks["no_lost_placement"] = (
            k["granted_not_completed"] == 0 and k["api_not_completed_count"] == 0
        )
        checks["no_reservation_left"] = k["reservations_left"] == 0
    for name, ok in checks.items():
        print(f"  {name:<22} {'met' if ok else 'NOT met'}")
    claims = {"decisions": out["decisions"]}
    if "kill" in out:
        claims["grants in the kill run"] = out["kill"]["granted"]
    result = {
        "bench": "fleet_replicas",
        "subject": out,
        "checks": checks,
        "met": all(checks.values()),
        "measured": stats.require(claims),
        "params": dict(vars(args)),
        "machine": stats.machine("redis"),
    }
    print(stats.result_line(result))
