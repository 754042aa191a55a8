"""What every bench computes and prints the same way: percentiles (one definition), a
summary of a sample, a process's CPU from ``/proc``, the machine a run was made on, and the
``RESULT {json}`` last line (BENCHMARKS.md), which refuses to call a target met on figures
that were never measured.

Percentiles are nearest-rank: the p-th percentile of n sorted samples is the sample at rank
``ceil(p / 100 * n)`` (1-based), so it is always a latency that was observed, never an
interpolation between two. p99.9 is reported only from 10,000 samples up. Formatting and
arithmetic only: nothing here starts a process or reads a socket.
"""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Iterable, Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import psutil

P999_FROM = 10_000  # samples needed before a p99.9 is printed


class NothingMeasured(RuntimeError):
    """A bench finished without measuring something it claims to (no grants, nothing
    offloaded, a baseline that never ran): its figures mean nothing, so the run fails."""


def percentile(values: Iterable[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of ``values``; NaN when empty."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    if not 0.0 < q <= 100.0:
        raise ValueError(f"percentile q must be in (0, 100], got {q}")
    rank = math.ceil(q / 100.0 * len(ordered))
    return float(ordered[max(1, rank) - 1])


def summary(values: Sequence[float], *, unit: str = "ms") -> dict[str, float]:
    """n, p50, p90, p99 (and p99.9 from :data:`P999_FROM` samples), mean and max, keyed
    ``p50_<unit>`` and so on; the percentiles NaN when there are no samples."""
    out: dict[str, float] = {"n": float(len(values))}
    qs: list[tuple[str, float]] = [("p50", 50), ("p90", 90), ("p99", 99)]
    if len(values) >= P999_FROM:
        qs.append(("p99.9", 99.9))
    for name, q in qs:
        out[f"{name}_{unit}"] = percentile(values, q)
    out[f"mean_{unit}"] = sum(values) / len(values) if values else math.nan
    out[f"max_{unit}"] = max(values) if values else math.nan
    return out


def median(values: Iterable[float]) -> float:
    """The p50 by the same rule as every other percentile here."""
    return percentile(values, 50)


def ratio(a: float, b: float) -> float:
    """``a / b``, NaN when either is missing or ``b`` is zero (a ratio to nothing)."""
    if not (math.isfinite(a) and math.isfinite(b)) or b == 0:
        return math.nan
    return a / b


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used; 0 once it is gone."""
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return float(t.user + t.system)


def cpu_tree_s(pid: int) -> float:
    """CPU seconds of process ``pid`` and of its live descendants."""
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    return sum(cpu_s(p.pid) for p in procs)


def cpu_by_thread_s(pid: int) -> dict[str, float]:
    """CPU seconds process ``pid``'s live threads have used, summed by their OS name
    (``/proc/<pid>/task/*/comm``); its main thread is ``"main"``. Empty once it is gone."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = "main" if tid == str(pid) else f.read().strip()
        except OSError:  # the thread ended between the listing and the read
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def machine(*packages: str) -> dict[str, Any]:
    """The machine and the library versions a run was made with (BENCHMARKS.md item 4)."""
    names = ("paho-mqtt", "onnxruntime", "opencv-python-headless", *packages)
    return {
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        **{name: _version(name) for name in dict.fromkeys(names)},
    }


def require(claims: Mapping[str, float]) -> dict[str, float]:
    """Raise :class:`NothingMeasured` naming each claim whose count is zero or missing:
    ``require({"grants": n_granted, "baseline replies": n_floor})``. Returns the claims, for
    the RESULT line's ``measured`` (what the smoke tier checks a bench counted)."""
    missing = [name for name, count in claims.items() if not count or not math.isfinite(count)]
    if missing:
        raise NothingMeasured("measured nothing for: " + ", ".join(missing))
    return dict(claims)


def met(measured: Mapping[str, float], target: Mapping[str, float], *, most: Iterable[str]) -> bool:
    """Every target met by a measured (finite) figure: the names in ``most`` are ceilings,
    the rest floors. A figure that is missing or NaN never meets its target."""
    ceilings = set(most)
    for name, goal in target.items():
        value = measured.get(name, math.nan)
        if not math.isfinite(value):
            return False
        if (value > goal) if name in ceilings else (value < goal):
            return False
    return True


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def result_line(result: Mapping[str, Any]) -> str:
    """The ``RESULT {json}`` last line; NaN and infinity become null (valid JSON)."""
    return "RESULT " + json.dumps(_finite(dict(result)), default=str)
