"""The edge agent's dispatcher: every message, commit, answer and run outcome becomes an
event for one job, and the agent's :class:`~edge_agent.sequencer.Sequencer` moves the job on
it through the lifecycle table (``edge_agent.lifecycle``) and hands each effect to this
agent's carrier (``edge_agent.carry``). This module owns what comes in as messages and the
one flag that says whether the agent still acts (:attr:`Dispatcher.mode`).

A job's path, from the request to its answer: :meth:`on_message` admits it (pure checks in
``admission``, then the sequencer's room and ``rules.intake``) and dispatches ``Admit``; the
acceptance commit comes back as ``Accepted`` (or the id proves known: the request is then a
repeat, answered by :meth:`_repeat_known`); from there the table routes it to the local
queue (``Start`` when a slot is free, ``RunCounted``, ``RunDone``; a slot for each compute
thread and one behind it, so the next job's run is counted while the threads compute, and
the slots behind are given once a turn of the loop has taken in all its events, so a
burst's most urgent jobs get them, not its first) or to the broker
(``Answered`` for its attempt, then a worker's ``Returned``, a broker's ``WorkerLost`` or
``DeadLettered``, or ``Overdue``), and every road ends in ``ResultCommitted``. It never
blocks the loop and never acts once :attr:`mode` says it is gone.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Collection
from functools import partial
from typing import Literal

from edge_agent import events as ev
from edge_agent import rules
from edge_agent.admission import (
    Job,
    RequestRefusal,
    ResultsGate,
    admit,
    queue_full,
    shutting_down,
)
from edge_agent.answers import Answers
from edge_agent.carry import Carrier
from edge_agent.compute import Compute
from edge_agent.errors import OutboxError
from edge_agent.events import Life
from edge_agent.job_figures import JobFigures
from edge_agent.jobs import Entry
from edge_agent.lifecycle import transition
from edge_agent.load import PredictionErrors
from edge_agent.metering import EdgeMetering
from edge_agent.offload import PlacementClient
from edge_agent.outbox import Accepted, Outbox, Stored
from edge_agent.replies import Replies
from edge_agent.returns import not_run, read_notice, read_return, retry_job
from edge_agent.sequencer import NO_OUTLOOK, Sequencer, limits_of
from edge_agent.tally import Tally
from edge_agent.trace_log import TraceLog
from sluicegate import wire
from sluicegate.config import EdgeSettings, OffloadSettings
from sluicegate.policy_feed import PolicyFeed
from sluicegate.transport import Message, Transport
from sluicegate.vision.image import PayloadLimits
from sluicegate.wire_pool import JobNotice

log = logging.getLogger(__name__)
Mode = Literal["starting", "serving", "stopping", "stopped", "killed"]
Msg = Message | None  # the message that carried the event, if one did
GONE: frozenset[Mode] = frozenset({"stopped", "killed"})  # nothing more is done


class Dispatcher:
    """Events in, effects out, for every job of one edge agent (loop thread only)."""

    def __init__(
        self,
        settings: EdgeSettings,
        offload_settings: OffloadSettings,
        *,
        transport: Transport,
        outbox: Outbox,
        compute: Compute,
        answers: Answers,
        placement: PlacementClient | None,
        feed: PolicyFeed | None,
        models: Collection[str],
        clock: Callable[[], float],
        new_id: Callable[[], str],
        ran_on: wire.RanOn,
        metering: EdgeMetering | None = None,
    ) -> None:
        self.settings = settings
        self._offload = offload_settings
        self._transport = transport
        self._outbox = outbox
        self._compute = compute
        self._answers = answers
        self._placement = placement
        self._feed = feed
        self._models = models
        self._clock = clock
        self._new_id = new_id
        self._ran_on = ran_on
        self._limits = PayloadLimits(
            settings.max_payload_bytes, settings.max_pixels, settings.max_side
        )
        self._results_gate = ResultsGate(settings.id)
        self.mode: Mode = "starting"  # the one flag saying whether the agent still acts
        self.counters: Counter[str] = Counter()
        self.idle = asyncio.Event()
        self.idle.set()
        self._repeats = 0  # requests for known ids whose outbox lookup is under way
        o = offload_settings
        self.core = Sequencer(
            settings.id,
            limits_of(settings, o),
            queue=compute.queue,
            service_s=compute.service_s,
            offload_open=self._offload_open,
            clock=clock,
            defer=_call_soon,
            counters=self.counters,
            gone=lambda: self.mode in GONE,
            settled=self._settle,
            illegal=lambda exc: log.error("%s", exc),
        )
        self.table = self.core.table
        self.dispatch = self.core.dispatch
        # The records of concluded jobs for the twin's recorder, sent with the telemetry.
        self.trace: TraceLog | None = None
        if settings.trace_jobs:
            offloads = placement is not None and offload_settings.enabled
            self.trace = TraceLog(settings.id, offload=offloads, queue_bound=o.queue_bound)
        self._replies = Replies(
            edge_id=settings.id,
            answers=answers,
            transport=transport,
            table=self.table,
            counters=self.counters,
            trace=self.trace,
            result_retention_s=settings.result_retention_s,
            clock=clock,
        )
        self._effects = Carrier(
            self.core.dispatch,
            gone=lambda: self.mode in GONE,
            replay=self.replay,
            replies=self._replies,
            table=self.table,
            counters=self.counters,
            transport=transport,
            outbox=outbox,
            compute=compute,
            answers=answers,
            placement=placement,
            clock=clock,
            ran_on=ran_on,
            trace=self.trace,
            metering=metering,
        )
        self.core.carrier = self._effects

    # -- what comes in -------------------------------------------------------------------------

    def on_message(self, msg: Message) -> None:
        """Admission of one request; called by the transport for each submit message."""
        edge = self.settings.id
        if self.mode != "serving":
            self._answers.refuse(shutting_down(msg, edge, self._new_id), msg)
            return
        now = self._clock()
        job = admit(msg, models=self._models, limits=self._limits, now=now, new_id=self._new_id)
        if isinstance(job, RequestRefusal):
            self._answers.refuse(job, msg)
            return
        self._take(job, msg, now)

    def _take(self, job: Job, msg: Message, now: float) -> None:
        """A job read from a request (or a released dead letter's retry): into the table,
        unless its answer could not be delivered, it is known, or there is no room."""
        edge = self.settings.id
        nowhere = self._results_gate.check(job, self._feed.current if self._feed else None)
        if nowhere is not None:
            self.counters[Tally.RESPONSE_TOPIC_NOT_ALLOWED] += 1
            self._replies.refuse(job, nowhere, msg)
            return
        if self.table.known(job.job_id):
            self._repeat(job, msg)
            return
        if self.core.admit(job, now, msg, redelivered=msg.dup) is None:
            self._replies.refuse(job, queue_full(job, edge, self.settings.queue_size), msg)

    def on_return(self, msg: Message) -> None:
        """A worker's result for a job this edge offloaded (manual ack: acked once it is
        committed, or at once when it is discarded)."""
        ret = read_return(msg)
        if isinstance(ret, str):
            self._unreadable(msg, Tally.BAD_RETURNS, ret)
            return
        refused = None
        if not_run(ret.result):
            code = ret.result.code or "worker_refused"
            refused = rules.Declined(code, ret.result.reason or "refused")
        event = ev.Returned(ret.attempt, ret.worker_id, refused)
        entry = self.table.get(ret.job_id)
        if entry is None:
            self._stray(ret.job_id, event, msg)
            return
        entry.returned = (ret.payload, ret.result)
        self.dispatch(entry, event, msg)

    def on_notice(self, msg: Message) -> None:
        """The broker says a placed job's worker was lost, or the job is dead-lettered."""
        notice = read_notice(msg)
        if isinstance(notice, str):
            self._unreadable(msg, Tally.BAD_NOTICES, notice)
            return
        event: ev.Event = ev.WorkerLost(notice.attempt, notice.reason)
        if notice.kind == "released":
            self._retry(notice, msg)
            return
        if notice.kind == "dead_letter":
            event = ev.DeadLettered(notice.reason)
        entry = self.table.get(notice.job_id)
        if entry is None:
            self._stray(notice.job_id, event, msg)
            return
        self.dispatch(entry, event, msg)

    def _retry(self, notice: JobNotice, msg: Message) -> None:
        """An operator released a dead letter: its image, kept on disk with its answer,
        runs again as a new job (the notice is acked once that job's acceptance commits)."""
        self._repeats += 1
        self.idle.clear()
        both = asyncio.gather(
            self._outbox.get(notice.job_id), self._outbox.get(notice.retry_id or notice.job_id)
        )
        both.add_done_callback(self._effects.later(partial(self._retry_found, notice, msg)))

    def _retry_found(
        self, notice: JobNotice, msg: Message, fut: asyncio.Future[list[Stored | None]]
    ) -> None:
        self._repeats -= 1
        try:
            stored, retried = fut.result()
        except OutboxError as exc:  # not acked: the notice comes again
            log.error("could not read dead letter %s to retry it: %s", notice.job_id, exc)
            return
        retry_id = notice.retry_id
        known = retried is not None or (retry_id is not None and self.table.known(retry_id))
        job = retry_job(stored, notice, self._clock(), retried=known)
        if isinstance(job, str):
            self._unreadable(msg, Tally.STALE_NOTICES, job)
            return
        log.warning("dead letter %s released: retrying as %s", notice.job_id, job.job_id)
        self.counters[Tally.RETRIES] += 1
        self._take(job, msg, self._clock())

    def _unreadable(self, msg: Message, tally: Tally, why: str) -> None:
        self.counters[tally] += 1
        log.warning("discarded a message on %s: %s", msg.topic, why)
        self._transport.ack(msg)

    def sweep(self) -> None:
        """Offloaded jobs whose return is overdue (or whose deadline needs a run here now)
        are moved on; the table says how."""
        if not self.table.census["offloaded"]:
            return
        now = self._clock()
        for entry in self.table.in_phase("offloaded"):
            if entry.life.due(now):
                self.dispatch(entry, ev.Overdue())

    def replay(self, stored_jobs: list[Stored]) -> None:
        """Track the unfinished jobs read back from the outbox; publish again the results
        it holds undelivered."""
        for stored in stored_jobs:
            job = stored.job
            self.counters[Tally.REPLAYED] += 1
            plan = rules.replay_plan(stored.state, stored.local_runs, self.settings.max_local_runs)
            if plan == "republish":
                assert stored.result is not None
                self.counters[Tally.REPUBLISHED] += 1
                self._answers.publish(job, stored.result, record=True)
                continue
            if self.table.get(job.job_id) is not None:
                continue
            if stored.local_runs:
                self.core.suspects.add(job.job_id)
            entry = Entry(job, Life(job.job_id, job.deadline))
            self.table.add(entry)
            replayed = ev.Replayed(plan, stored.attempt, stored.local_runs, stored.worker)
            self.dispatch(entry, replayed)

    @property
    def offloaded(self) -> int:
        """Work messages sent to pool workers since start."""
        return self._effects.offloaded

    @property
    def prediction(self) -> PredictionErrors:
        return self._effects.prediction

    @property
    def figures(self) -> JobFigures:
        """Concluded jobs' deadlines, part times and why local ones stayed."""
        return self._effects.figures

    @property
    def killed(self) -> bool:
        return self.mode == "killed"

    def _offload_open(self) -> bool:
        client = self._placement
        return client is not None and self._offload.enabled and client.broker_available

    @property
    def waiting(self) -> int:
        """Jobs waiting for a compute thread: queued, or started behind the threads."""
        return self.core.waiting

    @property
    def in_flight(self) -> int:
        """Jobs on the compute threads, or being started with a thread free for them."""
        return self.core.in_flight

    def _stray(self, job_id: str, event: ev.Event, msg: Message) -> None:
        """A return or notice for a job this edge does not hold: the table's concluded row."""
        _, effects = transition(Life(job_id, None, "concluded"), event, 0.0, NO_OUTLOOK)
        for effect in effects:
            if isinstance(effect, ev.Discard):
                log.info("discarded a message about job %s (%s)", job_id, effect.why)
                self.counters[effect.tally] += 1
            elif isinstance(effect, ev.Count):
                self.counters[effect.tally] += 1
        self._transport.ack(msg)

    def _settle(self) -> None:
        if self.table.busy or self._repeats:
            self.idle.clear()
        else:
            self.idle.set()

    # -- requests: accepted, or a repeat of a known id -----------------------------------------

    def _repeat(self, job: Job, msg: Message) -> None:
        self._repeats += 1
        self.idle.clear()
        accepting = self._outbox.accept(job)
        accepting.add_done_callback(self._effects.later(partial(self._repeat_known, job, msg)))

    def _repeat_known(self, job: Job, msg: Message, fut: asyncio.Future[Accepted]) -> None:
        self._repeats -= 1
        try:
            accepted = fut.result()
        except OutboxError as exc:
            self._replies.store_failed(job, msg, exc)
        else:
            stored = accepted.stored
            plan = rules.repeat_plan(
                stored.state if stored else None, dup=msg.dup, on_disk=accepted.outcome != "new"
            )
            if plan == "track":
                self.counters[Tally.ACCEPTED] += 1
                self._transport.ack(msg)
                self.replay([Stored(job, "queued", 0, 0, None)])
            else:
                self._replies.repeat(job, stored, msg, plan)
        self._settle()


def _call_soon(fn: Callable[[], None]) -> None:
    asyncio.get_running_loop().call_soon(fn)
