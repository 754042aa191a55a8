"""The audit log: chained, signed records; tampering is found at the right record."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from policy_testkit import NOW, key

from policies.audit import (
    DOMAIN,
    MAX_RECORD_BYTES,
    AuditWriter,
    decode_record,
    entry_digest,
    next_record,
    refusal_data,
    verify_chain,
)
from policies.audit_file import FileAuditStore
from policies.errors import (
    AuditChainBroken,
    AuditError,
    AuditLogUnreadable,
    AuditUntrustedSigner,
    TokenReplayed,
)

BROKER = key("broker-1")
TRUSTED = {BROKER.public}


def _log(tmp_path: Path, n: int = 6, *, fsync: bool = False) -> FileAuditStore:
    store = FileAuditStore(tmp_path / "audit.log", fsync=fsync)
    writer = AuditWriter(store, BROKER)
    for i in range(n):
        kind = "decision" if i % 2 == 0 else "refusal"
        writer.append(kind, {"job": f"job-{i}", "worker": "north-gpu-1", "n": i}, now=NOW + i)
    return store


def _lines(store: FileAuditStore) -> list[bytes]:
    return list(store.entries())


def _broken(entries: list[bytes]) -> AuditChainBroken:
    with pytest.raises(AuditChainBroken) as info:
        verify_chain(entries, TRUSTED)
    return info.value


def test_a_written_log_verifies(tmp_path: Path) -> None:
    store = _log(tmp_path, fsync=True)
    summary = verify_chain(store.entries(), TRUSTED)
    assert summary.count == 6
    assert summary.signers == {BROKER.public}
    assert summary.head == decode_record(_lines(store)[-1]).hash
    assert verify_chain(store.entries(), TRUSTED, expected_head=summary.head).count == 6
    # A second writer on the same file continues the chain from its last record.
    AuditWriter(store, BROKER).append("decision", {"job": "job-6"}, now=NOW + 6)
    assert verify_chain(store.entries(), TRUSTED).count == 7


def test_a_log_verified_in_steps_equals_one_pass(tmp_path: Path) -> None:
    lines = _lines(_log(tmp_path, 7))
    whole = verify_chain(lines, TRUSTED)
    first = verify_chain(lines[:3], TRUSTED)
    assert verify_chain(lines[3:], TRUSTED, after=first) == whole
    assert verify_chain([], TRUSTED, after=whole, expected_head=whole.head) == whole
    # A continuation that skips a record, or starts from another head, is found.
    with pytest.raises(AuditChainBroken) as info:
        verify_chain(lines[4:], TRUSTED, after=first)
    assert (info.value.index, info.value.problem) == (3, "sequence")
    other = replace(first, head=bytes(32))
    with pytest.raises(AuditChainBroken) as info:
        verify_chain(lines[3:], TRUSTED, after=other)
    assert (info.value.index, info.value.problem) == (3, "broken-link")


def test_attack_deleting_a_record_is_found_at_its_position(tmp_path: Path) -> None:
    lines = _lines(_log(tmp_path))
    err = _broken(lines[:3] + lines[4:])
    assert (err.index, err.problem) == (3, "sequence")
    assert "has seq 4, expected 3" in str(err)
    first = _broken(lines[1:])
    assert (first.index, first.problem) == (0, "sequence")


def test_attack_reordering_records_is_found_at_the_first_moved(tmp_path: Path) -> None:
    lines = _lines(_log(tmp_path))
    swapped = [*lines[:2], lines[3], lines[2], *lines[4:]]
    err = _broken(swapped)
    assert (err.index, err.problem) == (2, "sequence")


def test_attack_editing_a_record_is_found_at_that_record(tmp_path: Path) -> None:
    lines = _lines(_log(tmp_path))
    doc = json.loads(lines[4])
    doc["data"]["worker"] = "cloud-gpu-1"
    lines[4] = json.dumps(doc).encode()
    err = _broken(lines)
    assert (err.index, err.problem) == (4, "bad-signature")
    assert str(err).startswith("record 4:")


def test_a_re_signed_replacement_breaks_the_next_link(tmp_path: Path) -> None:
    lines = _lines(_log(tmp_path))
    original = decode_record(lines[2])
    forged = replace(original, data={"job": "other"}, signature=b"")
    forged = replace(forged, signature=BROKER.sign(DOMAIN + forged.hash))
    lines[2] = forged.encode()
    err = _broken(lines)
    assert (err.index, err.problem) == (3, "broken-link")


def test_a_witnessed_record_skips_only_its_signature_and_only_as_stored(tmp_path: Path) -> None:
    """A record whose stored bytes have the digest its writer kept is not signature-checked
    again; any other byte in it, or any other record, is checked as ever."""
    lines = _lines(_log(tmp_path))
    witnessed = {i: entry_digest(line) for i, line in enumerate(lines)}
    assert verify_chain(lines, TRUSTED, witnessed=witnessed) == verify_chain(lines, TRUSTED)
    # The signature is what is skipped: bytes stored with a bad one pass, if witnessed so.
    doc = json.loads(lines[3])
    doc["sig"] = doc["sig"][::-1]
    bad_sig = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
    assert (
        verify_chain(
            [*lines[:3], bad_sig, *lines[4:]],
            TRUSTED,
            witnessed=witnessed | {3: entry_digest(bad_sig)},
        ).count
        == 6
    )
    # Stored bytes other than the witnessed ones: signature-checked, the edit found.
    err = _broken_witnessed([*lines[:3], bad_sig, *lines[4:]], witnessed)
    assert (err.index, err.problem) == (3, "bad-signature")
    doc = json.loads(lines[4])
    doc["data"]["worker"] = "cloud-gpu-1"
    err = _broken_witnessed([*lines[:4], json.dumps(doc).encode(), lines[5]], witnessed)
    assert (err.index, err.problem) == (4, "bad-signature")
    # A witnessed digest at another position stands for nothing; nor is the signer trusted.
    shifted = {i + 1: d for i, d in witnessed.items()}
    assert _broken_witnessed([*lines[:3], bad_sig, *lines[4:]], shifted).problem == "bad-signature"
    with pytest.raises(AuditUntrustedSigner):
        verify_chain(lines, {key("other").public}, witnessed=witnessed)


def _broken_witnessed(entries: list[bytes], witnessed: dict[int, bytes]) -> AuditChainBroken:
    with pytest.raises(AuditChainBroken) as info:
        verify_chain(entries, TRUSTED, witnessed=witnessed)
    return info.value


def test_a_log_checked_with_another_key_is_an_untrusted_signer_not_a_broken_chain(
    tmp_path: Path,
) -> None:
    lines = _lines(_log(tmp_path))
    broker, other = BROKER.fingerprint.hex(), key("mallory").fingerprint.hex()
    with pytest.raises(AuditUntrustedSigner) as info:
        verify_chain(lines, {key("mallory").public})
    assert (info.value.reason, info.value.index, info.value.signer) == (
        "audit.untrusted_signer",
        0,
        BROKER.public,
    )
    assert str(info.value) == (
        f"record 0: (seq 0) signed by key {broker}, which is not trusted; trusted: {other}"
    )
    many = {key(f"k{i}").public for i in range(10)}
    with pytest.raises(AuditUntrustedSigner, match=r"trusted: [0-9a-f, ]+ and 2 more$"):
        verify_chain(lines, many)
    # A record added by another key in the middle of a trusted log is found where it is.
    intruder = AuditWriter(FileAuditStore(tmp_path / "audit.log"), key("mallory"))
    intruder.append("decision", {"job": "job-6"}, now=NOW + 6)
    with pytest.raises(AuditUntrustedSigner, match=f"record 6: .* key {other},") as info:
        verify_chain(_lines(FileAuditStore(tmp_path / "audit.log")), TRUSTED)
    assert info.value.index == 6


def test_unreadable_and_truncated(tmp_path: Path) -> None:
    lines = _lines(_log(tmp_path))
    garbage = _broken([*lines[:2], b"{not json", *lines[3:]])
    assert (garbage.index, garbage.problem) == (2, "unreadable")
    head = verify_chain(lines, TRUSTED).head
    with pytest.raises(AuditChainBroken, match="cut off the end") as info:
        verify_chain(lines[:-1], TRUSTED, expected_head=head)
    assert (info.value.index, info.value.problem) == (5, "truncated")


@pytest.mark.parametrize(
    ("entry", "expect"),
    [
        (b"x" * (MAX_RECORD_BYTES + 1), "at most"),
        (b"[" * 16_000, "nested too deeply"),
        (b'{"seq": 1}', "field"),
        (b"\xff", "codec"),
    ],
)
def test_unreadable_records(entry: bytes, expect: str) -> None:
    with pytest.raises(ValueError, match=expect):
        decode_record(entry)


def test_records_refuse_values_that_cannot_be_read_back() -> None:
    with pytest.raises(ValueError, match="finite"):
        next_record(None, "decision", {"x": float("nan")}, now=NOW, key=BROKER)
    with pytest.raises(ValueError, match="kind"):
        next_record(None, "Bad Kind", {}, now=NOW, key=BROKER)


def test_file_store_edges(tmp_path: Path) -> None:
    store = FileAuditStore(tmp_path / "none.log")
    assert store.last() is None  # a writer starts a new log
    with pytest.raises(AuditLogUnreadable, match=r"none\.log: cannot read: No such file"):
        list(store.entries())  # a reader was given a wrong path
    with pytest.raises(AuditError, match="newline"):
        store.append(0, b"a\nb")
    with pytest.raises(AuditError, match="cannot append"):
        FileAuditStore(tmp_path / "no-dir" / "x.log").append(0, b"{}")


def test_writer_refuses_to_continue_after_a_torn_last_line(tmp_path: Path) -> None:
    store = _log(tmp_path, n=2)
    with store.path.open("ab") as handle:
        handle.write(b'{"seq": 2, "t"')  # a crash in the middle of a write
    with pytest.raises(AuditError, match="last record is unreadable"):
        AuditWriter(store, BROKER).append("decision", {}, now=NOW)
    assert _broken(_lines(store)).index == 2


def test_refusal_data_carries_the_reason_code() -> None:
    data = refusal_data(TokenReplayed("nonce 00 was already used"), job="job-1")
    assert data == {
        "reason": "token.replayed",
        "message": "nonce 00 was already used",
        "job": "job-1",
    }
