"""The node's usage ledger on a real SQLite file: seq and prev assigned and signed on
append, the chain going on across reopening, what a SIGKILLed process had appended still
there, acknowledgements and pruning, and the errors a wrong file or a wrong record gets."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

from policies.keys import SigningKey
from sluicegate.errors import LedgerError
from sluicegate.metering.ledger import Ledger
from sluicegate.metering.record import GENESIS, SignedUsage

KEY = SigningKey.generate()


def _ledger(
    path: Path | str, *, node: str = "north-cpu-1", clock: float = 1_800_000_000.0
) -> Ledger:
    return Ledger(path, KEY, node=node, kind="pool", clock=lambda: clock)


def _drafts(ledger: Ledger, n: int, job: str = "j") -> list:  # type: ignore[type-arg]
    return [
        ledger.draft(
            event="ran",
            job_id=f"{job}-{i}",
            attempt=1,
            line="line-1-pc",
            zone="campus/dc",
            status="ok",
            device_us=1000 + i,
        )
        for i in range(n)
    ]


def _chained(records: list[SignedUsage], first_prev: bytes = GENESIS) -> bool:
    prev = first_prev
    for signed in records:
        if signed.record.prev != prev.hex() or not signed.node_signature_valid(KEY.public):
            return False
        prev = signed.digest()
    return True


async def test_append_numbers_chains_and_signs_each_record(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path / "usage.sqlite")
    head = await ledger.open()
    assert (head.seq, head.digest, head.unacked) == (0, GENESIS, 0)
    first = await ledger.append(_drafts(ledger, 3))
    second = await ledger.append(_drafts(ledger, 2, "k"))
    signed = first + second
    assert [s.record.seq for s in signed] == [1, 2, 3, 4, 5]
    assert _chained(signed)
    assert await ledger.unacked() == signed
    await ledger.close()


@pytest.mark.parametrize("synchronous", ["FULL", "NORMAL"])
async def test_appended_records_become_durable(tmp_path: Path, synchronous: str) -> None:
    ledger = Ledger(tmp_path / "u.sqlite", KEY, node="w", kind="pool", synchronous=synchronous)  # type: ignore[arg-type]
    await ledger.open()
    signed = await ledger.append(_drafts(ledger, 3))
    await asyncio.wait_for(ledger.durable(signed[-1].record.seq), 10)
    assert ledger.durable(1).done()  # what is durable already resolves at once
    assert ledger.syncs >= (1 if synchronous == "NORMAL" else 0)
    await ledger.close()


async def test_the_chain_goes_on_after_reopening(tmp_path: Path) -> None:
    path = tmp_path / "usage.sqlite"
    ledger = _ledger(path)
    await ledger.open()
    before = await ledger.append(_drafts(ledger, 2))
    await ledger.close()
    again = _ledger(path)
    head = await again.open()
    assert (head.seq, head.digest, head.unacked) == (2, before[-1].digest(), 2)
    after = await again.append(_drafts(again, 2, "k"))
    assert [s.record.seq for s in after] == [3, 4]
    assert _chained(before + after)
    await again.close()


async def test_acknowledged_records_are_not_offered_and_pruned_after_retention(
    tmp_path: Path,
) -> None:
    now = [1_800_000_000.0]
    ledger = Ledger(
        tmp_path / "u.sqlite", KEY, node="w", kind="pool", clock=lambda: now[0], retention_s=60.0
    )
    await ledger.open()
    signed = await ledger.append(_drafts(ledger, 4))
    assert await ledger.acknowledge([1, 3, 99]) == 2
    assert await ledger.acknowledge([1]) == 0  # once
    assert [s.record.seq for s in await ledger.unacked()] == [2, 4]
    assert [s.record.seq for s in await ledger.unacked(after=2)] == [4]
    assert await ledger.prune() == 0  # acknowledged just now
    now[0] += 61.0
    assert await ledger.prune() == 2
    assert await ledger.count_unacked() == 2
    more = await ledger.append(_drafts(ledger, 1, "k"))  # the head outlives pruned records
    assert more[0].record.seq == 5
    assert more[0].record.prev == signed[-1].digest().hex()
    await ledger.close()


async def test_a_record_of_another_node_or_a_bad_value_is_refused_before_writing(
    tmp_path: Path,
) -> None:
    ledger = _ledger(tmp_path / "u.sqlite")
    other = _ledger(tmp_path / "other.sqlite", node="cloud-cpu-1")
    await ledger.open()
    with pytest.raises(ValueError, match="cloud-cpu-1"):
        ledger.append(_drafts(other, 1))
    with pytest.raises(ValidationError, match="token_id"):
        ledger.draft(
            event="ran", job_id="j", attempt=1, line="l", zone="z", status="ok", token_id="not hex"
        )
    assert await ledger.count_unacked() == 0
    await ledger.close()


async def test_another_nodes_file_and_a_file_in_use_are_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "u.sqlite"
    first = _ledger(path)
    await first.open()
    with pytest.raises(LedgerError, match="in use by another process"):
        await _ledger(path).open()
    await first.close()
    with pytest.raises(LedgerError, match="ledger of pool 'north-cpu-1', not of pool 'x'"):
        await _ledger(path, node="x").open()
    (tmp_path / "junk.sqlite").write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(LedgerError, match="not a usable SQLite file"):
        await _ledger(tmp_path / "junk.sqlite").open()


CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from policies.keys import load_signing_key
    from sluicegate.metering.ledger import Ledger

    async def main():
        ledger = Ledger(sys.argv[1], load_signing_key(Path(sys.argv[2])), node="w", kind="pool",
                        synchronous=sys.argv[3])
        await ledger.open()
        for batch in range(5):
            drafts = [ledger.draft(event="ran", job_id=f"{batch}-{i}", attempt=1, line="l",
                                   zone="z", status="ok") for i in range(4)]
            signed = await ledger.append(drafts)
            print(signed[-1].record.seq, flush=True)  # only once it is committed
        await asyncio.Event().wait()  # killed here, the file never closed

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("synchronous", ["FULL", "NORMAL"])
def test_what_append_returned_survives_a_sigkill(tmp_path: Path, synchronous: str) -> None:
    key_file = tmp_path / "w.key"
    key_file.write_bytes(KEY.to_pem())
    path = tmp_path / "usage.sqlite"
    with subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), str(key_file), synchronous],
        stdout=subprocess.PIPE,
        env={**os.environ},
    ) as child:
        assert child.stdout is not None
        seen = [int(child.stdout.readline()) for _ in range(5)]
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    assert seen == [4, 8, 12, 16, 20]
    asyncio.run(_reopened(path))


async def _reopened(path: Path) -> None:
    ledger = Ledger(path, KEY, node="w", kind="pool")
    head = await ledger.open()
    assert head.seq == 20
    records = await ledger.unacked()
    assert [s.record.seq for s in records] == list(range(1, 21))
    assert _chained(records)
    assert head.digest == records[-1].digest()
    await ledger.close()
