"""Wires a real broker replica together: MQTT (with its Last Will), Redis, the broker's
signing key, the policy it serves (verified, then published retained for every node), the
audit log, model requirements and the HTTP API. It refuses to start without its own TLS
identity (unless ``[mqtt] plaintext``), with a key the policy does not list for its id, or
while another process holds its replica lease (``broker.lease``). ``sluicegate broker run``
calls :func:`serve`.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import redis.asyncio as aioredis

from broker.api import start_http
from broker.audit_check import AuditChecker, trusted_keys
from broker.console.access import access_for
from broker.console.board import Console
from broker.decision_audit import encode
from broker.enrollment import EnrollmentDesk
from broker.lease import ReplicaLease
from broker.metering import UsageIngest
from broker.params_file import ParamsChoice, ParamsRefused, choose_params, shadow_of
from broker.peer_usage import PeerUsage
from broker.service import Broker, status_message
from broker.view import HttpView
from policies import AsyncAuditWriter, SigningKey, load_signing_key
from policies.errors import PolicyError
from policies.redis_stores import AsyncRedisStreamAuditStore, audit_stream_key
from sluicegate import identity, topics
from sluicegate.config import Settings
from sluicegate.enroll.authority import Authority
from sluicegate.errors import ConfigError
from sluicegate.instance import this_process
from sluicegate.mqtt import MqttTransport
from sluicegate.policy_feed import PolicyFeed
from sluicegate.redis_url import async_client
from sluicegate.transport import Message, Will
from sluicegate.vision.manifest import Requirements, load_manifest
from sluicegate.vision.runtime import default_models_dir

log = logging.getLogger(__name__)


def requirements_of(models_dir: Path) -> dict[str, Requirements]:
    """What each model in ``models_dir`` needs, from its manifest (no weights are loaded)."""
    out: dict[str, Requirements] = {}
    for path in sorted(models_dir.glob("*.json")):
        manifest = load_manifest(path)
        out[manifest.name] = manifest.requirements
    return out


async def serve(
    settings: Settings,
    stop: asyncio.Event,
    *,
    connect_timeout: float | None = None,
    http_port_ready: asyncio.Future[int] | None = None,
) -> Broker:
    """Run one broker replica until ``stop`` is set."""
    cfg = settings.broker
    identity.prepare(settings.mqtt, cfg.id)
    if cfg.key_file is None:
        raise ConfigError(
            "the broker needs its placement signing key: set [broker] key_file (create one "
            "with 'sluicegate policy keygen' and list its public key under broker_signers)"
        )
    try:
        key = load_signing_key(cfg.key_file)
    except PolicyError as exc:
        raise ConfigError(str(exc)) from exc
    feed = PolicyFeed(node=cfg.id, policy_file=cfg.policy_file, state_dir=cfg.state_dir)
    feed.load()
    feed.require_anchor()
    if feed.current is not None:
        listed = feed.current.broker_key(cfg.id)
        if listed != key.public:
            problem = "lists another key for it" if listed else "does not list it"
            raise ConfigError(
                f"broker {cfg.id}: policy v{feed.current.version} {problem} under "
                f"broker_signers; its key_file {cfg.key_file} holds {key.public_text}, and "
                "edges and workers would refuse every token it signs"
            )
    envelope = feed.envelope  # what the feed accepted: never a refused file's envelope
    placement = choose_params(cfg, feed.current)
    redis = async_client(cfg.redis_url)
    lease = ReplicaLease(redis, cfg.id, this_process())
    try:
        await lease.acquire()
    except BaseException:
        await redis.aclose()
        raise
    try:
        return await _serve(
            settings,
            stop,
            key,
            feed,
            envelope,
            placement,
            redis,
            lease,
            connect_timeout,
            http_port_ready,
        )
    finally:
        await lease.release()
        await redis.aclose()


async def _serve(
    settings: Settings,
    stop: asyncio.Event,
    key: SigningKey,
    feed: PolicyFeed,
    envelope: bytes | None,
    placement: ParamsChoice,
    redis: aioredis.Redis,
    lease: ReplicaLease,
    connect_timeout: float | None,
    http_port_ready: asyncio.Future[int] | None,
) -> Broker:
    cfg = settings.broker
    transport = MqttTransport(
        settings.mqtt,
        client_id=identity.mqtt_client_id(settings.mqtt, cfg.id, f"sg-broker-{cfg.id}"),
        will=Will(topics.broker_status(cfg.id), status_message(cfg, "offline")),
        # A clean session, unlike every other role: requests come on a shared subscription,
        # and Mosquitto goes on handing a share of them to a persistent session whose
        # replica is down (each dropped, the edge waiting out its placement timeout).
        clean_start=True,
        read_gap_s=cfg.read_gap_ms / 1000.0,
    )
    audit = AsyncAuditWriter(AsyncRedisStreamAuditStore(redis, audit_stream_key(cfg.id)), key)
    requirements = requirements_of(cfg.models_dir or default_models_dir())
    shadow = shadow_of(cfg, requirements)
    broker = Broker(
        cfg,
        transport,
        redis,
        key,
        lambda: feed.current,
        audit,
        requirements=requirements,
        params=placement.params,
        shadow=shadow,
    )
    if shadow is not None:
        log.info("broker %s: shadow candidate %s decides beside production", cfg.id, shadow.label)
    feed.on_change(broker.fleet.use_policy)  # workers' zones follow every new policy
    refused = feed.file_refusal
    if refused is not None and feed.current is not None:
        # A new policy file not activated (a gated rollout without its verdict, an older
        # version...): the broker keeps serving the policy it holds, and says so.
        log.error(
            "broker %s keeps policy v%d; its policy file %s was refused [%s]: %s",
            cfg.id,
            feed.current.version,
            cfg.policy_file,
            refused.reason,
            refused.message,
        )
        record = {"file": str(cfg.policy_file), "code": refused.reason, "reason": refused.message}
        broker.audit.add(cfg.id, encode(record), "policy.refused")
    if placement.refused is not None:
        _params_refused(broker, placement.refused, placement.source)
    await transport.connect(timeout=connect_timeout)
    await feed.start(transport)
    if envelope is not None and feed.current is not None:
        # Every node takes the policy from here, verifies it, and never goes back a version.
        transport.publish_nowait(Message(topics.policy(), envelope, qos=1, retain=True))
    authority = Authority(cfg.ca_dir) if cfg.ca_dir is not None else None
    desk = EnrollmentDesk(authority, redis, broker.audit, lambda: feed.envelope)
    checker = AuditChecker(
        AsyncRedisStreamAuditStore(redis, audit_stream_key(cfg.id)),
        lambda: trusted_keys(key.public, feed.current),
        broker.metrics,
        writer=audit,
    )
    board = Console(broker, feed, transport, redis, settings.console, audit_state=checker.plain)
    await transport.subscribe(topics.edge_trace_all(), board.on_trace, qos=0)
    usage = UsageIngest(
        cfg.id,
        transport,
        redis,
        key,
        lambda: feed.current,
        broker.metrics,
        broker.gate,
        broker.audit,
    )
    # Records of jobs between this campus and a sister campus: ours out, theirs in.
    peer_usage = PeerUsage(
        cfg.id,
        transport,
        usage.store,
        key,
        lambda: feed.current,
        on_refused=lambda reason: broker.metrics.peer_refused.labels("usage", reason).inc(),
    )
    usage.on_new = peer_usage.send_ours
    broker.peers.hear(topics.peer_usage, peer_usage.on_message)
    await transport.subscribe(topics.usage_all(), usage.on_usage, qos=1)
    view = HttpView(broker, feed, transport, placement, checker, usage=usage, peer_usage=peer_usage)
    runner, port = await start_http(
        view, desk, cfg.http_host, cfg.http_port, (board, access_for(settings))
    )
    log.info("broker %s: HTTP API on http://%s:%d", cfg.id, cfg.http_host, port)
    if http_port_ready is not None:
        http_port_ready.set_result(port)
    keeper = asyncio.ensure_future(lease.keep())
    verifier = asyncio.ensure_future(checker.run())
    console = asyncio.ensure_future(board.run())
    metering = asyncio.ensure_future(usage.run())
    peer_metering = asyncio.ensure_future(peer_usage.run())
    try:
        await identity.serve_until_fenced(stop, lease.lost, lambda: lease.reason, broker.run)
    finally:
        keeper.cancel()
        verifier.cancel()
        console.cancel()
        metering.cancel()
        peer_metering.cancel()
        board.close()
        await runner.cleanup()
        await transport.close()
    return broker


def _params_refused(broker: Broker, refused: ParamsRefused, kept: str) -> None:
    """A placement file not activated (a gated rollout without its verdict...): the broker
    runs on the parameters it held, and says so in its log and its audit log."""
    cfg = broker.settings
    log.error(
        "broker %s keeps its placement parameters (%s); placement file %s (digest %s) was "
        "refused [%s]: %s",
        cfg.id,
        kept,
        cfg.placement_file,
        refused.digest[:16],
        refused.code,
        refused.message,
    )
    record = {
        "file": str(cfg.placement_file),
        "digest": refused.digest,
        "code": refused.code,
        "reason": refused.message,
        "kept": broker.params.digest(),
    }
    broker.audit.add(cfg.id, encode(record), "params.refused")
