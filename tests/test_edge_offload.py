"""In-memory tier: the edge's offload path against a scripted broker (real crypto, real model).

The scripted broker answers placement requests the way the campus broker would (a token
minted with the test broker key for the origin zone the policy gives the edge whose topic
carried the request, or a refusal, on that edge's reply topic), so each branch of the
edge's decision is exercised: sent to the worker with a token the edge verified, or kept
local with the reason in its result. A :class:`GatedOutbox` holds (or fails) the acceptance
commit, to show what the edge does while a new job's placement and its commit overlap.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

from edge_agent import jobs as jobs_module
from edge_agent.admission import owner_of
from edge_agent.agent import EdgeAgent
from edge_agent.errors import OutboxError
from edge_agent.offload import PlacementClient
from edge_agent.outbox import Outbox, Stored
from edge_agent.rules import Declined, Placement
from policies import PlacementClaims, Policy, mint
from policies.tokens import seal
from sluicegate import topics, wire
from sluicegate.config import load_settings
from sluicegate.memory_transport import MemoryBroker, MemoryTransport
from sluicegate.sqlite_writer import Batch
from sluicegate.transport import Message
from sluicegate.vision.runtime import ModelRegistry, default_models_dir
from sluicegate.wire_pool import JobNotice, PlacementRelease, PlacementReply, PlacementRequest
from tests.image_bytes import sample_jpeg
from tests.policies.policy_testkit import base_doc, key, policy_of
from tests.support import until

REGISTRY = ModelRegistry.from_dir(default_models_dir())
POLICY = policy_of(base_doc())
EDGE = "north-l1-pc"
ZONE = "campus/fab-north/line-1"  # EDGE's zone in the policy
WORKER = "north-gpu-1"
JPEG, TRUTH = sample_jpeg(21, "scratch")
Responder = Callable[[PlacementRequest], PlacementReply | None]


def as_broker_hears(msg: Message) -> tuple[PlacementRequest, str]:
    """A placement request as the campus broker takes it: from the edge whose topic carried
    it, with that edge's zone in the policy as its origin; and where the answer goes (that
    edge's reply topic, whatever the message's Response Topic)."""
    edge = topics.sender(msg.topic)
    req = PlacementRequest.model_validate_json(msg.payload)
    entry = POLICY.edge(edge)
    assert entry is not None, f"edge {edge} is not in the test policy"
    return req.model_copy(update={"origin_zone": entry.zone}), topics.placement_replies(edge)


def placed(
    worker: str = WORKER, zone: str = "campus/fab-north/dc", *, checked: bool = True
) -> Responder:
    """A broker that places on ``worker``; ``checked=False`` signs without asking the policy,
    as a compromised or misconfigured broker might."""

    def answer(req: PlacementRequest) -> PlacementReply:
        digest = bytes.fromhex(req.payload_sha256)
        now = time.time()
        if checked:
            token = mint(
                POLICY,
                key("broker-1"),
                job_id=req.job_id,
                payload_sha256=digest,
                data_class=req.data_class,
                origin_zone=req.origin_zone,
                target_worker=worker,
                now=now,
            )
        else:
            claims = PlacementClaims(
                req.job_id,
                digest,
                req.data_class,
                req.origin_zone,
                worker,
                zone,
                POLICY.version,
                POLICY.digest[:16],
                int(now * 1000),
                int(now * 1000) + 10_000,
                b"\x01" * 16,
            )
            token = seal(claims, key("broker-1"))
        return PlacementReply(
            job_id=req.job_id,
            status="placed",
            token=token,
            worker_id=worker,
            worker_zone=zone,
            work_topic=topics.pool_work(zone, worker, req.edge_id),
        )

    return answer


def refused(code: str, reason: str) -> Responder:
    return lambda req: PlacementReply(job_id=req.job_id, status="refused", code=code, reason=reason)


class HoldGate:
    """A slow disk between the outbox and its writer: while ``holding``, batches wait until
    :meth:`release` passes them on, or fails them as a broken disk's commit would."""

    def __init__(self) -> None:
        self.holding = False
        self.staged: list[tuple[Batch, Callable[[Batch], None]]] = []

    def admit(self, batch: Batch, pass_on: Callable[[Batch], None]) -> None:
        if self.holding:
            self.staged.append((batch, pass_on))
        else:
            pass_on(batch)


class GatedOutbox(Outbox):
    """An outbox in memory behind a :class:`HoldGate`."""

    def __init__(self) -> None:
        self.hold = HoldGate()
        super().__init__(":memory:", gate=self.hold)

    @property
    def holding(self) -> bool:
        return self.hold.holding

    @holding.setter
    def holding(self, value: bool) -> None:
        self.hold.holding = value

    @property
    def staged(self) -> list[tuple[Batch, Callable[[Batch], None]]]:
        return self.hold.staged

    def release(self, *, fail: OutboxError | None = None) -> None:
        self.flush()  # a batch the loop has not handed on yet is held too
        self.hold.holding = False
        staged, self.hold.staged = self.hold.staged, []
        for batch, pass_on in staged:
            if fail is None:
                pass_on(batch)
            else:
                batch.fail(fail)


@dataclass
class Rig:
    broker: MemoryBroker
    agent: EdgeAgent
    requests: list[PlacementRequest]
    pool: MemoryTransport  # speaks for the broker, the workers and the app
    edge: MemoryTransport  # the agent's own
    client: PlacementClient

    def give_back(
        self,
        job_id: str,
        attempt: int,
        payload: bytes | None = None,
        *,
        worker: str = WORKER,
        named: str | None = None,
    ) -> bytes:
        """``worker`` returns its result for ``attempt`` of ``job_id`` on its returns topic,
        its worker-id property naming ``named`` (by default itself); returns the bytes."""
        payload = payload or pool_result(job_id)
        self.pool.publish_nowait(
            Message(
                topics.edge_returns(self.agent.settings.id, worker),
                payload,
                qos=1,
                correlation_data=job_id.encode(),
                user_properties=(
                    (topics.PROP_JOB_ID, job_id),
                    (topics.PROP_ATTEMPT, str(attempt)),
                    (topics.PROP_WORKER, named or worker),
                ),
            )
        )
        return payload

    def notify(
        self,
        job_id: str,
        attempt: int,
        kind: str,
        reason: str = "gone",
        retry_id: str | None = None,
    ) -> None:
        notice = JobNotice(
            job_id=job_id,
            attempt=attempt,
            kind=kind,  # type: ignore[arg-type]
            worker_id=WORKER,
            crashes=attempt,
            reason=reason,
            retry_id=retry_id,
        )
        topic = topics.edge_notices(self.agent.settings.id)
        self.pool.publish_nowait(Message(topic, wire.dump(notice), qos=1))

    async def results(self, n: int = 1) -> list[Message]:
        """The results at the app, once there are at least ``n``."""
        return await self._logged(n, lambda m: m.topic == "app/results")

    async def work(self, n: int) -> list[Message]:
        """The work messages sent to workers, once there are at least ``n``."""
        return await self._logged(n, lambda m: "/pool/" in m.topic)

    async def released(self, n: int) -> list[PlacementRelease]:
        """The placements the edge handed back to the broker, once there are at least ``n``."""
        found = await self._logged(n, lambda m: m.topic == topics.placement_release(EDGE))
        return [PlacementRelease.model_validate_json(m.payload) for m in found]

    async def _logged(self, n: int, wanted: Callable[[Message], bool]) -> list[Message]:
        # Counted, not told apart: a result published again is equal to the first.
        def got() -> list[Message]:
            return [m for m in self.broker.log if wanted(m)]

        await self.broker.wait_for(lambda _: len(got()) >= n, 10)
        return got()

    def submit(
        self,
        *,
        deadline_ms: float | None = 5000,
        data_class: str = "wafer-image",
        job_id: str | None = None,
        via_broker: bool = False,
        dup: bool = False,
    ) -> str:
        """Submit a job (a new id unless ``job_id``); ``via_broker``: as the app would, so
        that the edge's ack of the request can be seen (else handed to the agent at once,
        marked as a redelivery with ``dup``)."""
        job_id = job_id or uuid.uuid4().hex
        props = [
            (topics.PROP_MODEL, "defect-v1"),
            (topics.PROP_JOB_ID, job_id),
            (topics.PROP_DATA_CLASS, data_class),
        ]
        if deadline_ms is not None:
            props.append((topics.PROP_DEADLINE_MS, str(deadline_ms)))
        msg = Message(
            topics.edge_submit(self.agent.settings.id),
            JPEG,
            qos=1,
            response_topic="app/results",
            correlation_data=job_id.encode(),
            content_type="image/jpeg",
            user_properties=tuple(props),
            dup=dup,
        )
        if via_broker:
            self.pool.publish_nowait(
                Message(
                    msg.topic,
                    msg.payload,
                    qos=1,
                    response_topic=msg.response_topic,
                    correlation_data=msg.correlation_data,
                    content_type=msg.content_type,
                    user_properties=msg.user_properties,
                )
            )
        else:
            self.agent.on_message(msg)
        return job_id

    async def on_disk(self, job_id: str, attempt: int) -> Stored:
        """The job's row once ``attempt`` is recorded (a first attempt answered during the
        acceptance commit goes out before its record)."""
        return await self.stored_when(job_id, lambda stored: stored.attempt >= attempt)

    async def concluded(self, job_id: str) -> None:
        """The job's result is on disk (as the outbox answers now, in order after every
        write queued before) and nothing the edge received is left unacked."""
        stored = await self.agent.outbox.get(job_id)
        assert stored is not None
        assert stored.state in ("done", "delivered")
        assert self.edge.unacked == []

    async def stored_when(self, job_id: str, check: Callable[[Stored], bool]) -> Stored:
        """The job's row, once ``check`` holds for it."""
        async with asyncio.timeout(10):
            while True:  # each read waits for the writes queued before it
                stored = await self.agent.outbox.get(job_id)
                if stored is not None and check(stored):
                    return stored

    async def first(self, topic_filter: str) -> Message:
        return await self.broker.wait_for(lambda m: topics.matches(topic_filter, m.topic), 10)

    async def asked(self, job_id: str, *, besides: Message | None = None) -> Message:
        """The placement request for ``job_id`` (other than ``besides``), once the edge has
        sent it."""

        def asks(m: Message) -> bool:
            if m.topic != topics.placement_request(EDGE) or m is besides:
                return False
            return PlacementRequest.model_validate_json(m.payload).job_id == job_id

        return await self.broker.wait_for(asks, 10)

    def answer(self, request: Message, responder: Responder | None = None) -> None:
        """Answer a placement request by hand, as the broker would (placed, by default)."""
        heard, reply_topic = as_broker_hears(request)
        reply = (responder or placed())(heard)
        assert reply is not None
        self.pool.publish_nowait(
            Message(reply_topic, wire.dump(reply), correlation_data=request.correlation_data)
        )

    def sent(self) -> list[str]:
        """The job id of each work message sent to a worker so far."""
        return [
            m.user_property(topics.PROP_JOB_ID) or ""
            for m in self.broker.log
            if "/pool/" in m.topic
        ]


class Answers:
    """Each answer the edge's placement client gives (placed or declined), as it gives it;
    a request given up before its answer leaves no trace here."""

    def __init__(self, client: PlacementClient, monkeypatch: pytest.MonkeyPatch) -> None:
        self.got: list[Placement | Declined] = []
        self._new = asyncio.Event()
        place = client.place

        def spy(*args: Any, **kwargs: Any) -> asyncio.Future[Placement | Declined]:
            outcome = place(*args, **kwargs)
            outcome.add_done_callback(self._record)
            return outcome

        monkeypatch.setattr(client, "place", spy)

    def _record(self, outcome: asyncio.Future[Placement | Declined]) -> None:
        if not outcome.cancelled():
            self.got.append(outcome.result())
            self._new.set()

    async def wait(self, n: int) -> None:
        async with asyncio.timeout(10):
            while len(self.got) < n:
                self._new.clear()
                await self._new.wait()


def pool_result(
    job_id: str, status: str = "ok", code: str | None = None, placed: bool = True
) -> bytes:
    return wire.dump(
        wire.JobResult(
            job_id=job_id,
            status=status,  # type: ignore[arg-type]
            code=code,
            model="defect-v1",
            outputs=wire.Outputs(label="scratch", scores={"scratch": 0.9}) if not code else None,
            ran_on=wire.RanOn(kind="pool", node=WORKER, zone="campus/fab-north/dc"),
            offload=wire.Offload(requested=True, placed=placed, worker=WORKER),
        )
    )


@pytest.fixture
def result_timeout() -> float:
    return 3.0


@pytest.fixture
def placement_timeout_ms() -> float:
    return 200.0


@pytest.fixture
def outbox(request: pytest.FixtureRequest) -> Outbox | None:
    """The agent's outbox: its own in memory, or (``gated``) a :class:`GatedOutbox`."""
    return GatedOutbox() if getattr(request, "param", None) == "gated" else None


@pytest.fixture
def gate(outbox: Outbox | None) -> GatedOutbox:
    assert isinstance(outbox, GatedOutbox), "mark the test @gated"
    return outbox


gated = pytest.mark.parametrize("outbox", ["gated"], indirect=True)
TestFn = TypeVar("TestFn", bound=Callable[..., Any])


def answered_by_hand(test: TestFn) -> TestFn:
    """A broker that answers only when the test does (:meth:`Rig.answer`), and an edge that
    waits for its answer as long as the test needs."""
    test = pytest.mark.parametrize("rig", [None], indirect=True)(test)
    return pytest.mark.parametrize("placement_timeout_ms", [10_000.0])(test)


@pytest.fixture
async def rig(
    request: pytest.FixtureRequest,
    result_timeout: float,
    placement_timeout_ms: float,
    outbox: Outbox | None,
) -> AsyncIterator[Rig]:
    responder: Responder | None = getattr(request, "param", placed())
    broker = MemoryBroker()
    requests: list[PlacementRequest] = []
    broker_side = MemoryTransport(broker)

    def on_request(msg: Message) -> None:
        req, reply_topic = as_broker_hears(msg)
        requests.append(req)
        reply = responder(req) if responder is not None else None
        if reply is not None:
            broker_side.publish_nowait(
                Message(reply_topic, wire.dump(reply), correlation_data=msg.correlation_data)
            )

    await broker_side.subscribe(topics.placement_requests_all(), on_request)
    online = wire.NodeStatus(node="b1", kind="edge", zone="campus", state="online")
    broker_side.publish_nowait(Message(topics.broker_status("b1"), wire.dump(online), retain=True))
    settings = load_settings(
        edge={"id": EDGE, "zone": ZONE, "concurrency": 1},
        offload={"placement_timeout_ms": placement_timeout_ms, "result_timeout_s": result_timeout},
    )
    transport = MemoryTransport(broker)
    policy: Policy = POLICY
    client = PlacementClient(
        transport,
        edge_id=EDGE,
        zone=ZONE,
        policy=lambda: policy,
        timeout_s=settings.offload.placement_timeout_ms / 1000.0,
        clock=time.time,
    )
    agent = EdgeAgent(
        settings.edge,
        transport,
        REGISTRY,
        offload=client,
        offload_settings=settings.offload,
        outbox=outbox,
    )
    # Teach the agent a (pessimistic) 10 s service time: a 5 s deadline is predicted to be
    # missed here, yet a job kept local still finishes long before it.
    agent.service_times.observe("defect-v1", 10.0)
    await client.start()
    stop = asyncio.Event()
    runner = asyncio.ensure_future(agent.run(stop))
    await asyncio.wait_for(agent.ready.wait(), 10)
    await broker.wait_for(lambda m: m.topic == topics.broker_status("b1"))
    yield Rig(broker, agent, requests, broker_side, transport, client)
    stop.set()
    await asyncio.wait_for(runner, 30)


async def test_late_job_is_placed_verified_and_sent_to_the_worker(rig: Rig) -> None:
    job_id = rig.submit()
    work = await rig.first(topics.pool_work("campus/fab-north/dc", WORKER, EDGE))
    asked = await rig.asked(job_id)
    assert asked.topic == topics.placement_request(EDGE)  # who asks is the topic's
    assert PlacementRequest.model_validate_json(asked.payload).origin_zone == ""  # not claimed
    req = rig.requests[0]
    assert req.job_id == job_id
    assert req.edge_id == EDGE
    assert req.payload_sha256 == hashlib.sha256(JPEG).hexdigest()
    assert req.reason == "deadline"
    assert len(wire.dump(req)) < 1024  # metadata and a hash, never the image
    assert work.payload == JPEG
    # The worker answers this edge, which owns the job, not the app.
    assert work.response_topic == topics.edge_returns(EDGE, WORKER)
    assert work.user_property(topics.PROP_EDGE) == EDGE
    assert work.correlation_data == job_id.encode()
    assert work.user_property(topics.PROP_ATTEMPT) == "1"
    assert req.attempt == 1
    assert work.user_property(topics.PROP_TOKEN)
    assert work.user_property(topics.PROP_ORIGIN_ZONE) == ZONE
    assert work.user_property(topics.PROP_JOB_ID) == job_id
    # The app billed: none of the policy's apps takes results on app/results.
    assert owner_of(POLICY, EDGE, "app/results") == ""
    assert work.user_property(topics.PROP_OWNER) is None
    assert rig.agent.offloaded == 1
    assert not [m for m in rig.broker.log if m.topic == "app/results"]  # the worker answers


@pytest.mark.parametrize(
    "rig",
    [refused("policy_denied", "class 'wafer-image' may not leave campus/fab-north/line-1")],
    indirect=True,
)
async def test_refusal_keeps_the_job_local_and_says_why(rig: Rig) -> None:
    rig.submit()
    result = json.loads((await rig.first("app/results")).payload)
    assert result["status"] == "ok"
    assert result["ran_on"]["kind"] == "edge"
    assert result["offload"] == {
        "requested": True,
        "placed": False,
        "code": "policy_denied",
        "reason": "class 'wafer-image' may not leave campus/fab-north/line-1",
    }
    assert result["outputs"]["label"] == TRUTH


@pytest.mark.parametrize(
    "rig", [refused("dead_letter", "the job is dead-lettered: 3 workers died")], indirect=True
)
async def test_a_dead_lettered_refusal_answers_failed_and_does_not_run_here(rig: Rig) -> None:
    rig.submit()
    result = json.loads((await rig.first("app/results")).payload)
    assert (result["status"], result["code"]) == ("failed", "dead_letter")
    assert "3 workers died" in result["reason"]
    assert "outputs" not in result  # a poison job is not run on the line PC
    assert rig.agent.counters["dead_letters"] == 1


@pytest.mark.parametrize("rig", [None], indirect=True)
async def test_silent_broker_times_out_to_local(rig: Rig) -> None:
    rig.submit()
    result = json.loads((await rig.first("app/results")).payload)
    assert result["offload"]["code"] == "broker_timeout"
    assert result["status"] == "ok"


@pytest.mark.parametrize("rig", [None], indirect=True)
async def test_a_placement_answered_after_the_edge_gave_up_is_handed_back(rig: Rig) -> None:
    late = rig.submit()
    request = await rig.asked(late)
    result = json.loads((await rig.results(1))[0].payload)
    assert (result["ran_on"]["kind"], result["offload"]["code"]) == ("edge", "broker_timeout")
    refused_late = rig.submit()
    refusal = await rig.asked(refused_late)
    await rig.results(2)
    rig.answer(refusal, refused("no_capacity", "every allowed worker is full"))  # nothing held
    rig.answer(request)  # placed, 200 ms too late: the slot must not wait out its expiry
    (released,) = await rig.released(1)
    assert (released.job_id, released.worker_id, released.attempt) == (late, WORKER, 1)
    assert released.edge_id == EDGE
    assert released.reason == "placed after the edge stopped waiting (200 ms)"
    assert rig.sent() == []  # and the image never left for it
    assert rig.client.released == 1


@pytest.mark.parametrize(
    "rig", [placed(worker="cloud-gpu-1", zone="offsite/cloud-east", checked=False)], indirect=True
)
async def test_edge_refuses_a_placement_its_policy_forbids(rig: Rig) -> None:
    # A wafer image may not go off-site: even a validly signed token for it is refused.
    rig.submit(data_class="wafer-image")
    result = json.loads((await rig.first("app/results")).payload)
    assert result["ran_on"]["kind"] == "edge"
    assert result["offload"]["code"] == "token.zone_denied"
    assert "offsite/cloud-east" in result["offload"]["reason"]
    assert not [m for m in rig.broker.log if m.topic.startswith("sluicegate/v1/pool/")]
    (released,) = await rig.released(1)  # its slot is not held for a job never sent
    assert (released.worker_id, released.attempt) == ("cloud-gpu-1", 1)
    assert released.reason.startswith("token.zone_denied: ")


@pytest.mark.parametrize(
    "rig", [placed(worker="cloud-gpu-1", zone="offsite/cloud-east")], indirect=True
)
async def test_ocr_crops_may_go_offsite(rig: Rig) -> None:
    rig.submit(data_class="ocr-crop")
    work = await rig.first(topics.pool_work("offsite/cloud-east", "cloud-gpu-1", EDGE))
    assert work.user_property(topics.PROP_DATA_CLASS) == "ocr-crop"


async def test_job_that_meets_its_deadline_is_not_offered(rig: Rig) -> None:
    rig.submit(deadline_ms=60_000)
    result = json.loads((await rig.first("app/results")).payload)
    assert result["status"] == "ok"
    assert "offload" not in result
    assert rig.requests == []


async def test_no_broker_online_runs_locally_without_asking() -> None:
    broker = MemoryBroker()
    transport = MemoryTransport(broker)
    client = PlacementClient(
        transport, edge_id="e1", zone=ZONE, policy=lambda: POLICY, timeout_s=0.2, clock=time.time
    )
    await client.start()
    assert not client.broker_available


async def test_the_workers_result_reaches_the_app_unchanged_once(rig: Rig) -> None:
    job_id = rig.submit()
    await rig.work(1)
    sent = rig.give_back(job_id, 1)
    rig.give_back(job_id, 1)  # the same return again (a redelivery): discarded
    rig.give_back(job_id, 7)  # an attempt that never was: discarded
    (result,) = await rig.results(1)
    assert result.payload == sent  # forwarded unchanged, ran_on the pool
    assert result.correlation_data == job_id.encode()
    barrier = rig.submit()  # everything before it has been handled once this is answered
    await rig.work(2)
    rig.give_back(barrier, 1)
    await rig.results(2)
    assert rig.agent.counters["fenced_returns"] == 2
    assert [m.payload for m in rig.broker.log if m.topic == "app/results"].count(sent) == 1
    await rig.agent.drained(10)  # forwarded before its commit: the job ends with the commit
    assert rig.agent.unfinished == 0
    assert rig.agent.telemetry().finished == {"pool": 2}  # the broker's offload ratio reads it


async def test_lost_worker_means_a_new_attempt_and_the_old_one_is_fenced(rig: Rig) -> None:
    job_id = rig.submit()
    await rig.work(1)
    rig.notify(job_id, 1, "worker_lost")
    second = (await rig.work(2))[1]
    assert second.user_property(topics.PROP_ATTEMPT) == "2"
    assert [r.attempt for r in rig.requests] == [1, 2]
    rig.give_back(job_id, 1, pool_result(job_id, code=None))  # the lost worker, late: fenced
    rig.notify(job_id, 1, "worker_lost")  # a stale notice changes nothing
    sent = rig.give_back(job_id, 2)
    (result,) = await rig.results(1)
    assert result.payload == sent
    assert rig.agent.counters["fenced_returns"] == 1
    assert rig.agent.counters["stale_notices"] == 1
    assert rig.agent.counters["workers_lost"] == 1


async def test_a_return_from_a_worker_the_attempt_did_not_go_to_is_discarded(rig: Rig) -> None:
    job_id = rig.submit()
    await rig.work(1)
    forged = pool_result(job_id, "failed", code="forged")
    rig.give_back(job_id, 1, forged, worker="south-npu-1")  # the right attempt, another worker
    rig.give_back(job_id, 1, forged, named="south-npu-1")  # on its topic, naming another
    sent = rig.give_back(job_id, 1)  # the worker the attempt went to
    (result,) = await rig.results(1)  # returns are handled in order: the two came first
    assert result.payload == sent
    assert rig.agent.counters["fenced_returns"] == 1  # the stranger's
    assert rig.agent.counters["bad_returns"] == 1  # the one whose properties lie
    await rig.concluded(job_id)  # and both were acked, discarded
    assert [m.payload for m in rig.broker.log if m.topic == "app/results"] == [sent]


async def test_dead_letter_notice_answers_failed_with_the_reason(rig: Rig) -> None:
    job_id = rig.submit()
    await rig.work(1)
    rig.notify(job_id, 1, "dead_letter", "3 workers died running this job")
    (result,) = await rig.results(1)
    doc = json.loads(result.payload)
    assert (doc["status"], doc["code"]) == ("failed", "dead_letter")
    assert doc["reason"] == "3 workers died running this job"
    rig.give_back(job_id, 1)  # too late: the job is concluded
    barrier = rig.submit()
    await rig.work(2)
    rig.give_back(barrier, 1)
    await rig.results(2)
    assert rig.agent.counters["fenced_returns"] == 1


async def test_a_released_dead_letter_runs_again_once_as_a_new_job(rig: Rig) -> None:
    job_id = rig.submit()
    await rig.work(1)
    rig.notify(job_id, 1, "dead_letter", "3 workers died running this job")
    (failed,) = await rig.results(1)
    assert json.loads(failed.payload)["code"] == "dead_letter"
    retry = f"{job_id}.retry"
    rig.notify(job_id, 1, "released", "released by ana for one retry", retry_id=retry)
    _, again = await rig.results(2)
    doc = json.loads(again.payload)
    assert (doc["job_id"], doc["status"]) == (retry, "ok")  # the image the edge kept, run
    assert again.correlation_data == failed.correlation_data  # answered like the original
    assert rig.agent.counters["retries"] == 1
    # The same release again (a redelivery), and one for a job the edge never held: nothing.
    rig.notify(job_id, 1, "released", "again", retry_id=retry)
    rig.notify("never-held", 1, "released", "?", retry_id="never-held.retry")
    barrier = rig.submit()
    await rig.work(2)
    rig.give_back(barrier, 1)
    results = await rig.results(3)
    assert [json.loads(m.payload)["job_id"] for m in results][2] == barrier
    await rig.concluded(barrier)  # every notice acked
    assert rig.agent.counters["retries"] == 1
    assert rig.agent.counters["stale_notices"] == 2


@pytest.mark.parametrize("result_timeout", [0.2])
async def test_no_return_in_time_means_a_new_attempt(rig: Rig) -> None:
    job_id = rig.submit()
    first, second = await rig.work(2)  # nobody answers the first: the edge asks again
    assert (
        first.user_property(topics.PROP_ATTEMPT),
        second.user_property(topics.PROP_ATTEMPT),
    ) == (
        "1",
        "2",
    )
    rig.give_back(job_id, 2)
    await rig.results(1)
    assert rig.agent.counters["offload_timeouts"] >= 1


async def test_work_the_worker_refused_runs_here(rig: Rig) -> None:
    job_id = rig.submit()
    await rig.work(1)
    rig.give_back(job_id, 1, pool_result(job_id, "rejected", code="queue_full"))
    (result,) = await rig.results(1)
    doc = json.loads(result.payload)
    assert doc["status"] == "ok"
    assert doc["ran_on"]["kind"] == "edge"
    assert doc["offload"]["code"] == "queue_full"
    assert rig.agent.counters["not_run_returns"] == 1
    assert rig.agent.telemetry().finished == {"edge": 1}


# -- a new job's placement is asked for while the outbox commits it ---------------------------


@gated
async def test_the_estimate_sent_counts_the_jobs_still_being_admitted_ahead(
    rig: Rig, gate: GatedOutbox
) -> None:
    """A burst: three jobs arrive while none is on disk yet. Each will queue here (or leave)
    once accepted, so each later one's local estimate counts the earlier ones (10 s each,
    one slot), where it used to count only the queue and say 10 s for every job."""
    gate.holding = True
    for _ in range(3):
        rig.submit()
    await rig.broker.wait_for(lambda m: len(rig.requests) >= 3)
    assert [r.local_estimate_ms for r in rig.requests] == [10_000.0, 20_000.0, 30_000.0]
    gate.release()


@gated
async def test_a_placement_answered_during_the_commit_has_its_work_sent_at_once(
    rig: Rig, gate: GatedOutbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit is off the offloaded job's path: the request is still acked only once the
    job is on disk, and a return that beats the commit waits for it."""
    answers = Answers(rig.client, monkeypatch)
    gate.holding = True  # the acceptance commit does not reach the disk until released
    job_id = rig.submit(via_broker=True)
    await answers.wait(1)
    assert isinstance(answers.got[0], Placement)  # asked and answered ...
    (work,) = await rig.work(1)  # ... and the image is on its way ...
    assert gate.staged  # ... while the commit is still to come
    assert work.user_property(topics.PROP_ATTEMPT) == "1"
    submit = topics.edge_submit(EDGE)
    assert [m.topic for m in rig.edge.unacked] == [submit]  # not accepted yet
    sent = rig.give_back(job_id, 1)  # the worker answers before the commit lands
    returns = topics.edge_returns(EDGE, WORKER)
    await rig.broker.wait_for(lambda m: m.topic == returns, 10)
    # The return is held, unacked.
    assert sorted(m.topic for m in rig.edge.unacked) == sorted([submit, returns])
    assert [m for m in rig.broker.log if m.topic == "app/results"] == []
    gate.release()
    (result,) = await rig.results(1)
    assert result.payload == sent
    assert len(rig.requests) == 1  # the answer asked for at admission was used
    assert rig.sent() == [job_id]  # and its work sent once
    assert rig.agent.offloaded == 1
    assert rig.agent.counters["sent_before_commit"] == 1
    await rig.concluded(job_id)
    assert rig.agent.unfinished == 0


@gated
async def test_a_return_whose_attempt_is_on_disk_reaches_the_app_before_its_commit(
    rig: Rig, gate: GatedOutbox
) -> None:
    job_id = rig.submit()
    await rig.work(1)
    stored = await rig.on_disk(job_id, 1)
    assert (stored.state, stored.attempt) == ("offloaded", 1)
    gate.holding = True  # the result's commit waits ...
    sent = rig.give_back(job_id, 1)
    (result,) = await rig.results(1)  # ... and the app has the result already
    assert result.payload == sent
    returns = topics.edge_returns(EDGE, WORKER)
    assert [m.topic for m in rig.edge.unacked] == [returns]  # acked only once committed
    assert gate.staged
    gate.release()
    await rig.concluded(job_id)
    assert rig.agent.unfinished == 0


@gated
async def test_a_return_whose_attempt_is_not_on_disk_yet_waits_for_its_commit(
    rig: Rig, gate: GatedOutbox
) -> None:
    """Forwarding before the commit is safe only once the attempt is recorded: until then a
    crash would have the job placed afresh, and its new result could differ."""
    gate.holding = True
    job_id = rig.submit()
    await rig.asked(job_id)
    gate.release()  # the acceptance lands, and the work goes ...
    gate.holding = True  # ... but the attempt's record waits
    await rig.work(1)
    sent = rig.give_back(job_id, 1)
    returns = topics.edge_returns(EDGE, WORKER)
    await until(lambda: any(m.topic == returns for m in rig.edge.unacked))
    assert [m.topic for m in rig.edge.unacked] == [returns]  # held, unacked
    assert not [m for m in rig.broker.log if m.topic == "app/results"]
    gate.release()
    (result,) = await rig.results(1)
    assert result.payload == sent
    await rig.concluded(job_id)


@gated
@answered_by_hand
async def test_a_placement_answered_after_the_commit_is_taken_then(
    rig: Rig, gate: GatedOutbox
) -> None:
    gate.holding = True
    job_id = rig.submit(via_broker=True)
    request = await rig.asked(job_id)
    gate.release()
    stored = await gate.get(job_id)  # the outbox answers in order: the job is accepted
    assert stored is not None
    assert (stored.state, stored.attempt) == ("queued", 0)
    assert rig.edge.unacked == []
    rig.answer(request)
    (work,) = await rig.work(1)
    assert work.user_property(topics.PROP_ATTEMPT) == "1"
    assert [r.job_id for r in rig.requests] == [job_id]
    rig.give_back(job_id, 1)
    await rig.results(1)
    await rig.agent.drained(10)  # forwarded before its commit: the job ends with the commit
    assert rig.agent.unfinished == 0


@gated
@answered_by_hand
@pytest.mark.parametrize("answered_first", [True, False], ids=["answered", "unanswered"])
async def test_a_failed_commit_drops_the_early_placement(
    rig: Rig, gate: GatedOutbox, monkeypatch: pytest.MonkeyPatch, answered_first: bool
) -> None:
    answers = Answers(rig.client, monkeypatch)
    gate.holding = True
    job_id = rig.submit(via_broker=True)
    request = await rig.asked(job_id)
    if answered_first:
        rig.answer(request)
        await answers.wait(1)
    broken = OutboxError("outbox :memory: cannot be written (disk I/O error); check free space")
    gate.release(fail=broken)
    (result,) = await rig.results(1)
    doc = json.loads(result.payload)
    assert (doc["status"], doc["code"]) == ("rejected", "outbox_unavailable")
    assert "disk I/O error" in doc["reason"]
    assert rig.edge.unacked == []  # answered, so acked; never accepted
    if not answered_first:
        rig.answer(request)  # too late: nobody waits for it any more
    barrier = rig.submit()
    rig.answer(await rig.asked(barrier))
    await rig.work(1 + answered_first)
    assert [r.job_id for r in rig.requests] == [job_id, barrier]
    assert len(answers.got) == 1 + answered_first  # an unanswered one was given up
    assert rig.agent.counters["outbox_errors"] == 1
    assert await gate.get(job_id) is None
    if answered_first:
        # Its work went out during the commit: the worker keeps its slot until it is done,
        # and what it returns finds no job to take.
        assert rig.sent() == [job_id, barrier]
        rig.give_back(job_id, 1)
        rig.give_back(barrier, 1)  # returns are handled in order: this one comes after
        _refusal, done = await rig.results(2)
        assert json.loads(done.payload)["job_id"] == barrier
        await rig.stored_when(barrier, lambda stored: not stored.pending)  # acked once stored
        assert rig.agent.counters["fenced_returns"] == 1
        assert rig.edge.unacked == []
        assert [m for m in rig.broker.log if m.topic == topics.placement_release(EDGE)] == []
        return
    assert rig.sent() == [barrier]  # the failed job's image never left
    # Its placement, answered after the failure, goes back to the broker.
    (released,) = await rig.released(1)
    assert (released.job_id, released.worker_id, released.attempt) == (job_id, WORKER, 1)
    assert "after the edge stopped waiting" in released.reason


@gated
@answered_by_hand
async def test_an_answer_to_an_abandoned_request_is_not_taken_for_a_later_one(
    rig: Rig, gate: GatedOutbox
) -> None:
    gate.holding = True
    job_id = rig.submit(via_broker=True)
    abandoned = await rig.asked(job_id)
    gate.release(fail=OutboxError("outbox :memory: cannot be written (disk I/O error)"))
    (refusal,) = await rig.results(1)  # rejected: the app tries again, the disk is back
    assert json.loads(refusal.payload)["code"] == "outbox_unavailable"
    rig.submit(job_id=job_id, via_broker=True)
    again = await rig.asked(job_id, besides=abandoned)
    assert again.correlation_data != abandoned.correlation_data
    rig.answer(abandoned)  # late, for the request given up: handed back, not taken
    rig.answer(again)
    (work,) = await rig.work(1)
    (released,) = await rig.released(1)
    assert (released.job_id, released.attempt) == (job_id, 1)
    replies = [m for m in rig.broker.log if m.topic == rig.client.reply_topic]
    tokens = {
        m.correlation_data: PlacementReply.model_validate_json(m.payload).token for m in replies
    }
    assert work.user_property(topics.PROP_TOKEN) == tokens[again.correlation_data]


async def test_a_repeat_is_not_offered_and_its_image_is_not_sent_again(rig: Rig) -> None:
    job_id = rig.submit(via_broker=True)
    await rig.work(1)
    rig.submit(job_id=job_id, via_broker=True)  # while it is offloaded: known, not asked
    sent = rig.give_back(job_id, 1)
    await rig.results(1)
    rig.submit(job_id=job_id, via_broker=True)  # concluded lately: still known, not asked
    again = (await rig.results(2))[1]
    assert again.payload == sent  # answered from the outbox, not run again
    barrier = rig.submit()
    await rig.work(2)
    await rig.on_disk(barrier, 1)  # its work may go out before it is accepted
    assert rig.sent() == [job_id, barrier]
    assert [r.job_id for r in rig.requests] == [job_id, barrier]
    assert rig.agent.counters["duplicates"] == 2
    assert rig.agent.counters["accepted"] == 2
    assert rig.edge.unacked == []
    assert [m for m in rig.broker.log if m.topic == topics.placement_release(EDGE)] == []


@gated
async def test_a_repeat_of_a_forgotten_job_answered_during_its_commit_is_not_run_twice(
    rig: Rig, gate: GatedOutbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job concluded long ago is known only to the outbox: its repeat is asked for like
    a new job, and the placement may come (and its work go) before the outbox says it
    knows the job. The app still gets the one stored result; the worker's is dropped."""
    monkeypatch.setattr(jobs_module, "RECENT_KEPT", 0)
    job_id = rig.submit(via_broker=True)
    await rig.work(1)
    sent = rig.give_back(job_id, 1)
    await rig.results(1)
    await rig.stored_when(job_id, lambda stored: stored.state == "delivered")
    gate.holding = True
    rig.submit(job_id=job_id, via_broker=True)
    await rig.work(2)  # answered, and sent, while the outbox still looks the job up
    assert rig.sent() == [job_id, job_id]
    gate.release()
    again = (await rig.results(2))[1]
    assert again.payload == sent  # the stored result
    rig.give_back(job_id, 1, pool_result(job_id, status="failed"))  # the second run's
    barrier = rig.submit()
    await rig.work(3)
    rig.give_back(barrier, 1)
    results = await rig.results(3)
    assert json.loads(results[2].payload)["job_id"] == barrier
    await rig.stored_when(barrier, lambda stored: not stored.pending)  # acked once stored
    assert [m.payload for m in results[:2]] == [sent, sent]  # never the second run's
    assert rig.agent.counters["fenced_returns"] == 1
    assert rig.agent.counters["duplicates"] == 1
    assert rig.edge.unacked == []
    assert [m for m in rig.broker.log if m.topic == topics.placement_release(EDGE)] == []


async def test_a_redelivered_request_is_offered_only_once_it_proves_new(rig: Rig) -> None:
    job_id = rig.submit(via_broker=True)
    await rig.work(1)
    rig.give_back(job_id, 1)
    await rig.results(1)
    rig.submit(job_id=job_id, dup=True)  # delivered again after a crash: concluded long ago
    fresh = rig.submit(dup=True)  # delivered before a crash that beat its commit: new
    await rig.work(2)
    assert rig.sent() == [job_id, fresh]
    assert [r.job_id for r in rig.requests] == [job_id, fresh]  # the concluded one: never
    assert rig.agent.counters["redelivered"] == 1
    assert rig.agent.counters["accepted"] == 2
