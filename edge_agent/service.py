"""Wires a real edge agent together: settings, the MQTT transport with its Last Will, the
verified model registry. ``sluicegate edge run`` and the demo call :func:`serve`.
"""

from __future__ import annotations

import asyncio

from edge_agent.agent import EdgeAgent, last_will
from sluicegate.config import Settings
from sluicegate.mqtt import MqttTransport
from sluicegate.vision.runtime import ModelRegistry, default_models_dir


def load_registry(settings: Settings) -> ModelRegistry:
    edge = settings.edge
    return ModelRegistry.from_dir(
        edge.models_dir or default_models_dir(), intra_op_threads=edge.intra_op_threads
    )


async def serve(
    settings: Settings,
    stop: asyncio.Event,
    *,
    registry: ModelRegistry | None = None,
    connect_timeout: float | None = None,
) -> EdgeAgent:
    """Run an edge agent until ``stop`` is set; returns the agent (for its counters)."""
    registry = registry or load_registry(settings)
    transport = MqttTransport(
        settings.mqtt,
        client_id=f"sg-edge-{settings.edge.id}",
        will=last_will(settings.edge),
        clean_start=False,
        session_expiry_s=settings.mqtt.session_expiry_s,
    )
    await transport.connect(timeout=connect_timeout)
    agent = EdgeAgent(settings.edge, transport, registry)
    try:
        await agent.run(stop)
    finally:
        await transport.close()
    return agent
