"""The broker's pure decisions on usage records, as tables: who may ship a record, alone and
in a message of records that vouch for each other, what a seq already held makes of
another, the chain's links, the gaps, and what a record counts for per line and pool."""

from __future__ import annotations

from typing import Any

import pytest

from broker.core.usage import Screening, counted, link_breaks, missing, outcome, screen
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


def _message(records: list[SignedUsage], sender: str = "north-gpu-1") -> list[str | None]:
    """Each record's refusal code (None: taken), in the message's order, screened as the
    intake screens a message: last first."""
    screening = Screening(sender, POLICY)
    codes = [screening.take(r) for r in reversed(records)]
    for seen, signed in zip(codes, reversed(records), strict=True):
        assert seen.digest == signed.digest()
    return [seen.refusal.code if seen.refusal else None for seen in reversed(codes)]


def _chain(n: int, *, signer: str | None = None) -> list[SignedUsage]:
    out: list[SignedUsage] = []
    prev = GENESIS
    for seq in range(1, n + 1):
        out.append(_signed(seq=seq, prev=prev.hex(), job_id=f"j-{seq}", signer=signer))
        prev = out[-1].digest()
    return out


def _relinked(signed: SignedUsage, prev: SignedUsage) -> SignedUsage:
    """``signed`` made to name ``prev`` (a forger's record), its signature left as it was."""
    forged = signed.record.model_copy(update={"prev": prev.digest().hex()})
    return signed.model_copy(update={"record": forged})


BAD = "usage.bad_signature"
RUN = _chain(5)


@pytest.mark.parametrize(
    ("records", "codes"),
    [
        (RUN, [None] * 5),
        # altered on the way: its successor names the original, so it is checked, and fails
        ([*RUN[:2], _altered(RUN[2]), *RUN[3:]], [None, None, BAD, None, None]),
        # the last one's signature fails: the one before it is not vouched for, but checked
        ([*RUN[:4], _altered(RUN[4])], [None, None, None, None, BAD]),
        # a forger relinks the successor to the altered record: both fail their own check
        (
            [*RUN[:2], _altered(RUN[2]), _relinked(RUN[3], _altered(RUN[2])), RUN[4]],
            [None, None, BAD, BAD, None],
        ),
        # signed with another node's key all along: each one fails, none vouches
        (_chain(3, signer="south-npu-1"), [BAD, BAD, BAD]),
        # not in order, or not linked (a resend of a few): each one checked on its own
        ([RUN[3], RUN[0], RUN[4]], [None, None, None]),
        ([RUN[0], _altered(RUN[1]), RUN[3]], [None, BAD, None]),
    ],
    ids=["run", "altered", "last-bad", "relinked", "foreign-key", "unordered", "gap"],
)
def test_a_message_is_screened_as_a_run_each_record_still_its_own(
    records: list[SignedUsage], codes: list[str | None]
) -> None:
    assert _message(records) == codes


def test_a_record_vouched_for_is_still_refused_for_what_it_says() -> None:
    """Only the signature check is spared: a record of another node, or of the wrong kind,
    is refused even when the next one names it."""
    chain = _chain(2)
    assert _message(chain, sender="north-gpu-2") == ["usage.id_mismatch"] * 2


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
