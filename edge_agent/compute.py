"""The jobs that run on this edge: the local queue, the thread pool and its outcomes.

A job waits in the queue (priority first, then earliest deadline) until the dispatcher
gives it a compute slot; its run is counted on disk first, then it is handed over here, and
the first compute thread free takes the most urgent job handed over: OpenCV and ONNX Runtime
run it (they release the GIL), and its outcome comes back to the loop as a
:class:`~edge_agent.events.RunDone`. There are more slots than threads (``rules.run_slots``),
so a job is counted while the threads compute and a thread never idles through a commit.
It never blocks the loop; what a job's phase allows is the lifecycle table's to say, not this
module's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import NamedTuple

from edge_agent.admission import Job, queue_key
from edge_agent.events import RunDone
from edge_agent.jobs import Entry
from edge_agent.load import JobQueue, ServiceTimes
from sluicegate.config import EdgeSettings
from sluicegate.errors import ImageError
from sluicegate.threads import EDGE_COMPUTE, compute_pool, start_all
from sluicegate.vision.postprocess import Outputs as VisionOutputs
from sluicegate.vision.runtime import LoadedModel, ModelRegistry, StageTimes

log = logging.getLogger(__name__)

Inference = tuple[VisionOutputs, StageTimes]
Done = Callable[[RunDone], None]


class Handed(NamedTuple):
    """A job whose run is counted, waiting for a compute thread."""

    job: Job
    model: LoadedModel
    done: Done


class Ran(NamedTuple):
    """What a compute thread made of a job: its outputs, or the exception it raised."""

    job: Job
    started: float  # when a thread took it
    done: Done
    outcome: Inference | Exception


def _key(entry: Entry) -> tuple[int, float]:
    return queue_key(entry.job)


def _handed_key(handed: Handed) -> tuple[int, float]:
    return queue_key(handed.job)


class Compute:
    """Queue, thread pool and service times of one edge agent (loop thread only)."""

    def __init__(
        self,
        settings: EdgeSettings,
        registry: ModelRegistry,
        clock: Callable[[], float],
        executor: Executor | None = None,
    ) -> None:
        self._settings = settings
        self._registry = registry
        self._clock = clock
        # Entries waiting for a slot; one that left ``queued`` meanwhile is skipped as popped.
        self.queue: JobQueue[Entry] = JobQueue(settings.queue_size, _key)
        self.service_times = ServiceTimes(settings.service_time_alpha)
        # Jobs handed over (their runs counted), the most urgent taken first by whichever
        # compute thread frees; guarded by the lock (the threads pop, the loop pushes).
        self._handed: JobQueue[Handed] = JobQueue(settings.queue_size, _handed_key)
        self._handed_lock = threading.Lock()
        self._own_executor = executor is None
        self._executor = executor or compute_pool(settings.concurrency, EDGE_COMPUTE)
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._own_executor and isinstance(self._executor, ThreadPoolExecutor):
            # Every compute thread exists before the first job, so none pays for making one.
            pool, threads = self._executor, self._settings.concurrency
            await self._loop.run_in_executor(None, start_all, pool, threads)

    def model_sha256(self, model: str) -> str | None:
        """The sha256 of the file served as ``model`` now (None: not loaded)."""
        return self._registry.get(model).manifest.sha256 if model in self._registry else None

    def service_s(self, model: str) -> float:
        return self.service_times.estimate(model) or 0.0

    def run(self, job: Job, done: Done) -> None:
        """Hand ``job`` (its run counted) to the compute threads; ``done`` gets its outcome
        on the loop. The model is the one served now: a reload meanwhile does not change it."""
        handed = Handed(job, self._registry.get(job.model), done)
        with self._handed_lock:
            self._handed.push(handed, force=True)
        self._executor.submit(self._run_next).add_done_callback(self._from_worker)

    def _run_next(self) -> Ran:
        # On a compute thread: one task per job handed over, each taking the most urgent.
        with self._handed_lock:
            job, model, done = self._handed.pop()
        started = self._clock()
        try:
            outcome: Inference | Exception = model.infer_bytes(job.payload, info=job.image)
        except Exception as exc:  # the job's failure, reported on the loop
            outcome = exc
        return Ran(job, started, done, outcome)

    def _from_worker(self, future: Future[Ran]) -> None:
        # Runs on the worker thread: hand the outcome back to the loop, nothing more.
        if future.cancelled():
            return  # killed: the job replays after a restart
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed under us
                loop.call_soon_threadsafe(self._completed, future.result())

    def _completed(self, ran: Ran) -> None:
        job, started, done, outcome = ran
        if isinstance(outcome, ImageError):
            done(RunDone("rejected", "bad_image", str(outcome), (None, None, started)))
        elif isinstance(outcome, Exception):  # any failure of the model is the job's result
            log.error("inference failed for job %s", job.job_id, exc_info=outcome)
            reason = f"inference failed: {type(outcome).__name__}: {outcome}"
            done(RunDone("failed", "inference_error", reason, (None, None, started)))
        else:
            outputs, times = outcome
            compute_s = (times.decode_ms + times.preprocess_ms + times.inference_ms) / 1000.0
            self.service_times.observe(job.model, compute_s)
            done(RunDone("ok", detail=(outputs, times, started)))

    def shutdown(self) -> None:
        if self._own_executor:
            self._executor.shutdown(wait=True)

    def kill(self) -> None:
        if self._own_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)
