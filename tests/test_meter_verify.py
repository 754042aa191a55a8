"""``sluicegate.metering.verify``: a real export (real keys, signatures, receipts, manifest)
checks out, and each way of tampering with the file is caught and named by line, node and
seq as the kind of problem it is."""

from __future__ import annotations

import json

import pytest

from policies.keys import SigningKey
from sluicegate.metering.record import (
    SignedUsage,
    Usage,
    countersign,
    export_lines,
    sign_usage,
    to_line,
)
from sluicegate.metering.verify import Problem, Verification, verify_export
from tests.meter_kit import MINUTE, T0, Ledgers, day, meter_policy
from tests.policies.policy_testkit import key

POLICY = meter_policy()


def _lines(data: bytes) -> list[bytes]:
    return data.split(b"\n")[:-1]


def _join(lines: list[bytes]) -> bytes:
    return b"\n".join(lines) + b"\n"


def _check(lines: list[bytes] | bytes) -> Verification:
    data = lines if isinstance(lines, bytes) else _join(lines)
    return verify_export(data, POLICY)


def _kinds(v: Verification) -> set[str]:
    return {p.kind for p in v.problems}


def _of(v: Verification, kind: str) -> list[Problem]:
    return [p for p in v.problems if p.kind == kind]


def _line_of(lines: list[bytes], node: str, seq: int) -> int:
    """The index in ``lines`` of ``node``'s record ``seq``."""
    for i, raw in enumerate(lines):
        doc = json.loads(raw)
        if "record" in doc and (doc["record"]["node"], doc["record"]["seq"]) == (node, seq):
            return i
    raise LookupError((node, seq))


@pytest.fixture
def lines() -> list[bytes]:
    return _lines(day().export())


def test_an_intact_export_verifies(lines: list[bytes]) -> None:
    v = _check(lines)
    assert v.ok, v.problems
    assert len(v.records) == 13
    assert v.nodes == 5
    assert v.lines == 14
    assert v.manifest is not None
    assert v.manifest.broker == "broker-1"
    assert v.summary().startswith("OK 13 records from 5 nodes")


def test_a_time_range_need_not_start_at_seq_1() -> None:
    led = day()
    later = [s for s in led.records if s.record.at_ms >= T0 + MINUTE]
    v = _check(led.export(records=later, from_ms=T0 + MINUTE))
    assert v.ok, v.problems
    assert min(x.signed.record.seq for x in v.records if x.signed.record.node == "north-gpu-1") == 2


def test_an_export_signed_by_another_listed_broker_verifies() -> None:
    assert _check(day().export(broker="broker-2")).ok


def test_a_field_altered_breaks_the_node_signature(lines: list[bytes]) -> None:
    i = _line_of(lines, "north-gpu-1", 2)
    lines[i] = lines[i].replace(b'"device_us":15000', b'"device_us":1500')
    v = _check(lines)
    (altered,) = _of(v, "altered")
    assert (altered.line, altered.node, altered.seq) == (i + 1, "north-gpu-1", 2)
    assert "neither the signature of 'north-gpu-1'" in altered.message
    assert not _of(v, "removed")  # the next record's link to it: the same problem
    assert "sha256" in _of(v, "manifest")[0].message
    assert str(altered).startswith(f"line {i + 1} (north-gpu-1 #2): altered:")


def test_an_altered_record_re_signed_by_its_broker_still_fails_its_node_signature(
    lines: list[bytes],
) -> None:
    i = _line_of(lines, "north-l1-pc", 1)
    signed = json.loads(lines[i])
    signed["record"]["owner"] = "someone-else"
    # A broker (not the node) re-issues the record with a valid receipt and manifest.
    forged = SignedUsage.model_validate_json(json.dumps(signed))
    forged = countersign(forged, key("broker-1"), broker="broker-1", received_ms=T0)
    led = day()
    records = [
        forged if s.record.node == "north-l1-pc" and s.record.seq == 1 else s for s in led.records
    ]
    v = _check(led.export(records=records))
    assert {(p.kind, p.node, p.seq) for p in v.problems} >= {("altered", "north-l1-pc", 1)}


def test_a_record_removed_from_the_middle_of_a_node_is_a_gap(lines: list[bytes]) -> None:
    i = _line_of(lines, "north-gpu-1", 2)
    del lines[i]
    v = _check(lines)
    (gap,) = _of(v, "removed")
    assert gap.node == "north-gpu-1"
    assert gap.seq == 3
    assert "seq 2 missing" in gap.message
    assert _kinds(v) == {"removed", "manifest"}


def test_a_record_withheld_by_the_exporter_is_a_gap_under_a_valid_manifest() -> None:
    led = day()
    kept = [s for s in led.records if (s.record.node, s.record.seq) != ("north-gpu-1", 2)]
    v = _check(led.export(records=kept))
    assert _kinds(v) == {"removed"}
    assert v.problems[0].node == "north-gpu-1"


def test_a_nodes_last_record_removed_shows_against_its_head(lines: list[bytes]) -> None:
    i = _line_of(lines, "north-gpu-1", 3)
    del lines[i]
    v = _check(lines)
    (gone,) = _of(v, "removed")
    assert gone.node == "north-gpu-1"
    assert "seq 3 (the node's last) missing" in gone.message


def test_a_nodes_first_record_removed_shows_against_its_head(lines: list[bytes]) -> None:
    del lines[_line_of(lines, "north-l2-pc", 1)]
    (gone,) = _of(_check(lines), "removed")
    assert gone.node == "north-l2-pc"
    assert "seq 1 missing" in gone.message


def test_all_of_a_nodes_records_removed_shows_against_its_head(lines: list[bytes]) -> None:
    lines = [raw for raw in lines[:-1] if b'"node":"south-npu-1"' not in raw] + lines[-1:]
    (gone,) = _of(_check(lines), "removed")
    assert gone.node == "south-npu-1"
    assert gone.line is None
    assert "all its records" in gone.message


def test_a_record_forged_with_an_unknown_key_is_caught(lines: list[bytes]) -> None:
    led = Ledgers()
    rogue = led.ran("rogue-gpu", "j-x", line="north-l1-pc", attempt=1, at_ms=T0 + 1, device_ms=9)
    rogue = sign_usage(rogue.record, SigningKey.generate())
    rogue = countersign(rogue, key("broker-1"), broker="broker-1", received_ms=T0 + 2)
    lines.insert(-1, to_line(rogue))
    v = _check(lines)
    unknown = _of(v, "unknown-key")
    assert unknown
    assert unknown[0].node == "rogue-gpu"
    assert unknown[0].line == len(lines) - 1
    assert "not an edge or worker" in unknown[0].message
    assert any(p.kind == "inserted" and p.node == "rogue-gpu" for p in v.problems)


def test_a_record_forged_for_a_listed_node_is_caught(lines: list[bytes]) -> None:
    i = _line_of(lines, "north-gpu-2", 3)
    last = json.loads(lines[i])["record"]
    extra = Usage(**(last | {"seq": 4, "job_id": "j-forged", "device_us": 9_000_000}))
    forged = countersign(
        sign_usage(extra, SigningKey.generate()), key("broker-1"), broker="broker-1", received_ms=T0
    )
    lines.insert(i + 1, to_line(forged))
    v = _check(lines)
    assert ("altered", "north-gpu-2", 4) in {(p.kind, p.node, p.seq) for p in v.problems}
    assert ("inserted", "north-gpu-2", 4) in {(p.kind, p.node, p.seq) for p in v.problems}


def test_a_copy_of_another_record_inserted_is_a_repeat(lines: list[bytes]) -> None:
    copy = lines[_line_of(lines, "north-gpu-1", 1)]
    lines.insert(_line_of(lines, "north-l2-pc", 1), copy)
    v = _check(lines)
    (repeat,) = _of(v, "repeated")
    assert repeat.node == "north-gpu-1"
    assert repeat.seq == 1
    assert "first on line" in repeat.message
    assert len(v.records) == 13  # counted once


def test_a_repeated_line_is_caught(lines: list[bytes]) -> None:
    i = _line_of(lines, "north-l1-pc", 2)
    lines.insert(i + 1, lines[i])
    v = _check(lines)
    assert [(p.line, p.node, p.seq) for p in _of(v, "repeated")] == [(i + 2, "north-l1-pc", 2)]
    assert _kinds(v) == {"repeated", "manifest"}
    assert v.totals == {
        "lines": 15,
        "records": 13,
        "nodes": 5,
        "problems.repeated": 1,
        "problems.manifest": 1,
    }


def test_another_record_in_a_seqs_place_is_an_insertion(lines: list[bytes]) -> None:
    i = _line_of(lines, "north-l1-pc", 2)
    other = json.loads(lines[i])["record"] | {"job_id": "j-other"}
    twin = countersign(
        sign_usage(Usage(**other), key("north-l1-pc")),
        key("broker-1"),
        broker="broker-1",
        received_ms=T0,
    )
    lines.insert(i + 1, to_line(twin))
    v = _check(lines)
    assert ("inserted", i + 2) in {(p.kind, p.line) for p in v.problems}


def test_records_reordered_are_caught(lines: list[bytes]) -> None:
    i, j = _line_of(lines, "north-l1-pc", 1), _line_of(lines, "north-l1-pc", 3)
    lines[i], lines[j] = lines[j], lines[i]
    v = _check(lines)
    assert _of(v, "reordered")
    assert _of(v, "manifest")
    assert not _of(v, "removed")  # each chain still checks, in seq order


def test_the_manifest_removed_is_caught(lines: list[bytes]) -> None:
    v = _check(lines[:-1])
    (missing,) = _of(v, "manifest")
    assert "no manifest" in missing.message
    assert len(v.records) == 13


@pytest.mark.parametrize(
    ("field", "value"),
    [("records_sha256", "0" * 64), ("to_ms", T0), ("broker", "broker-2"), ("heads", [])],
)
def test_the_manifest_altered_is_caught(lines: list[bytes], field: str, value: object) -> None:
    doc = json.loads(lines[-1])
    doc["manifest"][field] = value
    lines[-1] = json.dumps(doc, separators=(",", ":")).encode()
    messages = [p.message for p in _of(_check(lines), "manifest")]
    assert any("signature" in m for m in messages), messages


def test_a_manifest_signed_by_an_unlisted_broker_is_caught() -> None:
    led = day()
    lines = export_lines(
        led.records,
        SigningKey.generate(),
        broker="broker-9",
        exported_ms=T0,
        from_ms=T0,
        to_ms=T0 + 60 * MINUTE,
    )
    (bad,) = _of(_check(lines), "manifest")
    assert "'broker-9'" in bad.message
    assert "broker-1, broker-2" in bad.message


def test_a_forged_receipt_is_caught(lines: list[bytes]) -> None:
    i = _line_of(lines, "north-gpu-2", 1)
    signed = json.loads(lines[i])
    bare = SignedUsage.model_validate_json(json.dumps(signed))
    lines[i] = to_line(countersign(bare, SigningKey.generate(), broker="broker-1", received_ms=T0))
    v = _check(lines)
    (bad,) = _of(v, "altered")
    assert (bad.node, bad.seq) == ("north-gpu-2", 1)
    assert "receipt" in bad.message


def test_a_receipt_by_an_unlisted_broker_is_caught(lines: list[bytes]) -> None:
    i = _line_of(lines, "north-gpu-2", 2)
    bare = SignedUsage.model_validate_json(lines[i])
    lines[i] = to_line(countersign(bare, key("broker-7"), broker="broker-7", received_ms=T0))
    (bad,) = _of(_check(lines), "unknown-key")
    assert "'broker-7'" in bad.message
    assert bad.seq == 2


def test_a_receipt_stripped_is_caught(lines: list[bytes]) -> None:
    i = _line_of(lines, "north-gpu-2", 2)
    doc = json.loads(lines[i])
    doc["receipt"] = None
    lines[i] = json.dumps(doc, separators=(",", ":")).encode()
    assert any("no broker receipt" in p.message for p in _of(_check(lines), "altered"))


def test_a_truncated_line_is_unreadable_and_its_record_missing(lines: list[bytes]) -> None:
    i = _line_of(lines, "north-gpu-1", 2)
    lines[i] = lines[i][: len(lines[i]) // 2]
    v = _check(lines)
    (cut,) = _of(v, "unreadable")
    assert cut.line == i + 1
    assert "not a record" in cut.message
    assert _of(v, "removed")[0].node == "north-gpu-1"


def test_a_file_cut_short_is_caught(lines: list[bytes]) -> None:
    data = _join(lines)
    v = _check(data[: len(data) - 200])
    assert {"unreadable", "manifest"} <= _kinds(v)


def test_a_node_in_another_role_is_caught(lines: list[bytes]) -> None:
    led = Ledgers()
    odd = led.add(
        "north-gpu-1",
        kind="edge",
        event="ran",
        job_id="j",
        attempt=0,
        line="north-l1-pc",
        at_ms=T0 + 5,
    )
    v = verify_export(led.export(records=[odd]), POLICY)
    (bad,) = _of(v, "unknown-key")
    assert "as a worker" in bad.message


def test_a_record_outside_the_period_is_caught() -> None:
    led = day()
    v = _check(led.export(from_ms=T0 + MINUTE))
    outside = _of(v, "inserted")
    assert outside
    assert all("outside the export's period" in p.message for p in outside)


@pytest.mark.parametrize(
    "data",
    [b"", b"\n", b"\x00\xff\xfe garbage", b"[1, 2]\n", b'{"manifest": 3}\n', b"{}\n{}\n" * 3],
)
def test_bad_input_is_an_answer_never_an_exception(data: bytes) -> None:
    v = verify_export(data, POLICY)
    assert not v.ok
    assert v.problems
    assert "NOT VERIFIED" in v.summary()
