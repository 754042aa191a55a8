"""The synthetic image generator: reproducible, labelled, and the size benchmarks rely on."""

from __future__ import annotations

import numpy as np
import pytest

from sluicegate.vision import synth
from sluicegate.vision.image import decode, probe


def test_same_seed_same_image() -> None:
    a, label_a = synth.generate(np.random.default_rng(7))
    b, label_b = synth.generate(np.random.default_rng(7))
    assert label_a == label_b
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("label", synth.LABELS)
def test_requested_label_and_shape(label: str) -> None:
    img, got = synth.generate(np.random.default_rng(1), label, width=320, height=200)
    assert got == label
    assert img.shape == (200, 320, 3)
    assert img.dtype == np.uint8


def test_random_labels_cover_all_classes() -> None:
    rng = np.random.default_rng(2)
    seen = {synth.generate(rng, width=96, height=64)[1] for _ in range(40)}
    assert seen == set(synth.LABELS)


def test_defect_changes_the_picture() -> None:
    # Same seed, so the background draws start identical; the defect adds pixels on top.
    ok, _ = synth.generate(np.random.default_rng(3), "ok")
    for label in ("scratch", "pit", "stain"):
        img, _ = synth.generate(np.random.default_rng(3), label)
        assert not np.array_equal(img, ok)


def test_unknown_label_and_tiny_size_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown label 'dent'; known: ok, scratch, pit, stain"):
        synth.generate(np.random.default_rng(0), "dent")
    with pytest.raises(ValueError, match="at least 64x64"):
        synth.generate(np.random.default_rng(0), width=32, height=32)


def test_jpeg_of_640x480_is_50_to_100_kb() -> None:
    """The latency benchmark needs realistic 50-100 KB camera frames."""
    sizes = []
    for i in range(24):
        img, _ = synth.generate(np.random.default_rng([31, i]))
        sizes.append(len(synth.encode_jpeg(img, 90)) / 1024)
    assert min(sizes) >= 50
    assert max(sizes) <= 100


def test_encoders_round_trip() -> None:
    img, _ = synth.generate(np.random.default_rng(4), width=128, height=96)
    png = synth.encode_png(img)
    assert probe(png).format == "png"
    np.testing.assert_array_equal(decode(png), img)
    jpeg = synth.encode_jpeg(img, 75)
    assert probe(jpeg).format == "jpeg"
    assert decode(jpeg).shape == img.shape


def test_a_scene_says_which_surface_it_is_on_and_draws_what_generate_draws() -> None:
    from sluicegate.vision import synth_boxes

    surfaces = set()
    for seed in range(12):
        drawn = synth_boxes.scene(np.random.default_rng(seed), width=160, height=120)
        image, defects = synth_boxes.generate(np.random.default_rng(seed), width=160, height=120)
        assert np.array_equal(drawn.image, image)  # the same draws, the same image
        assert drawn.defects == defects
        surfaces.add(drawn.surface)
    assert surfaces == set(synth.SURFACES)  # wafers and both kinds of metal part
