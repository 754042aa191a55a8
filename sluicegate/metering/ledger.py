"""A node's usage ledger: every record it writes, signed by its own key, numbered and
chained, on disk before the result it meters leaves the node, until a broker replica has
acknowledged it (and for ``retention_s`` after).

Its tables (``sluicegate.metering.ledger_file`` holds the schema and operations) live in
a SQLite file (WAL, exclusive lock: a second process on it fails to start) whose
:class:`~sluicegate.sqlite_writer.Writer` commits what each loop tick submitted in one
transaction (group commit). A pool worker's ledger is a file of its own
with a writer of its own; an edge's shares its outbox's file and writer (``log``), so a
job's result and its usage record are made durable by the same commit. The chain's head
(last seq, last digest) is the writer's: :meth:`Ledger.append` assigns seq and prev and
signs inside the transaction, at the commit, and a transaction that rolls back
puts the head back where the file has it, so no seq is ever skipped or used twice.
An append's future resolves only after its commit: with
``synchronous = "FULL"`` (the default) that survives power loss, with ``"NORMAL"`` a
killed process, and a second thread then syncs the log to the disk, grouped, after which
:meth:`Ledger.durable` says the records survive power loss too. A node ships a record only
once it is durable that way, so a power loss can take records no broker has seen, never
one it holds (their seqs, written again, are no conflict).
A failure is a :class:`~sluicegate.errors.LedgerError` naming the file; nothing
here pretends a record is written when it is not. The edge agent uses the same ledger for
its own records (``kind = "edge"``); an edge that kept them in a file of their own
(``legacy``) has them moved into the shared file at its first start, unacked ones
included.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import os
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from policies.keys import SigningKey
from sluicegate.errors import LedgerError
from sluicegate.metering import ledger_file
from sluicegate.metering.ledger_file import Head
from sluicegate.metering.record import GENESIS, NodeKind, SignedUsage, Usage
from sluicegate.sqlite_writer import Writer, log_of

log = logging.getLogger(__name__)
T = TypeVar("T")
Synchronous = Literal["FULL", "NORMAL"]
FILE_NAME = "usage.sqlite"
SYNC_EVERY_S = 0.005  # at most one sync of the log this often: commits in between share it


class Ledger:
    """The usage records of node ``node``, on disk. ``await open()``, then submit from the
    loop; ``await close()`` commits what was submitted. With ``log`` (another owner's
    writer, already started) the records live in that writer's file, at ``path``."""

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
        log: Writer | None = None,
        legacy: Path | None = None,
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
        self._shared = log is not None
        self._legacy = legacy
        self._writer = log or Writer(self._where, ledger_file.explain)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._head = Head(0, GENESIS)  # moved inside the writer's transactions
        self._closed = False
        # Durable (synced) up to which seq: committed, the sync thread's, and the loop's with
        # the futures waiting on it.
        self._committed = 0
        self._synced = 0
        self._sync_wanted = threading.Condition()
        self._sync_stop = False
        self._syncer: threading.Thread | None = None
        self._durable_seq = 0  # (loop)
        self._unsynced: deque[tuple[int, int]] = deque()  # (writer's batch, seq) not synced
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self.syncs = 0

    # -- lifecycle ------------------------------------------------------------------------------

    async def open(self) -> Head:
        """Open (or create) the tables; the chain's head as the file has it."""
        self._loop = asyncio.get_running_loop()
        self._writer.after_commit(self._ended)
        self._writer.after_sync(self._synced_through)
        if self._shared:
            head = await self._writer.submit(self._attach, LedgerError)
            if self._legacy is not None:
                await asyncio.to_thread(ledger_file.retire, self._legacy)
        else:
            wal = log_of(self.path, self._synchronous)
            head = await self._writer.start(self._connect, wal=wal)
        if str(self.path) != ":memory:":
            # What a killed process committed may still sit in the page cache only.
            await asyncio.to_thread(_fsync_file, self.path, self._where)
        self._committed = self._synced = head.seq
        self._durable_to(head.seq)
        if self._synchronous == "NORMAL" and str(self.path) != ":memory:":
            self._syncer = threading.Thread(target=self._sync, name="sg-usage-sync", daemon=True)
            self._syncer.start()
        return head

    def _connect(self) -> tuple[sqlite3.Connection, Head]:
        db, self._head = ledger_file.connect(self.path, self._synchronous, self.node, self.kind)
        return db, self._head

    def _attach(self, db: sqlite3.Connection) -> Head:
        head = ledger_file.attach(db, self.node, self.kind, self._where)
        if self._legacy is not None:
            head = ledger_file.adopt(db, head, self._legacy, self.node, self.kind)
        self._head = head
        return head

    async def close(self) -> None:
        """Commit what was submitted, then close the file (a shared writer is its owner's
        to close)."""
        if self._closed:
            return
        self._closed = True
        if not self._shared:
            await self._writer.stop()
        if self._syncer is not None:
            with self._sync_wanted:
                self._sync_stop = True
                self._sync_wanted.notify()
            await asyncio.to_thread(self._syncer.join)

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
        are committed (or a ``LedgerError``). A draft of another node is a ``ValueError``,
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
        return self._submit(lambda db: ledger_file.acknowledge(db, wanted, now_ms), lazy=True)

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

    def _submit(
        self, op: Callable[[sqlite3.Connection], T], *, lazy: bool = False
    ) -> asyncio.Future[T]:
        loop = self._loop
        if loop is None:
            raise LedgerError(f"{self._where} is not open")
        if self._closed:
            fut: asyncio.Future[T] = loop.create_future()
            fut.set_exception(LedgerError(f"{self._where} is closed"))
            return fut
        return self._writer.submit(op, LedgerError, lazy=lazy)

    # -- at the writer's commits ------------------------------------------------------------------

    def _ended(self, db: sqlite3.Connection, committed: bool) -> None:
        """After each transaction of the writer (its own or shared): a rolled-back one puts
        the head back where the file has it; a committed one that moved the head makes its
        records durable once the writer has synced it (``FULL``) or asks the sync thread
        (``NORMAL``)."""
        if not committed:
            self._head = ledger_file.head_of(db, self._head)
            return
        seq = self._head.seq
        if seq <= self._committed:
            return
        if self._syncer is None:
            self._committed = seq
            self._unsynced.append((self._writer.batch_no, seq))
            return
        with self._sync_wanted:
            self._committed = seq
            self._sync_wanted.notify()

    def _synced_through(self, batch_no: int) -> None:
        """The writer's batches up to ``batch_no`` are on the disk (``FULL``)."""
        while self._unsynced and self._unsynced[0][0] <= batch_no:
            self._durable_to(self._unsynced.popleft()[1])

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


def _fsync_file(path: Path, where: str) -> None:
    """The file and its log to the disk."""
    for name in (str(path), f"{path}-wal"):
        _fsync(Path(name), where)


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


def ledger_path(state_dir: Path | None) -> Path:
    """Where a node keeps its ledger: ``<state_dir>/usage.sqlite``, or ``:memory:`` (kept
    by nothing: for tests and nodes without a state folder)."""
    return state_dir / FILE_NAME if state_dir is not None else Path(":memory:")
