"""Real tier: a local campus's nodes timed before they serve (``sluicegate.app.calibration``),
on the shipped models and real ONNX Runtime: a folder of links to the shipped files with
the figures as priors beside them, which a registry loads as it would the shipped folder;
and on a machine whose CPU cgroup can be written, the same under a cap, the cgroup gone
afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluicegate.app.calibration import CGROUP_V1, calibrate, cpu_cap_available
from sluicegate.vision.priors import PRIORS_FILE, priors_for, read_priors
from sluicegate.vision.runtime import ModelRegistry, default_models_dir


def test_calibrated_folder_serves_the_shipped_models_with_their_priors(tmp_path: Path) -> None:
    folder, found = calibrate(tmp_path / "edge-models", None, runs=1)
    shipped = ModelRegistry.from_dir(default_models_dir())
    registry = ModelRegistry.from_dir(folder)
    assert registry.names() == shipped.names()
    for name in registry.names():  # the very files, not copies that could drift
        assert registry.get(name).manifest.sha256 == shipped.get(name).manifest.sha256
        assert (folder / registry.get(name).manifest.file).is_symlink()
    assert {p.model for p in found} == set(registry.names())
    stored = read_priors(folder / PRIORS_FILE)
    assert stored == found
    assert set(priors_for(registry, stored)) == set(registry.names())  # all of them fit
    again, _ = calibrate(folder, None, runs=1)  # a second time: the links are kept
    assert again == folder
    # Another campus of the same process starts from the same figures, timed once.
    other, same = calibrate(tmp_path / "other-edge-models", None, runs=1)
    assert same == found
    assert read_priors(other / PRIORS_FILE) == found
    assert ModelRegistry.from_dir(other).names() == shipped.names()


@pytest.mark.skipif(not cpu_cap_available(), reason="no writable cgroup v1 CPU hierarchy")
def test_a_capped_calibration_leaves_no_cgroup_behind(tmp_path: Path) -> None:
    before = {p.name for p in CGROUP_V1.iterdir() if p.name.startswith("sluicegate-calibrate")}
    folder, found = calibrate(tmp_path / "line-pc", 0.5, runs=1)
    after = {p.name for p in CGROUP_V1.iterdir() if p.name.startswith("sluicegate-calibrate")}
    assert after == before
    assert {p.model for p in found} == set(ModelRegistry.from_dir(folder).names())
