"""Benchmark: what TLS and client certificates cost on the edge path and on the offload path,
an open campus and a secured one side by side in one run, measured in alternating rounds.

Two local campuses at once (``bench/campus_rig.py``), the same node layout (a broker, two
edge agents, an on-campus and an off-site worker), the same model and the same image; each
has its own Mosquitto on a free port and its own Redis. *open*: plain TCP, anonymous
clients. *secure*: what ``start_campus_mosquitto`` serves a campus, TLS 1.3, a client
certificate per identity (Ed25519 for nodes), the certificate's name as username and client
id, the generated ACL. In both, the apps submit as themselves (app-line-1 to line-1-pc,
app-line-2 to line-2-pc, results under ``app/line-N/``). Over TLS with their own
certificates too: the bare-worker baseline, as ``bench-direct``, an edge the bench adds to
the policy (and to the regenerated ACL) because a worker runs only work from a listed edge;
the floor's driver and relay, ``bench-floor`` and ``bench-relay``, with an ACL block
appended for them, since the generated ACL grants no one the ``bench/`` topics.

Each slot, on one campus, times in this order:

1. bare compute: ``cv2.imdecode`` + preprocess + ``session.run`` of the image in this
   process (the edge path's baseline, as ``bench/edge_path.py``);
2. edge path: the image from app-line-2 to line-2-pc, which runs every job itself (its
   offloading is off), submit to result;
3. offload path: the image from app-line-1 to line-1-pc, which offers every job, asks the
   broker and sends it to north-cpu-1 (the only worker a wafer image may go to);
4. its baseline: the same image straight to north-cpu-1's work topic with a token minted
   here with the campus broker key (as ``bench/offload_path.py``);
5. the messaging floor: the same image and 1 KB through a bare relay, QoS 1.

Edge overhead = edge path - bare compute; offload overhead = offload path - its baseline
(p50 minus p50, p99 minus p99). A warm-up of ``--warmup`` slots on each campus is
discarded; then ``--rounds`` rounds, each ``--jobs / --rounds`` slots on the open campus,
then as many on the secured one, open-loop at ``--rate`` slots/s. Target: the secured
campus's offload overhead p50 at most 1.10 times the open one's. Over the counted blocks it
also takes the CPU time (user + system) of each process of each campus, the driver's own
included, per counted slot: where a difference between the campuses is spent. Prints a
table, then the ``RESULT {...}`` line (BENCHMARKS.md).

    .venv/bin/python bench/tls_overhead.py                 # about 3 minutes on 2 cores
    .venv/bin/python bench/tls_overhead.py --jobs 2000 --rounds 20
"""

from __future__ import annotations

import argparse
import hashlib
import os
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import stats  # noqa: E402
from bench.campus_rig import LOCAL_EDGE, SECURITY, WORKER, CampusRig  # noqa: E402
from bench.edge_path import make_image  # noqa: E402
from bench.offload_path import SMALL, extra_legs_ms  # noqa: E402
from sluicegate.app.servers import find_binary  # noqa: E402
from sluicegate.vision.runtime import ModelRegistry, default_models_dir  # noqa: E402

MODEL = "defect-v1"
TARGET = {"offload_overhead_p50_ratio": 1.10}
# Figures per campus: one list of samples each, in ms.
SERIES = ("bare", "edge", "agent_compute", "offload", "direct", "relay_image", "relay_1kb")


def _require(ok: bool, message: str, warming: bool) -> None:
    """End the run on a job that did not do what it measures; a warm-up job only warms (on
    a loaded machine the first ones may expire)."""
    if not ok and not warming:
        raise SystemExit(message)


def one_slot(
    rig: CampusRig,
    tag: str,
    image: bytes,
    digest: bytes,
    bare: Callable[[], None],
    warming: bool = False,
) -> dict[str, float]:
    """Time one slot's five requests on ``rig`` (see the module docstring)."""
    t0 = time.perf_counter()
    bare()
    out = {"bare": (time.perf_counter() - t0) * 1000.0}
    out["edge"], doc = rig.local_job(f"edge-{tag}", image)
    ok = doc["status"] == "ok" and doc["ran_on"]["node"] == LOCAL_EDGE
    _require(ok, f"{rig.security}: edge job {tag} did not run on {LOCAL_EDGE}: {doc}", warming)
    timings = doc["timings_ms"]
    out["agent_compute"] = timings["decode_ms"] + timings["preprocess_ms"] + timings["inference_ms"]
    out["offload"], doc = rig.offloaded_job(f"off-{tag}", image)
    ok = doc["status"] == "ok" and doc["ran_on"]["node"] == WORKER
    _require(ok, f"{rig.security}: job off-{tag} was not offloaded: {doc}", warming)
    out["direct"], doc = rig.direct_job(f"dir-{tag}", image, digest)
    ok = doc["status"] == "ok"
    _require(ok, f"{rig.security}: direct job dir-{tag} failed: {doc}", warming)
    out["relay_image"] = rig.floor(f"img-{tag}", image)
    out["relay_1kb"] = rig.floor(f"small-{tag}", SMALL)
    return out


def run_block(
    rig: CampusRig,
    name: str,
    slots: int,
    rate: float,
    image: bytes,
    digest: bytes,
    bare: Callable[[], None],
    warming: bool = False,
) -> dict[str, list[float]]:
    """``slots`` slots on one campus, open-loop at ``rate`` per second."""
    out: dict[str, list[float]] = {key: [] for key in SERIES}
    period = 1.0 / rate
    next_at = time.perf_counter()
    for i in range(slots):
        next_at += period
        for key, value in one_slot(rig, f"{name}-{i}", image, digest, bare, warming).items():
            out[key].append(value)
        time.sleep(max(0.0, next_at - time.perf_counter()))  # open-loop pacing
    return out


DRIVER = "driver (bare compute, 4 clients)"


class CpuMeter:
    """CPU time (user + system) each process of a campus spends over the counted blocks;
    this driver's own (its bare compute and its MQTT clients) under :data:`DRIVER`."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.procs[DRIVER] = psutil.Process()
        self.spent = dict.fromkeys(self.procs, 0.0)
        self._at: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        times = {name: proc.cpu_times() for name, proc in self.procs.items()}
        return {name: t.user + t.system for name, t in times.items()}

    def start(self) -> None:
        self._at = self._now()

    def stop(self) -> None:
        for name, value in self._now().items():
            self.spent[name] += value - self._at[name]

    def per_slot_ms(self, slots: int) -> dict[str, float]:
        return {name: 1000.0 * s / slots for name, s in self.spent.items()}


def figures(s: dict[str, list[float]]) -> dict[str, float]:
    """One campus's figures (ms) from its samples."""
    f = {}
    for key in SERIES:
        f[f"{key}_p50_ms"] = stats.percentile(s[key], 50)
        f[f"{key}_p99_ms"] = stats.percentile(s[key], 99)
    for q in (50, 99):
        f[f"edge_overhead_p{q}_ms"] = stats.percentile(s["edge"], q) - stats.percentile(
            s["bare"], q
        )
        f[f"offload_overhead_p{q}_ms"] = stats.percentile(s["offload"], q) - stats.percentile(
            s["direct"], q
        )
    paired = [a - b for a, b in zip(s["offload"], s["direct"], strict=True)]
    f["offload_paired_p50_ms"] = stats.percentile(paired, 50)
    f["offload_paired_p99_ms"] = stats.percentile(paired, 99)
    f["extra_legs_floor_ms"] = extra_legs_ms(f["relay_image_p50_ms"], f["relay_1kb_p50_ms"])
    f["offload_above_floor_p50_ms"] = f["offload_overhead_p50_ms"] - f["extra_legs_floor_ms"]
    return f


def mosquitto_version() -> str:
    out = subprocess.run([find_binary("mosquitto"), "-h"], capture_output=True, text=True)
    return (out.stdout + out.stderr).splitlines()[0].strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--jobs", type=int, default=1000, help="counted slots per campus")
    ap.add_argument("--rounds", type=int, default=10, help="rounds (open, then secure)")
    ap.add_argument("--rate", type=float, default=15.0, help="slots per second")
    ap.add_argument("--warmup", type=int, default=100, help="discarded slots per campus")
    ap.add_argument("--payload-kb", type=int, default=100)
    args = ap.parse_args()
    if args.jobs < args.rounds or args.rounds < 1:
        raise SystemExit("--jobs must be at least --rounds, and --rounds at least 1")
    image = make_image(args.payload_kb)
    digest = hashlib.sha256(image).digest()
    model = ModelRegistry.from_dir(default_models_dir()).get(MODEL)
    session, input_name = model.session, model.manifest.input.name

    def bare() -> None:
        # The same decode the agent runs (JPEG DCT scaling per the manifest), then
        # preprocess and session.run: compute with no messaging, queueing or threads.
        batch, _decode_ms, _preprocess_ms, _frame = model.prepare(image)
        session.run(None, {input_name: batch})

    samples: dict[str, dict[str, list[float]]] = {
        name: {key: [] for key in SERIES} for name in SECURITY
    }
    per_round: dict[str, list[float]] = {name: [] for name in SECURITY}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sg-bench-tls-") as tmp:
        rigs = {}
        try:
            for name in SECURITY:
                rigs[name] = CampusRig(Path(tmp) / name, name).__enter__()
            tls = rigs["secure"].tls_session()
            meters = {name: CpuMeter(rig.pids()) for name, rig in rigs.items()}
            for name, rig in rigs.items():
                run_block(
                    rig, f"warm-{name}", args.warmup, args.rate, image, digest, bare, warming=True
                )
            base, extra = divmod(args.jobs, args.rounds)
            for r in range(args.rounds):
                slots = base + (1 if r < extra else 0)
                for name, rig in rigs.items():
                    meters[name].start()
                    got = run_block(rig, f"r{r}", slots, args.rate, image, digest, bare)
                    meters[name].stop()
                    for key, values in got.items():
                        samples[name][key] += values
                    per_round[name].append(
                        stats.percentile(got["offload"], 50) - stats.percentile(got["direct"], 50)
                    )
        finally:
            for rig in rigs.values():
                rig.stop()
    cpu = {name: meter.per_slot_ms(args.jobs) for name, meter in meters.items()}
    report(args, image, samples, per_round, tls, cpu, time.monotonic() - started)


ROWS = [
    ("edge path: app -> line-2-pc -> app", "edge"),
    ("  bare compute (baseline)", "bare"),
    ("  the agent's own compute, as it reports", "agent_compute"),
    ("  edge overhead = subject - bare compute", "edge_overhead"),
    ("offload path: app -> edge -> broker -> worker", "offload"),
    ("  straight to the same worker (baseline)", "direct"),
    ("  offload overhead = subject - baseline", "offload_overhead"),
    ("  paired difference per slot", "offload_paired"),
    ("bare relay round trip, the same image", "relay_image"),
    ("bare relay round trip, 1 KB", "relay_1kb"),
]


def report(
    args: argparse.Namespace,
    image: bytes,
    samples: dict[str, dict[str, list[float]]],
    per_round: dict[str, list[float]],
    tls: dict[str, str],
    cpu: dict[str, dict[str, float]],
    elapsed_s: float,
) -> None:
    fig = {name: figures(samples[name]) for name in SECURITY}
    op, se = fig["open"], fig["secure"]
    ratio = {key: se[key] / op[key] for key in op if op[key]}
    print(
        f"TLS and client certificates, open vs secure campus: {len(image) / 1024:.0f} KB JPEG, "
        f"{args.jobs} slots per campus in {args.rounds} rounds at {args.rate:g}/s, "
        f"nproc {os.cpu_count()}, {elapsed_s:.0f} s; secure: {tls.get('version')} "
        f"{tls.get('cipher')}, client certificates"
    )
    print(
        f"{'ms':46}{'open p50':>10}{'p99':>9}{'secure p50':>12}{'p99':>9}"
        f"{'ratio p50':>11}{'p99':>7}"
    )
    for label, key in ROWS:
        p50, p99 = f"{key}_p50_ms", f"{key}_p99_ms"
        print(
            f"{label:46}{op[p50]:10.3f}{op[p99]:9.3f}{se[p50]:12.3f}{se[p99]:9.3f}"
            f"{ratio.get(p50, float('nan')):11.2f}{ratio.get(p99, float('nan')):7.2f}"
        )
    for label, key in (
        ("floor of the offload's extra legs", "extra_legs_floor_ms"),
        ("offload overhead above that floor, p50", "offload_above_floor_p50_ms"),
    ):
        print(f"{label:46}{op[key]:10.3f}{'':9}{se[key]:12.3f}{'':9}{ratio.get(key, 0):11.2f}")
    print("TLS cost, secure - open (p50 ms):")
    deltas = {
        "edge_overhead": se["edge_overhead_p50_ms"] - op["edge_overhead_p50_ms"],
        "relay_image_rtt": se["relay_image_p50_ms"] - op["relay_image_p50_ms"],
        "offload_overhead": se["offload_overhead_p50_ms"] - op["offload_overhead_p50_ms"],
        "extra_legs_floor": se["extra_legs_floor_ms"] - op["extra_legs_floor_ms"],
        "offload_subject": se["offload_p50_ms"] - op["offload_p50_ms"],
        "offload_baseline": se["direct_p50_ms"] - op["direct_p50_ms"],
    }
    print(
        f"  edge overhead {deltas['edge_overhead']:+.3f} (relay round trip of the image "
        f"{deltas['relay_image_rtt']:+.3f});  offload overhead {deltas['offload_overhead']:+.3f} "
        f"(floor of its extra legs {deltas['extra_legs_floor']:+.3f}; subject "
        f"{deltas['offload_subject']:+.3f}, baseline {deltas['offload_baseline']:+.3f})"
    )
    print(f"{'CPU per counted slot, ms':46}{'open':>10}{'secure':>12}{'secure - open':>15}")
    for proc in sorted(cpu["open"], key=lambda n: cpu["secure"][n] - cpu["open"][n]):
        o, s = cpu["open"][proc], cpu["secure"][proc]
        print(f"  {proc:44}{o:10.2f}{s:12.2f}{s - o:+15.2f}")
    total = {name: sum(cpu[name].values()) for name in SECURITY}
    print(
        f"  {'all of them':44}{total['open']:10.2f}{total['secure']:12.2f}"
        f"{total['secure'] - total['open']:+15.2f}"
    )
    for name in SECURITY:
        rounds = " ".join(f"{x:.2f}" for x in per_round[name])
        print(f"offload overhead p50 by round, {name:6}: {rounds}")
    got = ratio.get("offload_overhead_p50_ms", float("nan"))
    met = got <= TARGET["offload_overhead_p50_ratio"]
    print(
        f"target: secure / open offload overhead p50 <= {TARGET['offload_overhead_p50_ratio']:.2f}"
        f": {got:.3f}, {'met' if met else 'not met'}"
    )
    result = {
        "bench": "tls_overhead",
        "subject": se,
        "baseline": op,
        "ratio": ratio,
        "tls_cost_p50_ms": deltas,
        "rounds_offload_overhead_p50_ms": per_round,
        "cpu_per_slot_ms": cpu,
        "target": TARGET,
        "met": met,
        "measured": stats.require(
            {
                f"{series} on the {name} campus": len(samples[name][series])
                for name in SECURITY
                for series in SERIES
            }
        ),
        "params": {
            "jobs": args.jobs,
            "rounds": args.rounds,
            "rate": args.rate,
            "warmup": args.warmup,
            "payload_bytes": len(image),
            "elapsed_s": round(elapsed_s, 1),
        },
        "tls": tls,
        "machine": stats.machine()
        | {"openssl": ssl.OPENSSL_VERSION, "mosquitto": mosquitto_version()},
    }
    print(stats.result_line(result))


if __name__ == "__main__":
    main()
