"""Billing between two sister campuses (sluicegate.metering.peering): each campus's
settlement export holds its own records of the jobs between them and the peer's, as the
peer's broker countersigned them; checked offline against its own policy, and settled job
for job, what north owes south is what south is owed by north. Real signatures (published
test keys)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from sluicegate.app.cli import app
from sluicegate.metering.peering import (
    concerns,
    peer_export,
    settle_peer,
    theirs_problem,
    verify_peer_export,
)
from sluicegate.metering.record import GENESIS, SignedUsage, Usage, countersign, sign_usage
from tests.policies.policy_testkit import PARTS_TERMS, key, policy_of, site_doc, to_toml

NORTH, SOUTH = "north-site", "south-site"
EDGE, WORKER = "north-l1-pc", "south-site-gpu-1"  # north's line, south's worker
T0 = 1_796_000_000_000
TERMS = {**PARTS_TERMS, "device_second": 0.5, "job": 0.01}
NORTH_POLICY = policy_of(site_doc(NORTH, SOUTH, send=TERMS, receive={}))
SOUTH_POLICY = policy_of(site_doc(SOUTH, NORTH, send={}, receive=TERMS))


class Node:
    """One node's chain of records, countersigned by its campus's broker."""

    def __init__(self, node: str, kind: str, campus: str) -> None:
        self.node, self.kind, self.campus = node, kind, campus
        self.seq, self.prev = 0, GENESIS.hex()

    def add(self, **fields: Any) -> SignedUsage:
        self.seq += 1
        base = {"node": self.node, "kind": self.kind, "seq": self.seq, "prev": self.prev}
        base |= {"zone": "z", "status": "ok", "line": EDGE, "data_class": "ocr-crop", "attempt": 0}
        signed = sign_usage(Usage(**(base | fields)), key(self.node))
        broker = f"{self.campus}-broker-1"
        signed = countersign(signed, key(broker), broker=broker, received_ms=fields["at_ms"] + 9)
        self.prev = signed.digest().hex()
        return signed


def records() -> tuple[list[SignedUsage], list[SignedUsage]]:
    """North's edge settled three of its jobs south's worker ran (one of them twice: a
    fenced late return), and ran one itself; south's worker ran a job of its own campus."""
    edge, worker = Node(EDGE, "edge", NORTH), Node(WORKER, "pool", SOUTH)
    north: list[SignedUsage] = []
    south: list[SignedUsage] = []
    for i, (ms, attempts) in enumerate([(12, 1), (20, 1), (7, 2)]):
        job = f"j-{i}"
        for attempt in range(1, attempts + 1):
            south.append(
                worker.add(
                    event="ran",
                    job_id=job,
                    attempt=attempt,
                    at_ms=T0 + 100 * i + attempt,
                    device_us=ms * 1000,
                    campus=NORTH,
                    owner="inspect",
                )
            )
        north.append(
            edge.add(
                event="settled",
                job_id=job,
                attempt=attempts,
                at_ms=T0 + 100 * i + 50,
                settled_node=f"{WORKER}@{SOUTH}",
                settled_attempt=attempts,
                owner="inspect",
            )
        )
    north.append(edge.add(event="ran", job_id="j-home", at_ms=T0 + 500, device_us=40_000))
    south.append(worker.add(event="ran", job_id="s-own", at_ms=T0 + 600, device_us=5_000))
    return north, south


def exports() -> tuple[bytes, bytes]:
    """Each campus's settlement export: its records that concern the other, and the
    other's it received (those its broker sent: the ones that concern it)."""
    north, south = records()
    to_south = [s for s in north if concerns(s.record, SOUTH)]
    to_north = [s for s in south if concerns(s.record, NORTH)]
    period = {"exported_ms": T0 + 9_000, "from_ms": T0, "to_ms": T0 + 10_000}
    north_export = peer_export(
        to_south,
        to_north,
        key(f"{NORTH}-broker-1"),
        broker=f"{NORTH}-broker-1",
        peer=SOUTH,
        **period,
    )
    south_export = peer_export(
        to_north,
        to_south,
        key(f"{SOUTH}-broker-1"),
        broker=f"{SOUTH}-broker-1",
        peer=NORTH,
        **period,
    )
    return north_export, south_export


def test_each_campus_sends_only_the_records_of_jobs_between_them() -> None:
    north, south = records()
    assert [s.record.job_id for s in north if concerns(s.record, SOUTH)] == ["j-0", "j-1", "j-2"]
    assert [s.record.job_id for s in south if concerns(s.record, NORTH)] == [
        "j-0",
        "j-1",
        "j-2",
        "j-2",
    ]
    # North keeps what south's broker countersigned about north's jobs, nothing else.
    assert theirs_problem(NORTH_POLICY, SOUTH, south[0]) is None
    assert "no job between" in str(theirs_problem(NORTH_POLICY, SOUTH, south[-1]))
    assert "not by a broker" in str(theirs_problem(NORTH_POLICY, SOUTH, north[0]))
    assert "no sister campus" in str(theirs_problem(NORTH_POLICY, "east-site", south[0]))
    bare = south[0].model_copy(update={"receipt": None})
    assert "no receipt" in str(theirs_problem(NORTH_POLICY, SOUTH, bare))


def test_both_settlements_verify_and_agree_job_for_job() -> None:
    north_export, south_export = exports()
    north = verify_peer_export(north_export, NORTH_POLICY, SOUTH)
    south = verify_peer_export(south_export, SOUTH_POLICY, NORTH)
    assert north.ok, north.verification.problems
    assert south.ok, south.verification.problems
    owes = settle_peer(north, NORTH_POLICY, SOUTH)
    owed = settle_peer(south, SOUTH_POLICY, NORTH)
    mine = [(b.line, b.job_id, b.worker, b.attempt, b.device_us) for b in owes.jobs("owed_by_us")]
    theirs = [(b.line, b.job_id, b.worker, b.attempt, b.device_us) for b in owed.jobs("owed_to_us")]
    assert (
        mine
        == theirs
        == [
            (EDGE, "j-0", WORKER, 1, 12_000),
            (EDGE, "j-1", WORKER, 1, 20_000),
            (EDGE, "j-2", WORKER, 2, 7_000),
        ]
    )
    assert owes.totals("owed_by_us") == owed.totals("owed_to_us")
    jobs, device_s, amount = owes.totals("owed_by_us")
    assert (jobs, str(device_s), str(amount)) == (3, "0.039", "0.0495")  # 0.039 s x 0.5 + 3 x 0.01
    assert owes.jobs("owed_to_us") == []
    assert (owes.waste, owed.waste) == (1, 1)  # j-2's first attempt, fenced: never billed


@pytest.mark.parametrize(
    ("change", "kind"),
    [
        (lambda lines: [lines[0], *lines], "repeated"),
        (lambda lines: [lines[0].replace(b"ocr-crop", b"wafer-image"), *lines[1:]], "altered"),
        (lambda lines: [*lines[:-1], lines[-1].replace(b"south-site", b"east-site")], "manifest"),
        (lambda lines: lines[1:], "manifest"),  # a line removed: the sha256 no longer fits
    ],
)
def test_an_export_changed_after_signing_does_not_verify(change: Any, kind: str) -> None:
    north_export, _ = exports()
    lines = north_export.rstrip(b"\n").split(b"\n")
    checked = verify_peer_export(b"\n".join(change(lines)) + b"\n", NORTH_POLICY, SOUTH)
    assert not checked.ok
    assert kind in checked.verification.counts


def test_a_campus_s_own_export_is_no_settlement() -> None:
    north_export, _ = exports()
    checked = verify_peer_export(north_export, NORTH_POLICY, "east-site")
    assert "manifest" in checked.verification.counts


def test_the_peer_report_command_prints_both_ways(tmp_path: Any) -> None:
    north_export, _ = exports()
    (tmp_path / "n.jsonl").write_bytes(north_export)
    policy = tmp_path / "north.toml"
    policy.write_text(to_toml(site_doc(NORTH, SOUTH, send=TERMS, receive={})))
    runner = CliRunner()
    args = ["meter", "peer-report", str(tmp_path / "n.jsonl"), "--policy", str(policy)]
    table = runner.invoke(app, [*args, "--peer", SOUTH])
    assert table.exit_code == 0, table.output
    assert "north-site owes south-site: its jobs south-site ran: 3 jobs, 0.039000 device-s" in (
        table.output
    )
    doc = json.loads(runner.invoke(app, [*args, "--peer", SOUTH, "--format", "json"]).output)
    assert doc["owed_by_us"]["jobs"] == 3
    assert doc["owed_by_us"]["amount"] == "0.049500"
    refused = runner.invoke(app, [*args, "--peer", "east-site"])
    assert refused.exit_code == 2
    assert "names no sister campus" in refused.output
    (tmp_path / "bad.jsonl").write_bytes(north_export.replace(b"12000", b"13000", 1))
    bad = runner.invoke(
        app,
        [
            "meter",
            "peer-report",
            str(tmp_path / "bad.jsonl"),
            "--policy",
            str(policy),
            "--peer",
            SOUTH,
        ],
    )
    assert bad.exit_code == 1
