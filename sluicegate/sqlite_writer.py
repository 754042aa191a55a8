"""A node's one durable log: one SQLite connection, used on the event loop, committing in
one transaction the operations submitted during one loop tick (group commit).

Operations submitted during a tick travel as one :class:`Batch`, committed at the tick's
end, each in a savepoint of its own, so one failing operation fails alone. Several owners
may share one writer: on an edge the outbox's jobs and the usage ledger's records ride the
same commits (a job's result and its usage record are made durable by one fsync). An owner
that keeps state mirroring the file (the ledger's chain head) learns of each transaction's
end, committed or rolled back, through :meth:`Writer.after_commit`.

The commit runs on the loop itself: a thread running the SQL cost the edge two thread
hand-offs per commit and its GIL contention with the loop, more than the SQL itself
(``docs/performance.md``, the edge path). The disk's sync need not: for a file (``start``'s
``wal``) the connection commits with ``synchronous = NORMAL`` and a
:class:`~sluicegate.wal_sync.WalSync` syncs the log after each commit, at once on the loop
where the disk is fast, else on a thread of its own, grouped, while the loop reads, decides
and commits the next batches. Each operation's future resolves once a sync covers its
commit (``synchronous = FULL``'s durability), in commit order. An
owner whose state follows durability (the ledger's records it may ship) learns of each
sync through :meth:`Writer.after_sync`. An operation submitted ``written`` resolves at its
commit instead, before the sync: what it wrote then survives a killed process (the OS has
it), not yet a power loss, and :meth:`Writer.durable` says when its batch is on the disk.
The edge starts a job's run once its run count is written, and acks the request only once
its acceptance is durable (``docs/performance.md``, the edge path).

An operation whose durability nobody waits for (a mark that a result was delivered, that
a broker holds a usage record: lost in a crash, it only makes the agent send again what is
then recognised) may be submitted ``lazy``: it opens no commit of its own, and rides the
next one an eager operation opens, or the one that :data:`LAZY_S` later commits what is
left. It cuts the commits a local job costs an edge by a quarter
(``docs/performance.md``, the edge path).

Between the loop and the commit sits a :class:`Gate`: by default it passes every batch on at
once; a test's gate may hold batches (a slow disk), drop them (a crash before their commit)
or fail them (a broken disk). It never reports a result for a batch it did not commit. A
failure is the error type the operation was submitted with (``OutboxError``,
``LedgerError``), its text from the writer's ``explain``.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import sqlite3
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from sluicegate.wal_sync import WalSync

log = logging.getLogger(__name__)

T = TypeVar("T")
Op = Callable[[sqlite3.Connection], Any]
Explain = Callable[[str, BaseException], str]
Hook = Callable[[sqlite3.Connection, bool], None]

# How long a lazy operation waits for an eager one to ride with, at most.
LAZY_S = 0.1
MAX_FAILED_BATCHES = 4096  # batches whose sync failed, remembered for Writer.durable


@dataclass(eq=False)
class Batch:
    """Operations submitted in one loop tick, each with the future of its result and the
    error type its failure is reported as."""

    ops: list[tuple[Op, asyncio.Future[Any], type[Exception]]] = field(default_factory=list)
    written: list[int] = field(default_factory=list)  # ops resolved at the commit, unsynced

    def __len__(self) -> int:
        return len(self.ops)

    def fail(self, error: Exception) -> None:
        """Report ``error`` for every operation (loop thread), as a failed commit would."""
        for _op, fut, _kind in self.ops:
            if not fut.done():
                fut.set_exception(error)


class Gate(Protocol):
    """What stands between the loop and the writer: ``pass_on(batch)`` to commit it."""

    def admit(self, batch: Batch, pass_on: Callable[[Batch], None]) -> None: ...


class OpenGate:
    """Every batch to the writer at once."""

    def admit(self, batch: Batch, pass_on: Callable[[Batch], None]) -> None:
        pass_on(batch)


def log_of(path: Path, synchronous: str) -> Path | None:
    """The write-ahead log a writer syncs behind its commits (:meth:`Writer.start`'s
    ``wal``): a file's, where its owner wants each commit durable (``FULL``)."""
    if synchronous != "FULL" or str(path) == ":memory:":
        return None
    return Path(f"{path}-wal")


@dataclass(frozen=True, slots=True)
class CommitStats:
    commits: int
    operations: int
    p50_ms: float  # the transaction, without the sync behind it
    p99_ms: float
    sync_ms: float = 0.0  # a sync behind the commits, smoothed (0: SQLite syncs, or none)
    sync_on_thread: bool = False  # the disk is slow enough for the sync thread


class Writer:
    """The connection and the batch of this tick; ``start`` opens the file with the owner's
    ``connect`` and returns what opening read. ``where`` names the file in errors."""

    def __init__(self, where: str, explain: Explain, gate: Gate | None = None) -> None:
        self.where = where
        self._explain = explain
        self.gate: Gate = gate or OpenGate()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conn: sqlite3.Connection | None = None
        self._batch = Batch()
        self._flush_soon = False  # a flush of this tick's batch is scheduled
        self._flush_later: asyncio.TimerHandle | None = None  # lazy operations' flush
        self._hooks: list[Hook] = []
        self._killed = False  # stopped as a killed process would be: nothing reports back
        self._closed = False
        self._commit_s: deque[float] = deque(maxlen=4096)
        self._sync: WalSync | None = None
        self._unsynced: deque[tuple[int, Batch, list[Any]]] = deque()  # committed, not synced
        self._sync_hooks: list[Callable[[int], None]] = []
        self.batch_no = 0  # the number of the batch being (or last) committed
        self.durable_through = 0  # the batches numbered up to this are on the disk ...
        self._unsynced_for_good: dict[int, str] = {}  # ... but these, whose sync failed: why
        # Waiters for a batch to be on the disk, lowest batch first: (number, the order they
        # asked in, future, error type).
        self._durable_waiters: list[tuple[int, int, asyncio.Future[None], type[Exception]]] = []
        self._asked = itertools.count()
        self.commits = 0
        self.operations = 0

    async def start(
        self, connect: Callable[[], tuple[sqlite3.Connection, T]], *, wal: Path | None = None
    ) -> T:
        """Open the file with the owner's ``connect``; ``wal``: the file's write-ahead log,
        which the writer then syncs after each commit (:class:`~sluicegate.wal_sync.WalSync`:
        on the loop, or on its thread for a slow disk; the connection commits with
        ``synchronous = NORMAL``), else each commit is as durable as the owner's connection
        makes it."""
        self._loop = asyncio.get_running_loop()
        self._conn, read = connect()
        # Each operation runs in a savepoint, which journals the old content of every page
        # it changes (an image's pages reused from the freelist: ~50 a job) to a temporary
        # file, two writes a page; in memory, they cost a copy.
        self._conn.execute("PRAGMA temp_store = MEMORY")
        if wal is not None:
            self._conn.execute("PRAGMA synchronous = NORMAL")
            self._sync = WalSync(wal, self._report_sync)
        return read

    @property
    def pending(self) -> int:
        """Operations submitted and not yet passed to the gate (lazy ones wait here)."""
        return len(self._batch)

    @property
    def started(self) -> bool:
        return self._loop is not None

    def after_commit(self, hook: Hook) -> None:
        """Call ``hook(db, committed)`` after each transaction ends."""
        self._hooks.append(hook)

    def after_sync(self, hook: Callable[[int], None]) -> None:
        """Call ``hook(through)`` once the batches numbered up to ``through``
        (:attr:`batch_no`) are on the disk: after a sync, or after the commit itself when
        the connection syncs as it commits."""
        self._sync_hooks.append(hook)

    def submit(
        self,
        op: Callable[[sqlite3.Connection], T],
        error: type[Exception],
        *,
        lazy: bool = False,
        written: bool = False,
    ) -> asyncio.Future[T]:
        """Run ``op`` in this tick's transaction (``lazy``: in the next transaction, within
        :data:`LAZY_S`); its future resolves once a sync covers the commit (``written``: as
        soon as the transaction commits, before the sync: what it wrote survives a killed
        process, not yet a power loss; :meth:`durable` says when it does), or fails with
        ``error``. Once killed, it never resolves."""
        loop = self._loop
        if loop is None:
            raise error(f"{self.where} is not open")
        fut: asyncio.Future[T] = loop.create_future()
        if self._closed:
            if not self._killed:
                fut.set_exception(error(f"{self.where} is closed"))
            return fut
        if not lazy and not self._flush_soon:
            self._flush_soon = True
            loop.call_soon(self.flush)
        elif lazy and not self._flush_soon and self._flush_later is None:
            self._flush_later = loop.call_later(LAZY_S, self.flush)
        if written:
            self._batch.written.append(len(self._batch.ops))
        self._batch.ops.append((op, fut, error))
        return fut

    def durable(self, batch_no: int, error: type[Exception]) -> asyncio.Future[None]:
        """Resolves once the batch numbered ``batch_no`` (:attr:`batch_no` while it commits)
        is on the disk; fails with ``error`` if the sync that was to cover it failed."""
        assert self._loop is not None
        fut: asyncio.Future[None] = self._loop.create_future()
        failed = self._unsynced_for_good.get(batch_no)
        if failed is not None:
            fut.set_exception(error(failed))
        elif batch_no <= self.durable_through:
            fut.set_result(None)
        elif not self._killed:  # once killed, it never resolves
            heapq.heappush(self._durable_waiters, (batch_no, next(self._asked), fut, error))
        return fut

    def flush(self) -> None:
        """Commit what was submitted now (through the gate)."""
        self._flush_soon = False
        if self._flush_later is not None:
            self._flush_later.cancel()
            self._flush_later = None
        batch, self._batch = self._batch, Batch()
        if not self._killed and batch.ops:
            self.gate.admit(batch, self._pass_on)

    def _pass_on(self, batch: Batch) -> None:
        if self._killed or self._conn is None:
            return
        self.batch_no += 1
        results = self._commit(batch)
        for i in batch.written:  # these need not wait for the sync
            _resolve_one(batch.ops[i][1], results[i])
        if self._sync is None:
            _resolve(batch, results)
            self._durable(self.batch_no)
            return
        self._unsynced.append((self.batch_no, batch, results))
        if self._sync.slow:
            self._sync.want(self.batch_no)
        else:  # a fast disk: a sync now costs the loop less than a thread's round trip
            self._synced(self.batch_no, self._sync.now())

    def _report_sync(self, through: int, error: OSError | None) -> None:
        """The sync thread's word (its thread): the loop resolves what it covered."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed under us
                loop.call_soon_threadsafe(self._synced, through, error)

    def _synced(self, through: int, error: OSError | None) -> None:
        if self._killed:
            return
        unsynced = self._unsynced
        while unsynced and unsynced[0][0] <= through:
            no, batch, results = unsynced.popleft()
            if error is not None:
                text = f"{self._explain(self.where, error)} (not synced)"
                results = [_Failed(kind(text)) for _op, _fut, kind in batch.ops]
                self._unsynced_for_good[no] = text
                if len(self._unsynced_for_good) > MAX_FAILED_BATCHES:  # the oldest go
                    del self._unsynced_for_good[next(iter(self._unsynced_for_good))]
            _resolve(batch, results)
        if error is None:
            self._durable(through)
            return
        log.error("%s could not be synced to the disk: %s", self.where, error)
        self._answer_waiters(through)

    def _durable(self, through: int) -> None:
        self.durable_through = max(self.durable_through, through)
        self._answer_waiters(through)
        for hook in self._sync_hooks:
            hook(through)

    def _answer_waiters(self, through: int) -> None:
        """Tell those waiting for batches up to ``through`` whether each is on the disk."""
        waiters = self._durable_waiters
        while waiters and waiters[0][0] <= through:
            no, _asked, fut, kind = heapq.heappop(waiters)
            if fut.done():
                continue
            failed = self._unsynced_for_good.get(no)
            if failed is not None:
                fut.set_exception(kind(failed))
            else:
                fut.set_result(None)

    async def stop(self) -> None:
        """Commit what was submitted, sync it, then close the file."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        if self._sync is not None:
            await asyncio.to_thread(self._sync.stop)
            await asyncio.sleep(0)  # its last reports, queued before, run first
        self._close()

    def kill(self) -> None:
        """Nothing submitted is written any more, and no operation reports back."""
        self._killed = self._closed = True
        self._batch = Batch()
        self._durable_waiters.clear()
        if self._sync is not None:
            self._sync.stop(wait=False)
        self._close()

    def _close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            self._conn = None

    @property
    def syncer(self) -> WalSync | None:
        """What syncs the log behind the commits, if the writer does."""
        return self._sync

    def stats(self) -> CommitStats:
        times = sorted(self._commit_s)
        sync = self._sync
        syncing = (sync.sync_s * 1000.0, sync.slow) if sync is not None else (0.0, False)
        if not times:
            return CommitStats(self.commits, self.operations, 0.0, 0.0, *syncing)
        p50 = times[len(times) // 2] * 1000.0
        p99 = times[min(len(times) - 1, int(len(times) * 0.99))] * 1000.0
        return CommitStats(self.commits, self.operations, p50, p99, *syncing)

    def _commit(self, batch: Batch) -> list[Any]:
        db = self._conn
        assert db is not None
        started = time.perf_counter()
        results: list[Any] = []
        try:
            db.execute("BEGIN IMMEDIATE")
            for op, _fut, kind in batch.ops:
                db.execute("SAVEPOINT op")
                try:
                    results.append(op(db))
                except Exception as exc:  # sqlite3's or the operation's own: it fails alone
                    db.execute("ROLLBACK TO op")
                    results.append(_Failed(kind(self._explain(self.where, exc))))
                db.execute("RELEASE op")
            db.execute("COMMIT")
        except sqlite3.Error as exc:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            self._ended(db, committed=False)
            text = self._explain(self.where, exc)
            return [_Failed(kind(text)) for _op, _fut, kind in batch.ops]
        self._commit_s.append(time.perf_counter() - started)
        self.commits += 1
        self.operations += len(batch)
        self._ended(db, committed=True)
        return results

    def _ended(self, db: sqlite3.Connection, *, committed: bool) -> None:
        for hook in self._hooks:
            hook(db, committed)


@dataclass(frozen=True, slots=True)
class _Failed:
    error: Exception


def _resolve(batch: Batch, results: list[Any]) -> None:
    for (_op, fut, _kind), result in zip(batch.ops, results, strict=True):
        _resolve_one(fut, result)


def _resolve_one(fut: asyncio.Future[Any], result: Any) -> None:
    if fut.done():
        return
    if isinstance(result, _Failed):
        fut.set_exception(result.error)
    else:
        fut.set_result(result)


def explain_sqlite(where: str, exc: BaseException, *, damaged: str, owner: str) -> str:
    """What a SQLite failure on ``where`` means to whoever reads it: ``damaged`` says what
    to do with a file that is not one, ``owner`` who else may hold it."""
    text = str(exc)
    if "not a database" in text or "malformed" in text:
        return f"{where} is not a usable SQLite file ({text}); {damaged}"
    if "locked" in text or "busy" in text:
        return f"{where} is in use by another process ({text}); is another {owner} running?"
    if "readonly" in text or "unable to open" in text or "disk I/O" in text:
        return f"{where} cannot be written ({text}); check permissions and free space"
    return f"{where}: {type(exc).__name__}: {text}"
