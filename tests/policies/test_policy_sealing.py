"""Sealing keys in the policy, tokens that bind them, and the HPKE seal and open."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import pytest
from policy_testkit import EXAMPLE, NOW, key

from policies.check import check_policy
from policies.errors import (
    KeyFileError,
    SealOpenFailed,
    TokenNotSealed,
    TokenUnknownSealKey,
)
from policies.loader import load_policy, parse_policy
from policies.model import Policy
from policies.sealing import (
    NO_KEY,
    SEAL_OVERHEAD,
    SealingKey,
    decode_seal_key,
    load_sealing_key,
    open_sealed,
    seal,
    sealing_key_from_pem,
)
from policies.tokens import mint, payload_digest, peek, verify
from policies.tokens import seal as seal_token

BROKER = key("broker-1")
IMAGE = b"\xff\xd8 wafer \xff\xd9" * 100
NORTH_LINE = "campus/fab-north/line-1"


def _seal_key(name: str) -> SealingKey:
    return SealingKey.from_seed(hashlib.sha256(b"sluicegate-test-seal/" + name.encode()).digest())


GPU1_OLD, GPU1_NEW = _seal_key("north-gpu-1/1"), _seal_key("north-gpu-1/2")


def _policy(*, confidential: bool, keys: list[SealingKey]) -> Policy:
    text = EXAMPLE.read_text()
    listed = ", ".join(f'"{k.public_text}"' for k in keys)
    text = text.replace(
        "[pools.south-dc-npu]",
        f"[pools.north-dc-gpu.encryption_keys]\nnorth-gpu-1 = [{listed}]\n\n[pools.south-dc-npu]",
    )
    if confidential:
        text = text.replace(
            'description = "Raw wafer inspection images: trade secret, campus only"',
            'description = "Raw wafer inspection images: trade secret, campus only"\n'
            "confidential = true",
        )
    return parse_policy(text, source="test")


def _mint(policy: Policy, **over: object) -> str:
    args: dict[str, object] = {
        "job_id": "job-a",
        "payload_sha256": payload_digest(IMAGE),
        "data_class": "wafer-image",
        "origin_zone": NORTH_LINE,
        "target_worker": "north-gpu-1",
        "now": NOW,
    }
    args.update(over)
    return mint(policy, BROKER, **args)  # type: ignore[arg-type]


def test_policy_without_keys_keeps_its_digest_and_keys_change_it() -> None:
    plain = load_policy(EXAMPLE)
    sealed = _policy(confidential=True, keys=[GPU1_OLD])
    assert b"encryption_keys" not in plain.canonical
    assert b"confidential" not in plain.canonical
    assert sealed.digest != plain.digest
    assert sealed.seal_key("north-gpu-1", GPU1_OLD.key_id) == GPU1_OLD.public
    assert sealed.seal_key("north-gpu-2", GPU1_OLD.key_id) is None
    assert sealed.confidential("wafer-image")
    assert not sealed.confidential("ocr-crop")


def test_a_confidential_class_needs_a_sealing_key_at_mint() -> None:
    policy = _policy(confidential=True, keys=[GPU1_OLD])
    with pytest.raises(TokenNotSealed, match="confidential"):
        _mint(policy)
    with pytest.raises(TokenUnknownSealKey, match="not one policy v1 lists"):
        _mint(policy, seal_key_id=GPU1_NEW.key_id)
    token = _mint(policy, seal_key_id=GPU1_OLD.key_id)
    claims = verify(
        token, policy, now=NOW + 1, job_id="job-a", payload_sha256=None, worker_id="north-gpu-1"
    )
    assert claims.sealed
    assert claims.seal_key_id == GPU1_OLD.key_id


def test_verify_refuses_a_token_binding_a_key_the_policy_does_not_list() -> None:
    policy = _policy(confidential=True, keys=[GPU1_OLD])
    claims = peek(_mint(policy, seal_key_id=GPU1_OLD.key_id))
    for bound, error in ((GPU1_NEW.key_id, TokenUnknownSealKey), (NO_KEY, TokenNotSealed)):
        forged = seal_token(replace(claims, seal_key_id=bound), BROKER)  # signed, unchecked
        with pytest.raises(error):
            verify(
                forged,
                policy,
                now=NOW + 1,
                job_id="job-a",
                payload_sha256=payload_digest(IMAGE),
                worker_id="north-gpu-1",
            )
    with pytest.raises(TokenUnknownSealKey, match="listed: none"):
        _mint(policy, target_worker="north-gpu-2", seal_key_id=GPU1_OLD.key_id)


def test_plain_class_may_travel_in_the_clear() -> None:
    policy = _policy(confidential=False, keys=[GPU1_OLD])
    claims = peek(_mint(policy))
    assert claims.seal_key_id == NO_KEY
    assert not claims.sealed


def test_seal_opens_only_with_its_own_placement_and_key() -> None:
    policy = _policy(confidential=True, keys=[GPU1_OLD, GPU1_NEW])
    one = peek(_mint(policy, seal_key_id=GPU1_OLD.key_id))
    other = peek(_mint(policy, job_id="job-b", seal_key_id=GPU1_OLD.key_id))
    sealed = seal(GPU1_OLD.public, IMAGE, one.seal_info())
    assert len(sealed) == len(IMAGE) + SEAL_OVERHEAD
    assert IMAGE not in sealed
    assert open_sealed(GPU1_OLD, sealed, one.seal_info()) == IMAGE
    with pytest.raises(SealOpenFailed, match="another placement or key"):
        open_sealed(GPU1_OLD, sealed, other.seal_info())  # a token from another job
    with pytest.raises(SealOpenFailed):
        open_sealed(GPU1_NEW, sealed, one.seal_info())  # another key
    flipped = bytearray(sealed)
    flipped[100] ^= 1
    with pytest.raises(SealOpenFailed):
        open_sealed(GPU1_OLD, bytes(flipped), one.seal_info())
    with pytest.raises(SealOpenFailed, match="fewer than"):
        open_sealed(GPU1_OLD, b"short", one.seal_info())


def test_key_text_and_pem_round_trip_and_bad_text_is_named() -> None:
    assert decode_seal_key(GPU1_OLD.public_text) == GPU1_OLD.public
    assert sealing_key_from_pem(GPU1_OLD.to_pem(), source="t").key_id == GPU1_OLD.key_id
    with pytest.raises(ValueError, match="must start with 'x25519:'"):
        decode_seal_key(key("x").public_text)
    with pytest.raises(ValueError, match="all-zero"):
        decode_seal_key("x25519:" + "A" * 43)


@pytest.mark.parametrize(
    ("snippet", "expect"),
    [
        ('north-gpu-9 = ["{k}"]', "not a worker of pool"),
        ('north-gpu-1 = ["{k}", "{k}"]', "same encryption key twice"),
        ("north-gpu-1 = []", "at least 1"),
    ],
)
def test_bad_encryption_keys_tables_are_refused(snippet: str, expect: str) -> None:
    text = EXAMPLE.read_text().replace(
        "[pools.south-dc-npu]",
        "[pools.north-dc-gpu.encryption_keys]\n"
        + snippet.replace("{k}", GPU1_OLD.public_text)
        + "\n\n[pools.south-dc-npu]",
    )
    with pytest.raises(Exception, match=expect):
        parse_policy(text, source="test")


def test_canonical_form_lists_keys_once_normalised() -> None:
    policy = _policy(confidential=True, keys=[GPU1_OLD])
    assert GPU1_OLD.public_text.encode() in policy.canonical


def test_lint_warns_of_a_confidential_class_reaching_a_worker_with_no_key() -> None:
    findings = check_policy(_policy(confidential=True, keys=[GPU1_OLD]))
    bare = [f for f in findings if f.code == "confidential-no-seal-key"]
    # wafer-image may run anywhere on campus: north-gpu-2 and south-npu-1 list no key.
    assert {f.key for f in bare} == {
        "pools.north-dc-gpu.encryption_keys",
        "pools.south-dc-npu.encryption_keys",
    }
    assert "north-gpu-2" in bare[0].message
    assert not [
        f
        for f in check_policy(_policy(confidential=False, keys=[GPU1_OLD]))
        if f.code == "confidential-no-seal-key"
    ]


def test_key_files_and_their_errors(tmp_path: Path) -> None:
    made = SealingKey.generate()
    path = tmp_path / "seal.key"
    path.write_bytes(made.to_pem())
    assert load_sealing_key(path).public == made.public
    with pytest.raises(KeyFileError, match="cannot read key file"):
        load_sealing_key(tmp_path / "absent.key")
    with pytest.raises(KeyFileError, match="not an unencrypted PKCS#8 PEM"):
        sealing_key_from_pem(b"not a key", source="x")
    with pytest.raises(KeyFileError, match="expected an X25519 key"):
        sealing_key_from_pem(key("officer").to_pem(), source="x")
    with pytest.raises(ValueError, match="has 32 bytes, this one has 3"):
        decode_seal_key("x25519:AAAA")


def test_many_distinct_workers_keys_seal_without_growing_without_bound() -> None:
    policy = _policy(confidential=True, keys=[GPU1_OLD])
    claims = peek(_mint(policy, seal_key_id=GPU1_OLD.key_id))
    assert claims.token_id == claims.nonce
    assert len(claims.token_id) == 16
    for _ in range(4100):  # more keys than the cache holds: it starts again, still right
        seal(SealingKey.generate().public, b"x", claims.seal_info())
    assert (
        open_sealed(GPU1_OLD, seal(GPU1_OLD.public, IMAGE, claims.seal_info()), claims.seal_info())
        == IMAGE
    )
