"""A crashable edge agent for the in-memory tier: the real EdgeAgent and a real SQLite
outbox file, over the memory transport's persistent sessions, with compute and offloading
the test controls.

``EdgeRig`` starts an agent, kills it (as SIGKILL would: the outbox keeps what it
committed, the session keeps what was not acked) and starts another on the same outbox and
client id. Compute runs on a :class:`HeldExecutor` (work waits until the test runs it) and
placements come from a :class:`FakePlacement` (every offer placed, or declined on request;
answered at once, or held until the test answers), so a test decides where each crash falls.
The fake also notes the work sent for a job the outbox had not yet committed (``early``):
only a first attempt, answered while the job's acceptance commits, may go out so. ``tick``
advances the loop one step and waits for the outbox's writer, which makes the
interleavings reproducible.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_agent.admission import Job
from edge_agent.agent import EdgeAgent
from edge_agent.outbox import Accepted, Outbox, Stored, Synchronous
from edge_agent.rules import Declined, Placement
from sluicegate import topics, wire
from sluicegate.config import load_settings
from sluicegate.memory_transport import MemoryBroker, MemoryTransport
from sluicegate.sqlite_writer import Batch
from sluicegate.transport import Message
from sluicegate.vision.image import ImageInfo
from sluicegate.vision.postprocess import Outputs
from sluicegate.vision.runtime import StageTimes
from sluicegate.wire_pool import JobNotice
from tests.image_bytes import sample_jpeg

EDGE = "rig-edge"
APP_TOPIC = "app/results"
JPEG, _ = sample_jpeg(5)


@dataclass(frozen=True)
class FakeManifest:
    sha256: str = "5" * 64


class FakeModel:
    manifest = FakeManifest()

    def infer_bytes(self, payload: bytes, info: ImageInfo | None = None) -> tuple[Any, Any]:
        return Outputs("ok", {"ok": 1.0}), StageTimes(0.1, 0.1, 0.1)


class FakeRegistry:
    def names(self) -> list[str]:
        return ["defect-v1", "reader-v1"]

    def __contains__(self, name: object) -> bool:
        return name in self.names()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def get(self, name: str) -> FakeModel:
        return FakeModel()


class HeldExecutor(Executor):
    """Compute that starts only when the test says so (on the test's thread)."""

    def __init__(self) -> None:
        self.held: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], Future[Any]]]
        self.held = []
        self.ran = 0  # calls run so far

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        self.held.append((fn, args, kwargs, fut))
        return fut

    def run_all(self) -> int:
        held, self.held = self.held, []
        self.ran += len(held)
        for fn, args, kwargs, fut in held:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args, **kwargs))
                except Exception as exc:
                    fut.set_exception(exc)
        return len(held)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if cancel_futures:
            for *_, fut in self.held:
                fut.cancel()
            self.held = []


@dataclass
class FakePlacement:
    """Stands in for PlacementClient: places every offer unless its job id is in
    ``decline``; with ``slow``, an answer waits for :meth:`answer_all`. Records each request
    as (job id, attempt) in ``asked`` (and why, with the edge's own estimate, in
    ``reasons``), each work message sent in ``sent`` and each placement
    handed back in ``released``; ``early`` lists (job id, attempt) of the work sent for a
    job not in ``on_disk`` (the ids the outbox has committed)."""

    decline: set[str] = field(default_factory=set)
    asked: list[tuple[str, int]] = field(default_factory=list)
    reasons: dict[str, tuple[str, float]] = field(default_factory=dict)
    sent: list[tuple[str, int]] = field(default_factory=list)
    on_disk: set[str] = field(default_factory=set)
    early: list[tuple[str, int]] = field(default_factory=list)
    released: list[tuple[str, int]] = field(default_factory=list)
    broker_available: bool = True
    slow: bool = False
    predicted_ms: float | None = None  # the broker's predicted completion on w1
    _waiting: list[asyncio.Future[None]] = field(default_factory=list)

    def policy(self) -> None:
        """No policy: no sister campus to hear from."""

    async def place(
        self, job: Job, reason: str, local_estimate_s: float, *, attempt: int = 1
    ) -> Placement | Declined:
        self.asked.append((job.job_id, attempt))
        self.reasons[job.job_id] = (reason, local_estimate_s)
        if self.slow:
            answer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.append(answer)
            await answer
        if job.job_id in self.decline:
            return Declined("no_capacity", "the test declined it")
        work = topics.pool_work("campus/dc", "w1", EDGE)
        return Placement("w1", "campus/dc", work, "tok", b"", predicted_ms=self.predicted_ms)

    def answer_all(self) -> int:
        """Let every placement held by ``slow`` be answered; returns how many."""
        waiting, self._waiting = self._waiting, []
        for answer in waiting:
            if not answer.done():
                answer.set_result(None)
        return len(waiting)

    def release(self, job_id: str, worker_id: str, attempt: int, reason: str) -> None:
        self.released.append((job_id, attempt))

    def send(self, job: Job, placement: Placement, *, attempt: int = 1) -> None:
        if job.job_id not in self.on_disk:
            self.early.append((job.job_id, attempt))
        self.sent.append((job.job_id, attempt))

    async def start(self) -> None:
        return None

    def close(self) -> None:
        return None


class StepGate:
    """Batches reach the outbox's writer only between loop iterations (:meth:`release`), so
    its answers never land on the loop in the middle of one: the interleaving of the loop's
    callbacks and the disk's answers is the same on every run."""

    def __init__(self) -> None:
        self._staged: list[tuple[Batch, Callable[[Batch], None]]] = []

    def admit(self, batch: Batch, pass_on: Callable[[Batch], None]) -> None:
        self._staged.append((batch, pass_on))

    def release(self) -> None:
        staged, self._staged = self._staged, []
        for batch, pass_on in staged:
            pass_on(batch)

    def lose_staged(self) -> None:
        """Forget the batches not yet given to the writer (a crash before their commit)."""
        self._staged = []


class SteppedOutbox(Outbox):
    """An outbox behind a :class:`StepGate`. Each job id the agent can know to be on disk
    is in ``on_disk``: added before the caller hears of its commit, or as the outbox reads
    it back at open (committed by an agent that died before hearing of it)."""

    def __init__(self, *args: Any, on_disk: set[str], **kwargs: Any) -> None:
        self.stepper = StepGate()
        super().__init__(*args, gate=self.stepper, **kwargs)
        self._on_disk = on_disk

    async def open(self) -> list[Stored]:
        stored = await super().open()
        self._on_disk.update(s.job.job_id for s in stored)
        return stored

    def accept(
        self, job: Job, *, start_run: bool = False, written: bool = False
    ) -> asyncio.Future[Accepted]:
        accepting = super().accept(job, start_run=start_run, written=written)

        def committed(fut: asyncio.Future[Accepted]) -> None:
            if not fut.cancelled() and fut.exception() is None:
                self._on_disk.add(job.job_id)

        accepting.add_done_callback(committed)
        return accepting


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def pool_result(job_id: str) -> bytes:
    result = wire.JobResult(
        job_id=job_id,
        status="ok",
        model="defect-v1",
        outputs=wire.Outputs(label="ok", scores={"ok": 1.0}),
        ran_on=wire.RanOn(kind="pool", node="w1", zone="campus/dc"),
    )
    return wire.dump(result)


class EdgeRig:
    """One edge (restartable), one app, one pool, all on one memory broker and loop."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        db: Path,
        *,
        offload: bool = False,
        max_local_runs: int = 3,
        hold_pubacks: bool = False,
        synchronous: Synchronous = "NORMAL",
    ) -> None:
        self.loop = loop
        self.db = db
        self.synchronous = synchronous  # FULL: each commit synced behind it, as shipped
        self.clock = Clock()
        self.broker = MemoryBroker(hold_pubacks=hold_pubacks)
        self.app = MemoryTransport(self.broker, client_id="app")
        self.pool = MemoryTransport(self.broker, client_id="pool")
        self.received: list[Message] = []
        self.run_until(self.app.subscribe(APP_TOPIC, self.received.append))
        self.executor = HeldExecutor()
        self.placement = FakePlacement() if offload else None
        self.settings = load_settings(
            edge={
                "id": EDGE,
                "concurrency": 2,
                "queue_size": 10_000,
                "telemetry_interval_s": 3600.0,
                "max_local_runs": max_local_runs,
            },
            offload={"queue_bound": 0, "result_timeout_s": 3.0},
        )
        self.agent: EdgeAgent | None = None
        self.transport: MemoryTransport | None = None
        self._runner: asyncio.Future[None] | None = None
        self.crashes = 0

    # -- driving the loop ------------------------------------------------------------------

    def run_until(self, aw: Any) -> Any:
        return self.loop.run_until_complete(aw)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the loop now, in a tick of its own; returns what it returned
        (what it schedules runs on later ticks)."""
        out: list[Any] = []
        self.loop.call_soon(lambda: out.append(fn()))
        self.tick()
        return out[0]

    def tick(self) -> None:
        """Commit what the outbox was given (its answers are then queued on the loop),
        then run exactly one iteration of the loop. Nothing else runs concurrently, so a
        sequence of ticks always interleaves the same way."""
        if self.agent is not None:
            outbox = self.agent.outbox
            assert isinstance(outbox, SteppedOutbox)
            outbox.stepper.release()
        # stop() before run_forever(): poll I/O once without waiting, run what is ready, return.
        self.loop.stop()
        self.loop.run_forever()

    def settle(self, *, compute: bool = True, max_ticks: int = 500) -> None:
        """Tick until nothing changes: nothing being written or sent and, with ``compute``,
        no compute held (without, held compute stays held: a run that never ends)."""
        quiet = 0
        for _ in range(max_ticks):
            before = self._fingerprint()
            self.tick()
            if compute and self.executor.run_all():
                quiet = 0
                continue
            quiet = quiet + 1 if self._fingerprint() == before else 0
            if quiet >= 3 and self.agent is not None and self.agent.outbox.writer.pending:
                self.agent.outbox.flush()  # the lazy operations' time comes: they commit
                quiet = 0
            elif quiet >= 3:
                return
        raise AssertionError("the edge did not settle")

    def _fingerprint(self) -> tuple[int, ...]:
        agent = self.agent
        if agent is None:
            return (len(self.broker.log),)
        return (
            len(self.broker.log),
            agent.unfinished,
            agent.delivering,
            agent.outbox.commits,
            len(self.executor.held),
            sum(agent.counters.values()),
        )

    # -- the edge's life -------------------------------------------------------------------

    def start(self) -> EdgeAgent:
        assert self.agent is None
        self.transport = MemoryTransport(self.broker, client_id="edge", persistent=True)
        on_disk = self.placement.on_disk if self.placement is not None else set()
        outbox = SteppedOutbox(
            self.db, synchronous=self.synchronous, clock=self.clock, on_disk=on_disk
        )
        agent = EdgeAgent(
            self.settings.edge,
            self.transport,
            FakeRegistry(),  # type: ignore[arg-type]
            clock=self.clock,
            offload=self.placement,  # type: ignore[arg-type]
            offload_settings=self.settings.offload,
            outbox=outbox,
            executor=self.executor,
        )
        self.agent = agent
        self._runner = asyncio.ensure_future(agent.run(asyncio.Event()), loop=self.loop)
        for _ in range(1000):  # until the outbox is open and the agent subscribed
            self.tick()
            if agent.ready.is_set():
                return agent
        raise AssertionError("the edge did not start")

    def crash(self, *, before_commit: bool = False) -> None:
        """SIGKILL, in memory: nothing more leaves the agent; disk and session stay. The
        writes submitted by then are committed first, unless ``before_commit``."""
        assert self.agent is not None
        assert self.transport is not None
        if before_commit:
            outbox = self.agent.outbox
            assert isinstance(outbox, SteppedOutbox)
            outbox.stepper.lose_staged()
        self.call(self.agent.kill)
        self.transport.crash()
        self.executor.shutdown(cancel_futures=True)
        self.agent = None
        self.crashes += 1

    def stop(self) -> None:
        if self.agent is not None:
            self.crash()
        tasks = asyncio.all_tasks(self.loop)
        for task in tasks:
            task.cancel()
        self.run_until(asyncio.gather(*tasks, return_exceptions=True))

    # -- the app and the pool ----------------------------------------------------------------

    def submit(
        self,
        job_id: str | None,
        *,
        correlation: bytes,
        deadline_ms: float | None = None,
        model: str = "defect-v1",
    ) -> None:
        props = [(topics.PROP_MODEL, model)]
        if job_id is not None:
            props.append((topics.PROP_JOB_ID, job_id))
        if deadline_ms is not None:
            props.append((topics.PROP_DEADLINE_MS, str(deadline_ms)))
        self.call(
            lambda: self.app.publish_nowait(
                Message(
                    topics.edge_submit(EDGE),
                    JPEG,
                    qos=1,
                    response_topic=APP_TOPIC,
                    correlation_data=correlation,
                    content_type="image/jpeg",
                    user_properties=tuple(props),
                )
            )
        )

    def give_back(self, job_id: str, attempt: int) -> None:
        """Worker w1 (where every placement goes) returns its result for ``attempt``."""
        props = (
            (topics.PROP_JOB_ID, job_id),
            (topics.PROP_ATTEMPT, str(attempt)),
            (topics.PROP_WORKER, "w1"),
        )
        topic = topics.edge_returns(EDGE, "w1")
        self.call(
            lambda: self.pool.publish_nowait(
                Message(topic, pool_result(job_id), qos=1, user_properties=props)
            )
        )

    def notify(self, job_id: str, attempt: int, kind: str = "worker_lost") -> None:
        notice = JobNotice(
            job_id=job_id,
            attempt=attempt,
            kind=kind,  # type: ignore[arg-type]
            worker_id="w1",
            crashes=1,
            reason="the worker died",
        )
        topic = topics.edge_notices(EDGE)
        self.call(lambda: self.pool.publish_nowait(Message(topic, wire.dump(notice), qos=1)))

    def results(self) -> list[dict[str, Any]]:
        return [json.loads(m.payload) for m in self.received]

    def per_job(self) -> Counter[str]:
        return Counter(r["job_id"] for r in self.results())
