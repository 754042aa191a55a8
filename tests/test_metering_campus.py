"""Real tier, whole campus (broker, one line PC, one campus worker as processes, on real
Mosquitto with TLS and the generated ACL, and Redis): the usage records of offloaded jobs
reach the broker, one per attempt that ran, countersigned; a worker restarted with records
the broker never acknowledged sends them again and the broker keeps one copy of each; a
record altered, forged or sent under another node's name is refused and never stored; the
export's records and manifest verify with the policy's and the broker's keys."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from policies import load_signing_key
from policies.keys import SigningKey
from policies.loader import parse_policy
from sluicegate import topics
from sluicegate.app.broker_http import get
from sluicegate.app.localcampus import LocalCampus
from sluicegate.metering.fetch import ExportError, fetch_export
from sluicegate.metering.ledger import FILE_NAME, Ledger
from sluicegate.metering.record import ManifestLine, SignedUsage, from_line, sign_usage
from sluicegate.metering.wire import UsageAck, encode_batch
from sluicegate.mqtt import MqttTransport
from sluicegate.transport import Message
from tests.policies.policy_testkit import key
from tests.support import local_campus, volley, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WORKER, LINE = "north-cpu-1", "line-1-pc"
OTHER_LINE = "line-2-pc"  # not started here: its identity is free for the test to speak as


@pytest.fixture(scope="module")
def campus(
    tmp_path_factory: pytest.TempPathFactory, fresh_redis_db: Callable[[], str]
) -> Iterator[LocalCampus]:
    with local_campus(
        tmp_path_factory.mktemp("metering-campus"),
        # A database of its own: another campus of the session (same ids, same published
        # keys) would have left records under the same (node, seq), refused here as conflicts.
        fresh_redis_db(),
        nodes=("broker-1", LINE, WORKER),
        node_env={LINE: {"SLUICEGATE_OFFLOAD__QUEUE_BOUND": "1"}},
    ) as lc:
        wait_until(
            lambda: _worker_online(lc), timeout=30
        )  # placed on only once the broker knows it
        yield lc


def _worker_online(campus: LocalCampus) -> bool:
    url = f"http://127.0.0.1:{campus.http_port}/fleet"
    status, body = get(url, campus.write().console_token("viewer"))
    workers = {w["id"]: w for w in json.loads(body)["workers"]} if status == 200 else {}
    return bool(workers.get(WORKER, {}).get("online"))


def _export(campus: LocalCampus) -> tuple[list[SignedUsage], ManifestLine]:
    body = fetch_export(
        f"http://127.0.0.1:{campus.http_port}", campus.write().console_token("viewer"), 0, 4e9
    )
    lines = body.rstrip(b"\n").split(b"\n")
    manifest = ManifestLine.model_validate_json(lines[-1])
    digest = hashlib.sha256(b"".join(line + b"\n" for line in lines[:-1])).hexdigest()
    assert manifest.manifest.records_sha256 == digest
    assert manifest.manifest.signature_valid(key("broker-1").public)
    return [from_line(line) for line in lines[:-1] if line], manifest


def _worker_records(campus: LocalCampus) -> list[SignedUsage]:
    return [s for s in _export(campus)[0] if s.record.node == WORKER]


def _some_records(campus: LocalCampus) -> list[SignedUsage]:
    """The worker's records at the broker, after a volley if there are none yet."""
    if not _worker_records(campus):
        asyncio.run(volley(campus, LINE, 12, deadline_ms=10_000))
    records: list[SignedUsage] = wait_until(lambda: _worker_records(campus), timeout=30)
    return records


def _metric(campus: LocalCampus, name: str) -> float:
    status, body = get(f"http://127.0.0.1:{campus.http_port}/metrics", None)
    assert status == 200
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _verified(campus: LocalCampus, records: list[SignedUsage]) -> None:
    policy = parse_policy(campus.write().policy_file.read_bytes(), source="policy.toml")
    public = policy.node_key(WORKER)
    assert public is not None
    for signed in records:
        assert signed.node_signature_valid(public)
        assert signed.receipt is not None
        assert signed.receipt.broker == "broker-1"
        assert signed.receipt_valid(key("broker-1").public)
    seqs = [s.record.seq for s in records]
    assert seqs == list(range(1, len(records) + 1))  # all there, each once
    for before, after in itertools.pairwise(records):
        assert after.record.prev == before.digest().hex()


def test_offloaded_jobs_are_recorded_once_per_attempt_countersigned(campus: LocalCampus) -> None:
    results = asyncio.run(volley(campus, LINE, 12, deadline_ms=10_000))
    assert all(r.status == "ok" for r in results), [(r.status, r.code) for r in results]
    pooled = {r.job_id for r in results if r.ran_on.node == WORKER}
    asked = [(r.offload.placed, r.offload.code) for r in results if r.offload is not None]
    assert pooled, f"a volley of 12 on a one-slot edge with queue_bound 1 must offload: {asked}"

    def arrived() -> list[SignedUsage] | None:
        records = _worker_records(campus)
        return records if pooled <= {s.record.job_id for s in records} else None

    records = wait_until(arrived, timeout=30)
    _verified(campus, records)
    attempts = [(s.record.job_id, s.record.attempt) for s in records]
    assert len(attempts) == len(set(attempts))  # one record per attempt that ran
    assert {s.record.job_id for s in records} <= {r.job_id for r in results}
    for s in records:
        r = s.record
        assert (r.kind, r.event, r.line, r.zone, r.status) == (
            "pool",
            "ran",
            LINE,
            "campus/fab-north/dc",
            "ok",
        )
        assert len(r.token_id) == 32
        assert r.device_us > 0
        assert r.bytes_in > 0
        assert len(r.result_sha256) == 64
    assert _metric(campus, "sluicegate_usage_device_seconds_total") > 0


def test_the_export_needs_a_viewer_and_a_period(campus: LocalCampus) -> None:
    base = f"http://127.0.0.1:{campus.http_port}"
    with pytest.raises(ExportError, match=r"HTTP 401 \(give a viewer's console token\)"):
        fetch_export(base, None, 0, 4e9)
    with pytest.raises(ExportError, match=r"(?s)HTTP 400.*is after to"):
        fetch_export(base, campus.write().console_token("viewer"), 10, 5)
    with pytest.raises(ExportError, match="cannot reach the broker"):
        fetch_export("http://127.0.0.1:1", None, 0, 1, timeout=5)


def test_a_restarted_worker_resends_and_the_broker_keeps_one_copy(campus: LocalCampus) -> None:
    held = _some_records(campus)
    duplicates = _metric(campus, "sluicegate_usage_duplicates_total")
    campus.stop_node(WORKER)
    # As if no acknowledgement had come: every record unacknowledged, and one more written.
    ledger_file = campus.root / "state" / WORKER / FILE_NAME
    db = sqlite3.connect(ledger_file)
    db.execute("UPDATE records SET acked_ms = NULL")
    db.commit()
    db.close()
    worker_key = load_signing_key(campus.write().key_files[WORKER])
    extra = asyncio.run(_append_one(ledger_file, worker_key))
    assert extra.record.seq == held[-1].record.seq + 1
    campus.restart(WORKER)

    def resent() -> list[SignedUsage] | None:
        records = _worker_records(campus)
        again = _metric(campus, "sluicegate_usage_duplicates_total") - duplicates
        return records if again >= len(held) and len(records) > len(held) else None

    records = wait_until(resent, timeout=60)
    _verified(campus, records)
    assert [s.record for s in records] == [s.record for s in held] + [extra.record]
    assert _metric(campus, "sluicegate_usage_conflicts_total") == 0


async def _append_one(path: Path, worker_key: SigningKey) -> SignedUsage:
    ledger = Ledger(path, worker_key, node=WORKER, kind="pool")
    await ledger.open()
    (signed,) = await ledger.append(
        [
            ledger.draft(
                event="ran",
                job_id="written-while-down",
                attempt=1,
                line=LINE,
                zone="campus/fab-north/dc",
                status="ok",
            )
        ]
    )
    await ledger.close()
    return signed


def test_altered_forged_and_misnamed_records_are_refused(campus: LocalCampus) -> None:
    held = _some_records(campus)
    last = held[-1]
    altered = last.model_copy(
        update={"record": last.record.model_copy(update={"device_us": 1}), "receipt": None}
    )
    forged_record = last.record.model_copy(
        update={"seq": last.record.seq + 1, "prev": last.digest().hex(), "job_id": "forged"}
    )
    forged = sign_usage(forged_record, SigningKey.generate())
    campus.stop_node(WORKER)  # its identity is the test's for a moment
    try:
        acks = asyncio.run(_send_as(campus, WORKER, WORKER, [altered, forged]))
        assert [(r.seq, r.code) for r in acks.refused] == [
            (last.record.seq, "usage.bad_signature"),
            (last.record.seq + 1, "usage.bad_signature"),
        ]
        assert acks.held == []
        # Another line PC ships the worker's genuine record under its own name: refused.
        genuine = last.model_copy(update={"receipt": None})
        misnamed = asyncio.run(_send_as(campus, OTHER_LINE, OTHER_LINE, [genuine]))
        assert [r.code for r in misnamed.refused] == ["usage.id_mismatch"]
    finally:
        campus.restart(WORKER)
    records = _worker_records(campus)
    assert [s.record for s in records] == [s.record for s in held]
    assert _metric(campus, 'sluicegate_usage_refusals_total{code="usage.bad_signature"}') >= 2


async def _send_as(
    campus: LocalCampus, identity: str, topic_node: str, records: list[SignedUsage]
) -> UsageAck:
    transport = MqttTransport(campus.write().mqtt(identity), client_id=identity)
    await transport.connect(timeout=10)
    got: asyncio.Queue[UsageAck] = asyncio.Queue()
    try:
        await transport.subscribe(
            topics.usage_acks(identity),
            lambda m: got.put_nowait(UsageAck.model_validate_json(m.payload)),
            qos=1,
        )
        await transport.publish(
            Message(topics.usage(topic_node), encode_batch(records), qos=1), wait=True
        )
        async with asyncio.timeout(15):
            while True:
                ack = await got.get()
                if ack.refused or ack.held:
                    return ack
    finally:
        await transport.close()
