"""The edge agent's asyncio shell: MQTT in, the outbox on disk, ONNX Runtime in an executor,
results out, exactly one per accepted job whatever crashes.

It subscribes to its submit topic with manual acknowledgement and hands each message to the
pure admission core. A job is accepted only once the outbox has committed it; then, and only
then, the request is acked (a crash before that makes the MQTT broker redeliver it). Refused
requests are answered and acked but never stored. Accepted jobs run on a bounded thread pool
(each local run counted on disk before it starts) or are offloaded to a pool worker as a
numbered attempt (recorded on disk as its work is sent; a first attempt answered while the
job's acceptance commits goes out at once, before it); results of offloaded jobs
come back through this edge's returns topic and are taken only for the job's current attempt.
Every result is committed before it is published (QoS 1) and marked delivered after the
broker's PUBACK. After a restart the outbox is replayed: queued jobs run (or are offered)
again, offloaded ones wait for their return until the timeout, undelivered results are
published again. It also publishes telemetry and a retained online/offline status. It must
never block the event loop on compute or disk and never let one bad message stop the rest.

The agent owns the table of jobs in progress and every decision about them; its parts do the
work: ``admission`` (pure), ``outbox`` (disk), ``compute`` (local runs), ``offloading``
(attempts, returns, notices) and ``answers`` (refusals and results out).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor
from functools import partial

import psutil

from edge_agent import ledger
from edge_agent.admission import (
    Job,
    Refusal,
    ResultsGate,
    admit,
    forgotten,
    outbox_unavailable,
    queue_full,
    shutting_down,
)
from edge_agent.answers import Answers, local_result
from edge_agent.compute import LocalRuns, RunHooks
from edge_agent.errors import OutboxError
from edge_agent.ledger import Tracked
from edge_agent.offload import Declined, PlacementClient, offload_reason
from edge_agent.offloading import Asked, Hooks, Offloads
from edge_agent.outbox import Accepted, Outbox, Stored
from edge_agent.reporting import Load, status_message, telemetry
from sluicegate import topics, wire
from sluicegate.config import EdgeSettings, OffloadSettings
from sluicegate.policy_feed import PolicyFeed
from sluicegate.transport import Message, Transport
from sluicegate.vision.image import PayloadLimits as Limits
from sluicegate.vision.postprocess import Outputs as VisionOutputs
from sluicegate.vision.runtime import ModelRegistry, StageTimes

log = logging.getLogger(__name__)

Inference = tuple[VisionOutputs, StageTimes]
PRUNE_INTERVAL_S = 60.0
RECENT_KEPT = 4096  # concluded job ids remembered: a repeat of one is not offered


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
    ) -> None:
        topics.check_id("edge id", settings.id)
        self._feed = feed  # what policy it holds and refused; where its apps take results
        self._results_gate = ResultsGate(settings.id)
        self.settings = settings
        self._transport = transport
        self._registry = registry
        self._models = frozenset(registry.names())
        self._clock = clock
        self._new_id = new_id
        self._limits = Limits(settings.max_payload_bytes, settings.max_pixels, settings.max_side)
        self._idle = asyncio.Event()
        self._idle.set()
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
        self._recent: OrderedDict[str, None] = OrderedDict()  # concluded lately, oldest first
        self._admitting_total = 0
        self._finishing = 0
        run_hooks = RunHooks(
            current=self._current,
            forget=self._forget,
            conclude=self._conclude_local,
            dead_letter=self._dead_letter_locally,
            settled=self._update_idle,
        )
        self._runs = LocalRuns(
            settings, registry, self.outbox, clock, run_hooks, self.counters, executor
        )
        self.service_times = self._runs.service_times
        hooks = Hooks(
            tracked=self._jobs.get,
            current=self._current,
            run_here=self._run_here,
            reroute=lambda tracked, why: self._route(tracked, retry=why),
            take=self._take_return,
            dead_letter=self._dead_letter,
            settled=self._runs.dispatch,
        )
        self._offloads = Offloads(
            hooks, offload, self._offload_settings, transport, self.outbox, clock, self.counters
        )
        self.on_return = self._offloads.on_return
        self.on_notice = self._offloads.on_notice

    @property
    def results(self) -> Counter[str]:
        """Answers given, by status (refusals included; republished results not)."""
        return self._answers.results

    @property
    def dropped_no_response_topic(self) -> int:
        return self._answers.dropped_no_response_topic

    @property
    def offloaded(self) -> int:
        """Work messages sent to pool workers since start."""
        return self._offloads.offloaded

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
            self._answers.refuse(shutting_down(msg, edge, self._new_id), msg)
            return
        now = self._clock()
        decision = admit(
            msg, models=self._models, limits=self._limits, now=now, new_id=self._new_id
        )
        if isinstance(decision, Refusal):
            self._answers.refuse(decision, msg)
            return
        job = decision
        nowhere = self._results_gate.check(job, self._feed.current if self._feed else None)
        if nowhere is not None:
            self.counters["response_topic_not_allowed"] += 1
            self._answers.refuse(nowhere, msg)
            return
        known = (
            job.job_id in self._jobs or job.job_id in self._admitting or job.job_id in self._recent
        )
        runs = self._runs
        held = len(runs.queue) + self._admitting_total + runs.in_flight - runs.reserved
        if not known and held >= self.settings.queue_size + self.settings.concurrency:
            self._answers.refuse(queue_full(job, edge, self.settings.queue_size), msg)
            return
        offer = None if known else self._offer_reason(job, None)
        # A job that will run here at once has its run counted in the same commit that
        # accepts it, its compute slot held meanwhile: one commit less before it starts.
        run_now = not known and runs.free_now and offer is None
        if run_now:
            runs.reserve()
        # A job that will be offered has its placement asked for now, while the outbox
        # commits it: the broker's answer and the commit overlap, and a placement that
        # comes first has its work sent at once (Offloads.ask_ahead). The request is acked
        # only once the job is on disk; if it proves not new, the answer is dropped.
        # Not for a redelivery: most were accepted before a crash, and the broker would
        # hold a reservation for each (one that proves new is offered once accepted).
        asked = None
        if offer is not None and not msg.dup:
            asked = self._offloads.ask_ahead(job, offer, runs.predict(job) - now)
        self._admitting[job.job_id] += 1
        self._admitting_total += 1
        self._idle.clear()
        accepting = self.outbox.accept(job, start_run=run_now)
        accepting.add_done_callback(partial(self._accepted, msg, job, run_now, asked))

    def _accepted(
        self,
        msg: Message,
        job: Job,
        run_now: bool,
        asked: Asked | None,
        fut: asyncio.Future[Accepted],
    ) -> None:
        """The outbox has the job (or knew it already): only now is the request acked, and
        only a new job takes the placement ``asked`` for it during the commit."""
        self._admitting[job.job_id] -= 1
        self._admitting_total -= 1
        if self._admitting[job.job_id] <= 0:
            del self._admitting[job.job_id]
        if self._killed:
            return  # the kill cancelled the asked placement with every other task
        try:
            accepted = fut.result()
        except OutboxError as exc:
            if asked is not None:
                asked.drop("the edge could not store the job")
            self.counters["outbox_errors"] += 1
            log.error("could not store job %s: %s", job.job_id, exc)
            self._answers.refuse(outbox_unavailable(job, self.settings.id, exc), msg)
            if run_now:
                self._runs.reserved_done(keep=False)
            self._update_idle()
            return
        if run_now:
            self._runs.reserved_done(keep=accepted.outcome == "new")
        if accepted.outcome == "new":
            self.counters["accepted"] += 1
            tracked = Tracked(job, "starting" if run_now else "queued", local_runs=int(run_now))
            self._jobs[job.job_id] = tracked
            self._transport.ack(msg)
            if run_now:
                self._runs.launch(tracked)
            else:
                self._route(tracked, asked=asked)
            return
        if asked is not None:
            asked.drop("a repeat of a job this edge knows")  # not an offer
        stored = accepted.stored
        if msg.dup and (stored is None or not stored.pending):
            # The broker redelivers a request accepted before a crash that came before its
            # ack: not a resubmission. The job's own result is (or will be) published.
            self.counters["redelivered"] += 1
            self._transport.ack(msg)
            return
        self.counters["duplicates"] += 1
        if stored is None:  # delivered long ago: only its id is left
            self._answers.refuse(forgotten(job, self.settings.result_retention_s), msg)
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

    def _route(
        self, tracked: Tracked, *, retry: Declined | None = None, asked: Asked | None = None
    ) -> None:
        """Send an accepted job on its way: offered when it would be late here (or, with
        ``retry``, offered again after a lost attempt), else into the local queue. A new job
        whose placement was ``asked`` for at admission is offered with that answer."""
        job = tracked.job
        now = self._clock()
        if job.deadline is not None and now >= job.deadline:
            if asked is not None:
                asked.drop("the job's deadline passed")
            late = (now - job.deadline) * 1000.0
            reason = f"the deadline passed {late:.0f} ms ago"
            if retry is not None:
                reason = f"{reason}, while the job was offloaded ({retry.reason}); not run again"
            else:
                reason = f"{reason}, before the job could start; not run"
            self._conclude_local(tracked, "expired", code="expired", reason=reason)
            return
        if asked is not None:
            self._idle.clear()
            self._offloads.offer_asked(tracked, asked)
            return
        offer = self._offer_reason(job, tracked if retry is not None else None)
        if offer is not None:
            self._idle.clear()
            self._offloads.offer(tracked, offer, self._runs.predict(job) - now)
            return
        self._run_here(tracked, retry)

    def _run_here(self, tracked: Tracked, why: Declined | None) -> None:
        """Into the local queue; ``why`` it did not leave goes into its result."""
        if why is not None:
            tracked.declined = tracked.declined or why
        self._idle.clear()
        self._runs.enqueue(tracked)

    def _offer_reason(self, job: Job, retry_of: Tracked | None) -> str | None:
        """Why to offer ``job`` (again, after ``retry_of`` lost an attempt), or None."""
        if not self._offloads.available:
            return None  # nobody to ask: no task, no hashing, just run it here
        if retry_of is not None:
            return self._offloads.retry_reason(retry_of)
        return offload_reason(
            job,
            predicted_done=self._runs.predict(job),
            waiting=len(self._runs.queue),
            queue_bound=self._offload_settings.queue_bound,
        )

    def _current(self, tracked: Tracked, phase: ledger.Phase) -> bool:
        return (
            not self._killed
            and self._jobs.get(tracked.job.job_id) is tracked
            and (tracked.phase == phase)
        )

    def check_offloaded(self) -> None:
        """Reroute offloaded jobs whose return is overdue; runs every fraction of
        ``result_timeout_s``, callable directly in tests."""
        self._offloads.check_overdue(self._jobs.values())

    def _take_return(
        self, tracked: Tracked, payload: bytes, status: str, attempt: int, msg: Message
    ) -> None:
        # Once the attempt is on disk, a crash before this result's commit leaves the job
        # awaiting that same attempt, its return unacked and so redelivered: the same bytes
        # would go out again. So the app may have the result before the commit (Answers).
        forward = tracked.on_disk == attempt
        self._conclude(tracked, payload, status, attempt=attempt, ack=msg, forward=forward)

    def _dead_letter(self, tracked: Tracked, reason: str) -> None:
        self._conclude_local(tracked, "failed", code="dead_letter", reason=reason)

    # -- conclusions ---------------------------------------------------------------------------

    def _forget(self, tracked: Tracked) -> None:
        """Stop tracking a job the outbox could not update: it replays after a restart."""
        if self._jobs.get(tracked.job.job_id) is tracked:
            del self._jobs[tracked.job.job_id]

    def _dead_letter_locally(self, tracked: Tracked) -> None:
        self.counters["dead_letters"] += 1
        job_id = tracked.job.job_id
        reason = ledger.dead_letter_reason(job_id, self.settings.id, tracked.local_runs)
        log.error("dead-lettered job %s: %s", job_id, reason)
        self._dead_letter(tracked, reason)

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
        forward: bool = False,
    ) -> None:
        tracked.phase = "finishing"
        self._finishing += 1
        then = partial(self._concluded, tracked)
        self._answers.conclude(
            tracked.job, payload, status, then, attempt=attempt, ack=ack, forward=forward
        )

    def _concluded(self, tracked: Tracked, stored: bool | None) -> None:
        self._finishing -= 1
        if self._jobs.get(tracked.job.job_id) is tracked:
            del self._jobs[tracked.job.job_id]  # concluded, or on disk to replay after restart
        if stored is None:
            self.counters["outbox_errors"] += 1
        elif stored:  # a repeat of it is answered from the outbox, not asked for
            self._recent[tracked.job.job_id] = None
            if len(self._recent) > RECENT_KEPT:
                self._recent.popitem(last=False)
        else:
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

    def _update_idle(self) -> None:
        busy = (
            self._runs.in_flight
            or len(self._runs.queue)
            or self._offloads.offering
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
                tracked.on_disk = stored.attempt
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
        load = Load(
            now=self._clock(),
            queue_depth=len(self._runs.queue),
            in_flight=self._runs.in_flight,
            models=self.service_times.snapshot(),
            cpu_percent=self._process.cpu_percent(None),
            memory_rss_bytes=self._process.memory_info().rss,
            memory_percent=self._process.memory_percent(),
            results=self._answers.results,
            dropped_no_response_topic=self._answers.dropped_no_response_topic,
            offloaded=self.offloaded,
            offload_pending=self._offloads.offering,
            events=self.counters,
            policy_version=self._feed.held.version if self._feed and self._feed.held else None,
            policy_refused=self._feed.refused if self._feed is not None else {},
        )
        return telemetry(self.settings, load)

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
        self._offloads.kill()
        self._runs.kill()
        self._halted.set()

    async def run(self, stop: asyncio.Event, *, drain_timeout: float = 10.0) -> None:
        """Serve until ``stop`` is set, then answer what is queued and go offline."""
        stored = await self.outbox.open()
        replay = self._replay(stored)
        await self._runs.start()
        self._process.cpu_percent(None)  # prime: the first reading is always 0
        self._accepting = True
        edge = self.settings.id
        submit = topics.edge_submit(edge)
        # Returns and notices first: the replayed jobs they concern are tracked already.
        await self._transport.subscribe(
            topics.edge_returns_all(edge), self.on_return, manual_ack=True
        )
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
        self._offloads.kill()  # offers still waiting: their jobs replay after a restart
        self._runs.shutdown()
        await self.outbox.close()
