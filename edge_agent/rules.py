"""The edge's decisions about one job, as pure functions over plain data and ``now``.

How full the edge is (:func:`has_room`), when a job would finish here (:func:`work_ahead`,
:func:`predict_completion`), how a new job is admitted (:func:`intake`), whether to offer it
to the campus broker (:func:`offer_reason`) or offer it again after an attempt was lost
(:func:`retry_reason`), whether its deadline has passed and what its result then says
(:func:`expiry_reason`), what a repeat of a known job id gets (:func:`repeat_plan`) and what
a job read back after a restart needs (:func:`replay_plan`). The lifecycle table and the
dispatcher call them; so will the digital twin. No I/O, no clock, no asyncio: ``now`` is
an argument.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

from policies import PlacementClaims
from sluicegate import wire


@dataclass(frozen=True, slots=True)
class Placement:
    """A placement the edge has verified and may act on."""

    worker_id: str
    zone: str
    work_topic: str
    token: str
    payload_sha256: bytes
    predicted_ms: float | None = None  # the broker's predicted completion there, from its reply
    # The token's verified claims, and the worker's key (raw X25519, from this edge's own
    # policy) the image must be sealed to when they bind one; None: sent in the clear.
    claims: PlacementClaims | None = None
    seal_to: bytes | None = None
    # The sister campus whose worker it is ("" for this campus's): its work crosses the
    # bridge in an envelope, and ``worker_id`` is ``topics.peer_worker``'s name for it.
    campus: str = ""


@dataclass(frozen=True, slots=True)
class Declined:
    """Why a job stays on this edge after all; becomes the result's ``offload`` field."""

    code: str
    reason: str
    # Stamped as the job concludes here: its time waiting for the broker's answers and
    # out on workers, in ms (the result's ``timings_ms.placement_ms``, ``offloaded_ms``).
    asked_ms: float | None = None
    away_ms: float | None = None

    def timed(self, asked_s: float, away_s: float) -> Declined:
        """This reason, with the job's time waiting for placements and on workers."""
        return replace(self, asked_ms=round(asked_s * 1000.0, 3), away_ms=round(away_s * 1000.0, 3))

    def as_wire(self, worker: str | None = None) -> wire.Offload:
        """The result's ``offload`` field; ``worker``: the job was placed there, and came
        back for this reason (lost, silent, refused unrun)."""
        placed = worker is not None
        return wire.Offload(
            requested=True, placed=placed, worker=worker, code=self.code, reason=self.reason
        )


Answer = Placement | Declined


class Outlook(NamedTuple):
    """What routing a job needs to know about the edge at that moment: whether a broker can
    be asked, the local queue and the job's predicted completion here, and the limits."""

    edge_id: str
    offload: bool  # offloading enabled and a campus broker online
    predicted_done: float  # when the job would finish here if it joined the queue now
    waiting: int  # jobs waiting for a compute thread here (queued, or started behind one)
    queue_bound: int  # [offload] queue_bound
    max_attempts: int  # [offload] max_attempts
    max_local_runs: int  # [edge] max_local_runs
    result_timeout_s: float  # [offload] result_timeout_s


def has_room(held: int, *, queue_size: int, concurrency: int) -> bool:
    """Whether a new job may be accepted while ``held`` jobs wait, run or commit."""
    return held < queue_size + concurrency


def run_slots(concurrency: int, *, max_local_runs: int, suspects: int) -> int:
    """How many jobs may be started here at once, each run counted on disk before it runs:
    one on each of the ``concurrency`` compute threads and one behind each, whose count is
    committed while the threads compute, so a thread that finishes a job takes the next at
    once instead of idling through that job's commit. Only one per thread while a job
    counted behind a thread could be dead-lettered for a crash it did not cause: while jobs
    that held a slot when the agent last died are still here (``suspects``), or when one
    counted run is enough to dead-letter a job (``max_local_runs`` 1)."""
    if suspects or max_local_runs <= 1:
        return concurrency
    return 2 * concurrency


def work_ahead(models: Mapping[str, int], service_s: Callable[[str], float]) -> float:
    """Seconds of compute the jobs ahead hold: each job at its own model's service time
    (``models``: how many jobs of each model are admitting, waiting or running). A detector
    job behind an OCR run waits for the OCR run, not for another detector run."""
    return sum(count * service_s(model) for model, count in models.items() if count)


DECLINED_WEIGHT = 0.2  # weight of the latest answer in the share declined (EWMA)


def declined_share(share: float, *, placed: bool) -> float:
    """The share of the broker's recent answers that kept their job here, after one more
    (``placed``: it placed the job on a worker). Starts at 1: with no history, every job
    still asking counts as staying."""
    return share + DECLINED_WEIGHT * ((0.0 if placed else 1.0) - share)


def expected_work(ahead_s: float, asked_s: float, share: float, own_s: float = 0.0) -> float:
    """Seconds of work ahead of a job here: what will surely run here (``ahead_s``), the
    ``share`` of what is still asking the broker (``asked_s``) expected to stay, less the
    job's own part of those (``own_s``)."""
    return max(0.0, ahead_s + share * asked_s - own_s)


def predict_completion(
    now: float, work_ahead_s: float, concurrency: int, service_s: float
) -> float:
    """When a job admitted now would finish here: the work ahead (:func:`work_ahead`),
    shared by the slots, then its own service time."""
    return now + work_ahead_s / concurrency + service_s


def offer_reason(deadline: float | None, outlook: Outlook) -> str | None:
    """``"deadline"`` or ``"queue"`` when a new job should be offered to the broker."""
    if not outlook.offload:
        return None  # nobody to ask: no task, no hashing, just run it here
    if deadline is not None and outlook.predicted_done > deadline:
        return "deadline"
    if outlook.waiting >= outlook.queue_bound:
        return "queue"
    return None


def intake(
    deadline: float | None, outlook: Outlook, *, slot_free: bool, redelivered: bool
) -> tuple[bool, str | None]:
    """How a new job is admitted: (run at once, why to ask for a placement while it
    commits). A job that will run here at once has its run counted in the same commit that
    accepts it, its slot held meanwhile: one commit less before it starts. One that will be
    offered has its placement asked for while it commits, unless the MQTT broker
    redelivered it: most of those were accepted before a crash, and the campus broker
    would hold a slot for each (one that proves new is offered once accepted)."""
    offer = offer_reason(deadline, outlook)
    return offer is None and slot_free, offer if not redelivered else None


def retry_reason(attempt: int, deadline: float | None, outlook: Outlook) -> str | None:
    """Why to offer a job again after ``attempt`` was lost, or None to run it here."""
    if not outlook.offload or attempt >= outlook.max_attempts:
        return None
    return "deadline" if deadline is not None else "queue"


def expiry_reason(
    deadline: float | None, now: float, *, lost: Declined | None = None
) -> str | None:
    """The result's reason when a job's deadline has passed before it could start (or,
    with ``lost``, while it was offloaded and that attempt was lost); None while it has
    not."""
    if deadline is None or now < deadline:
        return None
    late = (now - deadline) * 1000.0
    where = (
        "before the job could start" if lost is None else f"while it was offloaded ({lost.reason})"
    )
    return f"the deadline passed {late:.0f} ms ago, {where}; not run"


def offload_expiry(sent_at: float, timeout_s: float, deadline: float | None) -> float:
    """When to stop waiting for an offloaded job's return: after the timeout, or at its
    deadline if that comes first (then it can only end expired)."""
    expiry = sent_at + timeout_s
    return min(expiry, deadline) if deadline is not None else expiry


def rescue_at(
    deadline: float | None, now: float, predicted_done: float, answer_due: float | None = None
) -> float | None:
    """When an offloaded job whose return has not come must join the local queue to still
    meet its deadline: the deadline less what a run here takes now (``predicted_done`` is
    when it would finish if it joined the queue at ``now``). None without a deadline, when
    a run here could not meet it anyway, or when it would have to start before the worker's
    answer is due (``answer_due``: the broker's predicted completion there) and that answer
    is due in time: then it is no rescue of a silent worker but a second run of every such
    job, and a run started here takes the job (the worker's return, on time, is dropped).
    A worker not expected to meet the deadline leaves the rescue as it is."""
    if deadline is None:
        return None
    at = deadline - (predicted_done - now)
    if at <= now or (answer_due is not None and at < answer_due < deadline):
        return None
    return at


Repeat = Literal["track", "redelivered", "forgotten", "retarget", "republish"]
StoredState = Literal["queued", "offloaded", "done", "delivered"]


def repeat_plan(stored: StoredState | None, *, dup: bool, on_disk: bool = True) -> Repeat:
    """What a request gets whose job id the agent knew already (``stored``: the outbox
    row's state; None: only a tombstone is left). ``dup``: the MQTT broker redelivered it.
    ``on_disk``: False when the id was known in memory but the outbox committed it as new
    (its row gone): the job is tracked anew, as accepted now."""
    if not on_disk:
        return "track"
    pending = stored in ("queued", "offloaded")
    if dup and not pending:
        # Accepted before a crash that came before its ack: not a resubmission. The job's
        # own result is (or will be) published.
        return "redelivered"
    if stored is None:
        return "forgotten"  # delivered long ago: refused, never run twice
    if pending:
        return "retarget"  # the result goes where the latest request asked
    return "republish"  # answered again with its stored result


Plan = Literal["republish", "dead_letter", "route", "await_return"]


def replay_plan(stored: StoredState, local_runs: int, max_local_runs: int) -> Plan:
    """What a job read back from the outbox after a restart needs next."""
    if stored == "done":
        return "republish"  # its result may never have reached the broker
    if stored == "offloaded":
        return "await_return"  # the worker may still answer; then the timeout applies
    if local_runs >= max_local_runs:
        return "dead_letter"
    return "route"


def dead_letter_reason(job_id: str, edge_id: str, runs: int) -> str:
    return (
        f"job {job_id} was started {runs} times on edge {edge_id} and each run ended with the "
        "agent dying (crash, kill or power loss), so it is not run again; the image may crash "
        "the model: check it and the agent's log, then resubmit under a new job-id to retry"
    )
