"""Pure tier: the edge's ledger rules for what comes back about an offloaded job.

A worker's return may conclude a job only for its current attempt, from the worker that
attempt went to (the topic says who sent it: ``stranger`` otherwise), and while the job
waits on it; a return whose worker-id property names another worker than its topic is no
return at all.
"""

from __future__ import annotations

import pytest

from edge_agent.admission import Job
from edge_agent.ledger import Phase, Return, Tracked, Verdict, read_return, return_verdict
from sluicegate import topics, wire
from sluicegate.transport import Message
from sluicegate.vision.image import ImageInfo

EDGE = "north-l1-pc"
JOB = Job("job-1", "defect-v1", b"", ImageInfo("jpeg", 1, 1), "app/r", None, 5, "c", 0.0, None)


def _tracked(phase: Phase = "offloaded", attempt: int = 2, worker: str | None = "w1") -> Tracked:
    return Tracked(JOB, phase, attempt=attempt, worker=worker)


@pytest.mark.parametrize(
    ("tracked", "attempt", "worker", "verdict"),
    [
        (_tracked(), 2, "w1", "accept"),
        (_tracked(), 2, "w2", "stranger"),  # the current attempt, but it went to w1
        (_tracked(), 1, "w2", "stale"),  # an older attempt, wherever it ran
        (_tracked(), 3, "w1", "stale"),  # an attempt that never was
        (_tracked(attempt=0, worker=None), 0, "w1", "stale"),  # never offloaded
        (_tracked(worker=None), 2, "w2", "accept"),  # restarted: where it went is not known
        (_tracked(), 2, None, "accept"),  # a caller that names no worker
        (_tracked(phase="queued"), 2, "w1", "accept"),  # rerouted here, not started
        (_tracked(phase="queued"), 2, "w2", "stranger"),
        (_tracked(phase="running"), 2, "w1", "busy"),
        (_tracked(phase="offering"), 2, "w1", "busy"),  # being placed anew
        (_tracked(phase="finishing"), 2, "w2", "stranger"),  # who sent it, before what for
        (None, 2, "w1", "unknown"),  # concluded, or never this edge's
    ],
)
def test_return_verdict(
    tracked: Tracked | None, attempt: int, worker: str | None, verdict: Verdict
) -> None:
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
