"""Fetch PP-OCRv4's text detector and recogniser (Apache-2.0) for the ``ocr-ppocrv4`` model.

The two ONNX files come inside the ``rapidocr-onnxruntime`` 1.4.4 wheel on the package
registry. This script asks pip for that wheel by name and version (no dependencies), takes
the two ``.onnx`` files out of it, checks each against the sha256 pinned in
``models/ocr-ppocrv4.json`` and writes them beside it. It does nothing when both files are
there with the right digests, and refuses (exit 1, nothing written) when a digest differs.
The bootstrap runs it; nothing downloads a model at run time.

    .venv/bin/python models/fetch_ppocr.py [--models-dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = ("rapidocr-onnxruntime", "1.4.4")
MANIFEST = "ocr-ppocrv4.json"
INSIDE = {  # the file in the wheel, for the file the manifest names
    "ocr-ppocrv4-det.onnx": "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
    "ocr-ppocrv4-rec.onnx": "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
}


def pinned(models_dir: Path) -> dict[str, str]:
    """file name -> sha256, as the manifest pins them."""
    doc = json.loads((models_dir / MANIFEST).read_text())
    rec = doc["postprocess"]["recognizer"]
    return {doc["file"]: doc["sha256"], rec["file"]: rec["sha256"]}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def present(models_dir: Path, digests: dict[str, str]) -> bool:
    for name, digest in digests.items():
        path = models_dir / name
        if not path.is_file() or _sha(path.read_bytes()) != digest:
            return False
    return True


def fetch(models_dir: Path) -> str:
    digests = pinned(models_dir)
    if present(models_dir, digests):
        return "PP-OCRv4 models present and verified"
    name, version = WHEEL
    with tempfile.TemporaryDirectory(prefix="sg-ppocr-") as scratch:
        got = subprocess.run(
            [sys.executable, "-m", "pip", "download", f"{name}=={version}", "--no-deps",
             "--only-binary", ":all:", "-d", scratch, "-q"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if got.returncode != 0:
            raise SystemExit(f"pip could not download {name} {version}:\n{got.stderr.strip()}")
        (wheel,) = Path(scratch).glob("*.whl")
        found: dict[str, bytes] = {}
        with zipfile.ZipFile(wheel) as archive:
            for target, member in INSIDE.items():
                found[target] = archive.read(member)
    for target, data in found.items():
        if _sha(data) != digests[target]:
            raise SystemExit(
                f"{name} {version}: {INSIDE[target]} has sha256 {_sha(data)}, but "
                f"{MANIFEST} pins {digests[target]}; nothing written"
            )
    for target, data in found.items():
        tmp = models_dir / f".{target}.tmp"
        tmp.write_bytes(data)
        tmp.replace(models_dir / target)
    return f"PP-OCRv4 detector and recogniser taken from {name} {version}, verified"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models-dir", type=Path, default=Path(__file__).resolve().parent)
    print(fetch(ap.parse_args().models_dir))


if __name__ == "__main__":
    main()
