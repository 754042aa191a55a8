"""The one structure that knows which jobs this edge holds: each live job's entry (its
:class:`~edge_agent.events.Life` and what the shell keeps beside it), the ids concluded
lately, and a census by phase that the agent reads instead of keeping counters of its own.

The dispatcher is its only writer: it sets a job's life after every move, and the census,
the compute slots taken and the set of live jobs follow from that one write. No I/O, no
asyncio.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from edge_agent.admission import Job
from edge_agent.events import BUSY, Event, Life, Phase
from edge_agent.rules import Answer, Declined
from sluicegate import wire
from sluicegate.transport import Message

if TYPE_CHECKING:  # the handles' types only: nothing here runs asyncio
    import asyncio

    from edge_agent.answers import Outcome

AHEAD: frozenset[Phase] = frozenset({"admitting", "queued", "starting", "running"})
NOT, SURE, ASKED = 0, 1, 2  # how a job counts as work ahead (ahead_kind)


def ahead_kind(life: Life) -> int:
    """How a job counts as work ahead here, for the completion the edge predicts:
    ``SURE`` (queued, starting, running, or admitted to run here), ``ASKED`` (being admitted
    while its placement is asked for and not answered yet: it stays only if the broker
    declines, so it counts at the share of offers declined lately), or ``NOT`` (an
    admitted job whose placement came: it is leaving; or not ahead at all)."""
    if life.phase == "admitting" and life.asking:
        if life.ahead is None:
            return ASKED
        return SURE if isinstance(life.ahead, Declined) else NOT
    return SURE if life.phase in AHEAD else NOT


RECENT_KEPT = 4096  # concluded job ids remembered: a repeat of one goes to the outbox


@dataclass(slots=True, eq=False)
class Entry:
    """A job the edge holds: its life, and the shell's handles on what is under way."""

    job: Job
    life: Life
    # Returns and notices that came before the acceptance: each event, its message and
    # (a return's) the result it carried, dispatched again once the job is accepted.
    held: list[tuple[Event, Message, tuple[bytes, wire.JobResult] | None]] = field(
        default_factory=list
    )
    asked: asyncio.Future[Answer] | None = None  # the placement answer being waited for
    # A worker's result just in, and the result being committed: (its bytes, as read).
    returned: tuple[bytes, wire.JobResult] | None = None
    result: tuple[bytes, wire.JobResult] | None = None
    ack_later: Message | None = None  # acked once the result is committed
    forwarding: asyncio.Task[Outcome] | None = None  # publishing a result before its commit
    forwarded_at: float | None = None  # when that publish began: the result left then
    started: float | None = None  # when its run here started, if it ran here
    accepted_at: float | None = None  # when its acceptance was committed
    # Whether its acceptance is on the disk yet (None: not committed yet, or replayed).
    durable: asyncio.Future[None] | None = None
    # When the broker predicted its last attempt would be done on the worker (unix s).
    pool_predicted: float | None = None


class JobTable:
    """Live jobs by id, the recently concluded ids, and the census by phase."""

    def __init__(self) -> None:
        self._live: dict[str, Entry] = {}
        self._recent: OrderedDict[str, None] = OrderedDict()
        self.census: Counter[Phase] = Counter()
        self.slots = 0  # compute slots held: starting, running, or admitting to run at once
        # Jobs that will take compute here before a job admitted now: admitting, queued,
        # starting or running, by model (the completion prediction weighs each by its own).
        self.ahead: Counter[str] = Counter()  # per model: jobs surely ahead here
        self.asked: Counter[str] = Counter()  # per model: admitting, placement asked (ASKED)
        self._busy = 0  # jobs in a phase that keeps the agent from being idle

    def __len__(self) -> int:
        return len(self._live)

    def get(self, job_id: str) -> Entry | None:
        return self._live.get(job_id)

    def known(self, job_id: str) -> bool:
        """Held now, or concluded lately (a repeat is then answered from the outbox)."""
        return job_id in self._live or job_id in self._recent

    def add(self, entry: Entry) -> None:
        assert entry.life.phase == "new", entry.life
        self._live[entry.job.job_id] = entry
        self.census["new"] += 1
        self._busy += 1

    def set(self, entry: Entry, life: Life) -> None:
        """``entry`` moved to ``life``; a concluded one leaves the table."""
        old = entry.life
        entry.life = life
        live = self._live.get(old.job_id) is entry
        if not live:
            return  # an entry already out of the table (its late callbacks)
        self.census[old.phase] -= 1
        self.slots -= old.holds_slot
        self._busy -= old.phase in BUSY
        self._count_ahead(entry.job.model, old, -1)
        if life.phase == "concluded":
            del self._live[old.job_id]
            return
        self.census[life.phase] += 1
        self.slots += life.holds_slot
        self._busy += life.phase in BUSY
        self._count_ahead(entry.job.model, life, 1)

    def _count_ahead(self, model: str, life: Life, sign: int) -> None:
        kind = ahead_kind(life)
        if kind == SURE:
            self.ahead[model] += sign
        elif kind == ASKED:
            self.asked[model] += sign

    def remember(self, job_id: str) -> None:
        self._recent[job_id] = None
        self._recent.move_to_end(job_id)
        if len(self._recent) > RECENT_KEPT:
            self._recent.popitem(last=False)

    def held(self) -> int:
        """Jobs that count against the edge's capacity: admitting, waiting or running."""
        return sum(self.census[phase] for phase in AHEAD)

    @property
    def busy(self) -> bool:
        return self._busy > 0

    def in_phase(self, phase: Phase) -> list[Entry]:
        return [entry for entry in self._live.values() if entry.life.phase == phase]
