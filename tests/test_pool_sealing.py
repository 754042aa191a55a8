"""Sealed work, pure tier: the worker's key ring rules, intake's seal refusals in their order,
the broker's choice of the key a token binds, and the edge sealing what it sends.

No processes, no network: the policy is the testkit's with sealing keys listed for
``north-gpu-1``; keys come from fixed seeds.
"""

from __future__ import annotations

import hashlib
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from broker.core.decision import Placed, Refused
from broker.core.placement import decide
from broker.core.reference import decide_reference
from broker.core.sealing import SealUnavailable, seal_binding
from center_pool.intake import Work, WorkRefusal, check_token, open_work, read_work
from center_pool.seal_keys import HeldKey, KeyFolder, SealKeys, plan
from edge_agent.admission import Job
from edge_agent.offload import PlacementClient, check_placement
from edge_agent.rules import Placement
from policies import PlacementClaims, Policy, mint, payload_digest, verify
from policies.sealing import NO_KEY, SealingKey, open_sealed, seal
from policies.tokens import peek
from sluicegate import topics
from sluicegate.transport import Message
from sluicegate.vision.image import ImageInfo
from sluicegate.vision.image import PayloadLimits as Limits
from sluicegate.wire_pool import PlacementReply
from tests import test_broker_core_kit as kit
from tests.policies.policy_testkit import policy_of
from tests.pool_kit import BROKER, DATA_CLASS, EDGE, JPEG, ORIGIN, WORKER, WORKER_ZONE, policy_doc
from tests.test_broker_core_kit import campus_policy, caps, fleet_with, request


def _key(name: str) -> SealingKey:
    return SealingKey.from_seed(hashlib.sha256(b"sluicegate-test-seal/" + name.encode()).digest())


OLD, NEW, STRAY = _key("old"), _key("new"), _key("stray")
LIMITS = Limits(8 * 1024 * 1024, 40_000_000, 10_000)


def _policy(*keys: SealingKey, confidential: bool = True) -> Policy:
    doc: dict[str, Any] = policy_doc(1)
    if keys:
        doc["pools"]["north-dc"]["encryption_keys"] = {WORKER: [k.public_text for k in keys]}
    doc["classes"][DATA_CLASS]["confidential"] = confidential
    return policy_of(doc)


SEALED_POLICY = _policy(OLD, NEW)
NOW = time.time()


def _token(policy: Policy, job_id: str, key_id: bytes, payload: bytes = JPEG) -> str:
    return mint(
        policy,
        BROKER,
        job_id=job_id,
        payload_sha256=payload_digest(payload),
        data_class=DATA_CLASS,
        origin_zone=ORIGIN,
        target_worker=WORKER,
        now=NOW,
        seal_key_id=key_id,
    )


def _claims(token: str) -> PlacementClaims:
    return verify(token, SEALED_POLICY, now=NOW, job_id=peek(token).job_id, payload_sha256=None)


def _work(
    job_id: str, token: str, payload: bytes, *, sealed: bool = True, suite: str | None = None
) -> Work | WorkRefusal:
    props = [
        (topics.PROP_JOB_ID, job_id),
        (topics.PROP_MODEL, "defect-v1"),
        (topics.PROP_DATA_CLASS, DATA_CLASS),
        (topics.PROP_TOKEN, token),
    ]
    if sealed:
        props += [
            (topics.PROP_SEALED, suite or topics.SEAL_SUITE),
            (topics.PROP_INNER_CONTENT_TYPE, "image/jpeg"),
        ]
    msg = Message(
        topics.pool_work(WORKER_ZONE, WORKER, EDGE),
        payload,
        content_type=topics.SEALED_CONTENT_TYPE if sealed else "image/jpeg",
        user_properties=tuple(props),
    )
    return read_work(msg, limits=LIMITS, now=NOW, worker_id=WORKER)


def _sealed_work(job_id: str, key: SealingKey, payload: bytes = JPEG) -> tuple[Work, str]:
    token = _token(SEALED_POLICY, job_id, key.key_id, payload)
    box = seal(key.public, payload, _claims(token).seal_info())
    work = _work(job_id, token, box)
    assert isinstance(work, Work)
    return work, token


RING = {OLD.key_id: OLD, NEW.key_id: NEW}


def _screen(work: Work, keys: dict[bytes, SealingKey] = RING) -> Work | WorkRefusal:
    claims = check_token(work, SEALED_POLICY, now=NOW, worker_id=WORKER, keys=keys)
    if isinstance(claims, WorkRefusal):
        return claims
    return open_work(work, claims, keys, worker_id=WORKER)


# -- intake ---------------------------------------------------------------------------------


def test_a_sealed_image_opens_to_the_plaintext_and_its_own_content_type() -> None:
    work, _ = _sealed_work("job-a", NEW)
    assert JPEG not in work.payload
    opened = _screen(work)
    assert isinstance(opened, Work)
    assert opened.payload == JPEG
    assert opened.content_type == "image/jpeg"


def test_a_key_kept_after_rotation_still_opens_its_tokens() -> None:
    work, _ = _sealed_work("job-old", OLD)
    opened = _screen(work)
    assert isinstance(opened, Work)
    assert opened.payload == JPEG


def _refusal(result: object) -> tuple[str, bool]:
    assert isinstance(result, WorkRefusal), result
    return result.code, result.token_passed


def test_a_clear_image_under_a_sealed_token_is_refused_seal_required() -> None:
    token = _token(SEALED_POLICY, "job-b", NEW.key_id)
    work = _work("job-b", token, JPEG, sealed=False)
    assert isinstance(work, Work)
    assert _refusal(_screen(work)) == ("seal.required", False)


def test_a_sealed_image_under_a_clear_token_is_refused_seal_unexpected() -> None:
    policy = _policy(OLD, NEW, confidential=False)
    token = _token(policy, "job-c", NO_KEY)
    work = _work("job-c", token, seal(NEW.public, JPEG, b"whatever"))
    assert isinstance(work, Work)
    refusal = check_token(work, policy, now=NOW, worker_id=WORKER, keys=RING)
    assert _refusal(refusal) == ("seal.unexpected", False)


def test_a_key_this_worker_does_not_hold_is_refused_before_the_replay_check() -> None:
    work, _ = _sealed_work("job-d", NEW)
    refusal = check_token(work, SEALED_POLICY, now=NOW, worker_id=WORKER, keys={OLD.key_id: OLD})
    assert _refusal(refusal) == ("seal.key_not_held", False)


def test_a_token_moved_onto_another_jobs_ciphertext_does_not_open() -> None:
    theirs, _ = _sealed_work("job-e", NEW)
    token = _token(SEALED_POLICY, "job-f", NEW.key_id)  # the same image, another placement
    moved = _work("job-f", token, theirs.payload)
    assert isinstance(moved, Work)
    assert _refusal(_screen(moved)) == ("seal.open_failed", True)


def test_a_ciphertext_of_another_image_opens_but_fails_the_tokens_hash() -> None:
    token = _token(SEALED_POLICY, "job-g", NEW.key_id)
    other = seal(NEW.public, JPEG + b"\0", _claims(token).seal_info())
    work = _work("job-g", token, other)
    assert isinstance(work, Work)
    assert _refusal(_screen(work)) == ("token.payload_mismatch", True)


def test_an_altered_ciphertext_does_not_open() -> None:
    work, token = _sealed_work("job-h", NEW)
    flipped = bytearray(work.payload)
    flipped[-1] ^= 1
    altered = _work("job-h", token, bytes(flipped))
    assert isinstance(altered, Work)
    assert _refusal(_screen(altered)) == ("seal.open_failed", True)


def test_a_sealed_image_of_the_largest_size_is_not_too_large() -> None:
    limits = Limits(1024, 40_000_000, 10_000)
    token = _token(SEALED_POLICY, "job-k", NEW.key_id)
    props = ((topics.PROP_JOB_ID, "job-k"), (topics.PROP_TOKEN, token))
    topic = topics.pool_work(WORKER_ZONE, WORKER, EDGE)
    for size, sealed, fits in ((1024, True, True), (1025, True, False), (1025, False, False)):
        extra = ((topics.PROP_SEALED, topics.SEAL_SUITE),) if sealed else ()
        msg = Message(topic, bytes(size + (48 if sealed else 0)), user_properties=props + extra)
        work = read_work(msg, limits=limits, now=NOW, worker_id=WORKER)
        assert isinstance(work, Work) is fits, work


def test_an_unknown_suite_is_refused_at_reading() -> None:
    token = _token(SEALED_POLICY, "job-i", NEW.key_id)
    refusal = _work("job-i", token, b"x" * 64, suite="rot13")
    assert _refusal(refusal) == ("bad_property", False)


# -- the key ring ---------------------------------------------------------------------------

A, B, C = HeldKey(OLD, 100.0), HeldKey(NEW, 200.0), HeldKey(STRAY, 300.0)


@pytest.mark.parametrize(
    ("held", "listed", "now", "current", "kept", "dropped"),
    [
        ((A,), (), 1000.0, None, (OLD,), ()),  # nothing listed yet: kept, none current
        ((A, B), (OLD.key_id, NEW.key_id), 1000.0, NEW, (NEW, OLD), ()),  # newest listed
        ((A, B), (OLD.key_id,), 1000.0, OLD, (NEW, OLD), ()),  # a newer key waits for listing
        ((A, B, C), (NEW.key_id,), 1000.0, NEW, (STRAY, NEW, OLD), ()),  # unlisted: retired
        ((HeldKey(OLD, 100.0, 950.0), B), (NEW.key_id,), 1000.0, NEW, (NEW, OLD), ()),
        ((HeldKey(OLD, 100.0, 900.0), B), (NEW.key_id,), 1000.0, NEW, (NEW,), (OLD,)),
        ((HeldKey(OLD, 100.0, 900.0), B), (OLD.key_id, NEW.key_id), 1000.0, NEW, (NEW, OLD), ()),
    ],
)
def test_key_ring_rules(
    held: tuple[HeldKey, ...],
    listed: tuple[bytes, ...],
    now: float,
    current: SealingKey | None,
    kept: tuple[SealingKey, ...],
    dropped: tuple[SealingKey, ...],
) -> None:
    result = plan(held, listed, now=now, max_ttl_s=60.0)
    assert result.current == (current.key_id if current is not None else None)
    assert [h.key_id for h in result.keep] == [k.key_id for k in kept]
    assert result.drop == tuple(k.key_id for k in dropped)


def test_retirement_starts_when_first_seen_and_ends_when_listed_again() -> None:
    first = plan((A, B), (NEW.key_id,), now=500.0, max_ttl_s=60.0)
    assert {h.key_id: h.retired_at for h in first.keep} == {NEW.key_id: None, OLD.key_id: 500.0}
    again = plan(first.keep, (OLD.key_id, NEW.key_id), now=520.0, max_ttl_s=60.0)
    assert all(h.retired_at is None for h in again.keep)


def test_key_files_are_private_survive_a_restart_and_are_dropped_when_retired_long(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "seal-keys"
    keys = SealKeys(KeyFolder(folder), now=100.0)  # none held: one is made
    (made,) = keys.held
    (path,) = folder.glob("*.pem")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    newer = KeyFolder(folder).create(200.0)
    again = SealKeys(KeyFolder(folder), now=300.0)
    assert [h.key_id for h in again.held] == [newer.key_id, made.key_id]
    assert again.refresh({newer.key_id}, now=300.0, max_ttl_s=60.0)  # made retired now
    assert again.current == newer.key_id
    assert made.key_id in again.ring()
    restarted = SealKeys(KeyFolder(folder), now=330.0)  # its retirement clock kept
    restarted.refresh({newer.key_id}, now=330.0, max_ttl_s=60.0)
    assert made.key_id in restarted.ring()
    restarted.refresh({newer.key_id}, now=361.0, max_ttl_s=60.0)
    assert list(restarted.ring()) == [newer.key_id]
    assert [p.name for p in folder.iterdir()] == [f"200000-{newer.key_id.hex()}.pem"]


# -- the broker's binding -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "advertised", "seal_all", "expect"),
    [
        (SEALED_POLICY, NEW.public, False, NEW.key_id),
        (SEALED_POLICY, None, False, "seal_unavailable"),
        (SEALED_POLICY, STRAY.public, True, "seal_unavailable"),  # not listed for the worker
        (_policy(OLD, confidential=False), OLD.public, False, NO_KEY),
        (_policy(OLD, confidential=False), OLD.public, True, OLD.key_id),
        (_policy(OLD, confidential=False), STRAY.public, True, NO_KEY),  # nothing usable
        (_policy(confidential=False), None, True, NO_KEY),
    ],
)
def test_the_key_a_token_binds(
    policy: Policy, advertised: bytes | None, seal_all: bool, expect: bytes | str
) -> None:
    got = seal_binding(policy, WORKER, advertised, DATA_CLASS, seal_all=seal_all)
    if isinstance(expect, str):
        assert isinstance(got, SealUnavailable)
        assert got.code == expect
        assert WORKER in got.reason
        assert DATA_CLASS in got.reason
    else:
        assert got == expect


# -- the edge -------------------------------------------------------------------------------


class _Capture:
    connected = True

    def __init__(self) -> None:
        self.sent: list[Message] = []

    def publish_nowait(self, msg: Message) -> None:
        self.sent.append(msg)


def test_the_edge_sends_a_sealed_placement_sealed_and_never_the_image() -> None:
    token = _token(SEALED_POLICY, "job-j", NEW.key_id)
    reply = PlacementReply(
        job_id="job-j", status="placed", token=token, worker_id=WORKER, worker_zone=WORKER_ZONE
    )
    job = Job(
        "job-j",
        "defect-v1",
        JPEG,
        ImageInfo("jpeg", 64, 64),
        "app/x",
        None,
        5,
        DATA_CLASS,
        NOW,
        None,
    )
    placement = check_placement(
        reply, job, payload_digest(JPEG), SEALED_POLICY, edge_id=EDGE, origin_zone=ORIGIN, now=NOW
    )
    assert isinstance(placement, Placement)
    assert placement.seal_to == NEW.public
    transport = _Capture()
    client = PlacementClient(
        transport,  # type: ignore[arg-type]
        edge_id=EDGE,
        zone=ORIGIN,
        policy=lambda: SEALED_POLICY,
        timeout_s=0.05,
        clock=time.time,
    )
    client.send(job, placement)
    (msg,) = transport.sent
    props = dict(msg.user_properties)
    assert JPEG not in msg.payload
    assert not (msg.content_type or "").startswith("image/")
    assert props[topics.PROP_SEALED] == topics.SEAL_SUITE
    assert props[topics.PROP_INNER_CONTENT_TYPE] == "image/jpeg"
    assert placement.claims is not None
    assert open_sealed(NEW, msg.payload, placement.claims.seal_info()) == JPEG


# -- placement passes by workers a confidential job cannot be sealed to ---------------------


def test_placement_passes_by_workers_without_a_listed_key_and_refuses_when_none_has_one() -> None:
    policy = campus_policy({kit.NDC: ["gpu-1", "gpu-2"]})
    fleet = fleet_with(
        policy,
        [(caps("gpu-1", kit.NDC), {}), (caps("gpu-2", kit.NDC), {"queue_depth": 4})],
    )
    req = request(deadline_at=kit.NOW + 10.0)
    args: dict[str, Any] = {"now": kit.NOW, "params": kit.PARAMS}
    best = decide(fleet, req, policy, **args)
    assert best == decide_reference(fleet, req, policy, **args)  # no filter: as before
    assert isinstance(best, Placed)
    assert best.worker_id == "gpu-1"
    other = decide(fleet, req, policy, sealable=lambda w: w == "gpu-2", **args)
    assert isinstance(other, Placed)
    assert other.worker_id == "gpu-2"
    none = decide(fleet, req, policy, sealable=lambda _w: False, **args)
    assert isinstance(none, Refused)
    assert none.code == "seal_unavailable"
    assert "gpu-1" in none.reason


def test_following_the_policy_reports_each_change_of_the_current_key_once() -> None:
    keys = SealKeys(KeyFolder(None), now=100.0)  # no state folder: one key, in memory
    (held,) = keys.held
    assert keys.follow(_policy(OLD), WORKER, now=101.0) is None  # its key not listed yet
    rotation = keys.follow(_policy(held.key), WORKER, now=102.0)
    assert rotation is not None
    assert (rotation.current, rotation.previous) == (held.key_id, None)
    assert rotation.audit_data(WORKER)["public"] == keys.public_text() == held.key.public_text
    assert keys.follow(_policy(held.key), WORKER, now=103.0) is None
    assert keys.follow(_policy(OLD), WORKER, now=104.0) is not None  # unlisted: none current
    assert keys.public_text() is None
