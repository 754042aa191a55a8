"""Benchmark: placement decisions per second through one broker process, beside a bare paho
relay answering the same requests (the floor of MQTT request/reply on this machine).

Processes: a Mosquitto and a Redis started for the run; one ``sluicegate broker run``
replica over a campus policy with ``--workers`` pool workers, played by this driver, which
publishes their capabilities and telemetry (large capacity, so every request can be
placed); ``bench/relay.py`` on another topic; the driver, a plain paho-mqtt v5 client
keeping ``--window`` requests outstanding, as edge ``line-1-pc`` (on its request topic;
the broker answers on that edge's reply topic, where the relay is told to answer too).
Rounds alternate broker and relay. Each broker reply is a real decision: policy, index,
atomic Redis reservation, a signed token and an audit record. The campus is written open
(no TLS, no ACL: ``secure=False``), as the figures before identity-by-topic were measured.

    .venv/bin/python bench/broker_throughput.py            # about 40 s on 2 cores
    .venv/bin/python bench/broker_throughput.py --seconds 10 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import stats  # noqa: E402
from policies import SigningKey  # noqa: E402
from sluicegate import topics, wire  # noqa: E402
from sluicegate.app.campus import write_campus  # noqa: E402
from sluicegate.app.servers import free_port, running, start_mosquitto, start_redis  # noqa: E402
from sluicegate.wire_pool import (  # noqa: E402
    ModelCapability,
    PlacementRequest,
    WorkerCapabilities,
    WorkerTelemetry,
)

ZONE, EDGE = "campus/fab-north/dc", "line-1-pc"
RELAY_TOPIC = "bench/relay/placement"
TARGET = {"decisions_per_s": 3000.0}
# DESIGN.md's floor for the same bare paho relay on its 2-core reference machine. The
# target is 3,000/7,000 of that floor; scaled by the relay measured here, it says what
# 3,000/s means on this machine. Both verdicts are printed; ``met`` is the absolute one.
DESIGN_RELAY_PER_S = 7000.0


class Driver:
    def __init__(self, port: int) -> None:
        self.reply_topic = topics.placement_replies(EDGE)  # the broker answers the edge here
        self.cond = threading.Condition()
        self.replies = 0
        self.statuses: dict[str, int] = {}  # broker replies by status
        self.counting = False
        self.client = paho.Client(CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
        self.client.on_socket_open = lambda _c, _u, s: s.setsockopt(6, 1, 1)  # TCP_NODELAY
        self.client.on_message = self._on_message
        ready = threading.Event()
        self.client.on_connect = lambda *a: ready.set()
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        ready.wait(10)
        subscribed = threading.Event()
        self.client.on_subscribe = lambda *a: subscribed.set()
        self.client.subscribe(self.reply_topic, qos=1)
        subscribed.wait(10)
        self.payloads = [self._request(i) for i in range(512)]

    def wait_online(self, topic: str, timeout: float = 60.0) -> None:
        """Wait for a node's retained status to say online (requests sent before its
        subscriptions exist are lost, and each would stall a round for seconds)."""
        online = threading.Event()

        def on_status(_c: paho.Client, _u: object, msg: paho.MQTTMessage) -> None:
            if json.loads(msg.payload).get("state") == "online":
                online.set()

        self.client.message_callback_add(topic, on_status)
        self.client.subscribe(topic, qos=1)
        if not online.wait(timeout):
            raise SystemExit(f"no online status on {topic} within {timeout:.0f} s")
        self.client.unsubscribe(topic)
        self.client.message_callback_remove(topic)

    def _request(self, i: int) -> bytes:
        now = time.time()
        return wire.dump(
            PlacementRequest(
                job_id=f"bench-{i}-{os.getpid()}",
                edge_id=EDGE,
                model="defect-v1",
                data_class="wafer-image",
                payload_sha256=f"{i:064x}",
                payload_bytes=100_000,
                priority=5,
                deadline_at=now + 3600.0,
                submitted_at=now,
            )
        )

    def _on_message(self, _c: paho.Client, _u: object, msg: paho.MQTTMessage) -> None:
        with self.cond:
            self.replies += 1
            if self.counting:
                status = json.loads(msg.payload)["status"]
                self.statuses[status] = self.statuses.get(status, 0) + 1
            self.cond.notify_all()

    def round(
        self,
        topic: str,
        seconds: float,
        window: int,
        *,
        count: bool = False,
        serving: int | None = None,
    ) -> tuple[float, float]:
        """Requests answered per second, and the CPU per request (µs) of the answering
        process (``serving``, a pid)."""
        cpu0 = _cpu(serving)
        with self.cond:
            self.replies = 0
            self.counting = count
        sent = 0
        t0 = time.perf_counter()
        while time.perf_counter() < t0 + seconds:
            with self.cond:
                self.cond.wait_for(partial(self._room, sent - window), 5.0)
            props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
            props.ResponseTopic = self.reply_topic  # the relay's; the broker knows the edge's
            props.CorrelationData = str(sent).encode()
            # Unique job ids matter to the broker (one reservation per job).
            payload = self.payloads[sent % len(self.payloads)].replace(
                b'"job_id":"bench-', f'"job_id":"r{t0:.0f}-{sent}-'.encode(), 1
            )
            self.client.publish(topic, payload, qos=0, properties=props)  # as the edge does
            sent += 1
        with self.cond:
            self.cond.wait_for(lambda: self.replies >= sent, 30.0)
        rate = self.replies / (time.perf_counter() - t0)
        return rate, (_cpu(serving) - cpu0) * 1e6 / max(self.replies, 1)

    def _room(self, limit: int) -> bool:
        return self.replies > limit


def _cpu(pid: int | None) -> float:
    return 0.0 if pid is None else stats.cpu_s(pid)


def fleet_publisher(port: int, workers: list[str], stop: threading.Event) -> None:
    """Play ``workers``: retained capabilities once, telemetry every second."""
    client = paho.Client(CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
    client.connect("127.0.0.1", port)
    client.loop_start()
    for w in workers:
        caps = WorkerCapabilities(
            worker_id=w,
            zone=ZONE,
            device_class="x86-cpu",
            providers=["CPUExecutionProvider"],
            memory_total_mb=64000,
            models={"defect-v1": ModelCapability(version="1.0.0")},
            max_batch=8,
            concurrency=2,
        )
        client.publish(topics.worker_capabilities(w), wire.dump(caps), qos=1, retain=True)
    while not stop.is_set():
        for w in workers:
            tel = WorkerTelemetry(
                node=w,
                zone=ZONE,
                ts=time.time(),
                device_class="x86-cpu",
                utilisation=0.2,
                memory_used_mb=1000,
                memory_total_mb=64000,
                queue_depth=0,
                in_flight=0,
                capacity=1_000_000,
                models={},
                results={},
                refused={},
            )
            client.publish(topics.worker_telemetry(w), wire.dump(tel), qos=0)
        stop.wait(1.0)
    client.disconnect()
    client.loop_stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0, help="length of a round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window", type=int, default=64, help="requests outstanding")
    ap.add_argument("--workers", type=int, default=50)
    args = ap.parse_args()
    workers = [f"w{i:04d}" for i in range(args.workers)]
    with (
        running(start_mosquitto()) as mqtt,
        running(start_redis()) as redis,
        tempfile.TemporaryDirectory(prefix="sg-bench-") as tmp,
    ):
        campus = write_campus(
            Path(tmp),
            lambda _n: SigningKey.generate(),
            mqtt_port=mqtt.port,
            redis_url=f"redis://127.0.0.1:{redis.port}/0",
            workers=dict.fromkeys(workers, (ZONE, "x86-cpu")),
            http_port=free_port(),
            secure=False,
        )
        cmd = [
            sys.executable,
            "-m",
            "sluicegate.app.cli",
            "broker",
            "run",
            "--log-level",
            "warning",
        ]
        if profile := os.environ.get("SG_BENCH_PROFILE"):  # a cProfile of the broker, to read
            cmd[1:1] = ["-m", "cProfile", "-o", profile]
        broker = subprocess.Popen([*cmd, "--config", str(campus.node_config("broker-1"))])
        relay = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "bench" / "relay.py"),
                str(mqtt.port),
                "x",
                RELAY_TOPIC,
                "0",  # QoS 0 in and out, as on the broker's placement path
            ]
        )
        stop = threading.Event()
        feeder = threading.Thread(target=fleet_publisher, args=(mqtt.port, workers, stop))
        feeder.start()
        driver = Driver(mqtt.port)
        driver.wait_online(topics.broker_status("broker-1"))
        subject: list[float] = []
        baseline: list[float] = []
        subject_cpu: list[float] = []  # the broker's CPU µs per decision, each round
        baseline_cpu: list[float] = []
        try:
            requests = topics.placement_request(EDGE)
            driver.round(requests, 2.0, args.window)  # warm-up
            for _ in range(args.rounds):
                rate, cpu = driver.round(
                    requests,
                    args.seconds,
                    args.window,
                    count=True,
                    serving=broker.pid,
                )
                subject.append(rate)
                subject_cpu.append(cpu)
                rate, cpu = driver.round(RELAY_TOPIC, args.seconds, args.window, serving=relay.pid)
                baseline.append(rate)
                baseline_cpu.append(cpu)
        finally:
            stop.set()
            feeder.join()
            broker.terminate()
            relay.kill()
            broker.wait(20)
            relay.wait(20)
    report(args, subject, baseline, driver.statuses, subject_cpu, baseline_cpu)


def report(
    args: argparse.Namespace,
    subject: list[float],
    baseline: list[float],
    statuses: dict[str, int],
    subject_cpu: list[float],
    baseline_cpu: list[float],
) -> None:
    med_s, med_b = stats.median(subject), stats.median(baseline)
    cpu_s, cpu_b = stats.median(subject_cpu), stats.median(baseline_cpu)
    print(
        f"broker throughput: {args.workers} workers, window {args.window}, {args.rounds} rounds "
        f"of {args.seconds:g} s, nproc {os.cpu_count()}; replies by status {statuses}"
    )
    print(f"  broker decisions/s   {med_s:8.0f}   rounds {[round(x) for x in subject]}")
    print(f"  bare paho relay /s   {med_b:8.0f}   rounds {[round(x) for x in baseline]}")
    print(f"  broker CPU per decision {cpu_s:5.0f} µs   rounds {[round(x) for x in subject_cpu]}")
    print(f"  relay CPU per request   {cpu_b:5.0f} µs   rounds {[round(x) for x in baseline_cpu]}")
    ratio = med_s / med_b
    scaled = TARGET["decisions_per_s"] * med_b / DESIGN_RELAY_PER_S
    print(f"  broker / relay       {ratio:8.2f}")
    print(
        f"  target               {TARGET['decisions_per_s']:8.0f}   absolute; scaled by this "
        f"machine's relay ({med_b:.0f} vs DESIGN's {DESIGN_RELAY_PER_S:.0f}/s): {scaled:.0f}/s, "
        f"ratio {TARGET['decisions_per_s'] / DESIGN_RELAY_PER_S:.2f} of the relay"
    )
    result = {
        "bench": "broker_throughput",
        "subject": {
            "decisions_per_s": med_s,
            "rounds": subject,
            "statuses": statuses,
            "cpu_us_per_decision": cpu_s,
        },
        "baseline": {"relay_per_s": med_b, "rounds": baseline, "cpu_us_per_request": cpu_b},
        "ratio": {"broker_over_relay": ratio},
        "target": {**TARGET, "scaled_to_this_machine": scaled},
        "met": med_s >= TARGET["decisions_per_s"],
        "met_scaled": med_s >= scaled,
        "params": vars(args),
        "machine": stats.machine("redis"),
    }
    print(stats.result_line(result))


if __name__ == "__main__":
    main()
