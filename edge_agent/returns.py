"""What comes back to the edge about the jobs it offloaded, read off the wire: a worker's
return (:func:`read_return`; a sister campus's worker's, unwrapped, is named
``topics.peer_worker``) and a broker's notice (:func:`read_notice`), each either a
value or the reason it cannot be one, and whether a returned result says the work never ran
(:func:`not_run`), and the job a released dead letter's retry is (:func:`retry_job`). Pure:
what the job then does is the lifecycle table's to say.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pydantic import ValidationError

from edge_agent.admission import Job
from sluicegate import topics, wire
from sluicegate.transport import Message
from sluicegate.wire_pool import JobNotice

if TYPE_CHECKING:  # the outbox's row type, named here only (this module does no I/O)
    from edge_agent.outbox_file import Stored

# A worker's "rejected" with one of these codes (or before its token passed) means the job
# never ran there: the edge runs it itself rather than answering the app with the refusal.
_NOT_RUN = frozenset({"queue_full", "shutting_down", "offline", "bad_property", "no_edge_id"})


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
    peer = topics.peer_of(msg.topic)
    if peer:  # a sister campus's worker: named as the placement named it
        worker = topics.peer_worker(worker, peer)
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


def retry_job(
    stored: Stored | None, notice: JobNotice, now: float, *, retried: bool = False
) -> Job | str:
    """The retry of a released dead letter (``notice``): the image and request this edge
    kept, as a new job ``notice.retry_id`` received ``now``, with no deadline (the
    original's has passed); or why there is none (``retried``: the edge holds a job of
    that retry id already, on disk or in memory: the release came twice)."""
    if notice.retry_id is None:
        return f"the release of {notice.job_id!r} names no retry id"
    if retried:
        return f"{notice.retry_id} is retried already"
    if stored is None or not stored.job.payload or stored.pending:
        why = "holds no such job" if stored is None else "keeps no dead letter's image for it"
        return f"cannot retry {notice.job_id!r}: this edge {why} (kept for dead_letter_keep_s)"
    return replace(stored.job, job_id=notice.retry_id, received_at=now, deadline=None)
