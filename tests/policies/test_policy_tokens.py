"""Placement tokens: mint, verify, and every attack refused with its own reason."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import replace

import pytest
from policy_testkit import EXAMPLE, NOW, key

from policies.errors import (
    PlacementDenied,
    ReplayCacheFull,
    TokenBadSignature,
    TokenExpired,
    TokenLifetimeTooLong,
    TokenMalformed,
    TokenNotYetValid,
    TokenPayloadMismatch,
    TokenPolicyMismatch,
    TokenReplayed,
    TokenTooLarge,
    TokenUntrustedSigner,
    TokenWrongClass,
    TokenWrongJob,
    TokenWrongOrigin,
    TokenWrongTarget,
    TokenZoneDenied,
)
from policies.loader import load_policy, parse_policy
from policies.replay import (
    MemoryReplayCache,
    acheck_replay,
    acheck_replays,
    check_replay,
    replay_until,
)
from policies.tokens import (
    MAX_ENCODED,
    STRING_BUDGET,
    PlacementClaims,
    mint,
    payload_digest,
    peek,
    seal,
    verify,
)

POLICY = load_policy(EXAMPLE)
BROKER = key("broker-1")
IMAGE_A = b"\xff\xd8 wafer A \xff\xd9"
IMAGE_B = b"\xff\xd8 wafer B \xff\xd9"
NORTH_LINE = "campus/fab-north/line-1"


def _mint(**over: object) -> str:
    args: dict[str, object] = {
        "job_id": "job-a",
        "payload_sha256": payload_digest(IMAGE_A),
        "data_class": "wafer-image",
        "origin_zone": NORTH_LINE,
        "target_worker": "north-gpu-1",
        "now": NOW,
    }
    args.update(over)
    return mint(POLICY, BROKER, **args)  # type: ignore[arg-type]


def _verify(token: str, **over: object) -> PlacementClaims:
    args: dict[str, object] = {
        "now": NOW + 1,
        "job_id": "job-a",
        "payload_sha256": payload_digest(IMAGE_A),
        "worker_id": "north-gpu-1",
    }
    args.update(over)
    return verify(token, POLICY, **args)  # type: ignore[arg-type]


def _claims(**over: object) -> PlacementClaims:
    return replace(peek(_mint()), **over)  # type: ignore[arg-type]


def test_mint_then_verify_on_the_worker_and_on_the_edge() -> None:
    token = _mint()
    assert len(token) <= MAX_ENCODED
    claims = _verify(token, data_class="wafer-image", origin_zone=NORTH_LINE)
    assert claims.target_zone == "campus/fab-north/dc"
    assert claims.policy_version == POLICY.version
    assert claims.expires_at_ms - claims.issued_at_ms == 30_000
    assert claims.signer == BROKER.fingerprint
    edge_view = verify(
        token,
        POLICY,
        now=NOW,
        job_id="job-a",
        payload_sha256=payload_digest(IMAGE_A),
        origin_zone=NORTH_LINE,
    )
    assert edge_view == claims == peek(token)


def test_ocr_crops_may_go_offsite_but_wafer_images_may_not_be_minted_there() -> None:
    token = _mint(data_class="ocr-crop", target_worker="cloud-gpu-1")
    assert _verify(token, worker_id="cloud-gpu-1").target_zone == "offsite/cloud-east"
    with pytest.raises(PlacementDenied, match="deny wins"):
        _mint(target_worker="cloud-gpu-1")
    with pytest.raises(PlacementDenied, match="in no pool"):
        _mint(target_worker="ghost")


def test_attack_flipped_bit() -> None:
    raw = bytearray(base64.urlsafe_b64decode(_mint() + "=="))
    raw[40] ^= 0x01  # inside the payload hash
    flipped = base64.urlsafe_b64encode(bytes(raw)).rstrip(b"=").decode()
    with pytest.raises(TokenBadSignature) as info:
        _verify(flipped)
    assert info.value.reason == "token.bad_signature"


def test_attack_mix_and_match_token_of_job_a_on_job_b() -> None:
    token_a = _mint()
    with pytest.raises(TokenWrongJob, match="for job 'job-a', attached to job 'job-b'"):
        _verify(token_a, job_id="job-b", payload_sha256=payload_digest(IMAGE_B))


def test_attack_token_for_another_worker() -> None:
    with pytest.raises(TokenWrongTarget, match="this worker is 'north-gpu-2'"):
        _verify(_mint(), worker_id="north-gpu-2")


def test_attack_expired_and_not_yet_valid() -> None:
    token = _mint()
    skew = POLICY.max_skew_s
    assert _verify(token, now=NOW + 30 + skew)  # expiry plus allowed skew: still fine
    with pytest.raises(TokenExpired, match="expired"):
        _verify(token, now=NOW + 30 + skew + 0.01)
    assert _verify(token, now=NOW - skew)
    with pytest.raises(TokenNotYetValid, match="in the future"):
        _verify(token, now=NOW - skew - 0.01)


def test_attack_replayed_token() -> None:
    cache = MemoryReplayCache()
    claims = _verify(_mint())
    check_replay(cache, claims, POLICY, now=NOW)
    with pytest.raises(TokenReplayed, match=claims.nonce.hex()):
        check_replay(cache, claims, POLICY, now=NOW + 1)


async def _async_replay() -> None:
    class AsyncMemory:
        def __init__(self) -> None:
            self.inner = MemoryReplayCache()

        async def claim(self, nonce: bytes, until: float, now: float) -> bool:
            return self.inner.claim(nonce, until, now)

        async def claim_many(self, wanted: Sequence[tuple[bytes, float]], now: float) -> list[bool]:
            return [self.inner.claim(nonce, until, now) for nonce, until in wanted]

    cache = AsyncMemory()
    claims = _verify(_mint())
    await acheck_replay(cache, claims, POLICY, now=NOW)
    with pytest.raises(TokenReplayed):
        await acheck_replay(cache, claims, POLICY, now=NOW)
    (replayed,) = await acheck_replays(cache, [claims], POLICY, now=NOW)
    assert isinstance(replayed, TokenReplayed)


@pytest.mark.asyncio
async def test_async_replay_check() -> None:
    await _async_replay()


@pytest.mark.parametrize("signer", ["north-l1-pc", "officer-alice", "mallory"])
def test_attack_signed_by_a_key_not_trusted_for_the_broker_role(signer: str) -> None:
    forged = seal(_claims(), key(signer))
    with pytest.raises(TokenUntrustedSigner, match="trusts only broker signers") as info:
        _verify(forged)
    expect = "the key is unknown" if signer == "mallory" else f"'{signer}'"
    assert expect in str(info.value)


def test_minting_with_an_untrusted_key_is_refused() -> None:
    with pytest.raises(TokenUntrustedSigner, match="not a broker signer"):
        mint(
            POLICY,
            key("mallory"),
            job_id="j",
            payload_sha256=bytes(32),
            data_class="wafer-image",
            origin_zone=NORTH_LINE,
            target_worker="north-gpu-1",
            now=NOW,
        )


def test_attack_wrong_payload_hash() -> None:
    with pytest.raises(TokenPayloadMismatch, match="not the one placed"):
        _verify(_mint(), payload_sha256=payload_digest(IMAGE_B))


def test_attack_target_zone_the_policy_denies() -> None:
    # A compromised broker signs a wafer image for the off-site worker: the worker re-checks.
    rogue = seal(_claims(target_worker="cloud-gpu-1", target_zone="offsite/cloud-east"), BROKER)
    with pytest.raises(TokenZoneDenied, match="deny wins"):
        _verify(rogue, worker_id="cloud-gpu-1")


def test_zone_in_token_must_be_the_workers_zone() -> None:
    lying = seal(_claims(target_zone="campus/fab-south/dc"), BROKER)
    with pytest.raises(TokenWrongTarget, match="puts it in 'campus/fab-north/dc'"):
        _verify(lying)


def test_token_under_another_policy_version() -> None:
    newer = parse_policy(EXAMPLE.read_text().replace("version = 1", "version = 2"))
    with pytest.raises(TokenPolicyMismatch, match="v1"):
        verify(_mint(), newer, now=NOW, job_id="job-a", payload_sha256=payload_digest(IMAGE_A))


def test_wrong_class_and_wrong_origin() -> None:
    token = _mint()
    with pytest.raises(TokenWrongClass):
        _verify(token, data_class="ocr-crop")
    with pytest.raises(TokenWrongOrigin):
        _verify(token, origin_zone="campus/fab-south/line-1")


def test_lifetimes() -> None:
    with pytest.raises(TokenLifetimeTooLong, match="accepts 0 < ttl <= 60"):
        _mint(ttl_s=61)
    long_lived = seal(_claims(expires_at_ms=int(NOW * 1000) + 3_600_000), BROKER)
    with pytest.raises(TokenLifetimeTooLong):
        _verify(long_lived)
    with pytest.raises(ValueError, match="32 bytes"):
        _mint(payload_sha256=b"short")


def test_token_budget_is_enforced_at_mint() -> None:
    base = _claims()
    others = len(base.data_class + base.origin_zone + base.target_worker + base.target_zone)
    room = STRING_BUDGET - others
    fits = seal(replace(base, job_id="j" * room), BROKER)
    assert len(fits) == MAX_ENCODED
    assert peek(fits).job_id == "j" * room
    with pytest.raises(TokenTooLarge, match="room for 130 bytes"):
        seal(replace(base, job_id="j" * (room + 1)), BROKER)
    with pytest.raises(TokenTooLarge):
        seal(replace(base, job_id="", data_class="c" * 256), BROKER)


def _raw(claims: PlacementClaims, tail: bytes = b"") -> str:
    body = claims.body(BROKER.fingerprint) + tail
    raw = body + BROKER.sign(body)
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


@pytest.mark.parametrize(
    ("token", "expect"),
    [
        ("", "bytes starting"),
        ("A" * 401, "at most 400"),
        ("tökén", "at most 400"),
        ("not base64!", "not base64url"),
        (base64.urlsafe_b64encode(b"\x01" + bytes(200)).decode(), "version-2 token"),
        (_raw(_claims(job_id="x"), tail=b"\x00\x00"), "unexpected bytes"),
    ],
)
def test_malformed_tokens(token: str, expect: str) -> None:
    with pytest.raises(TokenMalformed, match=expect):
        _verify(token)


def test_malformed_string_fields() -> None:
    good = _raw(_claims())
    raw = bytearray(base64.urlsafe_b64decode(good + "=="))
    body_end = len(raw) - 64
    cut = bytes(raw[: body_end - 3])  # the last name is cut short
    with pytest.raises(TokenMalformed, match="target zone field is empty or cut short"):
        _verify(base64.urlsafe_b64encode(cut + bytes(64)).decode())
    bad_utf8 = bytearray(raw)
    bad_utf8[102] = 0xFF  # first byte of the job id
    with pytest.raises(TokenMalformed, match="job id field is not UTF-8"):
        _verify(base64.urlsafe_b64encode(bytes(bad_utf8)).decode())


def test_memory_replay_cache_is_bounded_and_fails_closed() -> None:
    cache = MemoryReplayCache(max_entries=2)
    assert cache.claim(b"a", until=10, now=0)
    assert cache.claim(b"b", until=20, now=0)
    assert not cache.claim(b"a", until=10, now=5)
    with pytest.raises(ReplayCacheFull, match="refusing rather than forgetting"):
        cache.claim(b"c", until=30, now=5)
    # Once 'a' has expired it is dropped first, making room.
    assert cache.claim(b"c", until=30, now=11)
    assert len(cache) == 2
    assert cache.claim(b"b", until=40, now=21)  # 'b' expired: a new token may reuse it
    with pytest.raises(ValueError, match="at least 1"):
        MemoryReplayCache(0)


def test_replay_window_covers_expiry_plus_skew() -> None:
    claims = peek(_mint())
    assert replay_until(claims, POLICY) == claims.expires_at_ms / 1000 + POLICY.max_skew_s
