"""Real tier: a pool worker (real MQTT transport, real ONNX Runtime, Redis replay cache and
audit stream) against real Mosquitto and redis-server, driven by a bare paho client that
publishes work messages exactly as an edge agent would.

The module gets a Mosquitto of its own: the retained policy topic is global. It is a plain
one (no TLS, no ACL), so the worker runs with ``[mqtt] plaintext``; each test sends as an
edge of its own that the policy lists.
"""

from __future__ import annotations

import asyncio
import json
import queue
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from center_pool.service import serve
from center_pool.worker import PoolWorker
from policies import SigningKey, verify_chain
from policies.audit import decode_record
from policies.redis_stores import RedisStreamAuditStore, audit_stream_key
from sluicegate import topics
from sluicegate.app.servers import ServerProcess, running, start_mosquitto
from sluicegate.config import Settings, load_settings
from sluicegate.transport import Message
from tests.policies.policy_testkit import policy_of
from tests.pool_kit import (
    JPEG,
    SPARE_EDGES,
    TRUTH,
    WORKER,
    WORKER_ZONE,
    WorkSpec,
    envelope,
    flip_bit,
    policy_doc,
    token,
    write_policy_file,
)
from tests.support import PlainClient, Received, sluicegate_cmd

pytestmark = pytest.mark.integration

PLAINTEXT = "[mqtt]\nplaintext = true\n"  # a worker process on the plain test Mosquitto
_edges = iter(SPARE_EDGES)


class WorkerThread:
    """``center_pool.service.serve`` on its own thread and event loop."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.worker: PoolWorker | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pool-worker", daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self.worker = await serve(self.settings, self._stop, connect_timeout=10)

        try:
            asyncio.run(main())
        except BaseException as exc:
            self.error = exc

    def start(self, watcher: PlainClient) -> None:
        watcher.subscribe(topics.worker_status(self.settings.pool.id))
        self._thread.start()
        wait_online(watcher, lambda: self.error)

    def stop(self) -> PoolWorker:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        if self.error is not None:
            raise self.error
        assert self.worker is not None
        return self.worker


def wait_online(watcher: PlainClient, failed: Any) -> None:
    while True:
        try:
            got = watcher.next(timeout=1.0)
        except queue.Empty:
            if failed():
                raise RuntimeError(f"worker did not start: {failed()}") from None
            continue
        if got.topic.endswith("/status") and b'"online"' in got.payload:
            return


def publish_work(client: PlainClient, msg: Message) -> None:
    """Publish ``msg`` (built by ``WorkSpec``) to its work topic with a bare paho client."""
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    if msg.correlation_data is not None:
        props.CorrelationData = msg.correlation_data
    if msg.content_type is not None:
        props.ContentType = msg.content_type
    props.UserProperty = list(msg.user_properties)
    client.client.publish(msg.topic, msg.payload, qos=1, properties=props).wait_for_publish(10)


@pytest.fixture(scope="module")
def broker() -> Iterator[ServerProcess]:
    with running(start_mosquitto()) as server:
        yield server


@pytest.fixture(scope="module")
def worker_key(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SigningKey]:
    key = SigningKey.generate()
    path = tmp_path_factory.mktemp("keys") / "worker.key"
    path.write_bytes(key.to_pem())
    return path, key


@pytest.fixture(scope="module")
def pool_redis(fresh_redis_db: Callable[[], str]) -> str:
    """The module worker's Redis database: its audit stream holds only its records."""
    return fresh_redis_db()


@pytest.fixture(scope="module")
def pool(
    broker: ServerProcess,
    pool_redis: str,
    worker_key: tuple[Path, SigningKey],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[WorkerThread]:
    folder = tmp_path_factory.mktemp("pool")
    settings = load_settings(
        mqtt={"port": broker.port, "plaintext": True},
        pool={
            "id": WORKER,
            "zone": WORKER_ZONE,
            "redis_url": pool_redis,
            "key_file": worker_key[0],
            "policy_file": write_policy_file(folder),
            "state_dir": folder / "state",
            "batch_window_ms": 20.0,
            "telemetry_interval_s": 0.2,
        },
    )
    watcher = PlainClient(broker.port)
    thread = WorkerThread(settings)
    thread.start(watcher)
    watcher.close()
    yield thread
    thread.stop()


class App:
    """Plays the edge agent that placed the jobs: its returns topic (where the worker sends
    results) plus the worker's completions, on one plain client. Each test sends as an edge
    of its own (one of the policy's spare edges)."""

    def __init__(self, port: int) -> None:
        self.client = PlainClient(port)
        self.edge = next(_edges)
        self.returns = topics.edge_returns(self.edge, WORKER)
        self.client.subscribe(self.returns)
        self.client.subscribe(topics.completion(WORKER))
        self.seen: list[Received] = []

    def work(self, spec: WorkSpec) -> Message:
        """``spec`` as this edge sends it: on the worker's work topic under its id."""
        return replace(spec, edge=self.edge).message()

    def send(self, work: WorkSpec | Message) -> Message:
        """Publish ``work`` (a spec, sent as this edge, or a message built by :meth:`work`)."""
        msg = self.work(work) if isinstance(work, WorkSpec) else work
        publish_work(self.client, msg)
        return msg

    def _take(self, want: Any) -> Received:
        for got in self.seen:
            if want(got):
                self.seen.remove(got)
                return got
        while True:
            got = self.client.next(timeout=15)
            if want(got):
                return got
            self.seen.append(got)

    def result(self, msg: Message) -> dict[str, Any]:
        got = self._take(
            lambda r: r.topic == self.returns and r.correlation_data == msg.correlation_data
        )
        assert got.content_type == "application/json"
        doc: dict[str, Any] = json.loads(got.payload)
        return doc

    def completion(self, job_id: str) -> dict[str, Any]:
        got = self._take(
            lambda r: (
                r.topic == topics.completion(WORKER) and json.loads(r.payload)["job_id"] == job_id
            )
        )
        doc: dict[str, Any] = json.loads(got.payload)
        return doc


@pytest.fixture
def app(broker: ServerProcess) -> Iterator[App]:
    client = App(broker.port)
    yield client
    client.client.close()


def _job_id(msg: Message) -> str:
    return msg.user_property(topics.PROP_JOB_ID) or ""


def test_placed_job_gets_its_result_and_the_broker_a_completion(
    app: App, pool: WorkerThread, broker: ServerProcess
) -> None:
    msg = app.send(WorkSpec(correlation=b"\x00corr\xff"))
    result = app.result(msg)
    assert result["status"] == "ok", result
    assert result["outputs"]["label"] == TRUTH
    assert result["ran_on"] == {"kind": "pool", "node": WORKER, "zone": WORKER_ZONE}
    assert result["offload"] == {"requested": True, "placed": True, "worker": WORKER}
    record = app.completion(_job_id(msg))
    assert (record["status"], record["worker_id"], record["model"]) == ("ok", WORKER, "defect-v1")
    assert (record["attempt"], record["edge_id"]) == (1, app.edge)
    assert record["batch_size"] >= 1
    assert record["service_ms"] > 0

    late = PlainClient(broker.port)  # a fresh subscriber sees the retained documents
    try:
        late.subscribe(topics.worker_capabilities(WORKER))
        caps = json.loads(late.next().payload)
        assert caps["models"]["defect-v1"]["version"] == "1.0.0"
        assert "CPUExecutionProvider" in caps["providers"]
    finally:
        late.close()


def test_refused_before_decoding_audited_and_the_worker_keeps_serving(
    app: App, pool: WorkerThread, pool_redis: str, worker_key: tuple[Path, SigningKey]
) -> None:
    not_an_image = b"GIF89a? no: not even that"
    first = app.send(WorkSpec(job_id=f"twice-{uuid.uuid4().hex[:6]}"))
    assert app.result(first)["status"] == "ok"
    sent = {
        "token.replayed": replace(first, correlation_data=b"replay"),
        "token.missing": app.work(WorkSpec(token="")),
        "token.bad_signature": app.work(
            WorkSpec(
                job_id="flip", payload=not_an_image, token=flip_bit(token("flip", not_an_image))
            )
        ),
        "token.wrong_target": app.work(
            WorkSpec(job_id="other", token=token("other", JPEG, worker="south-npu-1"))
        ),
        "token.payload_mismatch": app.work(
            WorkSpec(job_id="swap", payload=not_an_image, token=token("swap", JPEG))
        ),
        "token.expired": app.work(
            WorkSpec(job_id="old", token=token("old", JPEG, now=time.time() - 60))
        ),
        # The origin checked is the sending edge's zone in the policy: a token minted for
        # another line's job is refused even if the message claims that line.
        "token.wrong_origin": app.work(
            WorkSpec(
                job_id="south",
                token=token("south", JPEG, origin="campus/fab-south/line-1"),
                origin_property="campus/fab-south/line-1",
            )
        ),
        "edge.id_mismatch": app.work(WorkSpec(job_id="forged", edge_property="north-l1-pc")),
    }
    for msg in sent.values():
        app.send(msg)
    for code, msg in sent.items():
        result = app.result(msg)
        assert (result["status"], result["code"]) == ("rejected", code), result
        assert "bad_image" not in result["reason"]
    after = app.send(WorkSpec())
    assert app.result(after)["status"] == "ok"

    client = redis.Redis.from_url(pool_redis)
    try:
        store = RedisStreamAuditStore(client, audit_stream_key(WORKER))
        deadline = time.monotonic() + 10
        while True:
            entries = list(store.entries())
            reasons = [decode_record(e).data.get("reason") for e in entries]
            if set(sent) <= set(reasons) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        client.close()
    summary = verify_chain(entries, {worker_key[1].public})
    assert summary.count == len(entries)
    assert set(sent) <= set(reasons)
    jobs = {str(decode_record(e).data.get("job_id")) for e in entries}
    assert {"flip", "other", "swap", "old", "south", "forged"} <= jobs


def test_a_burst_of_same_model_jobs_comes_back_in_fewer_batches(
    app: App, pool: WorkerThread
) -> None:
    messages = [app.work(WorkSpec()) for _ in range(12)]
    for msg in messages:
        app.send(msg)
    for msg in messages:
        assert app.result(msg)["status"] == "ok"
    sizes = [app.completion(_job_id(msg))["batch_size"] for msg in messages]
    batches = sum(1 / size for size in sizes)  # each batch of k contributes k * (1/k)
    assert max(sizes) > 1
    assert round(batches) < len(messages)


# Keep this the last test on the module's worker: rollback protection means it cannot be undone.
def test_policy_on_the_retained_topic_replaces_the_bootstrap(
    app: App, pool: WorkerThread, broker: ServerProcess
) -> None:
    v2 = policy_of(policy_doc(version=2))
    plain = PlainClient(broker.port)
    try:
        info = plain.client.publish(topics.policy(), envelope(v2), qos=1, retain=True)
        info.wait_for_publish(10)
    finally:
        plain.close()
    # A token minted under v1 stops verifying once the worker holds v2.
    deadline = time.monotonic() + 10
    while True:
        result = app.result(app.send(WorkSpec()))
        if result["status"] != "ok" or time.monotonic() > deadline:
            break
    assert result["code"] == "token.policy_mismatch", result
    v2_job = WorkSpec(job_id="v2-job", token=token("v2-job", JPEG, policy=v2))
    assert app.result(app.send(v2_job))["status"] == "ok"


def test_cli_worker_serves_and_shares_the_replay_cache_across_restarts(
    redis_url: str, tmp_path: Path, worker_key: tuple[Path, SigningKey]
) -> None:
    with running(start_mosquitto()) as own:
        config = tmp_path / "pool.toml"
        config.write_text(
            PLAINTEXT + "[pool]\n"
            f'policy_file = "{write_policy_file(tmp_path)}"\n'
            f'state_dir = "{tmp_path / "state"}"\n'
            f'redis_url = "{redis_url}"\n'
            f'audit_path = "{tmp_path / "audit.jsonl"}"\n'
            f'key_file = "{worker_key[0]}"\n',
            encoding="utf-8",
        )
        app = App(own.port)
        msg = app.work(WorkSpec())
        try:
            for expected in ("ok", "token.replayed"):
                proc = start_pool_process(own.port, config)
                try:
                    result = app.result(app.send(replace(msg, correlation_data=expected.encode())))
                    assert result.get("code", result["status"]) == expected, result
                finally:
                    proc.terminate()
                    assert proc.wait(30) == 0
        finally:
            app.client.close()
    lines = (tmp_path / "audit.jsonl").read_bytes().splitlines()
    assert verify_chain(lines, {worker_key[1].public}).count == len(lines)
    kinds = [decode_record(line).kind for line in lines]
    assert kinds == ["policy.accepted", "policy.accepted", "work.refused"]
    anchor = json.loads((tmp_path / "state" / "policy-anchor.json").read_bytes())
    assert anchor["version"] == 1


def start_pool_process(
    port: int, config: Path, *, worker: tuple[str, str] = (WORKER, WORKER_ZONE)
) -> subprocess.Popen[bytes]:
    """``sluicegate pool run`` as its own process; returns once it is online."""
    watcher = PlainClient(port)
    try:
        watcher.subscribe(topics.worker_status(worker[0]))
        proc = subprocess.Popen(
            sluicegate_cmd(
                "pool",
                "run",
                "--config",
                str(config),
                "--port",
                str(port),
                "--id",
                worker[0],
                "--zone",
                worker[1],
                "--device-class",
                "x86-cpu",
            )
        )
        wait_online(watcher, lambda: proc.poll())
        return proc
    finally:
        watcher.close()


def test_after_a_broker_restart_the_worker_re_announces_and_serves(tmp_path: Path) -> None:
    with running(start_mosquitto()) as own:
        settings = load_settings(
            mqtt={"port": own.port, "reconnect_min_s": 1, "reconnect_max_s": 2, "plaintext": True},
            pool={"id": WORKER, "zone": WORKER_ZONE, "policy_file": write_policy_file(tmp_path)},
        )
        watcher = PlainClient(own.port)
        thread = WorkerThread(settings)
        thread.start(watcher)
        watcher.close()
        try:
            own.kill()  # no persistence: retained documents and sessions are gone
            own.restart()
            fresh = PlainClient(own.port)
            try:
                fresh.subscribe(topics.worker_all("capabilities"))
                fresh.subscribe(topics.worker_status(WORKER))
                seen = {fresh.next(timeout=20).topic for _ in range(2)}
                assert seen == {topics.worker_capabilities(WORKER), topics.worker_status(WORKER)}
            finally:
                fresh.close()
            app = App(own.port)
            try:
                assert app.result(app.send(WorkSpec()))["status"] == "ok"
            finally:
                app.client.close()
        finally:
            thread.stop()


def test_a_killed_worker_is_marked_offline_by_its_last_will(
    broker: ServerProcess, tmp_path: Path
) -> None:
    config = tmp_path / "pool.toml"
    config.write_text(PLAINTEXT + f'[pool]\npolicy_file = "{write_policy_file(tmp_path)}"\n')
    proc = start_pool_process(broker.port, config, worker=("cloud-gpu-1", "offsite/cloud-east"))
    watcher = PlainClient(broker.port)
    try:
        watcher.subscribe(topics.worker_status("cloud-gpu-1"))
        assert json.loads(watcher.next().payload)["state"] == "online"
        proc.kill()
        proc.wait(10)
        status = json.loads(watcher.next(timeout=20).payload)
        assert (status["node"], status["kind"], status["state"]) == (
            "cloud-gpu-1",
            "pool",
            "offline",
        )
    finally:
        watcher.close()
        if proc.poll() is None:
            proc.kill()


def test_cli_names_the_providers_it_would_accept(tmp_path: Path) -> None:
    config = tmp_path / "pool.toml"
    config.write_text(PLAINTEXT + '[pool]\nproviders = ["CANNExecutionProvider"]\n')
    done = subprocess.run(
        sluicegate_cmd("pool", "run", "--config", str(config), "--port", "1"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "CANNExecutionProvider" in done.stderr
    assert "available: " in done.stderr
    assert "Traceback" not in done.stderr
