"""The edge agent's asyncio shell: MQTT in, ONNX Runtime in an executor, results out.

It subscribes to its submit topic, hands each message to the pure admission core, keeps
accepted jobs in a bounded priority queue, runs them on a bounded thread pool (OpenCV and
ONNX Runtime release the GIL), and publishes exactly one result per accepted job to the
job's response topic with its correlation data. It also publishes telemetry every interval
and a retained online/offline status. It must never block the event loop on compute and
never let one bad message stop it serving the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Literal

import psutil

from edge_agent.admission import Job, Refusal, admit, queue_key
from edge_agent.load import JobQueue, ServiceTimes
from edge_agent.offload import (
    Declined,
    Placement,
    PlacementClient,
    offload_reason,
    predict_completion,
)
from sluicegate import topics, wire
from sluicegate.config import EdgeSettings, OffloadSettings
from sluicegate.errors import ImageError
from sluicegate.threads import EDGE_COMPUTE, compute_pool, start_all
from sluicegate.transport import Message, Transport, Will
from sluicegate.vision.image import PayloadLimits as Limits
from sluicegate.vision.postprocess import Outputs as VisionOutputs
from sluicegate.vision.runtime import ModelRegistry, StageTimes

log = logging.getLogger(__name__)

Inference = tuple[VisionOutputs, StageTimes]


def status_message(settings: EdgeSettings, state: Literal["online", "offline"]) -> bytes:
    """The retained status document (``online``/``offline``) for this agent."""
    return wire.dump(
        wire.NodeStatus(node=settings.id, kind="edge", zone=settings.zone, state=state)
    )


def last_will(settings: EdgeSettings) -> Will:
    return Will(topics.edge_status(settings.id), status_message(settings, "offline"))


class EdgeAgent:
    """One line PC's agent. Create, then ``await run(stop)``."""

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
    ) -> None:
        topics.check_id("edge id", settings.id)
        self.settings = settings
        self._transport = transport
        self._registry = registry
        self._models = frozenset(registry.names())
        self._clock = clock
        self._new_id = new_id
        self._limits = Limits(settings.max_payload_bytes, settings.max_pixels, settings.max_side)
        self._queue: JobQueue[Job] = JobQueue(settings.queue_size, queue_key)
        self._in_flight = 0
        self._executor = compute_pool(settings.concurrency, EDGE_COMPUTE)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self.service_times = ServiceTimes(settings.service_time_alpha)
        self.results: Counter[str] = Counter()
        self.dropped_no_response_topic = 0
        self._process = psutil.Process()
        self._accepting = False
        self.ready = asyncio.Event()  # set once subscribed and announced online
        self._offload = offload
        self._offload_settings = offload_settings or OffloadSettings()
        self._offering: set[asyncio.Task[None]] = set()
        self._declined: dict[str, Declined] = {}  # job id -> why it stayed here
        self.offloaded = 0

    # -- intake (event loop, must stay quick) ----------------------------------------------

    def on_message(self, msg: Message) -> None:
        """Admission of one request; called by the transport for each submit message."""
        if not self._accepting:
            decision: Job | Refusal = Refusal(
                msg.user_property(topics.PROP_JOB_ID) or self._new_id(),
                "rejected",
                "shutting_down",
                f"edge agent {self.settings.id} is shutting down; resubmit shortly",
                msg.response_topic,
                msg.correlation_data,
                msg.user_property(topics.PROP_MODEL),
            )
        else:
            decision = admit(
                msg,
                models=self._models,
                limits=self._limits,
                now=self._clock(),
                new_id=self._new_id,
            )
        if isinstance(decision, Refusal):
            self._refuse(decision)
        elif self._offer(decision):
            return
        elif self._queue.push(decision):
            self._idle.clear()
            self._dispatch()
        else:
            self._refuse(
                Refusal(
                    decision.job_id,
                    "rejected",
                    "queue_full",
                    f"edge agent {self.settings.id} has {self.settings.queue_size} jobs queued;"
                    " retry later or lower the submit rate",
                    decision.response_topic,
                    decision.correlation_data,
                    decision.model,
                )
            )

    # -- offload: offer the job to the broker when it would be late here --------------------

    def _offer(self, job: Job) -> bool:
        """Start an offload attempt if this job should leave; True when it was taken."""
        client = self._offload
        if client is None or not self._offload_settings.enabled or not client.broker_available:
            return False  # nobody to ask: no task, no hashing, just run it here
        service_s = self.service_times.estimate(job.model) or 0.0
        now = self._clock()
        done = predict_completion(
            now, len(self._queue), self._in_flight, self.settings.concurrency, service_s
        )
        reason = offload_reason(
            job,
            predicted_done=done,
            waiting=len(self._queue),
            queue_bound=self._offload_settings.queue_bound,
        )
        if reason is None:
            return False
        self._idle.clear()
        task = asyncio.ensure_future(self._offer_job(client, job, reason, done - now))
        self._offering.add(task)
        task.add_done_callback(self._offering.discard)
        return True

    async def _offer_job(
        self, client: PlacementClient, job: Job, reason: str, local_s: float
    ) -> None:
        try:
            outcome = await client.place(job, reason, local_s)
            if isinstance(outcome, Placement):
                try:
                    client.send(job, outcome)
                except Exception as exc:
                    outcome = Declined(
                        "send_failed", f"could not send to {outcome.worker_id}: {exc}"
                    )
                else:
                    self.offloaded += 1
                    log.info("job %s offloaded to %s (%s)", job.job_id, outcome.worker_id, reason)
                    return
            log.info("job %s stays local: %s", job.job_id, outcome.reason)
            self._declined[job.job_id] = outcome
            self._queue.push(job, force=True)  # accepted already: never refused now
        finally:
            task = asyncio.current_task()
            if task is not None:
                self._offering.discard(task)
            self._dispatch()

    def _refuse(self, refusal: Refusal) -> None:
        if refusal.response_topic is None:
            self.dropped_no_response_topic += 1
            log.warning(
                "dropped job %s: %s (nowhere to send a result)", refusal.job_id, refusal.reason
            )
            return
        log.info("refused job %s: %s", refusal.job_id, refusal.reason)
        result = wire.JobResult(
            job_id=refusal.job_id,
            status=refusal.status,
            code=refusal.code,
            reason=refusal.reason,
            model=refusal.model,
            ran_on=self._ran_on(),
        )
        self._publish_result(refusal.response_topic, refusal.correlation_data, result)

    def _ran_on(self) -> wire.RanOn:
        return wire.RanOn(kind="edge", node=self.settings.id, zone=self.settings.zone)

    def _publish_result(
        self, topic: str, correlation_data: bytes | None, result: wire.JobResult
    ) -> None:
        self.results[result.status] += 1
        try:
            self._transport.publish_nowait(
                topic,
                wire.dump(result),
                qos=1,
                correlation_data=correlation_data,
                content_type=wire.RESULT_CONTENT_TYPE,
            )
        except Exception as exc:  # a result that cannot be queued is logged, never silent
            log.error("could not publish the result of job %s: %s", result.job_id, exc)

    # -- execution: the loop hands jobs to the thread pool and takes results back ----------

    def _dispatch(self) -> None:
        """Start queued jobs while a compute slot is free (loop thread)."""
        while self._in_flight < self.settings.concurrency and len(self._queue):
            job = self._queue.pop()
            started = self._clock()
            if job.deadline is not None and started >= job.deadline:
                late = (started - job.deadline) * 1000.0
                reason = f"the deadline passed {late:.0f} ms before the job could start; not run"
                self._finish(job, "expired", code="expired", reason=reason, started=started)
                continue
            model = self._registry.get(job.model)
            self._in_flight += 1
            future = self._executor.submit(model.infer_bytes, job.payload, info=job.image)
            future.add_done_callback(partial(self._from_worker, job, started))
        if not self._in_flight and not len(self._queue) and not self._offering:
            self._idle.set()

    def _from_worker(self, job: Job, started: float, future: Future[Inference]) -> None:
        # Runs on the worker thread: hand the outcome back to the loop, nothing more.
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._completed, job, started, future)

    def _completed(self, job: Job, started: float, future: Future[Inference]) -> None:
        self._in_flight -= 1
        try:
            outputs, times = future.result()
        except ImageError as exc:
            self._finish(job, "rejected", code="bad_image", reason=str(exc), started=started)
        except Exception as exc:
            log.exception("inference failed for job %s", job.job_id)
            reason = f"inference failed: {type(exc).__name__}: {exc}"
            self._finish(job, "failed", code="inference_error", reason=reason, started=started)
        else:
            compute_s = (times.decode_ms + times.preprocess_ms + times.inference_ms) / 1000.0
            self.service_times.observe(job.model, compute_s)
            self._finish(job, "ok", outputs=outputs, times=times, started=started)
        self._dispatch()

    def _finish(
        self,
        job: Job,
        status: wire.Status,
        *,
        code: str | None = None,
        reason: str | None = None,
        outputs: VisionOutputs | None = None,
        times: StageTimes | None = None,
        started: float | None = None,
    ) -> None:
        end = self._clock()
        queue_ms = ((started or end) - job.received_at) * 1000.0
        timings = wire.Timings(
            queue_ms=round(queue_ms, 3),
            decode_ms=round(times.decode_ms, 3) if times else 0.0,
            preprocess_ms=round(times.preprocess_ms, 3) if times else 0.0,
            inference_ms=round(times.inference_ms, 3) if times else 0.0,
            total_ms=round((end - job.received_at) * 1000.0, 3),
        )
        declined = self._declined.pop(job.job_id, None)
        result = wire.JobResult(
            job_id=job.job_id,
            status=status,
            code=code,
            reason=reason,
            model=job.model,
            outputs=wire.outputs_of(outputs) if outputs is not None else None,
            ran_on=self._ran_on(),
            timings_ms=timings,
            offload=declined.as_wire() if declined is not None else None,
        )
        self._publish_result(job.response_topic, job.correlation_data, result)

    # -- telemetry and status -----------------------------------------------------------------

    def telemetry(self) -> wire.EdgeTelemetry:
        mem = self._process.memory_info()
        return wire.EdgeTelemetry(
            node=self.settings.id,
            zone=self.settings.zone,
            ts=self._clock(),
            queue_depth=len(self._queue),
            queue_capacity=self.settings.queue_size,
            in_flight=self._in_flight,
            concurrency=self.settings.concurrency,
            models={
                name: wire.ModelLoad(
                    service_ms=round(fig.service_s * 1000.0, 3), completed=fig.completed
                )
                for name, fig in self.service_times.snapshot().items()
            },
            cpu_percent=self._process.cpu_percent(None),
            memory_rss_mb=round(mem.rss / 2**20, 1),
            memory_percent=round(self._process.memory_percent(), 2),
            results=dict(self.results),
            dropped_no_response_topic=self.dropped_no_response_topic,
            offloaded=self.offloaded,
            offload_pending=len(self._offering),
        )

    async def _telemetry_loop(self) -> None:
        topic = topics.edge_telemetry(self.settings.id)
        while True:
            await asyncio.sleep(self.settings.telemetry_interval_s)
            if self._transport.connected:
                with contextlib.suppress(Exception):
                    await self._transport.publish(topic, wire.dump(self.telemetry()), qos=0)

    def _announce_online(self) -> None:
        self._transport.publish_nowait(
            topics.edge_status(self.settings.id),
            status_message(self.settings, "online"),
            qos=1,
            retain=True,
        )

    # -- lifecycle ---------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, *, drain_timeout: float = 10.0) -> None:
        """Serve until ``stop`` is set, then answer what is queued and go offline."""
        self._loop = asyncio.get_running_loop()
        # Every compute thread exists before the first job, so none pays for making one.
        await self._loop.run_in_executor(None, start_all, self._executor, self.settings.concurrency)
        self._process.cpu_percent(None)  # prime: the first reading is always 0
        self._accepting = True
        submit = topics.edge_submit(self.settings.id)
        # Subscribe before announcing: on one connection the broker handles the SUBSCRIBE
        # before the status PUBLISH, so whoever sees "online" can submit at once.
        await self._transport.subscribe(submit, self.on_message, qos=1)
        self._transport.on_connect(self._announce_online)
        if self._transport.connected:
            self._announce_online()
        self.ready.set()
        telemetry = asyncio.ensure_future(self._telemetry_loop())
        log.info(
            "edge agent %s (zone %s) serving %s on %s",
            self.settings.id,
            self.settings.zone,
            ", ".join(sorted(self._models)),
            submit,
        )
        try:
            await stop.wait()
        finally:
            self._accepting = False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), drain_timeout)
            telemetry.cancel()
            await asyncio.gather(telemetry, return_exceptions=True)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    self._transport.publish(
                        topics.edge_status(self.settings.id),
                        status_message(self.settings, "offline"),
                        qos=1,
                        retain=True,
                        wait=True,
                    ),
                    2.0,
                )
            self._executor.shutdown(wait=True)
