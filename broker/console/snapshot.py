"""The dashboard's document: the campus by zone, per line, per pool, compliance and a shadow
candidate's agreement with production, built from one replica's view of the fleet, the
edges' telemetry, the console's window and the policy in force. Plain dictionaries (JSON
for the page); reads only.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from broker.console.figures import class_matrix, may_run, node_zone
from broker.core.shadow import Shadow
from broker.service import Broker
from broker.view import policy_facts, shadow_facts
from policies.evaluate import kept_on_site
from sluicegate.policy_feed import PolicyFeed

if TYPE_CHECKING:
    from broker.console.board import Console

MOVES_SHOWN = 10  # the shadow candidate's largest moves, by jobs, in each snapshot


def build(console: Console, broker: Broker, feed: PolicyFeed, now: float) -> dict[str, Any]:
    policy = feed.current
    holds = console.holds
    silent_after = broker.settings.telemetry_interval_s * broker.settings.missed_intervals
    workers = _workers(broker, holds, now)
    edges = _edges(broker, holds, now, silent_after)
    zones: dict[str, dict[str, list[Any]]] = defaultdict(lambda: {"workers": [], "edges": []})
    for w in workers:
        zones[w["zone"] or "?"]["workers"].append(w)
    for e in edges:
        zones[e["zone"] or "?"]["edges"].append(e)
    pool_of: dict[str, str] = {}
    if policy is not None:
        pool_of = {w: p.name for p in policy.pools for w in p.workers}
    lines = console.window.lines(now)
    for e in edges:
        line = lines.setdefault(e["id"], {"jobs": 0})
        line.update(zone=e["zone"], paused=e["paused"], online=e["online"])
    zone_of: dict[str, str] = {w["id"]: w["zone"] for w in workers if w["zone"]}
    zone_of.update({e["id"]: e["zone"] for e in edges if e["zone"]})
    edge_zone = {e["id"]: e["zone"] for e in edges if e["zone"]}
    if policy is not None:
        edge_zone.update({e.edge_id: e.zone for e in policy.edges})
    classes: dict[str, Any] = {"classes": [], "zones": [], "cells": [], "forbidden": 0}
    if policy is not None:
        classes = class_matrix(
            console.window.placements(),
            lambda node: node_zone(zone_of, node),
            lambda c, origin, target: may_run(policy, c, origin, target),
            edge_zone,
        )
        prefix = broker.params.campus_prefix
        classes["rules"] = {
            name: {"campus_only": kept_on_site(policy, name, prefix)}
            for name in sorted(policy.classes)
        }
    return {
        "now": now,
        "broker": broker.settings.id,
        "window_s": console.window.window_s,
        "zones": dict(sorted(zones.items())),
        "lines": lines,
        "pools": _pools(console, broker, workers, pool_of, now),
        "compliance": {
            "policy": _policy(policy, now),
            "classes": classes,
            "audit": console.audit_state(),
            "dead_letters": console.dead_letters,
        },
        "shadow": shadow_section(broker.shadow) if broker.shadow is not None else None,
        "peers": peers_section(broker),
        "holds": [asdict(h) for h in sorted(holds.values(), key=lambda h: h.field)],
        "watching": console.watching,
    }


def peers_section(broker: Broker) -> dict[str, Any]:
    """Each sister campus the policy lists: where the agreement stands, what it offers and
    the link (``GET /peers``), the jobs this campus sent it (its asks, by outcome) and took
    from it (by answer: placed, or the refusal's code); and the sister campuses' messages
    refused here, by kind and reason."""
    described = broker.peers.describe()
    sent: dict[str, dict[str, int]] = defaultdict(dict)
    for key, n in broker.forwarder.outcomes.items():
        peer, _, outcome = key.rpartition(".")
        sent[peer][outcome] = n
    taken: dict[str, dict[str, int]] = defaultdict(dict)
    for (peer, answer), n in broker.answers.for_peers.items():
        taken[peer][answer] = n
    peers = [
        {
            **p,
            # The most any one model is offered (the same slots serve every model).
            "free_slots": max((o["free_slots"] for o in p["offers"]), default=0),
            "sent": dict(sorted(sent[p["peer"]].items())),
            "received": dict(sorted(taken[p["peer"]].items())),
        }
        for p in described["peers"]
    ]
    return {"peers": peers, "refused": described["refused"]}


def shadow_section(candidate: Shadow) -> dict[str, Any]:
    """What GET /shadow serves, kept small for a document pushed every second: without the
    recent differing decisions, and only the ``MOVES_SHOWN`` largest moves (most jobs
    first; ``moved_pairs`` says how many pairs there are in all)."""
    facts = shadow_facts(candidate)
    del facts["recent_differences"]
    moved = sorted(facts["moved"], key=lambda m: (-m["jobs"], m["production"], m["candidate"]))
    facts["moved"] = moved[:MOVES_SHOWN]
    facts["moved_pairs"] = len(moved)
    return facts


def _workers(broker: Broker, holds: dict[str, Any], now: float) -> list[dict[str, Any]]:
    fleet = broker.fleet
    out = []
    for state in sorted(fleet.states(), key=lambda s: s.worker_id):
        view = fleet.view(state.worker_id)
        if view is None:
            continue
        caps, latest = state.capabilities, state.latest
        hold = holds.get(f"worker:{state.worker_id}")
        held = (latest.queue_depth + latest.in_flight) if latest is not None else 0
        busy = held + view.reserved
        out.append(
            {
                "id": state.worker_id,
                "zone": view.policy_zone or (caps.zone if caps else None),
                "online": state.online,
                "seen_s_ago": round(now - state.last_seen, 1) if state.last_seen else None,
                "health": "subhealthy" if view.health.subhealthy else "healthy",
                "why": str(view.health) if view.health.subhealthy else None,
                "device_class": caps.device_class if caps else None,
                "providers": sorted(caps.providers) if caps else [],
                "models": dict(view.statuses),
                "utilisation": latest.utilisation if latest else None,
                "memory_used_mb": latest.memory_used_mb if latest else None,
                "memory_total_mb": caps.memory_total_mb if caps else None,
                "queue_depth": latest.queue_depth if latest else None,
                "in_flight": latest.in_flight if latest else None,
                "capacity": latest.capacity if latest else None,
                "reserved": view.reserved,
                "forecast": (
                    {**asdict(view.forecast), "crosses": view.forecast.crosses}
                    if view.forecast
                    else None
                ),
                "hold": hold.kind if hold else None,
                "held_by": hold.by if hold else None,
                "drained": bool(hold and hold.kind == "drain" and busy == 0),
                "jobs_held": busy,
            }
        )
    return out


def _edges(
    broker: Broker, holds: dict[str, Any], now: float, silent_after: float
) -> list[dict[str, Any]]:
    out = []
    for tel in sorted(broker.edges.values(), key=lambda t: t.node):
        hold = holds.get(f"line:{tel.node}")
        out.append(
            {
                "id": tel.node,
                "zone": tel.zone,
                "online": now - tel.ts <= silent_after,
                "seen_s_ago": round(now - tel.ts, 1),
                "queue_depth": tel.queue_depth,
                "queue_capacity": tel.queue_capacity,
                "in_flight": tel.in_flight,
                "cpu_percent": tel.cpu_percent,
                "memory_rss_mb": tel.memory_rss_mb,
                "models": dict(tel.models),
                "finished": {"edge": tel.finished_edge, "pool": tel.finished_pool},
                "policy_version": tel.policy_version,
                "paused": hold is not None,
                "paused_by": hold.by if hold else None,
            }
        )
    return out


def _pools(
    console: Console,
    broker: Broker,
    workers: list[dict[str, Any]],
    pool_of: dict[str, str],
    now: float,
) -> dict[str, Any]:
    figures = console.window.pools(now, lambda w: pool_of.get(w, "?"))
    demand = {d.pool: {k: _finite(v) for k, v in asdict(d).items()} for d in broker.demand()}
    out: dict[str, Any] = {}
    for name in sorted(set(pool_of.values()) | set(figures)):
        members = [w for w in workers if pool_of.get(w["id"], "?") == name]
        online = [w for w in members if w["online"]]
        util = [w["utilisation"] for w in online if w["utilisation"] is not None]
        out[name] = {
            "workers": [w["id"] for w in members],
            "online": len(online),
            "utilisation": round(sum(util) / len(util), 3) if util else None,
            "memory_used_mb": sum(w["memory_used_mb"] or 0.0 for w in online),
            "memory_total_mb": sum(w["memory_total_mb"] or 0.0 for w in online),
            "queue_depth": sum(w["queue_depth"] or 0 for w in online),
            "in_flight": sum(w["in_flight"] or 0 for w in online),
            "demand": demand.get(name),
            **figures.get(name, {"jobs": 0, "jobs_per_s": 0.0, "by_worker": {}, "models": {}}),
        }
    return out


def _policy(policy: Any, now: float) -> dict[str, Any] | None:
    if policy is None:
        return None
    return {
        **policy_facts(policy),
        "expires_in_s": round(policy.expires - now),
        "signers": [s.key_id for s in policy.signers],
        "signer_threshold": policy.signer_threshold,
    }


def _finite(value: Any) -> Any:
    """JSON has no infinity: a ratio with no capacity left shows as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
