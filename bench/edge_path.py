"""Benchmark: submit-to-result latency and throughput of the edge path over real Mosquitto,
beside the bare compute (cv2.imdecode + preprocess + session.run) timed in the same run.

Process layout: a Mosquitto started for the run, an edge agent as its own process
(``sluicegate edge run``), and this driver, a plain paho-mqtt v5 client. Latency runs
open-loop at ``--rate`` jobs/s; each slot first times one bare compute (A), then one job
end to end (B), so both see the same machine. Throughput alternates rounds of bare compute
on ``--concurrency`` threads (A) with rounds of the agent kept busy by a window of
outstanding jobs (B). Prints a table, then one ``RESULT {...}`` line (BENCHMARKS.md).

    .venv/bin/python bench/edge_path.py                 # defaults: < 1 minute on 2 cores
    .venv/bin/python bench/edge_path.py --jobs 3000 --rate 50 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from importlib.metadata import version
from pathlib import Path

import cv2
import numpy as np
import paho.mqtt.client as paho
import psutil
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sluicegate import topics
from sluicegate.servers import running, start_mosquitto
from sluicegate.vision.preprocess import preprocess
from sluicegate.vision.runtime import ModelRegistry, default_models_dir
from sluicegate.vision.synth import encode_jpeg, generate

MODEL = "defect-v1"
EDGE = "bench-edge"
TARGET = {"overhead_p50_ms": 1.0, "overhead_p99_ms": 3.0, "throughput_ratio": 0.8}


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def make_image(payload_kb: int) -> bytes:
    """A 640x480 synthetic JPEG near ``payload_kb`` KB (quality searched)."""
    img, _ = generate(np.random.default_rng(5), "scratch")
    best = encode_jpeg(img, 90)
    for quality in range(60, 100):
        data = encode_jpeg(img, quality)
        if abs(len(data) - payload_kb * 1024) < abs(len(best) - payload_kb * 1024):
            best = data
    return best


@dataclass
class Driver:
    """A plain paho client that timestamps each result as it arrives (paho's thread)."""

    port: int
    sent: dict[bytes, float] = field(default_factory=dict)
    done: dict[bytes, tuple[float, bytes]] = field(default_factory=dict)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        self.topic = f"bench/{os.getpid()}/results"
        self.client = paho.Client(CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
        self.client.on_message = self._on_message
        self.client.on_socket_open = lambda _c, _u, s: s.setsockopt(6, 1, 1)  # TCP_NODELAY
        connected = threading.Event()
        self.client.on_connect = lambda *a: connected.set()
        self.client.connect("127.0.0.1", self.port)
        self.client.loop_start()
        connected.wait(10)
        subscribed = threading.Event()
        self.client.on_subscribe = lambda *a: subscribed.set()
        self.client.subscribe(self.topic, qos=1)
        subscribed.wait(10)

    def _on_message(self, _c: paho.Client, _u: object, msg: paho.MQTTMessage) -> None:
        now = time.perf_counter()
        corr = msg.properties.CorrelationData  # type: ignore[union-attr]
        with self.cond:
            self.done[corr] = (now, bytes(msg.payload))
            self.cond.notify_all()

    def submit(self, corr: bytes, image: bytes) -> None:
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = self.topic
        props.CorrelationData = corr
        props.ContentType = "image/jpeg"
        props.UserProperty = [(topics.PROP_MODEL, MODEL)]
        with self.cond:
            self.sent[corr] = time.perf_counter()
        self.client.publish(topics.edge_submit(EDGE), image, qos=1, properties=props)

    def wait(self, corr: bytes, timeout: float = 30.0) -> float:
        with self.cond:
            if not self.cond.wait_for(lambda: corr in self.done, timeout):
                raise TimeoutError(f"no result for {corr!r}")
            return (self.done[corr][0] - self.sent[corr]) * 1000.0

    def wait_count(self, n: int, timeout: float = 60.0) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.done) >= n, timeout):
                raise TimeoutError(f"only {len(self.done)} of {n} results")

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def start_agent(port: int, concurrency: int) -> subprocess.Popen[bytes]:
    env = dict(
        os.environ,
        SLUICEGATE_EDGE__CONCURRENCY=str(concurrency),
        SLUICEGATE_EDGE__QUEUE_SIZE="4096",
        SLUICEGATE_EDGE__TELEMETRY_INTERVAL_S="1.0",
    )
    argv = [sys.executable, "-m", "sluicegate.cli", "edge", "run", "--port", str(port)]
    return subprocess.Popen([*argv, "--id", EDGE, "--log-level", "warning"], env=env)


def wait_online(driver: Driver, agent: subprocess.Popen[bytes]) -> None:
    online = threading.Event()

    def on_status(_c: paho.Client, _u: object, msg: paho.MQTTMessage) -> None:
        if b'"online"' in msg.payload:
            online.set()

    driver.client.message_callback_add(topics.edge_status(EDGE), on_status)
    driver.client.subscribe(topics.edge_status(EDGE), qos=1)
    deadline = time.monotonic() + 60
    while not online.wait(0.2):
        if agent.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("edge agent did not come online")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--jobs", type=int, default=1000, help="latency samples (after warm-up)")
    ap.add_argument("--rate", type=float, default=50.0, help="jobs/s in the latency run")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=3.0, help="length of a throughput round")
    ap.add_argument("--rounds", type=int, default=3, help="throughput rounds of each kind")
    ap.add_argument("--concurrency", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--window", type=int, default=32, help="outstanding jobs in throughput")
    ap.add_argument("--payload-kb", type=int, default=80)
    args = ap.parse_args()

    image = make_image(args.payload_kb)
    model = ModelRegistry.from_dir(default_models_dir()).get(MODEL)
    session, manifest = model.session, model.manifest
    input_name = manifest.input.name

    def bare() -> None:
        img = cv2.imdecode(np.frombuffer(image, np.uint8), cv2.IMREAD_COLOR)
        session.run(None, {input_name: preprocess(img, manifest)})

    with running(start_mosquitto()) as server:
        agent = start_agent(server.port, args.concurrency)
        driver = Driver(server.port)
        try:
            wait_online(driver, agent)
            proc = psutil.Process(agent.pid)
            lat = latency(driver, bare, image, args)
            thr = throughput(driver, bare, image, args)
            rss_mb = proc.memory_info().rss / 2**20
        finally:
            agent.send_signal(signal.SIGTERM)
            agent.wait(20)
            driver.close()
    report(args, image, lat, thr, rss_mb)


def latency(
    driver: Driver, bare: Callable[[], None], image: bytes, args: argparse.Namespace
) -> dict[str, list[float]]:
    e2e: list[float] = []
    base: list[float] = []
    agent_compute: list[float] = []
    period = 1.0 / args.rate
    next_at = time.perf_counter()
    for i in range(args.warmup + args.jobs):
        next_at += period
        t0 = time.perf_counter()
        bare()
        b = (time.perf_counter() - t0) * 1000.0
        corr = f"lat-{i}".encode()
        driver.submit(corr, image)
        e = driver.wait(corr)
        if i >= args.warmup:
            base.append(b)
            e2e.append(e)
            doc = json.loads(driver.done[corr][1])
            t = doc["timings_ms"]
            agent_compute.append(t["decode_ms"] + t["preprocess_ms"] + t["inference_ms"])
        time.sleep(max(0.0, next_at - time.perf_counter()))  # open-loop pacing
    return {"e2e": e2e, "bare": base, "agent_compute": agent_compute}


def throughput(
    driver: Driver, bare: Callable[[], None], image: bytes, args: argparse.Namespace
) -> dict[str, list[float]]:
    subject: list[float] = []
    baseline: list[float] = []
    for n in range(args.rounds):
        baseline.append(bare_round(bare, args.concurrency, args.seconds))
        subject.append(agent_round(driver, image, args.window, args.seconds, f"thr-{n}"))
    return {"subject": subject, "baseline": baseline}


def bare_round(bare: Callable[[], None], concurrency: int, seconds: float) -> float:
    """A: bare compute on as many threads as the agent uses; jobs/s."""
    stop_at = time.perf_counter() + seconds
    counts = [0] * concurrency

    def spin(k: int) -> None:
        while time.perf_counter() < stop_at:
            bare()
            counts[k] += 1

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(spin, range(concurrency)))
    return sum(counts) / (time.perf_counter() - t0)


def _room(driver: Driver, limit: int) -> bool:
    return len(driver.done) > limit


def agent_round(driver: Driver, image: bytes, window: int, seconds: float, tag: str) -> float:
    """B: the agent kept busy by ``window`` outstanding jobs; completed jobs/s."""
    driver.done.clear()
    driver.sent.clear()
    issued = 0
    t0 = time.perf_counter()
    while time.perf_counter() < t0 + seconds:
        with driver.cond:
            driver.cond.wait_for(partial(_room, driver, issued - window), 5.0)
        driver.submit(f"{tag}-{issued}".encode(), image)
        issued += 1
    driver.wait_count(issued)
    return issued / (time.perf_counter() - t0)


def report(
    args: argparse.Namespace,
    image: bytes,
    lat: dict[str, list[float]],
    thr: dict[str, list[float]],
    rss_mb: float,
) -> None:
    e2e, base, comp = lat["e2e"], lat["bare"], lat["agent_compute"]
    per_job = [e - c for e, c in zip(e2e, comp, strict=True)]
    ov50 = pct(e2e, 50) - pct(base, 50)
    ov99 = pct(e2e, 99) - pct(base, 99)
    thr_s, thr_b = float(np.median(thr["subject"])), float(np.median(thr["baseline"]))
    ratio = thr_s / thr_b
    print(
        f"edge path: {len(image) / 1024:.0f} KB 640x480 JPEG, {args.jobs} jobs at "
        f"{args.rate:g}/s, concurrency {args.concurrency}, nproc {os.cpu_count()}"
    )
    print(f"{'':32}{'p50 ms':>10}{'p99 ms':>10}")
    print(f"{'end to end (subject)':32}{pct(e2e, 50):10.3f}{pct(e2e, 99):10.3f}")
    print(f"{'bare compute (baseline)':32}{pct(base, 50):10.3f}{pct(base, 99):10.3f}")
    print(f"{'overhead = subject - baseline':32}{ov50:10.3f}{ov99:10.3f}")
    print(f"{'per job: e2e - agent compute':32}{pct(per_job, 50):10.3f}{pct(per_job, 99):10.3f}")
    print(
        f"throughput: agent {thr_s:.0f} jobs/s vs bare compute {thr_b:.0f} jobs/s "
        f"= {ratio:.2f} (rounds: {[round(x) for x in thr['subject']]} vs "
        f"{[round(x) for x in thr['baseline']]})"
    )
    print(f"agent peak RSS {rss_mb:.0f} MB")
    ratios = {"overhead_p50_ms": ov50, "overhead_p99_ms": ov99, "throughput_ratio": ratio}
    met = (
        ov50 <= TARGET["overhead_p50_ms"]
        and ov99 <= TARGET["overhead_p99_ms"]
        and (ratio >= TARGET["throughput_ratio"])
    )
    result = {
        "bench": "edge_path",
        "subject": {
            "e2e_p50_ms": pct(e2e, 50),
            "e2e_p99_ms": pct(e2e, 99),
            "per_job_overhead_p50_ms": pct(per_job, 50),
            "per_job_overhead_p99_ms": pct(per_job, 99),
            "throughput_jps": thr_s,
            "agent_rss_mb": rss_mb,
        },
        "baseline": {
            "bare_p50_ms": pct(base, 50),
            "bare_p99_ms": pct(base, 99),
            "throughput_jps": thr_b,
        },
        "ratio": ratios,
        "target": TARGET,
        "met": met,
        "params": {
            "jobs": args.jobs,
            "rate": args.rate,
            "payload_bytes": len(image),
            "concurrency": args.concurrency,
            "rounds": args.rounds,
            "seconds": args.seconds,
        },
        "machine": {
            "nproc": os.cpu_count(),
            "python": platform.python_version(),
            "onnxruntime": version("onnxruntime"),
            "opencv": cv2.__version__,
            "paho": version("paho-mqtt"),
        },
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
