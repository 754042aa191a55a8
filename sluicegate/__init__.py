"""Sluicegate: an edge-to-center broker for industrial machine-vision jobs over MQTT v5.

This package holds two floors. The kernel every role imports (wire models, topics, the MQTT
transport, configuration, metering, vision, enrollment) never imports a role; above the
roles, ``app`` (the command, the demo), ``twin``, ``doctor``, ``deploy`` and ``bundle`` put
them together, and nothing below imports them (``tests/test_layout.py``). The client vision
apps use::

    from sluicegate import Client
    with Client(edge="edge-1") as client:
        result = client.infer(jpeg_bytes, model="defect-v1", deadline_ms=200)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["AsyncClient", "Client", "JobFailed", "JobResult", "__version__"]

if TYPE_CHECKING:
    from sluicegate.client import AsyncClient, Client
    from sluicegate.wire import JobFailed, JobResult


def __getattr__(name: str) -> Any:
    # Lazy, so `import sluicegate.topics` does not pull in paho, OpenCV and ONNX Runtime.
    if name in ("AsyncClient", "Client"):
        from sluicegate import client

        return getattr(client, name)
    if name in ("JobFailed", "JobResult"):
        from sluicegate import wire

        return getattr(wire, name)
    raise AttributeError(f"module 'sluicegate' has no attribute {name!r}")
