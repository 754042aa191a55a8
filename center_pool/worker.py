"""The center pool worker's asyncio shell: zone-scoped work in, batched ONNX runs, results out.

It subscribes only to its own work topic. The transport hands each message to a loop-side
intake whose :class:`~center_pool.gate.Gate` checks the placement token and its nonce before
anything looks at the image; a refusal is answered, counted and (before the token passed)
audited, and the worker keeps serving. Admitted jobs wait in the pure
:class:`~center_pool.batching.BatchQueue`; a loop-side dispatcher hands each ready batch to a
bounded thread pool (OpenCV and ONNX Runtime release the GIL) and takes the outcome back with
``call_soon_threadsafe``. Results (back to the edge that placed each job, never to the app)
and completion records go out through the :class:`~center_pool.replies.Replies`. Capabilities
and status are retained (re-published on reconnect, offline as Last Will); telemetry goes
out every interval. It must never block the loop on compute or I/O, and never let one bad
message stop it serving the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path

import psutil

from center_pool import reporting
from center_pool.batching import BatchQueue, Entry, start_by
from center_pool.execution import BatchRun, ItemRun, run_batch
from center_pool.gate import Gate, Passed, Stopped, audit_data
from center_pool.guard import (
    POLICY_ACCEPTED,
    REFUSED,
    SEAL_KEY_ROTATED,
    AuditSink,
    check_cancelled,
)
from center_pool.hardware import Probe
from center_pool.intake import Work, WorkItem, WorkRefusal, admit_work, refuse
from center_pool.job_figures import WorkFigures
from center_pool.metrics import WorkerFigures
from center_pool.replies import Replies
from center_pool.seal_keys import KeyFolder, SealKeys
from center_pool.usage import BatchRecords, attempt_record
from policies import PlacementClaims, Policy
from policies.replay import AsyncReplayCache
from sluicegate import topics, wire
from sluicegate.config import PoolSettings
from sluicegate.errors import TransportError
from sluicegate.metering.meter import Meter
from sluicegate.metering.record import Usage
from sluicegate.node_metrics import MetricsServer
from sluicegate.policy_feed import PolicyFeed
from sluicegate.supervise import until_stopped
from sluicegate.transport import Message, Transport
from sluicegate.vision.image import PayloadLimits as Limits
from sluicegate.vision.openvino_session import backend_of
from sluicegate.vision.runtime import ModelRegistry
from sluicegate.vision.watch import ModelWatcher
from sluicegate.wire_pool import WorkerTelemetry

log = logging.getLogger(__name__)

INTAKE_CHUNK = 256  # work messages screened per pass of the intake loop


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
        self._models = {n: registry.get(n).manifest.sha256 for n in registry.names()}
        self._feed = feed
        self.audit = audit
        self._probe = probe
        self._clock = clock
        self._limits = Limits(settings.max_payload_bytes, settings.max_pixels, settings.max_side)
        self.seal_keys = seal_keys or SealKeys(KeyFolder(None), now=clock())
        self._gate = Gate(settings.id, feed, replay, self._limits, clock, self.seal_keys.ring)
        self.replies = Replies(settings, transport, clock)
        self.meter = meter
        self.usage = BatchRecords(meter, self._dispatch)  # results wait for their records
        self._backend = backend_of(providers[0]) if providers else ""
        self._queue: BatchQueue[WorkItem] = BatchQueue(
            max_batch=settings.max_batch,
            window_s=settings.batch_window_ms / 1000.0,
            capacity=settings.queue_size,
        )
        self._executor = ThreadPoolExecutor(settings.concurrency, thread_name_prefix="sg-pool")
        self._intake: deque[tuple[Message, float]] = deque()
        self._intake_wake = asyncio.Event()
        self._screening = 0  # messages taken off the intake, not yet admitted or refused
        self._running = 0  # batches on the executor
        self.in_flight = 0  # jobs in those batches
        self._running_models: Counter[str] = Counter()  # the same jobs, by model
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accepting = False
        self._idle = asyncio.Event()
        self._idle.set()
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
        self.service = reporting.ServiceStats()
        self.refused: Counter[str] = Counter()
        self.decode_attempts = 0  # jobs handed to the decoder: proof that refusals never are
        self.batch_sizes: Counter[int] = Counter()
        self._process = psutil.Process()
        self.figures = WorkFigures()  # jobs returned, times, batch sizes: for /metrics
        self.metrics: MetricsServer | None = None  # its /metrics, while the service serves it
        self.ready = asyncio.Event()  # set once subscribed and announced online
        feed.on_change(self._policy_changed)
        if feed.current is not None:  # loaded from local files before the worker existed
            self._policy_changed(feed.current)

    @property
    def unmetered(self) -> int:
        """Attempts that ran and went out without a usage record."""
        return self.usage.unmetered

    @property
    def results(self) -> Counter[str]:
        return self.replies.results

    @property
    def metrics_url(self) -> str | None:
        """Where this worker's ``/metrics`` is served now (None: not served)."""
        return self.metrics.url if self.metrics is not None else None

    # -- intake: loop side, token before anything else ------------------------------------------

    def on_message(self, msg: Message) -> None:
        """Called by the transport for each work message; only queues it."""
        self._intake.append((msg, self._clock()))
        self._idle.clear()
        self._intake_wake.set()

    async def _intake_loop(self) -> None:
        while True:
            await self._intake_wake.wait()
            self._intake_wake.clear()
            while self._intake:
                await self.audit.room()
                size = min(len(self._intake), INTAKE_CHUNK)
                chunk = [self._intake.popleft() for _ in range(size)]
                self._screening += len(chunk)
                verdicts: list[Passed | Stopped] = []
                try:
                    verdicts = await self._gate.screen(chunk, accepting=self._accepting)
                except Exception:  # a fault in screening leaves the loop serving the rest
                    log.exception("intake failed for %d work message(s)", len(chunk))
                finally:
                    self._screening -= len(chunk)
                check_cancelled()  # the replay cache may be redis-py, which can lose it
                for verdict in verdicts:
                    if isinstance(verdict, Passed):
                        self._admit(verdict.work, verdict.claims)
                    else:
                        self._refuse(verdict)
                self._dispatch()

    def _admit(self, work: Work, claims: PlacementClaims) -> None:
        now = self._clock()
        item = admit_work(work, claims, models=self._models, limits=self._limits, now=now)
        if isinstance(item, WorkRefusal):
            self._refuse(Stopped(item, work, audit=False))
            return
        start = start_by(item.deadline, now, self.service.batch_estimate_s(item.model))
        if not self._queue.push(Entry(item, item.model, now, item.priority, start)):
            reason = (
                f"worker {self.settings.id} has {self.settings.queue_size} jobs queued; "
                "ask the broker for another placement"
            )
            refusal = refuse(work, "queue_full", reason, token_passed=True)
            self._refuse(Stopped(refusal, work, audit=False))

    def _refuse(self, stopped: Stopped) -> None:
        refusal = stopped.refusal
        self.refused[refusal.code] += 1
        log.info("refused job %s [%s]: %s", refusal.job_id, refusal.code, refusal.reason)
        if stopped.audit:
            self.audit.submit(REFUSED, audit_data(stopped, self.settings.id), now=self._clock())
        self.replies.refusal(refusal)

    # -- execution: ready batches to the thread pool and back -----------------------------------

    def _dispatch(self) -> None:
        now = self._clock()
        while self._running < self.settings.concurrency:
            batch = self._queue.pop(now, drain=not self._accepting)
            if batch is None:
                break
            live: list[WorkItem] = []
            for item in batch.items:
                if item.deadline is not None and now >= item.deadline:
                    self._finish_expired(item, now)
                else:
                    live.append(item)
            if not live:
                continue
            self._running += 1
            self.in_flight += len(live)
            self._running_models[batch.model] += len(live)
            self.decode_attempts += len(live)
            model = self._registry.get(batch.model)
            jobs = [(item.payload, item.image) for item in live]
            future = self._executor.submit(run_batch, model, jobs, limits=self._limits)
            future.add_done_callback(partial(self._from_thread, live, now))
        self._arm_timer(now)
        busy = self._running or self.usage.pending or self._intake or self._screening
        if not (busy or len(self._queue)):
            self._idle.set()

    def _arm_timer(self, now: float) -> None:
        if self._running >= self.settings.concurrency or self._loop is None:
            return
        at = self._queue.ready_at()
        if at is None:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(max(0.0, at - now), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._dispatch()

    def _from_thread(self, items: list[WorkItem], started: float, future: Future[BatchRun]) -> None:
        # Runs on the executor thread: hand the outcome back to the loop, nothing more.
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._completed, items, started, future)

    def _completed(self, items: list[WorkItem], started: float, future: Future[BatchRun]) -> None:
        self._running -= 1
        self.in_flight -= len(items)
        self._running_models[items[0].model] -= len(items)
        try:
            run = future.result()
        except Exception as exc:  # whatever the batch raised is its jobs' result
            log.exception("batch of %d failed", len(items))
            failed = ItemRun(None, "inference_error", f"inference failed: {exc}", 0.0, 0.0)
            run = BatchRun(tuple(failed for _ in items), 0.0, 0)
        end = self._clock()
        if run.batch_size:
            self.service.observe(items[0].model, run.compute_ms, run.batch_size)
            self.batch_sizes[run.batch_size] += 1
            self.figures.batch(items[0].model, run.batch_size, end - started)
        sends: list[Callable[[], None]] = []
        drafts: list[Usage] = []
        for item, part in zip(items, run.items, strict=True):
            queue_ms = (started - item.received_at) * 1000.0
            # The job's own time on the device: its decode and preprocess, and its share of
            # the batch's inference (what its usage record bills).
            device_ms = 0.0
            if part.ran:
                device_ms = part.decode_ms + part.preprocess_ms
                device_ms += run.inference_ms / max(1, run.batch_size)
            timings = wire.Timings(
                queue_ms=round(queue_ms, 3),
                decode_ms=round(part.decode_ms, 3),
                preprocess_ms=round(part.preprocess_ms, 3),
                inference_ms=round(run.inference_ms, 3) if part.ok else 0.0,
                total_ms=round((end - item.received_at) * 1000.0, 3),
                device_ms=round(device_ms, 3),
            )
            status: wire.Status = "ok" if part.outputs is not None else "failed"
            if part.code == "bad_image":
                status = "rejected"
            out = self.replies.result(
                item.job_id,
                item.edge_id,
                item.attempt,
                item.correlation_data,
                status=status,
                model=item.model,
                timings=timings,
                code=part.code,
                reason=part.reason,
                outputs=(wire.outputs_of(part.outputs) if part.outputs is not None else None),
                hold=True,
            )
            if out is not None:
                sends.append(partial(self.replies.send, out))
            if part.ran and self.meter is not None:
                draft = attempt_record(
                    self.meter.ledger,
                    item,
                    self.settings,
                    model_sha256=self._models.get(item.model, ""),
                    backend=self._backend,
                    batch_size=run.batch_size,
                    status=status,
                    queue_ms=queue_ms,
                    device_ms=device_ms,
                    result=out.payload if out is not None else None,
                    now=end,
                )
                if draft is not None:
                    drafts.append(draft)
                else:
                    self.usage.unmetered += 1
            service_ms = part.decode_ms + part.preprocess_ms + run.inference_ms
            ran = service_ms / 1000.0 if run.batch_size else None
            self.figures.returned(item.model, status, ran)
            sends.append(
                partial(
                    self.replies.completion,
                    item.job_id,
                    status,
                    item.model,
                    edge_id=item.edge_id,
                    attempt=item.attempt,
                    service_ms=service_ms,
                    queue_ms=queue_ms,
                    batch_size=run.batch_size,
                )
            )
        self.usage.send_after(drafts, sends)
        self._dispatch()

    def _finish_expired(self, item: WorkItem, now: float) -> None:
        assert item.deadline is not None
        late = (now - item.deadline) * 1000.0
        queue_ms = (now - item.received_at) * 1000.0
        self.replies.result(
            item.job_id,
            item.edge_id,
            item.attempt,
            item.correlation_data,
            status="expired",
            model=item.model,
            code="expired",
            reason=f"the deadline passed {late:.0f} ms before the job could start; not run",
            timings=wire.Timings(queue_ms=round(queue_ms, 3), total_ms=round(queue_ms, 3)),
        )
        self.figures.returned(item.model, "expired")
        self.replies.completion(
            item.job_id,
            "expired",
            item.model,
            edge_id=item.edge_id,
            attempt=item.attempt,
            service_ms=0.0,
            queue_ms=queue_ms,
            batch_size=1,
        )

    # -- policy, telemetry and status --------------------------------------------------------

    def _policy_changed(self, policy: Policy) -> None:
        zone = policy.worker_zone(self.settings.id)
        if zone != self.settings.zone:
            log.warning(
                "policy v%d puts worker %s in zone %r, its configuration says %r: tokens for "
                "it name the policy's zone, and its work topic is the configured one",
                policy.version,
                self.settings.id,
                zone,
                self.settings.zone,
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
            queue_depth=len(self._queue) + len(self._intake),
            in_flight=self.in_flight,
            service=self.service,
            results=self.results,
            refused=self.refused,
            backlog_ms=self.service.backlog_ms(
                Counter(self._queue.depths()) + self._running_models, len(self._intake)
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
            queue_depth=len(self._queue) + len(self._intake),
            in_flight=self.in_flight,
            running=self._running,
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
        registry = self._registry
        self._models = {n: registry.get(n).manifest.sha256 for n in registry.names()}
        self.capabilities = reporting.capabilities(
            self.settings,
            registry,
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
        self._loop = asyncio.get_running_loop()
        self._accepting = True
        tasks = [
            asyncio.create_task(self.audit.run(), name="audit writer"),
            asyncio.create_task(self._intake_loop(), name="intake"),
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
            self._intake_wake.set()
            self._dispatch()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), drain_timeout)
            for task in tasks[1:]:
                task.cancel()
            await asyncio.gather(*tasks[1:], return_exceptions=True)
            if self._timer is not None:
                self._timer.cancel()
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
            self._executor.shutdown(wait=True)
            self._probe.close()
