"""The benchmarks' smoke tier: every bench in ``bench/`` run as a subprocess with tiny flags,
so a bench that crashes, or finishes having measured nothing it claims, fails CI
(``BENCHMARKS.md``: benches cannot rot). A run passes when it exits 0, its last line is
``RESULT {json}``, and every count it claims (``measured``, what ``bench.stats.require``
checked) is there and not zero. Nothing here looks at a timing: a tiny run on a shared
2-core machine measures nothing worth comparing.

Every ``bench/*.py`` is either a row of :data:`SMOKE` or a module the benches import or
start (:data:`HELPERS`); a new file in neither fails :func:`test_every_bench_has_a_row`.
Each bench starts its own Mosquitto, Redis and nodes on free ports; the edge and worker
processes a bench starts itself get a free metrics port too (``METRICS_PORT=0``). The campus
benches run here with their line PCs uncapped (``--edge-cpu 0``): timing the models under a
cap takes 5 s a bench, and the cap has tests of its own (``test_calibration.py``, the demo's).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"

pytestmark = pytest.mark.bench


@dataclass(frozen=True)
class Smoke:
    """One bench run: the script, its tiny flags, the claims its ``measured`` must name
    (each non-zero, as every other count there), and a time limit generous for 2 cores."""

    script: str
    flags: str
    claims: tuple[str, ...] = ()
    timeout_s: float = 150.0
    name: str = ""

    @property
    def id(self) -> str:
        return self.name or self.script.removesuffix(".py")


CAMPUS_S = 240.0  # benches that start whole campuses (calibration, several nodes)

SMOKE = [
    Smoke(
        "announced_burst.py",
        "--smoke --edge-cpu 0",
        (
            "announced jobs in the first seconds",
            "unannounced jobs in the first seconds",
            "scaling signal reads",
        ),
        CAMPUS_S,
    ),
    Smoke(
        "audit_verify.py",
        "--records 500 --more 100 --rounds 1 --chunk 100",
        ("records in the full pass", "incremental passes, witnessed"),
    ),
    Smoke(
        "backends.py",
        "--runs 3 --rounds 1",
        ("models on onnxruntime", "models on openvino", "timed batch-8 runs"),
    ),
    Smoke(
        "bench_policy.py",
        "--samples 200 --warmup 20 --zones 40 --batch 10",
        ("mint", "verify", "evaluations", "baseline signatures"),
    ),
    Smoke(
        "broker_throughput.py",
        "--seconds 1 --rounds 1 --workers 5 --warmup 0.5",
        ("grants", "tokens verified", "reservations in Redis", "relay replies"),
    ),
    Smoke(
        "campus_burst.py",
        "--rounds 1 --rate 2 --burst 1 --edge-cpu 0",
        (
            "offload answers",
            "offload models' time",
            "offload model threads' CPU",
            "edge-only answers",
        ),
        CAMPUS_S,
    ),
    Smoke(
        "chaos.py",
        "--jobs 40 --kills 1 --rate 20 --baseline-jobs 10 --resubmit-after 5 --settle 60",
        ("chaos results", "baseline accepted", "kills restarted"),
        CAMPUS_S,
    ),
    Smoke(
        "console_cost.py",
        "--seconds 1 --rounds 1 --workers 5 --dashboards 1 --records 20 --warmup 1",
        ("grants, no dashboard", "grants, dashboards open", "dashboard snapshots"),
    ),
    Smoke(
        "edge_path.py",
        "--jobs 20 --warmup 5 --seconds 0.5 --rounds 1",
        ("agent jobs", "bare computes", "relay round trips"),
    ),
    Smoke(
        "fleet_scale.py",
        "--edges 20 --workers 4 --rounds 1 --seconds 1 --settle 0.5 --rate 50",
        ("placed with fleet load", "placed without fleet load"),
        CAMPUS_S,
    ),
    Smoke(
        "fleet_scale.py",
        "--replicas 2 --workers 4 --decisions 100 --seconds 1 --chunk-seconds 1 "
        "--replica-warmup 0.5 --drain-seconds 1 --window 4 --tel-edges 20 --tel-rate 40 "
        "--tel-seconds 0.5 --rate 50 --settle 0.2 --kill-rate 50 --kill-seconds 1 "
        "--settle-timeout 30",
        ("decisions", "grants in the kill run"),
        CAMPUS_S,
        name="fleet_replicas",
    ),
    Smoke(
        "flood.py",
        "--rate 100 --seconds 1 --before 1 --after 1",
        ("malformed requests sent", "refusals received", "real jobs during the flood"),
    ),
    Smoke(
        "frozen_worker.py",
        "--smoke --edge-cpu 0",
        ("freeze jobs after it", "kill jobs after it", "answers"),
        CAMPUS_S,
    ),
    Smoke(
        "mqtt_read.py",
        "--messages 500 --rate 2000 --rounds 1",
        ("messages received by paho", "messages received by gapped"),
    ),
    Smoke("ocr_accuracy.py", "--images 5 --warmup 1", ("labels read",)),
    Smoke(
        "offload_path.py",
        "--jobs 20 --warmup 5 --rate 50",
        ("offloaded jobs", "baseline jobs", "relay round trips, 1 KB"),
    ),
    Smoke(
        "offload_trace.py",
        "--jobs 20 --warmup 5 --rate 50",
        ("dir-* jobs through 'worker: verify, decode, infer, return'",),
    ),
    Smoke(
        "placement.py",
        "--workers 100 --samples 500 --warmup 50 --throughput 500 --rounds 1 "
        "--outstanding 20 --verify 100",
        ("decisions", "placed", "scans", "reference decisions"),
    ),
    Smoke(
        "pool_batching.py",
        "--seconds 0.5 --rounds 1 --bursts 2 --burst 4",
        ("batched worker jobs", "plain worker jobs", "batched bursts"),
    ),
    Smoke(
        "tls_overhead.py",
        "--jobs 10 --rounds 1 --warmup 3 --rate 20",
        ("offload on the secure campus", "direct on the secure campus"),
        CAMPUS_S,
    ),
    Smoke(
        "trust_cost.py",
        "--rounds 1 --per-round 10 --jobs 10 --warmup 3",
        ("hpke_seal calls", "sealed, metered jobs", "clear, unmetered jobs"),
        CAMPUS_S,
    ),
    Smoke(
        "twin_fidelity.py",
        "--rounds 1 --rate 2 --burst 1 --edge-cpu 0",
        ("jobs answered", "jobs recorded", "jobs replayed", "jobs joined with their app's result"),
        CAMPUS_S,
    ),
    Smoke("twin_replay.py", "--minutes 0.5 --rounds 1", ("jobs replayed",)),
    Smoke(
        "learned_placement.py",
        "--seconds 3 --train-rounds 1 --population 2",
        ("held-out scenarios", "arms replayed"),
    ),
    Smoke(
        "usage_intake.py",
        "--messages 2 --rounds 1",
        ("sliced records acknowledged", "whole records acknowledged"),
    ),
    # Comes with its own change; skipped until the file is in the checkout.
    Smoke("peers.py", "--smoke", timeout_s=CAMPUS_S),
    Smoke(  # the A/B of two checkouts' agents: here this one against itself
        "peers.py",
        f"--smoke --against {ROOT}",
        ("defect-v1 agent-tls@base jobs", "agent-tls@base usage records acked"),
        CAMPUS_S,
        name="peers-against",
    ),
    Smoke(
        "peering.py",
        "--smoke --edge-cpu 0",
        (
            "burst jobs with the peer",
            "burst jobs alone",
            "jobs that ran on south",
            "work messages the wiretap saw",
            "local offloads timed",
            "crossing offloads timed",
        ),
        CAMPUS_S,
    ),
]

# Modules the benches import or start, not benches: each says why it has no row.
HELPERS = {
    "stats.py": "percentiles, summaries, CPU, the machine record and the RESULT line",
    "campus_args.py": "the options of the benches that drive the demo's campus traffic",
    "campus_rig.py": "tls_overhead's two campuses and their clients",
    "fleet_rig.py": "the fleet benches' campus and processes",
    "fleet_sim.py": "the simulated fleet, a child process of fleet_rig",
    "fleet_report.py": "the fleet benches' tables and RESULT lines",
    "fleet_driver.py": "the fleet benches' placing edges",
    "fleet_replicas.py": "run by fleet_scale.py --replicas (the fleet_replicas row)",
    "meter_check.py": "chaos's check of the usage records",
    "relay.py": "the bare paho relay the benches start as a baseline",
    "peers_workers.py": "peers.py's arms and workers",
    "bare_chain.py": "campus_burst's floor: the same jobs through bare paho processes",
}


def test_every_bench_has_a_row() -> None:
    """A new bench gets a row (its tiny flags) or, if it measures nothing itself, a line
    in HELPERS: it cannot join bench/ without the smoke tier running it."""
    present = {path.name for path in BENCH.glob("*.py")}
    known = {row.script for row in SMOKE} | set(HELPERS)
    assert not present - known, (
        f"bench/ files in no smoke row and not helpers: {sorted(present - known)}; give each "
        "a Smoke row with tiny flags in tests/test_bench_smoke.py (or a HELPERS line)"
    )
    assert not {row.script for row in SMOKE} & set(HELPERS)


def run(argv: list[str], env: dict[str, str], timeout_s: float) -> tuple[int | None, str]:
    """Run a bench; its exit code (None: stopped at ``timeout_s``) and its output. A bench
    past its time gets SIGINT, so its own cleanup stops the servers and nodes it started,
    and SIGKILL (its process group) only if that does not end it."""
    with subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                out, _ = proc.communicate(timeout=20.0)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
            return None, out
        return proc.returncode, out


def result_of(output: str) -> dict[str, Any]:
    """The ``RESULT {json}`` last line of a bench's output."""
    lines = output.rstrip().splitlines()
    assert lines, "the bench printed nothing"
    last = lines[-1]
    assert last.startswith("RESULT "), f"the last line is not a RESULT line: {last[:300]!r}"
    result = json.loads(last.removeprefix("RESULT "))
    assert isinstance(result, dict), f"RESULT is not a JSON object: {last[:300]!r}"
    return result


@pytest.mark.parametrize(
    "row", [pytest.param(row, id=row.id, marks=pytest.mark.timeout(row.timeout_s)) for row in SMOKE]
)
def test_bench_runs_and_measures(row: Smoke) -> None:
    script = BENCH / row.script
    if not script.exists():
        pytest.skip(f"bench/{row.script} is not in this checkout yet")
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        # Agents and workers a bench starts itself: a free port, not the default 9464/9465
        # (LocalCampus gives its nodes their own free ports over this).
        "SLUICEGATE_EDGE__METRICS_PORT": "0",
        "SLUICEGATE_POOL__METRICS_PORT": "0",
    }
    limit = row.timeout_s - 40.0  # room to stop it and report before pytest's own timeout
    code, out = run([sys.executable, str(script), *row.flags.split()], env, limit)
    assert code is not None, f"bench/{row.script} ran past {limit:.0f} s:\n{out[-4000:]}"
    assert code == 0, f"bench/{row.script} exited {code}:\n{out[-4000:]}"
    result = result_of(out)
    measured = result.get("measured")
    assert isinstance(measured, dict), f"RESULT has no 'measured' counts: {sorted(result)}"
    assert measured, "RESULT's 'measured' is empty: the bench claims to have counted nothing"
    missing = [claim for claim in row.claims if claim not in measured]
    assert not missing, f"claims not in 'measured': {missing}; it has {sorted(measured)}"
    zero = {name: count for name, count in measured.items() if not count or count <= 0}
    assert not zero, f"claims that measured nothing: {zero}"
