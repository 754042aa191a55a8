"""Broker decisions in the audit log: packed into records that fit, none lost when the
store fails for a while, and the chain still verifies (real Ed25519, real chain)."""

from __future__ import annotations

import asyncio
import json

from broker.decision_audit import BUDGET, DecisionAudit, encode, pack
from policies import AsyncAuditWriter, verify_chain
from policies.audit import MAX_RECORD_BYTES
from policies.errors import StoreUnavailable
from tests.policies.policy_testkit import key


class FlakyStore:
    """An in-memory audit store whose first ``failures`` appends fail as the Redis store's
    do when Redis is lost (``StoreUnavailable``)."""

    def __init__(self, failures: int = 0) -> None:
        self.entries: list[bytes] = []
        self.failures = failures
        self.stored = asyncio.Event()

    async def append(self, seq: int, entry: bytes) -> None:
        if self.failures:
            self.failures -= 1
            raise StoreUnavailable("Redis could not append audit record: connection lost")
        assert len(entry) <= MAX_RECORD_BYTES
        self.entries.append(entry)
        self.stored.set()

    async def last(self) -> bytes | None:
        return self.entries[-1] if self.entries else None


def decision(i: int, why_size: int = 200) -> dict[str, object]:
    return {"job_id": f"job-{i}", "status": "placed", "worker": "w1", "why": "x" * why_size}


def test_pack_keeps_every_record_within_budget_and_order() -> None:
    items = [(f"job-{i}", encode(decision(i, 900))) for i in range(100)]
    records = pack(items)
    assert [p for r in records for p in r] == items
    assert len(records) > 1
    assert all(sum(len(t) + len(j) + 2 for j, t in r) <= BUDGET for r in records)


def test_an_oversized_explanation_is_cut_not_the_decision() -> None:
    text = encode(decision(1, BUDGET))
    assert len(text) < BUDGET // 2
    assert json.loads(text)["job_id"] == "job-1"


async def test_a_burst_is_written_completely_in_chained_records_despite_failures() -> None:
    store = FlakyStore(failures=2)
    audit = DecisionAudit(AsyncAuditWriter(store, key("broker-1")), clock=lambda: 1.0e9)
    runner = asyncio.ensure_future(audit.run())
    for i in range(300):
        audit.add(f"job-{i}", encode(decision(i, 600)))
    async with asyncio.timeout(20):
        while audit.written < 300:
            store.stored.clear()
            await store.stored.wait()
    runner.cancel()
    summary = verify_chain(store.entries, [key("broker-1").public])
    assert summary.count == len(store.entries) > 1
    jobs = [
        d["job_id"] for e in store.entries for d in json.loads(json.loads(e)["data"]["decisions"])
    ]
    assert jobs == [f"job-{i}" for i in range(300)]
    assert audit.dropped == 0
