"""An edge's check of a placement a sister campus's broker signed (policies.tokens.
verify_peer): the peer's broker key its own policy pins, the job, the payload, the class and
zones its send terms list, its own campus as the origin, and sealing where its own policy
marks the class confidential."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from policy_testkit import NOW, PARTS_TERMS, key, policy_of, site_doc

from policies.errors import (
    TokenBadSignature,
    TokenExpired,
    TokenNotSealed,
    TokenPayloadMismatch,
    TokenUntrustedSigner,
    TokenWrongClass,
    TokenWrongJob,
    TokenWrongOrigin,
    TokenZoneDenied,
)
from policies.evaluate import peer_of_origin, peer_origin
from policies.model import Policy
from policies.sealing import SealingKey
from policies.tokens import mint, payload_digest, verify_peer

IMAGE = b"a crop of a serial number"
NORTH, SOUTH = "north-site", "south-site"
SEAL = SealingKey.from_seed(hashlib.sha256(b"south-gpu-1 seal").digest())


def north(**send: Any) -> Policy:
    return policy_of(site_doc(NORTH, SOUTH, send={**PARTS_TERMS, **send}, receive={}))


def south(*, sealed: bool = False) -> Policy:
    doc = site_doc(SOUTH, NORTH, send={}, receive=PARTS_TERMS)
    if sealed:
        pool = doc["pools"][f"{SOUTH}-dc"]
        pool["encryption_keys"] = {f"{SOUTH}-gpu-1": [SEAL.public_text]}
    return policy_of(doc)


def south_token(**over: Any) -> str:
    """A placement south's broker signs for north's job, as it does for a peer's ask."""
    args: dict[str, Any] = {
        "job_id": "job-1",
        "payload_sha256": payload_digest(IMAGE),
        "data_class": "ocr-crop",
        "origin_zone": peer_origin(NORTH),
        "target_worker": f"{SOUTH}-gpu-1",
        "now": NOW,
    }
    policy = over.pop("policy", None) or south()
    signer = over.pop("signer", None) or key(f"{SOUTH}-broker-1")
    args.update(over)
    return mint(policy, signer, **args)


def check(token: str, policy: Policy | None = None, **over: Any) -> Any:
    args: dict[str, Any] = {
        "now": NOW + 1,
        "job_id": "job-1",
        "payload_sha256": payload_digest(IMAGE),
        "data_class": "ocr-crop",
    }
    args.update(over)
    peer = args.pop("peer", SOUTH)
    return verify_peer(token, policy or north(), peer, **args)


def test_a_placement_the_peer_signed_inside_the_terms_is_trusted() -> None:
    claims = check(south_token())
    assert claims.target_worker == f"{SOUTH}-gpu-1"
    assert claims.target_zone == "campus/south-site/dc"
    assert claims.origin_zone == "peer:north-site"
    assert not claims.sealed


def test_a_sealed_placement_binds_the_peer_workers_key() -> None:
    claims = check(south_token(policy=south(sealed=True), seal_key_id=SEAL.key_id))
    assert claims.sealed
    assert claims.seal_key_id == SEAL.key_id


@pytest.mark.parametrize(
    ("token_over", "check_over", "error", "words"),
    [
        ({}, {"peer": "east-site"}, TokenUntrustedSigner, "no such sister campus"),
        ({"signer": key("north-site-broker-1")}, {}, TokenUntrustedSigner, "south-site-broker-1"),
        ({}, {"now": NOW + 3600}, TokenExpired, "expired"),
        ({}, {"job_id": "job-2"}, TokenWrongJob, "job-2"),
        ({}, {"payload_sha256": payload_digest(b"another")}, TokenPayloadMismatch, "not the one"),
        ({}, {"data_class": "wafer-image"}, TokenWrongClass, "wafer-image"),
        # one of south's own jobs: its placement is no placement of north's job
        ({"origin_zone": "campus/south-site/dc"}, {}, TokenWrongOrigin, "peer:north-site"),
    ],
)
def test_what_does_not_fit_the_job_or_the_peer_is_refused(
    token_over: dict[str, Any], check_over: dict[str, Any], error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        check(south_token(**token_over), **check_over)


def test_a_token_altered_after_signing_is_refused() -> None:
    token = south_token()
    chars = list(token)
    chars[-10] = "A" if chars[-10] != "A" else "B"  # inside the signature
    with pytest.raises(TokenBadSignature):
        check("".join(chars))


def test_a_class_or_zone_the_send_terms_do_not_list_is_refused() -> None:
    token = south_token()
    with pytest.raises(TokenZoneDenied, match="sends it classes"):
        check(token, north(classes=["wafer-image"]))


def test_a_class_this_campus_keeps_confidential_must_come_sealed() -> None:
    doc = site_doc(NORTH, SOUTH, send=PARTS_TERMS, receive={})
    doc["classes"]["ocr-crop"]["confidential"] = True
    with pytest.raises(TokenNotSealed, match="binds no sealing key"):
        check(south_token(), policy_of(doc))


def test_which_peers_a_campus_sends_to_and_which_run_here() -> None:
    assert north().peers_out() == (SOUTH,)
    assert north().peers_into("campus/north-site/dc") == ()  # it receives no class
    assert south().peers_out() == ()
    assert south().peers_into("campus/south-site/dc") == (NORTH,)
    assert south().peers_into("campus/fab-north/dc") == ()


def test_the_campus_a_peer_origin_names() -> None:
    assert peer_of_origin(peer_origin(NORTH)) == NORTH
    assert peer_of_origin("campus/north-site/dc") == ""
