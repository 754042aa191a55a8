"""Benchmark: the broker's audit-chain check (``broker.audit_check``) on a long chain in a
real redis-server: the first, full pass over ``--records`` records, then an incremental pass
over ``--more`` new ones, and how much the event loop lags meanwhile (a 1 ms ticker on the
same loop records its worst and p99 lateness). The baseline, side by side: the same chain
checked in one synchronous ``verify_chain`` call, as ``sluicegate policy audit-verify`` does.
Then ``--rounds`` rounds of ``--more`` new records each, checked by two checkers in
alternating order: one that verifies every signature, and one given the digests a broker's
own writer keeps of what it stored (``witnessed``), as the broker's check runs.

    .venv/bin/python bench/audit_verify.py                  # 100,000 records: about a minute
    .venv/bin/python bench/audit_verify.py --records 20000 --duty 1.0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import redis
import redis.asyncio as aioredis

from bench import stats
from broker.audit_check import AuditChecker, trusted_keys
from broker.metrics import BrokerMetrics
from policies.audit import AsyncAuditWriter, AuditRecord, entry_digest, next_record, verify_chain
from policies.keys import SigningKey
from policies.redis_stores import (
    AsyncRedisStreamAuditStore,
    RedisStreamAuditStore,
    audit_stream_key,
)
from sluicegate.app.servers import running, start_redis

STREAM = audit_stream_key("bench")


def fill(
    client: redis.Redis,
    key: SigningKey,
    n: int,
    head: AuditRecord | None,
    witnessed: dict[int, bytes] | None = None,
) -> AuditRecord:
    pipe = client.pipeline(transaction=False)
    for i in range(n):
        data = {"job": f"job-{i:08d}", "worker": "north-gpu-1", "status": "placed"}
        head = next_record(head, "decision", data, now=1.8e9 + i, key=key)
        entry = head.encode()
        if witnessed is not None:
            witnessed[head.seq] = entry_digest(entry)
        pipe.xadd(STREAM, {b"r": entry}, id=f"{head.seq + 1}-0")
        if i % 2000 == 1999:
            pipe.execute()
    pipe.execute()
    assert head is not None
    return head


async def timed_pass(checker: AuditChecker) -> dict[str, float]:
    lateness: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lateness.append((time.perf_counter() - t - 0.001) * 1000)

    tick = asyncio.create_task(ticker())
    began, cpu = time.perf_counter(), time.process_time()
    standing = await checker.check()
    took, cpu = time.perf_counter() - began, time.process_time() - cpu
    done.set()
    await tick
    assert standing.ok, standing
    return {
        "records": standing.records,
        "wall_s": round(took, 3),
        "cpu_s": round(cpu, 3),  # this process, all threads (the ticker's share included)
        "loop_lag_p99_ms": round(stats.percentile(lateness, 99), 2),
        "loop_lag_max_ms": round(max(lateness), 2),
        "loop_lag_median_ms": round(stats.median(lateness), 3),
    }


async def main(args: argparse.Namespace) -> dict[str, object]:
    key = SigningKey.generate()
    with running(start_redis()) as server:
        url = f"redis://{server.host}:{server.port}/0"
        sync = redis.Redis.from_url(url)
        head = fill(sync, key, args.records, None)
        began = time.perf_counter()
        verify_chain(RedisStreamAuditStore(sync, STREAM).entries(), {key.public})
        baseline = time.perf_counter() - began
        client = aioredis.Redis.from_url(url)
        checker = AuditChecker(
            AsyncRedisStreamAuditStore(client, STREAM),
            lambda: trusted_keys(key.public, None),
            BrokerMetrics(),
            chunk=args.chunk,
            duty=args.duty,
        )
        store = AsyncRedisStreamAuditStore(client, STREAM)
        own = AsyncAuditWriter(store, key)  # stands for the broker's writer: its digests
        witnessing = AuditChecker(
            store,
            lambda: trusted_keys(key.public, None),
            BrokerMetrics(),
            chunk=args.chunk,
            duty=args.duty,
            writer=own,
        )
        full = await timed_pass(checker)
        await timed_pass(witnessing)  # its own first, full pass
        arms: dict[str, list[dict[str, float]]] = {"signatures": [], "witnessed": []}
        for r in range(args.rounds):
            head = fill(sync, key, args.more, head, own.witnessed)
            order = [("signatures", checker), ("witnessed", witnessing)]
            for name, c in order if r % 2 == 0 else order[::-1]:
                arms[name].append(await timed_pass(c))
        await client.aclose()
        sync.close()
    incremental = {
        name: {
            "new_records": args.more,
            "cpu_s_rounds": [p["cpu_s"] for p in passes],
            "cpu_us_per_record_p50": round(
                stats.median(p["cpu_s"] for p in passes) / args.more * 1e6, 1
            ),
            "loop_lag_max_ms": max(p["loop_lag_max_ms"] for p in passes),
        }
        for name, passes in arms.items()
    }
    ratio = stats.ratio(
        incremental["witnessed"]["cpu_us_per_record_p50"],
        incremental["signatures"]["cpu_us_per_record_p50"],
    )
    return {
        "records": args.records,
        "chunk": args.chunk,
        "duty": args.duty,
        "baseline_sync_verify_s": round(baseline, 3),
        "baseline_us_per_record": round(baseline / args.records * 1e6, 1),
        "full_pass": full,
        "subject": incremental["witnessed"],
        "baseline": incremental["signatures"],
        "ratio": {"witnessed_over_signatures": round(ratio, 3)},
        "measured": stats.require(
            {
                "records in the full pass": full["records"],
                "incremental passes, signatures": len(arms["signatures"]),
                "incremental passes, witnessed": len(arms["witnessed"]),
            }
        ),
        "machine": stats.machine("redis"),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--more", type=int, default=5_000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=1000)
    parser.add_argument("--duty", type=float, default=0.5)
    result = {"bench": "audit_verify", **asyncio.run(main(parser.parse_args()))}
    print(json.dumps(result, indent=2, default=str))
    print(stats.result_line(result))
