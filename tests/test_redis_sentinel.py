"""Real tier: Redis behind Sentinel (a master, a replica, three sentinels as processes).

The broker's and the worker's Redis clients, made from a ``redis+sentinel://`` URL, follow
a planned failover (``SENTINEL FAILOVER``) without a restart: reservations, the replica
lease and the replay cache work on the promoted master, and what fails in between reaches
them as ``StoreUnavailable``, as does a write to the demoted master (``READONLY``) and a
service no sentinel knows. Then a whole secured campus runs on the Sentinel URL, and the
master is SIGKILLed in the middle of a burst: the sentinels promote the replica, every
accepted job ends in exactly one result (a refusal only for a job that found the edge's
queue full while no master answered), and placements go to the pool again after the
promotion.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import redis

from broker import keys
from broker.lease import ReplicaLease
from broker.reservations import Hold, Reservations
from policies.redis_stores import AsyncRedisReplayCache
from sluicegate.errors import StoreUnavailable
from sluicegate.instance import this_process
from sluicegate.redis_url import async_client, sync_client
from sluicegate.store import reached
from tests.faults import check_exactly_once
from tests.faults.app import App, Observer
from tests.faults.ledger import Ledger
from tests.faults.rig import WIRETAP, burst
from tests.faults.scenario import Outcome
from tests.sentinel_kit import SentinelGroup, SentinelRig, sentinel_group
from tests.support import wait_until

pytestmark = pytest.mark.integration

DB = 7  # the group's servers are this module's own; a database other than 0 all the same
T = TypeVar("T")


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelGroup]:
    with sentinel_group(tmp_path_factory.mktemp("sentinels")) as started:
        yield started


async def _eventually(call: Callable[[], Awaitable[T]], timeout: float, seen: list[str]) -> T:
    """``call()`` once it stops failing with StoreUnavailable (each failure noted in
    ``seen``), at most ``timeout`` s; any other error fails the test at once."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except StoreUnavailable as exc:
            seen.append(str(exc))
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)  # the next try, while the sentinels switch masters


def _master(group: SentinelGroup) -> int:
    port = group.master_port()
    assert port is not None, "the sentinels do not agree on a master"
    return port


def _hold(worker: str, job: str) -> Hold:
    return Hold(worker, job, 4, int((time.time() + 60) * 1000), "line-1-pc", 1, time.time() + 30)


def test_a_replica_and_an_unknown_service_are_store_unavailable(group: SentinelGroup) -> None:
    # A write to a replica is what a client still on a demoted master gets: READONLY.
    master = _master(group)
    group.wait_ready(master)
    replica = next(s.port for s in group.servers[:2] if s.port != master)
    direct = sync_client(f"redis://127.0.0.1:{replica}/{DB}")  # a plain URL: no sentinel
    try:
        with (
            pytest.raises(StoreUnavailable, match="ReadOnlyError"),
            reached("write to a replica"),
        ):
            direct.set("k", b"v")
    finally:
        direct.close()
    unknown = sync_client(group.url(DB).replace(f"/{group.service}/", "/no-such-service/"))
    try:
        with (
            pytest.raises(StoreUnavailable, match=r"MasterNotFoundError.*no-such-service"),
            reached("ask the sentinels for a master"),
        ):
            unknown.get("k")
    finally:
        unknown.close()


async def test_the_broker_and_worker_clients_follow_a_planned_failover(
    group: SentinelGroup, unique: str
) -> None:
    client = async_client(group.url(DB))
    reservations = Reservations(client)
    lease = ReplicaLease(client, f"broker-{unique}", this_process())
    replay = AsyncRedisReplayCache(client)
    worker = f"w-{unique}"
    seen: list[str] = []
    old = _master(group)
    group.wait_ready(old)
    keeper: asyncio.Future[None] | None = None
    try:
        now_ms = int(time.time() * 1000)
        assert await reservations.reserve_many([_hold(worker, f"a-{unique}")], now_ms) == [True]
        await lease.acquire()
        keeper = asyncio.ensure_future(lease.keep())
        assert await replay.claim(f"n1-{unique}".encode(), time.time() + 60, time.time())
        # A planned failover starts from a replica that has it all: replication is
        # asynchronous, and one write acknowledged by the replica proves the earlier ones.
        synced = redis.Redis(port=old, db=DB)
        try:
            synced.set(f"synced-{unique}", 1)
            assert synced.wait(1, 10_000) >= 1, "the replica never caught up"
        finally:
            synced.close()
        await asyncio.to_thread(group.failover)
        new = await asyncio.to_thread(group.wait_promoted, old)
        promoted = redis.Redis(port=new, db=DB)
        tries = iter(range(1_000_000))

        async def reserve_on_new_master() -> bool:
            job = f"b-{unique}-{next(tries)}"
            granted = await reservations.reserve_many([_hold(worker, job)], int(time.time() * 1000))
            return granted == [True] and promoted.zscore(keys.reservations(worker), job) is not None

        try:
            # The old master is up and still takes writes until the sentinels demote it
            # (about 10 s on): the client must move on its own, not wait for a READONLY.
            deadline = time.monotonic() + 20
            while not await _eventually(reserve_on_new_master, 20, seen):
                assert time.monotonic() < deadline, "the client never wrote to the new master"
            assert group.role(old) == "master", "demoted before the client moved: proves nothing"
            nonce = f"n2-{unique}".encode()
            assert await _eventually(
                lambda: replay.claim(nonce, time.time() + 60, time.time()), 20, seen
            )
            assert promoted.exists(replay.prefix + nonce.hex())

            def renewed() -> bool:  # the lease renewed on the new master since promotion
                return promoted.pttl(keys.replica_lease(f"broker-{unique}")) > 2000

            await asyncio.to_thread(wait_until, renewed, 10)
            assert not lease.lost.is_set(), lease.reason
            # What was written before the failover came across.
            assert promoted.zscore(keys.reservations(worker), f"a-{unique}") is not None
        finally:
            promoted.close()
        # A blocking client made now finds the new master (the CLI's clients are made per
        # command; only the asyncio client watches for a new master while it lives).
        blocking = sync_client(group.url(DB))
        try:
            with reached("write through a blocking client"):
                blocking.set(f"sync-{unique}", b"after")
            assert blocking.connection_pool.get_master_address()[1] == new
        finally:
            blocking.close()
    finally:
        if keeper is not None:
            keeper.cancel()
        await lease.release()
        await client.aclose()
    print(f"failover {old} -> {new}: {len(seen)} calls refused meanwhile: {set(seen)}")


async def test_a_lease_lost_in_a_failover_is_taken_back_and_one_taken_still_fences(
    redis_url: str, unique: str
) -> None:
    # What a promoted master shows a broker whose last renewals it never saw: no lease.
    client = async_client(redis_url)
    key = keys.replica_lease(f"broker-{unique}")
    lease = ReplicaLease(client, f"broker-{unique}", this_process())
    try:
        await lease.acquire()
        mine = await client.get(key)
        keeper = asyncio.ensure_future(lease.keep())
        try:
            await client.delete(key)
            back = await asyncio.to_thread(wait_until, lambda: _get(redis_url, key) == mine, 10)
            assert back
            assert not lease.lost.is_set()
            await client.set(key, b"another process", px=60_000)
            await asyncio.wait_for(lease.lost.wait(), 10)  # taken by another: fenced
            assert "taken by another process" in lease.reason
        finally:
            keeper.cancel()
    finally:
        await client.delete(key)
        await client.aclose()


def _get(url: str, key: str) -> bytes | None:
    client = sync_client(url)
    try:
        value = client.get(key)
        return value if isinstance(value, bytes) else None
    finally:
        client.close()


NODES = ["broker-1", "line-1-pc", "north-cpu-1"]
BURST_DB = 5
MAX_JOBS = 1200  # 10 s of a 120 jobs/s burst at one edge, if the pool never came back


@pytest.mark.slow
@pytest.mark.faults
@pytest.mark.timeout(180)
def test_a_master_sigkilled_mid_burst_loses_no_job(tmp_path: Path) -> None:
    # line-1-pc offers every job (each asks the broker, and through it Redis), and its
    # compute capped to a tenth of a core makes the pool the faster place for most.
    env = {"SLUICEGATE_OFFLOAD__QUEUE_BOUND": "0"}
    with SentinelRig(tmp_path, db=BURST_DB, nodes=NODES, env=env, edge_cpu=0.1) as rig:
        out, ledger, promoted_at, figures = asyncio.run(_burst_through_failover(rig))
    check_exactly_once(out, rig, min_accepted=40)
    jobs = out.verdict
    # While no master answers, the broker places nothing and line-1-pc (a tenth of a core)
    # runs what it can; a job that finds its queue full then is refused, saying so
    # (queue_full): the app is told, nothing is lost. Any other answer, or a refusal of a
    # job sent before the fault, is a failure.
    killed_at = out.started + out.seconds["fault"]
    assert jobs.statuses.keys() <= {"ok", "rejected"}, jobs.explain()
    assert jobs.codes.keys() <= {"queue_full"}, jobs.explain()
    refused_early = [
        j.job_id
        for j in ledger.jobs.values()
        if j.deliveries and j.deliveries[0][1].get("status") != "ok"
        if j.published_at < killed_at
    ]
    assert not refused_early, f"refused before the fault: {refused_early[:5]}; {jobs.explain()}"
    after = [
        j
        for j in ledger.jobs.values()
        if j.published_at > promoted_at and j.deliveries
        if (j.deliveries[0][1].get("ran_on") or {}).get("kind") == "pool"
    ]
    assert after, f"no job submitted after the promotion ran on the pool: {jobs.explain()}"
    offers = Counter(
        str((j.deliveries[0][1].get("offload") or {}).get("code"))
        for j in ledger.jobs.values()
        if j.deliveries
    )
    print(f"sentinel failover mid-burst: {figures}; offload codes {dict(offers)}")


async def _burst_through_failover(
    rig: SentinelRig,
) -> tuple[Outcome, Ledger, float, dict[str, float]]:
    """A steady burst at line-1-pc; once the pool serves, SIGKILL the master, wait for the
    promotion, go on until a job submitted since runs on the pool, then wait for every
    result. Returns the outcome, the app's ledger, when the promotion was seen and how long
    things took."""
    app = await App(rig.mqtt()).start()
    observer = await Observer(rig.mqtt(WIRETAP)).start()
    stop = asyncio.Event()
    t0 = time.monotonic()
    figures: dict[str, float] = {}
    try:
        load = asyncio.ensure_future(
            burst(app, "line-1-pc", "sent", jobs=MAX_JOBS, volley=6, every_s=0.05, stop=stop)
        )
        placed = await observer.wait_for(lambda tl: tl.count("work", "north-cpu-1") >= 5, 30)
        assert placed, f"no job reached the pool: {app.ledger.verdict().explain()}"
        pending_at_fault = len(app.ledger.pending())
        old = rig.group.master_port()
        assert old is not None
        killed_at = time.monotonic()
        rig.group.server(old).kill()
        await asyncio.to_thread(rig.group.wait_promoted, old)
        promoted_at = time.monotonic()
        figures["promotion_s"] = round(promoted_at - killed_at, 2)

        def pooled_since_promotion() -> bool:
            return any(
                j.published_at > promoted_at
                and j.deliveries
                and (j.deliveries[0][1].get("ran_on") or {}).get("kind") == "pool"
                for j in app.ledger.jobs.values()
            )

        back = await observer.wait_for(lambda _tl: pooled_since_promotion(), 30)
        figures["pool_again_s"] = round(time.monotonic() - promoted_at, 2) if back else -1.0
        stop.set()
        await load
        missing = await app.wait_results(60)
        outcome = Outcome(
            app.ledger.verdict(),
            observer.timeline,
            True,
            missing,
            {"fault": killed_at - t0, "settled": time.monotonic() - t0},
            t0,
            pending_at_fault,
        )
        return outcome, app.ledger, promoted_at, figures
    finally:
        await observer.close()
        await app.close()
