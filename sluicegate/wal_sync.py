"""The fsync behind a node's commits: a SQLite file in WAL mode commits with ``synchronous =
NORMAL`` (its pages written to the log, not synced), and this syncs the log after each
commit, where it costs least. On a disk that syncs fast, at once on the loop (:meth:`now`):
a hand-off to a thread and back would cost more than the wait. On a slow one, on a thread
of its own (:meth:`want`), grouped, each sync covering every commit made before it began:
the loop goes on reading, deciding and committing the next batches meanwhile, so a slow
disk costs the jobs their wait for it and not the loop its turns. Which one is
:attr:`WalSync.slow`, from the syncs it has timed (``docs/performance.md``, the edge path).

SQLite keeps such a file safe from corruption on its own (in WAL mode with ``NORMAL`` it
syncs the log before each checkpoint and the database after it); what this adds is the
durability of each commit: a commit's operations are reported done only once a sync that
began after it has returned (``sluicegate.sqlite_writer``). The thread runs no Python
between its syncs but a wait and a callback; ``report(through, error)`` is called on it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from sluicegate.threads import SYNC, name_os_thread

Report = Callable[[int, OSError | None], None]

# A sync slower than this (smoothed) goes to the thread: a hand-off there and back costs
# the loop about as much CPU as a wait this long (A/B at 0.1-0.3 ms and 1 ms syncs).
SLOW_SYNC_S = 0.0005
_SMOOTHING = 0.2  # weight of the newest sync in the running figure


class WalSync:
    """Syncs ``wal`` after commits: :meth:`now` on the caller's thread, or :meth:`want` on
    its own."""

    def __init__(self, wal: Path, report: Report) -> None:
        self.wal = wal
        self._report = report
        self._fd: int | None = None
        self._opening = threading.Lock()  # the log is opened at the first sync, by either
        self._cond = threading.Condition()
        self._wanted = 0  # the last commit (by the writer's numbering) waiting for a sync
        self._done = 0  # synced through (the thread's)
        self._stop = False
        self.sync_s = 0.0  # smoothed time of a sync (from 0: the first ones on the loop)
        self.syncs = 0
        self.thread_syncs = 0  # of them, on the thread
        self._thread = threading.Thread(target=self._run, name=SYNC, daemon=True)
        self._thread.start()

    @property
    def slow(self) -> bool:
        """Whether a sync takes long enough to be worth the thread."""
        return self.sync_s > SLOW_SYNC_S

    def now(self) -> OSError | None:
        """Sync on the calling thread (the loop): everything committed so far."""
        return self._sync()

    def want(self, through: int) -> None:
        """Commits up to number ``through`` are written and wait for the thread's sync."""
        with self._cond:
            self._wanted = through
            self._cond.notify()

    def stop(self, *, wait: bool = True) -> None:
        """Sync what was asked for, then end (``wait``: until the thread has ended)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if wait:
            self._thread.join()

    def _sync(self) -> OSError | None:
        started = time.perf_counter()
        try:
            with self._opening:
                if self._fd is None:
                    self._fd = os.open(self.wal, os.O_RDONLY)
            os.fdatasync(self._fd)
        except OSError as exc:
            return exc
        self.sync_s += _SMOOTHING * (time.perf_counter() - started - self.sync_s)
        self.syncs += 1
        return None

    def _run(self) -> None:
        name_os_thread(SYNC)
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._wanted > self._done or self._stop)
                    if self._wanted <= self._done:
                        return
                    through = self._wanted  # every commit up to it was written before now
                error = self._sync()
                self.thread_syncs += 1
                self._done = through
                self._report(through, error)
        finally:  # stopped: the writer syncs no more
            with self._opening:
                if self._fd is not None:
                    os.close(self._fd)
                    self._fd = None
