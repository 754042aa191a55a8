"""Benchmark: every shipped model on every backend this node has — ONNX Runtime (CPU) and
OpenVINO (CPU), side by side — at batch 1 and batch 8: p50/p99 of one ``session.run`` of
the model's own input (for OCR: its detector on a label, its recogniser on 8 lines), and the
peak RSS of a process that serves that one model on that one backend.

Each (model, backend) pair runs in its own child process (so its peak RSS is its own), one
inference thread, after a warm-up; pairs alternate (ONNX Runtime first in odd rounds,
OpenVINO first in even ones) for ``--rounds`` rounds, and the figures are the medians over
rounds. The baseline is ONNX Runtime: the ratio is OpenVINO's p50 over it.

    .venv/bin/python bench/backends.py                    # about 2 minutes on 2 cores
    .venv/bin/python bench/backends.py --runs 50 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import stats  # noqa: E402

BACKENDS = {"onnxruntime": None, "openvino": ["OpenVINO/CPU"]}


def _child(model: str, backend: str, runs: int) -> dict[str, Any]:
    from sluicegate.vision import label_synth, synth
    from sluicegate.vision.runtime import ModelRegistry, OcrModel, default_models_dir

    registry = ModelRegistry.from_dir(default_models_dir(), providers=BACKENDS[backend])
    served = registry.get(model)
    rng = np.random.default_rng(0)
    if isinstance(served, OcrModel):
        data = synth.encode_jpeg(label_synth.generate_label(rng).image)
    else:
        width = max(64, served.manifest.input.width * 2)
        height = max(64, served.manifest.input.height * 2)
        data = synth.encode_jpeg(synth.generate(rng, width=width, height=height)[0])
    tensor, _d, _p, _frame = served.prepare(data)
    feeds = {
        1: {served.manifest.input.name: tensor},
        8: {served.manifest.input.name: np.concatenate([tensor] * 8)},
    }
    session = served.session
    out: dict[str, Any] = {}
    if isinstance(served, OcrModel):
        rec = served.manifest.postprocess.recognizer  # type: ignore[union-attr]
        lines = rng.uniform(-1, 1, (8, 3, rec.height, rec.min_width)).astype(np.float32)
        feeds[8] = {rec.input: lines}
    for batch, feed in feeds.items():
        run = served.recogniser.run if isinstance(served, OcrModel) and batch == 8 else session.run
        for _ in range(5):
            run(None, feed)
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            run(None, feed)
            times.append((time.perf_counter() - t0) * 1e3)
        out[f"b{batch}_p50_ms"] = stats.percentile(times, 50)
        out[f"b{batch}_p99_ms"] = stats.percentile(times, 99)
        out[f"b{batch}_runs"] = len(times)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=100, help="timed runs per batch size")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "BACKEND"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.child[0], args.child[1], args.runs)))
        return
    from sluicegate.vision.runtime import ModelRegistry, default_models_dir

    models = ModelRegistry.from_dir(default_models_dir()).names()
    found: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for round_ in range(args.rounds):
        order = list(BACKENDS) if round_ % 2 == 0 else list(reversed(BACKENDS))
        for model in models:
            for backend in order:
                got = subprocess.run(
                    [sys.executable, __file__, "--runs", str(args.runs), "--child", model, backend],
                    capture_output=True, text=True, check=True,
                    env={**os.environ, "OMP_NUM_THREADS": "1"},
                )  # fmt: skip
                found.setdefault((model, backend), []).append(
                    json.loads(got.stdout.splitlines()[-1])
                )
    table: dict[str, dict[str, dict[str, float]]] = {}
    heads = ("b1 p50", "b1 p99", "b8 p50", "b8 p99", "RSS MB")
    print(f"{'model':<14} {'backend':<12} " + " ".join(f"{h:>8}" for h in heads))
    for (model, backend), runs in found.items():
        med = {k: stats.median(r[k] for r in runs) for k in runs[0]}
        table.setdefault(model, {})[backend] = med
        print(
            f"{model:<14} {backend:<12} {med['b1_p50_ms']:8.2f} {med['b1_p99_ms']:8.2f} "
            f"{med['b8_p50_ms']:8.2f} {med['b8_p99_ms']:8.2f} {med['peak_rss_mb']:8.0f}"
        )
    ratio = {
        m: {
            f"openvino_over_onnxruntime_b{b}_p50": v["openvino"][f"b{b}_p50_ms"]
            / v["onnxruntime"][f"b{b}_p50_ms"]
            for b in (1, 8)
        }
        for m, v in table.items()
    }
    timed = {b: sum(int(r[f"b{b}_runs"]) for rs in found.values() for r in rs) for b in (1, 8)}
    result = {
        "bench": "backends",
        "subject": {m: v["openvino"] for m, v in table.items()},
        "baseline": {m: v["onnxruntime"] for m, v in table.items()},
        "ratio": ratio,
        "target": {},
        "met": True,  # no target: the figures are read, not judged
        "measured": stats.require(
            {
                "models": len(table),
                "models on openvino": sum(1 for _m, b in found if b == "openvino"),
                "models on onnxruntime": sum(1 for _m, b in found if b == "onnxruntime"),
                "timed batch-1 runs": timed[1],
                "timed batch-8 runs": timed[8],
            }
        ),
        "machine": stats.machine("openvino"),
        "runs": args.runs,
        "rounds": args.rounds,
    }
    print(stats.result_line(result))


if __name__ == "__main__":
    main()
