"""The center pool worker's asyncio shell: it puts a worker together, runs it, and says what
it is and how it is doing.

It subscribes only to its own work topics (on campus, and from the sister campuses whose
receive terms open its zone, unwrapped from their envelopes), and hands each message to the
:class:`~center_pool.screening.Intake`, which screens it (token, replay, sealing) before
anything looks at the image and admits it onto the pure
:class:`~center_pool.batching.BatchQueue`; the :class:`~center_pool.dispatcher.Dispatcher`
runs ready batches on a bounded thread pool and sends each job's result (back to the edge that
placed it, never to the app), usage record and completion record. This module owns what is
the worker's own: following the policy (its zone, the sealing key it advertises, audited),
the retained capabilities and status (re-published on reconnect, offline as Last Will),
telemetry every interval and the ``/metrics`` figures, the models it serves after a reload,
and the order of start and stop (drain what was admitted, then go offline). It must never
block the loop on compute or I/O, and never let one bad message stop it serving the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psutil

from center_pool import reporting
from center_pool.batching import BatchQueue
from center_pool.dispatcher import Dispatcher
from center_pool.gate import Gate
from center_pool.guard import POLICY_ACCEPTED, SEAL_KEY_ROTATED, AuditSink
from center_pool.hardware import Probe
from center_pool.intake import WorkItem
from center_pool.job_figures import WorkFigures
from center_pool.metrics import WorkerFigures
from center_pool.replies import Replies
from center_pool.screening import Intake
from center_pool.seal_keys import KeyFolder, SealKeys
from policies import Policy
from policies.replay import AsyncReplayCache
from sluicegate import topics, wire
from sluicegate.config import PoolSettings
from sluicegate.errors import TransportError, WireError
from sluicegate.late_subscription import LateSubscription
from sluicegate.metering.meter import Meter
from sluicegate.node_metrics import MetricsServer
from sluicegate.policy_feed import PolicyFeed
from sluicegate.policy_standing import StandingLog, standing
from sluicegate.supervise import until_stopped
from sluicegate.transport import Message, Transport
from sluicegate.vision.image import PayloadLimits as Limits
from sluicegate.vision.openvino_session import backend_of
from sluicegate.vision.runtime import ModelRegistry
from sluicegate.vision.watch import ModelWatcher
from sluicegate.wire_peer import unwrap
from sluicegate.wire_pool import WorkerTelemetry

log = logging.getLogger(__name__)


class PoolWorker:
    """One center pool worker. Create, then ``await run(stop)``."""

    def __init__(
        self,
        settings: PoolSettings,
        transport: Transport,
        registry: ModelRegistry,
        *,
        feed: PolicyFeed,
        replay: AsyncReplayCache,
        audit: AuditSink,
        probe: Probe,
        providers: list[str],
        clock: Callable[[], float] = time.time,
        models_dir: Path | None = None,
        meter: Meter | None = None,
        seal_keys: SealKeys | None = None,
    ) -> None:
        """``models_dir``: the folder ``registry`` was loaded from, watched for new model
        versions every ``settings.models_reload_s`` (none: not watched). ``meter``: where
        each attempt that ran is recorded before its result goes (none: not metered).
        ``seal_keys``: the keys sealed images are opened with (none: one made in memory)."""
        topics.check_id("worker id", settings.id)
        self.settings = settings
        self._transport = transport
        self._registry = registry
        self._feed = feed
        self.audit = audit
        self._standing = StandingLog(f"worker {settings.id}")
        self._probe = probe
        self._clock = clock
        self._limits = Limits(settings.max_payload_bytes, settings.max_pixels, settings.max_side)
        self.seal_keys = seal_keys or SealKeys(KeyFolder(None), now=clock())
        self.replies = Replies(settings, transport, clock, self._campus)
        # Sister campuses' work, once a policy opens this worker's zone to one.
        self._peer_work = LateSubscription(
            transport, self._peer_work_topic, self.on_peer_message, what="sister campuses' work"
        )
        self.peer_envelopes_refused = 0  # peer work messages that were no envelope
        self.meter = meter
        self._backend = backend_of(providers[0]) if providers else ""
        self._queue: BatchQueue[WorkItem] = BatchQueue(
            max_batch=settings.max_batch,
            window_s=settings.batch_window_ms / 1000.0,
            capacity=settings.queue_size,
        )
        self.service = reporting.ServiceStats()
        self.figures = WorkFigures()  # jobs returned, times, batch sizes: for /metrics
        self._accepting = False
        self._idle = asyncio.Event()
        self._idle.set()
        self.runs = Dispatcher(
            settings,
            registry,
            self._queue,
            self.replies,
            self.service,
            self.figures,
            meter=meter,
            limits=self._limits,
            clock=clock,
            backend=self._backend,
            accepting=lambda: self._accepting,
            emptied=self._emptied,
        )
        self.intake = Intake(
            settings,
            Gate(settings.id, feed, replay, self._limits, clock, self.seal_keys.ring),
            self._queue,
            self.replies,
            audit,
            self.service,
            limits=self._limits,
            clock=clock,
            accepting=lambda: self._accepting,
            dispatch=self.runs.dispatch,
        )
        self._follow_models()
        self._providers = providers
        self.watcher = (
            ModelWatcher(
                registry,
                models_dir,
                interval_s=settings.models_reload_s,
                changed=self.models_changed,
                providers=providers,
                intra_op_threads=settings.intra_op_threads,
            )
            if models_dir is not None and settings.models_reload_s > 0
            else None
        )
        self.capabilities = reporting.capabilities(
            settings, registry, providers, probe.memory_total_mb, self.seal_keys.public_text()
        )
        self._process = psutil.Process()
        self.metrics: MetricsServer | None = None  # its /metrics, while the service serves it
        self.ready = asyncio.Event()  # set once subscribed and announced online
        feed.on_change(self._policy_changed)
        if feed.current is not None:  # loaded from local files before the worker existed
            self._policy_changed(feed.current)

    @property
    def unmetered(self) -> int:
        """Attempts that ran and went out without a usage record."""
        return self.runs.usage.unmetered

    @property
    def refused(self) -> Counter[str]:
        """Work refused, by code."""
        return self.intake.refused

    @property
    def decode_attempts(self) -> int:
        """Jobs handed to the decoder: proof that refusals never are."""
        return self.runs.decode_attempts

    @property
    def batch_sizes(self) -> Counter[int]:
        return self.runs.batch_sizes

    @property
    def in_flight(self) -> int:
        """Jobs in the batches on the executor."""
        return self.runs.in_flight

    @property
    def results(self) -> Counter[str]:
        return self.replies.results

    @property
    def metrics_url(self) -> str | None:
        """Where this worker's ``/metrics`` is served now (None: not served)."""
        return self.metrics.url if self.metrics is not None else None

    def on_message(self, msg: Message) -> None:
        """Called by the transport for each work message; only queues it."""
        self.intake.take(msg)
        self._idle.clear()

    def on_peer_message(self, msg: Message) -> None:
        """A sister campus's work, in the envelope it crossed the bridge in: unwrapped, it
        is screened like any other (its origin is that campus, from the topic)."""
        try:
            work = unwrap(msg)
        except WireError as exc:  # no job id to answer: counted, logged, acked
            self.peer_envelopes_refused += 1
            log.warning("work on %s refused: %s", msg.topic, exc)
            return
        self.on_message(work)

    def _campus(self) -> str:
        policy = self._feed.current
        return policy.campus if policy is not None else ""

    def _peer_work_topic(self) -> str | None:
        """Where sister campuses' work for this worker comes, once the policy opens its
        zone to one (the ACL grants the subscription only then)."""
        policy = self._feed.current
        if policy is None or not policy.peers_into(self.settings.zone):
            return None
        return topics.peer_work_all(policy.campus, self.settings.id)

    def _emptied(self) -> None:
        """Nothing queued or running: idle too, unless messages wait to be screened."""
        if not self.intake.busy:
            self._idle.set()

    def _follow_models(self) -> None:
        """Admit work for the models the registry serves, and meter it with their digests."""
        registry = self._registry
        models = {n: registry.get(n).manifest.sha256 for n in registry.names()}
        self.intake.models = self.runs.models = models

    # -- policy, telemetry and status --------------------------------------------------------

    def _policy_changed(self, policy: Policy) -> None:
        settings = self.settings
        self._standing.heard(
            policy, standing(policy, "pool", settings.id, settings.zone, self.audit.public_key)
        )
        self.audit.submit(
            POLICY_ACCEPTED,
            {"worker": self.settings.id, "version": policy.version, "digest": policy.digest.hex()},
            now=self._clock(),
        )
        self._plan_seal_keys(policy)

    def _plan_seal_keys(self, policy: Policy) -> None:
        """The current sealing key is the newest one ``policy`` lists for this worker: when it
        changes, the capabilities advertise the new one and the rotation is audited."""
        now = self._clock()
        rotation = self.seal_keys.follow(policy, self.settings.id, now=now)
        if rotation is None:
            return
        log.info("worker %s: %s", self.settings.id, rotation)
        self.audit.submit(SEAL_KEY_ROTATED, rotation.audit_data(self.settings.id), now=now)
        self.capabilities = self.capabilities.model_copy(update={"seal_key": rotation.public})
        if self._transport.connected and self.ready.is_set():  # else run() announces
            self._announce()

    def telemetry(self) -> WorkerTelemetry:
        return reporting.telemetry(
            self.settings,
            self._probe.sample(),
            ts=self._clock(),
            queue_depth=len(self._queue) + self.intake.waiting,
            in_flight=self.in_flight,
            service=self.service,
            results=self.results,
            refused=self.refused,
            backlog_ms=self.service.backlog_ms(
                Counter(self._queue.depths()) + self.runs.running_models, self.intake.waiting
            ),
        )

    def scrape(self) -> WorkerFigures:
        """What ``/metrics`` reads: the worker's figures now."""
        policy = self._feed.current
        entry = policy.worker(self.settings.id) if policy is not None else None
        return WorkerFigures(
            pool=entry.pool if entry is not None else "",
            zone=self.settings.zone,
            backend=self._backend,
            device=self.settings.device_class,
            queue_depth=len(self._queue) + self.intake.waiting,
            in_flight=self.in_flight,
            running=self.runs.running,
            concurrency=self.settings.concurrency,
            memory_rss_bytes=self._process.memory_info().rss,
            service_s={m: load.service_ms / 1000.0 for m, load in self.service.loads().items()},
            refused=self.refused,
            jobs=self.figures,
            usage_written=self.meter.written if self.meter is not None else 0,
            unmetered=self.unmetered,
            usage_unacked=self.meter.shipper.in_flight if self.meter is not None else 0,
        )

    async def _telemetry_loop(self) -> None:
        topic = topics.worker_telemetry(self.settings.id)
        while True:
            await asyncio.sleep(self.settings.telemetry_interval_s)
            policy = self._feed.current
            if policy is not None:  # retired keys are dropped once no token can need them
                self._plan_seal_keys(policy)
            if self._transport.connected:
                try:
                    await self._transport.publish(
                        Message(topic, wire.dump(self.telemetry()), qos=0)
                    )
                except TransportError as exc:
                    log.warning("telemetry not published: %s", exc)

    def models_changed(self, _changes: list[str]) -> None:
        """The registry serves another set of models (a reload): admit work for those, and
        tell the broker, whose placements follow the retained capabilities."""
        self._follow_models()
        self.capabilities = reporting.capabilities(
            self.settings,
            self._registry,
            self._providers,
            self._probe.memory_total_mb,
            self.seal_keys.public_text(),
        )
        if self._transport.connected:
            self._announce()

    def _announce(self) -> None:
        """Retained capabilities, then online: on every (re)connect."""
        self._transport.publish_nowait(
            Message(
                topics.worker_capabilities(self.settings.id),
                wire.dump(self.capabilities),
                qos=1,
                retain=True,
            )
        )
        self._transport.publish_nowait(
            Message(
                topics.worker_status(self.settings.id),
                reporting.status_message(self.settings, "online"),
                qos=1,
                retain=True,
            )
        )

    # -- lifecycle -----------------------------------------------------------------------------

    async def run(
        self, stop: asyncio.Event, *, drain_timeout: float = 10.0, policy_wait: float = 2.0
    ) -> None:
        """Serve until ``stop`` is set, then finish what was admitted and go offline."""
        self.runs.bind(asyncio.get_running_loop())
        await self.runs.start_threads()
        self._accepting = True
        tasks = [
            asyncio.create_task(self.audit.run(), name="audit writer"),
            asyncio.create_task(self.intake.run(), name="intake"),
        ]
        await self._feed.start(self._transport)
        if self._feed.current is None:  # the retained policy follows its SUBACK closely
            changed = asyncio.Event()
            self._feed.on_change(lambda _p: changed.set())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), policy_wait)
        if self._feed.current is None:
            log.warning("%s; work will be refused until one arrives", self._feed.why_none())
        if self.meter is not None:  # records not acknowledged before go out again
            await self.meter.start()
        work_topic = topics.pool_work_all(self.settings.zone, self.settings.id)
        await self._transport.subscribe(work_topic, self.on_message, qos=1)
        await self._peer_work.ensure()
        self._feed.on_change(self._peer_work.soon)
        self._transport.on_connect(self._announce)
        if self._transport.connected:
            self._announce()
        tasks.append(asyncio.create_task(self._telemetry_loop(), name="telemetry"))
        if self.watcher is not None:
            tasks.append(asyncio.create_task(self.watcher.run(), name="models watcher"))
        self.ready.set()
        log.info(
            "pool worker %s (%s, zone %s) serving %s with %s on %s",
            self.settings.id,
            self.settings.device_class,
            self.settings.zone,
            ", ".join(sorted(self.capabilities.models)) or "no models",
            ", ".join(self.capabilities.providers),
            work_topic,
        )
        try:
            await until_stopped(stop, tasks)
        finally:
            self._accepting = False
            self.intake.wake()
            self.runs.dispatch()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), drain_timeout)
            for task in tasks[1:]:
                task.cancel()
            await asyncio.gather(*tasks[1:], return_exceptions=True)
            self.runs.cancel_timer()
            with contextlib.suppress(TransportError, TimeoutError):
                await asyncio.wait_for(
                    self._transport.publish(
                        Message(
                            topics.worker_status(self.settings.id),
                            reporting.status_message(self.settings, "offline"),
                            qos=1,
                            retain=True,
                        ),
                        wait=True,
                    ),
                    2.0,
                )
            if self.meter is not None:
                await self.meter.stop()
            await self.audit.flush(5.0)
            tasks[0].cancel()
            await asyncio.gather(tasks[0], return_exceptions=True)
            self.runs.shutdown()
            self._probe.close()
