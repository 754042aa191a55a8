"""Image intake: header probing, the decompression-bomb guard, and decoding failures."""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Callable

import cv2
import numpy as np
import pytest
from PIL import Image

from sluicegate.errors import ImageError, ImageTooLargeError
from sluicegate.vision import image, synth
from sluicegate.vision.image import ImageInfo, check_dimensions, dct_reduction, decode, probe

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_declaring(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims width x height; the pixel data is never there."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return (
        PNG_MAGIC + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")
    )


def _jpeg_declaring(width: int, height: int) -> bytes:
    """A real 16x16 JPEG with its frame header (SOF0) patched to claim width x height."""
    data = bytearray(synth.encode_jpeg(np.zeros((16, 16, 3), np.uint8)))
    sof = data.find(b"\xff\xc0")
    assert sof > 0
    # marker(2) length(2) precision(1) height(2) width(2)
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


@pytest.fixture(scope="module")
def photo() -> np.ndarray:
    img, _ = synth.generate(np.random.default_rng(5), "ok")
    return img


def test_probe_jpeg(photo: np.ndarray) -> None:
    assert probe(synth.encode_jpeg(photo)) == ImageInfo("jpeg", 640, 480)


def test_probe_png() -> None:
    img = np.zeros((30, 50, 3), np.uint8)
    assert probe(synth.encode_png(img)) == ImageInfo("png", 50, 30)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"", "empty payload"),
        (b"hello, world", "not a JPEG or PNG image: first bytes are 68 65 6c"),
        (b"GIF89a\x01\x00\x01\x00", "looks like GIF"),
        (b'{"image": "..."}', "looks like JSON or text"),
        (b"\xff\xd8\xff", "truncated JPEG header \\(3 bytes\\): no frame header"),
        (b"\xff\xd8\xff\xe0\x00\x10JFIF", "truncated JPEG header"),
        # What Pillow scanned byte by byte (0.5 s at 8 MiB): refused at the first bad byte.
        (b"\xff\xd8\xff" + bytes(8 << 20), "a stuffed zero \\(marker 0x00\\) at byte 3"),
        (b"\xff\xd8\xff\xd9", "corrupt JPEG header: the image data \\(marker 0xd9\\)"),
        (b"\xff\xd8\xff\xda\x00\x08", "the image data \\(marker 0xda\\) at byte 3"),
        (b"\xff\xd8\xff\xe0\x00\x01", "segment length 1 at byte 4"),
        (b"\xff\xd8\xff\xe0\x00\x10" + bytes(14) + b"\x42", "found 0x42"),
        (PNG_MAGIC, "corrupt or truncated PNG header"),
        (PNG_MAGIC + b"\x00" * 30, "corrupt or truncated PNG header"),
    ],
)
def test_probe_refuses_what_is_not_an_image(data: bytes, expected: str) -> None:
    with pytest.raises(ImageError, match=expected):
        probe(data)


def test_probe_refuses_truncated_header(photo: np.ndarray) -> None:
    jpeg = synth.encode_jpeg(photo)
    sof = jpeg.find(b"\xff\xc0")
    with pytest.raises(ImageError, match="truncated JPEG header"):
        probe(jpeg[: sof + 6])


def test_probe_refuses_png_with_bad_header_checksum() -> None:
    data = bytearray(_png_declaring(10, 10))
    data[20] ^= 0xFF  # inside IHDR, so its CRC no longer matches
    with pytest.raises(ImageError, match="PNG header"):
        probe(bytes(data))


@pytest.mark.parametrize("craft", [_png_declaring, _jpeg_declaring])
def test_bomb_is_refused_from_the_header_before_decoding(
    craft: Callable[[int, int], bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    data = craft(20000, 20000)
    assert len(data) < 2000  # the claim, not the pixels

    def no_decoding(*_: object) -> None:
        raise AssertionError("decoded an image that should have been refused")

    monkeypatch.setattr(image.cv2, "imdecode", no_decoding)
    info = probe(data)
    assert (info.width, info.height) == (20000, 20000)
    with pytest.raises(ImageTooLargeError, match=r"20000x20000 = 400000000 pixels.*40000000"):
        check_dimensions(info, max_pixels=40_000_000, max_side=30_000)
    with pytest.raises(ImageTooLargeError, match=r"20000x20000 pixels; each side .* 16384"):
        check_dimensions(info, max_pixels=10**9, max_side=16384)


def test_sane_dimensions_pass() -> None:
    check_dimensions(ImageInfo("jpeg", 640, 480), max_pixels=640 * 480, max_side=640)


def test_decode_jpeg_and_png(photo: np.ndarray) -> None:
    from_png = decode(synth.encode_png(photo))
    assert from_png.dtype == np.uint8
    np.testing.assert_array_equal(from_png, photo)
    from_jpeg = decode(synth.encode_jpeg(photo, 95))
    assert from_jpeg.shape == (480, 640, 3)
    assert np.abs(from_jpeg.astype(int) - photo).mean() < 6


def test_decode_grey_png_gives_three_channels() -> None:
    import cv2

    ok, buf = cv2.imencode(".png", np.full((8, 9), 77, np.uint8))
    assert ok
    out = decode(bytes(buf))
    assert out.shape == (8, 9, 3)
    assert (out == 77).all()


@pytest.mark.parametrize("keep", [0.5, 0.9, -2])
def test_decode_refuses_truncated_jpeg(photo: np.ndarray, keep: float) -> None:
    data = synth.encode_jpeg(photo)
    cut = int(len(data) * keep) if keep > 0 else len(data) + int(keep)
    probe(data[:cut])  # the header alone still looks fine...
    with pytest.raises(ImageError, match="truncated JPEG"):
        decode(data[:cut])  # ...the body does not


def test_decode_refuses_corrupt_png_body(photo: np.ndarray) -> None:
    data = bytearray(synth.encode_png(photo))
    idat = data.find(b"IDAT")
    data[idat + 100 : idat + 140] = b"\x00" * 40
    probe(bytes(data))
    with pytest.raises(ImageError, match="corrupt or truncated"):
        decode(bytes(data))


def test_decode_refuses_truncated_png(photo: np.ndarray) -> None:
    data = synth.encode_png(photo)
    with pytest.raises(ImageError, match="corrupt or truncated"):
        decode(data[: len(data) // 2])


def test_decode_refuses_empty_and_garbage() -> None:
    with pytest.raises(ImageError, match="empty payload"):
        decode(b"")
    with pytest.raises(ImageError, match="cannot decode"):
        decode(b"not an image at all")


@pytest.mark.parametrize(
    ("info", "target", "expected"),
    [
        (ImageInfo("jpeg", 640, 480), (160, 120), 4),
        (ImageInfo("jpeg", 1280, 960), (160, 120), 8),
        (ImageInfo("jpeg", 641, 481), (160, 120), 4),
        (ImageInfo("jpeg", 636, 480), (160, 120), 2),
        (ImageInfo("jpeg", 160, 120), (160, 120), 1),
        (ImageInfo("png", 640, 480), (160, 120), 1),
    ],
)
def test_dct_reduction_never_goes_below_the_target(
    info: ImageInfo, target: tuple[int, int], expected: int
) -> None:
    assert dct_reduction(info, *target) == expected


def test_reduced_jpeg_decode_is_close_to_area_resize(photo: np.ndarray) -> None:
    import cv2

    data = synth.encode_jpeg(photo, 90)
    reduced = decode(data, reduce=4)
    area = cv2.resize(decode(data), (160, 120), interpolation=cv2.INTER_AREA)
    assert reduced.shape == area.shape
    assert np.abs(reduced.astype(int) - area).mean() < 1.0


@pytest.mark.parametrize(
    ("width", "height", "params"),
    [
        (640, 480, []),
        (33, 17, [cv2.IMWRITE_JPEG_PROGRESSIVE, 1]),
        (1, 1, [cv2.IMWRITE_JPEG_QUALITY, 5]),
        (4000, 3, [cv2.IMWRITE_JPEG_RST_INTERVAL, 4]),
    ],
)
def test_jpeg_header_walk_agrees_with_pillow(width: int, height: int, params: list[int]) -> None:
    img = np.random.default_rng(width).integers(0, 255, (height, width, 3), dtype=np.uint8)
    ok, buf = cv2.imencode(".jpg", img, params)
    assert ok
    data = buf.tobytes()
    with Image.open(io.BytesIO(data)) as im:
        assert probe(data) == ImageInfo("jpeg", *im.size)


def test_jpeg_header_walk_skips_large_metadata_segments() -> None:
    img = Image.new("RGB", (321, 123), "gray")
    out = io.BytesIO()
    exif = Image.Exif()
    exif[0x010E] = "x" * 60_000  # ImageDescription: a ~60 KB APP1 segment before the frame
    img.save(out, "JPEG", exif=exif, icc_profile=b"\0" * 50_000)
    assert probe(out.getvalue()) == ImageInfo("jpeg", 321, 123)
