"""The edge agent's outbox: every accepted job on disk from acceptance until its result is
delivered, so no crash loses one and no restart answers one twice.

One SQLite file in WAL mode holds one row per job, keyed by job id: the image and the
request's metadata (where the result goes, model, deadline, priority, data class), the
state (``queued`` → ``offloaded`` ↔ ``queued`` → ``done`` → ``delivered``), the current
placement attempt, how many local runs were started, and the result document once there is
one. Every operation is idempotent by job id: accepting a known id reports what is known
instead of inserting, finishing a finished job changes nothing, a return for an attempt that
is no longer current does not match. Delivered rows keep their result for
``result_retention_s`` (a resubmission gets it again); then only the id stays, as a
tombstone, for ``tombstone_s`` (at most ``max_tombstones``), so a late resubmission is still
recognised. It must never hold an unfinished job only in memory, nor let a failed write
pass for a committed one: a write that fails is an :class:`OutboxError` naming the file.
(The path ``:memory:`` gives a database in memory, for tests: it survives nothing.)

A :class:`~sluicegate.sqlite_writer.Writer` commits the writes of each loop tick in one
transaction on the loop, and with ``FULL`` syncs the log behind each commit, on the loop or,
for a slow disk, on a thread of its own (``docs/performance.md`` has the commit figures).
``FULL`` (the default) survives power loss; ``NORMAL`` in WAL mode survives a killed process
but may lose the last commits on power loss. The file is opened in exclusive locking mode:
a second agent on the same outbox fails to start instead of sharing its jobs.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Literal, TypeVar

from edge_agent.admission import Job
from edge_agent.errors import OutboxError
from edge_agent.outbox_file import COLUMNS, connect, explain, stored_row
from edge_agent.outbox_file import Stored as Stored
from sluicegate.sqlite_writer import CommitStats, Gate, Writer, log_of

T = TypeVar("T")
Synchronous = Literal["FULL", "NORMAL"]


@dataclass(frozen=True, slots=True)
class Accepted:
    """What :meth:`Outbox.accept` found: ``new`` (now stored), ``known`` (``stored`` says in
    what state) or ``forgotten`` (delivered so long ago that only a tombstone is left)."""

    outcome: Literal["new", "known", "forgotten"]
    stored: Stored | None = None
    batch: int = 0  # the writer's batch it was committed in (see Outbox.durable)


class Outbox:
    """The jobs of one edge agent, on disk. Open with ``await open()``; submit from the loop.
    ``gate`` stands between the loop and each commit (``sluicegate.sqlite_writer.Gate``)."""

    def __init__(
        self,
        path: Path | str,
        *,
        synchronous: Synchronous = "FULL",
        result_retention_s: float = 600.0,
        tombstone_s: float = 86_400.0,
        max_tombstones: int = 100_000,
        dead_letter_keep_s: float = 7 * 86_400.0,
        clock: Callable[[], float] = time.time,
        gate: Gate | None = None,
    ) -> None:
        if synchronous not in ("FULL", "NORMAL"):
            raise ValueError(f"synchronous must be 'FULL' or 'NORMAL', got {synchronous!r}")
        self.path = Path(path)
        self.synchronous = synchronous
        self.result_retention_s = result_retention_s
        self.tombstone_s = tombstone_s
        self.max_tombstones = max_tombstones
        self.dead_letter_keep_s = dead_letter_keep_s
        self._clock = clock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writer = Writer(f"outbox {self.path}", explain, gate)
        self._closed = False

    # -- lifecycle ----------------------------------------------------------------------------

    async def open(self) -> list[Stored]:
        """Open (or create) the file and return the jobs not yet delivered, oldest first."""
        self._loop = asyncio.get_running_loop()
        return await self._writer.start(
            partial(connect, self.path, self.synchronous), wal=log_of(self.path, self.synchronous)
        )

    async def close(self) -> None:
        """Commit what was submitted, then close the file."""
        if self._closed:
            return
        self._closed = True
        await self._writer.stop()

    def kill(self) -> None:
        """Stop as a killed process would: nothing submitted is written any more, and no
        submitted operation ever reports back."""
        self._closed = True
        self._writer.kill()

    @property
    def commits(self) -> int:
        return self._writer.commits

    @property
    def gate(self) -> Gate:
        return self._writer.gate

    def commit_stats(self) -> CommitStats:
        """Commit count, operations committed, and recent commit durations."""
        return self._writer.stats()

    @property
    def writer(self) -> Writer:
        """The file's writer: other owners' operations (the usage ledger's) submitted to it
        ride the outbox's commits."""
        return self._writer

    def flush(self) -> None:
        """Hand what was submitted during this tick to the writer now (through the gate)."""
        self._writer.flush()

    # -- operations (loop thread) ----------------------------------------------------------------

    def accept(
        self, job: Job, *, start_run: bool = False, written: bool = False
    ) -> asyncio.Future[Accepted]:
        """Store a new job (counting one local run already if ``start_run``), or report what
        is known of its id. A resubmission of a pending job with a new response topic or
        correlation data moves the result's destination to the latest request. ``written``:
        report at the commit, before the sync (:meth:`durable` of the answer's batch then
        says when the acceptance is on the disk)."""
        now = self._clock()
        writer = self._writer

        def op(db: sqlite3.Connection) -> Accepted:
            known = db.execute(f"SELECT {COLUMNS} FROM jobs WHERE job_id = ?", (job.job_id,))
            row = known.fetchone()
            if row is not None:
                stored = stored_row(row)
                moved = (job.response_topic, job.correlation_data) != (
                    stored.job.response_topic,
                    stored.job.correlation_data,
                )
                if stored.pending and moved:
                    db.execute(
                        "UPDATE jobs SET response_topic = ?, correlation_data = ?, updated_at = ?"
                        " WHERE job_id = ?",
                        (job.response_topic, job.correlation_data, now, job.job_id),
                    )
                    moved_job = replace(
                        stored.job,
                        response_topic=job.response_topic,
                        correlation_data=job.correlation_data,
                    )
                    stored = replace(stored, job=moved_job)
                return Accepted("known", stored, writer.batch_no)
            gone = db.execute("SELECT 1 FROM tombstones WHERE job_id = ?", (job.job_id,))
            if gone.fetchone() is not None:
                return Accepted("forgotten", None, writer.batch_no)
            db.execute(
                "INSERT INTO jobs (job_id, state, payload, response_topic, correlation_data,"
                " model, image_format, width, height, priority, data_class, received_at,"
                " deadline, local_runs, created_at, updated_at)"
                " VALUES (?, 'queued', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    job.job_id,
                    job.payload,
                    job.response_topic,
                    job.correlation_data,
                    job.model,
                    job.image.format,
                    job.image.width,
                    job.image.height,
                    job.priority,
                    job.data_class,
                    job.received_at,
                    job.deadline,
                    1 if start_run else 0,
                    now,
                    now,
                ),
            )
            return Accepted("new", None, writer.batch_no)

        return self._writer.submit(op, OutboxError, written=written)

    def durable(self, batch: int) -> asyncio.Future[None]:
        """Resolves once the writer's batch numbered ``batch`` is on the disk (an
        :class:`OutboxError` if the sync that was to cover it failed)."""
        return self._writer.durable(batch, OutboxError)

    def start_run(self, job_id: str) -> asyncio.Future[int | None]:
        """Count one more local run of a pending job before it starts; returns the count
        (runs started so far, this one included), or None if the job is not pending. It
        reports at the commit, before the sync: the count guards against a job that kills
        the process running it, and a killed process leaves what was written to the OS."""
        now = self._clock()

        def op(db: sqlite3.Connection) -> int | None:
            row = db.execute(
                "UPDATE jobs SET local_runs = local_runs + 1, state = 'queued', updated_at = ?"
                " WHERE job_id = ? AND state IN ('queued', 'offloaded') RETURNING local_runs",
                (now, job_id),
            ).fetchone()
            return int(row[0]) if row is not None else None

        return self._writer.submit(op, OutboxError, written=True)

    def offloaded(
        self, job_id: str, attempt: int, worker: str | None = None
    ) -> asyncio.Future[bool]:
        """Record that placement ``attempt`` of a pending job (to ``worker``) is being sent."""
        now = self._clock()

        def op(db: sqlite3.Connection) -> bool:
            cur = db.execute(
                "UPDATE jobs SET state = 'offloaded', attempt = ?, worker = ?, updated_at = ?"
                " WHERE job_id = ? AND state IN ('queued', 'offloaded') AND attempt < ?",
                (attempt, worker, now, job_id, attempt),
            )
            return cur.rowcount == 1

        return self._submit(op)

    def finish(
        self, job_id: str, result: bytes, *, attempt: int | None = None, keep_image: bool = False
    ) -> asyncio.Future[bool]:
        """Store a pending job's result and drop its image (with ``keep_image``, a dead
        letter's, keep it for ``dead_letter_keep_s``: an operator may release it for a
        retry); False if it was not pending (or, with ``attempt``, not offloaded as that
        attempt): only the first result counts."""
        now = self._clock()
        where = "job_id = ? AND state IN ('queued', 'offloaded')"
        args: tuple[Any, ...] = (result, int(keep_image), now, job_id)
        if attempt is not None:
            where = "job_id = ? AND state = 'offloaded' AND attempt = ?"
            args = (*args, attempt)

        def op(db: sqlite3.Connection) -> bool:
            cur = db.execute(
                "UPDATE jobs SET state = 'done', result = ?,"
                " payload = CASE WHEN ? THEN payload ELSE NULL END, updated_at = ?"
                f" WHERE {where}",
                args,
            )
            return cur.rowcount == 1

        return self._submit(op)

    def delivered(self, job_id: str, *, undeliverable: str | None = None) -> asyncio.Future[bool]:
        """Record that the broker acked the result's publish, or (``undeliverable``, why)
        that it refused it and always will: either way the result is not published again,
        and the job is forgotten as delivered jobs are; the row keeps the refusal. Lazy (it
        rides the next commit): lost in a crash, the result is only published again."""
        now = self._clock()

        def op(db: sqlite3.Connection) -> bool:
            cur = db.execute(
                "UPDATE jobs SET state = 'delivered', delivered_at = ?, updated_at = ?,"
                " undeliverable = ? WHERE job_id = ? AND state = 'done'",
                (now, now, undeliverable, job_id),
            )
            return cur.rowcount == 1

        return self._writer.submit(op, OutboxError, lazy=True)

    def prune(self) -> asyncio.Future[tuple[int, int]]:
        """Turn delivered rows past their retention into tombstones and forget old
        tombstones; returns (rows turned into tombstones, tombstones dropped)."""
        now = self._clock()
        # A row still holding its image is a dead letter's: kept for dead_letter_keep_s.
        cutoff = (now - self.result_retention_s, now - self.dead_letter_keep_s)
        expired = (
            "state = 'delivered' AND delivered_at < (CASE WHEN payload IS NULL THEN ? ELSE ? END)"
        )
        forget_before = now - self.tombstone_s

        def op(db: sqlite3.Connection) -> tuple[int, int]:
            db.execute(
                "INSERT OR REPLACE INTO tombstones (job_id, delivered_at) SELECT job_id,"
                f" delivered_at FROM jobs WHERE {expired}",
                cutoff,
            )
            moved = db.execute(f"DELETE FROM jobs WHERE {expired}", cutoff).rowcount
            dropped = db.execute(
                "DELETE FROM tombstones WHERE delivered_at < ?", (forget_before,)
            ).rowcount
            excess = db.execute("SELECT COUNT(*) FROM tombstones").fetchone()[0]
            excess -= self.max_tombstones
            if excess > 0:
                dropped += db.execute(
                    "DELETE FROM tombstones WHERE job_id IN (SELECT job_id FROM tombstones"
                    " ORDER BY delivered_at LIMIT ?)",
                    (excess,),
                ).rowcount
            return moved, dropped

        return self._submit(op)

    def get(self, job_id: str) -> asyncio.Future[Stored | None]:
        """The stored job (any state), or None."""

        def op(db: sqlite3.Connection) -> Stored | None:
            row = db.execute(f"SELECT {COLUMNS} FROM jobs WHERE job_id = ?", (job_id,))
            found = row.fetchone()
            return stored_row(found) if found is not None else None

        return self._submit(op)

    def _submit(self, op: Callable[[sqlite3.Connection], T]) -> asyncio.Future[T]:
        return self._writer.submit(op, OutboxError)
