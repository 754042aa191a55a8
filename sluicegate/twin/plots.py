"""The twin's two pictures, baseline against candidate: deadline attainment over time (per
second of arrivals) and the jobs each node held at every telemetry interval.

matplotlib (the ``twin`` extra) is imported here only, when a plot is asked for; the Agg
backend writes PNG without a display. Fixed sizes, fonts and no timestamps in the files'
metadata, so the same results give the same images.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from sluicegate.errors import SluicegateError
from sluicegate.twin.nodes import Result


def attainment_series(result: Result, bin_s: float = 1.0) -> tuple[list[float], list[float]]:
    """(second, share of that second's arrivals answered in time)."""
    total: Counter[int] = Counter()
    hits: Counter[int] = Counter()
    for o in result.outcomes:
        b = int(o.at // bin_s)
        total[b] += 1
        hits[b] += o.in_time
    keys = sorted(total)
    return [k * bin_s for k in keys], [hits[k] / total[k] for k in keys]


def write_plots(baseline: Result, candidate: Result, folder: Path) -> list[Path]:
    """``attainment.png`` and ``queue-depth.png`` in ``folder``; returns their paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SluicegateError(
            "plots need matplotlib: pip install 'sluicegate[twin]' (or leave out --out)"
        ) from exc
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"Software": None}
    out = []
    fig, ax = plt.subplots(figsize=(9, 4), dpi=100)
    for name, result, style in (("baseline", baseline, "-"), ("candidate", candidate, "--")):
        xs, ys = attainment_series(result)
        ax.plot(xs, ys, style, label=name, linewidth=1.5)
    ax.set_xlabel("seconds into the trace")
    ax.set_ylabel("deadline attainment")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left")
    fig.tight_layout()
    path = folder / "attainment.png"
    fig.savefig(path, metadata=meta)
    plt.close(fig)
    out.append(path)

    nodes = sorted(set(baseline.depth) | set(candidate.depth))
    fig, axes = plt.subplots(len(nodes), 1, figsize=(9, 1.6 * len(nodes) + 0.6), dpi=100)
    axes_list = list(axes) if len(nodes) > 1 else [axes]
    for ax, node in zip(axes_list, nodes, strict=True):
        for name, result, style in (("baseline", baseline, "-"), ("candidate", candidate, "--")):
            series = result.depth.get(node, ())
            ax.plot([t for t, _ in series], [d for _, d in series], style, label=name)
        ax.set_ylabel(node, rotation=0, ha="right", fontsize=8)
        ax.grid(alpha=0.3)
    axes_list[0].set_title("jobs held (queued and running) per node")
    axes_list[0].legend(loc="upper right", fontsize=8)
    axes_list[-1].set_xlabel("seconds into the trace")
    fig.tight_layout()
    path = folder / "queue-depth.png"
    fig.savefig(path, metadata=meta)
    plt.close(fig)
    out.append(path)
    return out
