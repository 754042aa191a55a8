"""The edge agent's in-memory view of the jobs it owns, and the pure rules over it.

Each accepted job not yet concluded is :class:`Tracked` in one phase. The tables below say
which phases an outside event may act on; everything else is discarded and counted. The
outbox's conditional writes enforce the same rules on disk, so a decision taken here and a
crash between here and the disk cannot disagree. This module also reads the two messages
that come back to the edge about offloaded jobs (a worker's return, a broker's notice) and
decides what a stored job needs after a restart. No I/O, no clock, no asyncio.

    phase       the job is ...                                  on disk
    queued      waiting for a local compute slot                queued (or offloaded: a
                                                                rerouted job until it starts)
    starting    having its local run counted before it runs     queued
    running     running here                                    queued
    offering    waiting for the broker's placement              queued / offloaded (retry)
    offloaded   on a worker as ``attempt``; awaiting its return offloaded
    finishing   having its result committed                     -> done
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import ValidationError

from edge_agent.admission import Job
from edge_agent.offload import Declined
from edge_agent.outbox import Stored
from sluicegate import topics, wire
from sluicegate.transport import Message
from sluicegate.wire_pool import JobNotice

Phase = Literal["queued", "starting", "running", "offering", "offloaded", "finishing"]

# A return is taken for the job's current attempt while the job waits on it, or waits here
# (rerouted, not started): then the outbox still holds it as offloaded as that attempt. Not
# while a new attempt is being placed: that attempt may be on disk already.
TAKES_RETURN: frozenset[Phase] = frozenset({"queued", "offloaded"})
# A lost worker matters only while the job is on it; a dead letter while no local run is on.
TAKES_WORKER_LOST: frozenset[Phase] = frozenset({"offloaded"})
TAKES_DEAD_LETTER: frozenset[Phase] = frozenset({"queued", "offering", "offloaded"})

# A worker's "rejected" with one of these codes (or before its token passed) means the job
# never ran there: the edge runs it itself rather than answering the app with the refusal.
_NOT_RUN = frozenset({"queue_full", "shutting_down", "offline", "bad_property", "no_edge_id"})


@dataclass(slots=True)
class Tracked:
    """A job this edge owns until its result is committed."""

    job: Job
    phase: Phase
    attempt: int = 0  # the current placement attempt; 0 until first offloaded
    local_runs: int = 0  # local runs started so far (as counted on disk)
    declined: Declined | None = None  # why it stayed here, for the result's offload field
    expires_at: float | None = None  # offloaded: when to stop waiting for the return
    on_disk: int = 0  # the latest attempt the outbox is known to have recorded
    worker: str | None = None  # where the current attempt went; None: not known (restarted)


Verdict = Literal["accept", "unknown", "stale", "busy", "stranger"]


def return_verdict(tracked: Tracked | None, attempt: int, worker: str | None = None) -> Verdict:
    """Whether ``worker``'s return for ``attempt`` may conclude the job (fencing)."""
    if tracked is None:
        return "unknown"  # concluded already, or never ours: a duplicate or a stray
    if attempt != tracked.attempt or tracked.attempt == 0:
        return "stale"
    if worker is not None and tracked.worker is not None and worker != tracked.worker:
        return "stranger"  # the attempt went to another worker
    if tracked.phase not in TAKES_RETURN:
        return "busy"  # placed anew, running here, or its result is being committed
    return "accept"


@dataclass(frozen=True, slots=True)
class Return:
    """A worker's result for one attempt of a job this edge offloaded."""

    job_id: str
    attempt: int
    worker_id: str
    result: wire.JobResult
    payload: bytes  # forwarded to the app unchanged


def read_return(msg: Message) -> Return | str:
    """The return in ``msg``, or why it cannot be one (for the log)."""
    job_id = msg.user_property(topics.PROP_JOB_ID)
    raw_attempt = msg.user_property(topics.PROP_ATTEMPT)
    worker = topics.sender(msg.topic)  # the ACL lets only that worker write it
    named = msg.user_property(topics.PROP_WORKER)
    if named is not None and named != worker:
        return f"the return names worker {named!r} but came from {worker!r}"
    if not job_id:
        return f"no {topics.PROP_JOB_ID!r} user property"
    if raw_attempt is None or not raw_attempt.isdigit() or int(raw_attempt) < 1:
        return f"{topics.PROP_ATTEMPT!r}={raw_attempt!r} is not an attempt number"
    try:
        result = wire.JobResult.model_validate_json(msg.payload)
    except ValidationError as exc:
        return f"the result document is malformed: {exc.error_count()} error(s)"
    if result.job_id != job_id:
        return f"the document is for job {result.job_id!r}, the property says {job_id!r}"
    return Return(job_id, int(raw_attempt), worker, result, msg.payload)


def not_run(result: wire.JobResult) -> bool:
    """True when a returned result says the worker refused the work without running it."""
    if result.status != "rejected":
        return False
    if result.offload is not None and not result.offload.placed:
        return True
    code = result.code or ""
    return code in _NOT_RUN or code.startswith(("token.", "policy."))


def read_notice(msg: Message) -> JobNotice | str:
    """The broker's notice in ``msg``, or why it cannot be one."""
    try:
        return JobNotice.model_validate_json(msg.payload)
    except ValidationError as exc:
        return f"the notice is malformed: {exc.error_count()} error(s)"


def offload_expiry(sent_at: float, timeout_s: float, deadline: float | None) -> float:
    """When to stop waiting for an offloaded job's return: after the timeout, or at its
    deadline if that comes first (then it can only end expired)."""
    expiry = sent_at + timeout_s
    return min(expiry, deadline) if deadline is not None else expiry


Plan = Literal["republish", "dead_letter", "route", "await_return"]


def replay_plan(stored: Stored, max_local_runs: int) -> Plan:
    """What a job read back from the outbox after a restart needs next."""
    if stored.state == "done":
        return "republish"  # its result may never have reached the broker
    if stored.state == "offloaded":
        return "await_return"  # the worker may still answer; then the timeout applies
    if stored.local_runs >= max_local_runs:
        return "dead_letter"
    return "route"


def dead_letter_reason(job_id: str, edge_id: str, runs: int) -> str:
    return (
        f"job {job_id} was started {runs} times on edge {edge_id} and each run ended with the "
        "agent dying (crash, kill or power loss), so it is not run again; the image may crash "
        "the model: check it and the agent's log, then resubmit under a new job-id to retry"
    )
