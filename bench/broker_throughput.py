"""Benchmark: placement decisions per second through one broker process, beside a bare paho
relay answering the same requests (the floor of MQTT request/reply on this machine).

Processes: a Mosquitto and a Redis started for the run; one ``sluicegate broker run``
replica over a campus policy with ``--workers`` pool workers, played by this driver, which
publishes their capabilities (each with the sealing key the policy lists for it: wafer
images are confidential and go only to a worker they can be sealed to) and telemetry
(large capacity, so every request can be placed); ``bench/relay.py`` on another topic;
the driver, a plain paho-mqtt v5 client keeping ``--window`` requests outstanding, as
edge ``line-1-pc`` (on its request topic; the broker answers on that edge's reply topic,
where the relay is told to answer too). Rounds alternate broker and relay. The campus is
written open (no TLS, no ACL: ``secure=False``), as the figures before identity-by-topic
were measured.

What counts is grants: a reply ``placed`` is a whole decision (policy, index, an atomic
Redis reservation, a token signed and bound to the worker's sealing key, an audit
record). Refusals are counted apart, by code, and ``met`` is computed from grants a
second alone; since every played worker has room for every request, a run with any
refusal fails (the bench would be measuring refusals). The played workers complete
nothing, so the broker's progress watch, which stops placing on a busy worker that
completes nothing, is held off (``[broker] stall_floor_ms``). After the rounds a sample
of the granted tokens is verified against the campus policy as the edge verifies them,
and the reservations are counted in Redis; a run with no grant, no verified token or no
reservation fails.

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
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import paho.mqtt.client as paho
import redis as redis_sync
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import stats  # noqa: E402
from broker import keys  # noqa: E402
from policies import Policy, SigningKey, load_policy, verify  # noqa: E402
from sluicegate import topics, wire  # noqa: E402
from sluicegate.app.campus import write_campus  # noqa: E402
from sluicegate.app.servers import free_port, running, start_mosquitto, start_redis  # noqa: E402
from sluicegate.wire_pool import (  # noqa: E402
    ModelCapability,
    PlacementReply,
    PlacementRequest,
    WorkerCapabilities,
    WorkerTelemetry,
)

ZONE, EDGE, CLASS = "campus/fab-north/dc", "line-1-pc", "wafer-image"
RELAY_TOPIC = "bench/relay/placement"
TARGET = {"grants_per_s": 3000.0}
# DESIGN.md's floor for the same bare paho relay on its 2-core reference machine. The
# target is 3,000/7,000 of that floor; scaled by the relay measured here, it says what
# 3,000/s means on this machine. Both verdicts are printed; ``met`` is the absolute one.
SAMPLED = 32  # granted replies kept, their tokens verified after the rounds
DESIGN_RELAY_PER_S = 7000.0
STALL_OFF_MS = 3_600_000  # [broker] stall_floor_ms at its most: the progress watch held off


@dataclass(frozen=True)
class Round:
    """One round: replies (grants among them, for the broker), its length, and the CPU
    seconds the answering process spent."""

    replies: int
    grants: int
    seconds: float
    cpu_s: float

    @property
    def per_s(self) -> float:
        return self.replies / self.seconds

    @property
    def grants_per_s(self) -> float:
        return self.grants / self.seconds

    @property
    def cpu_us_per_reply(self) -> float:
        return stats.ratio(self.cpu_s * 1e6, self.replies)


class Driver:
    def __init__(self, port: int) -> None:
        self.reply_topic = topics.placement_replies(EDGE)  # the broker answers the edge here
        self.cond = threading.Condition()
        self.replies = 0
        self.grants = 0
        self.statuses: dict[str, int] = {}  # broker replies by status, counted rounds
        self.codes: dict[str, int] = {}  # refusals by code, counted rounds
        # The first granted replies of counted rounds, with when each came (a token is
        # checked as of its arrival, as the edge checks it: it lives seconds).
        self.sampled: list[tuple[float, bytes]] = []
        self.counting = False
        self.placing = False  # a grant came: the broker has heard the played workers
        self.rounds = 0
        self.client = paho.Client(CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
        self.client.on_socket_open = lambda _c, _u, s: s.setsockopt(6, 1, 1)  # type: ignore[attr-defined]  # TCP_NODELAY
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

    def wait_placing(self, topic: str, timeout: float = 60.0) -> None:
        """Ask once every half second until a request is granted: the broker has heard the
        played workers' capabilities and telemetry (before that it refuses ``no_worker``,
        and a round would measure refusals)."""
        deadline = time.monotonic() + timeout
        n = 0
        while time.monotonic() < deadline:
            n += 1
            payload = self.payloads[0].replace(b'"job_id":"bench-', f'"job_id":"p{n}-'.encode(), 1)
            props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
            props.ResponseTopic = self.reply_topic
            self.client.publish(topic, payload, qos=0, properties=props)
            with self.cond:
                if self.cond.wait_for(lambda: self.placing, 0.5):
                    return
        raise SystemExit(f"the broker granted no request within {timeout:.0f} s")

    def _request(self, i: int) -> bytes:
        now = time.time()
        return wire.dump(
            PlacementRequest(
                job_id=f"bench-{i}-{os.getpid()}",
                edge_id=EDGE,
                model="defect-v1",
                data_class=CLASS,
                payload_sha256=digest_of(i),
                payload_bytes=100_000,
                priority=5,
                deadline_at=now + 3600.0,
                submitted_at=now,
            )
        )

    def _on_message(self, _c: paho.Client, _u: object, msg: paho.MQTTMessage) -> None:
        with self.cond:
            self.replies += 1
            if not self.placing and not self.counting:
                self.placing = json.loads(msg.payload)["status"] == "placed"
            if self.counting:
                reply = json.loads(msg.payload)
                status = reply["status"]
                self.statuses[status] = self.statuses.get(status, 0) + 1
                if status == "placed":
                    self.grants += 1
                    if len(self.sampled) < SAMPLED:
                        self.sampled.append((time.time(), bytes(msg.payload)))
                else:
                    code = str(reply.get("code"))
                    self.codes[code] = self.codes.get(code, 0) + 1
            self.cond.notify_all()

    def round(
        self,
        topic: str,
        seconds: float,
        window: int,
        *,
        count: bool = False,
        serving: int | None = None,
    ) -> Round:
        """``window`` requests outstanding on ``topic`` for ``seconds``: the broker's
        replies counted by status with ``count``, the CPU of ``serving`` (a pid) beside."""
        cpu0 = _cpu(serving)
        with self.cond:
            self.replies = self.grants = 0
            self.counting = count
        self.rounds += 1
        sent = 0
        t0 = time.perf_counter()
        while time.perf_counter() < t0 + seconds:
            with self.cond:
                self.cond.wait_for(partial(self._room, sent - window), 5.0)
            props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
            props.ResponseTopic = self.reply_topic  # the relay's; the broker knows the edge's
            props.CorrelationData = str(sent).encode()
            # Unique job ids matter to the broker (one reservation per job): r<round>-<n>-.
            payload = self.payloads[sent % len(self.payloads)].replace(
                b'"job_id":"bench-', f'"job_id":"r{self.rounds}-{sent}-'.encode(), 1
            )
            self.client.publish(topic, payload, qos=0, properties=props)  # as the edge does
            sent += 1
        with self.cond:
            self.cond.wait_for(lambda: self.replies >= sent, 30.0)
            replies, grants = self.replies, self.grants
        return Round(replies, grants, time.perf_counter() - t0, _cpu(serving) - cpu0)

    def _room(self, limit: int) -> bool:
        return self.replies > limit


def digest_of(i: int) -> str:
    """The payload hash request ``i`` names; a job id ``r<round>-<n>-<i>-<pid>`` says ``i``."""
    return f"{i:064x}"


def _cpu(pid: int | None) -> float:
    return 0.0 if pid is None else stats.cpu_s(pid)


def verified_grants(sampled: list[tuple[float, bytes]], policy: Policy) -> int:
    """How many of the sampled grants carry a token the edge would take: signed by a broker
    of ``policy``, for that job, its payload hash, the edge's zone and the class, bound to
    the worker the reply names and, the class being confidential, to its sealing key."""
    origin = policy.edge(EDGE)
    assert origin is not None, f"{EDGE} is not in the campus policy"
    for received, raw in sampled:
        reply = PlacementReply.model_validate_json(raw)
        if reply.token is None:
            raise SystemExit(f"a grant without a token: {reply}")
        claims = verify(
            reply.token,
            policy,
            now=received,
            job_id=reply.job_id,
            payload_sha256=bytes.fromhex(digest_of(int(reply.job_id.split("-")[2]))),
            origin_zone=origin.zone,
            data_class=CLASS,
        )
        if claims.target_worker != reply.worker_id:
            raise SystemExit(f"{reply.job_id}: the token binds {claims.target_worker}")
        if policy.confidential(CLASS) and not claims.sealed:
            raise SystemExit(f"{reply.job_id}: a confidential class's token binds no seal key")
    return len(sampled)


def fleet_publisher(
    port: int, workers: list[str], stop: threading.Event, seal_keys: dict[str, str]
) -> None:
    """Play ``workers``: retained capabilities once (each advertising its sealing key from
    ``seal_keys``, the ``x25519:`` text the policy lists), telemetry every second."""
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
            seal_key=seal_keys[w],
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


def reservations_held(redis_port: int, workers: list[str]) -> int:
    """Jobs reserved on the played workers in Redis now (none completes: all are held)."""
    client = redis_sync.Redis(port=redis_port)
    try:
        return sum(int(client.zcard(keys.reservations(w))) for w in workers)
    finally:
        client.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0, help="length of a round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window", type=int, default=64, help="requests outstanding")
    ap.add_argument("--workers", type=int, default=50)
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of uncounted requests")
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
        policy = load_policy(campus.policy_file)
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
        # The played workers complete nothing, so the broker's progress watch (a worker
        # holding jobs that completes none is taken out of placement: bench/frozen_worker.py
        # measures it) is held off; otherwise most replies here would be refusals.
        env = {**os.environ, "SLUICEGATE_BROKER__STALL_FLOOR_MS": str(STALL_OFF_MS)}
        broker = subprocess.Popen([*cmd, "--config", str(campus.node_config("broker-1"))], env=env)
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
        feeder = threading.Thread(
            target=fleet_publisher, args=(mqtt.port, workers, stop, campus.seal_keys)
        )
        feeder.start()
        driver = Driver(mqtt.port)
        driver.wait_online(topics.broker_status("broker-1"))
        subject: list[Round] = []
        baseline: list[Round] = []
        try:
            requests = topics.placement_request(EDGE)
            driver.wait_placing(requests)
            driver.round(requests, args.warmup, args.window)
            for _ in range(args.rounds):
                subject.append(
                    driver.round(
                        requests, args.seconds, args.window, count=True, serving=broker.pid
                    )
                )
                baseline.append(
                    driver.round(RELAY_TOPIC, args.seconds, args.window, serving=relay.pid)
                )
            held = reservations_held(redis.port, workers)
        finally:
            stop.set()
            feeder.join()
            broker.terminate()
            relay.kill()
            broker.wait(20)
            relay.wait(20)
    verified = verified_grants(driver.sampled, policy)
    report(args, subject, baseline, driver, verified, held)


def report(
    args: argparse.Namespace,
    subject: list[Round],
    baseline: list[Round],
    driver: Driver,
    verified: int,
    held: int,
) -> None:
    grants = sum(r.grants for r in subject)
    refusals = sum(r.replies - r.grants for r in subject)
    med_g = stats.median(r.grants_per_s for r in subject)
    med_r = stats.median(r.per_s for r in subject)
    med_b = stats.median(r.per_s for r in baseline)
    cpu_g = stats.median(r.cpu_us_per_reply for r in subject)
    cpu_b = stats.median(r.cpu_us_per_reply for r in baseline)
    print(
        f"broker throughput: {args.workers} workers, window {args.window}, {args.rounds} rounds "
        f"of {args.seconds:g} s, nproc {os.cpu_count()}; {grants} grants, {refusals} "
        f"refusals {driver.codes or ''}"
    )
    print(
        f"  broker grants/s      {med_g:8.0f}   rounds {[round(r.grants_per_s) for r in subject]}"
    )
    print(f"  broker replies/s     {med_r:8.0f}   rounds {[round(r.per_s) for r in subject]}")
    print(f"  bare paho relay /s   {med_b:8.0f}   rounds {[round(r.per_s) for r in baseline]}")
    print(
        f"  broker CPU per reply    {cpu_g:5.0f} µs   rounds "
        f"{[round(r.cpu_us_per_reply) for r in subject]}"
    )
    print(
        f"  relay CPU per request   {cpu_b:5.0f} µs   rounds "
        f"{[round(r.cpu_us_per_reply) for r in baseline]}"
    )
    print(
        f"  after the rounds: {verified} sampled tokens verify as the edge checks them; "
        f"{held} reservations held in Redis"
    )
    ratio = stats.ratio(med_g, med_b)
    scaled = TARGET["grants_per_s"] * med_b / DESIGN_RELAY_PER_S
    print(f"  grants / relay       {ratio:8.2f}")
    print(
        f"  target               {TARGET['grants_per_s']:8.0f}   grants/s absolute; scaled by "
        f"this machine's relay ({med_b:.0f} vs DESIGN's {DESIGN_RELAY_PER_S:.0f}/s): "
        f"{scaled:.0f}/s, ratio {TARGET['grants_per_s'] / DESIGN_RELAY_PER_S:.2f} of the relay"
    )
    result = {
        "bench": "broker_throughput",
        "subject": {
            "grants_per_s": med_g,
            "replies_per_s": med_r,
            "grants": grants,
            "refusals": refusals,
            "refusals_by_code": driver.codes,
            "rounds_grants_per_s": [r.grants_per_s for r in subject],
            "cpu_us_per_reply": cpu_g,
            "tokens_verified": verified,
            "reservations_held": held,
        },
        "baseline": {
            "relay_per_s": med_b,
            "rounds": [r.per_s for r in baseline],
            "cpu_us_per_request": cpu_b,
        },
        "ratio": {"grants_over_relay": ratio},
        "target": {**TARGET, "scaled_to_this_machine": scaled},
        "met": stats.met({"grants_per_s": med_g}, TARGET, most=()),
        "met_scaled": stats.met({"grants_per_s": med_g}, {"grants_per_s": scaled}, most=()),
        "measured": stats.require(
            {
                "grants": grants,
                "tokens verified": verified,
                "reservations in Redis": held,
                "relay replies": sum(r.replies for r in baseline),
            }
        ),
        "params": vars(args),
        "machine": stats.machine("redis"),
    }
    print(stats.result_line(result))
    if refusals:  # every played worker has room for every request: this is no placement
        raise SystemExit(
            f"broker_throughput: {refusals} refusals {driver.codes}; the played workers "
            "have room for every request, so the bench no longer measures placements"
        )


if __name__ == "__main__":
    main()
