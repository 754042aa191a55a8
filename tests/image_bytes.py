"""Hand-made image bytes for bad-input tests: headers that lie, bodies that are broken.

Nothing here allocates the pixels it declares: a 20000x20000 PNG header is 57 bytes.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

from sluicegate.vision.synth import encode_jpeg, generate


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares ``width`` x ``height`` RGB pixels, with one tiny IDAT."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 16))
        + chunk(b"IEND", b"")
    )


def jpeg_header_only(width: int, height: int) -> bytes:
    """A JPEG whose SOF0 declares ``width`` x ``height``, followed by no real scan data."""
    sof = struct.pack(">BHHB", 8, height, width, 3) + b"\x01\x22\x00\x02\x11\x01\x03\x11\x01"
    return (
        b"\xff\xd8"
        + b"\xff\xe0"
        + struct.pack(">H", 16)
        + b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
        + b"\xff\xc0"
        + struct.pack(">H", len(sof) + 2)
        + sof
        + b"\xff\xd9"
    )


def sample_jpeg(seed: int = 7, label: str | None = None) -> tuple[bytes, str]:
    img, truth = generate(np.random.default_rng(seed), label)
    return encode_jpeg(img), truth


def corrupt_jpeg(seed: int = 7) -> bytes:
    """A real JPEG header with its entropy-coded body replaced by noise and cut short."""
    good, _ = sample_jpeg(seed)
    sos = good.index(b"\xff\xda")
    body = np.random.default_rng(seed).integers(0, 255, 400, dtype=np.uint8).tobytes()
    return good[: sos + 20] + body.replace(b"\xff", b"\x00")
