"""Benchmark: a pool worker with dynamic batching (subject) beside the same worker without
batching and bare compute (baselines), interleaved, over a real Mosquitto.

Processes: a Mosquitto started for the run, two ``sluicegate pool run`` workers (one with
``--max-batch`` and ``--window-ms``, one with max batch 1 and no window; same concurrency),
and this driver, a plain paho-mqtt v5 client that mints each placement token itself with the
*published test* broker key under the test policy (bench only: those keys prove nothing) and
sends the work as the test policy's edge, on its work topics. The Mosquitto is a plain one
(the workers run with ``[mqtt] plaintext``).

* Throughput: rounds alternate bare compute (prepare + ``session.run`` per image), bare
  batched compute (``--max-batch`` prepares, one ``session.run``), both on as many threads
  as a worker's ``--concurrency``, the batching worker and the plain worker, each worker
  kept busy by ``--outstanding`` jobs in flight.
* Burst latency: ``--burst`` jobs published back to back, timed from the first send to the
  last result, alternating between the two workers.

Batch sizes come from the workers' completion records. Prints a table, then one
``RESULT {...}`` line (BENCHMARKS.md). On a CPU the gain of batching is small (the model is
tiny and decoding dominates); on a GPU the same command shows what batching buys.

    .venv/bin/python bench/pool_batching.py                 # about a minute on 2 cores
    .venv/bin/python bench/pool_batching.py --rounds 5 --bursts 200 --max-batch 16
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
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import stats  # noqa: E402
from policies import mint, payload_digest  # noqa: E402
from sluicegate import topics  # noqa: E402
from sluicegate.app.servers import running, start_mosquitto  # noqa: E402
from sluicegate.vision.runtime import ModelRegistry, default_models_dir  # noqa: E402
from tests.image_bytes import sample_jpeg  # noqa: E402
from tests.pool_kit import (  # noqa: E402
    BROKER,
    DATA_CLASS,
    EDGE,
    ORIGIN,
    POLICY,
    write_policy_file,
)

MODEL = "defect-v1"
BATCHED = ("north-gpu-1", "campus/fab-north/dc")  # workers the test policy knows
PLAIN = ("south-npu-1", "campus/fab-south/dc")
TARGET = {"throughput_ratio_vs_plain": 1.0}


@dataclass
class Driver:
    port: int
    image: bytes
    sent: dict[bytes, float] = field(default_factory=dict)
    done: dict[bytes, float] = field(default_factory=dict)
    batches: dict[str, Counter[int]] = field(default_factory=dict)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        # The workers return results to the edge that sent the work; the driver plays it.
        self.edge = EDGE
        self.topic = topics.edge_returns_all(self.edge)
        self.digest = payload_digest(self.image)
        self.client = paho.Client(CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
        # TCP_NODELAY, as every Sluicegate client sets it.
        self.client.on_socket_open = lambda _c, _u, s: s.setsockopt(6, 1, 1)  # type: ignore[attr-defined]
        self.client.message_callback_add(self.topic, self._on_result)
        self.client.message_callback_add(topics.completions_all(), self._on_completion)
        self.client.message_callback_add(topics.worker_all("status"), self._on_status)
        self.online: set[str] = set()
        connected = threading.Event()
        self.client.on_connect = lambda *a: connected.set()
        self.client.connect("127.0.0.1", self.port)
        self.client.loop_start()
        connected.wait(10)
        for t in (self.topic, topics.completions_all(), topics.worker_all("status")):
            self.client.subscribe(t, qos=1)

    def _on_result(self, _c: paho.Client, _u: object, msg: paho.MQTTMessage) -> None:
        now = time.perf_counter()
        corr = msg.properties.CorrelationData  # type: ignore[union-attr]
        if b'"ok"' not in msg.payload:
            print("not ok:", msg.payload[:300], file=sys.stderr)
        with self.cond:
            self.done[corr] = now
            self.cond.notify_all()

    def _on_completion(self, _c: paho.Client, _u: object, msg: paho.MQTTMessage) -> None:
        doc = json.loads(msg.payload)
        with self.cond:
            self.batches.setdefault(doc["worker_id"], Counter())[doc["batch_size"]] += 1

    def _on_status(self, _c: paho.Client, _u: object, msg: paho.MQTTMessage) -> None:
        doc = json.loads(msg.payload)
        with self.cond:
            if doc["state"] == "online":
                self.online.add(doc["node"])
            self.cond.notify_all()

    def submit(self, worker: tuple[str, str], job: str) -> None:
        token = mint(
            POLICY,
            BROKER,
            job_id=job,
            payload_sha256=self.digest,
            data_class=DATA_CLASS,
            origin_zone=ORIGIN,
            target_worker=worker[0],
            now=time.time(),
        )
        props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        props.ResponseTopic = topics.edge_returns(self.edge, worker[0])  # as the edge sets it
        props.CorrelationData = job.encode()
        props.ContentType = "image/jpeg"
        props.UserProperty = [
            (topics.PROP_JOB_ID, job),
            (topics.PROP_MODEL, MODEL),
            (topics.PROP_TOKEN, token),
            (topics.PROP_DATA_CLASS, DATA_CLASS),
            (topics.PROP_ORIGIN_ZONE, ORIGIN),
            (topics.PROP_EDGE, self.edge),
            (topics.PROP_ATTEMPT, "1"),
        ]
        with self.cond:
            self.sent[job.encode()] = time.perf_counter()
        work = topics.pool_work(worker[1], worker[0], self.edge)
        self.client.publish(work, self.image, qos=1, properties=props)

    def wait_count(self, n: int, timeout: float = 60.0) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.done) >= n, timeout):
                raise TimeoutError(f"only {len(self.done)} of {n} results")

    def wait_online(self, procs: list[subprocess.Popen[bytes]]) -> None:
        deadline = time.monotonic() + 60
        with self.cond:
            while not {BATCHED[0], PLAIN[0]} <= self.online:
                self.cond.wait(0.2)
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise SystemExit("the workers did not come online")

    def reset(self) -> None:
        with self.cond:
            self.sent.clear()
            self.done.clear()


def _room(driver: Driver, limit: int) -> bool:
    return len(driver.done) > limit


def busy_round(driver: Driver, worker: tuple[str, str], outstanding: int, seconds: float) -> float:
    """``worker`` kept busy by ``outstanding`` jobs in flight; completed jobs/s."""
    driver.reset()
    issued = 0
    t0 = time.perf_counter()
    while time.perf_counter() < t0 + seconds:
        with driver.cond:
            driver.cond.wait_for(partial(_room, driver, issued - outstanding), 5.0)
        driver.submit(worker, f"{worker[0]}-{t0:.3f}-{issued}")
        issued += 1
    driver.wait_count(issued)
    return issued / (time.perf_counter() - t0)


def burst(driver: Driver, worker: tuple[str, str], size: int, n: int) -> float:
    """Milliseconds from the first send of a burst to its last result."""
    driver.reset()
    t0 = time.perf_counter()
    for i in range(size):
        driver.submit(worker, f"b-{worker[0]}-{n}-{i}")
    driver.wait_count(size)
    return (max(driver.done.values()) - t0) * 1000.0


def start_worker(
    port: int,
    worker: tuple[str, str],
    config: Path,
    max_batch: int,
    window_ms: float,
    concurrency: int,
) -> subprocess.Popen[bytes]:
    env = dict(
        os.environ,
        SLUICEGATE_POOL__CONCURRENCY=str(concurrency),
        SLUICEGATE_POOL__MAX_BATCH=str(max_batch),
        SLUICEGATE_POOL__BATCH_WINDOW_MS=str(window_ms),
        SLUICEGATE_POOL__QUEUE_SIZE="4096",
    )
    argv = [sys.executable, "-m", "sluicegate.app.cli", "pool", "run", "--port", str(port)]
    argv += ["--config", str(config), "--id", worker[0], "--zone", worker[1]]
    return subprocess.Popen([*argv, "--log-level", "warning"], env=env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--window-ms", type=float, default=2.0)
    ap.add_argument(
        "--concurrency", type=int, default=2, help="batches a worker runs at once = bare threads"
    )
    ap.add_argument("--seconds", type=float, default=3.0, help="length of a throughput round")
    ap.add_argument("--rounds", type=int, default=3, help="throughput rounds of each kind")
    ap.add_argument("--outstanding", type=int, default=32, help="jobs in flight in throughput")
    ap.add_argument("--burst", type=int, default=16, help="jobs per burst")
    ap.add_argument("--bursts", type=int, default=60, help="bursts per worker (after 5 warm-up)")
    args = ap.parse_args()

    image = sample_jpeg(5)[0]
    model = ModelRegistry.from_dir(default_models_dir()).get(MODEL)

    def bare(batch: int) -> float:
        """Compute alone on ``--concurrency`` threads for ``--seconds``; jobs/s."""
        stop_at = time.perf_counter() + args.seconds
        counts = [0] * args.concurrency

        def spin(k: int) -> None:
            while time.perf_counter() < stop_at:
                tensors = [model.prepare(image)[0] for _ in range(batch)]
                model.run(tensors[0] if batch == 1 else np.concatenate(tensors))
                counts[k] += batch

        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(spin, range(args.concurrency)))
        return sum(counts) / (time.perf_counter() - t0)

    thr: dict[str, list[float]] = {"batched": [], "plain": [], "bare": [], "bare_batched": []}
    lat: dict[str, list[float]] = {"batched": [], "plain": []}
    with tempfile.TemporaryDirectory() as tmp, running(start_mosquitto()) as server:
        config = Path(tmp) / "pool.toml"
        config.write_text(
            f'[mqtt]\nplaintext = true\n[pool]\npolicy_file = "{write_policy_file(Path(tmp))}"\n'
        )
        procs = [
            start_worker(
                server.port, BATCHED, config, args.max_batch, args.window_ms, args.concurrency
            ),
            start_worker(server.port, PLAIN, config, 1, 0.0, args.concurrency),
        ]
        driver = Driver(server.port, image)
        try:
            driver.wait_online(procs)
            for n in range(5 + args.bursts):
                for name, worker in (("batched", BATCHED), ("plain", PLAIN)):
                    took = burst(driver, worker, args.burst, n)
                    if n >= 5:
                        lat[name].append(took)
            driver.batches.clear()
            for _ in range(args.rounds):
                thr["bare"].append(bare(1))
                thr["bare_batched"].append(bare(args.max_batch))
                thr["batched"].append(busy_round(driver, BATCHED, args.outstanding, args.seconds))
                thr["plain"].append(busy_round(driver, PLAIN, args.outstanding, args.seconds))
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            for proc in procs:
                proc.wait(30)
            driver.client.disconnect()
            driver.client.loop_stop()
    report(args, image, thr, lat, driver.batches)


def report(
    args: argparse.Namespace,
    image: bytes,
    thr: dict[str, list[float]],
    lat: dict[str, list[float]],
    batches: dict[str, Counter[int]],
) -> None:
    med = {k: stats.median(v) for k, v in thr.items()}
    print(
        f"pool batching: {len(image) / 1024:.0f} KB JPEG, max batch {args.max_batch}, window "
        f"{args.window_ms:g} ms, {args.outstanding} in flight, nproc {os.cpu_count()}"
    )
    print(f"{'throughput, jobs/s (median of rounds)':44}{'jobs/s':>10}")
    for name, label in [
        ("batched", "worker, dynamic batching (subject)"),
        ("plain", "worker, max batch 1 (baseline)"),
        ("bare", "bare compute, batch 1 (baseline)"),
        ("bare_batched", f"bare compute, batch {args.max_batch} (baseline)"),
    ]:
        print(f"{label:44}{med[name]:10.0f}")
    print(f"{f'burst of {args.burst}, first send to last result':44}{'p50 ms':>10}{'p99 ms':>10}")
    for name in ("batched", "plain"):
        p50, p99 = stats.percentile(lat[name], 50), stats.percentile(lat[name], 99)
        print(f"{'  ' + name:44}{p50:10.2f}{p99:10.2f}")
    sizes = {w: dict(sorted(c.items())) for w, c in batches.items()}
    print(f"batch sizes in the throughput rounds (size: jobs): {json.dumps(sizes)}")
    ratio = stats.ratio(med["batched"], med["plain"])
    result = {
        "bench": "pool_batching",
        "subject": {
            "throughput_jps": med["batched"],
            "burst_p50_ms": stats.percentile(lat["batched"], 50),
            "burst_p99_ms": stats.percentile(lat["batched"], 99),
            "batch_sizes": sizes.get(BATCHED[0], {}),
        },
        "baseline": {
            "plain_throughput_jps": med["plain"],
            "plain_burst_p50_ms": stats.percentile(lat["plain"], 50),
            "plain_burst_p99_ms": stats.percentile(lat["plain"], 99),
            "bare_jps": med["bare"],
            "bare_batched_jps": med["bare_batched"],
        },
        "ratio": {
            "throughput_vs_plain": ratio,
            "throughput_vs_bare": stats.ratio(med["batched"], med["bare"]),
            "bare_batched_vs_bare": stats.ratio(med["bare_batched"], med["bare"]),
        },
        "target": TARGET,
        "met": stats.met({"throughput_ratio_vs_plain": ratio}, TARGET, most=()),
        "measured": stats.require(
            {
                "batched worker jobs": sum(batches.get(BATCHED[0], Counter()).values()),
                "plain worker jobs": sum(batches.get(PLAIN[0], Counter()).values()),
                "batched bursts": len(lat["batched"]),
                "plain bursts": len(lat["plain"]),
                "bare compute rounds": len(thr["bare"]),
            }
        ),
        "params": vars(args),
        "machine": stats.machine(),
    }
    print(stats.result_line(result))


if __name__ == "__main__":
    main()
