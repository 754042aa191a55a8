"""Preprocessing follows the manifest: size, layout, colour order, scale, mean and std."""

from __future__ import annotations

import copy
from typing import Any

import cv2
import numpy as np
import pytest
from test_vision_manifest import VALID

from sluicegate.vision import synth
from sluicegate.vision.manifest import ModelManifest
from sluicegate.vision.preprocess import preprocess, resize


def _manifest(**changes: Any) -> ModelManifest:
    doc = copy.deepcopy(VALID)
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            doc[section][field] = value
        else:
            doc[section] = value
    return ModelManifest.model_validate(doc)


def _reference(img: np.ndarray, m: ModelManifest) -> np.ndarray:
    """The manifest's recipe written out the slow, obvious way."""
    spec = m.preprocess
    small = cv2.resize(img, (spec.resize.width, spec.resize.height), interpolation=cv2.INTER_AREA)
    if m.input.color_order == "RGB":
        small = small[..., ::-1]
    x = small.astype(np.float64) * spec.scale
    x = (x - np.array(spec.mean)) / np.array(spec.std)
    return x.transpose(2, 0, 1)[None].astype(np.float32)


def test_shape_dtype_and_layout() -> None:
    img, _ = synth.generate(np.random.default_rng(1))
    out = preprocess(img, _manifest())
    assert out.shape == (1, 3, 120, 160)
    assert out.dtype == np.float32
    assert out.flags.c_contiguous


@pytest.mark.parametrize("order", ["RGB", "BGR"])
def test_values_of_a_flat_colour(order: str) -> None:
    m = _manifest(
        input={**VALID["input"], "color_order": order},
        preprocess={**VALID["preprocess"], "mean": [0.1, 0.2, 0.3], "std": [0.5, 0.25, 0.2]},
    )
    img = np.empty((48, 64, 3), np.uint8)
    img[...] = (10, 20, 30)  # B, G, R
    out = preprocess(img, m)
    channels = (30, 20, 10) if order == "RGB" else (10, 20, 30)
    expected = zip(channels, (0.1, 0.2, 0.3), (0.5, 0.25, 0.2), strict=True)
    for c, (pixel, mean, std) in enumerate(expected):
        np.testing.assert_allclose(out[0, c], (pixel / 255 - mean) / std, rtol=1e-5)


@pytest.mark.parametrize("size", [(640, 480), (1280, 960), (800, 600), (1000, 480), (170, 125)])
def test_matches_the_obvious_recipe(size: tuple[int, int]) -> None:
    img, _ = synth.generate(np.random.default_rng(2), "scratch", width=size[0], height=size[1])
    m = _manifest(preprocess={**VALID["preprocess"], "mean": [0.4, 0.5, 0.6]})
    got = preprocess(img, m)
    want = _reference(img, m)
    # Area shrinking in halving steps rounds to uint8 in between: within 1 grey level.
    assert np.abs(got - want).max() <= 1.01 / 255 / 0.25


def test_area_resize_by_halving_equals_one_step_for_exact_factors() -> None:
    img = np.random.default_rng(3).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    one_step = cv2.resize(img, (160, 120), interpolation=cv2.INTER_AREA).astype(int)
    assert np.abs(resize(img, 160, 120, "area").astype(int) - one_step).max() <= 1


def test_same_size_is_not_copied() -> None:
    img = np.zeros((120, 160, 3), np.uint8)
    assert resize(img, 160, 120, "area") is img


@pytest.mark.parametrize(
    "bad",
    [np.zeros((120, 160), np.uint8), np.zeros((120, 160, 4), np.uint8), np.zeros((9, 9, 3))],
)
def test_refuses_what_is_not_a_bgr_image(bad: np.ndarray) -> None:
    with pytest.raises(ValueError, match="expected an HxWx3 uint8 BGR image"):
        preprocess(bad, _manifest())
