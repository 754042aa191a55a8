"""Pure tier: the admission decision for each kind of request, good and bad."""

from __future__ import annotations

import itertools

import pytest

from edge_agent.admission import Job, Limits, RequestRefusal, admit, derive_job_id, queue_key
from edge_agent.load import JobQueue
from sluicegate import topics
from sluicegate.transport import Message
from tests.image_bytes import corrupt_jpeg, jpeg_header_only, png_header_only, sample_jpeg

NOW = 1_800_000_000.0
LIMITS = Limits(max_payload_bytes=1 << 20, max_pixels=40_000_000, max_side=10_000)
MODELS = frozenset({"defect-v1"})
JPEG, _ = sample_jpeg()
_ids = itertools.count()


def _msg(
    payload: bytes = JPEG,
    *,
    response_topic: str | None = "app/results",
    content_type: str | None = "image/jpeg",
    **props: str,
) -> Message:
    user = {topics.PROP_MODEL: "defect-v1", **{k.replace("_", "-"): v for k, v in props.items()}}
    return Message(
        topic=topics.edge_submit("e1"),
        payload=payload,
        qos=1,
        response_topic=response_topic,
        correlation_data=b"corr-1",
        content_type=content_type,
        user_properties=tuple((k, v) for k, v in user.items() if v != "<absent>"),
    )


def _admit(msg: Message) -> Job | RequestRefusal:
    return admit(msg, models=MODELS, limits=LIMITS, now=NOW, new_id=lambda: f"id{next(_ids)}")


def test_good_request_is_accepted_with_its_properties() -> None:
    job = _admit(_msg(deadline_ms="200", priority="7", data_class="wafer", job_id="lot-42.7"))
    assert isinstance(job, Job)
    assert job.job_id == "lot-42.7"
    assert (job.model, job.priority, job.data_class) == ("defect-v1", 7, "wafer")
    assert job.deadline == pytest.approx(NOW + 0.2)
    assert (job.image.format, job.image.width, job.image.height) == ("jpeg", 640, 480)
    assert job.correlation_data == b"corr-1"


def test_defaults_when_optional_properties_are_absent() -> None:
    job = _admit(_msg(content_type=None))
    assert isinstance(job, Job)
    assert (job.priority, job.data_class, job.deadline) == (5, "generic", None)
    # No job-id given: derived from the request, so a resubmission gets the same id.
    assert job.job_id == derive_job_id("app/results", b"corr-1", JPEG)
    assert len(job.job_id) == 32
    again = _admit(_msg(content_type=None))
    assert isinstance(again, Job)
    assert again.job_id == job.job_id


@pytest.mark.parametrize(
    ("topic", "corr", "payload"),
    [
        ("app/other", b"corr-1", JPEG),
        ("app/results", b"corr-2", JPEG),
        ("app/results", None, JPEG),
        ("app/results", b"corr-1", JPEG + b"\0"),
    ],
)
def test_derived_ids_differ_when_the_request_differs(
    topic: str, corr: bytes | None, payload: bytes
) -> None:
    assert derive_job_id(topic, corr, payload) != derive_job_id("app/results", b"corr-1", JPEG)


def test_request_with_nowhere_to_answer_gets_a_fresh_id() -> None:
    refusal = _admit(_msg(response_topic=None))
    assert isinstance(refusal, RequestRefusal)
    assert refusal.job_id.startswith("id")


def test_deadline_at_and_deadline_ms_take_the_earlier() -> None:
    at_ms = str((NOW + 0.05) * 1000)
    job = _admit(_msg(deadline_ms="500", deadline_at=at_ms))
    assert isinstance(job, Job)
    assert job.deadline == pytest.approx(NOW + 0.05)


def test_the_apps_send_time_is_kept_and_changes_no_deadline() -> None:
    job = _admit(_msg(deadline_ms="200", sent_at=str((NOW - 0.004) * 1000)))
    assert isinstance(job, Job)
    assert job.sent_at == pytest.approx(NOW - 0.004)
    assert job.deadline == pytest.approx(NOW + 0.2)  # still from receipt
    unstamped = _admit(_msg())
    assert isinstance(unstamped, Job)
    assert unstamped.sent_at is None


JOB_ID_RULE = "1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit"


@pytest.mark.parametrize("job_id", ["7", "A" * 128, "Lot-42.w_07", "0-"])
def test_job_ids_the_wire_contract_allows_are_accepted(job_id: str) -> None:
    job = _admit(_msg(job_id=job_id))
    assert isinstance(job, Job), job
    assert job.job_id == job_id


@pytest.mark.parametrize(
    "job_id",
    [
        "A" * 129,  # longer than a placement request or a worker accepts
        "lot-42:7",  # ':' separates Redis key parts: 'x:decision' is job x's decision key
        "-lot",
        ".hidden",
        "lot 42",
        "lot/42",
        "lot-é",
    ],
)
def test_job_ids_outside_the_wire_contract_are_refused_naming_the_rule(job_id: str) -> None:
    decision = _admit(_msg(job_id=job_id))
    assert isinstance(decision, RequestRefusal), decision
    assert (decision.code, decision.job_id) == ("bad_property", job_id)
    assert (
        decision.reason == f"user property 'job-id'={job_id!r} is invalid: expected {JOB_ID_RULE}"
    )


@pytest.mark.parametrize(
    ("msg", "code", "words"),
    [
        (_msg(response_topic=None), "no_response_topic", "Response Topic"),
        (_msg(model="<absent>"), "bad_property", "missing user property 'model'"),
        (_msg(model="defect-v9"), "unknown_model", "unknown model 'defect-v9'; known: defect-v1"),
        (_msg(b""), "empty_payload", "payload is empty"),
        (_msg(b"\xff" * ((1 << 20) + 1)), "payload_too_large", "limit is 1048576 bytes"),
        (_msg(content_type="text/plain"), "bad_content_type", "'image/jpeg' or 'image/png'"),
        (_msg(content_type="image/png"), "bad_content_type", "does not match"),
        (_msg(deadline_ms="soon"), "bad_property", "'deadline-ms'='soon'"),
        (_msg(deadline_ms="-5"), "bad_property", "'deadline-ms'='-5'"),
        (_msg(deadline_ms="nan"), "bad_property", "'deadline-ms'='nan'"),
        (_msg(priority="11"), "bad_property", "integer 0 (lowest) to 9"),
        (
            _msg(sent_at="yesterday"),
            "bad_property",
            "'sent-at'='yesterday' is invalid: expected unix",
        ),
        (_msg(sent_at="inf"), "bad_property", "'sent-at'='inf'"),
        (_msg(data_class="Wafer Images"), "bad_property", "'data-class'"),
        (_msg(b"GIF89a" + b"\x00" * 40), "bad_image", ""),
        (_msg(b"\xff\xd8\xff\xe0\x00"), "bad_image", ""),
        (_msg(png_header_only(20000, 20000), content_type="image/png"), "image_too_large", ""),
        (_msg(jpeg_header_only(20000, 20000)), "image_too_large", "20000"),
        (_msg(jpeg_header_only(12000, 100)), "image_too_large", "12000"),
        (_msg(deadline_at=str((NOW - 1) * 1000)), "expired", "deadline passed"),
        (
            _msg(**{f"x_{i}": "y" * 64 for i in range(200)}),
            "bad_property",
            "carries 201 user properties; at most 32",
        ),
    ],
)
def test_bad_requests_are_refused_with_a_reason(msg: Message, code: str, words: str) -> None:
    decision = _admit(msg)
    assert isinstance(decision, RequestRefusal), decision
    assert decision.code == code
    assert words in decision.reason
    assert decision.status == ("expired" if code == "expired" else "rejected")
    assert decision.correlation_data == b"corr-1"
    assert decision.response_topic == msg.response_topic


def test_corrupt_body_with_valid_header_passes_admission() -> None:
    # The header is fine, so it is accepted; the decoder then answers it with bad_image.
    assert isinstance(_admit(_msg(corrupt_jpeg())), Job)


def test_refusal_echoes_a_caller_job_id_even_when_other_properties_are_bad() -> None:
    decision = _admit(_msg(job_id="mine-1", priority="x"))
    assert isinstance(decision, RequestRefusal)
    assert decision.job_id == "mine-1"


def test_queue_order_priority_then_deadline_then_fifo() -> None:
    ids = itertools.count()

    def job(priority: int, deadline: float | None) -> Job:
        j = _admit(_msg(priority=str(priority), job_id=f"q{next(ids)}"))
        assert isinstance(j, Job)
        return Job(**{**{f: getattr(j, f) for f in Job.__slots__}, "deadline": deadline})

    jobs = [job(5, None), job(5, NOW + 1), job(9, None), job(5, NOW + 0.5), job(5, None)]
    queue: JobQueue[Job] = JobQueue(10, queue_key)
    for j in jobs:
        assert queue.push(j)
    order = [jobs.index(queue.pop()) for _ in jobs]
    assert order == [2, 3, 1, 0, 4]
    with pytest.raises(IndexError):
        queue.pop()


def test_queue_refuses_past_capacity() -> None:
    queue: JobQueue[str] = JobQueue(2, lambda s: (0, 0.0))
    assert queue.push("a")
    assert queue.push("b")
    assert not queue.push("c")
    assert len(queue) == 2
    with pytest.raises(ValueError, match="capacity"):
        JobQueue(0, lambda s: (0, 0.0))


def test_an_oversized_payload_is_refused_without_hashing_it_for_an_id() -> None:
    decision = _admit(_msg(b"\xff" * ((1 << 20) + 1)))
    assert isinstance(decision, RequestRefusal)
    assert decision.job_id.startswith("id")  # a fresh id, not one derived from the bytes
    own = _admit(_msg(b"\xff" * ((1 << 20) + 1), job_id="mine-2"))
    assert own.job_id == "mine-2"


def test_a_refused_request_within_the_size_limit_has_its_derived_id() -> None:
    bad = _msg(priority="x")
    decision = _admit(bad)
    assert isinstance(decision, RequestRefusal)
    assert bad.response_topic is not None
    assert decision.job_id == derive_job_id(bad.response_topic, b"corr-1", bad.payload)


def test_an_edge_answers_only_where_the_policy_lets_its_apps_take_results() -> None:
    from edge_agent.admission import results_topics, unanswerable
    from tests.policies.policy_testkit import base_doc, policy_of

    doc = base_doc()
    doc["apps"] = {"inspect": {"edges": ["north-l1-pc"], "results": ["app/north"]}}
    policy = policy_of(doc)
    allowed = results_topics(policy, "north-l1-pc")
    assert allowed == ("sluicegate/v1/clients/inspect/results", "app/north/#")
    assert results_topics(policy, "other-pc") == ()
    table = {
        "app/north/line-1/results": None,
        "sluicegate/v1/clients/inspect/results": None,
        "app/south/results": "response_topic_not_allowed",
        "sluicegate/v1/clients/other/results": "response_topic_not_allowed",
    }
    admitted = _admit(_msg(job_id="rt-1"))
    assert isinstance(admitted, Job)

    def job_for(topic: str) -> Job:
        return Job(**{**{f: getattr(admitted, f) for f in Job.__slots__}, "response_topic": topic})

    for topic, code in table.items():
        job = job_for(topic)
        refusal = unanswerable(job, allowed, "north-l1-pc")
        assert (refusal.code if refusal else None) == code, topic
        if refusal is not None:
            assert refusal.response_topic is None  # nowhere to say so
            assert "app/north/#" in refusal.reason
    assert unanswerable(job_for("anything"), (), "e") is None


@pytest.mark.parametrize(
    ("edge", "topic", "owner"),
    [
        ("north-l1-pc", "app/north/line-1/results", "inspect"),
        ("north-l1-pc", "sluicegate/v1/clients/inspect/results", "inspect"),
        ("north-l1-pc", "sluicegate/v1/clients/audit/results", "audit"),
        ("north-l1-pc", "app/shared/results", "audit"),  # both list it: the first by id
        ("north-l1-pc", "app/elsewhere/results", ""),
        ("other-pc", "app/north/line-1/results", ""),  # not an edge of the app
    ],
)
def test_a_job_is_billed_to_the_app_whose_results_topics_it_answers_on(
    edge: str, topic: str, owner: str
) -> None:
    from edge_agent.admission import owner_of
    from tests.policies.policy_testkit import base_doc, policy_of

    doc = base_doc()
    doc["apps"] = {
        "inspect": {"edges": ["north-l1-pc"], "results": ["app/north", "app/shared"]},
        "audit": {"edges": ["north-l1-pc"], "results": ["app/shared"]},
    }
    assert owner_of(policy_of(doc), edge, topic) == owner
    assert owner_of(None, edge, topic) == ""


def test_owners_follow_the_policy_in_force() -> None:
    from edge_agent.admission import Owners
    from tests.policies.policy_testkit import base_doc, policy_of

    doc = base_doc()
    doc["apps"] = {"inspect": {"edges": ["north-l1-pc"], "results": ["app/north"]}}
    first = policy_of(doc)
    doc["apps"] = {"audit": {"edges": ["north-l1-pc"], "results": ["app/north"]}}
    doc["version"] = first.version + 1
    second = policy_of(doc)
    owners = Owners("north-l1-pc")
    assert owners.of(first, "app/north/results") == "inspect"
    assert owners.of(first, "app/north/results") == "inspect"
    assert owners.of(second, "app/north/results") == "audit"  # a new policy: asked again
    assert owners.of(None, "app/north/results") == ""
