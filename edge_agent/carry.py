"""The dispatcher's hands: each effect the lifecycle table asks for, carried out against the
outbox, the placement client, the compute pool, the transport and the answers, and each
completion that comes back later handed to the dispatcher as the job's next event. Nothing
here decides anything about a job: it does what the effect says, and when an effect
fails (a send the transport refuses, a write the outbox cannot make) it says so as an
event too.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import TypeVar, cast

from edge_agent import events as ev
from edge_agent import rules
from edge_agent.answers import Answers, local_result
from edge_agent.compute import Compute
from edge_agent.errors import OutboxError
from edge_agent.job_figures import JobFigures
from edge_agent.jobs import Entry, JobTable
from edge_agent.load import PredictionErrors
from edge_agent.metering import Concluded, EdgeMetering
from edge_agent.offload import PlacementClient
from edge_agent.outbox import Accepted, Outbox, Stored
from edge_agent.replies import Replies
from edge_agent.tally import Tally
from edge_agent.trace_log import TraceLog, record_of
from sluicegate import wire
from sluicegate.errors import LedgerError, TransportError
from sluicegate.metering.record import SignedUsage
from sluicegate.transport import Message, Transport
from sluicegate.vision.runtime import StageTimes

log = logging.getLogger(__name__)
Msg = Message | None  # the message that carried the event, if one did
Sink = Callable[[Entry, ev.Event, Msg], None]  # where a job's next event goes
F = TypeVar("F", bound=ev.Effect)
R = TypeVar("R")
Carry = Callable[[Entry, ev.Effect, ev.Event, Msg], None]


class Carrier:
    """Carries out effects for one edge agent's jobs (loop thread only). What comes back
    later goes to ``dispatch`` as the job's next event, unless ``gone()`` says the agent
    no longer acts; jobs the disk holds and memory lost go to ``replay``."""

    def __init__(
        self,
        dispatch: Sink,
        *,
        gone: Callable[[], bool],
        replay: Callable[[list[Stored]], None],
        replies: Replies,
        table: JobTable,
        counters: Counter[str],
        transport: Transport,
        outbox: Outbox,
        compute: Compute,
        answers: Answers,
        placement: PlacementClient | None,
        clock: Callable[[], float],
        ran_on: wire.RanOn,
        trace: TraceLog | None = None,
        metering: EdgeMetering | None = None,
    ) -> None:
        self._dispatch = dispatch
        self._gone = gone
        self._replay = replay
        self._replies = replies
        self._table = table
        self._counters = counters
        self._transport = transport
        self._outbox = outbox
        self._compute = compute
        self._answers = answers
        self._placement = placement
        self._clock = clock
        self._ran_on = ran_on
        self._trace = trace
        self.metering = metering
        self.offloaded = 0  # work messages sent to pool workers since start
        self.prediction = PredictionErrors()  # of the jobs that ran here
        self.figures = JobFigures()  # deadlines, part times, why local: for /metrics
        self._by_type: dict[type[object], Carry] = {}
        self._does(ev.Ack, self._ack)
        self._does(ev.CommitAcceptance, self._commit_acceptance)
        self._does(ev.Ask, self._ask)
        self._does(ev.CancelAsk, self._cancel_ask)
        self._does(ev.Send, self._send)
        self._does(ev.Release, self._release)
        self._does(ev.RecordAttempt, self._record_attempt)
        self._does(ev.Enqueue, self._enqueue)
        self._does(ev.CountRun, self._count_run)
        self._does(ev.Launch, self._launch)
        self._does(ev.ConcludeHere, self._conclude_here)
        self._does(ev.ConcludeReturn, self._conclude_return)
        self._does(ev.Publish, self._publish)
        self._does(ev.Hold, self._hold)
        self._does(ev.Rehandle, self._rehandle)
        self._does(ev.DiscardHeld, self._discard_held)
        self._does(ev.Discard, self._discard)
        self._does(ev.Count, self._count)
        self._does(ev.Forget, self._forget)
        self._does(ev.Remember, self._remember)
        self._does(ev.Resync, self._resync)

    def _does(self, kind: type[F], carry: Callable[[Entry, F, ev.Event, Msg], None]) -> None:
        """``carry`` does effects of ``kind`` (mypy checks it takes that effect); found by
        the effect's exact type, so the map may hold it as a carrier of any effect."""
        self._by_type[kind] = cast(Carry, carry)

    def carry(self, entry: Entry, effect: ev.Effect, event: ev.Event, msg: Msg) -> None:
        self._by_type[type(effect)](entry, effect, event, msg)

    def later(self, fn: Callable[[R], None]) -> Callable[[R], None]:
        """A completion callback that does nothing once the agent is gone."""

        def call(result: R) -> None:
            if not self._gone():
                fn(result)

        return call

    def _commit_acceptance(
        self, entry: Entry, effect: ev.CommitAcceptance, event: ev.Event, msg: Msg
    ) -> None:
        # Reported once written, before the sync: a run counted with it may start at once
        # (the count survives the process it might kill); the request is acked only once
        # the acceptance is on the disk (``entry.durable``, see _ack).
        accepting = self._outbox.accept(entry.job, start_run=effect.start_run, written=True)
        accepting.add_done_callback(self.later(partial(self._accepted, entry, msg)))

    def _accepted(self, entry: Entry, msg: Msg, fut: asyncio.Future[Accepted]) -> None:
        """The acceptance commit's outcome as the job's next event: ``Accepted`` when it
        stored a new job; else ``AcceptKnown``, and the request gets what a repeat of the
        id it found gets once that commit is on the disk (or, when the write failed, a
        refusal naming the outbox)."""
        assert msg is not None  # an acceptance is always a request's
        try:
            accepted = fut.result()
        except OutboxError as exc:
            self._dispatch(entry, ev.AcceptKnown(), None)
            self._replies.store_failed(entry.job, msg, exc)
            return
        entry.durable = self._outbox.durable(accepted.batch)
        if accepted.outcome == "new":
            entry.accepted_at = self._clock()
            self._counters[Tally.ACCEPTED] += 1
            self._dispatch(entry, ev.Accepted(), msg)
            return
        self._dispatch(entry, ev.AcceptKnown(), None)
        repeat = partial(self._replies.repeat, entry.job, accepted.stored, msg)
        entry.durable.add_done_callback(self.later(partial(_when_durable, repeat)))

    # -- effects: messages ---------------------------------------------------------------------

    def _ack(self, entry: Entry, effect: ev.Ack, event: ev.Event, msg: Msg) -> None:
        """Ack ``msg`` once the job's acceptance is on the disk (never, if its sync failed:
        the broker then delivers the request again)."""
        if msg is None:
            return
        durable = entry.durable
        if durable is None or (durable.done() and durable.exception() is None):
            self._transport.ack(msg)
        elif not durable.done():
            ack = partial(self._transport.ack, msg)
            durable.add_done_callback(self.later(partial(_when_durable, ack)))

    def _hold(self, entry: Entry, effect: ev.Hold, event: ev.Event, msg: Msg) -> None:
        assert msg is not None
        returned = entry.returned if isinstance(event, ev.Returned) else None
        entry.held.append((event, msg, returned))

    def _rehandle(self, entry: Entry, effect: ev.Rehandle, event: ev.Event, msg: Msg) -> None:
        held, entry.held = entry.held, []
        for again, came, returned in held:
            if returned is not None:
                entry.returned = returned
            self._dispatch(entry, again, came)

    def _discard_held(
        self, entry: Entry, effect: ev.DiscardHeld, event: ev.Event, msg: Msg
    ) -> None:
        held, entry.held = entry.held, []
        for _event, came, _returned in held:
            self._counters[Tally.FENCED_RETURNS] += 1
            self._transport.ack(came)

    def _discard(self, entry: Entry, effect: ev.Discard, event: ev.Event, msg: Msg) -> None:
        self._counters[effect.tally] += 1
        log.info(
            "discarded a message for job %s (%s; %s, attempt %d)",
            entry.job.job_id,
            effect.why,
            type(event).__name__,
            entry.life.attempt,
        )
        if msg is not None:
            self._transport.ack(msg)

    def _count(self, entry: Entry, effect: ev.Count, event: ev.Event, msg: Msg) -> None:
        self._counters[effect.tally] += 1

    # -- effects: placement and work -----------------------------------------------------------

    def _ask(self, entry: Entry, effect: ev.Ask, event: ev.Event, msg: Msg) -> None:
        assert self._placement is not None
        asking = self._placement.place(
            entry.job, effect.reason, effect.local_s, attempt=effect.attempt
        )
        entry.asked = asked = asyncio.ensure_future(asking)
        asked.add_done_callback(self.later(partial(self._answered, entry, effect.attempt)))

    def _answered(self, entry: Entry, attempt: int, fut: asyncio.Future[rules.Answer]) -> None:
        if not fut.cancelled():
            self._dispatch(entry, ev.Answered(attempt, fut.result()), None)

    def _cancel_ask(self, entry: Entry, effect: ev.CancelAsk, event: ev.Event, msg: Msg) -> None:
        if entry.asked is not None and not entry.asked.done():
            entry.asked.cancel()  # the client hands back a placement that comes after

    def _send(self, entry: Entry, effect: ev.Send, event: ev.Event, msg: Msg) -> None:
        assert self._placement is not None
        job_id, placement = entry.job.job_id, effect.placement
        try:
            self._placement.send(entry.job, placement, attempt=effect.attempt)
        except TransportError as exc:
            log.warning("job %s: could not send attempt %d: %s", job_id, effect.attempt, exc)
            self._dispatch(entry, ev.SendFailed(effect.attempt), None)
            return
        self.offloaded += 1
        if placement.predicted_ms is not None:
            entry.pool_predicted = self._clock() + placement.predicted_ms / 1000.0
        log.info("job %s attempt %d sent to %s", job_id, effect.attempt, placement.worker_id)

    def _release(self, entry: Entry, effect: ev.Release, event: ev.Event, msg: Msg) -> None:
        if self._placement is not None:
            self._placement.release(entry.job.job_id, effect.worker, effect.attempt, effect.why)

    def _record_attempt(
        self, entry: Entry, effect: ev.RecordAttempt, event: ev.Event, msg: Msg
    ) -> None:
        # Not awaited before the send: the outbox applies writes in order, so a return that
        # comes back first is still recorded after its attempt. A crash before the record
        # lands means the restarted agent places the job again under the same attempt
        # number; whichever result returns first concludes it, the other is a repeat.
        recording = self._outbox.offloaded(entry.job.job_id, effect.attempt, effect.worker)
        recording.add_done_callback(self.later(partial(self._recorded, entry, effect.attempt)))

    def _recorded(self, entry: Entry, attempt: int, fut: asyncio.Future[bool]) -> None:
        exc = fut.exception()
        if exc is None and fut.result():
            self._dispatch(entry, ev.AttemptRecorded(attempt), None)
            return
        why = exc if exc is not None else "no pending job to record it on"
        log.warning("job %s: attempt %d not recorded on disk: %s", entry.job.job_id, attempt, why)

    # -- effects: local runs -------------------------------------------------------------------

    def _enqueue(self, entry: Entry, effect: ev.Enqueue, event: ev.Event, msg: Msg) -> None:
        self._compute.queue.push(entry, force=True)  # accepted already: never refused now

    def _count_run(self, entry: Entry, effect: ev.CountRun, event: ev.Event, msg: Msg) -> None:
        counting = self._outbox.start_run(entry.job.job_id)
        counting.add_done_callback(self.later(partial(self._run_counted, entry)))

    def _run_counted(self, entry: Entry, fut: asyncio.Future[int | None]) -> None:
        try:
            runs = fut.result()
        except OutboxError as exc:
            runs = None
            self._counters[Tally.OUTBOX_ERRORS] += 1
            log.error("could not count the run of job %s: %s", entry.job.job_id, exc)
        self._dispatch(entry, ev.RunCounted(runs), None)

    def _launch(self, entry: Entry, effect: ev.Launch, event: ev.Event, msg: Msg) -> None:
        self._compute.run(entry.job, self.later(partial(self._ran, entry)))

    def _ran(self, entry: Entry, done: ev.RunDone) -> None:
        self._dispatch(entry, done, None)

    # -- effects: results ----------------------------------------------------------------------

    def _conclude_here(
        self, entry: Entry, effect: ev.ConcludeHere, event: ev.Event, msg: Msg
    ) -> None:
        outputs, times, started = effect.detail or (None, None, None)
        now = self._clock()
        if outputs is not None and effect.predicted is not None:
            self.prediction.observe(now - effect.predicted)
        result = local_result(
            entry.job,
            effect.status,
            ran_on=self._ran_on,
            now=now,
            code=effect.code,
            reason=effect.reason,
            outputs=outputs,
            times=times,
            started=started,
            declined=entry.life.declined,
            placed_on=entry.life.worker if entry.life.attempt else None,
        )
        entry.result, entry.started = (wire.dump(result), result), started
        self._commit(entry, None, keep_image=effect.code == "dead_letter", times=times)

    def _conclude_return(
        self, entry: Entry, effect: ev.ConcludeReturn, event: ev.Event, msg: Msg
    ) -> None:
        assert entry.returned is not None
        entry.result, entry.ack_later = entry.returned, msg
        if effect.forward:  # the attempt is on disk: the app may have it before the commit
            entry.forwarding = self._answers.forward(entry.job, entry.returned[0])
            entry.forwarded_at = self._clock()
        self._commit(entry, effect.attempt)

    def _commit(
        self,
        entry: Entry,
        attempt: int | None,
        *,
        keep_image: bool = False,
        times: StageTimes | None = None,
    ) -> None:
        """Commit the result and, beside it, the job's usage record; the result goes on
        (``ResultCommitted``) once both are on disk. A record that cannot be written is
        logged and counted, never a reason to hold a result back."""
        assert entry.result is not None
        committing = self._outbox.finish(
            entry.job.job_id, entry.result[0], attempt=attempt, keep_image=keep_image
        )
        metered = None
        if self.metering is not None:
            done = Concluded(
                entry.job,
                entry.result[1],
                entry.result[0],
                times,
                placed=entry.life.attempt > 0,
                settled_attempt=attempt or 0,
                worker=(entry.life.worker or "") if attempt == entry.life.attempt else "",
            )
            metered = self.metering.record(done)
        if metered is None:
            committing.add_done_callback(self.later(partial(self._result_committed, entry)))
            return
        both = asyncio.gather(
            committing, _logged(metered, entry.job.job_id), return_exceptions=True
        )
        both.add_done_callback(self.later(partial(self._both_committed, entry, committing)))

    def _both_committed(
        self, entry: Entry, committing: asyncio.Future[bool], _both: asyncio.Future[object]
    ) -> None:
        self._result_committed(entry, committing)

    def _result_committed(self, entry: Entry, fut: asyncio.Future[bool]) -> None:
        try:
            stored: bool | None = fut.result()
        except OutboxError as exc:  # not committed: it replays (or is redelivered) later
            log.error("could not store the result of job %s: %s", entry.job.job_id, exc)
            stored = None
        if stored is False:
            log.info(
                "job %s was concluded already on disk; this result is dropped", entry.job.job_id
            )
        self._dispatch(entry, ev.ResultCommitted(stored), entry.ack_later)

    def _publish(self, entry: Entry, effect: ev.Publish, event: ev.Event, msg: Msg) -> None:
        assert entry.result is not None
        payload, result = entry.result
        self._answers.results[result.status] += 1
        if result.status == "ok":
            self._answers.finished[result.ran_on.kind] += 1
        sent = entry.forwarding if effect.sent else None
        self._answers.publish(entry.job, payload, record=True, sent=sent)
        left_at = (entry.forwarded_at if sent is not None else None) or self._clock()
        self.figures.concluded(entry.job, result, left_at=left_at)
        if self._trace is not None:
            self._record(entry, result, left_at)

    def _record(self, entry: Entry, result: wire.JobResult, left_at: float) -> None:
        """The job's record for the twin's recorder, sent with the next telemetry."""
        assert self._trace is not None
        job = entry.job
        record = record_of(
            job,
            result,
            left_at=left_at,
            started=entry.started,
            accepted=entry.accepted_at,
            pool_predicted=entry.pool_predicted,
            sha256=self._compute.model_sha256(job.model),
            predicted=entry.life.predicted,
            asked_s=entry.life.asked_s or None,  # 0: it never waited for an answer
        )
        if not self._trace.add(record):
            self._counters[Tally.TRACE_DROPPED] += 1

    def _forget(self, entry: Entry, effect: ev.Forget, event: ev.Event, msg: Msg) -> None:
        pass  # the table drops it; the disk keeps it for a replay

    def _remember(self, entry: Entry, effect: ev.Remember, event: ev.Event, msg: Msg) -> None:
        self._table.remember(entry.job.job_id)

    def _resync(self, entry: Entry, effect: ev.Resync, event: ev.Event, msg: Msg) -> None:
        job_id = entry.job.job_id
        self._outbox.get(job_id).add_done_callback(self.later(partial(self._resynced, job_id)))

    def _resynced(self, job_id: str, fut: asyncio.Future[Stored | None]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        stored = fut.result()
        if stored is not None and stored.pending and self._table.get(job_id) is None:
            log.warning("job %s is still %s on disk; tracking it again", job_id, stored.state)
            self._replay([stored])


def _when_durable(then: Callable[[], object], durable: asyncio.Future[None]) -> None:
    """``then()`` once the commit ``durable`` waited for is on the disk; a failed sync
    was logged by the writer, and what waited on it is left undone."""
    if durable.exception() is None:
        then()


async def _logged(fut: asyncio.Future[list[SignedUsage]], job_id: str) -> None:
    """Wait for a usage record's commit; a failure is the log's, not the result's."""
    try:
        await fut
    except LedgerError as exc:
        log.error("job %s: its usage record was not written: %s", job_id, exc)
