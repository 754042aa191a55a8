"""No job lost, none looping for ever: what the broker does when a worker dies holding jobs,
and with completions of attempts that are no longer current.

Three tiers: the pure decisions of ``broker.core.recovery`` as tables; the Redis scripts of
``broker.reservations`` / ``broker.inflight`` against a real redis-server; and brokers as real
processes (``sluicegate broker run``) against real Mosquitto and Redis, with workers played by
MQTT clients that carry a Last Will and can vanish without a DISCONNECT.
"""

from __future__ import annotations

import asyncio
import os
import queue
import re
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pytest
import pytest_asyncio
import redis
import redis.asyncio as aioredis
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from broker import keys
from broker.core.recovery import (
    Current,
    LostJob,
    after_death,
    judge_completion,
    worker_gone,
)
from broker.inflight import CLAIM, InflightStore
from broker.reservations import Hold, Reservations
from broker.store import BrokerStore
from sluicegate import topics, wire
from sluicegate.app.broker_http import get, get_json, post_json
from sluicegate.app.campus import FAB, Campus, write_campus
from sluicegate.app.servers import ServerProcess, free_port, running, start_mosquitto, start_redis
from sluicegate.metering.record import GENESIS, ManifestLine, Usage, from_line, sign_usage
from sluicegate.metering.wire import UsageAck, encode_batch
from sluicegate.wire_pool import (
    Completion,
    JobNotice,
    ModelCapability,
    PlacementReply,
    WorkerCapabilities,
    WorkerTelemetry,
)
from tests import support
from tests.policies.policy_testkit import key
from tests.secure_kit import audited
from tests.support import PlainClient, list_brokers, sluicegate_cmd

NOW = 1_800_000_000.0

# -- pure tier: broker.core.recovery -------------------------------------------------------------


@pytest.mark.parametrize(
    ("online", "seen", "listed", "watching_s", "gone"),
    [
        (True, True, True, 100.0, False),  # reporting: alive
        (True, True, False, 100.0, False),  # the node record lags; the fleet knows better
        (False, True, True, 0.0, True),  # this replica saw it and lost it (will or silence)
        (False, False, True, 100.0, False),  # never seen here, but another replica sees it
        (False, False, False, 100.0, True),  # nobody has heard from it for a timeout
        (False, False, False, 1.0, False),  # a fresh replica waits one timeout first
    ],
)
def test_worker_gone(online: bool, seen: bool, listed: bool, watching_s: float, gone: bool) -> None:
    verdict = worker_gone(
        online=online, seen=seen, node_listed=listed, watching_s=watching_s, stale_after_s=3.0
    )
    assert verdict is gone


def _lost(crashes: int, on: tuple[str, ...], deadline: float | None = None) -> LostJob:
    return LostJob("job-7", "line-1-pc", len(on), crashes, on, deadline)


@pytest.mark.parametrize(
    ("job", "max_crashes", "kind", "words"),
    [
        (_lost(1, ("w1",)), 3, "worker_lost", ["w1", "attempt 1", "crash 1 of 3", "attempt 2"]),
        (_lost(2, ("w1", "w2")), 3, "worker_lost", ["w2", "crash 2 of 3", "attempt 3"]),
        (
            _lost(3, ("w1", "w2", "w3")),
            3,
            "dead_letter",
            ["dead letter", "3 workers", "w1, w2, w3", "max_worker_crashes is 3"],
        ),
        (_lost(1, ("w1",)), 1, "dead_letter", ["1 workers", "w1"]),
        (_lost(5, ("a", "b", "c", "d", "e")), 3, "dead_letter", ["5 workers"]),
        (_lost(1, ("w1",), deadline=NOW - 2), 3, "worker_lost", ["deadline passed 2.0 s ago"]),
    ],
)
def test_after_death(job: LostJob, max_crashes: int, kind: str, words: list[str]) -> None:
    worker = job.crashed_on[-1]
    notify = after_death(job, worker, cause="last_will", max_crashes=max_crashes, now=NOW)
    assert notify.kind == kind
    assert (notify.job_id, notify.edge_id, notify.attempt) == ("job-7", "line-1-pc", job.attempt)
    assert (notify.worker_id, notify.crashes) == (worker, job.crashes)
    for word in words:
        assert word in notify.reason, notify.reason
    assert "Last Will" in notify.reason


@pytest.mark.parametrize(
    ("current", "attempt", "worker", "verdict", "drop", "unlist"),
    [
        (None, 1, "w1", "unknown", False, True),
        (Current(1, "w1", None, False), 1, "w1", "current", True, True),
        (Current(1, "w1", None, False), 2, "w1", "current", True, True),  # Redis lagged
        (Current(2, "w2", 1, False), 1, "w1", "stale", False, True),  # w1 lost, w2 has it
        (Current(2, "w1", None, False), 1, "w1", "stale", False, False),  # w1 holds attempt 2
        (Current(2, "w2", 2, False), 2, "w2", "after_loss", False, True),
        (Current(3, "w3", 3, True), 3, "w3", "stale", False, True),  # dead-lettered
    ],
)
def test_judge_completion(
    current: Current | None, attempt: int, worker: str, verdict: str, drop: bool, unlist: bool
) -> None:
    judged = judge_completion(current, attempt=attempt, worker_id=worker)
    assert (judged.verdict, judged.drop, judged.unlist) == (verdict, drop, unlist)
    if verdict == "stale" and current is not None and not current.dead:
        assert f"attempt {attempt}" in judged.reason
        assert f"attempt {current.attempt}" in judged.reason


# -- Redis tier: the scripts -----------------------------------------------------------------

redis_tier = pytest.mark.integration


@pytest_asyncio.fixture
async def rclient(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


def _hold(worker: str, job: str, attempt: int = 1, capacity: int = 8) -> Hold:
    until_ms = int((time.time() + 15) * 1000)
    return Hold(worker, job, capacity, until_ms, "line-1-pc", attempt, time.time() + 10)


@redis_tier
async def test_a_grant_records_the_job_in_flight_and_keeps_it_past_the_deadline(
    rclient: aioredis.Redis, unique: str
) -> None:
    worker, job = f"w-{unique}", f"j-{unique}"
    now_ms = int(time.time() * 1000)
    hold = _hold(worker, job, attempt=2)
    assert await Reservations(rclient, inflight_margin_ms=600_000).reserve_many([hold], now_ms)
    record = await InflightStore(rclient, BrokerStore(rclient, 1000)).record(job)
    assert record is not None
    assert (record["edge"], record["worker"], record["attempt"], record["crashes"]) == (
        "line-1-pc",
        worker,
        2,
        0,
    )
    assert hold.deadline_at is not None
    assert record["deadline_at"] == pytest.approx(hold.deadline_at, abs=0.001)
    assert await rclient.zscore(keys.inflight_on(worker), job) is not None
    assert await rclient.zscore(keys.inflight_workers(), worker) is not None
    # Never shorter than anything pending: past the deadline by the margin, for all three.
    for key_name in (keys.inflight(job), keys.inflight_on(worker)):
        expires_ms = await rclient.pexpiretime(key_name)
        assert expires_ms >= hold.until_ms + 600_000 - 5


@redis_tier
async def test_an_older_attempt_never_overwrites_a_newer_one(
    rclient: aioredis.Redis, unique: str
) -> None:
    job = f"j-{unique}"
    reservations = Reservations(rclient)
    now_ms = int(time.time() * 1000)
    assert await reservations.reserve_many([_hold(f"a-{unique}", job, attempt=3)], now_ms)
    assert await reservations.reserve_many([_hold(f"b-{unique}", job, attempt=2)], now_ms)
    assert await rclient.hmget(keys.inflight(job), "worker", "attempt") == [
        f"a-{unique}".encode(),
        b"3",
    ]


@redis_tier
async def test_claims_are_atomic_count_crashes_and_survive_new_attempts(
    rclient: aioredis.Redis, unique: str
) -> None:
    w1, w2, job, other = f"w1-{unique}", f"w2-{unique}", f"j-{unique}", f"o-{unique}"
    reservations = Reservations(rclient)
    inflight = InflightStore(rclient, BrokerStore(rclient, 1000))
    now_ms = int(time.time() * 1000)
    await reservations.reserve_many([_hold(w1, job), _hold(w1, other)], now_ms)
    # Two replicas claim the same death at once: each job goes to exactly one of them.
    first, second = await asyncio.gather(inflight.claim([w1], now_ms), inflight.claim([w1], now_ms))
    won = first[w1] + second[w1]
    assert sorted(j.job_id for j in won) == sorted([job, other])
    assert {j.crashes for j in won} == {1}
    assert not await rclient.exists(keys.inflight_on(w1))
    # The job is placed again as attempt 2 on w2, which dies too: the count goes on.
    await reservations.reserve_many([_hold(w2, job, attempt=2)], now_ms)
    (lost,) = (await inflight.claim([w2], now_ms))[w2]
    assert (lost.attempt, lost.crashes, lost.crashed_on) == (2, 2, (w1, w2))
    # A late listing of the lost attempt on w2 is claimed once only.
    await rclient.zadd(keys.inflight_on(w2), {job: now_ms + 60_000})
    assert (await inflight.claim([w2], now_ms))[w2] == []


@redis_tier
async def test_a_claim_skips_a_job_placed_elsewhere_since(
    rclient: aioredis.Redis, unique: str
) -> None:
    w1, w2, job = f"w1-{unique}", f"w2-{unique}", f"j-{unique}"
    reservations = Reservations(rclient)
    now_ms = int(time.time() * 1000)
    await reservations.reserve_many([_hold(w1, job)], now_ms)
    await reservations.reserve_many([_hold(w2, job, attempt=2)], now_ms)  # the edge re-offered
    inflight = InflightStore(rclient, BrokerStore(rclient, 1000))
    assert (await inflight.claim([w1], now_ms))[w1] == []
    assert await rclient.hget(keys.inflight(job), "crashes") is None


@redis_tier
async def test_scripts_are_loaded_again_after_redis_forgets_them(
    rclient: aioredis.Redis, unique: str
) -> None:
    reservations = Reservations(rclient)
    now_ms = int(time.time() * 1000)
    assert await reservations.reserve_many([_hold(f"w-{unique}", f"a-{unique}")], now_ms)
    await rclient.script_flush()
    assert await reservations.reserve_many([_hold(f"w-{unique}", f"b-{unique}")], now_ms)
    assert await rclient.script_exists(CLAIM.sha) == [False]
    inflight = InflightStore(rclient, BrokerStore(rclient, 1000))
    assert len((await inflight.claim([f"w-{unique}"], now_ms))[f"w-{unique}"]) == 2


# -- real tier: broker processes, Mosquitto, Redis ------------------------------------------

EDGE = "line-1-pc"
ZONE = f"{FAB}/dc"
INTERVAL_S = 0.5  # the brokers' telemetry interval in these tests; workers report twice as often
# The replicas every test's campus lists (besides broker-1), each with its own key: a test
# runs at most two. Always the same ones, so every test's policy has the same version.
REPLICAS = ("broker-a", "broker-b")


@pytest.fixture(scope="module")
def mqtt() -> Iterator[ServerProcess]:
    """A Mosquitto of this module's own: retained statuses and wills stay here."""
    with running(start_mosquitto()) as server:
        yield server


@pytest.fixture
def broker_redis(fresh_redis_db: Callable[[], str]) -> str:
    """A Redis database of this test's own: the brokers here see every worker with jobs
    in flight campus-wide, and must see only this test's."""
    return fresh_redis_db()


@pytest.fixture
def campus(tmp_path: Path, mqtt: ServerProcess, broker_redis: str, unique: str) -> Campus:
    """An open campus (the module's Mosquitto is a plain one) whose policy lists
    :data:`REPLICAS` and four workers of this test's own."""
    workers = {f"w{i}-{unique}": (ZONE, "x86-cpu") for i in range(1, 5)}
    made = write_campus(
        tmp_path,
        key,
        mqtt_port=mqtt.port,
        redis_url=broker_redis,
        workers=workers,
        secure=False,
        confidential=False,  # workers played by hand hold no sealing key
    )
    list_brokers(made, REPLICAS)
    return made


class FakeWorker:
    """A pool worker as the broker sees one: retained capabilities and status, telemetry
    every half interval, and a Last Will. ``kill`` drops the TCP connection without a
    DISCONNECT, as a SIGKILL does; ``silence`` stops the telemetry but stays connected."""

    def __init__(self, port: int, worker_id: str) -> None:
        self.id = worker_id
        self._quiet = threading.Event()
        connected = threading.Event()
        self.client = paho.Client(
            CallbackAPIVersion.VERSION2, client_id=f"fake-{worker_id}", protocol=paho.MQTTv5
        )
        offline = wire.NodeStatus(node=worker_id, kind="pool", zone=ZONE, state="offline")
        self.client.will_set(topics.worker_status(worker_id), wire.dump(offline), 1, True)
        self.client.on_connect = lambda *_: connected.set()
        self.client.connect("127.0.0.1", port, keepalive=60)
        self.client.loop_start()
        assert connected.wait(10)
        caps = WorkerCapabilities(
            worker_id=worker_id,
            zone=ZONE,
            device_class="x86-cpu",
            providers=["CPUExecutionProvider"],
            memory_total_mb=16000,
            models={"defect-v1": ModelCapability(version="1.0.0")},
            max_batch=8,
            concurrency=1,
        )
        online = wire.NodeStatus(node=worker_id, kind="pool", zone=ZONE, state="online")
        for topic, doc in (
            (topics.worker_capabilities(worker_id), caps),
            (topics.worker_status(worker_id), online),
        ):
            self.client.publish(topic, wire.dump(doc), qos=1, retain=True).wait_for_publish(10)
        self._thread = threading.Thread(target=self._report, name=f"tel-{worker_id}", daemon=True)
        self._thread.start()

    def _report(self) -> None:
        while not self._quiet.wait(INTERVAL_S / 2):
            tel = WorkerTelemetry(
                node=self.id,
                zone=ZONE,
                ts=time.time(),
                device_class="x86-cpu",
                utilisation=0.1,
                memory_used_mb=1000,
                memory_total_mb=16000,
                queue_depth=0,
                in_flight=0,
                capacity=64,
                models={},
                results={},
                refused={},
            )
            self.client.publish(topics.worker_telemetry(self.id), wire.dump(tel), qos=0)

    def silence(self) -> None:
        self._quiet.set()
        self._thread.join(5)

    def kill(self) -> None:
        self.silence()
        self.client.loop_stop()
        sock = self.client.socket()
        if sock is not None:
            sock.close()


class BrokerProcess:
    """``sluicegate broker run`` as its own process, as replica ``broker_id`` (one the policy
    lists, with its key) on its own HTTP port."""

    def __init__(
        self,
        campus: Campus,
        mqtt: ServerProcess,
        redis_url: str,
        broker_id: str = REPLICAS[0],
        **env: str,
    ) -> None:
        self.id = broker_id
        self.campus = campus
        self.http_port = free_port()
        watcher = PlainClient(mqtt.port)
        try:
            watcher.subscribe(topics.broker_status(self.id))
            environ = {
                **os.environ,
                "SLUICEGATE_BROKER__TELEMETRY_INTERVAL_S": str(INTERVAL_S),
                "SLUICEGATE_BROKER__MISSED_INTERVALS": "4",
                # Its workers are played: they take placements and complete nothing, which
                # a stalled one does too; the progress watch has tests of its own.
                "SLUICEGATE_BROKER__STALL_FLOOR_MS": "600000",
                "SLUICEGATE_BROKER__KEY_FILE": str(campus.root / f"{broker_id}.key"),
                **{f"SLUICEGATE_BROKER__{k.upper()}": v for k, v in env.items()},
            }
            self.proc = subprocess.Popen(
                sluicegate_cmd(
                    "broker",
                    "run",
                    "--config",
                    str(campus.node_config("broker-1")),
                    "--id",
                    self.id,
                    "--http-port",
                    str(self.http_port),
                    "--redis-url",
                    redis_url,
                ),
                env=environ,
            )
            while True:
                try:
                    got = watcher.next(timeout=1.0)
                except queue.Empty:
                    if self.proc.poll() is not None:
                        raise RuntimeError(f"broker exited with {self.proc.returncode}") from None
                    continue
                if b'"online"' in got.payload:
                    break
        finally:
            watcher.close()

    def http(self, path: str) -> tuple[int, Any]:
        url = f"http://127.0.0.1:{self.http_port}{path}"
        return get_json(url, self.campus.console_token("viewer"), timeout=10)

    def metric(self, name: str) -> float:
        """A counter's value (its labelled children summed); 0 if it has none yet."""
        text = self.http("/metrics")[1]
        pattern = rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$"
        return sum(float(m.group(2)) for m in re.finditer(pattern, text, re.MULTILINE))

    def kill(self) -> None:
        """SIGKILL: no cleanup at all."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGUSR1)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


class Edge:
    """Plays the edge agent: asks for placements and collects its notices."""

    def __init__(self, port: int) -> None:
        self.client = PlainClient(port)
        self.reply_topic = topics.placement_replies(EDGE)  # where the broker answers it
        self.client.subscribe(self.reply_topic)
        self.client.subscribe(topics.edge_notices(EDGE))
        self.notices: list[JobNotice] = []
        self._replies: dict[bytes, PlacementReply] = {}

    def place(self, job_id: str, attempt: int = 1, *, must_place: bool = True) -> PlacementReply:
        req = support.live_request(EDGE, job_id, deadline_s=120.0, attempt=attempt)
        props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        props.CorrelationData = f"{job_id}/{attempt}".encode()
        info = self.client.client.publish(
            topics.placement_request(EDGE), wire.dump(req), qos=1, properties=props
        )
        info.wait_for_publish(10)
        while props.CorrelationData not in self._replies:
            self._take()
        reply = self._replies.pop(props.CorrelationData)
        assert reply.status == "placed" or not must_place, reply
        return reply

    def _take(self) -> None:
        got = self.client.next(timeout=20)
        if got.topic == self.reply_topic:
            self._replies[got.correlation_data or b""] = PlacementReply.model_validate_json(
                got.payload
            )
        elif got.topic == topics.edge_notices(EDGE):
            self.notices.append(JobNotice.model_validate_json(got.payload))

    def wait_notices(self, jobs: set[str]) -> list[JobNotice]:
        """Notices until one has come for each of ``jobs``; returns theirs."""
        while not jobs <= {n.job_id for n in self.notices}:
            self._take()
        return [n for n in self.notices if n.job_id in jobs]

    def close(self) -> None:
        self.client.close()


def wait_until(check: Callable[[], Any], timeout: float = 20.0) -> Any:
    return support.wait_until(check, timeout)  # a broker's recovery takes longer


@pytest.fixture
def edge(mqtt: ServerProcess) -> Iterator[Edge]:
    made = Edge(mqtt.port)
    yield made
    made.close()


@pytest.fixture
def processes() -> Iterator[list[BrokerProcess | FakeWorker]]:
    """Brokers and workers a test starts; whatever is left is stopped at the end."""
    started: list[BrokerProcess | FakeWorker] = []
    yield started
    for thing in started:
        if isinstance(thing, BrokerProcess):
            thing.stop()
        else:
            thing.kill()


def _workers(campus: Campus, mqtt: ServerProcess, started: list[Any], n: int) -> list[FakeWorker]:
    names = sorted(n for n in campus.key_files if n.startswith("w"))[:n]
    made = [FakeWorker(mqtt.port, name) for name in names]
    started.extend(made)
    return made


def _online(broker: BrokerProcess, workers: list[FakeWorker]) -> None:
    def ready() -> bool:
        seen = {w["id"]: w for w in broker.http("/fleet")[1]["workers"]}
        return all(seen.get(w.id, {}).get("online") for w in workers)

    wait_until(ready)


def _replicas(
    campus: Campus, mqtt: ServerProcess, redis_url: str, started: list[Any], n: int
) -> tuple[list[BrokerProcess], list[FakeWorker]]:
    """Every replica of :data:`REPLICAS` and ``n`` workers, each replica seeing them all."""
    brokers = [BrokerProcess(campus, mqtt, redis_url, replica) for replica in REPLICAS]
    started.extend(brokers)
    workers = _workers(campus, mqtt, started, n)
    for broker in brokers:
        _online(broker, workers)
    return brokers, workers


def _jobs(n: int) -> list[str]:
    return [f"job-{uuid.uuid4().hex[:12]}" for _ in range(n)]


@pytest.mark.integration
def test_a_last_will_sends_worker_lost_for_exactly_its_jobs_keeping_the_attempt(
    campus: Campus,
    mqtt: ServerProcess,
    broker_redis: str,
    edge: Edge,
    processes: list[Any],
) -> None:
    broker = BrokerProcess(campus, mqtt, broker_redis)
    processes.append(broker)
    workers = _workers(campus, mqtt, processes, 2)
    _online(broker, workers)
    attempts = {job: 1 + i % 3 for i, job in enumerate(_jobs(8))}
    placed = {job: edge.place(job, attempt) for job, attempt in attempts.items()}
    victim = next(r.worker_id for r in placed.values())
    expected = {job: attempts[job] for job, r in placed.items() if r.worker_id == victim}
    next(w for w in workers if w.id == victim).kill()
    notices = edge.wait_notices(set(expected))
    assert {n.job_id: n.attempt for n in notices} == expected
    assert {(n.kind, n.worker_id, n.crashes) for n in notices} == {("worker_lost", victim, 1)}
    assert all("Last Will" in n.reason for n in notices)
    wait_until(lambda: broker.metric("sluicegate_worker_losses_total") >= 1)
    assert broker.metric("sluicegate_replacements_total") == len(expected)
    assert 'reason="last_will"' in broker.http("/metrics")[1]
    job = next(iter(expected))
    status, record = broker.http(f"/jobs/{job}")
    assert status == 200
    assert record["inflight"]["crashes"] == 1
    assert record["inflight"]["lost_attempt"] == expected[job]
    wait_until(lambda: _job_record(broker, job, "worker_lost"))
    survivors = {j for j, r in placed.items() if r.worker_id != victim}
    assert not survivors & {n.job_id for n in edge.notices}


@pytest.mark.integration
def test_the_kth_crash_dead_letters_the_job_with_its_reason_in_api_and_metrics(
    campus: Campus,
    mqtt: ServerProcess,
    broker_redis: str,
    edge: Edge,
    processes: list[Any],
) -> None:
    broker = BrokerProcess(campus, mqtt, broker_redis, max_worker_crashes="3")
    processes.append(broker)
    workers = {w.id: w for w in _workers(campus, mqtt, processes, 4)}  # one survives
    _online(broker, list(workers.values()))
    (job,) = _jobs(1)
    crashed = []
    for attempt in (1, 2, 3):
        reply = edge.place(job, attempt)
        assert reply.worker_id not in crashed  # a dead worker gets nothing
        assert reply.worker_id is not None
        crashed.append(reply.worker_id)
        workers[reply.worker_id].kill()
        (notice,) = [n for n in edge.wait_notices({job}) if n.attempt == attempt]
        edge.notices.clear()
        assert notice.crashes == attempt
        assert notice.kind == ("dead_letter" if attempt == 3 else "worker_lost")
    for worker in crashed:
        assert worker in notice.reason
    assert "3 workers" in notice.reason
    # The job's record is written by the broker's batched store, just after the notice.
    record = wait_until(lambda: _job_record(broker, job, "dead_letter"))
    assert record["inflight"]["dead_letter"]["reason"] == notice.reason
    assert record["inflight"]["crashed_on"] == crashed
    listed = broker.http("/dead-letters?limit=5")[1]["dead_letters"]
    assert listed[0]["job_id"] == job  # newest first
    assert listed[0]["reason"] == notice.reason
    assert broker.http("/dead-letters?limit=0")[0] == 400
    assert broker.metric("sluicegate_dead_letters_total") == 1
    assert broker.metric("sluicegate_replacements_total") == 2
    paths = broker.http("/openapi.json")[1]["paths"]
    assert "/dead-letters" in paths
    assert "sluicegate_dead_letters_total" in paths["/metrics"]["get"]["description"]
    _decision_on(broker_redis, broker, "job.dead_letter", job)
    # Asked again (an edge that missed the notice), it is refused, with a worker free.
    again = edge.place(job, 4, must_place=False)
    assert (again.status, again.code) == ("refused", "dead_letter")
    assert notice.reason in (again.reason or "")
    # An operator releases it for one retry: its edge is told to run its image again.
    actions = f"http://127.0.0.1:{broker.http_port}/console/api/actions"
    release = {"action": "release", "target": job, "note": "fixed the model"}
    assert post_json(actions, campus.console_token("viewer"), release)[0] == 403
    status, done = post_json(actions, campus.console_token("operator"), release)
    assert status == 200, done
    assert done["retry_id"] == f"{job}.retry"
    (told,) = [n for n in edge.wait_notices({job}) if n.kind == "released"]
    assert (told.retry_id, told.attempt) == (f"{job}.retry", 3)
    assert told.reason == "released by operator for one retry: fixed the model"
    status, twice = post_json(actions, campus.console_token("operator"), release)
    assert (status, "released already" in twice["error"]) == (409, True)
    unknown = {"action": "release", "target": "job-never-dead"}
    assert post_json(actions, campus.console_token("operator"), unknown)[0] == 404
    assert broker.http("/dead-letters?limit=5")[1]["dead_letters"] == []  # off the list
    retry = broker.http(f"/jobs/{job}")[1]["inflight"]["dead_letter"]["retry"]
    assert (retry["by"], retry["job_id"]) == ("operator", f"{job}.retry")
    assert _decision_on(broker_redis, broker, "operator.release", job)["note"] == "fixed the model"


def _job_record(broker: BrokerProcess, job: str, status: str) -> dict[str, Any] | None:
    """The job's record from the HTTP API once it has ``status``; None until then."""
    code, record = broker.http(f"/jobs/{job}")
    return record if code == 200 and record.get("status") == status else None


def _decision_on(redis_url: str, broker: BrokerProcess, kind: str, job: str) -> dict[str, Any]:
    """The decision on ``job`` in the first record of ``kind`` that holds one, once there is."""

    def found() -> dict[str, Any] | None:
        mine = [d for d in audited(redis_url, kind, broker.id) if d["job_id"] == job]
        return mine[0] if mine else None

    result: dict[str, Any] = wait_until(found)
    return result


def _complete(port: int, job: str, worker: str, attempt: int) -> None:
    done = Completion(
        job_id=job,
        worker_id=worker,
        status="ok",
        model="defect-v1",
        service_ms=5.0,
        queue_ms=1.0,
        batch_size=1,
        ts=time.time(),
        attempt=attempt,
        edge_id=EDGE,
    )
    client = PlainClient(port)
    try:
        info = client.client.publish(topics.completion(worker), wire.dump(done), qos=1)
        info.wait_for_publish(10)
    finally:
        client.close()


@pytest.mark.integration
def test_a_stale_completion_is_counted_audited_and_leaves_the_current_attempt(
    campus: Campus,
    mqtt: ServerProcess,
    broker_redis: str,
    edge: Edge,
    processes: list[Any],
) -> None:
    broker = BrokerProcess(campus, mqtt, broker_redis)
    processes.append(broker)
    workers = _workers(campus, mqtt, processes, 2)
    _online(broker, workers)
    (job,) = _jobs(1)
    first = edge.place(job, attempt=1)
    second = edge.place(job, attempt=2)  # the edge re-offered: no result came back in time
    assert first.worker_id is not None
    assert second.worker_id is not None
    _complete(mqtt.port, job, first.worker_id, attempt=1)
    wait_until(lambda: broker.metric("sluicegate_stale_completions_total") == 1)
    record = broker.http(f"/jobs/{job}")[1]
    assert (record["inflight"]["attempt"], record["inflight"]["worker"]) == (2, second.worker_id)
    audited = _decision_on(broker_redis, broker, "completion.stale", job)
    assert (audited["attempt"], audited["current_attempt"]) == (1, 2)
    assert audited["worker"] == first.worker_id
    _complete(mqtt.port, job, second.worker_id, attempt=2)
    wait_until(lambda: "inflight" not in broker.http(f"/jobs/{job}")[1])
    done = broker.http(f"/jobs/{job}")[1]
    assert (done["status"], done["attempt"]) == ("completed:ok", 2)
    assert broker.metric("sluicegate_stale_completions_total") == 1


@pytest.mark.integration
def test_a_restarted_broker_sends_the_notices_for_jobs_placed_before_it(
    campus: Campus,
    mqtt: ServerProcess,
    broker_redis: str,
    edge: Edge,
    processes: list[Any],
) -> None:
    first = BrokerProcess(campus, mqtt, broker_redis, REPLICAS[0])
    processes.append(first)
    workers = _workers(campus, mqtt, processes, 2)
    _online(first, workers)
    placed = {job: edge.place(job) for job in _jobs(6)}
    first.kill()  # SIGKILL: nothing flushed, nothing said
    second = BrokerProcess(campus, mqtt, broker_redis, REPLICAS[1])
    processes.append(second)
    # It reads what is in flight from Redis as it starts.
    wait_until(lambda: second.http("/health")[1]["inflight_at_start"]["jobs"] == len(placed))
    _online(second, workers)
    victim = workers[0]
    expected = {j for j, r in placed.items() if r.worker_id == victim.id}
    victim.kill()
    if not expected:  # every job went to the other worker: it is the one to lose
        victim = workers[1]
        expected = set(placed)
        victim.kill()
    notices = edge.wait_notices(expected)
    assert {n.job_id for n in notices} == expected
    assert {(n.kind, n.attempt) for n in notices} == {("worker_lost", 1)}
    wait_until(lambda: second.metric("sluicegate_replacements_total") == len(expected))


@pytest.mark.integration
def test_a_silent_worker_s_jobs_are_sent_back_once_it_times_out(
    campus: Campus,
    mqtt: ServerProcess,
    broker_redis: str,
    edge: Edge,
    processes: list[Any],
) -> None:
    broker = BrokerProcess(campus, mqtt, broker_redis)
    processes.append(broker)
    (worker,) = _workers(campus, mqtt, processes, 1)
    _online(broker, [worker])
    jobs = set(_jobs(3))
    for job in jobs:
        edge.place(job)
    worker.silence()  # connected, so no Last Will: only silence tells
    notices = edge.wait_notices(jobs)
    assert {(n.kind, n.worker_id) for n in notices} == {("worker_lost", worker.id)}
    assert all("telemetry went silent" in n.reason for n in notices)
    assert 'reason="silent"' in broker.http("/metrics")[1]


@pytest.mark.integration
def test_two_brokers_on_one_redis_send_one_notice_per_job(
    campus: Campus,
    mqtt: ServerProcess,
    broker_redis: str,
    edge: Edge,
    processes: list[Any],
) -> None:
    brokers, (worker,) = _replicas(campus, mqtt, broker_redis, processes, 1)
    jobs = set(_jobs(10))
    replies = [edge.place(job) for job in jobs]
    assert {r.broker_id for r in replies} == {b.id for b in brokers}  # both placed some
    worker.kill()
    notices = edge.wait_notices(jobs)
    # Both replicas saw the Last Will and acted on it; between them, one notice per job.
    for broker in brokers:
        wait_until(lambda b=broker: b.metric("sluicegate_worker_losses_total") >= 1)
    sent = sum(b.metric("sluicegate_replacements_total") for b in brokers)
    assert sent == len(jobs)
    assert sorted(n.job_id for n in notices) == sorted(jobs)


@pytest.mark.integration
def test_with_redis_away_requests_get_a_named_refusal_and_placement_resumes_when_it_is_back(
    tmp_path: Path, mqtt: ServerProcess, edge: Edge, processes: list[Any], unique: str
) -> None:
    # A Redis of this test's own, which it stops and starts again (its append-only file
    # keeps the replica's lease across the gap).
    with running(start_redis(appendonly=True, appendfsync="always")) as store:
        url = f"redis://{store.host}:{store.port}/0"
        workers = {f"w{i}-{unique}": (ZONE, "x86-cpu") for i in range(1, 3)}
        own = write_campus(
            tmp_path,
            key,
            mqtt_port=mqtt.port,
            redis_url=url,
            workers=workers,
            secure=False,
            confidential=False,  # workers played by hand hold no sealing key
        )
        list_brokers(own, REPLICAS)
        broker = BrokerProcess(own, mqtt, url)
        processes.append(broker)
        _online(broker, _workers(own, mqtt, processes, 1))
        placed = edge.place(_jobs(1)[0])
        store.stop()
        refused = edge.place(_jobs(1)[0], must_place=False)
        assert refused.status == "refused"
        assert refused.code == "broker_unavailable"
        assert "Redis could not reserve worker slots" in (refused.reason or "")
        status, body = broker.http(f"/jobs/{placed.job_id}")
        assert status == 503
        assert body["code"] == "store_unavailable"
        assert "Redis could not read a job's decision" in body["error"]
        store.start()
        assert edge.place(_jobs(1)[0]).status == "placed"
        assert broker.proc.poll() is None  # it served on throughout


@pytest.mark.integration
def test_a_replica_that_stopped_takes_no_share_of_the_requests(
    campus: Campus,
    mqtt: ServerProcess,
    broker_redis: str,
    edge: Edge,
    processes: list[Any],
) -> None:
    # Both replicas share the request subscription; one stops. Had it kept its MQTT
    # session, Mosquitto would go on handing it a share of the requests, lost unanswered.
    first = BrokerProcess(campus, mqtt, broker_redis, REPLICAS[0])
    second = BrokerProcess(campus, mqtt, broker_redis, REPLICAS[1])
    processes += [first, second]
    workers = _workers(campus, mqtt, processes, 2)
    _online(first, workers)
    _online(second, workers)
    second.stop()
    replies = [edge.place(job) for job in _jobs(6)]
    assert {r.status for r in replies} == {"placed"}


@pytest.mark.integration
def test_an_operators_hold_taken_on_one_replica_holds_on_every_replica(
    campus: Campus,
    mqtt: ServerProcess,
    broker_redis: str,
    edge: Edge,
    processes: list[Any],
) -> None:
    brokers, workers = _replicas(campus, mqtt, broker_redis, processes, 4)
    first, other = brokers
    operator = campus.console_token("operator")
    held, free = workers[:3], workers[3]
    for worker in held:
        status, body = post_json(
            f"http://127.0.0.1:{first.http_port}/console/api/actions",
            operator,
            {"action": "cordon", "target": worker.id, "note": "rack swap"},
        )
        assert status == 200, body

    def applied() -> bool:
        holds = other.http("/console/api/snapshot")[1]["holds"]
        return {h["target"] for h in holds} == {w.id for w in held}

    wait_until(applied)  # the other replica reads the holds from Redis within a second
    replies = [edge.place(job) for job in _jobs(12)]
    assert {r.broker_id for r in replies} == {b.id for b in brokers}  # both answered
    assert {r.worker_id for r in replies} == {free.id}


@pytest.mark.integration
def test_two_replicas_store_each_usage_record_once_and_both_acknowledge(
    campus: Campus,
    mqtt: ServerProcess,
    broker_redis: str,
    processes: list[Any],
    unique: str,
) -> None:
    brokers = [BrokerProcess(campus, mqtt, broker_redis, replica) for replica in REPLICAS]
    processes.extend(brokers)
    worker = f"w1-{unique}"
    records, prev = [], GENESIS
    for seq in (1, 2, 3):
        usage = Usage(
            node=worker,
            kind="pool",
            seq=seq,
            prev=prev.hex(),
            at_ms=1_780_000_000_000 + seq,
            event="ran",
            job_id=f"job-{seq}",
            attempt=1,
            line="line-1-pc",
            zone=ZONE,
            status="ok",
            device_us=1_500,
        )
        signed = sign_usage(usage, key(worker))
        records.append(signed)
        prev = signed.digest()
    client = PlainClient(mqtt.port)  # the open Mosquitto: it may speak as the worker
    try:
        client.subscribe(topics.usage_acks(worker))
        client.client.publish(topics.usage(worker), encode_batch(records), qos=1).wait_for_publish(
            10
        )
        acks = [UsageAck.model_validate_json(client.next().payload) for _ in REPLICAS]
    finally:
        client.close()
    assert sorted(a.broker for a in acks) == sorted(REPLICAS)
    assert all(sorted(a.held) == [1, 2, 3] and not a.refused for a in acks)
    assert redis.Redis.from_url(broker_redis).hlen(keys.usage_records(worker)) == 3
    assert sum(b.metric("sluicegate_usage_records_total") for b in brokers) == 3
    assert sum(b.metric("sluicegate_usage_duplicates_total") for b in brokers) == 3
    for broker in brokers:  # either replica exports the same records, under its own manifest
        status, body = get(
            f"http://127.0.0.1:{broker.http_port}/v1/usage/export?from=0&to=4000000000",
            campus.console_token("viewer"),
        )
        assert status == 200
        lines = body.rstrip(b"\n").split(b"\n")
        exported = [from_line(line) for line in lines[:-1]]
        assert [s.record for s in exported if s.record.node == worker] == [
            r.record for r in records
        ]
        assert all(s.receipt is not None and s.receipt.broker in REPLICAS for s in exported)
        manifest = ManifestLine.model_validate_json(lines[-1]).manifest
        assert manifest.broker == broker.id
        assert manifest.signature_valid(key(broker.id).public)
