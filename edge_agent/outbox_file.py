"""The outbox file: its schema (and the migration from older ones), the checks made when it
is opened, and how a row becomes a :class:`Stored` job. Runs in the outbox's writer's
transactions; no asyncio.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from edge_agent.admission import Job
from edge_agent.errors import OutboxError
from sluicegate.sqlite_writer import explain_sqlite
from sluicegate.vision.image import ImageInfo

State = Literal["queued", "offloaded", "done", "delivered"]
SCHEMA_VERSION = 3  # 2: the worker each attempt went to; 3: why a result was undeliverable
PENDING: tuple[State, ...] = ("queued", "offloaded")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    state TEXT NOT NULL CHECK (state IN ('queued', 'offloaded', 'done', 'delivered')),
    payload BLOB,
    response_topic TEXT NOT NULL,
    correlation_data BLOB,
    model TEXT NOT NULL,
    image_format TEXT NOT NULL,
    width INTEGER NOT NULL,
    height INTEGER NOT NULL,
    priority INTEGER NOT NULL,
    data_class TEXT NOT NULL,
    received_at REAL NOT NULL,
    deadline REAL,
    attempt INTEGER NOT NULL DEFAULT 0,
    local_runs INTEGER NOT NULL DEFAULT 0,
    worker TEXT,
    result BLOB,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    delivered_at REAL,
    undeliverable TEXT
);
CREATE INDEX IF NOT EXISTS jobs_delivered ON jobs (delivered_at) WHERE state = 'delivered';
CREATE TABLE IF NOT EXISTS tombstones (job_id TEXT PRIMARY KEY, delivered_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS tombstones_age ON tombstones (delivered_at);
"""

COLUMNS = (
    "job_id, state, payload, response_topic, correlation_data, model, image_format, width, "
    "height, priority, data_class, received_at, deadline, attempt, local_runs, worker, result"
)


@dataclass(frozen=True, slots=True)
class Stored:
    """A job as the outbox holds it. ``job.payload`` is empty once the job is done."""

    job: Job
    state: State
    attempt: int
    local_runs: int
    result: bytes | None
    worker: str | None = None  # where ``attempt`` went, when it was recorded with it

    @property
    def pending(self) -> bool:
        return self.state in PENDING


def stored_row(row: tuple[Any, ...]) -> Stored:
    (job_id, state, payload, topic, corr, model, fmt, width, height) = row[:9]
    (priority, data_class, received_at, deadline, attempt, local_runs, worker, result) = row[9:]
    job = Job(
        job_id=job_id,
        model=model,
        payload=bytes(payload) if payload is not None else b"",
        image=ImageInfo(fmt, width, height),
        response_topic=topic,
        correlation_data=bytes(corr) if corr is not None else None,
        priority=priority,
        data_class=data_class,
        received_at=received_at,
        deadline=deadline,
    )
    stored_result = bytes(result) if result is not None else None
    return Stored(job, state, attempt, local_runs, stored_result, worker)


def connect(path: Path, synchronous: str) -> tuple[sqlite3.Connection, list[Stored]]:
    """Open (or create, or migrate) the outbox file; the connection and the jobs not yet
    delivered, oldest first. Runs as the writer opens the file."""
    where = f"outbox {path}"
    in_memory = str(path) == ":memory:"
    try:
        if not in_memory:
            path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutboxError(
            f"{where}: cannot create its directory ({exc.strerror}); set [edge] "
            "outbox_path to a writable place"
        ) from exc
    try:
        db = sqlite3.connect(path, timeout=1.0, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as exc:
        raise OutboxError(f"{where} cannot be opened: {exc}; check the path") from exc
    try:
        version = _check(db, where, in_memory, synchronous)
        rows = _migrate(db, version)
    except sqlite3.Error as exc:
        db.close()
        raise OutboxError(explain(where, exc)) from exc
    except OutboxError:
        db.close()
        raise
    return db, [stored_row(row) for row in rows]


def _check(db: sqlite3.Connection, where: str, in_memory: bool, synchronous: str) -> int:
    """Lock the file, set its journal and sync modes, and check it; its schema version."""
    db.execute("PRAGMA locking_mode = EXCLUSIVE")
    mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
    if str(mode).lower() != ("memory" if in_memory else "wal"):
        raise OutboxError(f"{where} cannot use WAL journaling (got {mode!r})")
    db.execute(f"PRAGMA synchronous = {synchronous}")
    # A finished job's image pages go back to the freelist without being zeroed first (the
    # build's default zeroes them: ~21 more pages written a job); the next image reuses them.
    db.execute("PRAGMA secure_delete = FAST")
    version = int(db.execute("PRAGMA user_version").fetchone()[0])
    if version > SCHEMA_VERSION:
        raise OutboxError(
            f"{where} was written by a newer Sluicegate (schema {version}, this one "
            f"knows {SCHEMA_VERSION}); upgrade the agent or move the file away"
        )
    check = db.execute("PRAGMA quick_check").fetchone()[0]
    if check != "ok":
        raise OutboxError(f"{where} is damaged ({check}); move it away to start afresh")
    return version


def _migrate(db: sqlite3.Connection, version: int) -> list[Any]:
    """Bring the schema to this version; the rows not yet delivered, oldest first."""
    db.execute("BEGIN IMMEDIATE")
    for statement in _SCHEMA.split(";"):
        if statement.strip():
            db.execute(statement)
    if 0 < version < 2:  # written before attempts named their worker
        db.execute("ALTER TABLE jobs ADD COLUMN worker TEXT")
    if 0 < version < 3:  # written before a broker's refusal of a result ended its job
        db.execute("ALTER TABLE jobs ADD COLUMN undeliverable TEXT")
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    rows = db.execute(
        f"SELECT {COLUMNS} FROM jobs WHERE state != 'delivered' ORDER BY rowid"
    ).fetchall()
    db.execute("COMMIT")
    return rows


def explain(where: str, exc: BaseException) -> str:
    return explain_sqlite(where, exc, damaged="move it away to start afresh", owner="agent")
