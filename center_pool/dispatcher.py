"""The execution side of a worker: ready batches off the queue, onto a bounded thread pool,
and each job's result, usage record and completion record out.

:class:`Dispatcher` pops what the pure :class:`~center_pool.batching.BatchQueue` says is
ready, never more batches at once than the worker's concurrency; a job whose deadline passed
before it could start is answered ``expired`` and never run. Each batch goes to the executor
(:func:`~center_pool.execution.run_batch`: OpenCV and ONNX Runtime release the GIL) and its
outcome comes back to the loop with ``call_soon_threadsafe``. Every job of it then gets its
timings, a result for its edge and a completion for the broker through the
:class:`~center_pool.replies.Replies`, and, metered, a usage record that those wait for
(:class:`~center_pool.usage.BatchRecords`). A timer wakes it when the queue's next batch is
due. It never blocks the loop on compute, and a batch that raises is its jobs' failed
result, never the dispatcher's end.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from functools import partial

from center_pool.batching import BatchQueue, ready_batches
from center_pool.execution import BatchRun, ItemRun, run_batch
from center_pool.intake import WorkItem
from center_pool.job_figures import WorkFigures
from center_pool.replies import Replies
from center_pool.reporting import ServiceStats
from center_pool.usage import BatchRecords, attempt_record
from sluicegate import wire
from sluicegate.config import PoolSettings
from sluicegate.metering.meter import Meter
from sluicegate.metering.record import Usage
from sluicegate.threads import POOL_COMPUTE, compute_pool, start_all
from sluicegate.vision.image import PayloadLimits as Limits
from sluicegate.vision.runtime import ModelRegistry

log = logging.getLogger(__name__)


class Dispatcher:
    """Runs one worker's admitted jobs, a batch at a time. ``bind`` it to the loop first."""

    def __init__(
        self,
        settings: PoolSettings,
        registry: ModelRegistry,
        queue: BatchQueue[WorkItem],
        replies: Replies,
        service: ServiceStats,
        figures: WorkFigures,
        *,
        meter: Meter | None,
        limits: Limits,
        clock: Callable[[], float],
        backend: str,
        accepting: Callable[[], bool],
        emptied: Callable[[], None],
    ) -> None:
        """``accepting``: False once the worker stops (then every queued batch is ready).
        ``emptied``: called when nothing is queued, running or waiting for its records."""
        self._settings = settings
        self._registry = registry
        self._queue = queue
        self._replies = replies
        self._service = service
        self._figures = figures
        self._meter = meter
        self._limits = limits
        self._clock = clock
        self._backend = backend
        self._accepting = accepting
        self._emptied = emptied
        self.models: Mapping[str, str] = {}  # the models served, name to sha256
        self.usage = BatchRecords(meter, self.dispatch)  # results wait for their records
        self._executor = compute_pool(settings.concurrency, POOL_COMPUTE)
        self.running = 0  # batches on the executor
        self.in_flight = 0  # jobs in those batches
        self.running_models: Counter[str] = Counter()  # the same jobs, by model
        self.decode_attempts = 0  # jobs handed to the decoder: proof that refusals never are
        self.batch_sizes: Counter[int] = Counter()
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop that outcomes come back to and timers run on."""
        self._loop = loop

    async def start_threads(self) -> None:
        """Make every compute thread now, so the first batches pay for none (and a host
        that caps the model threads' CPU finds them all from the start)."""
        threads = self._settings.concurrency
        await asyncio.get_running_loop().run_in_executor(None, start_all, self._executor, threads)

    def cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def shutdown(self) -> None:
        """Wait for the batches on the executor, then stop its threads."""
        self._executor.shutdown(wait=True)

    def dispatch(self) -> None:
        """Start every batch that is ready, while slots are free."""
        now = self._clock()
        free = self._settings.concurrency - self.running
        for ready in ready_batches(self._queue, now, free, _deadline, drain=not self._accepting()):
            for item in ready.expired:
                self._finish_expired(item, now)
            live = ready.live
            if not live:
                continue
            self.running += 1
            self.in_flight += len(live)
            self.running_models[ready.model] += len(live)
            self.decode_attempts += len(live)
            model = self._registry.get(ready.model)
            jobs = [(item.payload, item.image) for item in live]
            future = self._executor.submit(run_batch, model, jobs, limits=self._limits)
            future.add_done_callback(partial(self._from_thread, live, now))
        self._arm_timer(now)
        if not (self.running or self.usage.pending or len(self._queue)):
            self._emptied()

    def _arm_timer(self, now: float) -> None:
        if self.running >= self._settings.concurrency or self._loop is None:
            return
        at = self._queue.ready_at()
        if at is None:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(max(0.0, at - now), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.dispatch()

    def _from_thread(self, items: list[WorkItem], started: float, future: Future[BatchRun]) -> None:
        # Runs on the executor thread: hand the outcome back to the loop, nothing more.
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._completed, items, started, future)

    def _completed(self, items: list[WorkItem], started: float, future: Future[BatchRun]) -> None:
        self.running -= 1
        self.in_flight -= len(items)
        self.running_models[items[0].model] -= len(items)
        try:
            run = future.result()
        except Exception as exc:  # whatever the batch raised is its jobs' result
            log.exception("batch of %d failed", len(items))
            failed = ItemRun(None, "inference_error", f"inference failed: {exc}", 0.0, 0.0)
            run = BatchRun(tuple(failed for _ in items), 0.0, 0)
        end = self._clock()
        if run.batch_size:
            self._service.observe(items[0].model, run.compute_ms, run.batch_size)
            self.batch_sizes[run.batch_size] += 1
            self._figures.batch(items[0].model, run.batch_size, end - started)
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
            out = self._replies.result(
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
                peer=item.peer,
            )
            if out is not None:
                sends.append(partial(self._replies.send, out))
            if part.ran and self._meter is not None:
                draft = attempt_record(
                    self._meter.ledger,
                    item,
                    self._settings,
                    model_sha256=self.models.get(item.model, ""),
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
            self._figures.returned(item.model, status, ran)
            sends.append(
                partial(
                    self._replies.completion,
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
        self.dispatch()

    def _finish_expired(self, item: WorkItem, now: float) -> None:
        assert item.deadline is not None
        late = (now - item.deadline) * 1000.0
        queue_ms = (now - item.received_at) * 1000.0
        self._replies.result(
            item.job_id,
            item.edge_id,
            item.attempt,
            item.correlation_data,
            status="expired",
            model=item.model,
            code="expired",
            reason=f"the deadline passed {late:.0f} ms before the job could start; not run",
            timings=wire.Timings(queue_ms=round(queue_ms, 3), total_ms=round(queue_ms, 3)),
            peer=item.peer,
        )
        self._figures.returned(item.model, "expired")
        self._replies.completion(
            item.job_id,
            "expired",
            item.model,
            edge_id=item.edge_id,
            attempt=item.attempt,
            service_ms=0.0,
            queue_ms=queue_ms,
            batch_size=1,
        )


def _deadline(item: WorkItem) -> float | None:
    return item.deadline
