"""The edge agent: MQTT in, the outbox on disk, ONNX Runtime in an executor, results out,
exactly one per accepted job whatever crashes.

This module puts the parts together and runs them: it opens the outbox and replays what it
holds, subscribes (returns and notices first, then the submit topic with manual
acknowledgement), announces the edge online, runs the housekeeping timers (telemetry with
the concluded jobs' records, the sweep of overdue offloads, pruning), and drains or dies.
Every decision about a job is the lifecycle table's (``edge_agent.lifecycle``), carried out
by the dispatcher (``edge_agent.dispatch``); ``docs/architecture.md`` follows one job
through them. It must never block the event loop and never let one bad message stop the
rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

import psutil

from edge_agent.answers import Answers
from edge_agent.compute import Compute
from edge_agent.dispatch import Dispatcher
from edge_agent.metering import EdgeMetering
from edge_agent.metrics import EdgeFigures
from edge_agent.offload import PlacementClient
from edge_agent.outbox import Outbox
from edge_agent.reporting import Load, status_message, telemetry
from edge_agent.schedule import Schedule
from edge_agent.tally import Tally
from sluicegate import topics, wire
from sluicegate.config import EdgeSettings, OffloadSettings
from sluicegate.errors import TransportError, WireError
from sluicegate.late_subscription import LateSubscription
from sluicegate.metering.meter import Meter
from sluicegate.node_metrics import MetricsServer
from sluicegate.policy_feed import PolicyFeed
from sluicegate.transport import Message, Transport
from sluicegate.vision.openvino_session import backend_of
from sluicegate.vision.runtime import ModelRegistry
from sluicegate.vision.watch import ModelWatcher
from sluicegate.wire_peer import unwrap

log = logging.getLogger(__name__)
CPU = "CPUExecutionProvider"  # what runs the models when [edge] providers names none

PRUNE_INTERVAL_S = 60.0
# Offloaded jobs are looked at this often: a job whose worker went silent joins the local
# queue within this much of the moment a run here is still in time for its deadline.
SWEEP_S = 0.02


class EdgeAgent:
    """One line PC's agent. Create, then ``await run(stop)``.

    Without an ``outbox`` the agent keeps its jobs in an in-memory SQLite database: fine for
    tests and embedding, not durable (``edge_agent.service`` always gives it a file).
    """

    def __init__(
        self,
        settings: EdgeSettings,
        transport: Transport,
        registry: ModelRegistry,
        *,
        clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] = lambda: uuid.uuid4().hex,
        offload: PlacementClient | None = None,
        offload_settings: OffloadSettings | None = None,
        outbox: Outbox | None = None,
        executor: Executor | None = None,
        feed: PolicyFeed | None = None,
        models_dir: Path | None = None,
        meter: Meter | None = None,
    ) -> None:
        """``meter``: the edge's usage ledger and its shipper (none: nothing metered)."""
        topics.check_id("edge id", settings.id)
        self.settings = settings
        self._transport = transport
        self._feed = feed
        self._clock = clock
        self._offload_settings = offload_settings or OffloadSettings()
        self._models = registry  # what it serves now: a reload changes it in place
        # The folder ``registry`` was loaded from, watched for new versions.
        self.watcher = (
            ModelWatcher(
                registry,
                models_dir,
                interval_s=settings.models_reload_s,
                providers=settings.providers,
                intra_op_threads=settings.intra_op_threads,
            )
            if models_dir is not None and settings.models_reload_s > 0
            else None
        )
        self._process = psutil.Process()
        self._cpu_percent = 0.0  # the last telemetry's reading
        self._halted = asyncio.Event()
        self._placement = offload
        # Sister campuses' workers' returns, once the policy lets this campus send them work.
        self._peer_returns = LateSubscription(
            transport,
            self._peer_returns_topic,
            self.on_peer_return,
            what="sister campuses' returns",
            manual_ack=True,
        )
        self.ready = asyncio.Event()  # set once subscribed and announced online
        self.metrics: MetricsServer | None = None  # its /metrics, while the service serves it
        self.outbox = outbox or Outbox(
            ":memory:",
            result_retention_s=settings.result_retention_s,
            tombstone_s=settings.tombstone_s,
            max_tombstones=settings.max_tombstones,
            clock=clock,
        )
        ran_on = wire.RanOn(kind="edge", node=settings.id, zone=settings.zone)
        self._answers = Answers(transport, self.outbox, ran_on)
        self._compute = Compute(settings, registry, clock, executor)
        self.service_times = self._compute.service_times
        self.metering = (
            EdgeMetering(
                meter,
                edge_id=settings.id,
                zone=settings.zone,
                device_class=settings.device_class,
                backend=backend_of(settings.providers[0] if settings.providers else CPU),
                policy=(lambda: feed.current) if feed is not None else (lambda: None),
                model_sha256=self._compute.model_sha256,
            )
            if meter is not None
            else None
        )
        self._jobs = Dispatcher(
            settings,
            self._offload_settings,
            transport=transport,
            outbox=self.outbox,
            compute=self._compute,
            answers=self._answers,
            placement=offload,
            feed=feed,
            models=self._models,
            clock=clock,
            new_id=new_id,
            ran_on=ran_on,
            metering=self.metering,
        )
        self.schedule = Schedule(
            edge_id=settings.id,
            zone=settings.zone,
            transport=transport,
            models=self._models.names,
            local_per_s=self._local_per_s,
            policy=(lambda: feed.current) if feed is not None else (lambda: None),
            clock=clock,
        )
        self.counters: Counter[str] = self._jobs.counters
        self.on_message = self._jobs.on_message
        self.on_return = self._jobs.on_return
        self.on_notice = self._jobs.on_notice

    def _local_per_s(self, model: str) -> float:
        """Images a second of ``model`` this edge runs when busy (0: not measured yet)."""
        service_s = self.service_times.estimate(model)
        return self.settings.concurrency / service_s if service_s else 0.0

    @property
    def results(self) -> Counter[str]:
        """Answers given, by status (refusals included; republished results not)."""
        return self._answers.results

    @property
    def metrics_url(self) -> str | None:
        """Where this agent's ``/metrics`` is served now (None: not served)."""
        return self.metrics.url if self.metrics is not None else None

    @property
    def dropped_no_response_topic(self) -> int:
        return self._answers.dropped_no_response_topic

    @property
    def offloaded(self) -> int:
        """Work messages sent to pool workers since start."""
        return self._jobs.offloaded

    @property
    def unfinished(self) -> int:
        """Jobs accepted (or being accepted) and not yet concluded."""
        return len(self._jobs.table)

    async def drained(self, timeout: float) -> None:
        """Wait until no job is unfinished (``TimeoutError`` after ``timeout`` seconds): a
        result may reach its app before its commit, the job ends with the commit."""
        await asyncio.wait_for(self._jobs.idle.wait(), timeout)

    @property
    def delivering(self) -> int:
        """Results published and not yet acked by the broker."""
        return self._answers.delivering

    def check_offloaded(self) -> None:
        """Reroute offloaded jobs whose return is overdue; runs every fraction of
        ``result_timeout_s``, callable directly in tests."""
        self._jobs.sweep()

    # -- telemetry and status -----------------------------------------------------------------

    def telemetry(self) -> wire.EdgeTelemetry:
        self._cpu_percent = self._process.cpu_percent(None)
        return telemetry(self.settings, self._load())

    def scrape(self) -> EdgeFigures:
        """What ``/metrics`` reads: the telemetry's figures now (its CPU reading the last
        telemetry's, so a scrape never shortens the next one's interval), and the
        concluded jobs' figures."""
        return EdgeFigures(self._load(), self._jobs.figures)

    def _load(self) -> Load:
        census = self._jobs.table.census
        return Load(
            now=self._clock(),
            queue_depth=self._jobs.waiting,
            in_flight=self._jobs.in_flight,
            models=self.service_times.snapshot(),
            cpu_percent=self._cpu_percent,
            memory_rss_bytes=self._process.memory_info().rss,
            memory_percent=self._process.memory_percent(),
            results=self._answers.results,
            finished=self._answers.finished,
            dropped_no_response_topic=self._answers.dropped_no_response_topic,
            offloaded=self.offloaded,
            offload_pending=census["offering"],
            events={**self.counters, Tally.RESULTS_REFUSED.value: self._answers.refused},
            policy_version=self._feed.held.version if self._feed and self._feed.held else None,
            policy_refused=self._feed.refused if self._feed is not None else {},
            prediction=self._jobs.prediction.snapshot(),
        )

    async def _every(self, interval_s: float, action: Callable[[], object]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                result = action()
                if asyncio.isfuture(result) or asyncio.iscoroutine(result):
                    await result
            except Exception as exc:  # housekeeping never stops the agent
                log.warning("periodic %s failed: %s", getattr(action, "__name__", action), exc)

    def _publish_telemetry(self) -> None:
        if self._transport.connected:
            self._publish_trace()  # first: a recorder that hears the telemetry has the records
            topic = topics.edge_telemetry(self.settings.id)
            with contextlib.suppress(TransportError):  # QoS 0: the next one follows soon
                self._transport.publish_nowait(Message(topic, wire.dump(self.telemetry()), qos=0))

    def _publish_trace(self) -> None:
        """The records of the jobs concluded since the last telemetry, if any (QoS 0: a
        recorder that misses them sees a gap; the agent never waits for one)."""
        trace = self._jobs.trace
        batch = trace.take() if trace is not None else None
        if batch is not None:
            topic = topics.edge_trace(self.settings.id)
            with contextlib.suppress(TransportError):
                self._transport.publish_nowait(Message(topic, wire.dump(batch), qos=0))

    def _announce_online(self) -> None:
        self._transport.publish_nowait(
            Message(
                topics.edge_status(self.settings.id),
                status_message(self.settings, "online"),
                qos=1,
                retain=True,
            )
        )

    # -- lifecycle ---------------------------------------------------------------------------------

    def kill(self) -> None:
        """Stop at once, as a killed process would: nothing more is written, published or
        acked; what is on disk is what a restart finds. (Crash tests; fatal errors.)"""
        self._jobs.mode = "killed"
        self.outbox.kill()
        self._answers.cancel()
        self._compute.kill()
        self._halted.set()

    async def run(self, stop: asyncio.Event, *, drain_timeout: float = 10.0) -> None:
        """Serve until ``stop`` is set, then answer what is queued and go offline."""
        stored = await self.outbox.open()
        if self.metering is not None:
            await self.metering.meter.start()
        await self._compute.start()
        self._process.cpu_percent(None)  # prime: the first reading is always 0
        # Tracked before the returns and notices about them can come.
        self._jobs.replay(stored)
        if stored:
            log.info("replaying %d unfinished jobs from %s", len(stored), self.outbox.path)
        edge = self.settings.id
        submit = topics.edge_submit(edge)
        await self._subscribe(topics.edge_returns_all(edge), self.on_return)
        await self._subscribe(topics.edge_notices(edge), self.on_notice)
        await self._peer_returns.ensure()
        if self._feed is not None:
            self._feed.on_change(self._peer_returns.soon)
        await self._transport.subscribe(topics.edge_schedule(edge), self.schedule.on_message)
        self.schedule.publish(self._clock())  # an empty book: a restarted edge has forgotten
        self._jobs.mode = "serving"
        # Subscribe before announcing: on one connection the broker handles the SUBSCRIBE
        # before the status PUBLISH, so whoever sees "online" can submit at once.
        await self._transport.subscribe(submit, self.on_message, qos=1, manual_ack=True)
        self._transport.on_connect(self._announce_online)
        if self._transport.connected:
            self._announce_online()
        self.ready.set()
        sweep_s = min(SWEEP_S, self._offload_settings.result_timeout_s / 4.0)
        housekeeping = [
            asyncio.ensure_future(
                self._every(self.settings.telemetry_interval_s, self._publish_telemetry)
            ),
            asyncio.ensure_future(self._every(sweep_s, self.check_offloaded)),
            asyncio.ensure_future(self._every(PRUNE_INTERVAL_S, self.outbox.prune)),
        ]
        if self.watcher is not None:
            housekeeping.append(asyncio.ensure_future(self.watcher.run()))
        log.info(
            "edge agent %s (zone %s) serving %s on %s",
            edge,
            self.settings.zone,
            ", ".join(self._models.names()),
            submit,
        )
        try:
            halted = asyncio.ensure_future(self._halted.wait())
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait({halted, stopped}, return_when=asyncio.FIRST_COMPLETED)
            halted.cancel()
            stopped.cancel()
        finally:
            for task in housekeeping:
                task.cancel()
            await asyncio.gather(*housekeeping, return_exceptions=True)
            if not self._jobs.killed:
                await self._shut_down(drain_timeout)

    async def _subscribe(self, topic_filter: str, handler: Callable[[Message], None]) -> None:
        await self._transport.subscribe(topic_filter, handler, manual_ack=True)

    def on_peer_return(self, msg: Message) -> None:
        """A sister campus's worker's result, in the envelope it crossed the bridge in:
        unwrapped, it is read like any return (its worker named with its campus)."""
        try:
            ret = unwrap(msg)
        except WireError as exc:
            self.counters[Tally.BAD_RETURNS] += 1
            log.warning("return on %s unreadable: %s", msg.topic, exc)
            self._transport.ack(msg)
            return
        self.on_return(ret)

    def _peer_returns_topic(self) -> str | None:
        """Where sister campuses' workers return this edge's jobs, once the policy lets this
        campus send them work (the ACL grants the subscription only then)."""
        policy = self._placement.policy() if self._placement is not None else None
        if policy is None or not policy.peers_out():
            return None
        return topics.peer_returns_all(policy.campus, self.settings.id)

    async def _shut_down(self, drain_timeout: float) -> None:
        self._jobs.mode = "stopping"  # new requests are refused; jobs in hand finish
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._jobs.idle.wait(), drain_timeout)
        await self._answers.drain(2.0)
        if self._transport.connected:
            self._publish_trace()  # the last jobs' records, before the agent goes offline
        with contextlib.suppress(TransportError, TimeoutError):
            await asyncio.wait_for(
                self._transport.publish(
                    Message(
                        topics.edge_status(self.settings.id),
                        status_message(self.settings, "offline"),
                        qos=1,
                        retain=True,
                    ),
                    wait=True,
                ),
                2.0,
            )
        self._jobs.mode = "stopped"  # offers still waiting: their jobs replay after a restart
        self._compute.shutdown()
        if self.metering is not None:  # first: its records may ride the outbox's last commit
            await self.metering.meter.stop()
        await self.outbox.close()
