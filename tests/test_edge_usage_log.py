"""An edge's one durable log: its usage ledger lives in the outbox's file and rides the
outbox's commits, so a job's result and its usage record are made durable together; an
edge that kept its records in a file of their own has its chain moved in at the first
start, unacknowledged records included, and its chain goes on from there."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from edge_agent.outbox import Outbox
from edge_agent.outbox_bench import _job
from policies.keys import SigningKey
from sluicegate.errors import LedgerError
from sluicegate.metering.ledger import Ledger
from sluicegate.metering.record import GENESIS, SignedUsage, Usage

KEY = SigningKey.generate()
EDGE = "line-1-pc"


def _shared(outbox: Outbox, legacy: Path | None = None, node: str = EDGE) -> Ledger:
    return Ledger(outbox.path, KEY, node=node, kind="edge", log=outbox.writer, legacy=legacy)


def _draft(ledger: Ledger, job_id: str) -> Usage:
    return ledger.draft(
        event="ran", job_id=job_id, attempt=0, line=EDGE, zone="campus/line-1", status="ok"
    )


def _rows(path: Path, sql: str) -> list[tuple[object, ...]]:
    db = sqlite3.connect(path)
    try:
        return db.execute(sql).fetchall()
    finally:
        db.close()


async def test_a_result_and_its_usage_record_share_one_commit(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "edge.outbox.db")
    await outbox.open()
    ledger = _shared(outbox)
    head = await ledger.open()
    assert (head.seq, head.digest) == (0, GENESIS)
    await outbox.accept(_job(1, b"jpeg"))
    before = outbox.commits
    # Submitted in one loop tick, as the edge submits a result and its record.
    finished = outbox.finish("bench-1", b'{"status": "ok"}')
    appended = ledger.append([_draft(ledger, "bench-1")])
    stored, signed = await asyncio.gather(finished, appended)
    assert stored is True
    assert [s.record.seq for s in signed] == [1]
    assert outbox.commits == before + 1
    assert ledger.durable_seq == 1  # FULL: committed is durable
    await ledger.close()
    await outbox.close()
    assert not (tmp_path / "usage.sqlite").exists()
    assert _rows(outbox.path, "SELECT seq FROM records") == [(1,)]
    assert _rows(outbox.path, "SELECT state FROM jobs") == [("done",)]


async def test_a_failing_record_fails_alone_and_takes_no_seq(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "edge.outbox.db")
    await outbox.open()
    ledger = _shared(outbox)
    await ledger.open()
    await outbox.accept(_job(1, b"jpeg"))
    # A row in the way of seq 1 (as a damaged file would have): the append fails.
    squat = "INSERT INTO records (seq, at_ms, line) VALUES (1, 0, x'00')"
    await outbox.writer.submit(lambda db: db.execute(squat), LedgerError)
    failing = ledger.append([_draft(ledger, "x")])
    finished = outbox.finish("bench-1", b"{}")
    results = await asyncio.gather(failing, finished, return_exceptions=True)
    assert isinstance(results[0], LedgerError)
    assert "UNIQUE constraint failed" in str(results[0])
    assert results[1] is True  # the result beside it is committed all the same
    await outbox.writer.submit(lambda db: db.execute("DELETE FROM records"), LedgerError)
    (signed,) = await ledger.append([_draft(ledger, "bench-1")])
    assert (signed.record.seq, signed.record.prev) == (1, GENESIS.hex())
    await ledger.close()
    await outbox.close()


async def _legacy_chain(path: Path, n: int, acked: int) -> list[SignedUsage]:
    own = Ledger(path, KEY, node=EDGE, kind="edge")
    await own.open()
    signed = await own.append([_draft(own, f"old-{i}") for i in range(n)])
    await own.acknowledge([s.record.seq for s in signed[:acked]])
    await own.close()
    return signed


async def test_a_legacy_ledger_file_is_moved_into_the_outbox_once(tmp_path: Path) -> None:
    legacy = tmp_path / f"edge-{EDGE}.usage.sqlite"
    old = await _legacy_chain(legacy, 3, acked=1)
    outbox = Outbox(tmp_path / f"edge-{EDGE}.outbox.db")
    await outbox.open()
    ledger = _shared(outbox, legacy)
    head = await ledger.open()
    assert (head.seq, head.digest, head.unacked) == (3, old[-1].digest(), 2)
    assert [s.record.seq for s in await ledger.unacked()] == [2, 3]
    (new,) = await ledger.append([_draft(ledger, "new")])
    assert (new.record.seq, new.record.prev) == (4, old[-1].digest().hex())
    assert not legacy.exists()
    assert legacy.with_name(legacy.name + ".merged").exists()
    await ledger.close()
    await outbox.close()
    # A second start finds the chain in the outbox and adopts nothing again.
    await _legacy_chain(legacy, 2, acked=0)
    again = Outbox(outbox.path)
    await again.open()
    head = await _shared(again, legacy).open()
    assert (head.seq, head.unacked) == (4, 3)
    await again.close()


async def test_an_outbox_holding_another_nodes_chain_is_refused(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "edge.outbox.db")
    await outbox.open()
    await _shared(outbox).open()
    with pytest.raises(LedgerError, match="ledger of edge 'line-1-pc', not of edge 'other'"):
        await _shared(outbox, node="other").open()
    await outbox.close()
