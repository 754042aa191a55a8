"""The jobs that run on this edge: the local queue, the compute slots and the thread pool.

A job waits in the queue (priority first, then earliest deadline); when a slot is free its
deadline is checked, then its run is counted in the outbox, and only once that is on disk
does OpenCV and ONNX Runtime get it, on a compute thread (they release the GIL). The
outcome comes back to the loop, where the agent concludes the job. A job whose counted runs
reached ``max_local_runs`` (each ended by the agent dying) is dead-lettered instead of being
started again. It never blocks the loop and never runs a job that is no longer the agent's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

from edge_agent.admission import Job, queue_key
from edge_agent.errors import OutboxError
from edge_agent.ledger import Phase, Tracked
from edge_agent.load import JobQueue, ServiceTimes
from edge_agent.offload import predict_completion
from edge_agent.outbox import Outbox
from sluicegate.config import EdgeSettings
from sluicegate.errors import ImageError
from sluicegate.threads import EDGE_COMPUTE, compute_pool, start_all
from sluicegate.vision.postprocess import Outputs as VisionOutputs
from sluicegate.vision.runtime import ModelRegistry, StageTimes

log = logging.getLogger(__name__)

Inference = tuple[VisionOutputs, StageTimes]


@dataclass(frozen=True)
class RunHooks:
    """What local execution asks of the agent that owns the jobs."""

    current: Callable[[Tracked, Phase], bool]  # still tracked, and in that phase
    forget: Callable[[Tracked], None]  # its run could not be counted: it replays later
    conclude: Callable[..., None]  # conclude_local(tracked, status, **details)
    dead_letter: Callable[[Tracked], None]  # its runs reached max_local_runs
    settled: Callable[[], None]  # slots or queue changed: update idleness


class LocalRuns:
    """Queue, compute slots and thread pool of one edge agent (loop thread only)."""

    def __init__(
        self,
        settings: EdgeSettings,
        registry: ModelRegistry,
        outbox: Outbox,
        clock: Callable[[], float],
        hooks: RunHooks,
        counters: Any,
        executor: Executor | None = None,
    ) -> None:
        self._settings = settings
        self._registry = registry
        self._outbox = outbox
        self._clock = clock
        self._hooks = hooks
        self._counters = counters
        self.queue: JobQueue[Tracked] = JobQueue(settings.queue_size, self._key)
        self.in_flight = 0  # slots taken: starting (run being counted) or running
        self.reserved = 0  # of which held for jobs whose acceptance is being committed
        self.service_times = ServiceTimes(settings.service_time_alpha)
        self._own_executor = executor is None
        self._executor = executor or compute_pool(settings.concurrency, EDGE_COMPUTE)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._killed = False

    @staticmethod
    def _key(tracked: Tracked) -> tuple[int, float]:
        return queue_key(tracked.job)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._own_executor and isinstance(self._executor, ThreadPoolExecutor):
            # Every compute thread exists before the first job, so none pays for making one.
            pool, threads = self._executor, self._settings.concurrency
            await self._loop.run_in_executor(None, start_all, pool, threads)

    def predict(self, job: Job) -> float:
        """When ``job`` would finish here if it joined the queue now."""
        service_s = self.service_times.estimate(job.model) or 0.0
        concurrency = self._settings.concurrency
        return predict_completion(
            self._clock(), len(self.queue), self.in_flight, concurrency, service_s
        )

    @property
    def free_now(self) -> bool:
        """A slot is free and nothing waits for it."""
        return not len(self.queue) and self.in_flight < self._settings.concurrency

    def reserve(self) -> None:
        """Hold a slot for a job whose acceptance (its run counted with it) is committing."""
        self.in_flight += 1
        self.reserved += 1

    def reserved_done(self, *, keep: bool) -> None:
        """The commit is back: ``keep`` the slot for the job's run, or give it back."""
        self.reserved -= 1
        if not keep:
            self.in_flight -= 1
            self.dispatch()

    def enqueue(self, tracked: Tracked) -> None:
        tracked.phase = "queued"
        self.queue.push(tracked, force=True)  # accepted already: never refused now
        self.dispatch()

    def dispatch(self) -> None:
        """Start queued jobs while a compute slot is free."""
        while not self._killed and self.in_flight < self._settings.concurrency and len(self.queue):
            tracked = self.queue.pop()
            if not self._hooks.current(tracked, "queued"):
                continue  # concluded or rerouted while it waited
            job = tracked.job
            if self._expired(tracked, self._clock()):
                continue
            if tracked.local_runs >= self._settings.max_local_runs:
                self._hooks.dead_letter(tracked)
                continue
            tracked.phase = "starting"
            self.in_flight += 1
            self._outbox.start_run(job.job_id).add_done_callback(partial(self._counted, tracked))
        self._hooks.settled()

    def _counted(self, tracked: Tracked, fut: asyncio.Future[int | None]) -> None:
        if self._killed:
            return
        try:
            runs = fut.result()
        except OutboxError as exc:
            runs = None
            self._counters["outbox_errors"] += 1
            log.error("could not count the run of job %s: %s", tracked.job.job_id, exc)
        if runs is None or not self._hooks.current(tracked, "starting"):
            self.in_flight -= 1
            if self._hooks.current(tracked, "starting"):  # disk trouble: replays after restart
                self._hooks.forget(tracked)
            self.dispatch()
            return
        tracked.local_runs = runs
        self.launch(tracked)

    def launch(self, tracked: Tracked) -> None:
        """Hand a job whose run is counted on disk to a compute thread (its slot is held)."""
        job = tracked.job
        started = self._clock()
        if self._expired(tracked, started):
            self.in_flight -= 1
            self.dispatch()
            return
        tracked.phase = "running"
        model = self._registry.get(job.model)
        future = self._executor.submit(model.infer_bytes, job.payload, info=job.image)
        future.add_done_callback(partial(self._from_worker, tracked, started))

    def _expired(self, tracked: Tracked, now: float) -> bool:
        """Conclude a job whose deadline passed before it could start; True if it did."""
        deadline = tracked.job.deadline
        if deadline is None or now < deadline:
            return False
        late = (now - deadline) * 1000.0
        reason = f"the deadline passed {late:.0f} ms before the job could start; not run"
        self._hooks.conclude(tracked, "expired", code="expired", reason=reason)
        return True

    def _from_worker(self, tracked: Tracked, started: float, future: Future[Inference]) -> None:
        # Runs on the worker thread: hand the outcome back to the loop, nothing more.
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed under us
                loop.call_soon_threadsafe(self._completed, tracked, started, future)

    def _completed(self, tracked: Tracked, started: float, future: Future[Inference]) -> None:
        if self._killed:
            return
        self.in_flight -= 1
        job = tracked.job
        try:
            outputs, times = future.result()
        except ImageError as exc:
            self._hooks.conclude(
                tracked, "rejected", code="bad_image", reason=str(exc), started=started
            )
        except Exception as exc:
            log.exception("inference failed for job %s", job.job_id)
            reason = f"inference failed: {type(exc).__name__}: {exc}"
            self._hooks.conclude(
                tracked, "failed", code="inference_error", reason=reason, started=started
            )
        else:
            compute_s = (times.decode_ms + times.preprocess_ms + times.inference_ms) / 1000.0
            self.service_times.observe(job.model, compute_s)
            self._hooks.conclude(tracked, "ok", outputs=outputs, times=times, started=started)
        self.dispatch()

    def shutdown(self) -> None:
        if self._own_executor:
            self._executor.shutdown(wait=True)

    def kill(self) -> None:
        self._killed = True
        if self._own_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)
