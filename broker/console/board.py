"""The operator's console behind the dashboard: the live campus document, operators' actions
and a job's whole story, for one broker replica.

It hears the edges' job records (``sluicegate/v1/edge/+/trace``) and the broker's
completions into a :class:`~broker.console.figures.Window`; keeps the operators' holds in
Redis and applies them to the broker (its own actions at once, other replicas' at the next
sync); releases a dead letter for one retry (its record marked, its edge told to run the
image it kept as a new job); and once a push interval builds one snapshot that every open
dashboard receives, so five dashboards cost what one does. Every action is audited in the
broker's hash-chained log (kind ``operator.<action>``) before it is answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import redis.asyncio as aioredis
from pydantic import ValidationError

from broker import keys
from broker.console import figures
from broker.console.auth import Who
from broker.console.holds import Action, ActionRefused, Hold, act, cordoned, parse_holds, paused
from broker.console.snapshot import build  # the document's shape lives there
from broker.decision_audit import encode
from broker.service import Broker
from policies.redis_stores import audit_stream_key
from sluicegate import topics, wire
from sluicegate.config import ConsoleSettings
from sluicegate.errors import StoreUnavailable, TransportError
from sluicegate.policy_feed import PolicyFeed
from sluicegate.store import reached
from sluicegate.transport import Message, Transport
from sluicegate.wire_pool import JobNotice

log = logging.getLogger(__name__)
DEAD_LETTERS_SHOWN = 20
AUDIT_SCAN = 2000  # audit records searched (newest first) for a job's records
SUBSCRIBER_QUEUE = 4  # snapshots buffered per dashboard; a slow one skips to the newest


class Console:
    def __init__(
        self,
        broker: Broker,
        feed: PolicyFeed,
        transport: Transport,
        redis: aioredis.Redis,
        settings: ConsoleSettings,
        *,
        audit_state: Callable[[], dict[str, Any] | None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._broker = broker
        self._feed = feed
        self._transport = transport
        self._redis = redis
        self.settings = settings
        self._audit_state = audit_state
        self._clock = clock
        self.window = figures.Window(settings.window_s)
        self.holds: dict[str, Hold] = {}
        self._dead: dict[str, Any] = {"count": 0, "recent": []}
        self._subscribers: set[asyncio.Queue[str]] = set()
        self.latest: str | None = None  # the last snapshot pushed, JSON
        self.build_ms = 0.0  # what building and encoding the last one took
        broker.completion_listeners.append(self.window.add_completion)

    # -- intake ----------------------------------------------------------------------------

    def on_trace(self, msg: Message) -> None:
        try:
            trace = wire.EdgeTrace.model_validate_json(msg.payload)
        except ValidationError as exc:
            log.warning("ignored a malformed job trace on %s: %s", msg.topic, str(exc)[:200])
            return
        if trace.node == topics.node_of(msg.topic):  # only an edge speaks for itself
            self.window.add_trace(trace, self._clock())

    # -- holds -----------------------------------------------------------------------------

    async def sync_holds(self) -> None:
        """Read the holds in force from Redis and apply them to this replica."""
        with reached("read the operators' holds"):
            raw = await self._redis.hgetall(keys.operator_holds())
        self._apply(parse_holds(raw))

    def _apply(self, holds: dict[str, Hold]) -> None:
        self.holds = holds
        why = {
            edge: f"offload from {edge} paused by {h.by}" + (f": {h.note}" if h.note else "")
            for edge, h in paused(holds).items()
        }
        self._broker.hold(frozenset(cordoned(holds)), why)

    async def act(self, who: Who, body: bytes) -> dict[str, Any]:
        """Take an operator's action (JSON ``{action, target, note}``); raises
        :class:`ActionRefused` with the status and why."""
        try:
            action = Action.model_validate_json(body)
        except ValidationError as exc:
            raise ActionRefused(400, f"bad action: {_first_error(exc)}") from None
        if action.action == "release":
            return await self._release(who, action)
        policy = self._feed.current
        if policy is None:
            raise ActionRefused(503, "the broker holds no verified policy")
        await self.sync_holds()
        outcome = act(
            action,
            by=who.name,
            now=self._clock(),
            holds=self.holds,
            workers=policy.worker_zones,
            edges=policy.edges_by_id,
        )
        with reached("store the operator's action"):
            if outcome.put is not None:
                await self._redis.hset(keys.operator_holds(), outcome.put.field, outcome.put.dump())
            if outcome.lift is not None:
                await self._redis.hdel(keys.operator_holds(), outcome.lift)
        self._broker.audit.add(action.target, encode(outcome.record), f"operator.{action.action}")
        await self.sync_holds()
        log.warning("operator %s: %s %s %s", who.name, action.action, action.target, action.note)
        return {"ok": True, **outcome.record}

    async def _release(self, who: Who, action: Action) -> dict[str, Any]:
        """Release a dead letter for one retry: listed as released, audited, and its edge
        told to run the image it kept as a new job (``<job id>.retry``)."""
        job_id = action.target
        now = self._clock()
        released = await self._broker.inflight.release_dead_letter(job_id, who.name, now)
        if isinstance(released, str):
            raise ActionRefused(409 if "already" in released else 404, released)
        if not released["edge"]:  # every placement records its edge; an old record may not
            raise ActionRefused(409, f"release: dead letter {job_id!r} names no edge to tell")
        retry = released["retry_id"]
        record = {"action": "release", "target": job_id, "job_id": job_id, "by": who.name}
        record["note"] = action.note
        record |= {"retry_id": retry, "edge": released["edge"]}
        self._broker.audit.add(job_id, encode(record), "operator.release")
        why = f"released by {who.name} for one retry" + (f": {action.note}" if action.note else "")
        notice = JobNotice(
            job_id=job_id,
            attempt=released["attempt"] or 1,
            kind="released",
            worker_id=released["worker"] or "",
            crashes=released["crashes"],
            reason=why,
            retry_id=retry,
        )
        message = Message(
            topics.edge_notices(released["edge"]),
            wire.dump(notice),
            qos=1,
            content_type=wire.RESULT_CONTENT_TYPE,
            user_properties=((topics.PROP_JOB_ID, job_id),),
        )
        try:
            await self._transport.publish(message, wait=True)
        except TransportError as exc:
            raise ActionRefused(
                503, f"release of {job_id!r} recorded, but its edge was not told: {exc}"
            ) from exc
        recent = [d for d in self._dead["recent"] if d.get("job_id") != job_id]
        self._dead = {"count": max(0, self._dead["count"] - 1), "recent": recent}
        log.warning("operator %s released dead letter %s as %s", who.name, job_id, retry)
        return {"ok": True, **record}

    # -- the live document ------------------------------------------------------------------

    def subscribe(self) -> asyncio.Queue[str]:
        queue: asyncio.Queue[str] = asyncio.Queue(SUBSCRIBER_QUEUE)
        self._subscribers.add(queue)
        if self.latest is not None:
            queue.put_nowait(self.latest)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[str]) -> None:
        self._subscribers.discard(queue)

    def close(self) -> None:
        """End every open live stream (an empty message), before the HTTP server stops."""
        for queue in self._subscribers:
            with contextlib.suppress(asyncio.QueueEmpty):
                queue.get_nowait()
            queue.put_nowait("")

    @property
    def watching(self) -> int:
        return len(self._subscribers)

    async def run(self) -> None:
        """Sync holds, refresh dead letters, push a snapshot to open dashboards; repeat."""
        every = self.settings.push_interval_s
        tick = 0
        while True:
            try:
                await self.sync_holds()
                if tick % 5 == 0:
                    await self._refresh_dead_letters()
            except StoreUnavailable as exc:
                log.warning("console: %s", exc)
            if self._subscribers:
                started = time.perf_counter()
                document = self.snapshot()
                document["build_ms"] = self.build_ms
                self._push(json.dumps(document, default=str, separators=(",", ":")))
                self.build_ms = round((time.perf_counter() - started) * 1000.0, 3)
            tick += 1
            await asyncio.sleep(every)

    def _push(self, text: str) -> None:
        self.latest = text
        for queue in self._subscribers:
            if queue.full():
                with contextlib.suppress(asyncio.QueueEmpty):
                    queue.get_nowait()
            queue.put_nowait(text)

    async def _refresh_dead_letters(self) -> None:
        recent = await self._broker.inflight.dead_letters(DEAD_LETTERS_SHOWN)
        with reached("count the dead letters"):
            count = int(await self._redis.zcard(keys.dead_letters()))
        self._dead = {"count": count, "recent": recent}

    def snapshot(self) -> dict[str, Any]:
        return build(self, self._broker, self._feed, self._clock())

    @property
    def dead_letters(self) -> dict[str, Any]:
        return self._dead

    def audit_state(self) -> dict[str, Any] | None:
        return self._audit_state() if self._audit_state is not None else None

    # -- a job -------------------------------------------------------------------------------

    async def job(self, job_id: str, decision: dict[str, Any] | None) -> dict[str, Any]:
        """The job's decision and placement (from the broker), its audit records, and its
        record from the edge, if still in the window."""
        out: dict[str, Any] = {"job_id": job_id, "placement": decision}
        out["audit"] = await self._audit_records(job_id)
        seen = self.window.find(job_id)
        out["edge_record"] = (
            {"edge": seen.edge, **seen.job.model_dump()} if seen is not None else None
        )
        out["path"] = _path(out)
        return out

    async def _audit_records(self, job_id: str) -> list[dict[str, Any]]:
        stream = audit_stream_key(self._broker.settings.id)
        with reached("read the audit log"):
            rows = await self._redis.xrevrange(stream, count=AUDIT_SCAN)
        found = []
        for _id, fields in rows or []:
            entry = next(iter((fields or {}).values()), b"")
            with contextlib.suppress(ValueError):
                record = json.loads(entry)
                data = record.get("data", {})
                if job_id not in str(data.get("jobs", "")).split(",") and not _names_job(
                    record, job_id
                ):
                    continue
                found.append(_audit_entry(record, job_id))
        return found[::-1]


def _names_job(record: dict[str, Any], job_id: str) -> bool:
    return str(record.get("kind", "")).startswith("operator.") and job_id in str(record)


def _audit_entry(record: dict[str, Any], job_id: str) -> dict[str, Any]:
    data = record.get("data", {})
    mine: Any = None
    with contextlib.suppress(ValueError, TypeError):
        decisions = json.loads(data.get("decisions", "[]"))
        mine = [d for d in decisions if isinstance(d, dict) and d.get("job_id") == job_id]
    return {
        "seq": record.get("seq"),
        "t": record.get("t"),
        "kind": record.get("kind"),
        "entries": mine if mine else None,
        "data": None if mine else data,
    }


def _path(job: dict[str, Any]) -> list[str]:
    """The job's path in words: edge, decision, worker, outcome."""
    steps: list[str] = []
    edge = job.get("edge_record") or {}
    placement = job.get("placement") or {}
    if edge:
        steps.append(f"received on {edge['edge']}")
    if placement:
        status = str(placement.get("status", ""))
        if placement.get("worker") and status != "refused":
            steps.append(
                f"placed on {placement['worker']} (attempt {placement.get('attempt', 1)}): {status}"
            )
        elif placement.get("code"):
            steps.append(f"refused ({placement['code']}): it stayed on its line PC")
    if edge:
        ran = edge.get("ran_on")
        where = "a pool worker" if edge.get("offloaded") else "the line PC"
        steps.append(f"ran on {ran} ({where})" if ran else f"did not run ({edge.get('code')})")
        steps.append(f"answered {edge.get('status')} after {edge.get('latency_ms')} ms")
    return steps


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    return f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}"


def hold_view(hold: Hold) -> dict[str, Any]:
    return asdict(hold)
