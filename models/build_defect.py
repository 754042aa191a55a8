"""Build models/defect-v1.onnx and its manifest, reproducibly from a seed.

Generates synthetic surface images (sluicegate.vision.synth), encodes them as JPEG (some
PNG), and turns them into tensors with the runtime's own LoadedModel.prepare, so training
sees exactly what serving will see. Trains a small CNN with PyTorch on CPU, writes the ONNX
graph by hand with onnx.helper (deterministic, no exporter), checks it, verifies ONNX Runtime
agrees with PyTorch, then measures held-out accuracy on fresh images through
LoadedModel.infer_bytes, the production path.

    .venv-models/bin/python models/build_defect.py            # writes models/defect-v1.*
    .venv-models/bin/python models/build_defect.py --out /tmp/m  # elsewhere

Needs the dev-only environment described in models/README.md (torch 2.13.0 CPU, onnx).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from onnx_graph import Graph
from torch import nn

from sluicegate.vision import synth
from sluicegate.vision.manifest import ModelManifest
from sluicegate.vision.runtime import LoadedModel, ModelRegistry

NAME = "defect-v1"
VERSION = "1.0.0"
OPSET = 17
INPUT_W, INPUT_H = 160, 120
MEAN = (0.5, 0.5, 0.5)
STD = (0.25, 0.25, 0.25)
CHANNELS = (16, 32, 64, 64)
TRAIN_STREAM, HELDOUT_STREAM, VERIFY_STREAM = 0, 1, 2
# Mostly the size the line cameras send; a few others so the model is not tied to it.
TRAIN_SIZES = ((640, 480),) * 8 + ((800, 600), (512, 384))


def manifest(sha256: str = "0" * 64) -> ModelManifest:
    return ModelManifest.model_validate(
        {
            "name": NAME,
            "version": VERSION,
            "file": f"{NAME}.onnx",
            "sha256": sha256,
            "opset": OPSET,
            "input": {
                "name": "image",
                "shape": [1, 3, INPUT_H, INPUT_W],
                "dtype": "float32",
                "layout": "NCHW",
                "color_order": "RGB",
            },
            "preprocess": {
                "resize": {"width": INPUT_W, "height": INPUT_H, "interpolation": "area"},
                "scale": 1 / 255,
                "mean": list(MEAN),
                "std": list(STD),
                "jpeg_dct_scaling": True,
            },
            "labels": list(synth.LABELS),
            "postprocess": {"kind": "classification", "output": "scores", "softmax": False},
        }
    )


# --- data ---------------------------------------------------------------------------------


def _sample(args: tuple[int, int, int]) -> tuple[npt.NDArray[np.float32], int]:
    """One training image, fully determined by (seed, stream, index)."""
    seed, stream, index = args
    rng = np.random.default_rng([seed, stream, index])
    label = synth.LABELS[index % len(synth.LABELS)]
    width, height = TRAIN_SIZES[int(rng.integers(len(TRAIN_SIZES)))]
    img, _ = synth.generate(rng, label, width=width, height=height)
    if rng.random() < 0.1:
        data = synth.encode_png(img)
    else:
        data = synth.encode_jpeg(img, int(rng.integers(60, 99)))
    batch, _, _, _ = LoadedModel(manifest(), session=None).prepare(data)
    return batch[0], synth.LABELS.index(label)


def dataset(
    seed: int, stream: int, n: int, jobs: int
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    x = np.empty((n, 3, INPUT_H, INPUT_W), np.float32)
    y = np.empty(n, np.int64)
    tasks = [(seed, stream, i) for i in range(n)]
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        for i, (tensor, label) in enumerate(pool.imap(_sample, tasks, chunksize=64)):
            x[i], y[i] = tensor, label
    return x, y


# --- model --------------------------------------------------------------------------------


def train(x: npt.NDArray[np.float32], y: npt.NDArray[np.int64], seed: int, epochs: int) -> Net:
    torch.manual_seed(seed)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=1e-4)
    batch = 64
    steps = epochs * (len(x) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps)
    gen = torch.Generator().manual_seed(seed)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    loss_fn = torch.nn.CrossEntropyLoss()
    for epoch in range(epochs):
        net.train()
        t0 = time.perf_counter()
        order = torch.randperm(len(x), generator=gen)
        total, right, loss_sum = 0, 0, 0.0
        for start in range(0, len(x) - batch + 1, batch):
            idx = order[start : start + batch]
            xb, yb = xt[idx], yt[idx]
            # Flips are free extra views: a defect is a defect either way up.
            flip = torch.rand(2, generator=gen)
            if flip[0] < 0.5:
                xb = xb.flip(3)
            if flip[1] < 0.5:
                xb = xb.flip(2)
            logits = net(xb)
            loss = loss_fn(logits, yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            loss_sum += float(loss.detach()) * len(idx)
            right += int((logits.argmax(1) == yb).sum())
            total += len(idx)
        print(
            f"  epoch {epoch + 1:2d}/{epochs}: loss {loss_sum / total:.4f}, "
            f"train accuracy {right / total:.4f} ({time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
    net.eval()
    return net


class Net(nn.Module):
    """Four stride-2 conv blocks, then global max and mean pooling, then one linear layer.

    Max pooling finds one small pit anywhere; mean pooling weighs a broad stain.
    """

    def __init__(self) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        c_in = 3
        for c_out in CHANNELS:
            blocks += [
                nn.Conv2d(c_in, c_out, 3, stride=2, padding=1, bias=False),
                nn.BatchNorm2d(c_out),
                nn.ReLU(),
            ]
            c_in = c_out
        self.features = nn.Sequential(*blocks)
        self.fc = nn.Linear(2 * c_in, len(synth.LABELS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.features(x)
        pooled = torch.cat([f.amax(dim=(2, 3)), f.mean(dim=(2, 3))], dim=1)
        return self.fc(pooled)


# --- export -------------------------------------------------------------------------------


def export(net: Net, seed: int) -> bytes:
    """Write the ONNX graph by hand from the trained weights, batch norm folded in."""
    g = Graph()
    current = "image"
    modules = list(net.features)
    for i in range(0, len(modules), 3):
        j = i // 3
        current = g.conv(f"conv{j}", current, modules[i], modules[i + 1], relu=f"relu{j}")
    g.const("fc.weight", net.fc.weight.detach().numpy())
    g.const("fc.bias", net.fc.bias.detach().numpy())
    g.node("GlobalMaxPool", [current], ["gmp"])
    g.node("GlobalAveragePool", [current], ["gap"])
    g.node("Concat", ["gmp", "gap"], ["pooled4d"], axis=1)
    g.node("Flatten", ["pooled4d"], ["pooled"], axis=1)
    g.node("Gemm", ["pooled", "fc.weight", "fc.bias"], ["logits"], transB=1)
    g.node("Softmax", ["logits"], ["scores"], axis=1)
    return g.finish(
        NAME,
        [("image", ["batch", 3, INPUT_H, INPUT_W])],
        [("scores", ["batch", len(synth.LABELS)])],
        opset=OPSET,
        producer="sluicegate models/build_defect.py",
        version=VERSION,
        doc=f"Synthetic surface defect classifier {NAME}, seed {seed}.",
    )


def verify_against_torch(net: Net, onnx_bytes: bytes, x: npt.NDArray[np.float32]) -> float:
    import onnxruntime as ort

    session = ort.InferenceSession(onnx_bytes, providers=["CPUExecutionProvider"])
    got = session.run(["scores"], {"image": x})[0]
    with torch.no_grad():
        want = torch.softmax(net(torch.from_numpy(x)), dim=1).numpy()
    diff = float(np.abs(got - want).max())
    if diff > 1e-4:
        raise SystemExit(f"ONNX Runtime and PyTorch disagree: max |difference| {diff:.2e}")
    return diff


# --- held-out evaluation through the production path -------------------------------------


def fresh_jpegs(seed: int, stream: int, n: int) -> Iterator[tuple[bytes, str]]:
    """Fresh 640x480 JPEG (quality 90) images with random labels, never used in training."""
    for i in range(n):
        rng = np.random.default_rng([seed, stream, i])
        img, label = synth.generate(rng)
        yield synth.encode_jpeg(img, 90), label


def evaluate(folder: Path, seed: int, n: int) -> float:
    model = ModelRegistry.from_dir(folder).get(NAME)
    labels = synth.LABELS
    confusion = np.zeros((len(labels), len(labels)), np.int64)
    decode, prep, infer, sizes = [], [], [], []
    for data, label in fresh_jpegs(seed, HELDOUT_STREAM, n):
        outputs, times = model.infer_bytes(data)
        assert outputs.label is not None
        confusion[labels.index(label), labels.index(outputs.label)] += 1
        decode.append(times.decode_ms)
        prep.append(times.preprocess_ms)
        infer.append(times.inference_ms)
        sizes.append(len(data) / 1024)
    accuracy = float(np.trace(confusion) / confusion.sum())
    print(
        f"held-out accuracy on {n} fresh 640x480 JPEGs via LoadedModel.infer_bytes: {accuracy:.4f}"
    )
    print("  confusion (rows = truth, columns = predicted):", ", ".join(labels))
    for label, row in zip(labels, confusion, strict=True):
        print(f"  {label:>8}: {' '.join(f'{v:4d}' for v in row)}")
    med = statistics.median
    print(
        f"  median per image: decode {med(decode):.3f} ms, preprocess {med(prep):.3f} ms, "
        f"inference {med(infer):.3f} ms; JPEG size {min(sizes):.0f}-{max(sizes):.0f} KB "
        f"(median {med(sizes):.0f} KB)"
    )
    return accuracy


# --- main ---------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=20240611, help="everything derives from it")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent, help="output folder"
    )
    parser.add_argument("--train", type=int, default=8000, help="training images")
    parser.add_argument("--epochs", type=int, default=16)
    parser.add_argument("--heldout", type=int, default=1000, help="fresh images to score")
    parser.add_argument("--jobs", type=int, default=2, help="processes generating images")
    parser.add_argument(
        "--threads", type=int, default=2, help="torch threads; part of the reproducibility key"
    )
    parser.add_argument(
        "--min-accuracy", type=float, default=0.95, help="exit 1 below this held-out accuracy"
    )
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    start = time.perf_counter()

    print(f"generating {args.train} training images (seed {args.seed})...", flush=True)
    x, y = dataset(args.seed, TRAIN_STREAM, args.train, args.jobs)
    print(f"  done in {time.perf_counter() - start:.0f} s; training...", flush=True)
    net = train(x, y, args.seed, args.epochs)
    del x, y

    onnx_bytes = export(net, args.seed)
    check_x, _ = dataset(args.seed, VERIFY_STREAM, 64, 1)
    diff = verify_against_torch(net, onnx_bytes, check_x)
    digest = hashlib.sha256(onnx_bytes).hexdigest()
    print(
        f"exported {len(onnx_bytes) / 1024:.0f} KB, opset {OPSET}; ONNX Runtime matches "
        f"PyTorch on 64 images (max |diff| {diff:.1e}); sha256 {digest}"
    )

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{NAME}.onnx").write_bytes(onnx_bytes)
    text = json.dumps(manifest(digest).model_dump(mode="json"), indent=2) + "\n"
    (args.out / f"{NAME}.json").write_text(text, encoding="utf-8")
    print(f"wrote {args.out / f'{NAME}.onnx'} and {NAME}.json")

    accuracy = evaluate(args.out, args.seed, args.heldout)
    print(f"build took {time.perf_counter() - start:.0f} s")
    if accuracy < args.min_accuracy:
        print(f"accuracy {accuracy:.4f} is below {args.min_accuracy}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
