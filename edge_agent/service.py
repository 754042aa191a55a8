"""Wires a real edge agent together: settings, the outbox file, the MQTT transport with its
Last Will and a persistent session (so requests and returns that arrive while the agent is
down wait for it, and unacked ones come again), the verified model registry, the node's
policy feed, the placement client for offloading and the ``/metrics`` server (``[edge]
metrics_*``; a port it cannot bind is logged, never fatal). It refuses to start without its
own TLS identity (unless ``[mqtt] plaintext``), without a pinned policy trust anchor, or
while another process serves the same edge (``sluicegate.identity``). ``sluicegate edge
run`` and the demo call :func:`serve`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

from edge_agent.agent import EdgeAgent
from edge_agent.metrics import edge_registry
from edge_agent.offload import PlacementClient
from edge_agent.outbox import Outbox
from edge_agent.reporting import last_will, status_message
from policies import Policy, load_signing_key
from policies.errors import KeyFileError
from policies.keys import public_key_of
from sluicegate import identity, topics
from sluicegate.config import EdgeSettings, OffloadSettings, Settings
from sluicegate.metering.meter import Meter, node_meter
from sluicegate.mqtt import MqttTransport
from sluicegate.node_metrics import MetricsServer
from sluicegate.policy_feed import ANCHOR_FILE, PolicyFeed
from sluicegate.policy_standing import StandingLog, standing
from sluicegate.transport import Transport
from sluicegate.vision.priors import PRIORS_FILE, priors_for, read_priors
from sluicegate.vision.runtime import ModelRegistry, default_models_dir

log = logging.getLogger(__name__)


def models_folder(settings: Settings) -> Path:
    """Where this edge's models are: ``[edge] models_dir``, else the default folder."""
    return settings.edge.models_dir or default_models_dir()


def load_registry(settings: Settings) -> ModelRegistry:
    edge = settings.edge
    return ModelRegistry.from_dir(
        models_folder(settings), providers=edge.providers, intra_op_threads=edge.intra_op_threads
    )


def outbox_path(settings: Settings) -> Path:
    """Where this edge's outbox lives: ``[edge] outbox_path``; else a file named after the
    edge id in the node's state directory (``[offload] state_dir``), or in the user's
    (``$XDG_STATE_HOME/sluicegate``, by default ~/.local/state/sluicegate)."""
    edge = settings.edge
    if edge.outbox_path is not None:
        return edge.outbox_path
    user_state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    folder = settings.offload.state_dir or Path(user_state) / "sluicegate"
    return folder / f"edge-{edge.id}.outbox.db"


def open_outbox(settings: Settings) -> Outbox:
    edge = settings.edge
    return Outbox(
        outbox_path(settings),
        synchronous=edge.outbox_synchronous,
        result_retention_s=edge.result_retention_s,
        tombstone_s=edge.tombstone_s,
        dead_letter_keep_s=edge.dead_letter_keep_s,
        max_tombstones=edge.max_tombstones,
    )


def edge_meter(settings: Settings, transport: Transport, outbox: Outbox) -> Meter | None:
    """The edge's usage metering (not started): its ledger in the outbox's file, its
    records committed with the results they meter, signed with the edge's own key; None
    with ``[edge] metering`` off, or with no readable ``key_file`` (a record nobody can
    check bills nothing: said in the log)."""
    edge = settings.edge
    if not edge.metering:
        return None
    if edge.key_file is None:
        log.warning("edge %s has no [edge] key_file: its jobs are not metered", edge.id)
        return None
    try:
        key = load_signing_key(edge.key_file)
    except KeyFileError as exc:  # not enrolled yet (plaintext debugging): serve unmetered
        log.error("edge %s: its jobs are not metered: [edge] key_file: %s", edge.id, exc)
        return None
    if edge.usage_synchronous != edge.outbox_synchronous:
        log.warning(
            "[edge] usage_synchronous = %s is not used: usage records are committed with the "
            "results in the outbox (outbox_synchronous = %s)",
            edge.usage_synchronous,
            edge.outbox_synchronous,
        )
    return node_meter(
        outbox.path,
        key,
        transport,
        node=edge.id,
        kind="edge",
        settings=edge,
        log=outbox.writer,
        synchronous=outbox.synchronous,
        legacy=outbox.path.with_name(f"edge-{edge.id}.usage.sqlite"),
    )


async def serve(
    settings: Settings,
    stop: asyncio.Event,
    *,
    registry: ModelRegistry | None = None,
    connect_timeout: float | None = None,
) -> EdgeAgent:
    """Run an edge agent until ``stop`` is set; returns the agent (for its counters)."""
    edge = settings.edge
    identity.prepare(settings.mqtt, edge.id)
    with identity.node_lock(outbox_path(settings).parent, edge.id):
        return await _serve(settings, stop, registry, connect_timeout)


def follows_policy(offload: OffloadSettings) -> bool:
    """Whether an edge with these settings follows a policy: it offloads, or it is given one
    (``policy_file``, or the anchor its enrollment pinned in ``state_dir``)."""
    enrolled = offload.state_dir is not None and (offload.state_dir / ANCHOR_FILE).exists()
    return bool(offload.enabled or offload.policy_file or enrolled)


def policy_feed(settings: Settings) -> PolicyFeed | None:
    """The policy this edge follows, loaded, its anchor pinned. It says where the edge may
    answer, offload or not (a job whose result the ACL would refuse is refused before it
    is accepted): only an edge given no policy at all (offload off, no ``policy_file``, no
    anchor pinned in its ``state_dir`` by enrollment) serves without one."""
    offload = settings.offload
    if not follows_policy(offload):
        log.warning(
            "edge %s follows no policy (offload off, no policy_file, no pinned anchor in its "
            "state_dir): it accepts a job whose Response Topic its ACL may refuse, and such "
            "a result ends undelivered (results_refused)",
            settings.edge.id,
        )
        return None
    feed = PolicyFeed(
        node=settings.edge.id, policy_file=offload.policy_file, state_dir=offload.state_dir
    )
    feed.load()
    feed.require_anchor()
    edge = settings.edge
    key = public_key_of(edge.key_file)
    said = StandingLog(f"edge {edge.id}")

    def check(policy: Policy) -> None:
        said.heard(policy, standing(policy, "edge", edge.id, edge.zone, key))

    feed.on_change(check)  # each version it takes; the one it holds now, at once
    if feed.current is not None:
        check(feed.current)
    return feed


def placement_client(
    settings: Settings, transport: Transport, feed: PolicyFeed | None, registry: ModelRegistry
) -> PlacementClient | None:
    """What asks the broker for placements, when this edge offloads."""
    edge, offload = settings.edge, settings.offload
    if not offload.enabled:
        return None
    return PlacementClient(
        transport,
        edge_id=edge.id,
        zone=edge.zone,
        policy=lambda: feed.current if feed is not None else None,
        timeout_s=offload.placement_timeout_ms / 1000.0,
        clock=time.time,
        model_sha256=lambda name: registry.get(name).manifest.sha256 if name in registry else None,
    )


async def _serve(
    settings: Settings,
    stop: asyncio.Event,
    registry: ModelRegistry | None,
    connect_timeout: float | None,
) -> EdgeAgent:
    watched = None
    if registry is None:
        watched = models_folder(settings)
        registry = load_registry(settings)
    edge, offload = settings.edge, settings.offload
    transport = MqttTransport(
        settings.mqtt,
        client_id=identity.mqtt_client_id(settings.mqtt, edge.id, f"sg-edge-{edge.id}"),
        will=last_will(edge),
        clean_start=False,
        session_expiry_s=settings.mqtt.session_expiry_s,
    )
    feed = policy_feed(settings)
    client = placement_client(settings, transport, feed, registry)
    await transport.connect(timeout=connect_timeout)
    try:
        guard = await identity.claim(
            transport,
            settings.mqtt,
            node=edge.id,
            status_topic=topics.edge_status(edge.id),
            online=status_message(edge, "online"),
        )
    except BaseException:
        await transport.close()
        raise
    if feed is not None:
        await feed.start(transport)
    if client is not None:
        await client.start()
    outbox = open_outbox(settings)
    agent = EdgeAgent(
        edge,
        transport,
        registry,
        offload=client,
        offload_settings=offload,
        outbox=outbox,
        feed=feed,
        models_dir=watched,
        meter=edge_meter(settings, transport, outbox),
    )
    if watched is not None:
        for name, prior in priors_for(registry, read_priors(watched / PRIORS_FILE)).items():
            agent.service_times.seed(name, prior.image_ms / 1000.0)
    metrics = metrics_server(edge, agent)
    try:
        if metrics is not None:
            await metrics.start()
            agent.metrics = metrics
        await identity.serve_guarded(guard, stop, agent.run)
    finally:
        if metrics is not None:
            await metrics.stop()
        if client is not None:
            client.close()
        await transport.close()
    return agent


def metrics_server(edge: EdgeSettings, agent: EdgeAgent) -> MetricsServer | None:
    """The agent's ``/metrics`` server (not started), or None with ``metrics_enabled``
    off."""
    if not edge.metrics_enabled:
        return None
    return MetricsServer(
        edge_registry(edge.id, agent.scrape),
        host=edge.metrics_host,
        port=edge.metrics_port,
        setting="[edge] metrics_host/metrics_port",
    )
