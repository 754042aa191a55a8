"""Announced work: the book an edge keeps of the work its apps (or the plant's MES) said is
coming, the checks an announcement passes, and what it means for the pools.

A line's work is often known before it arrives: a shift change, a batch start, a recipe
that doubles the camera rate. An app announces it to its edge (``wire.Announcement`` on
``topics.edge_schedule``; the ACL lets only the apps of that edge write there); the edge
checks it (:func:`check`), keeps it in its :class:`Book` and reports the book whole, each
window with the images a second the edge can run of it itself, its slots shared among the
windows that overlap (:func:`local_rates`; ``wire.EdgeSchedule``). The
brokers read those reports as the leading part of their demand signal
(:func:`overflow_per_s`: what a window will send past its edge). Pure: the clock comes in as
``now``; the edge's and the broker's shells carry the messages.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from sluicegate.wire import Announced, Announcement

MAX_WINDOWS = 16  # announcements an edge keeps at once
MAX_AHEAD_S = 7 * 86_400.0  # how far ahead a window may start
MAX_LENGTH_S = 86_400.0  # how long a window may last


@dataclass(frozen=True, slots=True)
class Refused:
    """Why an announcement was not taken: a ``code`` to branch on, a ``reason`` to read."""

    code: str
    reason: str


def check(a: Announcement, now: float, models: Collection[str]) -> Refused | None:
    """None when ``a`` may be booked at ``now`` by an edge serving ``models``."""
    if a.withdraw:
        return None
    if a.ends_at <= a.starts_at:
        return Refused(
            "bad_window", f"ends_at {a.ends_at:.3f} is not after starts_at {a.starts_at:.3f}"
        )
    if a.ends_at <= now:
        return Refused("window_over", f"the window ended at {a.ends_at:.3f}, before now")
    if a.starts_at - now > MAX_AHEAD_S:
        return Refused(
            "too_far_ahead",
            f"starts {a.starts_at - now:.0f} s from now; at most {MAX_AHEAD_S:.0f} s ahead",
        )
    if a.ends_at - a.starts_at > MAX_LENGTH_S:
        return Refused(
            "too_long",
            f"lasts {a.ends_at - a.starts_at:.0f} s; a window lasts at most {MAX_LENGTH_S:.0f} s",
        )
    if a.model not in models:
        served = ", ".join(sorted(models)) or "none"
        return Refused(
            "unknown_model", f"this edge serves no model {a.model!r} (it serves {served})"
        )
    return None


class Book:
    """One edge's accepted announcements, by id."""

    def __init__(self) -> None:
        self._windows: dict[str, Announcement] = {}

    def take(self, a: Announcement, now: float, models: Collection[str]) -> Refused | None:
        """Book, replace or withdraw ``a``; None when done, else why not (nothing changed)."""
        self._prune(now)
        if a.withdraw:
            if self._windows.pop(a.announcement_id, None) is None:
                return Refused(
                    "unknown_announcement",
                    f"no announcement {a.announcement_id!r} is booked here to withdraw",
                )
            return None
        refused = check(a, now, models)
        if refused is not None:
            return refused
        if a.announcement_id not in self._windows and len(self._windows) >= MAX_WINDOWS:
            return Refused(
                "too_many",
                f"this edge keeps {MAX_WINDOWS} announcements at once; withdraw one first",
            )
        self._windows[a.announcement_id] = a
        return None

    def live(self, now: float) -> list[Announcement]:
        """The windows still ahead or under way at ``now``, earliest first."""
        self._prune(now)
        return sorted(self._windows.values(), key=lambda a: (a.starts_at, a.announcement_id))

    def _prune(self, now: float) -> None:
        for key in [k for k, a in self._windows.items() if a.ends_at <= now]:
            del self._windows[key]


def local_rates(windows: Sequence[Announcement], capacity: Callable[[str], float]) -> list[float]:
    """The images a second of each window its edge runs itself, given ``capacity``: the
    images a second of a model the edge runs when busy with it alone (0: not timed yet).
    Windows that overlap in time share the edge's slots: when the windows overlapping one
    ask for more than the slots hold (the sum of each one's rate over its model's capacity
    exceeds 1), each runs that share of its own rate, and the rest goes past the edge; when
    they fit, each is credited its model's whole capacity. An untimed model runs nothing
    here and is not counted against the others."""
    caps = [capacity(w.model) for w in windows]
    out = []
    for w, cap in zip(windows, caps, strict=True):
        if cap <= 0.0:
            out.append(0.0)
            continue
        load = sum(
            v.rate_per_s / c
            for v, c in zip(windows, caps, strict=True)
            if c > 0.0 and v.starts_at < w.ends_at and w.starts_at < v.ends_at
        )
        out.append(cap if load <= 1.0 else w.rate_per_s / load)
    return out


def overflow_per_s(windows: Iterable[Announced], now: float, lead_s: float) -> float:
    """The images a second an edge's windows will send past it (their rate beyond what the
    edge runs itself), counting each window under way at ``now`` or starting within
    ``lead_s``."""
    return sum(
        max(0.0, w.rate_per_s - w.local_per_s)
        for w in windows
        if w.starts_at - lead_s <= now < w.ends_at
    )
