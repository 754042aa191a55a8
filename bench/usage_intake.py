"""Benchmark: what a node catching up on its usage records does to the broker's event loop.

A pool worker back from an outage ships its ledger's backlog, 128 records a message; the
broker's usage intake (``broker.metering.UsageIngest``) takes up to 64 messages at once and
checks and countersigns each record (an Ed25519 verify and a sign, about 0.2 ms) on the
event loop, where placement requests wait for it. This bench ships ``--messages`` such
messages to one intake on a real Redis (the in-memory transport carries them, so only the
intake's own work is measured) while a ticker on the same loop asks to run every
millisecond; each late wake-up is time a placement request would have waited.

Two arms, alternated round by round: the intake as it runs (a turn of the loop every
``SCREEN_SLICE`` records checked, ``STORE_SLICE`` records a Redis call) and the same intake
taking each batch in one go, one Redis call for all (the baseline).
Reported: the ticker's lateness p50/p99/max and the records stored a second.

    .venv/bin/python bench/usage_intake.py [--messages 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import broker.metering as metering
from bench import stats
from sluicegate import topics
from sluicegate.app.servers import running, start_redis
from sluicegate.memory_transport import MemoryBroker, MemoryTransport
from sluicegate.metering.wire import UsageAck, encode_batch
from sluicegate.transport import Message
from tests.meter_kit import new_intake, pool_chain
from tests.policies.policy_testkit import base_doc, policy_of

POLICY = policy_of(base_doc())
SLICES = (metering.SCREEN_SLICE, metering.STORE_SLICE)  # as the intake runs
NODE = "north-gpu-1"
PER_MESSAGE = 128  # what sluicegate.metering.shipper sends at most
TARGET_MAX_MS = 5.0  # a placement's share of the edge's 50 ms it may lose to the intake
ARMS = ("sliced", "whole")


async def one_round(url: str, db: int, payloads: list[bytes], sliced: bool) -> dict[str, float]:
    screen, store = SLICES
    client = aioredis.Redis.from_url(f"{url}/{db}")
    await client.flushdb()
    broker = MemoryBroker()
    ingest, _metrics, transport = new_intake("broker-1", broker, client, POLICY)
    await transport.subscribe(topics.usage_all(), ingest.on_usage, qos=1)
    metering.SCREEN_SLICE = screen if sliced else 1 << 30
    metering.STORE_SLICE = store if sliced else 1 << 30
    task = asyncio.create_task(ingest.run())
    late: list[float] = []
    total = len(payloads) * PER_MESSAGE

    def acked() -> int:
        return sum(
            len(UsageAck.model_validate_json(m.payload).held)
            for m in broker.log
            if m.topic == topics.usage_acks(NODE)
        )

    start = time.perf_counter()
    sender = MemoryTransport(broker)
    for payload in payloads:
        sender.publish_nowait(Message(topics.usage(NODE), payload, qos=1))
    while acked() < total:
        due = time.perf_counter() + 0.001
        await asyncio.sleep(0.001)
        late.append(max(0.0, time.perf_counter() - due) * 1000.0)
        if time.perf_counter() - start > 120:
            raise SystemExit("the intake did not acknowledge every record within 120 s")
    seconds = time.perf_counter() - start
    task.cancel()
    await client.aclose()
    return {
        "late_p50_ms": stats.median(late),
        "late_p99_ms": stats.percentile(late, 99),
        "late_max_ms": max(late, default=float("nan")),
        "records_per_s": total / seconds,
        "records": total,
        "ticks": len(late),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=16, help="messages of 128 records")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    records = pool_chain(NODE, args.messages * PER_MESSAGE)
    payloads = [
        encode_batch(records[i : i + PER_MESSAGE]) for i in range(0, len(records), PER_MESSAGE)
    ]
    runs: dict[str, list[dict[str, float]]] = {a: [] for a in ARMS}
    with running(start_redis()) as redis:
        url = f"redis://127.0.0.1:{redis.port}"
        asyncio.run(one_round(url, 1, payloads[:2], True))  # warm-up
        for _ in range(args.rounds):
            for arm in ARMS:
                runs[arm].append(asyncio.run(one_round(url, 1, payloads, arm == "sliced")))
    print(f"{len(records)} usage records in {len(payloads)} messages, {args.rounds} rounds")
    print(f"{'intake':<8}{'late p50 ms':>12}{'p99 ms':>9}{'max ms':>9}{'records/s':>11}")
    summary = {}
    for arm in ARMS:
        fig = {k: stats.median(r[k] for r in runs[arm]) for k in runs[arm][0]}
        fig["late_max_ms_worst"] = max(r["late_max_ms"] for r in runs[arm])
        summary[arm] = {k: round(v, 2) for k, v in fig.items()}
        print(
            f"{arm:<8}{fig['late_p50_ms']:>12.2f}{fig['late_p99_ms']:>9.2f}"
            f"{fig['late_max_ms']:>9.1f}{fig['records_per_s']:>11.0f}"
        )
    ratio = summary["sliced"]["late_max_ms"] / max(summary["whole"]["late_max_ms"], 1e-9)
    result = {
        "bench": "usage_intake",
        "subject": summary["sliced"],
        "baseline": summary["whole"],
        "ratio": {"late_max_sliced_over_whole": round(ratio, 3)},
        "target": {"late_max_ms": TARGET_MAX_MS},
        "met": summary["sliced"]["late_max_ms"] <= TARGET_MAX_MS,
        "measured": stats.require(
            {f"{arm} records acknowledged": sum(r["records"] for r in runs[arm]) for arm in ARMS}
            | {f"{arm} ticks": sum(r["ticks"] for r in runs[arm]) for arm in ARMS}
        ),
        "machine": stats.machine("redis", "pynacl"),
    }
    print(stats.result_line(result))


if __name__ == "__main__":
    main()
