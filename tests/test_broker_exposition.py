"""Real tier: the broker's ``/metrics`` checked against what was really sent to it, and its
scaling signal across a restart of the broker process.

A broker replica runs on real Mosquitto and Redis, with workers played by plain MQTT
publishers (as in ``test_broker_integration``). The counts test sends a known number of
placement requests and completions and reads the counters back; the audit chain's gauges
must match the stream in Redis. The restart test runs ``sluicegate broker run`` as a
process, stops it and starts it again: until a worker reports to the new process, the pool's
``sluicegate_pool_signal_age_seconds`` is ``+Inf`` while its desired workers read 0, which
is why the documented autoscaler query holds the last fresh value (docs/observability.md).
A pool with no worker running is asked for by the requests refused for want of one.
"""

from __future__ import annotations

import json
import math
import os
import queue
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

import broker.audit_check
from broker.run import serve
from policies import load_policy
from policies.redis_stores import audit_stream_key
from sluicegate import topics, wire
from sluicegate.app.campus import Campus, write_campus
from sluicegate.app.servers import ServerProcess, free_port
from sluicegate.config import Settings, load_settings
from sluicegate.wire_pool import (
    Completion,
    ModelCapability,
    PlacementReply,
    WorkerCapabilities,
    WorkerTelemetry,
)
from tests.metrics_kit import Samples, has, scrape, total
from tests.policies.policy_testkit import key
from tests.support import PlainClient, ServiceThread, live_request, sluicegate_cmd, wait_until

pytestmark = pytest.mark.integration

FAB = "campus/fab-north"
WORKERS = {"north-a": (f"{FAB}/dc", "x86-cpu"), "north-b": (f"{FAB}/dc", "x86-cpu")}
DC_POOL = "campus-fab-north-dc"  # the pool write_campus makes of the dc zone
EDGE = "line-1-pc"


SIGNAL_AGE, DESIRED = "sluicegate_pool_signal_age_seconds", "sluicegate_pool_desired_workers"


def metrics(port: int) -> Samples:
    return scrape(f"http://127.0.0.1:{port}/metrics")


@pytest.fixture(scope="module")
def campus(
    tmp_path_factory: pytest.TempPathFactory,
    mosquitto: ServerProcess,
    fresh_redis_db: Callable[[], str],
) -> Campus:
    return write_campus(
        tmp_path_factory.mktemp("exposition"),
        key,
        mqtt_port=mosquitto.port,
        redis_url=fresh_redis_db(),
        workers=WORKERS,
        secure=False,
        confidential=False,  # its workers are played by hand and hold no sealing key
    )


class Workers:
    """Plays the workers: capabilities (retained), telemetry and completions."""

    def __init__(self, port: int) -> None:
        self.client = PlainClient(port)

    def announce(self, *, queue_depth: int = 0) -> None:
        for worker, (zone, device) in WORKERS.items():
            caps = WorkerCapabilities(
                worker_id=worker,
                zone=zone,
                device_class=device,
                providers=["CPUExecutionProvider"],
                memory_total_mb=16000,
                max_batch=8,
                concurrency=1,
                models={"defect-v1": ModelCapability(version="1.0.0")},
            )
            self.client.client.publish(
                topics.worker_capabilities(worker), wire.dump(caps), qos=1, retain=True
            ).wait_for_publish(10)
            self.telemetry(worker, queue_depth=queue_depth)

    def telemetry(self, worker: str, *, queue_depth: int = 0) -> None:
        zone, device = WORKERS[worker]
        tel = WorkerTelemetry(
            node=worker,
            zone=zone,
            ts=time.time(),
            device_class=device,
            utilisation=0.2,
            memory_used_mb=1000,
            memory_total_mb=16000,
            memory_bandwidth=0.1,
            queue_depth=queue_depth,
            in_flight=0,
            capacity=16,
            models={},
            results={},
            refused={},
        )
        self.client.client.publish(
            topics.worker_telemetry(worker), wire.dump(tel), qos=1
        ).wait_for_publish(10)

    def complete(self, job_id: str, worker: str, status: str = "ok") -> None:
        done = Completion(
            job_id=job_id,
            worker_id=worker,
            status=status,
            model="defect-v1",
            service_ms=12.0,
            queue_ms=1.0,
            batch_size=1,
            ts=time.time(),
            edge_id=EDGE,
        )
        self.client.client.publish(
            topics.completion(worker), wire.dump(done), qos=1
        ).wait_for_publish(10)

    def forget(self) -> None:
        """Clear the retained capabilities, so the next test starts from nothing."""
        for worker in WORKERS:
            self.client.client.publish(
                topics.worker_capabilities(worker), b"", qos=1, retain=True
            ).wait_for_publish(10)
        self.client.close()


@pytest.fixture
def workers(mosquitto: ServerProcess) -> Iterator[Workers]:
    w = Workers(mosquitto.port)
    yield w
    w.forget()


def ask(client: PlainClient, model: str = "defect-v1") -> PlacementReply:
    job_id = uuid.uuid4().hex
    req = live_request(EDGE, job_id, model=model)
    client.client.publish(topics.placement_request(EDGE), wire.dump(req), qos=1)
    while True:
        got = PlacementReply.model_validate_json(client.next(timeout=15).payload)
        if got.job_id == job_id:
            return got


def test_counters_equal_what_was_sent(
    campus: Campus, mosquitto: ServerProcess, workers: Workers
) -> None:
    settings = load_settings(campus.node_config("broker-1"), broker={"http_port": free_port()})
    port = settings.broker.http_port
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(broker.audit_check, "INTERVAL_S", 0.2)
        thread = ServiceThread(lambda stop: serve(settings, stop, connect_timeout=10)).start()
        try:
            _counted(campus, settings, port, mosquitto, workers)
        finally:
            thread.stop()


def _counted(
    campus: Campus, settings: Settings, port: int, mosquitto: ServerProcess, workers: Workers
) -> None:
    # Ready, not merely up: the placement requests' subscription (QoS 0) is acked, so
    # the first request cannot be published into nothing.
    wait_until(lambda: _ready(port), timeout=20)
    before = time.time()
    workers.announce()
    after = time.time()
    wait_until(lambda: total(metrics(port), "sluicegate_workers", state="healthy") == 2)
    edge = PlainClient(mosquitto.port)
    edge.subscribe(topics.placement_replies(EDGE))
    replies = [ask(edge) for _ in range(7)] + [ask(edge, model="no-such-model") for _ in range(3)]
    edge.close()
    placed = [r for r in replies if r.status == "placed"]
    refused: dict[str, int] = {}
    for r in replies:
        if r.status == "refused":
            refused[r.code or ""] = refused.get(r.code or "", 0) + 1
    assert len(placed) == 7, replies
    for reply in placed[:5]:
        workers.complete(reply.job_id, reply.worker_id or "")
    workers.complete(placed[5].job_id, placed[5].worker_id or "", status="failed")
    wait_until(lambda: total(metrics(port), "sluicegate_completions_total") == 6)
    got = metrics(port)
    assert total(got, "sluicegate_placement_decisions_total", outcome="placed") == 7
    assert total(got, "sluicegate_placement_decisions_total", outcome="refused") == 3
    for code, n in refused.items():
        assert total(got, "sluicegate_placement_refusals_total", code=code) == n
    assert total(got, "sluicegate_placement_refusals_total") == 3
    assert total(got, "sluicegate_placement_decision_seconds_count") == 10
    assert total(got, "sluicegate_completions_total", status="ok") == 5
    assert total(got, "sluicegate_completions_total", status="failed") == 1
    assert total(got, "sluicegate_offloaded_job_seconds_count") == 6
    assert total(got, "sluicegate_offloaded_job_seconds_sum") == pytest.approx(6 * 0.012)
    # The fleet's and the policy's gauges.
    policy = load_policy(campus.policy_file)
    assert total(got, "sluicegate_policy_version") == policy.version
    assert total(got, "sluicegate_policy_expiry_timestamp_seconds") == policy.expires
    for worker in WORKERS:
        assert has(got, "sluicegate_worker_last_seen_timestamp_seconds", worker=worker)
        seen = total(got, "sluicegate_worker_last_seen_timestamp_seconds", worker=worker)
        assert before <= seen <= after + 1.0
    assert has(got, "sluicegate_pool_signal_age_seconds", pool=DC_POOL)
    age = total(got, "sluicegate_pool_signal_age_seconds", pool=DC_POOL)
    assert 0.0 <= age < 30.0
    assert has(got, "sluicegate_pool_desired_workers", pool=DC_POOL)
    # The audit chain: every record in Redis verified, none failed.
    stream = redis.Redis.from_url(settings.broker.redis_url)
    try:
        written = wait_until(lambda: stream.xlen(audit_stream_key("broker-1")) >= 10)
        assert written
        length = stream.xlen(audit_stream_key("broker-1"))
    finally:
        stream.close()
    wait_until(lambda: total(metrics(port), "sluicegate_audit_chain_records") == length)
    audit = metrics(port)
    assert has(audit, "sluicegate_audit_verify_failures_total")
    assert total(audit, "sluicegate_audit_verify_failures_total") == 0
    assert has(audit, "sluicegate_audit_verified_timestamp_seconds")
    verified = total(audit, "sluicegate_audit_verified_timestamp_seconds")
    assert verified >= before


def _ready(port: int) -> bool:
    """Whether the broker's ``/health`` answers 200 (urllib raises on a 503)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as resp:
            checks = json.loads(resp.read())["checks"]
    except OSError:
        return False
    assert checks["placements"] is True
    return True


class BrokerProcess:
    """``sluicegate broker run`` as its own process, on its own HTTP port."""

    def __init__(self, campus: Campus, mosquitto: ServerProcess, http_port: int) -> None:
        self.port = http_port
        watcher = PlainClient(mosquitto.port)
        try:
            watcher.subscribe(topics.broker_status("broker-1"))
            self.proc = subprocess.Popen(
                sluicegate_cmd(
                    "broker",
                    "run",
                    "--config",
                    str(campus.node_config("broker-1")),
                    "--http-port",
                    str(http_port),
                ),
                env=dict(os.environ),
            )
            while True:
                try:
                    got = watcher.next(timeout=1.0)
                except queue.Empty:
                    if self.proc.poll() is not None:
                        raise RuntimeError(f"broker exited with {self.proc.returncode}") from None
                    continue
                if b'"online"' in got.payload and not got.retain:
                    break
        finally:
            watcher.close()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.mark.slow
def test_the_scaling_signal_across_a_broker_restart(
    campus: Campus, mosquitto: ServerProcess, workers: Workers
) -> None:
    port = free_port()
    first = BrokerProcess(campus, mosquitto, port)
    try:
        workers.announce(queue_depth=12)  # a backlog: the pool needs workers
        before = wait_until(lambda: _signal(port, fresh=True))
    finally:
        first.stop()
    second = BrokerProcess(campus, mosquitto, port)
    try:
        # Capabilities are retained and come back at once; telemetry is not.
        stale = _signal(port, fresh=False)
        assert stale is not None
        assert stale[0] == math.inf  # the age says the signal is not to be trusted
        assert stale[1] == 0  # ... which would otherwise say "no workers needed"
        for worker in WORKERS:
            workers.telemetry(worker, queue_depth=12)
        after = wait_until(lambda: _signal(port, fresh=True))
    finally:
        second.stop()
    assert before[1] >= 1
    assert after[1] == before[1]
    assert after[0] < 30.0


def _signal(port: int, *, fresh: bool) -> tuple[float, float] | None:
    """(signal age, desired workers) of the dc pool; None until ``fresh`` matches."""
    got = metrics(port)
    there = [has(got, name, pool=DC_POOL) for name in (SIGNAL_AGE, DESIRED)]
    age, desired = (total(got, name, pool=DC_POOL) for name in (SIGNAL_AGE, DESIRED))
    if not all(there) or (fresh and (math.isinf(age) or desired < 1)):
        return None
    return age, desired


def test_a_pool_scaled_to_zero_is_asked_for_by_the_requests_it_could_not_take(
    tmp_path: Path, mosquitto: ServerProcess, fresh_redis_db: Callable[[], str]
) -> None:
    """No worker of the campus runs: each wafer image is refused ``no_worker``, and the
    on-campus pool its class may reach reads a desired worker (the off-site one, which
    wafers may not reach, none), so an autoscaler following the signal starts one."""
    zero = write_campus(
        tmp_path, key, mqtt_port=mosquitto.port, redis_url=fresh_redis_db(), secure=False
    )
    settings = load_settings(zero.node_config("broker-1"), broker={"http_port": free_port()})
    port = settings.broker.http_port
    on_campus, off_site = "campus-fab-north-dc", "offsite-cloud-east"
    thread = ServiceThread(lambda stop: serve(settings, stop, connect_timeout=10)).start()
    edge = PlainClient(mosquitto.port)
    try:
        wait_until(lambda: _ready(port), timeout=20)
        assert total(metrics(port), DESIRED, pool=on_campus) == 0
        edge.subscribe(topics.placement_replies(EDGE))
        codes = {ask(edge).code for _ in range(5)}
        assert codes == {"no_worker"}
        wait_until(lambda: total(metrics(port), DESIRED, pool=on_campus) >= 1)
        assert total(metrics(port), DESIRED, pool=off_site) == 0
    finally:
        edge.close()
        thread.stop()
