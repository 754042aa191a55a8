"""What the broker's HTTP API shows, assembled from the running broker as plain data.

Implements :class:`broker.api.BrokerView` over a :class:`~broker.service.Broker` and its
policy feed: readiness, the fleet (nodes, zones, capabilities, load, health state,
forecast), a job's status and explanation with its placement in flight (attempt, worker,
crashes, dead letter), dead letters, the policy in force, the audit chain's verified head,
and metrics with the fleet and policy gauges refreshed at scrape time
(``broker.exposition``). Reads only; changes nothing.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import asdict
from typing import Any

from broker.audit_check import AuditChecker
from broker.core.shadow import Shadow
from broker.exposition import refresh
from broker.metering import UsageIngest
from broker.params_file import ParamsChoice
from broker.peer_usage import PeerUsage
from broker.service import Broker
from policies import Policy
from sluicegate.policy_feed import PolicyFeed
from sluicegate.transport import Transport

FLEET_PAGE = 1000  # edges GET /fleet shows unless asked for fewer
FLEET_PAGE_MAX = 5000


class HttpView:
    def __init__(
        self,
        broker: Broker,
        feed: PolicyFeed,
        transport: Transport,
        placement: ParamsChoice | None = None,
        audit: AuditChecker | None = None,
        *,
        usage: UsageIngest | None = None,
        peer_usage: PeerUsage | None = None,
    ) -> None:
        self._broker = broker
        self._usage = usage
        self._peer_usage = peer_usage
        self._audit = audit
        self._feed = feed
        self._transport = transport
        self._placement = placement

    async def usage_export(self, from_ms: int, to_ms: int, peer: str = "") -> bytes | None:
        """The signed export of the usage records of ``[from_ms, to_ms]`` (with ``peer``,
        the settlement export with that sister campus); None when this broker takes no
        usage records; ``KeyError`` for a peer the policy does not list."""
        if self._usage is None:
            return None
        if peer:
            if self._peer_usage is None:
                return None
            return await self._peer_usage.export(peer, from_ms, to_ms)
        return await self._usage.export(from_ms, to_ms)

    def health(self) -> dict[str, Any]:
        checks = {
            "mqtt": self._transport.connected,
            "redis": self._broker.redis_ok,
            "policy": self._feed.current is not None,
            # A request sent before the (QoS 0) subscription is acked reaches no replica.
            "placements": self._broker.listening,
        }
        missing = [name for name, ok in checks.items() if not ok]
        detail = {"policy": self._feed.why_none()} if not checks["policy"] else {}
        workers, jobs = self._broker.reaper.carried_over
        return {
            "ready": not missing,
            "checks": checks,
            "missing": missing,
            **detail,
            # Placements in flight this replica found in Redis when it started (a restart).
            "inflight_at_start": {"workers": workers, "jobs": jobs},
        }

    def fleet(self, *, zone: str = "", after: str = "", limit: int = FLEET_PAGE) -> dict[str, Any]:
        """Every worker, and a page of the edges: ``limit`` of them in id order after
        ``after``; both only in zones under ``zone`` (a prefix) when it is given. ``page``
        says how many match and where the next page starts. Each edge is JSON already
        (``EdgeFleet.page``: its sample as it came), for the HTTP layer to splice in."""
        fleet = self._broker.fleet
        workers = []
        zones: dict[str, list[str]] = defaultdict(list)
        for state in fleet.states():
            view = fleet.view(state.worker_id)
            if view is None:
                continue
            caps, latest = state.capabilities, state.latest
            zone_of = caps.zone if caps else None
            if not (zone_of or "").startswith(zone):
                continue
            if zone_of:
                zones[zone_of].append(state.worker_id)
            workers.append(
                {
                    "id": state.worker_id,
                    "online": state.online,
                    "last_seen": state.last_seen,
                    "zone": zone_of,
                    "policy_zone": view.policy_zone,
                    "capabilities": _plain(caps),
                    "load": _plain(latest),
                    "reserved": view.reserved,
                    "health": {
                        "subhealthy": view.health.subhealthy,
                        "why": str(view.health),
                    },
                    "forecast": _plain(view.forecast),
                    "models": dict(view.statuses),
                }
            )
        edges, matching, next_after = self._broker.edge_fleet.page(
            zone=zone, after=after, limit=limit
        )
        page = {"limit": limit, "edges": matching, "next_after": next_after}
        return {"workers": workers, "edges": edges, "zones": dict(zones), "page": page}

    async def job(self, job_id: str) -> dict[str, Any] | None:
        data = await self._broker.job(job_id)
        inflight = await self._broker.inflight.record(job_id)
        if data is None and inflight is None:
            return None
        data = data or {"job_id": job_id}
        if inflight is not None:
            data["inflight"] = inflight
            if "dead_letter" in inflight:
                data["status"] = "dead_letter"
        return data

    async def dead_letters(self, limit: int) -> list[dict[str, Any]]:
        return await self._broker.inflight.dead_letters(limit)

    def policy(self) -> dict[str, Any] | None:
        policy = self._feed.current
        if policy is None:
            return None
        return {
            **policy_facts(policy),
            "classes": sorted(policy.classes),
            "pools": {p.name: {"zone": p.zone, "workers": list(p.workers)} for p in policy.pools},
            "demand": [asdict(d) for d in self._broker.demand()],
        }

    def placement(self) -> dict[str, Any]:
        """The placement parameters in force, their digest and source, and a candidate set
        refused at start (``broker.params_file``)."""
        params = self._broker.params
        chosen = self._placement
        refused = chosen.refused if chosen is not None else None
        return {
            "digest": params.digest(),
            "source": chosen.source if chosen is not None else "settings",
            "params": params.describe(),
            "refused": asdict(refused) if refused is not None else None,
        }

    def shadow(self) -> dict[str, Any] | None:
        """The shadow candidate's comparison with production (None: no candidate)."""
        shadow = self._broker.shadow
        return shadow_facts(shadow) if shadow is not None else None

    def peers(self) -> dict[str, Any]:
        """GET /peers: ``broker.peers.Peers.describe``."""
        return self._broker.peers.describe()

    def audit(self) -> dict[str, Any] | None:
        """The audit chain's verified head and when it was last verified:
        ``{head, records, verified_at, ok, error}`` (None: this broker does not check it)."""
        return self._audit.plain() if self._audit is not None else None

    def metrics(self) -> bytes:
        broker = self._broker
        refresh(
            broker.metrics,
            broker.fleet,
            broker.edges,
            broker.demand(),
            self._feed.current,
            time.time(),
            broker.peers.facts(),
        )
        return broker.metrics.render()


def _plain(value: object) -> Any:
    if value is None:
        return None
    data = asdict(value)  # type: ignore[call-overload]
    return {k: sorted(v) if isinstance(v, frozenset) else v for k, v in data.items()}


def shadow_facts(shadow: Shadow) -> dict[str, Any]:
    """A shadow candidate's comparison with production, as GET /shadow serves it: its label,
    decisions, agreement, outcomes, moves, refusal codes, forbidden placements and recent
    differing decisions."""
    return {"candidate": shadow.label, **shadow.tally.describe()}


def policy_facts(policy: Policy) -> dict[str, Any]:
    """What people are shown of a policy first: campus, version, digest, expiry, zones."""
    return {
        "campus": policy.campus,
        "version": policy.version,
        "digest": policy.digest.hex(),
        "expires": policy.expires,
        "zones": sorted(policy.zones),
    }
