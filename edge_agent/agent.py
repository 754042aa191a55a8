"""The edge agent's asyncio shell: MQTT in, the outbox on disk, ONNX Runtime in an executor,
results out, exactly one per accepted job whatever crashes.

It subscribes to its submit topic with manual acknowledgement and hands each message to the
pure admission core. A job is accepted only once the outbox has committed it; then, and only
then, the request is acked (a crash before that makes the MQTT broker redeliver it). Refused
requests are answered and acked but never stored. Accepted jobs run on a bounded thread pool
(each local run counted on disk before it starts) or are offloaded to a pool worker as a
numbered attempt (the attempt on disk before the work is sent); results of offloaded jobs
come back through this edge's returns topic and are taken only for the job's current attempt.
Every result is committed before it is published (QoS 1) and marked delivered after the
broker's PUBACK. After a restart the outbox is replayed: queued jobs run (or are offered)
again, offloaded ones wait for their return until the timeout, undelivered results are
published again. It also publishes telemetry and a retained online/offline status. It must
never block the event loop on compute or disk and never let one bad message stop the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Literal

import psutil

from edge_agent import ledger
from edge_agent.admission import Job, Refusal, admit, queue_key, refuse_job, refuse_request
from edge_agent.answers import Answers, local_result
from edge_agent.errors import OutboxError
from edge_agent.ledger import Tracked
from edge_agent.load import JobQueue, ServiceTimes
from edge_agent.offload import (
    Declined,
    Placement,
    PlacementClient,
    offload_reason,
    predict_completion,
)
from edge_agent.outbox import Accepted, Outbox, Stored
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
PRUNE_INTERVAL_S = 60.0


def status_message(settings: EdgeSettings, state: Literal["online", "offline"]) -> bytes:
    """The retained status document (``online``/``offline``) for this agent."""
    return wire.dump(
        wire.NodeStatus(node=settings.id, kind="edge", zone=settings.zone, state=state)
    )


def last_will(settings: EdgeSettings) -> Will:
    return Will(topics.edge_status(settings.id), status_message(settings, "offline"))


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
    ) -> None:
        topics.check_id("edge id", settings.id)
        self.settings = settings
        self._transport = transport
        self._registry = registry
        self._models = frozenset(registry.names())
        self._clock = clock
        self._new_id = new_id
        self._limits = Limits(settings.max_payload_bytes, settings.max_pixels, settings.max_side)
        self._queue: JobQueue[Tracked] = JobQueue(settings.queue_size, self._queue_key)
        self._in_flight = 0
        self._own_executor = executor is None
        self._executor = executor or compute_pool(settings.concurrency, EDGE_COMPUTE)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self.service_times = ServiceTimes(settings.service_time_alpha)
        # accepted, duplicates, replayed, republished, fenced_returns, bad_returns,
        # not_run_returns, workers_lost, offload_timeouts, stale_notices, dead_letters, ...
        self.counters: Counter[str] = Counter()
        self._process = psutil.Process()
        self._accepting = False
        self._killed = False
        self._halted = asyncio.Event()
        self.ready = asyncio.Event()  # set once subscribed and announced online
        self._offload = offload
        self._offload_settings = offload_settings or OffloadSettings()
        self.outbox = outbox or Outbox(
            ":memory:",
            result_retention_s=settings.result_retention_s,
            tombstone_s=settings.tombstone_s,
            max_tombstones=settings.max_tombstones,
            clock=clock,
        )
        self._ran_on = wire.RanOn(kind="edge", node=settings.id, zone=settings.zone)
        self._answers = Answers(transport, self.outbox, self._ran_on)
        self._jobs: dict[str, Tracked] = {}  # accepted and not yet concluded
        self._admitting: Counter[str] = Counter()  # job id -> requests awaiting their commit
        self._admitting_total = 0
        self._tasks: set[asyncio.Task[None]] = set()  # offers in progress
        self._offering = 0
        self._finishing = 0
        self.offloaded = 0

    @property
    def results(self) -> Counter[str]:
        """Answers given, by status (refusals included; republished results not)."""
        return self._answers.results

    @property
    def dropped_no_response_topic(self) -> int:
        return self._answers.dropped_no_response_topic

    @property
    def unfinished(self) -> int:
        """Jobs accepted (or being accepted) and not yet concluded."""
        return len(self._jobs) + self._admitting_total

    @property
    def delivering(self) -> int:
        """Results published and not yet acked by the broker."""
        return self._answers.delivering

    # -- intake (event loop, must stay quick) ----------------------------------------------

    def on_message(self, msg: Message) -> None:
        """Admission of one request; called by the transport for each submit message."""
        edge = self.settings.id
        if not self._accepting:
            reason = f"edge agent {edge} is shutting down; resubmit shortly"
            refusal = refuse_request(msg, "shutting_down", reason, self._new_id)
            self._answers.refuse(refusal, msg)
            return
        decision = admit(
            msg, models=self._models, limits=self._limits, now=self._clock(), new_id=self._new_id
        )
        if isinstance(decision, Refusal):
            self._answers.refuse(decision, msg)
            return
        job = decision
        known = job.job_id in self._jobs or job.job_id in self._admitting
        held = len(self._queue) + self._admitting_total + self._in_flight
        if not known and held >= self.settings.queue_size + self.settings.concurrency:
            reason = (
                f"edge agent {edge} has {self.settings.queue_size} jobs queued;"
                " retry later or lower the submit rate"
            )
            self._answers.refuse(refuse_job(job, "queue_full", reason), msg)
            return
        self._admitting[job.job_id] += 1
        self._admitting_total += 1
        self._idle.clear()
        self.outbox.accept(job).add_done_callback(partial(self._accepted, msg, job))

    def _accepted(self, msg: Message, job: Job, fut: asyncio.Future[Accepted]) -> None:
        """The outbox has the job (or knew it already): only now is the request acked."""
        self._admitting[job.job_id] -= 1
        self._admitting_total -= 1
        if self._admitting[job.job_id] <= 0:
            del self._admitting[job.job_id]
        if self._killed:
            return
        try:
            accepted = fut.result()
        except OutboxError as exc:
            self.counters["outbox_errors"] += 1
            log.error("could not store job %s: %s", job.job_id, exc)
            reason = f"edge agent {self.settings.id} cannot store jobs now ({exc}); resubmit later"
            self._answers.refuse(refuse_job(job, "outbox_unavailable", reason), msg)
            self._update_idle()
            return
        if accepted.outcome == "new":
            self.counters["accepted"] += 1
            tracked = Tracked(job, "queued")
            self._jobs[job.job_id] = tracked
            self._transport.ack(msg)
            self._route(tracked)
            return
        self.counters["duplicates"] += 1
        stored = accepted.stored
        if stored is None:  # delivered long ago: only its id is left
            reason = (
                f"job {job.job_id} already ran and its result was delivered more than "
                f"{self.settings.result_retention_s:.0f} s ago; resubmit under a new job-id "
                "to run it again"
            )
            self._answers.refuse(refuse_job(job, "duplicate_job", reason), msg)
        elif stored.pending:
            current = self._jobs.get(job.job_id)
            if current is not None:  # the result goes where the latest request asked
                current.job = stored.job
            self._transport.ack(msg)
        else:
            if stored.result is not None:
                log.info("job %s was resubmitted; answering with its stored result", job.job_id)
                self._answers.publish(job, stored.result, record=False)
            self._transport.ack(msg)
        self._update_idle()

    # -- routing: run here, or offer to the broker -----------------------------------------

    def _route(self, tracked: Tracked, *, retry: Declined | None = None) -> None:
        """Send an accepted job on its way: offered when it would be late here (or, with
        ``retry``, offered again after a lost attempt), else into the local queue."""
        job = tracked.job
        now = self._clock()
        if job.deadline is not None and now >= job.deadline:
            late = (now - job.deadline) * 1000.0
            reason = f"the deadline passed {late:.0f} ms ago"
            if retry is not None:
                reason = f"{reason}, while the job was offloaded ({retry.reason}); not run again"
            else:
                reason = f"{reason}, before the job could start; not run"
            self._conclude_local(tracked, "expired", code="expired", reason=reason)
            return
        offer = self._offer_reason(job, retry)
        if offer is not None and self._offload is not None:
            tracked.phase = "offering"
            self._offering += 1
            self._idle.clear()
            local_s = self._predict(job) - now
            self._spawn(self._offer_job(self._offload, tracked, offer, local_s))
            return
        if retry is not None:
            tracked.declined = tracked.declined or retry
        tracked.phase = "queued"
        self._queue.push(tracked, force=True)  # accepted already: never refused now
        self._idle.clear()
        self._dispatch()

    def _predict(self, job: Job) -> float:
        service_s = self.service_times.estimate(job.model) or 0.0
        return predict_completion(
            self._clock(), len(self._queue), self._in_flight, self.settings.concurrency, service_s
        )

    def _offer_reason(self, job: Job, retry: Declined | None) -> str | None:
        client = self._offload
        if client is None or not self._offload_settings.enabled or not client.broker_available:
            return None  # nobody to ask: no task, no hashing, just run it here
        if retry is not None:
            tracked = self._jobs.get(job.job_id)
            if tracked is None or tracked.attempt >= self._offload_settings.max_attempts:
                return None
            return "deadline" if job.deadline is not None else "queue"
        return offload_reason(
            job,
            predicted_done=self._predict(job),
            waiting=len(self._queue),
            queue_bound=self._offload_settings.queue_bound,
        )

    async def _offer_job(
        self, client: PlacementClient, tracked: Tracked, reason: str, local_s: float
    ) -> None:
        job = tracked.job
        attempt = tracked.attempt + 1
        try:
            outcome = await client.place(job, reason, local_s, attempt=attempt)
            if isinstance(outcome, Placement):
                declined = await self._send(client, tracked, outcome, attempt, reason)
                if declined is None:
                    return
                outcome = declined
            if not self._current(tracked, "offering"):
                return  # concluded meanwhile (a return, a dead letter)
            log.info("job %s stays local: %s", job.job_id, outcome.reason)
            tracked.declined = outcome
            tracked.phase = "queued"
            self._queue.push(tracked, force=True)  # accepted already: never refused now
        finally:
            self._offering -= 1
            self._dispatch()

    async def _send(
        self,
        client: PlacementClient,
        tracked: Tracked,
        placement: Placement,
        attempt: int,
        reason: str,
    ) -> Declined | None:
        """Record the attempt on disk, then send the work; None once sent (or moot)."""
        job_id = tracked.job.job_id
        if not self._current(tracked, "offering"):
            return None
        try:
            recorded = await self.outbox.offloaded(job_id, attempt)
        except OutboxError as exc:
            return Declined("outbox_error", f"could not record attempt {attempt}: {exc}")
        if not self._current(tracked, "offering"):
            return None
        if not recorded:
            return Declined("outbox_error", f"attempt {attempt} could not be recorded")
        tracked.attempt = attempt
        tracked.phase = "offloaded"
        timeout = self._offload_settings.result_timeout_s
        tracked.expires_at = ledger.offload_expiry(self._clock(), timeout, tracked.job.deadline)
        try:
            client.send(tracked.job, placement, attempt=attempt)
        except Exception as exc:  # the attempt is void: the timeout reroutes the job
            log.warning("job %s: could not send attempt %d: %s", job_id, attempt, exc)
            return None
        self.offloaded += 1
        log.info(
            "job %s attempt %d offloaded to %s (%s)", job_id, attempt, placement.worker_id, reason
        )
        return None

    def _current(self, tracked: Tracked, phase: ledger.Phase) -> bool:
        return (
            not self._killed
            and self._jobs.get(tracked.job.job_id) is tracked
            and (tracked.phase == phase)
        )

    # -- returns and notices for offloaded jobs ---------------------------------------------

    def on_return(self, msg: Message) -> None:
        """A worker's result for a job this edge offloaded (manual ack)."""
        ret = ledger.read_return(msg)
        if isinstance(ret, str):
            self.counters["bad_returns"] += 1
            log.warning("discarded a return on %s: %s", msg.topic, ret)
            self._transport.ack(msg)
            return
        tracked = self._jobs.get(ret.job_id)
        verdict = ledger.return_verdict(tracked, ret.attempt)
        if verdict != "accept" or tracked is None:
            self.counters["fenced_returns"] += 1
            current = tracked.attempt if tracked is not None else "none"
            log.info(
                "discarded the return of job %s attempt %d from %s (%s; current attempt %s)",
                ret.job_id,
                ret.attempt,
                ret.worker_id,
                verdict,
                current,
            )
            self._transport.ack(msg)
            return
        if ledger.not_run(ret.result):
            self.counters["not_run_returns"] += 1
            why = Declined(ret.result.code or "worker_refused", ret.result.reason or "refused")
            log.info("job %s was refused by %s: %s", ret.job_id, ret.worker_id, why.reason)
            tracked.declined = why
            self._transport.ack(msg)
            tracked.phase = "queued"  # no new offer: run it here
            self._queue.push(tracked, force=True)
            self._idle.clear()
            self._dispatch()
            return
        self._conclude(tracked, ret.payload, ret.result.status, attempt=ret.attempt, ack=msg)

    def on_notice(self, msg: Message) -> None:
        """The broker says a placed job's worker was lost, or the job is dead-lettered."""
        notice = ledger.read_notice(msg)
        self._transport.ack(msg)
        if isinstance(notice, str):
            self.counters["bad_notices"] += 1
            log.warning("discarded a notice on %s: %s", msg.topic, notice)
            return
        tracked = self._jobs.get(notice.job_id)
        if notice.kind == "dead_letter":
            if tracked is None or tracked.phase not in ledger.TAKES_DEAD_LETTER:
                self.counters["stale_notices"] += 1
                return
            self.counters["dead_letters"] += 1
            self._conclude_local(tracked, "failed", code="dead_letter", reason=notice.reason)
            return
        if (
            tracked is None
            or tracked.phase not in ledger.TAKES_WORKER_LOST
            or notice.attempt != tracked.attempt
        ):
            self.counters["stale_notices"] += 1
            return
        self.counters["workers_lost"] += 1
        log.info(
            "job %s attempt %d lost with worker %s", notice.job_id, notice.attempt, notice.worker_id
        )
        self._route(tracked, retry=Declined("worker_lost", notice.reason))

    def check_offloaded(self) -> None:
        """Reroute offloaded jobs whose return is overdue (the broker or the message may be
        gone); runs every fraction of ``result_timeout_s``, callable directly in tests."""
        now = self._clock()
        timeout = self._offload_settings.result_timeout_s
        for tracked in list(self._jobs.values()):
            if tracked.phase == "offloaded" and (tracked.expires_at or 0.0) <= now:
                self.counters["offload_timeouts"] += 1
                log.info(
                    "job %s attempt %d: no result within %.1f s; rerouting",
                    tracked.job.job_id,
                    tracked.attempt,
                    timeout,
                )
                why = Declined("result_timeout", f"no result from the pool within {timeout} s")
                self._route(tracked, retry=why)

    # -- execution: the loop hands jobs to the thread pool and takes results back ----------

    def _queue_key(self, tracked: Tracked) -> tuple[int, float]:
        return queue_key(tracked.job)

    def _dispatch(self) -> None:
        """Start queued jobs while a compute slot is free (loop thread)."""
        while not self._killed and self._in_flight < self.settings.concurrency and len(self._queue):
            tracked = self._queue.pop()
            if not self._current(tracked, "queued"):
                continue  # concluded or rerouted while it waited
            job = tracked.job
            now = self._clock()
            if job.deadline is not None and now >= job.deadline:
                late = (now - job.deadline) * 1000.0
                reason = f"the deadline passed {late:.0f} ms before the job could start; not run"
                self._conclude_local(tracked, "expired", code="expired", reason=reason)
                continue
            if tracked.local_runs >= self.settings.max_local_runs:
                self._dead_letter_locally(tracked)
                continue
            tracked.phase = "starting"
            self._in_flight += 1
            self.outbox.start_run(job.job_id).add_done_callback(partial(self._start, tracked))
        self._update_idle()

    def _start(self, tracked: Tracked, fut: asyncio.Future[int | None]) -> None:
        if self._killed:
            return
        try:
            runs = fut.result()
        except OutboxError as exc:
            runs = None
            self.counters["outbox_errors"] += 1
            log.error("could not count the run of job %s: %s", tracked.job.job_id, exc)
        if runs is None or not self._current(tracked, "starting"):
            self._in_flight -= 1
            if self._current(tracked, "starting"):  # disk trouble: it replays after a restart
                del self._jobs[tracked.job.job_id]
            self._dispatch()
            return
        tracked.local_runs = runs
        tracked.phase = "running"
        model = self._registry.get(tracked.job.model)
        started = self._clock()
        future = self._executor.submit(
            model.infer_bytes, tracked.job.payload, info=tracked.job.image
        )
        future.add_done_callback(partial(self._from_worker, tracked, started))

    def _from_worker(self, tracked: Tracked, started: float, future: Future[Inference]) -> None:
        # Runs on the worker thread: hand the outcome back to the loop, nothing more.
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed under us
                loop.call_soon_threadsafe(self._completed, tracked, started, future)

    def _completed(self, tracked: Tracked, started: float, future: Future[Inference]) -> None:
        if self._killed:
            return
        self._in_flight -= 1
        job = tracked.job
        try:
            outputs, times = future.result()
        except ImageError as exc:
            self._conclude_local(
                tracked, "rejected", code="bad_image", reason=str(exc), started=started
            )
        except Exception as exc:
            log.exception("inference failed for job %s", job.job_id)
            reason = f"inference failed: {type(exc).__name__}: {exc}"
            self._conclude_local(
                tracked, "failed", code="inference_error", reason=reason, started=started
            )
        else:
            compute_s = (times.decode_ms + times.preprocess_ms + times.inference_ms) / 1000.0
            self.service_times.observe(job.model, compute_s)
            self._conclude_local(tracked, "ok", outputs=outputs, times=times, started=started)
        self._dispatch()

    def _dead_letter_locally(self, tracked: Tracked) -> None:
        self.counters["dead_letters"] += 1
        job_id = tracked.job.job_id
        reason = ledger.dead_letter_reason(job_id, self.settings.id, tracked.local_runs)
        log.error("dead-lettered job %s: %s", job_id, reason)
        self._conclude_local(tracked, "failed", code="dead_letter", reason=reason)

    def _conclude_local(
        self,
        tracked: Tracked,
        status: wire.Status,
        *,
        code: str | None = None,
        reason: str | None = None,
        outputs: VisionOutputs | None = None,
        times: StageTimes | None = None,
        started: float | None = None,
    ) -> None:
        """Conclude a job with a result made here."""
        result = local_result(
            tracked.job,
            status,
            ran_on=self._ran_on,
            now=self._clock(),
            code=code,
            reason=reason,
            outputs=outputs,
            times=times,
            started=started,
            declined=tracked.declined,
        )
        self._conclude(tracked, wire.dump(result), status)

    def _conclude(
        self,
        tracked: Tracked,
        payload: bytes,
        status: str,
        *,
        attempt: int | None = None,
        ack: Message | None = None,
    ) -> None:
        tracked.phase = "finishing"
        self._finishing += 1
        then = partial(self._concluded, tracked)
        self._answers.conclude(tracked.job, payload, status, then, attempt=attempt, ack=ack)

    def _concluded(self, tracked: Tracked, stored: bool | None) -> None:
        self._finishing -= 1
        if self._jobs.get(tracked.job.job_id) is tracked:
            del self._jobs[tracked.job.job_id]  # concluded, or on disk to replay after restart
        if stored is None:
            self.counters["outbox_errors"] += 1
        elif not stored:
            # The outbox refused a result this agent thought it could take: trust the disk.
            self.counters["late_results"] += 1
            self._resync(tracked.job.job_id)
        self._update_idle()

    def _resync(self, job_id: str) -> None:
        """Track a job again as the outbox holds it, if it is still pending there."""

        def read(fut: asyncio.Future[Stored | None]) -> None:
            if self._killed or fut.cancelled() or fut.exception() is not None:
                return
            stored = fut.result()
            if stored is not None and stored.pending and job_id not in self._jobs:
                log.warning("job %s is still %s on disk; tracking it again", job_id, stored.state)
                for action in self._replay([stored]):
                    action()

        self.outbox.get(job_id).add_done_callback(read)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _update_idle(self) -> None:
        busy = (
            self._in_flight
            or len(self._queue)
            or self._offering
            or self._finishing
            or self._admitting
        )
        if busy:
            self._idle.clear()
        else:
            self._idle.set()

    # -- restart: replay what the outbox holds ----------------------------------------------

    def _replay(self, stored_jobs: list[Stored]) -> list[Callable[[], None]]:
        """Track the unfinished jobs read back from the outbox; returns what to do once the
        agent is subscribed (route, republish, dead-letter)."""
        actions: list[Callable[[], None]] = []
        timeout = self._offload_settings.result_timeout_s
        now = self._clock()
        for stored in stored_jobs:
            job = stored.job
            plan = ledger.replay_plan(stored, self.settings.max_local_runs)
            self.counters["replayed"] += 1
            if plan == "republish":
                assert stored.result is not None
                self.counters["republished"] += 1
                actions.append(partial(self._answers.publish, job, stored.result, record=True))
                continue
            tracked = Tracked(job, "queued", stored.attempt, stored.local_runs)
            self._jobs[job.job_id] = tracked
            if plan == "await_return":
                tracked.phase = "offloaded"
                tracked.expires_at = ledger.offload_expiry(now, timeout, job.deadline)
            elif plan == "dead_letter":
                actions.append(partial(self._dead_letter_locally, tracked))
            else:
                actions.append(partial(self._route, tracked))
        if stored_jobs:
            log.info("replaying %d unfinished jobs from %s", len(stored_jobs), self.outbox.path)
        return actions

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
            results=dict(self._answers.results),
            dropped_no_response_topic=self._answers.dropped_no_response_topic,
            offloaded=self.offloaded,
            offload_pending=self._offering,
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
            topic = topics.edge_telemetry(self.settings.id)
            with contextlib.suppress(Exception):  # QoS 0: the next one follows in a second
                self._transport.publish_nowait(topic, wire.dump(self.telemetry()), qos=0)

    def _announce_online(self) -> None:
        self._transport.publish_nowait(
            topics.edge_status(self.settings.id),
            status_message(self.settings, "online"),
            qos=1,
            retain=True,
        )

    # -- lifecycle ---------------------------------------------------------------------------------

    def kill(self) -> None:
        """Stop at once, as a killed process would: nothing more is written, published or
        acked; what is on disk is what a restart finds. (Crash tests; fatal errors.)"""
        self._killed = True
        self._accepting = False
        self.outbox.kill()
        self._answers.kill()
        for task in list(self._tasks):
            task.cancel()
        if self._own_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)
        self._halted.set()

    async def run(self, stop: asyncio.Event, *, drain_timeout: float = 10.0) -> None:
        """Serve until ``stop`` is set, then answer what is queued and go offline."""
        self._loop = asyncio.get_running_loop()
        stored = await self.outbox.open()
        replay = self._replay(stored)
        if self._own_executor and isinstance(self._executor, ThreadPoolExecutor):
            # Every compute thread exists before the first job, so none pays for making one.
            pool, threads = self._executor, self.settings.concurrency
            await self._loop.run_in_executor(None, start_all, pool, threads)
        self._process.cpu_percent(None)  # prime: the first reading is always 0
        self._accepting = True
        edge = self.settings.id
        submit = topics.edge_submit(edge)
        # Returns and notices first: the replayed jobs they concern are tracked already.
        await self._transport.subscribe(topics.edge_returns(edge), self.on_return, manual_ack=True)
        await self._transport.subscribe(topics.edge_notices(edge), self.on_notice, manual_ack=True)
        # Subscribe before announcing: on one connection the broker handles the SUBSCRIBE
        # before the status PUBLISH, so whoever sees "online" can submit at once.
        await self._transport.subscribe(submit, self.on_message, qos=1, manual_ack=True)
        for action in replay:
            action()
        self._transport.on_connect(self._announce_online)
        if self._transport.connected:
            self._announce_online()
        self.ready.set()
        sweep_s = min(0.25, self._offload_settings.result_timeout_s / 4.0)
        housekeeping = [
            asyncio.ensure_future(
                self._every(self.settings.telemetry_interval_s, self._publish_telemetry)
            ),
            asyncio.ensure_future(self._every(sweep_s, self.check_offloaded)),
            asyncio.ensure_future(self._every(PRUNE_INTERVAL_S, self.outbox.prune)),
        ]
        log.info(
            "edge agent %s (zone %s) serving %s on %s",
            edge,
            self.settings.zone,
            ", ".join(sorted(self._models)),
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
            if not self._killed:
                await self._shut_down(drain_timeout)

    async def _shut_down(self, drain_timeout: float) -> None:
        self._accepting = False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), drain_timeout)
        await self._answers.drain(2.0)
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
        for task in list(self._tasks):
            task.cancel()
        if self._own_executor:
            self._executor.shutdown(wait=True)
        await self.outbox.close()
