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


def usage_records(node_id: str) -> str:
    """Hash: a node's usage records by seq, each the first one held for that seq: its
    digest (64 hex), its ``prev`` (64 hex), then its countersigned line. Never overwritten."""
    return f"{PREFIX}:usage:records:{node_id}"


def usage_by_time() -> str:
    """Sorted set: ``<node>:<seq>`` of every usage record held, scored by its ``at_ms``
    (what an export's period selects)."""
    return f"{PREFIX}:usage:by-time"


def usage_heads() -> str:
    """Hash: node -> the highest seq of its usage records held (with the records' count,
    the gaps)."""
    return f"{PREFIX}:usage:heads"


def usage_peer_records(peer: str) -> str:
    """Hash: the usage records sister campus ``peer`` sent that concern this campus, by
    ``<node>:<seq>`` (its nodes' names, not ours), each its countersigned line, the first held."""
    return f"{PREFIX}:usage:peer:{peer}:records"


def usage_peer_by_time(peer: str) -> str:
    """Sorted set: ``<node>:<seq>`` of each record of :func:`usage_peer_records`, scored by
    its ``at_ms``."""
    return f"{PREFIX}:usage:peer:{peer}:by-time"


def usage_conflicts(node_id: str) -> str:
    """Hash: usage records of a node that differ from the one held for their seq, by their
    digest, as they came (kept aside for an investigation, capped)."""
    return f"{PREFIX}:usage:conflicts:{node_id}"
