"""Pure tier: what comes back to the edge about an offloaded job, and the fencing rules
that decide whether it may conclude the job (the lifecycle table's return rows).

A worker's return may conclude a job only for its current attempt, from the worker that
attempt went to (the topic says who sent it: ``stranger`` otherwise), and while the job
waits on it; a return whose worker-id property names another worker than its topic is no
return at all.
"""

from __future__ import annotations

import pytest

from edge_agent import events as ev
from edge_agent.admission import Job
from edge_agent.events import Life, Phase
from edge_agent.lifecycle import transition
from edge_agent.outbox_file import Stored
from edge_agent.returns import Return, read_return, retry_job
from edge_agent.rules import Outlook
from sluicegate import topics, wire
from sluicegate.transport import Message
from sluicegate.vision.image import ImageInfo
from sluicegate.wire_pool import JobNotice

EDGE = "north-l1-pc"
OUTLOOK = Outlook(EDGE, False, 0.0, 0, 32, 4, 3, 3.0)


def _tracked(phase: Phase = "offloaded", attempt: int = 2, worker: str | None = "w1") -> Life:
    return Life("job-1", None, phase, attempt=attempt, worker=worker)


def return_verdict(life: Life | None, attempt: int, worker: str) -> str:
    """What the table makes of the return: accepted, or the reason it was discarded."""
    life = life or Life("job-1", None, "concluded")
    _, effects = transition(life, ev.Returned(attempt, worker), 0.0, OUTLOOK)
    discarded = [e.why for e in effects if isinstance(e, ev.Discard)]
    return discarded[0] if discarded else "accept"


@pytest.mark.parametrize(
    ("tracked", "attempt", "worker", "verdict"),
    [
        (_tracked(), 2, "w1", "accept"),
        (_tracked(), 2, "w2", "stranger"),  # the current attempt, but it went to w1
        (_tracked(), 1, "w2", "stale"),  # an older attempt, wherever it ran
        (_tracked(), 3, "w1", "stale"),  # an attempt that never was
        (_tracked(attempt=0, worker=None), 0, "w1", "stale"),  # never offloaded
        (_tracked(worker=None), 2, "w2", "accept"),  # replayed from an older outbox
        (_tracked(phase="queued"), 2, "w1", "accept"),  # rerouted here, not started
        (_tracked(phase="queued"), 2, "w2", "stranger"),
        (_tracked(phase="running"), 2, "w1", "busy"),
        (_tracked(phase="offering"), 2, "w1", "busy"),  # being placed anew
        (_tracked(phase="finishing"), 2, "w2", "stranger"),  # who sent it, before what for
        (None, 2, "w1", "unknown"),  # concluded, or never this edge's
    ],
)
def test_return_verdict(tracked: Life | None, attempt: int, worker: str, verdict: str) -> None:
    assert return_verdict(tracked, attempt, worker) == verdict


def _result(job_id: str = "job-1") -> bytes:
    ran = wire.RanOn(kind="pool", node="w1", zone="campus/dc")
    return wire.dump(wire.JobResult(job_id=job_id, status="ok", model="defect-v1", ran_on=ran))


def _return(
    *,
    sender: str = "w1",
    named: str | None = "w1",
    job_id: str | None = "job-1",
    attempt: str | None = "2",
    payload: bytes | None = None,
) -> Message:
    props = [
        (name, value)
        for name, value in (
            (topics.PROP_JOB_ID, job_id),
            (topics.PROP_ATTEMPT, attempt),
            (topics.PROP_WORKER, named),
        )
        if value is not None
    ]
    return Message(
        topics.edge_returns(EDGE, sender),
        _result() if payload is None else payload,
        qos=1,
        user_properties=tuple(props),
    )


@pytest.mark.parametrize(
    ("msg", "worker"),
    [
        (_return(), "w1"),
        (_return(named=None), "w1"),  # the property is optional: the topic says who
        (_return(sender="w2", named="w2"), "w2"),
    ],
)
def test_a_return_comes_from_the_worker_its_topic_names(msg: Message, worker: str) -> None:
    got = read_return(msg)
    assert isinstance(got, Return), got
    assert (got.job_id, got.attempt, got.worker_id) == ("job-1", 2, worker)
    assert got.payload == msg.payload


@pytest.mark.parametrize(
    ("msg", "words"),
    [
        (_return(sender="w1", named="w2"), ["'w2'", "'w1'"]),
        (_return(job_id=None), ["'job-id'"]),
        (_return(attempt="0"), ["'attempt'", "'0'"]),
        (_return(attempt=None), ["'attempt'", "None"]),
        (_return(payload=b"{}"), ["malformed"]),
        (_return(payload=_result("job-9")), ["'job-9'", "'job-1'"]),
    ],
)
def test_what_is_no_return_says_why(msg: Message, words: list[str]) -> None:
    why = read_return(msg)
    assert isinstance(why, str)
    for word in words:
        assert word in why, why


def _released(retry_id: str | None) -> JobNotice:
    return JobNotice(
        job_id="dl-1",
        attempt=1,
        kind="released",
        worker_id="broker-1",
        crashes=3,
        reason="ana: fixed the model",
        retry_id=retry_id,
    )


def _dead_letter(*, pending: bool = False) -> Stored:
    job = Job(
        "dl-1", "defect-v1", b"jpeg", ImageInfo("jpeg", 8, 8), "app/r", b"c", 5, "g", 1.0, 2.0
    )
    return Stored(job, "queued" if pending else "delivered", 1, 3, None)


@pytest.mark.parametrize(
    ("stored", "retry_id", "retried", "words"),
    [
        (_dead_letter(), None, False, "names no retry id"),
        (_dead_letter(), "dl-1-r1", True, "dl-1-r1 is retried already"),
        (None, "dl-1-r1", False, "holds no such job"),
        (_dead_letter(pending=True), "dl-1-r1", False, "keeps no dead letter's image"),
    ],
)
def test_a_release_that_cannot_be_retried_says_why(
    stored: Stored | None, retry_id: str | None, retried: bool, words: str
) -> None:
    why = retry_job(stored, _released(retry_id), 50.0, retried=retried)
    assert isinstance(why, str)
    assert words in why


def test_a_released_dead_letter_runs_again_as_a_new_job_without_a_deadline() -> None:
    job = retry_job(_dead_letter(), _released("dl-1-r1"), 50.0)
    assert isinstance(job, Job)
    assert (job.job_id, job.received_at, job.deadline, job.payload) == (
        "dl-1-r1",
        50.0,
        None,
        b"jpeg",
    )
