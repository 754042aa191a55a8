"""Every Redis key the campus broker uses, in one place.

All keys share the ``sluicegate:`` prefix of the compliance stores; the audit stream and the
token nonces are named by ``policies.redis_stores``. Nothing else spells a broker key out
(the in-flight Lua scripts get :data:`INFLIGHT_PREFIX` as an argument, never a literal).
"""

from __future__ import annotations

PREFIX = "sluicegate:broker"
INFLIGHT_PREFIX = f"{PREFIX}:inflight:"


def node(node_id: str) -> str:
    """Hash: a node's latest capabilities/telemetry JSON; expires when the node goes silent."""
    return f"{PREFIX}:node:{node_id}"


def reservations(worker_id: str) -> str:
    """Sorted set: job ids placed on a worker and not yet completed, scored by expiry (ms)."""
    return f"{PREFIX}:reserve:{worker_id}"


def job(job_id: str) -> str:
    """Hash: a job's placement status, as later events set it."""
    return f"{PREFIX}:job:{job_id}"


def job_decision(job_id: str) -> str:
    """String: the job's latest decision record with its explanation (JSON). Its own key,
    so a decision is one command (``SET .. EX``), not a field write plus an expiry."""
    return f"{PREFIX}:job:{job_id}:decision"


def inflight(job_id: str) -> str:
    """Hash: a placed job's current placement (edge, worker, attempt, deadline, placed at)
    and what outlives its attempts (crashes, the workers that died with it, dead letter).
    Expires well after the job's deadline; a completion of the current attempt removes it."""
    return f"{INFLIGHT_PREFIX}{job_id}"


def inflight_on(worker_id: str) -> str:
    """Sorted set: jobs in flight on a worker, scored by when their record may go (ms). A
    worker's death takes the whole set at once (one replica wins it)."""
    return f"{PREFIX}:inflight-on:{worker_id}"


def inflight_workers() -> str:
    """Sorted set: workers that hold jobs in flight, scored by their latest record's expiry
    (ms); what a broker, restarted or not, watches for silent workers."""
    return f"{PREFIX}:inflight-workers"


def dead_letters() -> str:
    """Sorted set: dead-lettered job ids by the time (ms) they were dead-lettered."""
    return f"{PREFIX}:dead-letters"


def join_token(token_id: str) -> str:
    """String: a join token already used (single use); expires with the token."""
    return f"{PREFIX}:join:{token_id}"


def replica_lease(broker_id: str) -> str:
    """String: the instance that serves as broker replica ``broker_id`` (expires unless its
    holder renews it): a second process with the same id refuses to start."""
    return f"{PREFIX}:replica:{broker_id}"


def operator_holds() -> str:
    """Hash: operators' holds in force (a drained or cordoned worker, a paused line), one
    JSON document per field (``broker.console.holds``); every replica applies them."""
    return f"{PREFIX}:operator-holds"
