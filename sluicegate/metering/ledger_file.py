"""The usage ledger's SQLite file: its schema, the checks made when it is opened, and the
operations the ledger's writer runs in its transactions. No asyncio here.

One row per signed record (``records``: seq, when it was written, the record's line, when
a broker replica acknowledged it), and the chain's head (``head``: the node, its kind, the
last seq and that record's digest), which outlives the records pruned after their
acknowledgement, so the chain goes on from where it was after any restart.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from policies.keys import SigningKey
from sluicegate.errors import LedgerError
from sluicegate.metering.record import GENESIS, SignedUsage, Usage, from_line, sign_chained, to_line
from sluicegate.sqlite_writer import explain_sqlite

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    seq INTEGER PRIMARY KEY,
    at_ms INTEGER NOT NULL,
    line BLOB NOT NULL,
    acked_ms INTEGER
);
CREATE INDEX IF NOT EXISTS records_unacked ON records (seq) WHERE acked_ms IS NULL;
CREATE INDEX IF NOT EXISTS records_acked ON records (acked_ms) WHERE acked_ms IS NOT NULL;
CREATE TABLE IF NOT EXISTS head (
    one INTEGER PRIMARY KEY CHECK (one = 1),
    node TEXT NOT NULL,
    kind TEXT NOT NULL,
    seq INTEGER NOT NULL,
    digest BLOB NOT NULL
);
"""


@dataclass(frozen=True, slots=True)
class Head:
    """The chain's end: the last seq written (0: none yet), its digest, and how many
    records no broker replica had acknowledged when the file was opened."""

    seq: int
    digest: bytes
    unacked: int = 0


def explain(where: str, exc: BaseException) -> str:
    return explain_sqlite(where, exc, damaged="move it away (its records are lost)", owner="node")


def connect(path: Path, synchronous: str, node: str, kind: str) -> tuple[sqlite3.Connection, Head]:
    """Open (or create) the ledger of ``node``; the connection and the chain's head."""
    where = f"usage ledger {path}"
    in_memory = str(path) == ":memory:"
    try:
        if not in_memory:
            path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(path, timeout=1.0, isolation_level=None, check_same_thread=False)
    except OSError as exc:
        raise LedgerError(f"{where}: cannot create its folder ({exc.strerror})") from exc
    except sqlite3.Error as exc:
        raise LedgerError(f"{where} cannot be opened: {exc}; check the path") from exc
    try:
        head = _prepare(db, where, in_memory, synchronous, node, kind)
    except sqlite3.Error as exc:
        db.close()
        raise LedgerError(explain(where, exc)) from exc
    except LedgerError:
        db.close()
        raise
    return db, head


def _prepare(
    db: sqlite3.Connection, where: str, in_memory: bool, synchronous: str, node: str, kind: str
) -> Head:
    db.execute("PRAGMA locking_mode = EXCLUSIVE")  # a second process on it fails to start
    mode = str(db.execute("PRAGMA journal_mode = WAL").fetchone()[0]).lower()
    if mode != ("memory" if in_memory else "wal"):
        raise LedgerError(f"{where} cannot use WAL journaling (got {mode!r})")
    db.execute(f"PRAGMA synchronous = {synchronous}")
    version = int(db.execute("PRAGMA user_version").fetchone()[0])
    if version > SCHEMA_VERSION:
        raise LedgerError(
            f"{where} was written by a newer Sluicegate (schema {version}, this one knows "
            f"{SCHEMA_VERSION}); upgrade this node"
        )
    db.execute("BEGIN IMMEDIATE")
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    head = attach(db, node, kind, where)
    db.execute("COMMIT")
    return head


def attach(db: sqlite3.Connection, node: str, kind: str, where: str) -> Head:
    """The ledger's tables in ``db`` (made if missing) and the chain's head, inside the
    caller's transaction: in a file of its own, or in a file another owner shares (an
    edge's outbox). A file that holds another node's chain is a :class:`LedgerError`."""
    for statement in _SCHEMA.split(";"):
        if statement.strip():
            db.execute(statement)
    row = db.execute("SELECT node, kind, seq, digest FROM head").fetchone()
    if row is None:
        db.execute(
            "INSERT INTO head (one, node, kind, seq, digest) VALUES (1, ?, ?, 0, ?)",
            (node, kind, GENESIS),
        )
        row = (node, kind, 0, GENESIS)
    if (row[0], row[1]) != (node, kind):
        raise LedgerError(
            f"{where} is the ledger of {row[1]} {row[0]!r}, not of {kind} {node!r}: each "
            "node keeps its own (set this node's state folder)"
        )
    return Head(int(row[2]), bytes(row[3]), count_unacked(db))


def head_of(db: sqlite3.Connection, fallback: Head) -> Head:
    """The head as the file has it (after a rolled-back transaction); ``fallback`` when
    the file cannot be read."""
    try:
        row = db.execute("SELECT seq, digest FROM head").fetchone()
    except sqlite3.Error:
        return fallback
    if row is None:
        return Head(0, GENESIS)
    return Head(int(row[0]), bytes(row[1]), fallback.unacked)


def adopt(db: sqlite3.Connection, head: Head, legacy: Path, node: str, kind: str) -> Head:
    """Move the chain an edge kept in a file of its own (``legacy``) into ``db``, inside the
    caller's transaction: its records, acknowledged or not, and its head, so the chain goes
    on from there. Only into a chain that is still empty (a second start finds ``db``
    holding it already); the legacy file is left as it is for :func:`retire`."""
    if head.seq != 0 or not legacy.exists():
        return head
    where = f"usage ledger {legacy}"
    try:
        old = sqlite3.connect(legacy, timeout=1.0, isolation_level=None)
    except sqlite3.Error as exc:
        raise LedgerError(f"{where} cannot be opened: {exc}") from exc
    try:
        found = old.execute("SELECT node, kind, seq, digest FROM head").fetchone()
        rows = old.execute("SELECT seq, at_ms, line, acked_ms FROM records").fetchall()
    except sqlite3.Error as exc:
        raise LedgerError(explain(where, exc)) from exc
    finally:
        old.close()
    if found is None:
        return head
    if (found[0], found[1]) != (node, kind):
        raise LedgerError(
            f"{where} is the ledger of {found[1]} {found[0]!r}, not of {kind} {node!r}"
        )
    db.executemany("INSERT INTO records (seq, at_ms, line, acked_ms) VALUES (?, ?, ?, ?)", rows)
    db.execute("UPDATE head SET seq = ?, digest = ? WHERE one = 1", (found[2], found[3]))
    return Head(int(found[2]), bytes(found[3]), count_unacked(db))


def retire(legacy: Path) -> None:
    """Rename a legacy ledger file (and its log) to ``<name>.merged`` once its chain is
    in the shared file: kept for an operator to look at, never read again."""
    for name in (legacy, Path(f"{legacy}-wal"), Path(f"{legacy}-shm")):
        if name.exists():
            name.replace(name.with_name(name.name + ".merged"))


def append(
    db: sqlite3.Connection, head: Head, drafts: Iterable[Usage], key: SigningKey
) -> tuple[Head, list[SignedUsage]]:
    """Sign and insert ``drafts`` after ``head`` (their seq and prev assigned here); the
    new head and the signed records. Inside the caller's transaction."""
    seq, digest = head.seq, head.digest
    signed: list[SignedUsage] = []
    rows = []
    for draft in drafts:
        seq += 1
        record = draft.model_copy(update={"seq": seq, "prev": digest.hex()})
        one, digest = sign_chained(record, key)
        signed.append(one)
        rows.append((seq, record.at_ms, to_line(one)))
    db.executemany("INSERT INTO records (seq, at_ms, line) VALUES (?, ?, ?)", rows)
    db.execute("UPDATE head SET seq = ?, digest = ? WHERE one = 1", (seq, digest))
    return Head(seq, digest, head.unacked), signed


def acknowledge(db: sqlite3.Connection, seqs: Iterable[int], now_ms: int) -> int:
    """Mark records acknowledged (once); how many were not before."""
    cur = db.executemany(
        "UPDATE records SET acked_ms = ? WHERE seq = ? AND acked_ms IS NULL",
        ((now_ms, int(s)) for s in seqs),
    )
    return max(0, cur.rowcount)


def unacked(db: sqlite3.Connection, after: int, limit: int) -> list[SignedUsage]:
    """Records not acknowledged, from seq ``after + 1`` on, in order, at most ``limit``."""
    rows = db.execute(
        "SELECT line FROM records WHERE acked_ms IS NULL AND seq > ? ORDER BY seq LIMIT ?",
        (after, limit),
    ).fetchall()
    return [from_line(bytes(row[0])) for row in rows]


def prune(db: sqlite3.Connection, before_ms: int) -> int:
    """Forget records acknowledged before ``before_ms``; how many."""
    cur = db.execute(
        "DELETE FROM records WHERE acked_ms IS NOT NULL AND acked_ms < ?", (before_ms,)
    )
    return max(0, cur.rowcount)


def count_unacked(db: sqlite3.Connection) -> int:
    return int(db.execute("SELECT COUNT(*) FROM records WHERE acked_ms IS NULL").fetchone()[0])
