"""The campus broker's asyncio shell: MQTT and Redis in, the placement core, tokens out.

It feeds the pure :class:`~broker.fleet.Fleet` from worker capabilities, telemetry, status
and completion records; answers each placement request (job metadata and the image's hash,
never the image) with a signed token or a refusal that says why; and keeps what other
replicas and a restart need in Redis: atomic reservations, node documents that expire when
a node goes silent, each job's status and explanation. Requests are decided in batches —
whatever arrived while the previous batch was in Redis — so a burst costs one round trip.
Every decision is written to the signed, hash-chained audit log. It decides nothing itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import redis.asyncio as aioredis
from pydantic import BaseModel, ValidationError

from broker import keys
from broker.decision import Decision, Placed, as_record
from broker.fleet import Fleet
from broker.metrics import BrokerMetrics
from broker.params import FleetParams, PlacementParams
from broker.placement import decide
from broker.reservations import Hold, Reservations
from policies import AsyncAuditWriter, Policy, SigningKey, mint
from policies.errors import PolicyError
from sluicegate import topics, wire
from sluicegate.config import BrokerSettings
from sluicegate.transport import Message, Transport
from sluicegate.vision.manifest import Requirements
from sluicegate.wire_pool import (
    Completion,
    PlacementReply,
    PlacementRequest,
    WorkerCapabilities,
    WorkerTelemetry,
)

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
MAX_ATTEMPTS = 3  # decisions per request when another replica took the chosen slot
JOB_TTL_S = 24 * 3600  # how long a job's status and explanation stay queryable


@dataclass
class _Pending:
    request: PlacementRequest
    reply_topic: str
    correlation: bytes | None
    arrived: float  # perf_counter


def status_message(settings: BrokerSettings, state: Literal["online", "offline"]) -> bytes:
    """The broker's retained status; the offline copy is its Last Will."""
    return wire.dump(wire.NodeStatus(node=settings.id, kind="broker", zone="", state=state))


class Broker:
    """One broker replica. Create, then ``await run(stop)``."""

    def __init__(
        self,
        settings: BrokerSettings,
        transport: Transport,
        redis: aioredis.Redis,
        key: SigningKey,
        policy: Callable[[], Policy | None],
        audit: AsyncAuditWriter,
        *,
        requirements: dict[str, Requirements] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self._transport = transport
        self._redis = redis
        self._key = key
        self._policy = policy
        self._audit = audit
        self._clock = clock
        self.fleet = Fleet(FleetParams.from_settings(settings), requirements or {})
        self.params = PlacementParams.from_settings(settings)
        self.reservations = Reservations(redis)
        self.metrics = BrokerMetrics()
        self.edges: dict[str, wire.EdgeTelemetry] = {}
        self._inbox: asyncio.Queue[_Pending] = asyncio.Queue()
        self._audit_queue: asyncio.Queue[tuple[str, dict[str, Any], float]] = asyncio.Queue()
        self._node_docs: dict[str, bytes] = {}  # latest document per node, flushed to Redis
        self._ops: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []  # Redis writes
        self._ops_wanted = asyncio.Event()
        self.redis_ok = False

    # -- intake (event loop, quick) --------------------------------------------------------

    def on_request(self, msg: Message) -> None:
        reply_topic = msg.response_topic
        try:
            request = PlacementRequest.model_validate_json(msg.payload)
        except ValidationError as exc:
            if reply_topic:
                bad = PlacementReply(
                    job_id="?", status="refused", code="bad_request", reason=f"{exc}"[:500]
                )
                self._reply(reply_topic, msg.correlation_data, bad)
            return
        if not reply_topic:
            log.warning("placement request for %s has no Response Topic", request.job_id)
            return
        self._inbox.put_nowait(
            _Pending(request, reply_topic, msg.correlation_data, time.perf_counter())
        )

    def on_capabilities(self, msg: Message) -> None:
        caps = _parse(WorkerCapabilities, msg)
        if caps is not None:
            self.fleet.apply_capabilities(caps, self._clock())
            self._node_docs[f"{caps.worker_id}:capabilities"] = msg.payload

    def on_worker_telemetry(self, msg: Message) -> None:
        tel = _parse(WorkerTelemetry, msg)
        if tel is not None:
            self.fleet.apply_telemetry(tel, self._clock())
            self._node_docs[f"{tel.node}:telemetry"] = msg.payload

    def on_worker_status(self, msg: Message) -> None:
        status = _parse(wire.NodeStatus, msg)
        if status is not None and status.state == "offline":
            lost = self.fleet.mark_offline(status.node, self._clock())
            for job_id in lost:
                self._job_status(job_id, {"status": "worker_lost", "worker": status.node})
            log.warning(
                "worker %s went offline; %d placed jobs lost with it", status.node, len(lost)
            )

    def on_completion(self, msg: Message) -> None:
        done = _parse(Completion, msg)
        if done is None:
            return
        self.fleet.apply_completion(done, self._clock())
        self.metrics.completions.labels(done.status).inc()
        self.metrics.job_seconds.observe(done.service_ms / 1000.0)
        self._write("zrem", keys.reservations(done.worker_id), done.job_id)
        self._job_status(done.job_id, {"status": f"completed:{done.status}"})

    def on_edge_telemetry(self, msg: Message) -> None:
        tel = _parse(wire.EdgeTelemetry, msg)
        if tel is not None:
            self.edges[tel.node] = tel
            self._node_docs[f"{tel.node}:telemetry"] = msg.payload

    # -- deciding ------------------------------------------------------------------------------

    async def _placer(self) -> None:
        """Decide whatever has arrived, reserve in one Redis round trip, reply, repeat."""
        while True:
            batch = [await self._inbox.get()]
            while not self._inbox.empty():
                batch.append(self._inbox.get_nowait())
            try:
                await self._place_batch(batch)
            except Exception:
                log.exception("placement batch failed; refusing its %d requests", len(batch))
                for item in batch:
                    self._answer(item, None, "broker_error", "the broker failed; run locally")

    async def _place_batch(self, batch: list[_Pending]) -> None:
        policy = self._policy()
        todo = batch
        for _attempt in range(MAX_ATTEMPTS):
            if not todo:
                return
            now = self._clock()
            placed: list[tuple[_Pending, Placed]] = []
            for item in todo:
                if policy is None:
                    self._answer(item, None, "no_policy", "the broker holds no verified policy")
                    continue
                decision = decide(self.fleet, item.request, policy, now=now, params=self.params)
                if isinstance(decision, Placed):
                    self.fleet.reserve(decision.worker_id, item.request.job_id, now)
                    placed.append((item, decision))
                else:
                    self._answer(item, decision, decision.code, decision.reason)
            todo = []
            holds = [self._hold(item.request, d, now) for item, d in placed]
            try:
                granted = await self.reservations.reserve_many(holds, int(now * 1000))
                self.redis_ok = True
            except Exception as exc:  # Redis down: no reservation, no placement
                self.redis_ok = False
                for item, decision in placed:
                    self.fleet.release(item.request.job_id)
                    self._answer(item, decision, "broker_unavailable", f"Redis unavailable: {exc}")
                return
            for (item, decision), ok in zip(placed, granted, strict=True):
                if ok:
                    self._grant(item, decision, policy)
                else:  # another replica filled the slot first: decide again
                    self.fleet.release(item.request.job_id)
                    todo.append(item)
        for item in todo:
            self._answer(item, None, "no_capacity", "workers filled up while placing; run locally")

    def _hold(self, request: PlacementRequest, decision: Placed, now: float) -> Hold:
        state = self.fleet.state(decision.worker_id)
        latest = state.latest if state is not None else None
        capacity = latest.capacity if latest is not None else 1
        horizon = self.settings.token_ttl_s
        if request.deadline_at is not None:
            horizon = max(horizon, request.deadline_at - now)
        until_ms = int((now + horizon + 5.0) * 1000)
        return Hold(decision.worker_id, request.job_id, capacity, until_ms)

    def _grant(self, item: _Pending, decision: Placed, policy: Policy | None) -> None:
        assert policy is not None
        req = item.request
        try:
            token = mint(
                policy,
                self._key,
                job_id=req.job_id,
                payload_sha256=bytes.fromhex(req.payload_sha256),
                data_class=req.data_class,
                origin_zone=req.origin_zone,
                target_worker=decision.worker_id,
                now=self._clock(),
                ttl_s=self.settings.token_ttl_s,
            )
        except PolicyError as exc:  # the core and the policy library disagree: refuse
            self.fleet.release(req.job_id)
            self._write("zrem", keys.reservations(decision.worker_id), req.job_id)
            self._answer(item, decision, exc.reason, f"token not minted: {exc}")
            return
        reply = PlacementReply(
            job_id=req.job_id,
            status="placed",
            token=token,
            worker_id=decision.worker_id,
            worker_zone=decision.zone,
            work_topic=topics.pool_work(decision.zone, decision.worker_id),
            predicted_ms=round(decision.predicted_ms, 3),
            broker_id=self.settings.id,
        )
        self._finish(item, decision, reply)

    def _answer(self, item: _Pending, decision: Decision | None, code: str, reason: str) -> None:
        reply = PlacementReply(
            job_id=item.request.job_id,
            status="refused",
            code=code,
            reason=reason,
            broker_id=self.settings.id,
        )
        self.metrics.refusals.labels(code).inc()
        self._finish(item, decision, reply)

    def _finish(self, item: _Pending, decision: Decision | None, reply: PlacementReply) -> None:
        self._reply(item.reply_topic, item.correlation, reply)
        self.metrics.decisions.labels(reply.status).inc()
        self.metrics.decision_seconds.observe(time.perf_counter() - item.arrived)
        req = item.request
        record: dict[str, Any] = {
            "job_id": req.job_id,
            "status": reply.status,
            "edge": req.edge_id,
            "origin_zone": req.origin_zone,
            "data_class": req.data_class,
            "model": req.model,
            "worker": reply.worker_id,
            "code": reply.code,
            "reason": reply.reason,
        }
        explanation = as_record(decision) if decision is not None else None
        self._audit_queue.put_nowait(
            ("placement", {**record, "why": json.dumps(explanation, default=str)}, self._clock())
        )
        self._job_status(req.job_id, {**record, "decision": explanation})

    def _reply(self, topic: str, correlation: bytes | None, reply: PlacementReply) -> None:
        self._transport.publish_nowait(
            topic,
            wire.dump(reply),
            qos=1,
            correlation_data=correlation,
            content_type=wire.RESULT_CONTENT_TYPE,
        )

    # -- Redis upkeep and the audit log ----------------------------------------------------

    def _write(self, command: str, *args: Any, **kwargs: Any) -> None:
        """Queue a Redis command; the writer sends everything queued in one pipeline."""
        self._ops.append((command, args, kwargs))
        self._ops_wanted.set()

    def _job_status(self, job_id: str, fields: dict[str, Any]) -> None:
        data = {k: json.dumps(v, default=str) for k, v in fields.items() if v is not None}
        self._write("hset", keys.job(job_id), mapping=data)
        self._write("expire", keys.job(job_id), JOB_TTL_S)

    async def _writer(self) -> None:
        while True:
            await self._ops_wanted.wait()
            self._ops_wanted.clear()
            ops, self._ops = self._ops, []
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for command, args, kwargs in ops:
                        getattr(pipe, command)(*args, **kwargs)
                    await pipe.execute()
                self.redis_ok = True
            except Exception as exc:
                self.redis_ok = False
                log.warning("Redis write of %d operations failed: %s", len(ops), exc)

    def demand(self) -> dict[str, float]:
        """Per pool zone, the load the forecast expects over the capacity there: a scaling
        signal (above 1.0, the zone needs more workers)."""
        totals: dict[str, list[float]] = {}
        for state in self.fleet.states():
            view = self.fleet.view(state.worker_id)
            if (
                view is None
                or not state.online
                or view.forecast is None
                or view.policy_zone is None
            ):
                continue
            totals.setdefault(view.policy_zone, []).append(view.forecast.predicted)
        return {zone: sum(loads) / len(loads) for zone, loads in totals.items()}

    async def job(self, job_id: str) -> dict[str, Any] | None:
        raw = await self._redis.hgetall(keys.job(job_id))
        if not raw:
            return None
        return {_text(k): json.loads(v) for k, v in raw.items()}

    async def _auditor(self) -> None:
        while True:
            kind, data, now = await self._audit_queue.get()
            flat = {
                k: v if isinstance(v, str | int | float | bool) or v is None else str(v)
                for k, v in data.items()
            }
            try:
                await self._audit.append(kind, flat, now=now)
            except Exception:
                log.exception("audit append failed for %s", data.get("job_id"))

    async def _housekeeping(self) -> None:
        interval = self.settings.telemetry_interval_s
        ttl_ms = int(interval * self.settings.missed_intervals * 1000)
        while True:
            await asyncio.sleep(min(interval, 1.0))
            self.fleet.expire(self._clock(), self.params.stale_after_s)
            docs, self._node_docs = self._node_docs, {}
            for name, payload in docs.items():
                node, kind = name.rsplit(":", 1)
                self._write("hset", keys.node(node), kind, payload)
                self._write("pexpire", keys.node(node), ttl_ms)
            self._write("ping")

    # -- lifecycle -----------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set."""
        t = self._transport
        await t.subscribe(topics.worker_all("capabilities"), self.on_capabilities)
        await t.subscribe(topics.worker_all("telemetry"), self.on_worker_telemetry, qos=0)
        await t.subscribe(topics.worker_all("status"), self.on_worker_status)
        await t.subscribe(topics.completions(), self.on_completion)
        await t.subscribe(topics.edge_telemetry_all(), self.on_edge_telemetry, qos=0)
        await t.subscribe(topics.placement_requests_shared(), self.on_request)

        def announce() -> None:
            t.publish_nowait(
                topics.broker_status(self.settings.id),
                status_message(self.settings, "online"),
                qos=1,
                retain=True,
            )

        t.on_connect(announce)
        if t.connected:
            announce()
        tasks = [
            asyncio.ensure_future(self._placer()),
            asyncio.ensure_future(self._auditor()),
            asyncio.ensure_future(self._housekeeping()),
            asyncio.ensure_future(self._writer()),
        ]
        log.info("broker %s serving placements", self.settings.id)
        try:
            await stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    t.publish(
                        topics.broker_status(self.settings.id),
                        status_message(self.settings, "offline"),
                        qos=1,
                        retain=True,
                        wait=True,
                    ),
                    2.0,
                )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _parse(model: type[M], msg: Message) -> M | None:
    try:
        return model.model_validate_json(msg.payload)
    except ValidationError as exc:
        log.warning("ignored a malformed message on %s: %s", msg.topic, str(exc)[:300])
        return None
