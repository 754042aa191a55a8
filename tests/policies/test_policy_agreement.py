"""Bilateral agreements between campuses: each side's [peers] entry, its signed half, and
whether the two together are in force (policies.agreement)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from policy_testkit import (
    NOW,
    PARTS_TERMS,
    SITE_OFFICERS,
    base_doc,
    key,
    policy_of,
    site_doc,
    to_toml,
)
from typer.testing import CliRunner

from policies.agreement import (
    PeerBook,
    Statement,
    judge,
    own_half_problem,
    parse_statement,
    statement_for,
)
from policies.cli import app
from policies.errors import (
    AgreementBadSignature,
    AgreementReplayed,
    AgreementThresholdNotMet,
    AgreementUnknownSigner,
    AgreementWrongParties,
    PolicyParseError,
)
from policies.evaluate import allowed, explain, peer_origin
from policies.model import Policy

OFFICERS = SITE_OFFICERS
PARTS = PARTS_TERMS


def north(**changes: Any) -> Policy:
    doc = site_doc(
        "north-site",
        "south-site",
        send=PARTS,
        receive={},
    )
    doc.update(changes)
    return policy_of(doc)


def south(
    *, send: dict[str, Any] | None = None, receive: dict[str, Any] = PARTS, version: int = 1
) -> Policy:
    doc = site_doc(
        "south-site",
        "north-site",
        send=send or {},
        receive=receive,
        version=version,
    )
    return policy_of(doc)


def half(policy: Policy, peer: str, *officers: str) -> Statement:
    statement = statement_for(policy, peer)
    for name in officers:
        statement = statement.signed_by(key(name), name)
    return statement


def test_matching_halves_signed_by_each_sides_threshold_are_in_force() -> None:
    ours, theirs = north(), south()
    book = PeerBook()
    assert book.offer(ours, half(theirs, "north-site", "officer-dan", "officer-erin"))
    standing = book.judge(ours, "south-site", now=NOW)
    assert (standing.code, standing.version) == ("in_force", 1), standing.reason
    # And the other way round: south holds north's half.
    back = PeerBook()
    back.offer(theirs, half(ours, "south-site", "officer-alice", "officer-carol"))
    assert back.judge(theirs, "north-site", now=NOW).in_force


def test_a_half_survives_its_file_and_a_changed_byte_does_not() -> None:
    statement = half(south(), "north-site", "officer-dan", "officer-erin")
    again = parse_statement(statement.to_bytes(), source="south.agreement.json")
    assert again == statement
    assert PeerBook().offer(north(), again)
    tampered = statement.to_bytes().replace(b'"max_jobs_per_s": 50.0', b'"max_jobs_per_s": 500.0')
    assert tampered != statement.to_bytes()
    with pytest.raises(AgreementBadSignature, match="changed after it was written"):
        parse_statement(tampered, source="south.agreement.json")


def test_below_the_peers_threshold_nothing_is_in_force() -> None:
    book = PeerBook()
    with pytest.raises(AgreementThresholdNotMet, match="needs 2"):
        book.offer(north(), half(south(), "north-site", "officer-dan"))
    assert book.refused == {"agreement.threshold_not_met": 1}
    assert book.judge(north(), "south-site", now=NOW).code == "no_statement"


def test_a_key_the_entry_does_not_pin_is_refused_even_if_it_signs_well() -> None:
    # Our own officers cannot sign the peer's half for it.
    with pytest.raises(AgreementUnknownSigner, match="not one of the 2 officer keys"):
        PeerBook().offer(north(), half(south(), "north-site", "officer-dan", "officer-alice"))


def test_a_signature_over_other_terms_is_refused() -> None:
    signed = half(south(), "north-site", "officer-dan", "officer-erin")
    other = half(south(receive={**PARTS, "max_jobs_per_s": 5.0}), "north-site")
    forged = Statement(
        other.campus,
        other.peer,
        other.version,
        other.expires,
        other.send,
        other.receive,
        signed.signatures,
    )
    with pytest.raises(AgreementBadSignature, match="does not verify"):
        PeerBook().offer(north(), forged)


def test_a_half_for_another_campus_or_from_an_unlisted_one_is_refused() -> None:
    theirs = half(south(), "north-site", "officer-dan", "officer-erin")
    stranger = north(campus="west-site")
    with pytest.raises(AgreementWrongParties, match="addressed to 'north-site'"):
        PeerBook().offer(stranger, theirs)
    lonely = north(peers={})
    with pytest.raises(AgreementWrongParties, match="does not list"):
        PeerBook().offer(lonely, theirs)


def test_terms_that_do_not_mirror_name_each_field_that_differs() -> None:
    fewer = south(receive={**PARTS, "max_jobs_per_s": 20.0, "device_second": 0.003})
    book = PeerBook()
    book.offer(north(), half(fewer, "north-site", "officer-dan", "officer-erin"))
    standing = book.judge(north(), "south-site", now=NOW)
    assert standing.code == "mismatch"
    assert "send max_jobs_per_s: 50.0 vs 20.0" in standing.reason
    assert "send device_second: 0.002 vs 0.003" in standing.reason
    assert "classes" not in standing.reason


def test_a_withdrawal_replaces_the_half_and_an_older_half_is_a_replay() -> None:
    ours = north()
    book = PeerBook()
    v1 = half(south(), "north-site", "officer-dan", "officer-erin")
    book.offer(ours, v1)
    assert book.judge(ours, "south-site", now=NOW).in_force
    withdrawn = statement_for(_south_without_peers(version=2), "north-site")
    withdrawn = withdrawn.signed_by(key("officer-dan"), "dan").signed_by(key("officer-erin"), "e")
    assert withdrawn.withdrawn
    assert book.offer(ours, withdrawn)
    standing = book.judge(ours, "south-site", now=NOW)
    assert (standing.code, standing.version) == ("withdrawn", 2)
    with pytest.raises(AgreementReplayed, match="older than the v2"):
        book.offer(ours, v1)
    assert book.judge(ours, "south-site", now=NOW).code == "withdrawn"
    assert book.refused == {"agreement.replayed": 1}
    assert not book.offer(ours, withdrawn)  # the same half again changes nothing


def _south_without_peers(*, version: int) -> Policy:
    doc = site_doc(
        "south-site",
        "north-site",
        send={},
        receive=PARTS,
        version=version,
    )
    doc["peers"] = {}
    return policy_of(doc)


def test_a_half_that_expired_is_not_in_force() -> None:
    book = PeerBook()
    book.offer(north(), half(south(), "north-site", "officer-dan", "officer-erin"))
    later = south().expires + 1.0
    assert book.judge(north(), "south-site", now=later).code == "expired"


def test_our_own_policy_without_the_peer_holds_nothing_in_force() -> None:
    theirs = half(south(), "north-site", "officer-dan", "officer-erin")
    assert judge(north(peers={}), "south-site", theirs, now=NOW).code == "not_listed"


def test_the_same_version_with_other_terms_is_refused() -> None:
    book = PeerBook()
    book.offer(north(), half(south(), "north-site", "officer-dan", "officer-erin"))
    other = half(
        south(receive={**PARTS, "max_jobs_per_s": 9.0}), "north-site", "officer-dan", "officer-erin"
    )
    with pytest.raises(AgreementReplayed, match="other terms"):
        book.offer(north(), other)


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ({"classes": ["no-such-class"]}, "peers.south-site.send.classes[0]"),
        ({"zones": ["campus/fab-north/dc"]}, "peers.south-site.send.zones[0]"),
    ],
)
def test_an_entry_that_names_what_the_policy_does_not_have_is_refused(
    change: dict[str, Any], where: str
) -> None:
    doc = site_doc(
        "north-site",
        "south-site",
        send=PARTS,
        receive={},
    )
    doc["peers"]["south-site"]["send"].update(change)
    with pytest.raises(PolicyParseError) as caught:
        policy_of(doc)
    assert where in str(caught.value)


def test_a_campus_is_not_its_own_peer_and_an_officer_threshold_must_be_reachable() -> None:
    doc = site_doc(
        "north-site",
        "south-site",
        send=PARTS,
        receive={},
    )
    doc["peers"]["north-site"] = doc["peers"].pop("south-site")
    with pytest.raises(PolicyParseError, match="not its own peer"):
        policy_of(doc)
    doc["peers"]["south-site"] = doc["peers"].pop("north-site")
    doc["peers"]["south-site"]["officers"]["threshold"] = 3
    with pytest.raises(PolicyParseError, match="can never be met"):
        policy_of(doc)


def test_a_policy_without_peers_keeps_its_digest() -> None:
    doc = base_doc()
    plain = policy_of(doc)
    assert policy_of({**doc, "peers": {}}).digest == plain.digest
    assert north().digest != north(peers={}).digest


def _write(tmp_path: Path, name: str, doc: dict[str, Any]) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(to_toml(doc))
    return path


def _key_file(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.key"
    path.write_bytes(key(name).to_pem())
    path.chmod(0o600)
    return path


def _peer_sign(tmp_path: Path, policy_file: Path, peer: str, officer: str) -> tuple[int, str]:
    """``policy peer-sign`` with ``officer``'s published test key."""
    return _cli("peer-sign", policy_file, "--peer", peer, "--key", _key_file(tmp_path, officer))


def _cli(*args: str | Path) -> tuple[int, str]:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


def test_officers_sign_their_halves_and_each_side_checks_the_other_s(tmp_path: Path) -> None:
    at = "2026-05-28T00:00:00Z"
    north_doc = site_doc(
        "north-site",
        "south-site",
        send=PARTS,
        receive={},
    )
    south_doc = site_doc(
        "south-site",
        "north-site",
        send={},
        receive=PARTS,
    )
    north_file, south_file = (
        _write(tmp_path, "north", north_doc),
        _write(tmp_path, "south", south_doc),
    )
    code, out = _peer_sign(tmp_path, south_file, "north-site", "officer-dan")
    assert code == 0, out
    assert "1 of 2 officer keys" in out
    half_file = tmp_path / "south-site.to-north-site.agreement.json"
    code, out = _cli("peer-check", north_file, half_file, "--now", at)
    assert code == 1
    assert "agreement.threshold_not_met" in out
    code, out = _peer_sign(tmp_path, south_file, "north-site", "officer-erin")
    assert code == 0, out
    assert "2 of 2 officer keys" in out
    code, out = _cli("peer-check", north_file, half_file, "--now", at)
    assert (code, out.split(":")[0]) == (0, "in_force"), out
    # South's officers withdraw with v2: the same file now says so, and north sees it.
    south_doc.update(version=2, peers={})
    south_file.write_text(to_toml(south_doc))
    for officer in ("officer-dan", "officer-erin"):
        code, out = _peer_sign(tmp_path, south_file, "north-site", officer)
        assert code == 0, out
    assert "a withdrawal" in out
    code, out = _cli("peer-check", north_file, half_file, "--now", at)
    assert code == 1
    assert out.startswith("withdrawn: 'south-site' withdrew at its v2"), out


def test_only_our_own_half_with_the_terms_in_force_and_our_threshold_is_published() -> None:
    ours = north()
    good = half(ours, "south-site", "officer-alice", "officer-bob")
    assert own_half_problem(ours, good) is None
    theirs = half(south(), "north-site", "officer-dan", "officer-erin")
    assert "it is 'south-site''s half" in (own_half_problem(ours, theirs) or "")
    changed = north(peers={})  # the entry is gone: the v1 half would say what no longer holds
    assert "says a withdrawal for 'south-site'" in (own_half_problem(changed, good) or "")
    other = policy_of(
        site_doc("north-site", "south-site", send={**PARTS, "max_jobs_per_s": 1.0}, receive={})
    )
    assert "says other terms" in (own_half_problem(other, good) or "")
    one = half(ours, "south-site", "officer-alice")
    assert "carries 1 of the 2 officer signatures" in (own_half_problem(ours, one) or "")


def test_a_peers_job_is_explained_in_words() -> None:
    theirs = south()
    verdict = allowed(theirs, "ocr-crop", peer_origin("north-site"), "campus/south-site/dc")
    assert str(verdict).endswith("allowed by the agreement with that campus (its receive terms)")
    denied = allowed(theirs, "wafer-image", peer_origin("north-site"), "campus/south-site/dc")
    assert str(denied).endswith("denied: the agreement with that campus does not list it")
    lines = explain(theirs, "ocr-crop", peer_origin("north-site"), "campus/south-site/dc")
    assert any("comes from sister campus 'north-site'" in line for line in lines)
    assert not any("is not declared" in line for line in lines)  # a peer is no zone of ours


def test_peer_sign_says_when_the_key_signs_nothing_of_this_policy(tmp_path: Path) -> None:
    doc = site_doc("north-site", "south-site", send=PARTS, receive={})
    code, out = _peer_sign(tmp_path, _write(tmp_path, "north", doc), "south-site", "officer-dan")
    assert code == 0, out
    assert "0 of 2 officer keys" in out
    assert "not a signer of this policy: the peer will refuse it" in out
