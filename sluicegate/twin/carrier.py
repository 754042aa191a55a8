"""The twin's carrier of an edge's effects: what ``edge_agent.carry`` does against the outbox,
the broker, the compute threads and MQTT, done on the replay's virtual clock. Each simulated
edge runs the agent's own :class:`~edge_agent.sequencer.Sequencer` (its table of jobs, its
outlook, admission, ``lifecycle.transition``, its pump); this module only turns each effect
into what follows and when: a commit lands after the time the trace measured for that edge
(``Draws.admit_ms``), a run takes a compute thread for a drawn service time, an ask goes to
the twin's broker (:class:`Broker`), a send reaches a worker after the link's drawn time, a
published result is the job's outcome. Nothing here decides where a job goes or when.

The simulated parts it stands on (the broker, the workers, the outcomes) are the
:class:`World`'s, in ``sluicegate.twin.events``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from edge_agent import events as ev
from edge_agent.admission import queue_key
from edge_agent.jobs import Entry
from edge_agent.load import JobQueue
from sluicegate.twin.nodes import Job, SimEdge


class World(Protocol):
    """What an edge's effects reach beyond the edge (``sluicegate.twin.events.Events``)."""

    now: float

    def at(self, when: float, fn: Callable[..., None], /, *args: Any) -> None: ...
    def job(self, job_id: str) -> Job: ...
    def ask(self, now: float, job: Job, attempt: int, reason: str, local_s: float) -> None: ...
    def release(self, job: Job, worker: str) -> None: ...
    def send(self, now: float, job: Job, attempt: int, worker: str) -> None: ...
    def admit_s(self, job: Job) -> float: ...
    def run_s(self, edge: SimEdge, job: Job) -> tuple[float, float]: ...
    def overhead_s(self, edge: SimEdge, job: Job) -> float: ...
    def conclude(
        self, job: Job, status: str, where: str | None, code: str | None, left_at: float
    ) -> None: ...


class SimCarrier:
    """Carries out the effects of one simulated edge's moves (the agent's Carrier's twin)."""

    def __init__(self, edge: SimEdge, world: World) -> None:
        self.edge = edge
        self.world = world
        # Runs handed to the compute threads, the most urgent taken first by a free thread.
        self._handed: JobQueue[Entry] = JobQueue(edge.spec.queue_size, _entry_key)
        self._threads = 0  # busy
        self._by_type: dict[type[object], Callable[[Entry, Any, ev.Event], None]] = {
            ev.Ack: _nothing,
            ev.CommitAcceptance: self._commit_acceptance,
            ev.Ask: self._ask,
            ev.CancelAsk: self._cancel_ask,
            ev.Send: self._send,
            ev.Release: self._release,
            ev.RecordAttempt: self._record_attempt,
            ev.Enqueue: self._enqueue,
            ev.CountRun: self._count_run,
            ev.Launch: self._launch,
            ev.ConcludeHere: self._conclude_here,
            ev.ConcludeReturn: self._conclude_return,
            ev.Publish: self._publish,
            ev.Hold: self._hold,
            ev.Rehandle: self._rehandle,
            ev.DiscardHeld: self._discard_held,
            ev.Discard: _nothing,
            ev.Count: _nothing,
            ev.Forget: _nothing,  # the twin's disk never fails: no job is left to a replay
            ev.Remember: self._remember,
            ev.Resync: _nothing,
        }

    def carry(self, entry: Entry, effect: ev.Effect, event: ev.Event, msg: Any) -> None:
        self._by_type[type(effect)](entry, effect, event)

    def event(self, now: float, job_id: str, event: ev.Event) -> None:
        """``event`` for the job, if the edge still holds it (else a stray: dropped)."""
        entry = self.edge.core.table.get(job_id)
        if entry is not None:
            self.edge.core.dispatch(entry, event)

    def _later(self, when: float, entry: Entry, event: ev.Event) -> None:
        self.world.at(when, self.event, entry.job.job_id, event)

    # -- commits ---------------------------------------------------------------------------

    def _commit_acceptance(self, entry: Entry, effect: ev.CommitAcceptance, _e: ev.Event) -> None:
        job = self.world.job(entry.job.job_id)
        self._later(self.world.now + self.world.admit_s(job), entry, ev.Accepted())

    def _record_attempt(self, entry: Entry, effect: ev.RecordAttempt, _e: ev.Event) -> None:
        now, life = self.world.now, entry.life
        self._later(now, entry, ev.AttemptRecorded(effect.attempt))
        # The agent's sweep of offloaded jobs, at the moments the rules act on.
        for when in {life.expires_at, life.rescue_at} - {None}:
            assert when is not None
            self.world.at(max(now, when), self._sweep, entry.job.job_id)

    def _sweep(self, now: float, job_id: str) -> None:
        entry = self.edge.core.table.get(job_id)
        if entry is not None and entry.life.due(now):
            self.edge.core.dispatch(entry, ev.Overdue())

    def _count_run(self, entry: Entry, effect: ev.CountRun, _e: ev.Event) -> None:
        self._later(self.world.now, entry, ev.RunCounted(entry.life.local_runs + 1))

    def _remember(self, entry: Entry, effect: ev.Remember, _e: ev.Event) -> None:
        self.edge.core.table.remember(entry.job.job_id)

    # -- the broker and the workers --------------------------------------------------------

    def _ask(self, entry: Entry, effect: ev.Ask, _e: ev.Event) -> None:
        job = self.world.job(entry.job.job_id)
        job.cancelled = 0
        self.world.ask(self.world.now, job, effect.attempt, effect.reason, effect.local_s)

    def _cancel_ask(self, entry: Entry, effect: ev.CancelAsk, _e: ev.Event) -> None:
        self.world.job(entry.job.job_id).cancelled = effect.attempt

    def _send(self, entry: Entry, effect: ev.Send, _e: ev.Event) -> None:
        job = self.world.job(entry.job.job_id)
        self.world.send(self.world.now, job, effect.attempt, effect.placement.worker_id)

    def _release(self, entry: Entry, effect: ev.Release, _e: ev.Event) -> None:
        self.world.release(self.world.job(entry.job.job_id), effect.worker)

    def _hold(self, entry: Entry, effect: ev.Hold, event: ev.Event) -> None:
        self.world.job(entry.job.job_id).held.append(event)

    def _rehandle(self, entry: Entry, effect: ev.Rehandle, _e: ev.Event) -> None:
        job = self.world.job(entry.job.job_id)
        held, job.held = job.held, []
        for again in held:
            self._later(self.world.now, entry, again)

    def _discard_held(self, entry: Entry, effect: ev.DiscardHeld, _e: ev.Event) -> None:
        self.world.job(entry.job.job_id).held = []

    # -- local runs ------------------------------------------------------------------------

    def _enqueue(self, entry: Entry, effect: ev.Enqueue, _e: ev.Event) -> None:
        self.edge.core.queue.push(entry, force=True)

    def _launch(self, entry: Entry, effect: ev.Launch, _e: ev.Event) -> None:
        self._handed.push(entry, force=True)
        self._take(self.world.now)

    def _take(self, now: float) -> None:
        """Free compute threads take the most urgent runs handed to them."""
        while self._threads < self.edge.spec.concurrency and len(self._handed):
            entry = self._handed.pop()
            self._threads += 1
            seconds, compute = self.world.run_s(self.edge, self.world.job(entry.job.job_id))
            self.world.at(now + seconds, self._ran, entry, compute)

    def _ran(self, now: float, entry: Entry, compute: float) -> None:
        self._threads -= 1
        self.edge.times.observe(entry.job.model, compute)  # what the agent's estimate learns
        self.edge.core.dispatch(entry, ev.RunDone("ok"))
        self._take(now)

    # -- results ---------------------------------------------------------------------------

    def _conclude_here(self, entry: Entry, effect: ev.ConcludeHere, _e: ev.Event) -> None:
        job, now = self.world.job(entry.job.job_id), self.world.now
        declined = entry.life.declined
        code = effect.code or (declined.code if declined is not None else None)
        ran = effect.status == "ok"
        left = now + self.world.overhead_s(self.edge, job) if ran else now
        job.result = (effect.status, self.edge.spec.id if ran else None, code, left)
        self._later(left, entry, ev.ResultCommitted(True))

    def _conclude_return(self, entry: Entry, effect: ev.ConcludeReturn, _e: ev.Event) -> None:
        job, now = self.world.job(entry.job.job_id), self.world.now
        status, worker = job.returned
        job.result = (status, worker if status == "ok" else None, None, now)
        self._later(now, entry, ev.ResultCommitted(True))

    def _publish(self, entry: Entry, effect: ev.Publish, _e: ev.Event) -> None:
        job = self.world.job(entry.job.job_id)
        assert job.result is not None
        status, where, code, left = job.result
        self.world.conclude(job, status, where, code, left)


def _entry_key(entry: Entry) -> tuple[int, float]:
    return queue_key(entry.job)


def _nothing(entry: Entry, effect: object, event: ev.Event) -> None:
    pass
