"""Benchmark: what sealing images to the worker and metering every attempt cost.

Two parts, each with its baseline side by side in the same run (BENCHMARKS.md):

* ``crypto``: per 100 KB image, HPKE seal (the edge: a fresh X25519 encapsulation, then
  AES-128-GCM) and open (the worker) against bare AES-128-GCM encrypt and decrypt of the
  same bytes with a key already agreed, and the sha256 every offloaded image already pays;
  then a usage record's signatures: the node signs it, the broker checks it and
  countersigns. Interleaved in rounds (seal, AES, open, AES decrypt, ... in each round).
* ``offload``: two local campuses started side by side, each on its own Mosquitto and
  Redis, alike but for sealing and metering: *on* (``[broker] seal_all``, ``[pool]`` and
  ``[edge] metering`` on) and *off* (both off). Jobs alternate between them (A, B, A, B,
  ...), each a 100 KB part image offloaded by edge line-1-pc to worker north-cpu-1 (the
  only worker started), and the app times each to its result. The overhead is the
  difference of the p50s (and the paired difference per slot). Target: +0.3 ms at most.
  Both campuses run open (no TLS), as bench/offload_path.py does, so that the figure is
  sealing and metering alone.

    .venv/bin/python bench/trust_cost.py                    # both parts, about a minute
    .venv/bin/python bench/trust_cost.py --part crypto --rounds 20
    .venv/bin/python bench/trust_cost.py --part offload --jobs 1000 --rate 50
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import stats  # noqa: E402
from bench.edge_path import Driver, make_image  # noqa: E402
from bench.offload_path import wait_workers_online  # noqa: E402
from policies.keys import SigningKey  # noqa: E402
from policies.sealing import SealingKey, open_sealed, seal, work_info  # noqa: E402
from sluicegate import topics  # noqa: E402
from sluicegate.app.campus import APP_OF_LINE, APPS  # noqa: E402
from sluicegate.app.localcampus import LocalCampus  # noqa: E402
from sluicegate.app.servers import running, start_mosquitto, start_redis  # noqa: E402
from sluicegate.metering.record import GENESIS, Usage, countersign, sign_usage  # noqa: E402

EDGE, WORKER, BROKER = "line-1-pc", "north-cpu-1", "broker-1"
CLASS = "part-image"  # a class that may travel in the clear: only the settings differ
TARGET = {"overhead_p50_ms": 0.3}
ARMS = {
    "on": {
        "SLUICEGATE_BROKER__SEAL_ALL": "true",
        "SLUICEGATE_POOL__METERING": "true",
        "SLUICEGATE_EDGE__METERING": "true",
    },
    "off": {
        "SLUICEGATE_BROKER__SEAL_ALL": "false",
        "SLUICEGATE_POOL__METERING": "false",
        "SLUICEGATE_EDGE__METERING": "false",
    },
}


def _timed(action: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        action()
        out.append((time.perf_counter() - start) * 1e6)
    return out


def crypto_part(image: bytes, rounds: int, per_round: int) -> dict[str, dict[str, float]]:
    worker = SealingKey.generate()
    info = work_info(
        token_id=os.urandom(16),
        key_id=worker.key_id,
        job_id="bench-job",
        data_class=CLASS,
        origin_zone="campus/fab-north/line-1",
        target_worker=WORKER,
        target_zone="campus/fab-north/dc",
    )
    sealed = seal(worker.public, image, info)
    aes = AESGCM(os.urandom(16))
    nonce = os.urandom(12)
    boxed = aes.encrypt(nonce, image, None)
    node, broker = SigningKey.generate(), SigningKey.generate()
    record = Usage(
        node=WORKER,
        kind="pool",
        seq=1,
        prev=GENESIS.hex(),
        at_ms=int(time.time() * 1000),
        event="ran",
        job_id="bench-job",
        attempt=1,
        token_id=os.urandom(16).hex(),
        line=EDGE,
        owner="app-line-1",
        data_class=CLASS,
        zone="campus/fab-north/dc",
        model="defect-v1",
        model_sha256=hashlib.sha256(b"m").hexdigest(),
        backend="onnxruntime/CPUExecutionProvider",
        device_class="x86-cpu-dc",
        device_us=2_000,
        queue_us=100,
        bytes_in=len(image),
        result_sha256=hashlib.sha256(b"r").hexdigest(),
        status="ok",
    )
    signed = sign_usage(record, node)

    def broker_side() -> object:
        assert signed.node_signature_valid(node.public)
        return countersign(signed, broker, broker=BROKER, received_ms=1)

    ops: dict[str, Callable[[], object]] = {
        "hpke_seal": lambda: seal(worker.public, image, info),
        "aes_gcm_encrypt": lambda: aes.encrypt(nonce, image, None),
        "hpke_open": lambda: open_sealed(worker, sealed, info),
        "aes_gcm_decrypt": lambda: aes.decrypt(nonce, boxed, None),
        "sha256": lambda: hashlib.sha256(image).digest(),
        "record_sign": lambda: sign_usage(record, node),
        "record_check_countersign": broker_side,
    }
    samples: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(rounds):
        for name, action in ops.items():
            samples[name] += _timed(action, per_round)
    return {name: stats.summary(values, unit="us") for name, values in samples.items()}


@contextlib.contextmanager
def _campus(name: str, tmp: Path) -> Iterator[tuple[LocalCampus, int]]:
    with running(start_mosquitto()) as mqtt, running(start_redis()) as redis:
        campus = LocalCampus(
            tmp / name,
            mqtt_port=mqtt.port,
            redis_url=f"redis://127.0.0.1:{redis.port}/0",
            env={"SLUICEGATE_OFFLOAD__QUEUE_BOUND": "0", **ARMS[name]},
            nodes=["broker-1", EDGE, WORKER],
            secure=False,
        )
        campus.start()
        try:
            wait_workers_online(campus, [WORKER])
            yield campus, mqtt.port
        finally:
            campus.stop()


def offload_part(
    image: bytes, jobs: int, warmup: int, rate: float
) -> tuple[dict[str, list[float]], dict[str, dict[str, int]]]:
    prefix = APPS[APP_OF_LINE[EDGE]][1]
    times: dict[str, list[float]] = {"on": [], "off": []}
    where: dict[str, dict[str, int]] = {"on": {}, "off": {}}
    with tempfile.TemporaryDirectory(prefix="sg-trust-") as tmp, contextlib.ExitStack() as stack:
        drivers = {}
        for arm in ("on", "off"):
            _campus_obj, port = stack.enter_context(_campus(arm, Path(tmp)))
            drivers[arm] = Driver(port, results=f"{prefix}/bench-{arm}-{os.getpid()}/results")
            stack.callback(drivers[arm].close)
        period = 1.0 / rate
        next_at = time.perf_counter()
        for i in range(warmup + jobs):
            for arm in ("on", "off") if i % 2 == 0 else ("off", "on"):
                next_at += period / 2
                job = f"{arm}-{i}"
                drivers[arm].submit(
                    EDGE,
                    job.encode(),
                    image,
                    user=[
                        (topics.PROP_MODEL, "defect-v1"),
                        (topics.PROP_DATA_CLASS, CLASS),
                        (topics.PROP_JOB_ID, job),
                        (topics.PROP_DEADLINE_MS, "200"),
                    ],
                )
                elapsed = drivers[arm].wait(job.encode())
                doc = json.loads(drivers[arm].done[job.encode()][1])
                if doc["status"] != "ok" and i >= warmup:  # a warm-up job only warms: on
                    raise SystemExit(f"job {job} failed: {doc}")  # a loaded machine it may expire
                node = doc["ran_on"]["node"]
                where[arm][node] = where[arm].get(node, 0) + 1
                if i >= warmup:
                    if node != WORKER:
                        raise SystemExit(f"job {job} was not offloaded: {doc.get('offload')}")
                    times[arm].append(elapsed)
                time.sleep(max(0.0, next_at - time.perf_counter()))
    return times, where


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--part", choices=["crypto", "offload", "all"], default="all")
    ap.add_argument("--payload-kb", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=10, help="crypto: interleaved rounds")
    ap.add_argument("--per-round", type=int, default=200, help="crypto: calls per op per round")
    ap.add_argument("--jobs", type=int, default=1000, help="offload: samples per arm")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--rate", type=float, default=50.0, help="offload: slots per second")
    args = ap.parse_args()
    image = make_image(args.payload_kb)
    result: dict[str, object] = {"bench": "trust_cost", "params": vars(args)}
    met = None  # the target is the offload part's: without it, nothing to judge
    claims: dict[str, float] = {}
    if args.part in ("crypto", "all"):
        crypto = crypto_part(image, args.rounds, args.per_round)
        print(f"crypto, {len(image) / 1024:.0f} KB image, {args.rounds} rounds")
        print(f"{'':28}{'p50 us':>10}{'p99 us':>10}")
        for name, figures in crypto.items():
            print(f"{name:28}{figures['p50_us']:10.1f}{figures['p99_us']:10.1f}")
        seal_ratio = crypto["hpke_seal"]["p50_us"] / crypto["aes_gcm_encrypt"]["p50_us"]
        open_ratio = crypto["hpke_open"]["p50_us"] / crypto["aes_gcm_decrypt"]["p50_us"]
        print(f"seal / AES-GCM encrypt {seal_ratio:.1f}x, open / AES-GCM decrypt {open_ratio:.1f}x")
        result["crypto"] = crypto
        result["crypto_ratio"] = {"seal_vs_aes": seal_ratio, "open_vs_aes": open_ratio}
        claims |= {f"{name} calls": figures["n"] for name, figures in crypto.items()}
    if args.part in ("offload", "all"):
        times, where = offload_part(image, args.jobs, args.warmup, args.rate)
        on, off = times["on"], times["off"]
        paired = [a - b for a, b in zip(on, off, strict=True)]
        print(f"offload, {len(image) / 1024:.0f} KB, {args.jobs} jobs per arm; ran on {where}")
        print(f"{'':36}{'p50 ms':>10}{'p99 ms':>10}")
        for name, values in (
            ("sealed and metered (on)", on),
            ("clear, not metered (off)", off),
            ("paired difference per slot", paired),
        ):
            print(
                f"{name:36}{stats.percentile(values, 50):10.3f}{stats.percentile(values, 99):10.3f}"
            )
        overhead = stats.percentile(on, 50) - stats.percentile(off, 50)
        print(f"{'overhead p50 (on - off)':36}{overhead:10.3f}   target <= +0.3 ms")
        met = stats.met({"overhead_p50_ms": overhead}, TARGET, most=TARGET)
        claims |= {"sealed, metered jobs": len(on), "clear, unmetered jobs": len(off)}
        result["subject"] = {
            "p50_ms": stats.percentile(on, 50),
            "p99_ms": stats.percentile(on, 99),
            "ran_on": where["on"],
        }
        result["baseline"] = {
            "p50_ms": stats.percentile(off, 50),
            "p99_ms": stats.percentile(off, 99),
        }
        result["ratio"] = {
            "overhead_p50_ms": overhead,
            "paired_p50_ms": stats.percentile(paired, 50),
        }
    result["target"] = TARGET
    result["met"] = met
    result["measured"] = stats.require(claims)
    result["machine"] = stats.machine("cryptography", "pynacl")
    print(stats.result_line(result))


if __name__ == "__main__":
    main()
