"""The order in which one edge agent's jobs move, whoever carries their effects out. A
:class:`Sequencer` holds the table of jobs (``edge_agent.jobs``) and the local queue, works
out each job's outlook (the completion it would have here), admits a new job (room, and
``rules.intake``), moves a job on each event through the lifecycle table
(``edge_agent.lifecycle.transition``), hands each effect, in order, to its :class:`Carrier`,
and starts queued jobs, the most urgent first, while compute slots are free.

Two carriers carry its effects out: ``edge_agent.carry`` against the outbox, the broker,
the compute threads and MQTT (the agent), and ``sluicegate.twin.carrier`` on the twin's
virtual clock (a replay). Both therefore run the same sequencing and the same table. No
I/O, no asyncio: the shell passes the clock and ``defer`` (call once the events that came
with this turn are in: the loop's ``call_soon``, the twin's same-instant event).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from edge_agent import events as ev
from edge_agent import rules
from edge_agent.admission import Job
from edge_agent.events import IllegalMove, Life
from edge_agent.jobs import NOT, SURE, Entry, JobTable, ahead_kind
from edge_agent.lifecycle import NEEDS_OUTLOOK, transition
from edge_agent.load import JobQueue
from edge_agent.rules import Placement
from edge_agent.tally import Tally
from sluicegate.config import EdgeSettings, OffloadSettings


class Carrier(Protocol):
    """Carries out one effect of a move: ``msg`` is the message that carried ``event``,
    if one did (the twin's carrier has none)."""

    def carry(self, entry: Entry, effect: ev.Effect, event: ev.Event, msg: Any) -> None: ...


@dataclass(frozen=True, slots=True)
class Limits:
    """The edge's fixed figures the sequencing reads (``[edge]``, ``[offload]``)."""

    concurrency: int  # compute threads
    queue_size: int
    queue_bound: int
    max_attempts: int
    max_local_runs: int
    result_timeout_s: float


def limits_of(edge: EdgeSettings, offload: OffloadSettings) -> Limits:
    """The figures of an edge's ``[edge]`` and ``[offload]`` settings."""
    return Limits(
        concurrency=edge.concurrency,
        queue_size=edge.queue_size,
        queue_bound=offload.queue_bound,
        max_attempts=offload.max_attempts,
        max_local_runs=edge.max_local_runs,
        result_timeout_s=offload.result_timeout_s,
    )


class Sequencer:
    """Events in, effects handed to the carrier, for every job of one edge."""

    def __init__(
        self,
        edge_id: str,
        limits: Limits,
        *,
        queue: JobQueue[Entry],
        service_s: Callable[[str], float],
        offload_open: Callable[[], bool],
        clock: Callable[[], float],
        defer: Callable[[Callable[[], None]], None],
        counters: Counter[str],
        gone: Callable[[], bool],
        settled: Callable[[], None],
        illegal: Callable[[IllegalMove], None],
    ) -> None:
        """``service_s(model)``: the edge's estimate of one run; ``offload_open()``: whether
        a broker may be asked now; ``gone()``: the edge no longer acts; ``settled()``: called
        once an outermost dispatch is done; ``illegal``: told of a move the table lacks."""
        self.edge_id = edge_id
        self.limits = limits
        self.queue = queue
        self.table = JobTable()
        self.carrier: Carrier | None = None
        self._service_s = service_s
        self._offload_open = offload_open
        self._clock = clock
        self._defer = defer
        self._counters = counters
        self._gone = gone
        self._settled = settled
        self._illegal = illegal
        self.declined_share = 1.0  # rules.declined_share
        # Jobs read back at start whose run was counted: they held a slot when the agent
        # died. While one is here, a job is started only with a thread free for it.
        self.suspects: set[str] = set()
        self._outlook_tail = (
            limits.queue_bound,
            limits.max_attempts,
            limits.max_local_runs,
            limits.result_timeout_s,
        )
        self._ahead_due = False  # the slots behind the threads are to be given this turn
        self._depth = 0  # dispatches in progress: the pump and settling run at the outermost

    # -- admission -----------------------------------------------------------------------------

    def admit(
        self, job: Job, now: float, msg: Any = None, *, redelivered: bool = False
    ) -> Entry | None:
        """Take a new job, carried by ``msg``, into the table and move it (``Admit``); None
        when the edge has no room for it (the shell refuses it, naming the queue)."""
        limits = self.limits
        held = self.table.held()
        if not rules.has_room(held, queue_size=limits.queue_size, concurrency=limits.concurrency):
            return None
        outlook = self.outlook(job, now)
        free = not self.table.census["queued"] and self.table.slots < limits.concurrency
        run_now, ask = rules.intake(job.deadline, outlook, slot_free=free, redelivered=redelivered)
        admit_ev = ev.Admit(run_now, ask, max(0.0, outlook.predicted_done - now))
        entry = Entry(job, Life(job.job_id, job.deadline))
        self.table.add(entry)
        self.dispatch(entry, admit_ev, msg)
        return entry

    def outlook(self, job: Job, now: float, own: Life | None = None) -> rules.Outlook:
        """What routing ``job`` (whose life is ``own``, if it has one yet) needs to know
        about this edge now. The work ahead of it here is what is queued and running and
        what is still being admitted: in a burst, most of it; each job weighs its own
        model's service time."""
        table, service = self.table, self._service_s
        service_s = service(job.model)
        share = self.declined_share  # of the jobs still asking, those that will stay
        ahead = rules.work_ahead(table.ahead, service)
        asked = rules.work_ahead(table.asked, service) if table.asked else 0.0
        kind = NOT if own is None else ahead_kind(own)  # not ahead of itself
        own_s = 0.0 if kind == NOT else service_s if kind == SURE else share * service_s
        work = rules.expected_work(ahead, asked, share, own_s)
        done = rules.predict_completion(now, work, self.limits.concurrency, service_s)
        return rules.Outlook(
            self.edge_id, self._offload_open(), done, self.waiting, *self._outlook_tail
        )

    @property
    def waiting(self) -> int:
        """Jobs waiting for a compute thread: queued, or started behind the threads."""
        return self.table.census["queued"] + max(0, self.table.slots - self.limits.concurrency)

    @property
    def in_flight(self) -> int:
        """Jobs on the compute threads, or being started with a thread free for them."""
        return min(self.table.slots, self.limits.concurrency)

    # -- the one place a job moves -------------------------------------------------------------

    def dispatch(self, entry: Entry, event: ev.Event, msg: Any = None) -> None:
        if self._gone():
            return
        assert self.carrier is not None, "a sequencer carries nothing before its carrier"
        now = self._clock()
        needs = type(event) in NEEDS_OUTLOOK
        outlook = self.outlook(entry.job, now, entry.life) if needs else NO_OUTLOOK
        if type(event) is ev.Answered:  # the broker's answers: how many offers stay here
            placed = isinstance(event.answer, Placement)
            self.declined_share = rules.declined_share(self.declined_share, placed=placed)
        try:
            life, effects = transition(entry.life, event, now, outlook)
        except IllegalMove as exc:  # a bug: the job stays as it was, the edge serves on
            self._counters[Tally.ILLEGAL_MOVES] += 1
            self._illegal(exc)
            return
        self.table.set(entry, life)
        carrier = self.carrier
        self._depth += 1
        try:
            for effect in effects:
                carrier.carry(entry, effect, event, msg)
        finally:
            self._depth -= 1
        if not self._depth:
            self._pump()
            self._settled()

    def _run_slots(self) -> int:
        if self.suspects:  # forget those concluded since
            self.suspects = {j for j in self.suspects if self.table.get(j) is not None}
        return rules.run_slots(
            self.limits.concurrency,
            max_local_runs=self.limits.max_local_runs,
            suspects=len(self.suspects),
        )

    def _pump(self) -> None:
        """Start queued jobs, the most urgent first, while a compute thread is free; the
        slots behind the threads are given later in this turn (its dispatches count as
        nested: they neither pump nor settle themselves)."""
        self._start_while(self.limits.concurrency)
        if self._ahead_due or not len(self.queue):
            return
        if self.table.slots < self._run_slots():
            self._ahead_due = True
            self._defer(self._start_ahead)

    def _start_ahead(self) -> None:
        """Start jobs into the slots behind the compute threads, the most urgent first, once
        the events that came with this turn are in the queue."""
        self._ahead_due = False
        if self._gone():
            return
        self._start_while(self._run_slots())
        self._settled()

    def _start_while(self, slots: int) -> None:
        queue, table = self.queue, self.table
        self._depth += 1
        try:
            while table.slots < slots and len(queue):
                entry = queue.pop()
                if entry.life.phase == "queued" and table.get(entry.job.job_id) is entry:
                    self.dispatch(entry, ev.Start())
        finally:
            self._depth -= 1


# The outlook of events whose rules do not read it (lifecycle.NEEDS_OUTLOOK).
NO_OUTLOOK = rules.Outlook("", False, 0.0, 0, 0, 1, 1, 1.0)
