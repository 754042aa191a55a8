"""In-memory tier: the pool worker's shell over the in-memory transport, with the real model.

Covers what is awkward to force over a real broker: no policy yet, a replay cache that is
down, a deadline that passes while the job waits, a full queue, the batch sizes a burst
makes, and what a shutdown still answers.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from center_pool.guard import AuditSink, MemoryAsyncReplayCache, MemoryAuditStore
from center_pool.hardware import HostProbe
from center_pool.worker import PoolWorker
from policies import AsyncAuditWriter, Policy, SigningKey, verify_chain
from policies.audit import decode_record
from policies.redis_stores import AsyncRedisReplayCache
from policies.replay import AsyncReplayCache
from sluicegate import topics
from sluicegate.app.servers import free_port
from sluicegate.config import PoolSettings
from sluicegate.memory_transport import MemoryBroker, MemoryTransport
from sluicegate.policy_feed import PolicyFeed
from sluicegate.transport import Message
from sluicegate.vision.runtime import LoadedModel, ModelRegistry, default_models_dir
from tests.pool_kit import (
    EDGE,
    JPEG,
    POLICY,
    TRUTH,
    WORKER,
    WORKER_ZONE,
    WorkSpec,
    envelope,
    flip_bit,
    pin,
    token,
)

REGISTRY = ModelRegistry.from_dir(default_models_dir())
# Results go back to the edge that sent the job, under this worker's id; completions to the
# broker under it too.
RESULTS = topics.edge_returns(EDGE, WORKER)
COMPLETIONS = topics.completion(WORKER)


class GatedModel(LoadedModel):
    """The real model, but each preprocessing waits until the test opens the gate."""

    def __init__(self, real: LoadedModel) -> None:
        super().__init__(real.manifest, real.session)
        self.gate = threading.Event()

    def prepare(self, data: bytes, **kw: Any) -> Any:
        assert self.gate.wait(10)
        return super().prepare(data, **kw)


@dataclass
class Harness:
    broker: MemoryBroker
    worker: PoolWorker
    store: MemoryAuditStore
    key: SigningKey
    stop: asyncio.Event
    runner: asyncio.Future[None]

    def send(self, spec: WorkSpec) -> Message:
        msg = spec.message()
        self.worker.on_message(msg)
        return msg

    def results(self) -> list[dict[str, Any]]:
        return [json.loads(m.payload) for m in self.broker.log if m.topic == RESULTS]

    def completions(self) -> list[dict[str, Any]]:
        return [json.loads(m.payload) for m in self.broker.log if m.topic == COMPLETIONS]

    async def returned(self, msg: Message, to: str = RESULTS) -> Message:
        """The message that returned ``msg``'s result to its edge (on ``to``)."""
        return await self.broker.wait_for(
            lambda m: m.topic == to and m.correlation_data == msg.correlation_data
        )

    async def result_for(self, msg: Message, to: str = RESULTS) -> dict[str, Any]:
        result: dict[str, Any] = json.loads((await self.returned(msg, to)).payload)
        return result

    async def close(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.runner, 30)


async def start(
    state_dir: Path,
    *,
    policy: bool = True,
    replay: AsyncReplayCache | None = None,
    registry: ModelRegistry = REGISTRY,
    models_dir: Path | None = None,
    published: Policy = POLICY,
    **pool: Any,
) -> Harness:
    """A worker on an in-memory broker; with ``policy`` the broker holds ``published``
    (signed by the test officers, whom the worker's pinned anchor trusts)."""
    broker = MemoryBroker()
    if policy:
        MemoryTransport(broker).publish_nowait(
            Message(topics.policy(), envelope(published), qos=1, retain=True)
        )
    settings = PoolSettings(id=WORKER, zone=WORKER_ZONE, telemetry_interval_s=0.05, **pool)
    store, key = MemoryAuditStore(), SigningKey.generate()
    feed = PolicyFeed(node=WORKER, state_dir=pin(state_dir))
    feed.load()
    worker = PoolWorker(
        settings,
        MemoryTransport(broker),
        registry,
        feed=feed,
        replay=replay or MemoryAsyncReplayCache(),
        audit=AuditSink(AsyncAuditWriter(store, key)),
        probe=HostProbe(),
        providers=["CPUExecutionProvider"],
        models_dir=models_dir,
    )
    stop = asyncio.Event()
    runner = asyncio.ensure_future(worker.run(stop, policy_wait=0.2))
    await asyncio.wait_for(worker.ready.wait(), 10)
    return Harness(broker, worker, store, key, stop, runner)


@pytest_asyncio.fixture
async def pool(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = await start(tmp_path)
    yield harness
    await harness.close()


async def test_good_job_result_completion_capabilities_and_status(pool: Harness) -> None:
    msg = pool.send(WorkSpec(correlation=b"corr-1"))
    result = await pool.result_for(msg)
    assert result["status"] == "ok", result
    assert result["outputs"]["label"] == TRUTH
    assert result["ran_on"] == {"kind": "pool", "node": WORKER, "zone": WORKER_ZONE}
    assert result["offload"] == {"requested": True, "placed": True, "worker": WORKER}
    assert result["timings_ms"]["inference_ms"] > 0
    done = await pool.broker.wait_for(lambda m: m.topic == COMPLETIONS)
    record = json.loads(done.payload)
    assert (record["status"], record["worker_id"], record["batch_size"]) == ("ok", WORKER, 1)
    caps = json.loads(pool.broker.retained[topics.worker_capabilities(WORKER)].payload)
    assert caps["models"]["defect-v1"]["providers"] == ["CPUExecutionProvider"]
    assert (caps["zone"], caps["device_class"], caps["max_batch"]) == (WORKER_ZONE, "x86-cpu", 8)
    status = json.loads(pool.broker.retained[topics.worker_status(WORKER)].payload)
    assert (status["kind"], status["state"]) == ("pool", "online")


async def test_results_return_to_the_edge_with_job_attempt_and_worker(pool: Harness) -> None:
    msg = pool.send(WorkSpec(job_id="job-a3", attempt="3", correlation=b"\x00app\xff"))
    back = await pool.returned(msg)
    assert back.qos == 1
    assert back.correlation_data == b"\x00app\xff"  # the app's, unchanged
    assert dict(back.user_properties) == {
        topics.PROP_JOB_ID: "job-a3",
        topics.PROP_ATTEMPT: "3",
        topics.PROP_WORKER: WORKER,
    }
    assert json.loads(back.payload)["status"] == "ok"
    done = await pool.broker.wait_for(lambda m: m.topic == COMPLETIONS)
    record = json.loads(done.payload)
    assert (record["job_id"], record["attempt"], record["edge_id"]) == ("job-a3", 3, EDGE)
    # Nothing goes anywhere but the edge's returns topic and the broker's completions.
    sent = {m.topic for m in pool.broker.log if m.correlation_data == b"\x00app\xff"}
    assert sent == {RESULTS}


async def test_work_on_a_topic_naming_no_edge_is_refused_counted_and_audited(
    pool: Harness,
) -> None:
    pool.send(WorkSpec(job_id="lost-1", edge=""))
    refused = pool.send(WorkSpec(job_id="lost-2", edge="-bad"))
    # A refusal that can be returned proves the two before it were screened first.
    after = await pool.result_for(pool.send(WorkSpec(job_id="after", token="")))
    assert after["code"] == "token.missing"
    assert pool.worker.refused["no_edge_id"] == 2
    assert pool.worker.replies.unreturned == 2
    assert pool.worker.decode_attempts == 0
    assert not [m for m in pool.broker.log if m.correlation_data == refused.correlation_data]
    await pool.worker.audit.flush(5)
    audited = {
        str(decode_record(e).data["job_id"]): decode_record(e).data for e in pool.store.entries[1:]
    }
    assert audited["lost-1"]["reason"] == "no_edge_id"
    assert audited["lost-2"]["reason"] == "no_edge_id"
    assert "work/-bad'" in str(audited["lost-2"]["message"])


async def test_work_naming_another_edge_goes_back_refused_to_the_edge_that_sent_it(
    pool: Harness,
) -> None:
    forged = pool.send(WorkSpec(job_id="forged", edge_property="south-l1-pc"))
    result = await pool.result_for(forged)  # on this edge's returns, not south-l1-pc's
    assert (result["status"], result["code"]) == ("rejected", "edge.id_mismatch")
    assert result["offload"]["placed"] is False
    assert pool.worker.decode_attempts == 0
    assert pool.completions() == []  # never placed here: nothing for the broker
    named = topics.edge_inbox("south-l1-pc")
    assert not [m for m in pool.broker.log if topics.matches(named, m.topic)]
    await pool.worker.audit.flush(5)
    (record,) = [decode_record(e).data for e in pool.store.entries[1:]]
    assert (record["job_id"], record["reason"]) == ("forged", "edge.id_mismatch")


async def test_work_from_an_edge_the_policy_does_not_list_is_refused_unread(
    pool: Harness,
) -> None:
    ghost = pool.send(WorkSpec(job_id="ghost", edge="ghost-pc"))  # a valid token and all
    result = await pool.result_for(ghost, to=topics.edge_returns("ghost-pc", WORKER))
    assert (result["status"], result["code"]) == ("rejected", "edge.not_in_policy")
    assert "'ghost-pc'" in result["reason"]
    assert pool.worker.refused == {"edge.not_in_policy": 1}
    assert pool.worker.decode_attempts == 0
    assert pool.completions() == []
    await pool.worker.audit.flush(5)
    (record,) = [decode_record(e).data for e in pool.store.entries[1:]]
    assert (record["job_id"], record["reason"]) == ("ghost", "edge.not_in_policy")


async def test_refusals_are_answered_counted_audited_and_never_decoded(pool: Harness) -> None:
    not_an_image = b"not even an image"
    replayed = WorkSpec(job_id="twice")  # the same message, token and all, twice
    cases = {
        "token.missing": WorkSpec(token=""),
        "token.bad_signature": WorkSpec(
            job_id="flip", payload=not_an_image, token=flip_bit(token("flip", not_an_image))
        ),
        "token.wrong_target": WorkSpec(
            job_id="other", token=token("other", JPEG, worker="south-npu-1")
        ),
        "token.payload_mismatch": WorkSpec(
            job_id="swap", payload=not_an_image, token=token("swap", JPEG)
        ),
        "token.expired": WorkSpec(job_id="old", token=token("old", JPEG, now=time.time() - 60)),
    }
    first = pool.send(replayed)
    assert (await pool.result_for(first))["status"] == "ok"
    decoded = pool.worker.decode_attempts
    again = replace(first, correlation_data=b"same token again")
    pool.worker.on_message(again)
    got = {"token.replayed": await pool.result_for(again)}
    for code, spec in cases.items():
        got[code] = await pool.result_for(pool.send(spec))
    for code, result in got.items():
        assert (result["status"], result["code"]) == ("rejected", code), result
        assert WORKER in result["reason"]
        assert result["offload"]["placed"] is False
    assert pool.worker.decode_attempts == decoded
    assert dict(pool.worker.refused) == dict.fromkeys(got, 1)
    # Only the job that passed its token was reported to the broker.
    assert [c["job_id"] for c in pool.completions()] == ["twice"]
    ok = await pool.result_for(pool.send(WorkSpec()))
    assert ok["status"] == "ok"
    await pool.worker.audit.flush(5)
    summary = verify_chain(pool.store.entries, {pool.key.public})
    kinds = [decode_record(e).kind for e in pool.store.entries]
    assert kinds[0] == "policy.accepted"
    refused = [str(decode_record(e).data["reason"]) for e in pool.store.entries[1:]]
    assert sorted(refused) == sorted(got)
    assert summary.count == 1 + len(got)


async def test_post_token_rejections_reach_the_broker_but_not_the_audit_log(
    pool: Harness,
) -> None:
    bad = b"\x89PNG\r\n\x1a\n but nothing after the signature"
    expired = WorkSpec(deadline_at_ms=(time.time() - 1) * 1000)
    for spec, code in [
        (WorkSpec(model="defect-v9"), "unknown_model"),
        (WorkSpec(payload=bad, token=None, content_type=None), "bad_image"),
        (expired, "expired"),
    ]:
        result = await pool.result_for(pool.send(spec))
        assert result["code"] == code, result
        assert result["offload"]["placed"] is True
    assert [c["status"] for c in pool.completions()] == ["rejected", "rejected", "expired"]
    await pool.worker.audit.flush(5)
    assert len(pool.store.entries) == 1  # policy.accepted only


async def test_a_burst_of_same_model_jobs_runs_in_fewer_batches(pool: Harness) -> None:
    messages = [pool.send(WorkSpec()) for _ in range(16)]  # one intake pass
    results = [await pool.result_for(m) for m in messages]
    assert all(r["status"] == "ok" for r in results)
    sizes = [c["batch_size"] for c in pool.completions()]
    assert sum(pool.worker.batch_sizes.values()) < 16
    assert max(sizes) == 8
    assert pool.worker.batch_sizes == {8: 2}


async def test_without_a_policy_work_is_refused_until_one_arrives(tmp_path: Path) -> None:
    harness = await start(tmp_path, policy=False)
    try:
        refused = await harness.result_for(harness.send(WorkSpec()))
        assert refused["code"] == "policy.missing"
        assert "no verified policy" in refused["reason"]
        MemoryTransport(harness.broker).publish_nowait(
            Message(topics.policy(), envelope(), qos=1, retain=True)
        )
        await asyncio.sleep(0.01)
        assert (await harness.result_for(harness.send(WorkSpec())))["status"] == "ok"
    finally:
        await harness.close()


async def test_an_unreachable_replay_cache_fails_a_whole_pass_closed(tmp_path: Path) -> None:
    # One intake pass claims its nonces in one round trip: none of its jobs runs unchecked.
    down = redis.asyncio.Redis(port=free_port(), retry=Retry(NoBackoff(), 0))
    harness = await start(tmp_path, replay=AsyncRedisReplayCache(down))
    try:
        messages = [harness.send(WorkSpec()) for _ in range(4)]  # one intake pass
        results = [await harness.result_for(m) for m in messages]
        assert {r["code"] for r in results} == {"token.replay_unavailable"}
        assert all("Redis could not claim 4 token nonces" in r["reason"] for r in results)
        assert harness.worker.decode_attempts == 0
    finally:
        await harness.close()
        await down.aclose()


async def test_an_unreachable_replay_cache_fails_closed(tmp_path: Path) -> None:
    # The real Redis cache and client, pointed at a port where nothing listens.
    down = redis.asyncio.Redis(port=free_port(), retry=Retry(NoBackoff(), 0))
    harness = await start(tmp_path, replay=AsyncRedisReplayCache(down))
    try:
        result = await harness.result_for(harness.send(WorkSpec()))
        assert result["code"] == "token.replay_unavailable"
        assert "Redis could not claim a token nonce" in result["reason"]
        assert harness.worker.decode_attempts == 0
    finally:
        await harness.close()
        await down.aclose()


async def test_deadline_passing_in_the_queue_expires_and_a_full_queue_refuses(
    tmp_path: Path,
) -> None:
    gated = GatedModel(REGISTRY.get("defect-v1"))
    harness = await start(
        tmp_path,
        registry=ModelRegistry({"defect-v1": gated}),
        concurrency=1,
        max_batch=1,
        queue_size=1,
        batch_window_ms=0,
    )
    try:
        running = harness.send(WorkSpec())
        await asyncio.sleep(0.05)
        late = harness.send(WorkSpec(deadline_at_ms=(time.time() + 0.5) * 1000))
        await asyncio.sleep(0.05)
        full = await harness.result_for(harness.send(WorkSpec()))
        assert full["code"] == "queue_full"
        await asyncio.sleep(0.6)
        gated.gate.set()
        assert (await harness.result_for(running))["status"] == "ok"
        expired = await harness.result_for(late)
        assert (expired["status"], expired["code"]) == ("expired", "expired")
        assert harness.worker.decode_attempts == 1
    finally:
        gated.gate.set()
        await harness.close()


async def test_shutdown_answers_what_was_admitted_and_refuses_the_rest(tmp_path: Path) -> None:
    gated = GatedModel(REGISTRY.get("defect-v1"))
    harness = await start(
        tmp_path, registry=ModelRegistry({"defect-v1": gated}), concurrency=1, max_batch=2
    )
    queued = [harness.send(WorkSpec()) for _ in range(3)]
    await asyncio.sleep(0.05)
    harness.stop.set()
    await asyncio.sleep(0.01)
    late = harness.send(WorkSpec())
    gated.gate.set()
    await asyncio.wait_for(harness.runner, 30)
    assert [(await harness.result_for(m))["status"] for m in queued] == ["ok"] * 3
    assert (await harness.result_for(late))["code"] == "shutting_down"
    offline = json.loads(harness.broker.retained[topics.worker_status(WORKER)].payload)
    assert offline["state"] == "offline"


async def test_telemetry_reports_load_refusals_and_service_time(pool: Harness) -> None:
    await pool.result_for(pool.send(WorkSpec()))
    await pool.result_for(pool.send(WorkSpec(token="")))
    topic = topics.worker_telemetry(WORKER)

    def fresh(m: Message) -> bool:
        return m.topic == topic and b'"token.missing"' in m.payload

    doc = json.loads((await pool.broker.wait_for(fresh)).payload)
    assert doc["refused"] == {"token.missing": 1}
    assert doc["results"] == {"ok": 1, "rejected": 1}
    assert doc["models"]["defect-v1"]["completed"] == 1
    assert doc["models"]["defect-v1"]["service_ms"] > 0
    assert doc["capacity"] == 512 + 2 * 8
    assert 0 <= doc["utilisation"] <= 1
    assert doc["memory_total_mb"] > 0


@pytest.mark.parametrize("bad_id", ["", "a/b", "#"])
def test_worker_id_must_be_a_topic_level(bad_id: str) -> None:
    with pytest.raises(ValueError, match="invalid worker id"):
        PoolWorker(
            PoolSettings(id=bad_id),
            MemoryTransport(MemoryBroker()),
            REGISTRY,
            feed=PolicyFeed(node="x"),
            replay=MemoryAsyncReplayCache(),
            audit=AuditSink(AsyncAuditWriter(MemoryAuditStore(), SigningKey.generate())),
            probe=HostProbe(),
            providers=["CPUExecutionProvider"],
        )
