"""The policy feed: pure acceptance table, the shell over the in-memory transport (restart,
bootstrap file, expiry) and one real-Mosquitto test with a retained policy message."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from policies import Policy, TrustAnchor, signed_envelope
from policies.signing import dump_anchor, dump_signatures
from sluicegate import topics
from sluicegate.app.servers import ServerProcess, running, start_mosquitto
from sluicegate.config import MqttSettings
from sluicegate.errors import ConfigError
from sluicegate.memory_transport import MemoryBroker, MemoryTransport
from sluicegate.mqtt import MqttTransport
from sluicegate.policy_feed import (
    ANCHOR_FILE,
    ENVELOPE_FILE,
    Accepted,
    PolicyFeed,
    Refused,
    consider,
)
from sluicegate.transport import Message
from tests.policies.policy_testkit import NOW, base_doc, key, policy_of, signed, to_toml
from tests.support import PlainClient, until

V1 = policy_of(base_doc(version=1))
V2 = policy_of(base_doc(version=2))
EXPIRED = policy_of(base_doc(version=3, expires="2026-01-01T00:00:00Z"))  # before NOW
OFFICERS = ("officer-alice", "officer-bob")


def envelope(policy: Policy, *names: str) -> bytes:
    return signed_envelope(policy, signed(policy, *(names or OFFICERS)))


def tampered(policy: Policy) -> bytes:
    doc = json.loads(envelope(policy))
    doc["policy"]["classes"]["wafer-image"]["allow"].append("offsite/**")
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("data", "anchor", "reason"),
    [
        (tampered(V1), None, "policy.digest_mismatch"),
        (envelope(V1), TrustAnchor.of(V2), "policy.rollback"),
        (envelope(EXPIRED), None, "policy.expired"),
        (envelope(V1, "officer-alice", "mallory"), None, "policy.unknown_signer"),
        (envelope(V1, "officer-alice"), None, "policy.threshold_not_met"),
        (b"not json", None, "policy.parse"),
    ],
)
def test_consider_refuses_with_the_reason(
    data: bytes, anchor: TrustAnchor | None, reason: str
) -> None:
    verdict = consider(data, now=NOW, anchor=anchor, held=None, source="t", local=True)
    assert isinstance(verdict, Refused)
    assert verdict.reason == reason, verdict.message


def test_consider_accepts_newer_and_equal_and_reports_change() -> None:
    first = consider(envelope(V1), now=NOW, anchor=None, held=None, source="t", local=True)
    assert isinstance(first, Accepted)
    assert first.changed
    assert first.anchor.version == 1
    same = consider(envelope(V1), now=NOW, anchor=first.anchor, held=first.policy, source="t")
    assert isinstance(same, Accepted)
    assert not same.changed
    newer = consider(envelope(V2), now=NOW, anchor=first.anchor, held=first.policy, source="t")
    assert isinstance(newer, Accepted)
    assert newer.changed
    assert newer.policy.version == 2


def test_nothing_from_the_network_is_trusted_on_first_use() -> None:
    verdict = consider(envelope(V1), now=NOW, anchor=None, held=None, source="t")
    assert isinstance(verdict, Refused)
    assert verdict.reason == "policy.no_anchor"
    assert "--join" in verdict.message
    pinned = TrustAnchor.of(V1)
    again = consider(envelope(V1), now=NOW, anchor=pinned, held=None, source="t")
    assert isinstance(again, Accepted)


def _pin(state: Path, policy: Policy) -> None:
    """What enrollment leaves: the trust anchor of the campus's policy, pinned."""
    state.mkdir(parents=True, exist_ok=True)
    (state / ANCHOR_FILE).write_bytes(dump_anchor(TrustAnchor.of(policy)))


def _feed(state: Path | None, policy_file: Path | None = None, now: float = NOW) -> PolicyFeed:
    return PolicyFeed(node="n1", policy_file=policy_file, state_dir=state, clock=lambda: now)


async def test_feed_follows_the_retained_topic_and_never_goes_back(tmp_path: Path) -> None:
    broker = MemoryBroker()
    publisher = MemoryTransport(broker)
    publisher.publish_nowait(Message(topics.policy(), envelope(V1), qos=1, retain=True))
    _pin(tmp_path, V1)
    feed = _feed(tmp_path)
    seen: list[int] = []
    feed.on_change(lambda p: seen.append(p.version))
    feed.load()
    assert feed.current is None
    assert "holds no verified policy" in feed.why_none()
    await feed.start(MemoryTransport(broker))
    current = await until(lambda: feed.current)
    assert current.version == 1
    # A tampered envelope last: once it is refused, everything before it has been taken.
    for data in (envelope(V2), envelope(V1), tampered(V2), envelope(V2), tampered(V2)):
        publisher.publish_nowait(Message(topics.policy(), data, qos=1, retain=True))
    await until(lambda: feed.refused["policy.digest_mismatch"] == 2)
    assert feed.current is not None
    assert feed.current.version == 2
    assert seen == [1, 2]  # the repeated v2 is no change
    assert dict(feed.refused) == {"policy.rollback": 1, "policy.digest_mismatch": 2}
    assert json.loads((tmp_path / ANCHOR_FILE).read_bytes())["version"] == 2

    # Restart: the persisted envelope is in force before any message arrives, and the older
    # retained one that a fresh broker might still hold is refused.
    again = _feed(tmp_path)
    again.load()
    assert again.current is not None
    assert again.current.version == 2
    verdict = again.offer(envelope(V1), source="stale")
    assert isinstance(verdict, Refused)
    assert verdict.reason == "policy.rollback"
    assert again.current.version == 2


def test_an_older_version_is_refused_quietly_and_a_forged_one_loudly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The broker that has just taken v2 hears its own retained v1: expected, so INFO.
    _pin(tmp_path, V2)
    feed = _feed(tmp_path)
    feed.load()
    assert feed.offer(envelope(V2), source="file").changed  # type: ignore[union-attr]
    caplog.set_level(logging.INFO, logger="sluicegate.policy_feed")
    caplog.clear()
    feed.offer(envelope(V1), source="retained")
    feed.offer(tampered(V2), source="retained")
    said = [(r.levelname, r.getMessage().split("]")[0].split("[")[-1]) for r in caplog.records]
    assert said == [("INFO", "policy.rollback"), ("WARNING", "policy.digest_mismatch")]


def _write_policy(folder: Path, version: int) -> Path:
    doc = base_doc(version=version)
    path = folder / f"campus-v{version}.toml"
    path.write_text(to_toml(doc), encoding="utf-8")
    policy = policy_of(doc)
    path.with_name(path.name + ".sig").write_bytes(dump_signatures(signed(policy, *OFFICERS)))
    return path


def test_bootstrap_file_and_anchor_rollback_across_restart(tmp_path: Path) -> None:
    state = tmp_path / "state"
    feed = _feed(state, _write_policy(tmp_path, 2))
    feed.load()
    assert feed.current is not None
    assert feed.current.version == 2
    # The persisted envelope is lost, the anchor is not: an older bootstrap file is refused.
    (state / ENVELOPE_FILE).unlink()
    older = _feed(state, _write_policy(tmp_path, 1))
    older.load()
    assert older.current is None
    assert dict(older.refused) == {"policy.rollback": 1}
    assert "older than the accepted version 2" in older.why_none()


def test_bootstrap_file_without_signatures_is_a_config_error(tmp_path: Path) -> None:
    path = _write_policy(tmp_path, 1)
    path.with_name(path.name + ".sig").unlink()
    with pytest.raises(ConfigError, match=r"campus-v1\.toml\.sig"):
        _feed(None, path).load()


def test_policy_that_expires_while_held_is_no_longer_current() -> None:
    clock = [NOW]
    feed = PolicyFeed(node="n1", clock=lambda: clock[0])
    assert isinstance(feed.offer(envelope(V1), source="t", local=True), Accepted)
    assert feed.current is not None
    clock[0] = V1.expires + 1
    assert feed.current is None
    assert feed.held is not None
    assert feed.held.digest == V1.digest
    assert "expired" in feed.why_none()


def test_unknown_signer_is_counted_and_the_held_policy_stays() -> None:
    feed = _feed(None)
    feed.offer(envelope(V1), source="t", local=True)
    mallory_v2 = signed_envelope(V2, signed(V2, "mallory", "officer-alice"))
    verdict = feed.offer(mallory_v2, source="t")
    assert isinstance(verdict, Refused)
    assert verdict.reason == "policy.unknown_signer"
    assert key("mallory").public not in V2.signer_keys
    assert feed.current is not None
    assert feed.current.version == 1


@pytest.fixture
def own_mosquitto() -> Iterator[ServerProcess]:
    """Retained policy messages are global: this test gets a Mosquitto of its own."""
    with running(start_mosquitto()) as server:
        yield server


@pytest.mark.integration
async def test_real_broker_retained_policy_reaches_a_late_subscriber(
    own_mosquitto: ServerProcess, tmp_path: Path
) -> None:
    plain = PlainClient(own_mosquitto.port)
    try:
        info = plain.client.publish(topics.policy(), envelope(V2), qos=1, retain=True)
        info.wait_for_publish(10)
    finally:
        plain.close()
    _pin(tmp_path, V1)
    feed = _feed(tmp_path)
    changed = asyncio.Event()
    feed.on_change(lambda _p: changed.set())
    feed.load()
    async with MqttTransport(MqttSettings(port=own_mosquitto.port), client_id="feed-t") as t:
        await feed.start(t)
        await asyncio.wait_for(changed.wait(), 10)
    assert feed.current is not None
    assert feed.current.version == 2
    assert (tmp_path / ENVELOPE_FILE).read_bytes() == envelope(V2)


def test_only_an_installed_file_starts_the_chain_and_a_node_without_refuses_to_start(
    tmp_path: Path,
) -> None:
    network = PolicyFeed(node="n1", clock=lambda: NOW)
    network.load()
    with pytest.raises(ConfigError, match="no pinned policy trust anchor"):
        network.require_anchor()
    refused = network.offer(envelope(V1), source=topics.policy())
    assert isinstance(refused, Refused)
    assert refused.reason == "policy.no_anchor"
    assert network.current is None
    pinned = PolicyFeed(node="n1", policy_file=_write_policy(tmp_path, 1), clock=lambda: NOW)
    pinned.load()
    pinned.require_anchor()
    assert isinstance(pinned.offer(envelope(V2), source=topics.policy()), Accepted)
    assert pinned.current is not None
    assert pinned.current.version == 2


def _write_gated(folder: Path, version: int) -> tuple[Path, Policy]:
    doc = base_doc(version=version)
    doc["rollout"] = {"twin_keys": {"twin-1": key("twin-1").public_text}, "require_verdict": True}
    path = folder / f"gated-v{version}.toml"
    path.write_text(to_toml(doc), encoding="utf-8")
    policy = policy_of(doc)
    path.with_name(path.name + ".sig").write_bytes(dump_signatures(signed(policy, *OFFICERS)))
    return path, policy


def _verdict_for(policy: Policy) -> bytes:
    from policies.verdict import Body, Candidate, Figures, Thresholds, sign_verdict

    body = Body(
        candidate=Candidate(kind="policy", digest=policy.digest.hex(), version=policy.version),
        trace_sha256="ab" * 32,
        thresholds=Thresholds(),
        figures=Figures(attainment=0.99, peak_queue_depth={"w": 2}, violations=0),
        passed=True,
        reasons=[],
        issued_at=NOW,
    )
    return sign_verdict(body, key("twin-1"), "twin-1").to_bytes()


def test_a_gated_rollout_keeps_the_held_policy_until_its_verdict_is_beside_the_file(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    v1, _ = _write_gated(tmp_path, 1)
    first = _feed(state, v1)
    first.load()
    assert first.current is not None
    assert first.file_refusal is None
    v2, policy = _write_gated(tmp_path, 2)
    restarted = _feed(state, v2)
    restarted.load()  # the persisted v1, then the new file without its verdict
    assert restarted.current is not None
    assert restarted.current.version == 1
    assert restarted.file_refusal is not None
    assert restarted.file_refusal.reason == "verdict.missing"
    assert dict(restarted.refused) == {"verdict.missing": 1}
    v2.with_name(v2.name + ".verdict").write_bytes(_verdict_for(policy))
    verified = _feed(state, v2)
    verified.load()
    assert verified.current is not None
    assert verified.current.version == 2
    assert verified.file_refusal is None
