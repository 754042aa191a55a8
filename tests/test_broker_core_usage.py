"""The broker's pure decisions on usage records, as tables: who may ship a record, what a
seq already held makes of another, the chain's links, the gaps, and what a record counts
for per line and pool."""

from __future__ import annotations

from typing import Any

import pytest

from broker.core.usage import counted, link_breaks, missing, outcome, screen
from sluicegate.metering.record import GENESIS, SignedUsage, Usage, sign_usage
from tests.policies.policy_testkit import base_doc, key, policy_of

POLICY = policy_of(base_doc())


def _signed(node: str = "north-gpu-1", *, signer: str | None = None, **fields: Any) -> SignedUsage:
    base: dict[str, Any] = {
        "node": node,
        "kind": "pool",
        "seq": 1,
        "prev": GENESIS.hex(),
        "at_ms": 1_780_000_000_000,
        "event": "ran",
        "job_id": "j-1",
        "attempt": 1,
        "line": "north-l1-pc",
        "zone": "campus/fab-north/dc",
        "status": "ok",
        "device_us": 2_500,
    }
    return sign_usage(Usage(**(base | fields)), key(signer or node))


def _altered(signed: SignedUsage) -> SignedUsage:
    forged = signed.record.model_copy(update={"device_us": 1})
    return signed.model_copy(update={"record": forged})


@pytest.mark.parametrize(
    ("signed", "sender", "code"),
    [
        (_signed(), "north-gpu-1", None),
        (_signed("north-l1-pc", kind="edge", zone="campus/fab-north/line-1"), "north-l1-pc", None),
        (_signed(), "north-gpu-2", "usage.id_mismatch"),
        (_signed("north-gpu-9"), "north-gpu-9", "usage.not_in_policy"),
        (_signed(kind="edge"), "north-gpu-1", "usage.kind_mismatch"),
        (_signed(signer="south-npu-1"), "north-gpu-1", "usage.bad_signature"),
        (_altered(_signed()), "north-gpu-1", "usage.bad_signature"),
    ],
)
def test_who_may_ship_a_record(signed: SignedUsage, sender: str, code: str | None) -> None:
    refusal = screen(signed, sender, POLICY)
    assert (refusal.code if refusal else None) == code
    if refusal is not None:
        assert sender in refusal.reason


def test_no_policy_refuses_every_record() -> None:
    refusal = screen(_signed(), "north-gpu-1", None)
    assert refusal is not None
    assert refusal.code == "usage.no_policy"


@pytest.mark.parametrize(
    ("held", "want"),
    [(None, "new"), ("aa" * 32, "duplicate"), ("bb" * 32, "conflict")],
)
def test_what_a_seq_held_makes_of_a_record(held: str | None, want: str) -> None:
    assert outcome("aa" * 32, held) == want


FIRST = _signed()
SECOND = _signed(seq=2, prev=FIRST.digest().hex(), job_id="j-2")


@pytest.mark.parametrize(
    ("signed", "before", "after", "breaks"),
    [
        (FIRST, None, None, 0),
        (FIRST, None, SECOND.record.prev, 0),  # the next one links to it
        (FIRST, None, "00" * 32, 1),  # the next one names another
        (_signed(prev="11" * 32), None, None, 1),  # seq 1 must follow the genesis
        (SECOND, FIRST.digest().hex(), None, 0),
        (SECOND, None, None, 0),  # its predecessor not held yet: no break
        (SECOND, "22" * 32, "33" * 32, 2),
    ],
)
def test_links_to_the_neighbours_held(
    signed: SignedUsage, before: str | None, after: str | None, breaks: int
) -> None:
    assert link_breaks(signed, before, after) == breaks


@pytest.mark.parametrize(("head", "held", "gap"), [(5, 5, 0), (9, 5, 4), (0, 0, 0), (3, 4, 0)])
def test_gaps(head: int, held: int, gap: int) -> None:
    assert missing(head, held) == gap


def test_what_a_record_counts_for() -> None:
    ran = counted(_signed(device_us=2_500), POLICY)
    assert (ran.line, ran.pool, ran.device_s, ran.ran, ran.billed) == (
        "north-l1-pc",
        "north-dc",
        0.0025,
        True,
        False,
    )
    here = counted(_signed("north-l1-pc", kind="edge", zone="z", device_us=1_000_000), POLICY)
    assert (here.pool, here.device_s) == ("edge", 1.0)
    settled = counted(
        _signed(
            "north-l1-pc",
            kind="edge",
            zone="z",
            event="settled",
            settled_node="north-gpu-1",
            settled_attempt=1,
        ),
        POLICY,
    )
    assert (settled.line, settled.pool, settled.ran, settled.billed) == (
        "north-l1-pc",
        "north-dc",
        False,
        True,
    )
