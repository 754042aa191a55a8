"""In-memory tier: an edge's job placed on a sister campus's worker (issue 39, part 4). Its
campus broker relays the peer broker's placement (the reply names the peer's campus); the
edge checks the token against the peer's keys and terms in its own policy, sends the image
across the bridge in an envelope on ``topics.peer_work`` (sealed to the peer worker's key
when its policy keeps the class confidential), and takes the peer worker's enveloped result
from ``topics.peer_returns`` like any return. Real crypto, the real model; the broker and
the peer's worker are scripted."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from edge_agent.agent import EdgeAgent
from edge_agent.offload import PlacementClient
from policies import Policy, mint
from policies.evaluate import peer_origin
from policies.sealing import SealingKey, open_sealed
from policies.tokens import peek
from sluicegate import topics, wire
from sluicegate.config import load_settings
from sluicegate.memory_transport import MemoryBroker, MemoryTransport
from sluicegate.transport import Message
from sluicegate.vision.runtime import ModelRegistry, default_models_dir
from sluicegate.wire_peer import unwrap, wrap
from sluicegate.wire_pool import PlacementRelease, PlacementReply, PlacementRequest
from tests.image_bytes import sample_jpeg
from tests.policies.policy_testkit import PARTS_TERMS, key, policy_of, site_doc

REGISTRY = ModelRegistry.from_dir(default_models_dir())
NORTH, SOUTH = "north-site", "south-site"
EDGE, ZONE = "north-l1-pc", "campus/fab-north/line-1"
PEER_WORKER, PEER_ZONE = "south-site-gpu-1", "campus/south-site/dc"
SEAL = SealingKey.from_seed(hashlib.sha256(b"south-site-gpu-1 seal").digest())
JPEG, TRUTH = sample_jpeg(21, "scratch")


def north(*, confidential: bool = False) -> Policy:
    doc = site_doc(NORTH, SOUTH, send=PARTS_TERMS, receive={})
    doc["classes"]["ocr-crop"]["confidential"] = confidential
    return policy_of(doc)


def south(signer: str = "south-site-broker-1") -> Policy:
    """South's policy, its brokers ``signer`` among them (north pins only the first)."""
    doc = site_doc(SOUTH, NORTH, send={}, receive=PARTS_TERMS)
    doc["pools"][f"{SOUTH}-dc"]["encryption_keys"] = {PEER_WORKER: [SEAL.public_text]}
    doc["broker_signers"]["keys"][signer] = key(signer).public_text
    return policy_of(doc)


Answer = Callable[[PlacementRequest], PlacementReply]


def south_places(*, sealed: bool = False, signer: str = "south-site-broker-1") -> Answer:
    """North's broker relaying what south's broker answered its ask: a placement on south's
    worker, signed by south's broker for origin ``peer:north-site``."""

    def answer(req: PlacementRequest) -> PlacementReply:
        token = mint(
            south(signer),
            key(signer),
            job_id=req.job_id,
            payload_sha256=bytes.fromhex(req.payload_sha256),
            data_class=req.data_class,
            origin_zone=peer_origin(NORTH),
            target_worker=PEER_WORKER,
            now=time.time(),
            seal_key_id=SEAL.key_id if sealed else bytes(8),
        )
        return PlacementReply(
            job_id=req.job_id,
            status="placed",
            token=token,
            worker_id=PEER_WORKER,
            worker_zone=PEER_ZONE,
            campus=SOUTH,
            seal_key=SEAL.public_text if sealed else None,
        )

    return answer


@dataclass
class Rig:
    broker: MemoryBroker
    agent: EdgeAgent
    side: MemoryTransport  # speaks for the broker, south's worker and the app
    policy: Policy

    def submit(self) -> str:
        job_id = uuid.uuid4().hex
        props = (
            (topics.PROP_MODEL, "defect-v1"),
            (topics.PROP_JOB_ID, job_id),
            (topics.PROP_DATA_CLASS, "ocr-crop"),
            (topics.PROP_DEADLINE_MS, "5000"),
        )
        msg = Message(
            topics.edge_submit(EDGE),
            JPEG,
            qos=1,
            response_topic="app/results",
            correlation_data=job_id.encode(),
            content_type="image/jpeg",
            user_properties=props,
        )
        self.agent.on_message(msg)
        return job_id

    async def result(self) -> dict[str, Any]:
        found = await self.broker.wait_for(lambda m: m.topic == "app/results", 10)
        return dict(json.loads(found.payload))


async def rig_with(policy: Policy, answer: Answer) -> AsyncIterator[Rig]:
    broker = MemoryBroker()
    side = MemoryTransport(broker)

    def on_request(msg: Message) -> None:
        req = PlacementRequest.model_validate_json(msg.payload)
        req = req.model_copy(update={"origin_zone": ZONE})
        reply = wire.dump(answer(req))
        side.publish_nowait(
            Message(topics.placement_replies(EDGE), reply, correlation_data=msg.correlation_data)
        )

    await side.subscribe(topics.placement_requests_all(), on_request)
    online = wire.NodeStatus(node="b1", kind="edge", zone="campus", state="online")
    side.publish_nowait(Message(topics.broker_status("b1"), wire.dump(online), retain=True))
    settings = load_settings(
        edge={"id": EDGE, "zone": ZONE, "concurrency": 1},
        offload={"placement_timeout_ms": 500.0, "result_timeout_s": 5.0},
    )
    transport = MemoryTransport(broker)
    client = PlacementClient(
        transport,
        edge_id=EDGE,
        zone=ZONE,
        policy=lambda: policy,
        timeout_s=0.5,
        clock=time.time,
    )
    agent = EdgeAgent(
        settings.edge, transport, REGISTRY, offload=client, offload_settings=settings.offload
    )
    agent.service_times.observe("defect-v1", 10.0)  # a 5 s deadline is missed here: offer
    await client.start()
    stop = asyncio.Event()
    runner = asyncio.ensure_future(agent.run(stop))
    await asyncio.wait_for(agent.ready.wait(), 10)
    await broker.wait_for(lambda m: m.topic == topics.broker_status("b1"))
    yield Rig(broker, agent, side, policy)
    stop.set()
    await asyncio.wait_for(runner, 30)


async def south_worker(rig: Rig, opened: list[bytes], key_to: SealingKey | None = None) -> None:
    """South's worker as its bridge delivers north's work: unwrapped, (opened,) answered in
    an envelope on south's returns topic to north's edge."""

    def on_work(msg: Message) -> None:
        work = unwrap(msg)
        job_id = work.user_property(topics.PROP_JOB_ID) or ""
        payload = work.payload
        if key_to is not None:
            token = work.user_property(topics.PROP_TOKEN) or ""
            payload = open_sealed(key_to, payload, peek(token).seal_info())
        opened.append(payload)
        result = wire.JobResult(
            job_id=job_id,
            status="ok",
            model="defect-v1",
            outputs=wire.Outputs(label="scratch", scores={"scratch": 0.9}),
            ran_on=wire.RanOn(kind="pool", node=PEER_WORKER, zone=PEER_ZONE),
            offload=wire.Offload(requested=True, placed=True, worker=PEER_WORKER),
        )
        back = Message(
            topics.peer_returns(SOUTH, NORTH, EDGE, PEER_WORKER),
            wire.dump(result),
            qos=1,
            correlation_data=work.correlation_data,
            user_properties=(
                (topics.PROP_JOB_ID, job_id),
                (topics.PROP_ATTEMPT, work.user_property(topics.PROP_ATTEMPT) or "1"),
                (topics.PROP_WORKER, PEER_WORKER),
            ),
        )
        rig.side.publish_nowait(wrap(back))

    await rig.side.subscribe(topics.peer_work(NORTH, SOUTH, PEER_WORKER, "+"), on_work)


@pytest.fixture
async def rig(request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    policy, answer = getattr(request, "param", (north(), south_places()))
    async for made in rig_with(policy, answer):
        yield made


async def test_a_job_placed_on_a_sister_campus_crosses_and_its_result_comes_back(
    rig: Rig,
) -> None:
    opened: list[bytes] = []
    await south_worker(rig, opened)
    job_id = rig.submit()
    result = await rig.result()
    assert result["status"] == "ok", result
    assert result["ran_on"] == {"kind": "pool", "node": PEER_WORKER, "zone": PEER_ZONE}
    assert opened == [JPEG]
    crossed = [m for m in rig.broker.log if m.topic.startswith(f"{topics.ROOT}/peer/")]
    work = unwrap(next(m for m in crossed if "/work/" in m.topic))
    # On the bridge: no MQTT property, everything in the envelope.
    assert all(not m.user_properties and m.response_topic is None for m in crossed)
    assert work.user_property(topics.PROP_JOB_ID) == job_id
    assert work.user_property(topics.PROP_EDGE) == EDGE
    assert not [m for m in rig.broker.log if "/pool/" in m.topic]  # nothing to our workers
    assert rig.agent.offloaded == 1


@pytest.mark.parametrize(
    "rig", [(north(confidential=True), south_places(sealed=True))], indirect=True
)
async def test_a_class_kept_confidential_crosses_only_sealed_to_the_peer_worker(
    rig: Rig,
) -> None:
    opened: list[bytes] = []
    await south_worker(rig, opened, key_to=SEAL)
    rig.submit()
    assert (await rig.result())["status"] == "ok"
    assert opened == [JPEG]  # south's worker, and only it, opens it
    crossed = [m for m in rig.broker.log if "/work/" in m.topic]
    assert len(crossed) == 1
    assert JPEG[100:164] not in crossed[0].payload  # ciphertext on the bridge
    work = unwrap(crossed[0])
    assert work.content_type == topics.SEALED_CONTENT_TYPE
    assert work.user_property(topics.PROP_SEALED) == topics.SEAL_SUITE


@pytest.mark.parametrize(
    ("rig", "code"),
    [
        # a replica south added after north's officers signed: north does not trust it yet
        ((north(), south_places(signer="south-site-broker-9")), "token.untrusted_signer"),
        ((north(confidential=True), south_places()), "token.not_sealed"),
    ],
    indirect=["rig"],
)
async def test_a_peer_placement_the_edge_does_not_trust_runs_here_and_says_why(
    rig: Rig, code: str
) -> None:
    rig.submit()
    result = await rig.result()
    assert result["ran_on"]["kind"] == "edge"
    assert result["offload"]["placed"] is False
    assert result["offload"]["code"] == code
    assert not [m for m in rig.broker.log if "/peer/" in m.topic]  # nothing crossed
    # The placement is handed back to our broker, which hands it back across.
    (release,) = [m for m in rig.broker.log if m.topic == topics.placement_release(EDGE)]
    handed = PlacementRelease.model_validate_json(release.payload)
    assert topics.campus_of(handed.worker_id) == "south-site"
    assert handed.edge_id == EDGE
