"""Real tier: a third-party model whose graph fixes its batch at 1, in a campus's models
folder as a plant engineer adds it (``sluicegate models add``). The campus starts as the
demo does, timing every model in the folder on each kind of node first (the step that died
on such a model), and the model serves on a line PC's agent and on a pool worker, an image
at a time, over the secured campus (real processes, Mosquitto, Redis, ONNX Runtime).
"""

from __future__ import annotations

import asyncio
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from sluicegate import wire
from sluicegate.app.campus import APP_OF_LINE, APPS
from sluicegate.app.localcampus import LocalCampus
from sluicegate.client import AsyncClient
from sluicegate.vision.runtime import MODELS_DIR_ENV, default_models_dir
from tests.image_bytes import sample_jpeg
from tests.support import local_campus
from tests.test_models_add import SIZE, add_classifier, graph

pytestmark = [pytest.mark.integration, pytest.mark.slow]

OFFLOADS, KEEPS = "line-1-pc", "line-2-pc"


def _models_folder(tmp_path: Path) -> Path:
    """The shipped defect classifier, and beside it a classifier whose input is [1, 3, 64,
    64] that answers 'pit' for any image, added with ``models add``."""
    folder = tmp_path / "models"
    folder.mkdir()
    for name in ("defect-v1.json", "defect-v1.onnx"):
        shutil.copy(default_models_dir() / name, folder / name)
    bias = np.array([0.1, 0.2, 0.6, 0.1])  # its output whatever the image: pit
    source = graph(tmp_path / "fixed.onnx", (4,), bias, input_shape=[1, 3, SIZE, SIZE])
    code, out = add_classifier(source, tmp_path, "ok\nscratch\npit\nstain\n")
    assert code == 0, out
    return folder


async def _jobs(campus: LocalCampus, edge: str, n: int) -> list[wire.JobResult]:
    app = APP_OF_LINE[edge]
    reply_to = f"{APPS[app][1]}/fixed-{uuid.uuid4().hex[:6]}"
    async with AsyncClient(campus.write().mqtt(app), edge=edge, response_topic=reply_to) as c:
        image = sample_jpeg(3)[0]
        return list(
            await asyncio.gather(
                *(
                    c.infer(image, model="fixed", deadline_ms=10_000.0, data_class="wafer-image")
                    for _ in range(n)
                )
            )
        )


def test_a_model_with_its_batch_fixed_at_one_starts_and_serves_on_a_line_pc_and_a_worker(
    tmp_path: Path, fresh_redis_db: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MODELS_DIR_ENV, str(_models_folder(tmp_path)))
    node_env = {
        OFFLOADS: {"SLUICEGATE_OFFLOAD__QUEUE_BOUND": "0"},  # offers every job
        KEEPS: {"SLUICEGATE_OFFLOAD__ENABLED": "false"},  # runs every job itself
    }

    with local_campus(tmp_path / "campus", fresh_redis_db(), node_env=node_env, start=False) as lc:
        found = lc.calibrate()  # what the demo does before it starts: every model, each role
        assert {p.model for p in found["edge"]} == {"fixed", "defect-v1"}
        assert {p.batch for p in found["pool"] if p.model == "fixed"} == {1}
        lc.start()
        try:
            lc.wait_workers_online(["north-cpu-1", "cloud-cpu-1"])
            offloaded = asyncio.run(_jobs(lc, OFFLOADS, 4))
            kept = asyncio.run(_jobs(lc, KEEPS, 4))
        finally:
            lc.stop()
    for results, kind in ((offloaded, "pool"), (kept, "edge")):
        assert [(r.status, r.ran_on.kind if r.ran_on else None) for r in results] == [
            ("ok", kind)
        ] * 4, [(r.reason, r.offload) for r in results]
        assert {r.outputs.label for r in results if r.outputs} == {"pit"}
