"""A node's usage ledger: every record it writes, signed by its own key, numbered and
chained, on disk before the result it meters leaves the node, until a broker replica has
acknowledged it (and for ``retention_s`` after).

One SQLite file (WAL, exclusive lock: a second process on it fails to start) in the
node's state folder; ``sluicegate.metering.ledger_file`` holds its schema and operations.
The loop never touches the file: a writer thread of this module's owns the connection and
commits whatever the loop handed it meanwhile in one transaction (group commit), so a batch
of records costs one commit. The chain's head (last seq, last digest) is the thread's:
:meth:`Ledger.append` assigns seq and prev and signs on the thread, inside the
transaction, so a commit that fails leaves the head where the file has it and no seq is
ever skipped or used twice. An append's future resolves only after its commit: with
``synchronous = "FULL"`` (the default) that survives power loss, with ``"NORMAL"`` a killed
process, and a second thread then syncs the log to the disk, grouped, after which
:meth:`Ledger.durable` says the records survive power loss too. A node ships a record only
once it is durable that way, so a power loss can take records no broker has seen, never
one it holds (their seqs, written again, are no conflict).
A failure is a :class:`~sluicegate.errors.LedgerError` naming the file; nothing
here pretends a record is written when it is not. The edge agent uses the same ledger for
its own records (``kind = "edge"``).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future as ThreadFuture
from functools import partial
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

from policies.keys import SigningKey
from sluicegate.errors import LedgerError
from sluicegate.metering import ledger_file
from sluicegate.metering.ledger_file import Head
from sluicegate.metering.record import GENESIS, NodeKind, SignedUsage, Usage

log = logging.getLogger(__name__)
T = TypeVar("T")
Synchronous = Literal["FULL", "NORMAL"]
FILE_NAME = "usage.sqlite"
SYNC_EVERY_S = 0.005  # at most one sync of the log this often: commits in between share it
_Op = Callable[[sqlite3.Connection], Any]


class Ledger:
    """The usage records of node ``node``, on disk. ``await open()``, then submit from the
    loop; ``await close()`` commits what was submitted."""

    def __init__(
        self,
        path: Path | str,
        key: SigningKey,
        *,
        node: str,
        kind: NodeKind,
        retention_s: float = 7 * 86_400.0,
        synchronous: Synchronous = "FULL",
        clock: Callable[[], float] = time.time,
    ) -> None:
        if synchronous not in ("FULL", "NORMAL"):
            raise ValueError(f"synchronous must be 'FULL' or 'NORMAL', got {synchronous!r}")
        self.path = Path(path)
        self.node = node
        self.kind: NodeKind = kind
        self.retention_s = retention_s
        self._key = key
        self._synchronous = synchronous
        self._clock = clock
        self._where = f"usage ledger {self.path}"
        self._queue: queue.SimpleQueue[tuple[_Op, asyncio.Future[Any]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._head = Head(0, GENESIS)  # the writer thread's
        self._closed = False
        self.commits = 0
        # Durable (synced) up to which seq: the sync thread's figure, and the loop's with
        # the futures waiting on it.
        self._committed = 0  # (writer thread) the head once committed
        self._synced = 0  # (sync thread)
        self._sync_wanted = threading.Condition()
        self._sync_stop = False
        self._durable_seq = 0  # (loop)
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self.syncs = 0

    # -- lifecycle ------------------------------------------------------------------------------

    async def open(self) -> Head:
        """Open (or create) the file; the chain's head as the file has it."""
        self._loop = asyncio.get_running_loop()
        opened: ThreadFuture[Head] = ThreadFuture()
        self._thread = threading.Thread(
            target=self._serve, args=(opened,), name="sg-usage-ledger", daemon=True
        )
        self._thread.start()
        return await asyncio.wrap_future(opened)

    async def close(self) -> None:
        """Commit what was submitted, then close the file."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    # -- operations (loop thread) -----------------------------------------------------------------

    def draft(self, **fields: Any) -> Usage:
        """A record of this node to append (``at_ms`` now unless given); seq and prev are
        placeholders that :meth:`append` replaces. Raises pydantic's ``ValidationError``,
        naming the field, for a value a record cannot hold."""
        fields.setdefault("at_ms", int(self._clock() * 1000))
        return Usage(node=self.node, kind=self.kind, seq=1, prev=GENESIS.hex(), **fields)

    def append(self, drafts: Sequence[Usage]) -> asyncio.Future[list[SignedUsage]]:
        """Sign ``drafts`` with the node's key, each the next seq chained to the one before,
        and commit them in one transaction; the future holds the signed records once they
        are durable (or a ``LedgerError``). A draft of another node is a ``ValueError``,
        raised here before anything is written."""
        for d in drafts:
            if (d.node, d.kind) != (self.node, self.kind):
                raise ValueError(
                    f"a record of {d.kind} {d.node!r} handed to the ledger of {self.kind} "
                    f"{self.node!r}; build records with Ledger.draft"
                )
        drafts = list(drafts)

        def op(db: sqlite3.Connection) -> list[SignedUsage]:
            self._head, signed = ledger_file.append(db, self._head, drafts, self._key)
            return signed

        return self._submit(op)

    def acknowledge(self, seqs: Iterable[int]) -> asyncio.Future[int]:
        """A broker replica holds these records; how many were not acknowledged before."""
        wanted, now_ms = list(seqs), int(self._clock() * 1000)
        return self._submit(lambda db: ledger_file.acknowledge(db, wanted, now_ms))

    def unacked(self, *, after: int = 0, limit: int = 500) -> asyncio.Future[list[SignedUsage]]:
        """Records no replica has acknowledged, from seq ``after + 1``, in order."""
        return self._submit(lambda db: ledger_file.unacked(db, after, limit))

    def prune(self) -> asyncio.Future[int]:
        """Forget records acknowledged more than ``retention_s`` ago; how many."""
        before = int((self._clock() - self.retention_s) * 1000)
        return self._submit(lambda db: ledger_file.prune(db, before))

    def count_unacked(self) -> asyncio.Future[int]:
        return self._submit(ledger_file.count_unacked)

    @property
    def durable_seq(self) -> int:
        """Records up to this seq would survive power loss (loop side)."""
        return self._durable_seq

    def durable(self, seq: int) -> asyncio.Future[None]:
        """Resolves once the records up to ``seq`` (committed) would survive power loss."""
        loop = self._loop
        if loop is None:
            raise LedgerError(f"{self._where} is not open")
        fut: asyncio.Future[None] = loop.create_future()
        if seq <= self._durable_seq:
            fut.set_result(None)
        else:
            heapq.heappush(self._waiting, (seq, next(self._order), fut))
        return fut

    def _durable_to(self, seq: int) -> None:
        self._durable_seq = max(self._durable_seq, seq)
        while self._waiting and self._waiting[0][0] <= self._durable_seq:
            fut = heapq.heappop(self._waiting)[2]
            if not fut.done():
                fut.set_result(None)

    def _submit(self, op: Callable[[sqlite3.Connection], T]) -> asyncio.Future[T]:
        loop = self._loop
        if loop is None:
            raise LedgerError(f"{self._where} is not open")
        fut: asyncio.Future[T] = loop.create_future()
        if self._closed:
            fut.set_exception(LedgerError(f"{self._where} is closed"))
            return fut
        self._queue.put((op, cast("asyncio.Future[Any]", fut)))
        return fut

    # -- the writer thread ----------------------------------------------------------------------

    def _serve(self, opened: ThreadFuture[Head]) -> None:
        try:
            db, head = ledger_file.connect(self.path, self._synchronous, self.node, self.kind)
        except LedgerError as exc:
            opened.set_exception(exc)
            return
        self._head = head
        syncs = self._synchronous == "NORMAL" and str(self.path) != ":memory:"
        if str(self.path) != ":memory:":
            # What a killed process committed may still sit in the page cache only.
            for name in (str(self.path), f"{self.path}-wal"):
                _fsync(Path(name), self._where)
        self._committed = self._synced = head.seq
        self._report_durable(head.seq)
        syncer = None
        if syncs:
            syncer = threading.Thread(target=self._sync, name="sg-usage-sync", daemon=True)
            syncer.start()
        opened.set_result(head)
        try:
            stop = False
            while not stop:
                first = self._queue.get()
                if first is None:
                    break
                batch = [first]
                while True:  # group commit: whatever else queued meanwhile
                    try:
                        more = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        stop = True
                        break
                    batch.append(more)
                self._report(batch, self._commit(db, batch))
                if syncs:
                    with self._sync_wanted:
                        self._committed = self._head.seq
                        self._sync_wanted.notify()
                else:  # every commit synced already (FULL), or nothing to sync (memory)
                    self._report_durable(self._head.seq)
        finally:
            if syncer is not None:
                with self._sync_wanted:
                    self._sync_stop = True
                    self._sync_wanted.notify()
                syncer.join()
            db.close()

    def _sync(self) -> None:
        """The sync thread: the log file to the disk, as often as commits come, grouped."""
        wal = Path(f"{self.path}-wal")
        fd: int | None = None
        try:
            while True:
                with self._sync_wanted:
                    self._sync_wanted.wait_for(
                        lambda: self._committed > self._synced or self._sync_stop
                    )
                    if self._committed <= self._synced:
                        return
                    target = self._committed  # everything up to it was written before now
                try:
                    if fd is None:
                        fd = os.open(wal, os.O_RDONLY)
                    os.fsync(fd)
                except OSError as exc:
                    log.error("%s: the log could not be synced (%s); retrying", self._where, exc)
                    with self._sync_wanted:
                        self._sync_wanted.wait(1.0)
                    continue
                self._synced = target
                self.syncs += 1
                self._report_durable(target)
                with self._sync_wanted:  # let the next commits gather (and run undisturbed)
                    self._sync_wanted.wait_for(lambda: self._sync_stop, SYNC_EVERY_S)
        finally:
            if fd is not None:
                os.close(fd)

    def _report_durable(self, seq: int) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._durable_to, seq)

    def _commit(
        self, db: sqlite3.Connection, batch: list[tuple[_Op, asyncio.Future[Any]]]
    ) -> list[Any]:
        before = self._head
        results: list[Any] = []
        try:
            db.execute("BEGIN IMMEDIATE")
            for op, _fut in batch:
                mark = self._head
                db.execute("SAVEPOINT op")
                try:
                    results.append(op(db))
                except Exception as exc:  # sqlite3's or the operation's own: it fails alone
                    db.execute("ROLLBACK TO op")
                    self._head = mark
                    results.append(LedgerError(ledger_file.explain(self._where, exc)))
                db.execute("RELEASE op")
            db.execute("COMMIT")
        except sqlite3.Error as exc:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            self._head = before
            return [LedgerError(ledger_file.explain(self._where, exc))] * len(batch)
        self.commits += 1
        return results

    def _report(self, batch: list[tuple[_Op, asyncio.Future[Any]]], results: list[Any]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed under us
            loop.call_soon_threadsafe(partial(_resolve, batch, results))


def _fsync(path: Path, where: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    except OSError as exc:
        log.error("%s: %s could not be opened to sync it: %s", where, path.name, exc)
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        log.error("%s: %s could not be synced: %s", where, path.name, exc)
    finally:
        os.close(fd)


def _resolve(batch: list[tuple[_Op, asyncio.Future[Any]]], results: list[Any]) -> None:
    for (_op, fut), result in zip(batch, results, strict=True):
        if fut.done():
            continue
        if isinstance(result, LedgerError):
            fut.set_exception(result)
        else:
            fut.set_result(result)


def ledger_path(state_dir: Path | None) -> Path:
    """Where a node keeps its ledger: ``<state_dir>/usage.sqlite``, or ``:memory:`` (kept
    by nothing: for tests and nodes without a state folder)."""
    return state_dir / FILE_NAME if state_dir is not None else Path(":memory:")
