"""The vocabulary of a job's life on the edge: :class:`Life` (what the rules know of one
job), the events that move it and the effects a move asks for, all frozen data. The rules
over them are ``edge_agent.lifecycle``; the shell that turns messages into events and
carries out effects is ``edge_agent.agent``. No I/O, no asyncio, no clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

from edge_agent import rules
from edge_agent.rules import Answer, Declined, Outlook, Placement
from edge_agent.tally import Tally

if TYPE_CHECKING:  # types only: the table never touches a run's outputs
    from sluicegate.vision.postprocess import Outputs
    from sluicegate.vision.runtime import StageTimes

# A run's outputs and stage times (None when it failed) and when it started.
RunDetail = tuple["Outputs | None", "StageTimes | None", "float | None"]

Phase = Literal[
    "new",
    "admitting",
    "queued",
    "starting",
    "running",
    "offering",
    "offloaded",
    "finishing",
    "concluded",
]
PHASES: tuple[Phase, ...] = (
    "new",
    "admitting",
    "queued",
    "starting",
    "running",
    "offering",
    "offloaded",
    "finishing",
    "concluded",
)
# The phases that hold a compute slot, and those that make the agent busy (not idle).
HOLDS_SLOT: frozenset[Phase] = frozenset({"starting", "running"})
BUSY: frozenset[Phase] = frozenset(
    {"new", "admitting", "queued", "starting", "running", "offering", "finishing"}
)


class Life(NamedTuple):
    """Everything the rules know of one job (a named tuple: the table makes a new one on
    every move, and ``_replace`` is four times cheaper than ``dataclasses.replace``)."""

    job_id: str
    deadline: float | None
    phase: Phase = "new"
    attempt: int = 0  # the placement attempt the job is (or was last) on; 0: never placed
    asking: int = 0  # the attempt whose placement is being asked for (offering, admitting)
    on_disk: int = 0  # the latest attempt the outbox is known to have recorded
    worker: str | None = None  # where ``attempt`` went; None: not known
    local_runs: int = 0  # local runs started so far, as counted on disk
    run_now: bool = False  # admitting: its run is counted in the acceptance commit
    ahead: Answer | None = None  # admitting: the answer for the placement asked ahead
    early: bool = False  # attempt 1's work went out before the acceptance commit landed
    declined: Declined | None = None  # why it stayed here, for the result's offload field
    expires_at: float | None = None  # offloaded: when to stop waiting for the return
    rescue_at: float | None = None  # offloaded: when only a run here can meet the deadline
    predicted: float | None = None  # when it would finish here, as first predicted
    ack_return: bool = False  # finishing a worker's return: ack it once committed
    forwarded: bool = False  # finishing a return published before its commit
    # Where its time went while it was not this edge's to run (the result's timings say):
    since: float = 0.0  # when its current wait on the broker's answer or on a worker began
    asked_s: float = 0.0  # waiting for the broker's placement answers, all attempts
    away_s: float = 0.0  # its work out on workers, sent until returned, lost or expired

    def due(self, now: float) -> bool:
        """Offloaded, and its return waited for until a moment the rules act on."""
        if self.phase != "offloaded":
            return False
        return (self.expires_at or 0.0) <= now or (self.rescue_at or now + 1.0) <= now

    @property
    def holds_slot(self) -> bool:
        return self.phase in HOLDS_SLOT or (self.phase == "admitting" and self.run_now)


# -- events -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Admit:
    """A new request is to be stored; ``run_now``: a slot is free and its run is counted in
    the same commit; ``ask``: its first placement is asked for while it commits."""

    run_now: bool
    ask: str | None = None
    local_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Replayed:
    """Read back from the outbox at start, still pending."""

    plan: rules.Plan
    attempt: int
    local_runs: int
    worker: str | None


@dataclass(frozen=True, slots=True)
class Accepted:
    """The acceptance committed: the job is new and on disk."""


@dataclass(frozen=True, slots=True)
class AcceptKnown:
    """The acceptance found the id on disk already (or failed): not a job of this request."""


@dataclass(frozen=True, slots=True)
class Answered:
    attempt: int
    answer: Answer


@dataclass(frozen=True, slots=True)
class SendFailed:
    attempt: int


@dataclass(frozen=True, slots=True)
class AttemptRecorded:
    attempt: int


@dataclass(frozen=True, slots=True)
class Returned:
    """A worker's result for ``attempt`` (``not_run``: it refused the work unrun)."""

    attempt: int
    worker: str
    not_run: Declined | None = None


@dataclass(frozen=True, slots=True)
class WorkerLost:
    attempt: int
    reason: str


@dataclass(frozen=True, slots=True)
class DeadLettered:
    reason: str


@dataclass(frozen=True, slots=True)
class Overdue:
    """The sweep of offloaded jobs: has this one's return been waited for long enough?"""


@dataclass(frozen=True, slots=True)
class Start:
    """A compute slot is free and this job came out of the local queue."""


@dataclass(frozen=True, slots=True)
class RunCounted:
    runs: int | None  # None: the outbox could not count it (or the job is not pending)


@dataclass(frozen=True, slots=True)
class RunDone:
    status: Literal["ok", "rejected", "failed"]
    code: str | None = None
    reason: str | None = None
    detail: RunDetail | None = None  # for the result document


@dataclass(frozen=True, slots=True)
class ResultCommitted:
    stored: bool | None  # True: stored; False: concluded already on disk; None: write failed


Event = (
    Admit
    | Replayed
    | Accepted
    | AcceptKnown
    | Answered
    | SendFailed
    | AttemptRecorded
    | Returned
    | WorkerLost
    | DeadLettered
    | Overdue
    | Start
    | RunCounted
    | RunDone
    | ResultCommitted
)
EVENTS: tuple[type[Event], ...] = (
    Admit,
    Replayed,
    Accepted,
    AcceptKnown,
    Answered,
    SendFailed,
    AttemptRecorded,
    Returned,
    WorkerLost,
    DeadLettered,
    Overdue,
    Start,
    RunCounted,
    RunDone,
    ResultCommitted,
)

# -- effects ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ack:
    """Acknowledge the message that carried the event."""


@dataclass(frozen=True, slots=True)
class CommitAcceptance:
    start_run: bool


@dataclass(frozen=True, slots=True)
class Ask:
    attempt: int
    reason: str
    local_s: float


@dataclass(frozen=True, slots=True)
class CancelAsk:
    attempt: int


@dataclass(frozen=True, slots=True)
class Send:
    attempt: int
    placement: Placement


@dataclass(frozen=True, slots=True)
class Release:
    attempt: int
    worker: str
    why: str


@dataclass(frozen=True, slots=True)
class RecordAttempt:
    attempt: int
    worker: str


@dataclass(frozen=True, slots=True)
class Enqueue:
    pass


@dataclass(frozen=True, slots=True)
class CountRun:
    pass


@dataclass(frozen=True, slots=True)
class Launch:
    pass


@dataclass(frozen=True, slots=True)
class ConcludeHere:
    """Commit a result made on this edge (its offload field from ``Life.declined``)."""

    status: Literal["ok", "rejected", "failed", "expired"]
    code: str | None = None
    reason: str | None = None
    detail: RunDetail | None = None
    predicted: float | None = None  # ran here: when it was predicted to finish


@dataclass(frozen=True, slots=True)
class ConcludeReturn:
    """Commit the worker's returned result for ``attempt``; with ``forward``, publish it
    first (its attempt is on disk, so a crash before the commit replays the same bytes)."""

    attempt: int
    forward: bool


@dataclass(frozen=True, slots=True)
class Publish:
    """Publish the committed result (``sent``: forwarded before its commit already), and
    record its delivery once the broker acked it."""

    sent: bool = False


@dataclass(frozen=True, slots=True)
class Hold:
    """Keep the message, unacked, until the acceptance lands; then handle it again."""


@dataclass(frozen=True, slots=True)
class Rehandle:
    """Handle the held messages again, now that the job is accepted."""


@dataclass(frozen=True, slots=True)
class DiscardHeld:
    """Ack and drop the held messages: the job will not be taken."""


@dataclass(frozen=True, slots=True)
class Discard:
    """Ack the message and drop it, counted under ``tally``, ``why`` for the log."""

    tally: Tally
    why: str


@dataclass(frozen=True, slots=True)
class Count:
    tally: Tally


@dataclass(frozen=True, slots=True)
class Forget:
    """Out of memory without a result: it is on disk to replay after a restart."""


@dataclass(frozen=True, slots=True)
class Remember:
    """Concluded and stored: a repeat of its id is answered from the outbox."""


@dataclass(frozen=True, slots=True)
class Resync:
    """The outbox refused a result: read the job back and track it as the disk has it."""


Effect = (
    Ack
    | CommitAcceptance
    | Ask
    | CancelAsk
    | Send
    | Release
    | RecordAttempt
    | Enqueue
    | CountRun
    | Launch
    | ConcludeHere
    | ConcludeReturn
    | Publish
    | Hold
    | Rehandle
    | DiscardHeld
    | Discard
    | Count
    | Forget
    | Remember
    | Resync
)
Effects = tuple[Effect, ...]
Move = tuple[Life, Effects]


class IllegalMove(Exception):
    """An event the table has no row for in the job's phase."""

    def __init__(self, life: Life, event: Event) -> None:
        super().__init__(
            f"job {life.job_id}: no rule for {type(event).__name__} in phase {life.phase!r}"
        )
        self.life = life
        self.event = event


Rule = Callable[[Life, "Event", float, Outlook], Move]
