"""Wires a real pool worker together: execution providers, the verified model registry, the
device probe, the policy feed, the replay cache and audit log (Redis when ``redis_url`` is
set), the MQTT transport with its Last Will, and the ``/metrics`` server (``[pool]
metrics_*``; a port it cannot bind is logged, never fatal). ``sluicegate pool run`` calls
:func:`serve`.

Where the audit log goes, first match wins: ``audit_path`` (a file), ``redis_url`` (the
stream ``sluicegate:audit:<worker id>``), ``state_dir/audit.jsonl``, else memory with a
warning. The audit records are signed with ``key_file`` (or an ephemeral key, logged), and
so are the usage records (``[pool] metering``), kept in ``state_dir/usage.sqlite`` until a
broker replica acknowledges them (in memory, with a warning, without a ``state_dir``).
The sealing keys sealed images are opened with live in ``state_dir/seal-keys/``
(``center_pool.seal_keys``; one is made on first start; in memory without a ``state_dir``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import redis.asyncio

from center_pool.guard import (
    AsyncFileAuditStore,
    AuditSink,
    MemoryAsyncReplayCache,
    MemoryAuditStore,
    load_worker_key,
)
from center_pool.hardware import available_providers, open_probe, select_providers
from center_pool.metrics import worker_registry
from center_pool.reporting import last_will, status_message
from center_pool.seal_keys import KeyFolder, SealKeys, folder_of
from center_pool.worker import PoolWorker
from policies import AsyncAuditWriter, SigningKey
from policies.audit import AsyncAuditStore
from policies.redis_stores import (
    AsyncRedisReplayCache,
    AsyncRedisStreamAuditStore,
    audit_stream_key,
)
from policies.replay import AsyncReplayCache
from sluicegate import identity, topics
from sluicegate.config import PoolSettings, Settings
from sluicegate.metering.ledger import ledger_path
from sluicegate.metering.meter import Meter, node_meter
from sluicegate.mqtt import MqttTransport
from sluicegate.node_metrics import MetricsServer
from sluicegate.policy_feed import PolicyFeed
from sluicegate.redis_url import async_client
from sluicegate.vision.priors import PRIORS_FILE, priors_for, read_priors
from sluicegate.vision.runtime import ModelRegistry, default_models_dir

log = logging.getLogger(__name__)

AUDIT_FILE = "audit.jsonl"


def audit_store(pool: PoolSettings, client: redis.asyncio.Redis | None) -> AsyncAuditStore:
    """The store this worker's audit log goes to (see the module docstring)."""
    if pool.audit_path is not None:
        pool.audit_path.parent.mkdir(parents=True, exist_ok=True)
        return AsyncFileAuditStore(pool.audit_path)
    if client is not None:
        return AsyncRedisStreamAuditStore(client, audit_stream_key(pool.id))
    if pool.state_dir is not None:
        pool.state_dir.mkdir(parents=True, exist_ok=True)
        return AsyncFileAuditStore(pool.state_dir / AUDIT_FILE)
    log.warning(
        "worker %s keeps its audit log in memory only: set [pool] audit_path, redis_url or "
        "state_dir to keep a record of refused work",
        pool.id,
    )
    return MemoryAuditStore()


async def serve(
    settings: Settings,
    stop: asyncio.Event,
    *,
    registry: ModelRegistry | None = None,
    connect_timeout: float | None = None,
) -> PoolWorker:
    """Run a pool worker until ``stop`` is set; returns the worker (for its counters)."""
    pool = settings.pool
    identity.prepare(settings.mqtt, pool.id)
    with contextlib.ExitStack() as stack:
        if pool.state_dir is not None:
            stack.enter_context(identity.node_lock(pool.state_dir, pool.id))
        return await _serve(settings, stop, registry, connect_timeout)


async def _serve(
    settings: Settings,
    stop: asyncio.Event,
    registry: ModelRegistry | None,
    connect_timeout: float | None,
) -> PoolWorker:
    pool = settings.pool
    providers = select_providers(available_providers(pool.providers), pool.providers)
    watched = None
    if registry is None:
        watched = pool.models_dir or default_models_dir()
        registry = ModelRegistry.from_dir(
            watched, providers=providers, intra_op_threads=pool.intra_op_threads
        )
    feed = PolicyFeed(node=pool.id, policy_file=pool.policy_file, state_dir=pool.state_dir)
    feed.load()
    feed.require_anchor()
    key = load_worker_key(pool.key_file, pool.id)
    client = async_client(pool.redis_url) if pool.redis_url else None
    replay: AsyncReplayCache = (
        AsyncRedisReplayCache(client) if client is not None else MemoryAsyncReplayCache()
    )
    sink = AuditSink(AsyncAuditWriter(audit_store(pool, client), key))
    transport = MqttTransport(
        settings.mqtt,
        client_id=identity.mqtt_client_id(settings.mqtt, pool.id, f"sg-pool-{pool.id}"),
        will=last_will(pool),
        clean_start=False,
        session_expiry_s=settings.mqtt.session_expiry_s,
    )
    probe = open_probe(pool.device_index)
    worker: PoolWorker | None = None
    try:
        await transport.connect(timeout=connect_timeout)
        try:
            guard = await identity.claim(
                transport,
                settings.mqtt,
                node=pool.id,
                status_topic=topics.worker_status(pool.id),
                online=status_message(pool, "online"),
            )
            worker = PoolWorker(
                pool,
                transport,
                registry,
                feed=feed,
                replay=replay,
                audit=sink,
                probe=probe,
                providers=providers,
                models_dir=watched,
                meter=meter(pool, key, transport),
                seal_keys=SealKeys(KeyFolder(folder_of(pool.state_dir)), now=time.time()),
            )
            if watched is not None:
                known = read_priors(watched / PRIORS_FILE)
                for name, prior in priors_for(registry, known).items():
                    worker.service.seed(name, prior.image_ms, prior.batch_ms)
            metrics = metrics_server(pool, worker)
            try:
                if metrics is not None:
                    await metrics.start()
                    worker.metrics = metrics
                await identity.serve_guarded(guard, stop, worker.run)  # closes the probe at end
            finally:
                if metrics is not None:
                    await metrics.stop()
        finally:
            await transport.close()
    finally:
        if worker is None:
            probe.close()
        if client is not None:
            await client.aclose()
    return worker


def meter(pool: PoolSettings, key: SigningKey, transport: MqttTransport) -> Meter | None:
    """The worker's usage metering (not started), or None with ``[pool] metering`` off."""
    if not pool.metering:
        return None
    if pool.key_file is None:  # an ephemeral key's records would never verify at the broker
        log.warning(
            "worker %s runs unmetered: usage records are signed with its identity key, and "
            "[pool] key_file is not set",
            pool.id,
        )
        return None
    if pool.state_dir is None:
        log.warning(
            "worker %s keeps its usage records in memory only: set [pool] state_dir so that "
            "records not yet acknowledged by the broker survive a restart",
            pool.id,
        )
    path = ledger_path(pool.state_dir)
    return node_meter(path, key, transport, node=pool.id, kind="pool", settings=pool)


def metrics_server(pool: PoolSettings, worker: PoolWorker) -> MetricsServer | None:
    """The worker's ``/metrics`` server (not started), or None with ``metrics_enabled``
    off."""
    if not pool.metrics_enabled:
        return None
    return MetricsServer(
        worker_registry(pool.id, worker.scrape),
        host=pool.metrics_host,
        port=pool.metrics_port,
        setting="[pool] metrics_host/metrics_port",
    )
