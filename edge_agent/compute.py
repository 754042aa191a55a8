"""The jobs that run on this edge: the local queue, the thread pool and its outcomes.

A job waits in the queue (priority first, then earliest deadline) until the dispatcher
gives it a compute slot; its run is counted on disk first, then OpenCV and ONNX Runtime get
it on a compute thread (they release the GIL), and its outcome comes back to the loop as a
:class:`~edge_agent.events.RunDone`. It never blocks the loop; what a job's phase allows is
the lifecycle table's to say, not this module's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from functools import partial

from edge_agent.admission import Job, queue_key
from edge_agent.events import RunDone
from edge_agent.jobs import Entry
from edge_agent.load import JobQueue, ServiceTimes
from sluicegate.config import EdgeSettings
from sluicegate.errors import ImageError
from sluicegate.threads import EDGE_COMPUTE, compute_pool, start_all
from sluicegate.vision.postprocess import Outputs as VisionOutputs
from sluicegate.vision.runtime import ModelRegistry, StageTimes

log = logging.getLogger(__name__)

Inference = tuple[VisionOutputs, StageTimes]
Done = Callable[[RunDone], None]


def _key(entry: Entry) -> tuple[int, float]:
    return queue_key(entry.job)


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
        """Run ``job`` on a compute thread; ``done`` gets its outcome on the loop."""
        started = self._clock()
        model = self._registry.get(job.model)
        future = self._executor.submit(model.infer_bytes, job.payload, info=job.image)
        future.add_done_callback(partial(self._from_worker, job, started, done))

    def _from_worker(self, job: Job, started: float, done: Done, future: Future[Inference]) -> None:
        # Runs on the worker thread: hand the outcome back to the loop, nothing more.
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed under us
                loop.call_soon_threadsafe(self._completed, job, started, done, future)

    def _completed(self, job: Job, started: float, done: Done, future: Future[Inference]) -> None:
        if future.cancelled():
            return  # killed: the job replays after a restart
        try:
            outputs, times = future.result()
        except ImageError as exc:
            done(RunDone("rejected", "bad_image", str(exc), (None, None, started)))
        except Exception as exc:  # any failure of the model is the job's result, never ours
            log.exception("inference failed for job %s", job.job_id)
            reason = f"inference failed: {type(exc).__name__}: {exc}"
            done(RunDone("failed", "inference_error", reason, (None, None, started)))
        else:
            compute_s = (times.decode_ms + times.preprocess_ms + times.inference_ms) / 1000.0
            self.service_times.observe(job.model, compute_s)
            done(RunDone("ok", detail=(outputs, times, started)))

    def shutdown(self) -> None:
        if self._own_executor:
            self._executor.shutdown(wait=True)

    def kill(self) -> None:
        if self._own_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)
