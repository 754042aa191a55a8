"""Build models/surface-det.onnx and its manifest, reproducibly from a seed.

A small anchor-free surface-defect detector (scratch, pit, stain) whose one output is in
the YOLOv8 layout, ``output0`` = [N, 4 + 3, A]: per anchor cx, cy, w, h in model-input
pixels, then three class scores in [0, 1]; the runtime's detection postprocess does the
NMS and the letterbox mapping. This script owns the training: the torch model, its targets
and loss, the training loop, the export and the scoring. The images and the manifest come
from ``detector_data.py`` (synth_boxes JPEGs turned into tensors by the runtime's own
LoadedModel.prepare under the very manifest that ships, so training sees exactly what
serving will see). The ONNX graph is written by hand with onnx.helper (deterministic, no
exporter), checked, compared with PyTorch, then scored (mAP@0.5) on fresh images through
LoadedModel.infer_bytes.

    .venv-models/bin/python models/build_detector.py            # writes models/surface-det.*
    .venv-models/bin/python models/build_detector.py --out /tmp/m  # elsewhere

Needs the dev-only environment described in models/README.md (torch 2.13.0 CPU, onnx).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from detector_data import (
    F32,
    INPUT,
    LABELS,
    NAME,
    OPSET,
    SCALE,
    TRAIN_STREAM,
    U8,
    VERIFY_STREAM,
    VERSION,
    dataset,
    evaluate,
    manifest,
)
from onnx_graph import Graph
from torch import nn

STRIDE = 8
GRID = INPUT // STRIDE
RAW = 4 + len(LABELS) + 1  # the head's channels: box, class logits, quality logit
STEM, C1, C2, C3 = 24, 48, 64, 64  # channels: stride 4, 8, 16, 32


# --- training data ------------------------------------------------------------------------


def tensors(levels: U8 | torch.Tensor) -> torch.Tensor:
    """The float input the serving code gives for these levels, bit for bit."""
    t = torch.from_numpy(levels) if isinstance(levels, np.ndarray) else levels
    return t.float() * torch.tensor(SCALE)


def targets(
    boxes: list[F32], labels: list[npt.NDArray[np.int64]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Centre sampling: a cell is positive for a box when its centre lies within
    ``radius`` of the box's centre on each axis, the radius half the box, at least 3/4 of a
    cell (so the cell holding the centre always counts, and a pit has a neighbour or three
    to learn from) and at most 1.5 cells. A cell that
    two boxes claim goes to the smaller. Returns class targets [B, C, A], box targets
    [B, A, 4] (xyxy, input pixels) and the positive mask [B, A]."""
    n = len(boxes)
    centres = (np.arange(GRID, dtype=np.float32) + 0.5) * STRIDE
    gy, gx = np.meshgrid(centres, centres, indexing="ij")
    gx, gy = gx.reshape(-1), gy.reshape(-1)
    cls = np.zeros((n, len(LABELS), GRID * GRID), np.float32)
    box = np.zeros((n, GRID * GRID, 4), np.float32)
    pos = np.zeros((n, GRID * GRID), bool)
    for i, (b, c) in enumerate(zip(boxes, labels, strict=True)):
        area = np.full(GRID * GRID, np.inf, np.float32)
        for (x1, y1, x2, y2), label in zip(b, c, strict=True):
            w, h = x2 - x1, y2 - y1
            rx = np.clip(w / 2, 0.75 * STRIDE, 1.5 * STRIDE)
            ry = np.clip(h / 2, 0.75 * STRIDE, 1.5 * STRIDE)
            near = (np.abs(gx - (x1 + x2) / 2) <= rx) & (np.abs(gy - (y1 + y2) / 2) <= ry)
            near &= w * h < area
            area[near] = w * h
            cls[i, :, near] = 0.0
            cls[i, label, near] = 1.0
            box[i, near] = (x1, y1, x2, y2)
            pos[i] |= near
    return torch.from_numpy(cls), torch.from_numpy(box), torch.from_numpy(pos)


def flipped(boxes: list[F32], flips: tuple[bool, bool, bool]) -> list[F32]:
    """Boxes after the batch's horizontal flip, vertical flip and transpose (in that order)."""
    out = []
    for b in boxes:
        b = b.copy()
        if flips[0]:
            b[:, [0, 2]] = INPUT - b[:, [2, 0]]
        if flips[1]:
            b[:, [1, 3]] = INPUT - b[:, [3, 1]]
        if flips[2]:
            b = b[:, [1, 0, 3, 2]]
        out.append(b)
    return out


# --- model --------------------------------------------------------------------------------


def _block(c_in: int, c_out: int, stride: int, kernel: int = 3) -> nn.Sequential:
    pad = kernel // 2 if kernel % 2 else 0
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=pad, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(),
    )


class Net(nn.Module):
    """A 4x4 stride-4 patch stem, then stride 8, 16 and 32 stages of two 3x3 blocks; the
    coarse stages are upsampled back to stride 8 (context for the broad stains and long
    scratches) and fused with it, and a 1x1 head gives per cell dx, dy, log w, log h, three
    class logits and a quality logit (how well the cell's own box fits, FCOS's centreness
    in IoU form); a label's score is its class probability times the quality, so of two
    boxes on one defect the better placed wins the NMS, and ranks higher for the mAP."""

    def __init__(self) -> None:
        super().__init__()
        self.s8 = nn.Sequential(_block(3, STEM, 4, 4), _block(STEM, C1, 2), _block(C1, C1, 1))
        self.s16 = nn.Sequential(_block(C1, C2, 2), _block(C2, C2, 1))
        self.s32 = nn.Sequential(_block(C2, C3, 2), _block(C3, C3, 1))
        self.fuse = _block(C1 + C2 + C3, C1, 1, 1)
        self.neck = _block(C1, C1, 1)
        self.head = nn.Conv2d(C1, RAW, 1)
        nn.init.normal_(self.head.weight, std=0.01)
        nn.init.zeros_(self.head.bias)
        with torch.no_grad():
            self.head.bias[4 : 4 + len(LABELS)] = -4.6  # sigmoid 0.01: few cells hold a defect

    def raw(self, x: torch.Tensor) -> torch.Tensor:
        f8 = self.s8(x)
        f16 = self.s16(f8)
        f32 = self.s32(f16)
        up16 = F.interpolate(f16, scale_factor=2, mode="nearest")
        up32 = F.interpolate(f32, scale_factor=4, mode="nearest")
        out = self.head(self.neck(self.fuse(torch.cat([f8, up16, up32], 1))))
        return out.flatten(2)  # [N, RAW, A]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The graph's ``output0``: cx, cy, w, h (input pixels), class scores."""
        return decode(self.raw(x))


def grid() -> torch.Tensor:
    centres = (torch.arange(GRID, dtype=torch.float32) + 0.5) * STRIDE
    gy, gx = torch.meshgrid(centres, centres, indexing="ij")
    return torch.stack([gx.reshape(-1), gy.reshape(-1)])[None]  # [1, 2, A]


MAX_LOG_SIZE = 6.0  # exp(6) * 8 px: far beyond the input; keeps exp finite


def decode(raw: torch.Tensor) -> torch.Tensor:
    """The head's raw [N, RAW, A] as ``output0`` [N, 4 + C, A], exactly as the graph does."""
    xy = raw[:, 0:2] * STRIDE + grid()
    wh = torch.exp(torch.clamp(raw[:, 2:4], max=MAX_LOG_SIZE)) * STRIDE
    c = len(LABELS)
    scores = torch.sigmoid(raw[:, 4 : 4 + c]) * torch.sigmoid(raw[:, 4 + c :])
    return torch.cat([xy, wh, scores], 1)


def _xyxy(cxcywh: torch.Tensor) -> torch.Tensor:
    """[..., 4] cx cy w h to x1 y1 x2 y2."""
    half = cxcywh[..., 2:4] / 2
    return torch.cat([cxcywh[..., 0:2] - half, cxcywh[..., 0:2] + half], -1)


def giou(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IoU and generalised IoU of matching rows of two [K, 4] xyxy tensors."""
    lt = torch.maximum(a[:, :2], b[:, :2])
    rb = torch.minimum(a[:, 2:], b[:, 2:])
    inter = (rb - lt).clamp(min=0).prod(1)
    area_a = (a[:, 2:] - a[:, :2]).prod(1)
    area_b = (b[:, 2:] - b[:, :2]).prod(1)
    union = area_a + area_b - inter
    iou = inter / union.clamp(min=1e-6)
    hull = (torch.maximum(a[:, 2:], b[:, 2:]) - torch.minimum(a[:, :2], b[:, :2])).prod(1)
    return iou, iou - (hull - union) / hull.clamp(min=1e-6)


def loss_of(
    raw: torch.Tensor, cls_t: torch.Tensor, box_t: torch.Tensor, pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Focal loss on every cell's class logits, GIoU loss on the positive cells' boxes, and
    binary cross-entropy of their quality logits against their boxes' IoU; all per positive
    cell. Returns (total, mean IoU of the positives' boxes)."""
    c = len(LABELS)
    logits = raw[:, 4 : 4 + c]
    p = torch.sigmoid(logits)
    ce = F.binary_cross_entropy_with_logits(logits, cls_t, reduction="none")
    p_t = p * cls_t + (1 - p) * (1 - cls_t)
    alpha = 0.25 * cls_t + 0.75 * (1 - cls_t)
    n_pos = pos.sum().clamp(min=1).float()
    focal = (alpha * (1 - p_t) ** 2 * ce).sum() / n_pos
    pred = _xyxy(decode(raw)[:, :4].transpose(1, 2))[pos]
    iou, g = giou(pred, box_t[pos])
    box_loss = (1 - g).sum() / n_pos
    quality = raw[:, 4 + c][pos]
    target = iou.detach().clamp(0.0, 1.0)
    q_loss = F.binary_cross_entropy_with_logits(quality, target, reduction="sum") / n_pos
    mean_iou = iou.detach().mean() if iou.numel() else torch.tensor(0.0)
    return focal + 2.0 * box_loss + q_loss, mean_iou


def train(
    x: U8, boxes: list[F32], labels: list[npt.NDArray[np.int64]], seed: int, epochs: int
) -> Net:
    torch.manual_seed(seed)
    net = Net()
    batch = 32
    steps = epochs * (len(x) // batch)
    opt = torch.optim.AdamW(net.parameters(), lr=4e-3, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=4e-3, total_steps=steps, pct_start=0.15)
    gen = torch.Generator().manual_seed(seed)
    xt = torch.from_numpy(x)
    for epoch in range(epochs):
        net.train()
        t0 = time.perf_counter()
        order = torch.randperm(len(x), generator=gen)
        loss_sum, iou_sum, count = 0.0, 0.0, 0
        for start in range(0, len(x) - batch + 1, batch):
            idx = order[start : start + batch]
            xb = tensors(xt[idx])
            # Flips and the transpose are free extra views: a defect is one either way up.
            coin = torch.rand(3, generator=gen) < 0.5
            flips = (bool(coin[0]), bool(coin[1]), bool(coin[2]))
            if flips[0]:
                xb = xb.flip(3)
            if flips[1]:
                xb = xb.flip(2)
            if flips[2]:
                xb = xb.transpose(2, 3)
            b = flipped([boxes[int(i)] for i in idx], flips)
            cls_t, box_t, pos = targets(b, [labels[int(i)] for i in idx])
            loss, mean_iou = loss_of(net.raw(xb), cls_t, box_t, pos)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            loss_sum += float(loss.detach())
            iou_sum += float(mean_iou)
            count += 1
        print(
            f"  epoch {epoch + 1:2d}/{epochs}: loss {loss_sum / count:.4f}, positives' IoU "
            f"{iou_sum / count:.3f} ({time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
    net.eval()
    return net


# --- export -------------------------------------------------------------------------------


def export(net: Net, seed: int) -> bytes:
    """Write the ONNX graph by hand from the trained weights, batch norm folded in."""
    g = Graph()

    def conv(name: str, src: str, block: nn.Module, relu: bool = True) -> str:
        if isinstance(block, nn.Sequential):
            return g.conv(name, src, block[0], block[1], relu=f"{name}.relu" if relu else None)
        return g.conv(name, src, block, relu=f"{name}.relu" if relu else None)

    def stage(prefix: str, src: str, seq: nn.Sequential) -> str:
        for i, block in enumerate(seq):
            src = conv(f"{prefix}.{i}", src, block)
        return src

    def upsample(name: str, src: str, factor: int) -> str:
        scales = g.const(f"{name}.scales", [1.0, 1.0, factor, factor])
        g.node(
            "Resize",
            [src, "", scales],
            [name],
            mode="nearest",
            coordinate_transformation_mode="asymmetric",
            nearest_mode="floor",
        )
        return name

    f8 = stage("s8", "images", net.s8)
    f16 = stage("s16", f8, net.s16)
    f32 = stage("s32", f16, net.s32)
    g.node("Concat", [f8, upsample("up16", f16, 2), upsample("up32", f32, 4)], ["cat"], axis=1)
    head = conv("head", conv("neck", conv("fuse", "cat", net.fuse), net.neck), net.head, False)
    g.node("Reshape", [head, g.const("raw.shape", [0, RAW, -1], np.int64)], ["raw"])
    split = g.const("split", [2, 2, len(LABELS), 1], np.int64)
    g.node("Split", ["raw", split], ["dxy", "dwh", "cls", "quality"], axis=1)
    g.node("Mul", ["dxy", g.const("stride", STRIDE)], ["dxy.px"])
    g.node("Add", ["dxy.px", g.const("grid", grid().numpy())], ["cxcy"])
    g.node("Min", ["dwh", g.const("max_log_size", MAX_LOG_SIZE)], ["dwh.clip"])
    g.node("Exp", ["dwh.clip"], ["wh.cells"])
    g.node("Mul", ["wh.cells", "stride"], ["wh"])
    g.node("Sigmoid", ["cls"], ["cls.p"])
    g.node("Sigmoid", ["quality"], ["quality.p"])
    g.node("Mul", ["cls.p", "quality.p"], ["scores"])
    g.node("Concat", ["cxcy", "wh", "scores"], ["output0"], axis=1)
    return g.finish(
        NAME,
        [("images", ["batch", 3, INPUT, INPUT])],
        [("output0", ["batch", 4 + len(LABELS), GRID * GRID])],
        opset=OPSET,
        producer="sluicegate models/build_detector.py",
        version=VERSION,
        doc=f"Synthetic surface defect detector {NAME} (YOLOv8 output layout), seed {seed}.",
    )


def verify_against_torch(net: Net, onnx_bytes: bytes, x: F32) -> tuple[float, float]:
    """Max |ONNX Runtime - PyTorch| over the boxes (pixels) and over the scores."""
    import onnxruntime as ort

    session = ort.InferenceSession(onnx_bytes, providers=["CPUExecutionProvider"])
    got = session.run(["output0"], {"images": x})[0]
    with torch.no_grad():
        want = net(torch.from_numpy(x)).numpy()
    boxes = float(np.abs(got[:, :4] - want[:, :4]).max())
    scores = float(np.abs(got[:, 4:] - want[:, 4:]).max())
    if boxes > 1e-2 or scores > 1e-4:
        raise SystemExit(
            f"ONNX Runtime and PyTorch disagree: max |difference| {boxes:.2e} px in the "
            f"boxes, {scores:.2e} in the scores"
        )
    return boxes, scores


# --- main ---------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=20240611, help="everything derives from it")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--train", type=int, default=8000, help="training images")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--heldout", type=int, default=1000, help="fresh images to score")
    parser.add_argument("--jobs", type=int, default=2, help="processes generating images")
    parser.add_argument(
        "--threads", type=int, default=2, help="torch threads; part of the reproducibility key"
    )
    parser.add_argument("--min-map", type=float, default=0.9, help="exit 1 below this mAP@0.5")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    start = time.perf_counter()

    print(f"generating {args.train} training images (seed {args.seed})...", flush=True)
    x, boxes, labels = dataset(args.seed, TRAIN_STREAM, args.train, args.jobs)
    took = time.perf_counter() - start
    print(f"  {sum(map(len, labels))} defects, in {took:.0f} s; training...", flush=True)
    net = train(x, boxes, labels, args.seed, args.epochs)
    del x

    onnx_bytes = export(net, args.seed)
    check_x, _, _ = dataset(args.seed, VERIFY_STREAM, 16, 1)
    box_diff, score_diff = verify_against_torch(net, onnx_bytes, tensors(check_x).numpy())
    digest = hashlib.sha256(onnx_bytes).hexdigest()
    print(
        f"exported {len(onnx_bytes) / 1024:.0f} KB, opset {OPSET}; ONNX Runtime matches PyTorch "
        f"on 16 images (max |diff| {box_diff:.1e} px in boxes, {score_diff:.1e} in scores); "
        f"sha256 {digest}"
    )

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{NAME}.onnx").write_bytes(onnx_bytes)
    text = json.dumps(manifest(digest).model_dump(mode="json"), indent=2) + "\n"
    (args.out / f"{NAME}.json").write_text(text, encoding="utf-8")
    print(f"wrote {args.out / f'{NAME}.onnx'} and {NAME}.json")

    # Scored from a folder of just these two files, loaded as every node loads its models
    # (sha256 included), so other models in --out cannot get in the way.
    with tempfile.TemporaryDirectory() as tmp:
        for suffix in (".onnx", ".json"):
            shutil.copy(args.out / f"{NAME}{suffix}", Path(tmp) / f"{NAME}{suffix}")
        mean_ap = evaluate(Path(tmp), args.seed, args.heldout)
    print(f"build took {time.perf_counter() - start:.0f} s")
    if mean_ap < args.min_map:
        print(f"mAP@0.5 {mean_ap:.4f} is below {args.min_map}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
