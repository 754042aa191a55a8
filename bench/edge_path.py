"""Benchmark: submit-to-result latency and throughput of the edge path over real Mosquitto,
beside two baselines run in the same process layout and interleaved with it:

* bare compute: decode + preprocess + ``session.run`` of the same image, the same model;
* bare relay: a paho client that answers each request at once (``bench/relay.py``), the
  floor of the messaging itself on this machine.

Processes: a Mosquitto started for the run (a plain one: the agent runs with ``[mqtt]
plaintext``, from the test policy as its installed bootstrap policy; no broker is online, so
it offers nothing), the edge agent (``sluicegate edge run``) and the relay as their own
processes, and this driver, a plain paho-mqtt v5 client. Latency runs
open-loop at ``--rate`` jobs/s; each slot times one bare compute, one agent job and one
relay round trip, in that order. Throughput alternates rounds of bare compute on
``--concurrency`` threads, of the agent and of the relay, each kept busy by a window of
outstanding jobs. Prints a table, then one ``RESULT {...}`` line (BENCHMARKS.md).

    .venv/bin/python bench/edge_path.py                 # defaults: about a minute on 2 cores
    .venv/bin/python bench/edge_path.py --jobs 3000 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import paho.mqtt.client as paho
import psutil
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import stats  # noqa: E402
from sluicegate import topics  # noqa: E402
from sluicegate.app.servers import running, start_mosquitto  # noqa: E402
from sluicegate.vision.runtime import ModelRegistry, default_models_dir  # noqa: E402
from sluicegate.vision.synth import encode_jpeg, generate  # noqa: E402
from tests.pool_kit import write_policy_file  # noqa: E402

MODEL = "defect-v1"
AGENT, RELAY = "bench-edge", "bench-relay"
TARGET = {"overhead_p50_ms": 1.0, "overhead_p99_ms": 3.0, "throughput_ratio": 0.8}


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
    """A plain paho client that timestamps each result as it arrives (on paho's thread).
    ``results`` is the Response Topic it asks for (by default ``bench/<pid>/results``; an
    edge whose policy lists apps answers only under their results prefixes)."""

    port: int
    results: str = ""
    sent: dict[bytes, float] = field(default_factory=dict)
    done: dict[bytes, tuple[float, bytes]] = field(default_factory=dict)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        self.topic = self.results or f"bench/{os.getpid()}/results"
        self.client = paho.Client(CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
        self.client.on_message = self._on_message
        self.client.on_socket_open = lambda _c, _u, s: s.setsockopt(6, 1, 1)  # type: ignore[attr-defined]  # TCP_NODELAY
        connected = threading.Event()
        self.client.on_connect = lambda *a: connected.set()
        self.client.connect("127.0.0.1", self.port)
        self.client.loop_start()
        connected.wait(10)
        self.listen(self.topic)

    def listen(self, topic: str) -> None:
        """Also collect results published on ``topic`` (by correlation data)."""
        subscribed = threading.Event()
        self.client.on_subscribe = lambda *a: subscribed.set()
        self.client.subscribe(topic, qos=1)
        if not subscribed.wait(10):
            raise TimeoutError(f"no SUBACK for {topic}")

    def _on_message(self, _c: paho.Client, _u: object, msg: paho.MQTTMessage) -> None:
        now = time.perf_counter()
        corr = msg.properties.CorrelationData  # type: ignore[union-attr]
        with self.cond:
            self.done[corr] = (now, bytes(msg.payload))
            self.cond.notify_all()

    def submit(
        self,
        edge: str,
        corr: bytes,
        image: bytes,
        *,
        user: list[tuple[str, str]] | None = None,
        topic: str | None = None,
    ) -> None:
        """Publish a job to ``edge``'s submit topic (or straight to ``topic``)."""
        props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        props.ResponseTopic = self.topic
        props.CorrelationData = corr
        props.ContentType = "image/jpeg"
        props.UserProperty = user or [(topics.PROP_MODEL, MODEL)]
        with self.cond:
            self.sent[corr] = time.perf_counter()
        target = topic or topics.edge_submit(edge)
        self.client.publish(target, image, qos=1, properties=props)

    def wait(self, corr: bytes, timeout: float = 30.0) -> float:
        with self.cond:
            if not self.cond.wait_for(lambda: corr in self.done, timeout):
                raise TimeoutError(f"no result for {corr!r}")
            return (self.done[corr][0] - self.sent[corr]) * 1000.0

    def wait_count(self, n: int, timeout: float = 60.0) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.done) >= n, timeout):
                raise TimeoutError(f"only {len(self.done)} of {n} results")

    def wait_online(self, edge: str, proc: subprocess.Popen[bytes]) -> None:
        online = threading.Event()
        self.client.message_callback_add(
            topics.edge_status(edge),
            lambda _c, _u, m: online.set() if b'"online"' in m.payload else None,
        )
        self.client.subscribe(topics.edge_status(edge), qos=1)
        deadline = time.monotonic() + 60
        while not online.wait(0.2):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{edge} did not come online")

    def cache_answers(self, edge: str, timeout: float = 15.0) -> int:
        """How many requests ``edge`` has answered as repeats of a job it knew (from its
        outbox, not by running them), from the next telemetry it publishes: a benchmark
        whose ids repeat measures the cache, not the path."""
        got: dict[str, dict[str, int]] = {}
        heard = threading.Event()

        def on(_c: paho.Client, _u: object, msg: paho.MQTTMessage) -> None:
            got["events"] = json.loads(msg.payload).get("events", {})
            heard.set()

        topic = topics.edge_telemetry(edge)
        self.client.message_callback_add(topic, on)
        self.client.subscribe(topic, qos=0)
        if not heard.wait(timeout):
            raise TimeoutError(f"no telemetry from {edge} within {timeout} s")
        self.client.message_callback_remove(topic)
        events = got["events"]
        return int(events.get("duplicates", 0)) + int(events.get("redelivered", 0))

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def start_agent(port: int, concurrency: int, policy_file: Path) -> subprocess.Popen[bytes]:
    """The agent, its state (outbox, lock) in the run's own folder: nothing of an earlier
    run is there to be replayed or answered from."""
    env = dict(
        os.environ,
        SLUICEGATE_EDGE__CONCURRENCY=str(concurrency),
        SLUICEGATE_EDGE__QUEUE_SIZE="4096",
        SLUICEGATE_MQTT__PLAINTEXT="true",
        SLUICEGATE_OFFLOAD__POLICY_FILE=str(policy_file),
        SLUICEGATE_OFFLOAD__STATE_DIR=str(policy_file.parent / "state"),
    )
    argv = [sys.executable, "-m", "sluicegate.app.cli", "edge", "run", "--port", str(port)]
    return subprocess.Popen([*argv, "--id", AGENT, "--log-level", "warning"], env=env)


def start_relay(port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, str(ROOT / "bench" / "relay.py"), str(port), RELAY])


def latency(
    driver: Driver, bare: Callable[[], None], image: bytes, args: argparse.Namespace
) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"e2e": [], "bare": [], "relay": [], "agent_compute": []}
    period = 1.0 / args.rate
    next_at = time.perf_counter()
    for i in range(args.warmup + args.jobs):
        next_at += period
        t0 = time.perf_counter()
        bare()
        b = (time.perf_counter() - t0) * 1000.0
        corr, rcorr = f"lat-{i}".encode(), f"rel-{i}".encode()
        driver.submit(AGENT, corr, image)
        e = driver.wait(corr)
        driver.submit(RELAY, rcorr, image)
        r = driver.wait(rcorr)
        if i >= args.warmup:
            out["bare"].append(b)
            out["e2e"].append(e)
            out["relay"].append(r)
            t = json.loads(driver.done[corr][1])["timings_ms"]
            out["agent_compute"].append(t["decode_ms"] + t["preprocess_ms"] + t["inference_ms"])
        time.sleep(max(0.0, next_at - time.perf_counter()))  # open-loop pacing
    return out


def bare_round(bare: Callable[[], None], concurrency: int, seconds: float) -> float:
    """Bare compute on as many threads as the agent uses; jobs/s."""
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


def busy_round(
    driver: Driver, edge: str, image: bytes, window: int, seconds: float, tag: str
) -> float:
    """``edge`` kept busy by ``window`` outstanding jobs; completed jobs/s. Correlation
    data carries ``tag`` (the round), so no job id of one round repeats in another."""
    driver.done.clear()
    driver.sent.clear()
    issued = 0
    t0 = time.perf_counter()
    while time.perf_counter() < t0 + seconds:
        with driver.cond:
            driver.cond.wait_for(partial(_room, driver, issued - window), 5.0)
        driver.submit(edge, f"{edge}-{tag}-{issued}".encode(), image)
        issued += 1
    driver.wait_count(issued)
    return issued / (time.perf_counter() - t0)


def throughput(
    driver: Driver, bare: Callable[[], None], image: bytes, args: argparse.Namespace
) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"agent": [], "bare": [], "relay": []}
    for n in range(args.rounds):
        out["bare"].append(bare_round(bare, args.concurrency, args.seconds))
        out["agent"].append(busy_round(driver, AGENT, image, args.window, args.seconds, f"r{n}"))
        out["relay"].append(busy_round(driver, RELAY, image, args.window, args.seconds, f"r{n}"))
    return out


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
    session, input_name = model.session, model.manifest.input.name

    def bare() -> None:
        # The same decode the agent runs (JPEG DCT scaling per the manifest), then
        # preprocess and session.run: compute with no messaging, queueing or threads.
        batch, _decode_ms, _preprocess_ms, _frame = model.prepare(image)
        session.run(None, {input_name: batch})

    with (
        tempfile.TemporaryDirectory(prefix="sg-bench-") as tmp,
        running(start_mosquitto()) as server,
    ):
        policy_file = write_policy_file(Path(tmp))
        agent = start_agent(server.port, args.concurrency, policy_file)
        relay = start_relay(server.port)
        driver = Driver(server.port)
        try:
            driver.wait_online(AGENT, agent)
            driver.wait_online(RELAY, relay)
            proc = psutil.Process(agent.pid)
            lat = latency(driver, bare, image, args)
            thr = throughput(driver, bare, image, args)
            rss_mb = proc.memory_info().rss / 2**20
            cached = driver.cache_answers(AGENT)
        finally:
            relay.kill()
            agent.send_signal(signal.SIGTERM)
            agent.wait(20)
            relay.wait(20)
            driver.close()
    report(args, image, lat, thr, rss_mb, cached)
    if cached:
        raise SystemExit(f"{cached} jobs were answered from the agent's cache: ids repeated")


def report(
    args: argparse.Namespace,
    image: bytes,
    lat: dict[str, list[float]],
    thr: dict[str, list[float]],
    rss_mb: float,
    cached: int,
) -> None:
    e2e, base, relay, comp = lat["e2e"], lat["bare"], lat["relay"], lat["agent_compute"]
    own = [e - c - r for e, c, r in zip(e2e, comp, relay, strict=True)]
    ov50, ov99 = (
        stats.percentile(e2e, 50) - stats.percentile(base, 50),
        stats.percentile(e2e, 99) - stats.percentile(base, 99),
    )
    med = {k: stats.median(v) for k, v in thr.items()}
    ratio = stats.ratio(med["agent"], med["bare"])
    # Best a relay plus compute could do on these cores: their per-job costs add up.
    floor = 1.0 / (1.0 / med["bare"] + 1.0 / med["relay"])
    print(
        f"edge path: {len(image) / 1024:.0f} KB 640x480 JPEG, {args.jobs} jobs at "
        f"{args.rate:g}/s, concurrency {args.concurrency}, nproc {os.cpu_count()}"
    )
    print(f"{'latency':40}{'p50 ms':>10}{'p99 ms':>10}")
    rows = [
        ("agent, submit to result (subject)", e2e),
        ("bare compute (baseline)", base),
        ("bare paho relay round trip (baseline)", relay),
        ("agent's own compute, as it reports", comp),
        ("agent - its compute - relay (per job)", own),
    ]
    for name, values in rows:
        print(f"{name:40}{stats.percentile(values, 50):10.3f}{stats.percentile(values, 99):10.3f}")
    print(f"{'overhead = subject - bare compute':40}{ov50:10.3f}{ov99:10.3f}")
    print(f"{'throughput, jobs/s (median of rounds)':40}")
    print(f"  agent {med['agent']:.0f}  bare compute {med['bare']:.0f}  relay {med['relay']:.0f}")
    print(
        f"  agent / bare compute = {ratio:.2f};  agent / (relay + compute floor "
        f"{floor:.0f}) = {med['agent'] / floor:.2f}"
    )
    print(f"  rounds: {json.dumps({k: [round(x) for x in v] for k, v in thr.items()})}")
    print(f"agent RSS at the end {rss_mb:.0f} MB; answered from its cache: {cached}")
    ratios = {
        "overhead_p50_ms": ov50,
        "overhead_p99_ms": ov99,
        "throughput_ratio": ratio,
        "throughput_vs_relay_compute_floor": med["agent"] / floor,
    }
    met = (
        ov50 <= TARGET["overhead_p50_ms"]
        and ov99 <= TARGET["overhead_p99_ms"]
        and ratio >= TARGET["throughput_ratio"]
    )
    result = {
        "bench": "edge_path",
        "subject": {
            "e2e_p50_ms": stats.percentile(e2e, 50),
            "e2e_p99_ms": stats.percentile(e2e, 99),
            "own_p50_ms": stats.percentile(own, 50),
            "own_p99_ms": stats.percentile(own, 99),
            "throughput_jps": med["agent"],
            "agent_rss_mb": rss_mb,
            "answered_from_cache": cached,
        },
        "baseline": {
            "bare_p50_ms": stats.percentile(base, 50),
            "bare_p99_ms": stats.percentile(base, 99),
            "relay_p50_ms": stats.percentile(relay, 50),
            "relay_p99_ms": stats.percentile(relay, 99),
            "bare_throughput_jps": med["bare"],
            "relay_throughput_jps": med["relay"],
        },
        "ratio": ratios,
        "target": TARGET,
        "met": met,
        "measured": stats.require(
            {
                "agent jobs": len(e2e),
                "bare computes": len(base),
                "relay round trips": len(relay),
                "throughput rounds": len(thr["agent"]),
            }
        ),
        "params": {
            "jobs": args.jobs,
            "rate": args.rate,
            "payload_bytes": len(image),
            "concurrency": args.concurrency,
            "rounds": args.rounds,
            "seconds": args.seconds,
        },
        "machine": stats.machine(),
    }
    print(stats.result_line(result))


if __name__ == "__main__":
    main()
