"""A picture of use over time: device-seconds per minute, stacked by the report's key.

Use is every attempt that ran in the period (billed, waste and unsettled alike: what the
devices did), placed in the minute its record was written. :func:`use_series` is pure;
:func:`write_plot` imports matplotlib (the ``twin`` and ``dev`` extras) only when a plot is
asked for and draws with the Agg backend, no display needed, no timestamp in the file.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from pathlib import Path

from sluicegate.errors import SluicegateError
from sluicegate.metering.report import Attempt, By, Settlement

MINUTE_MS = 60_000
MAX_SERIES = 12  # keys drawn on their own; the rest are summed as "other"


def attempts_of(settlement: Settlement) -> list[Attempt]:
    """Every attempt of the period that ran."""
    return [
        *(b.attempt for b in settlement.billed),
        *(w.attempt for w in settlement.waste),
        *(a for u in settlement.unsettled for a in u.attempts),
    ]


def use_series(
    attempts: Iterable[Attempt], by: By, bin_ms: int = MINUTE_MS
) -> tuple[list[int], dict[str, list[float]]]:
    """The start (ms) of every bin from the first to the last, and for each key its
    device-seconds in each bin (the biggest keys first; past :data:`MAX_SERIES`, "other")."""
    cells: dict[str, dict[int, float]] = {}
    for a in attempts:
        b = a.at_ms // bin_ms
        row = cells.setdefault(a.key(by), {})
        row[b] = row.get(b, 0.0) + a.device_us / 1e6
    if not cells:
        return [], {}
    low = min(min(row) for row in cells.values())
    high = max(max(row) for row in cells.values())
    bins = list(range(low, high + 1))
    ranked = sorted(cells, key=lambda k: (-sum(cells[k].values()), k))
    series: dict[str, list[float]] = {}
    for i, key in enumerate(ranked):
        name = key if i < MAX_SERIES else "other"
        values = series.setdefault(name, [0.0] * len(bins))
        for j, b in enumerate(bins):
            values[j] += cells[key].get(b, 0.0)
    return [b * bin_ms for b in bins], series


def write_plot(settlement: Settlement, by: By, path: Path) -> None:
    """Draw the period's use to ``path`` (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.dates import DateFormatter
    except ImportError as exc:
        raise SluicegateError(
            "the plot needs matplotlib: pip install 'sluicegate[twin]' (or leave out --plot)"
        ) from exc
    starts, series = use_series(attempts_of(settlement), by)
    if not starts:
        raise SluicegateError(f"nothing ran in the period: no plot written to {path}")
    # matplotlib's dates are days since its epoch: the Unix epoch (its default since 3.3).
    times = [ms / 86_400_000 for ms in starts]
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=100)
    bottom = [0.0] * len(times)
    width = 1 / 1440 * 0.9  # a minute, in days, with a gap
    for name, values in series.items():
        ax.bar(times, values, width=width, bottom=bottom, label=name, align="edge")
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.xaxis_date(tz=dt.UTC)
    ax.xaxis.set_major_formatter(DateFormatter("%Y-%m-%d %H:%M", tz=dt.UTC))  # type: ignore[no-untyped-call]
    ax.set_ylabel("device-seconds per minute")
    ax.set_xlabel("UTC")
    ax.set_title(f"device time by {by}: every attempt that ran, billed or not")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(loc="upper left", fontsize=8, ncols=2)
    fig.autofmt_xdate()
    fig.tight_layout()
    try:
        fig.savefig(path, format="png", metadata={"Software": None})
    except OSError as exc:
        raise SluicegateError(f"cannot write the plot {path}: {exc.strerror}") from exc
    finally:
        plt.close(fig)
