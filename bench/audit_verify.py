"""Benchmark: the broker's audit-chain check (``broker.audit_check``) on a long chain in a
real redis-server: the first, full pass over ``--records`` records, then an incremental pass
over ``--more`` new ones, and how much the event loop lags meanwhile (a 1 ms ticker on the
same loop records its worst and p99 lateness). The baseline, side by side: the same chain
checked in one synchronous ``verify_chain`` call, as ``sluicegate policy audit-verify`` does.

    .venv/bin/python bench/audit_verify.py                  # 100,000 records: about a minute
    .venv/bin/python bench/audit_verify.py --records 20000 --duty 1.0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import redis
import redis.asyncio as aioredis

from broker.audit_check import AuditChecker, trusted_keys
from broker.metrics import BrokerMetrics
from policies.audit import AuditRecord, next_record, verify_chain
from policies.keys import SigningKey
from policies.redis_stores import (
    AsyncRedisStreamAuditStore,
    RedisStreamAuditStore,
    audit_stream_key,
)
from sluicegate.app.servers import running, start_redis

STREAM = audit_stream_key("bench")


def fill(client: redis.Redis, key: SigningKey, n: int, head: AuditRecord | None) -> AuditRecord:
    pipe = client.pipeline(transaction=False)
    for i in range(n):
        data = {"job": f"job-{i:08d}", "worker": "north-gpu-1", "status": "placed"}
        head = next_record(head, "decision", data, now=1.8e9 + i, key=key)
        pipe.xadd(STREAM, {b"r": head.encode()}, id=f"{head.seq + 1}-0")
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
    began = time.perf_counter()
    standing = await checker.check()
    took = time.perf_counter() - began
    done.set()
    await tick
    assert standing.ok, standing
    lateness.sort()
    return {
        "records": standing.records,
        "wall_s": round(took, 3),
        "loop_lag_p99_ms": round(lateness[int(len(lateness) * 0.99)], 2),
        "loop_lag_max_ms": round(max(lateness), 2),
        "loop_lag_median_ms": round(statistics.median(lateness), 3),
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
        full = await timed_pass(checker)
        fill(sync, key, args.more, head)
        incremental = await timed_pass(checker)
        await client.aclose()
        sync.close()
    return {
        "records": args.records,
        "chunk": args.chunk,
        "duty": args.duty,
        "baseline_sync_verify_s": round(baseline, 3),
        "baseline_us_per_record": round(baseline / args.records * 1e6, 1),
        "full_pass": full,
        "incremental_pass": {**incremental, "new_records": args.more},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--more", type=int, default=1_000)
    parser.add_argument("--chunk", type=int, default=1000)
    parser.add_argument("--duty", type=float, default=0.5)
    print(json.dumps(asyncio.run(main(parser.parse_args())), indent=2))
