"""Every Redis key the campus broker uses, in one place.

All keys share the ``sluicegate:`` prefix of the compliance stores; the audit stream and the
token nonces are named by ``policies.redis_stores``. Nothing else spells a broker key out.
"""

from __future__ import annotations

PREFIX = "sluicegate:broker"


def node(node_id: str) -> str:
    """Hash: a node's latest capabilities/telemetry JSON; expires when the node goes silent."""
    return f"{PREFIX}:node:{node_id}"


def reservations(worker_id: str) -> str:
    """Sorted set: job ids placed on a worker and not yet completed, scored by expiry (ms)."""
    return f"{PREFIX}:reserve:{worker_id}"


def job(job_id: str) -> str:
    """Hash: a job's placement status and the decision's explanation."""
    return f"{PREFIX}:job:{job_id}"
