"""Usage exports for the meter tests, made the way a campus makes them: each node's records
numbered, chained and signed with its (published test) key by ``sign_usage``, countersigned
by broker-1 with ``countersign``, and written by ``export_lines``. Nothing of the crypto is
mocked; the keys are ``tests.policies.policy_testkit.key``, which proves nothing outside
tests.

:func:`day` is a small campus's day: jobs run on their edges, jobs offloaded once, a job
whose first worker was lost (attempt 1 wasted, attempt 2 billed), a fenced late return, a
job that expired after a run (nothing delivered, all waste), and a job still unsettled.
:func:`pool_chain` is a worker's chain of records; :func:`new_intake` a broker replica's
usage intake to ship them to.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from broker.decision_audit import DecisionAudit
from broker.gatekeeper import Gatekeeper
from broker.metering import UsageIngest
from broker.metrics import BrokerMetrics
from center_pool.guard import MemoryAuditStore
from policies import AsyncAuditWriter
from policies.model import Policy
from sluicegate.memory_transport import MemoryBroker, MemoryTransport
from sluicegate.metering.record import (
    GENESIS,
    SignedUsage,
    Usage,
    countersign,
    export_lines,
    sign_usage,
)
from tests.policies.policy_testkit import base_doc, key, policy_of, to_toml, workers

T0 = 1_796_000_000_000  # ms, 2026-11-30T00:53:20Z
MINUTE = 60_000
EDGES = ("north-l1-pc", "north-l2-pc")
MODEL_SHA = "ab" * 32


def meter_doc() -> dict[str, Any]:
    doc = base_doc()
    doc["pools"]["north-dc"]["workers"] = workers("north-gpu-1", "north-gpu-2")
    doc["edges"]["north-l2-pc"] = {
        "zone": "campus/fab-north/line-1",
        "key": key("north-l2-pc").public_text,
    }
    doc["broker_signers"]["keys"]["broker-2"] = key("broker-2").public_text
    return doc


def meter_policy() -> Policy:
    return policy_of(meter_doc())


def write_policy(folder: Path) -> Path:
    path = folder / "campus.toml"
    path.write_text(to_toml(meter_doc()))
    return path


class Ledgers:
    """Every node's ledger at once: ``seq`` and ``prev`` kept per node as the real one does."""

    def __init__(self) -> None:
        self.records: list[SignedUsage] = []
        self._seq: dict[str, int] = {}
        self._prev: dict[str, str] = {}

    def add(self, node: str, **fields: Any) -> SignedUsage:
        seq = self._seq.get(node, 0) + 1
        kind = "edge" if node in EDGES else "pool"
        base: dict[str, Any] = {
            "node": node,
            "kind": kind,
            "seq": seq,
            "prev": self._prev.get(node, GENESIS.hex()),
            "zone": "campus/fab-north/line-1" if kind == "edge" else "campus/fab-north/dc",
            "status": "ok",
        }
        signed = sign_usage(Usage(**(base | fields)), key(node))
        at = int(fields.get("at_ms", 0))
        signed = countersign(signed, key("broker-1"), broker="broker-1", received_ms=at + 40)
        self._seq[node] = seq
        self._prev[node] = signed.digest().hex()
        self.records.append(signed)
        return signed

    def ran(
        self,
        node: str,
        job: str,
        *,
        line: str,
        at_ms: int,
        device_ms: int,
        attempt: int = 0,
        owner: str = "inspect",
        model: str = "defect-v1",
        device_class: str | None = None,
        status: str = "ok",
    ) -> SignedUsage:
        edge = node in EDGES
        return self.add(
            node,
            event="ran",
            job_id=job,
            attempt=0 if edge else attempt,
            token_id="" if edge else f"{attempt:032x}",
            line=line,
            owner=owner,
            data_class="wafer-image",
            at_ms=at_ms,
            model=model,
            model_sha256=MODEL_SHA,
            backend="cpu" if edge else "cuda",
            device_class=device_class or ("x86-cpu" if edge else "nvidia-a100"),
            device_us=device_ms * 1000,
            queue_us=1500,
            bytes_in=120_000,
            status=status,
        )

    def settled(
        self,
        edge: str,
        job: str,
        *,
        at_ms: int,
        worker: str = "",
        attempt: int = 0,
        owner: str = "inspect",
        status: str = "ok",
    ) -> SignedUsage:
        return self.add(
            edge,
            event="settled",
            job_id=job,
            attempt=attempt,
            line=edge,
            owner=owner,
            data_class="wafer-image",
            at_ms=at_ms,
            model="defect-v1",
            settled_node=worker,
            settled_attempt=attempt if worker else 0,
            status=status,
        )

    def export(
        self,
        *,
        records: list[SignedUsage] | None = None,
        from_ms: int = T0,
        to_ms: int = T0 + 60 * MINUTE,
        broker: str = "broker-1",
    ) -> bytes:
        lines = export_lines(
            self.records if records is None else records,
            key(broker),
            broker=broker,
            exported_ms=to_ms + 5000,
            from_ms=from_ms,
            to_ms=to_ms,
        )
        return b"\n".join(lines) + b"\n"


def day() -> Ledgers:
    """A campus's hour (times in ms after :data:`T0`), its records in the order written."""
    led = Ledgers()
    l1, l2 = EDGES
    # Run on the edges: each settles itself.
    led.ran(l1, "j-local-1", line=l1, at_ms=T0 + 10_000, device_ms=40)
    led.ran(l2, "j-local-2", line=l2, at_ms=T0 + 20_000, device_ms=60, owner="ocr")
    # Offloaded once, delivered.
    led.ran("north-gpu-1", "j-off-1", line=l1, attempt=1, at_ms=T0 + 30_000, device_ms=12)
    led.settled(l1, "j-off-1", at_ms=T0 + 30_050, worker="north-gpu-1", attempt=1)
    # The first worker lost after running: attempt 1 wasted, attempt 2 delivered.
    led.ran("north-gpu-1", "j-retry", line=l1, attempt=1, at_ms=T0 + MINUTE, device_ms=15)
    led.ran("north-gpu-2", "j-retry", line=l1, attempt=2, at_ms=T0 + MINUTE + 900, device_ms=14)
    led.settled(l1, "j-retry", at_ms=T0 + MINUTE + 950, worker="north-gpu-2", attempt=2)
    # Rerouted to another worker, the first one's return fenced when it came late.
    led.ran(
        "south-npu-1",
        "j-fenced",
        line=l2,
        attempt=2,
        at_ms=T0 + 2 * MINUTE,
        device_ms=20,
        owner="ocr",
        device_class="ascend-310",
    )
    led.ran(
        "north-gpu-2",
        "j-fenced",
        line=l2,
        attempt=1,
        at_ms=T0 + 2 * MINUTE + 300,
        device_ms=30,
        owner="ocr",
    )
    led.settled(
        l2, "j-fenced", at_ms=T0 + 2 * MINUTE + 100, worker="south-npu-1", attempt=2, owner="ocr"
    )
    # Ran on a worker, the return lost, the job expired: nothing delivered, all waste.
    led.ran("north-gpu-1", "j-expired", line=l1, attempt=1, at_ms=T0 + 3 * MINUTE, device_ms=25)
    led.settled(l1, "j-expired", at_ms=T0 + 3 * MINUTE + 5000, status="expired")
    # Ran, not settled yet when the export was made.
    led.ran(
        "north-gpu-2",
        "j-open",
        line=l2,
        attempt=1,
        at_ms=T0 + 4 * MINUTE,
        device_ms=11,
        owner="ocr",
    )
    return led


def pool_chain(
    node: str, n: int, *, start: int = 1, prev: bytes = GENESIS, signer: str | None = None
) -> list[SignedUsage]:
    """``n`` records of jobs run on pool worker ``node`` (seq ``start`` on), chained from
    ``prev`` and signed by ``signer``'s key (the node's own unless named)."""
    out = []
    signing = key(signer or node)
    for seq in range(start, start + n):
        record = Usage(
            node=node,
            kind="pool",
            seq=seq,
            prev=prev.hex(),
            at_ms=1_780_000_000_000 + seq,
            event="ran",
            job_id=f"j-{seq}",
            attempt=1,
            line="north-l1-pc",
            zone="campus/fab-north/dc",
            status="ok",
            device_us=2_000,
        )
        signed = sign_usage(record, signing)
        prev = signed.digest()
        out.append(signed)
    return out


def new_intake(
    name: str, broker: MemoryBroker, client: aioredis.Redis, policy: Policy
) -> tuple[UsageIngest, BrokerMetrics, MemoryTransport]:
    """A broker replica's usage intake on ``client``'s Redis and the in-memory ``broker``:
    the intake, its metrics and its transport (subscribe it to the usage topics to start)."""
    metrics = BrokerMetrics()
    audit = DecisionAudit(AsyncAuditWriter(MemoryAuditStore(), key(name)), clock=lambda: 1e9)
    transport = MemoryTransport(broker)
    ingest = UsageIngest(
        name,
        transport,
        client,
        key(name),
        lambda: policy,
        metrics,
        Gatekeeper(lambda: policy, metrics, audit),
        audit,
    )
    return ingest, metrics, transport
