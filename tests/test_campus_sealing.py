"""Sealed images on a running, secured campus (real broker, edges and workers as processes,
real Mosquitto and Redis): wafer images are confidential, so every one offloaded travels
sealed to the chosen worker's key. A wiretap (an identity the ACL was widened to let read
the work topics) sees only ciphertext; the right worker serves the jobs; the same message
sent to another worker, or a fresh token put on another job's ciphertext, is refused and
audited; and a key rotation in the middle of a burst loses no job.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis as redis_sync

from center_pool.seal_keys import KeyFolder, folder_of
from policies import mint, parse_policy, payload_digest, signed_envelope, verify
from policies.errors import SealOpenFailed
from policies.redis_stores import RedisStreamAuditStore, audit_stream_key
from policies.sealing import open_sealed, seal
from policies.signing import add_signature, sign_policy
from policies.tokens import peek
from sluicegate import AsyncClient, topics, wire
from sluicegate.app.broker_http import get
from sluicegate.app.campus import APP_OF_LINE, APPS, WORKERS, Campus
from sluicegate.app.localcampus import LocalCampus
from sluicegate.mqtt import MqttTransport
from sluicegate.transport import Message
from sluicegate.wire_pool import WorkerCapabilities
from tests.image_bytes import sample_jpeg
from tests.policies.policy_testkit import key
from tests.secure_kit import TlsClient, issue_identity
from tests.support import local_campus, until, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WIRETAP = "wiretap"  # a widened ACL lets it read every work topic
DESK = "officer-desk"  # publishes the officers' signed policy (retained)
# Writes work topics by hand, as the edge they name (a widened ACL: never a real edge's own
# identity, whose one session the running edge holds).
INTRUDER = "intruder"
NORTH, CLOUD = "north-cpu-1", "cloud-cpu-1"
EDGE = "line-1-pc"
IMAGE = sample_jpeg(5)[0]


class Tap:
    """Every work message and capabilities document Mosquitto delivers to the wiretap."""

    def __init__(self, lc: LocalCampus) -> None:
        self.transport = MqttTransport(lc.write().mqtt(WIRETAP), client_id=WIRETAP)
        self.work: list[Message] = []
        self.caps: dict[str, WorkerCapabilities] = {}
        self.lock = threading.Lock()

    def on_work(self, msg: Message) -> None:
        with self.lock:
            self.work.append(msg)

    def on_caps(self, msg: Message) -> None:
        caps = WorkerCapabilities.model_validate_json(msg.payload)
        with self.lock:
            self.caps[caps.worker_id] = caps

    def sealed_for(self, worker: str) -> list[Message]:
        with self.lock:
            return [m for m in self.work if f"/{worker}/" in m.topic]


@pytest.fixture(scope="module")
def campus(
    tmp_path_factory: pytest.TempPathFactory, fresh_redis_db: Callable[[], str]
) -> Iterator[LocalCampus]:
    with local_campus(tmp_path_factory.mktemp("sealed"), fresh_redis_db(), prepare=_taps) as lc:
        wait_until(lambda: _fleet(lc).get(NORTH, {}).get("online"), timeout=30)  # placeable
        yield lc


def _taps(files: Campus) -> None:
    """The wiretap, the policy desk and the intruder: identities, and ACL lines a
    misconfigured campus might have."""
    for name in (WIRETAP, DESK, INTRUDER):
        issue_identity(files, name)
    with files.acl_file.open("a") as acl:
        acl.write(f"user {WIRETAP}\n")
        for worker, (zone, _) in WORKERS.items():
            acl.write(f"topic read {topics.pool_work_all(zone, worker)}\n")
        acl.write(f"topic read {topics.worker_capabilities('+')}\n\n")
        acl.write(f"user {DESK}\ntopic write {topics.policy()}\n\n")
        acl.write(f"user {INTRUDER}\ntopic read {topics.edge_returns(EDGE, '+')}\n")
        for worker, (zone, _) in WORKERS.items():
            acl.write(f"topic write {topics.pool_work_all(zone, worker)}\n")


async def _tapped(lc: LocalCampus, n: int, tap: Tap | None = None) -> list[wire.JobResult]:
    """A volley of ``n`` wafer jobs on line 1 (more than it runs in time: the rest go to
    the pool), with the wiretap listening when given."""
    if tap is not None:
        await tap.transport.connect(timeout=10)
        for worker, (zone, _) in WORKERS.items():
            await tap.transport.subscribe(topics.pool_work_all(zone, worker), tap.on_work, qos=1)
        await tap.transport.subscribe(topics.worker_capabilities("+"), tap.on_caps, qos=1)
    app = APP_OF_LINE[EDGE]
    reply_to = f"{APPS[app][1]}/{uuid.uuid4().hex[:6]}"
    try:
        async with AsyncClient(lc.write().mqtt(app), edge=EDGE, response_topic=reply_to) as c:
            results = await asyncio.gather(
                *(
                    c.infer(IMAGE, model="defect-v1", deadline_ms=3000, data_class="wafer-image")
                    for _ in range(n)
                )
            )
            assert c.duplicates == 0
            assert c.unmatched == 0
            return list(results)
    finally:
        if tap is not None:
            await tap.transport.close()


def _fleet(lc: LocalCampus) -> dict[str, Any]:
    """The broker's view of the workers (GET /fleet), by id."""
    status, body = get(f"http://127.0.0.1:{lc.http_port}/fleet", lc.write().console_token("viewer"))
    assert status == 200, body[:300]
    return {w["id"]: w for w in json.loads(body)["workers"]}


def _worker_audit(lc: LocalCampus, worker: str, kind: str) -> list[dict[str, Any]]:
    client = redis_sync.Redis.from_url(lc.redis_url)
    try:
        records = [
            json.loads(raw)
            for raw in RedisStreamAuditStore(client, audit_stream_key(worker)).entries()
        ]
    finally:
        client.close()
    return [r["data"] for r in records if r["kind"] == kind]


def _refused(lc: LocalCampus, worker: str, job_id: str) -> dict[str, Any] | None:
    for data in _worker_audit(lc, worker, "work.refused"):
        if data.get("job_id") == job_id:
            return data
    return None


@pytest.fixture(scope="module")
def captured(campus: LocalCampus) -> list[Message]:
    """The sealed work messages of one volley, as the wiretap got them."""
    tap = Tap(campus)
    results = asyncio.run(_tapped(campus, 16, tap))
    assert [r.status for r in results] == ["ok"] * len(results), [r.reason for r in results]
    on_pool = [r for r in results if r.ran_on.kind == "pool"]
    assert on_pool, [r.offload for r in results]  # the burst went to the pool...
    assert {r.ran_on.node for r in on_pool} == {NORTH}  # ...the only campus worker, which served it
    sealed = tap.sealed_for(NORTH)
    assert len(sealed) >= len(on_pool)
    return sealed


def test_a_wiretap_on_the_work_topic_gets_only_ciphertext(captured: list[Message]) -> None:
    for msg in captured:
        props = dict(msg.user_properties)
        assert IMAGE not in msg.payload
        assert IMAGE[:64] not in msg.payload  # not even the JPEG header and tables
        assert msg.content_type == topics.SEALED_CONTENT_TYPE
        assert props[topics.PROP_SEALED] == topics.SEAL_SUITE
        assert props[topics.PROP_INNER_CONTENT_TYPE] == "image/jpeg"
        assert len(msg.payload) == len(IMAGE) + 48  # the encapsulated key and the tag


def _policy(lc: LocalCampus) -> Any:
    return parse_policy(lc.write().policy_file.read_bytes(), source="campus")


def _props(msg: Message, **changed: str) -> list[tuple[str, str]]:
    """The captured message's properties, changed as given, without its deadline (long
    past by now)."""
    props = dict(msg.user_properties)
    props.pop(topics.PROP_DEADLINE_AT, None)
    props.update(changed)
    return list(props.items())


def test_the_same_message_sent_to_another_worker_cannot_be_opened_and_is_refused(
    campus: LocalCampus, captured: list[Message]
) -> None:
    msg = captured[0]
    props = dict(msg.user_properties)
    policy = _policy(campus)
    claims = verify(
        props[topics.PROP_TOKEN],
        policy,
        now=time.time() - 1,
        job_id=props[topics.PROP_JOB_ID],
        payload_sha256=None,
    )
    (other,) = KeyFolder(folder_of(campus.root / "state" / CLOUD)).load()
    with pytest.raises(SealOpenFailed):  # the other worker's key cannot open it
        open_sealed(other.key, msg.payload, claims.seal_info())
    job_id = f"moved-{uuid.uuid4().hex[:8]}"
    intruder = TlsClient(campus.write(), INTRUDER)
    try:
        cloud_zone = WORKERS[CLOUD][0]
        topic = topics.pool_work(cloud_zone, CLOUD, EDGE)
        reply = topics.edge_returns(EDGE, CLOUD)
        code = intruder.publish(
            topic,
            msg.payload,
            response_topic=reply,
            user=_props(msg, **{topics.PROP_JOB_ID: job_id}),
        )
        assert not code.is_failure
        refused = wait_until(lambda: _refused(campus, CLOUD, job_id), timeout=15)
    finally:
        intruder.close()
    assert refused["reason"].startswith(("token.", "seal."))  # never opened, never run


def test_a_fresh_token_on_another_jobs_ciphertext_fails_to_open_and_the_right_one_serves(
    campus: LocalCampus, captured: list[Message]
) -> None:
    policy = _policy(campus)
    (held,) = KeyFolder(folder_of(campus.root / "state" / NORTH)).load()
    assert policy.seal_key(NORTH, held.key_id) == held.key.public
    broker = key("broker-1")
    north_zone = WORKERS[NORTH][0]

    def token(job_id: str) -> str:
        return mint(
            policy,
            broker,
            job_id=job_id,
            payload_sha256=payload_digest(IMAGE),
            data_class="wafer-image",
            origin_zone="campus/fab-north/line-1",
            target_worker=NORTH,
            now=time.time(),
            seal_key_id=held.key_id,
        )

    moved, right = f"moved-{uuid.uuid4().hex[:8]}", f"right-{uuid.uuid4().hex[:8]}"
    moved_token, right_token = token(moved), token(right)
    claims = verify(right_token, policy, now=time.time(), job_id=right, payload_sha256=None)
    intruder = TlsClient(campus.write(), INTRUDER)
    try:
        intruder.subscribe(topics.edge_returns(EDGE, NORTH))
        topic = topics.pool_work(north_zone, NORTH, EDGE)
        reply = topics.edge_returns(EDGE, NORTH)
        theirs = captured[-1]
        intruder.publish(
            topic,
            theirs.payload,
            response_topic=reply,
            user=_props(theirs, **{topics.PROP_JOB_ID: moved, topics.PROP_TOKEN: moved_token}),
        )
        refused = wait_until(lambda: _refused(campus, NORTH, moved), timeout=15)
        assert refused["reason"] == "seal.open_failed"
        box = seal(held.key.public, IMAGE, claims.seal_info())
        intruder.publish(
            topic,
            box,
            response_topic=reply,
            user=_props(theirs, **{topics.PROP_JOB_ID: right, topics.PROP_TOKEN: right_token}),
        )

        def served() -> dict[str, Any] | None:
            got = json.loads(intruder.get(timeout=10).payload)
            return got if got.get("job_id") == right else None

        result = wait_until(served, timeout=20)
    finally:
        intruder.close()
    assert result["status"] == "ok", result


def test_a_key_rotation_in_the_middle_of_a_burst_loses_no_job(
    campus: LocalCampus, captured: list[Message]
) -> None:
    files = campus.write()
    old = KeyFolder(folder_of(campus.root / "state" / NORTH)).load()[0]
    new = KeyFolder(folder_of(campus.root / "state" / NORTH)).create(time.time())  # 'seal-key new'
    text = files.policy_file.read_text().replace("version = 1\n", "version = 2\n", 1)
    text = text.replace(
        f'{NORTH} = ["{old.key.public_text}"]',
        f'{NORTH} = ["{old.key.public_text}", "{new.key.public_text}"]',
    )
    policy = parse_policy(text.encode(), source="v2")
    assert policy.seal_key(NORTH, new.key_id) == new.key.public
    envelope = signed_envelope(
        policy, add_signature(None, policy, sign_policy(policy, key("officer"), "officer"))
    )
    tap = Tap(campus)

    async def burst() -> list[wire.JobResult]:
        volley = asyncio.ensure_future(_tapped(campus, 40, tap))
        await until(lambda: tap.sealed_for(NORTH) or volley.done(), timeout=30)
        assert not volley.done(), [r.offload for r in volley.result()]  # mid-burst
        desk = TlsClient(files, DESK)
        try:
            assert not desk.publish(topics.policy(), envelope, retain=True).is_failure
        finally:
            desk.close()
        return await volley

    results = asyncio.run(burst())
    assert len(results) == 40
    assert [r.status for r in results] == ["ok"] * 40, [r.reason for r in results]
    rotated = wait_until(
        lambda: _worker_audit(campus, NORTH, "worker.seal_key_rotated"), timeout=15
    )
    assert rotated[-1]["key_id"] == new.key_id.hex()
    assert rotated[-1]["previous"] == old.key_id.hex()
    later = Tap(campus)
    ran_on_north = False
    for _ in range(5):  # a volley overflows to north once the broker places there again
        after = asyncio.run(_tapped(campus, 16, later))
        assert [r.status for r in after] == ["ok"] * 16, [r.reason for r in after]
        ran_on_north = any(r.ran_on.node == NORTH for r in after)
        if ran_on_north:
            break
    assert ran_on_north
    assert later.caps[NORTH].seal_key == new.key.public_text  # advertised, retained
    bound = {
        peek(dict(m.user_properties)[topics.PROP_TOKEN]).seal_key_id
        for m in later.sealed_for(NORTH)
    }
    assert bound == {new.key_id}  # what is placed now is sealed to the new key
