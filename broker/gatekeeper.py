"""The broker's checks of who is speaking, carried out: ``broker.core.identity``'s verdicts on
each message, against the policy held now, counted and audited.

Every refusal is counted by code (``sluicegate_identity_refusals_total``); one of a node's
messages (a worker's capabilities or telemetry, a completion or a release naming another
node) is logged and audited (``identity.refused``) once per node, code and policy, so a
node that keeps trying does not flood the log. Placement requests are refused to their
edge, with the code, by the caller.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from broker.core.identity import IdentityRefusal, edge_origin, same_sender, worker_standing
from broker.decision_audit import DecisionAudit, encode
from broker.metrics import BrokerMetrics
from policies import Policy
from sluicegate import topics
from sluicegate.transport import Message

log = logging.getLogger(__name__)

AUDITED_KEPT = 10_000  # (node, code, policy) refusals remembered as audited already


class Gatekeeper:
    def __init__(
        self, policy: Callable[[], Policy | None], metrics: BrokerMetrics, audit: DecisionAudit
    ) -> None:
        self._policy = policy
        self._metrics = metrics
        self._audit = audit
        self._audited: set[tuple[str, str, bytes]] = set()

    def origin(self, policy: Policy, edge_id: str, claimed: str) -> str | IdentityRefusal:
        """The origin zone of a request on ``edge_id``'s topic naming ``claimed``, or the
        refusal to answer it with (counted)."""
        origin = edge_origin(policy, edge_id, claimed)
        if isinstance(origin, IdentityRefusal):
            self._metrics.identity_refusals.labels(origin.code).inc()
        return origin

    def worker(self, msg: Message, worker_id: str, zone: str) -> bool:
        """Whether the worker whose topic carried ``msg`` may be placed on as it describes
        itself (``worker_id``, ``zone``)."""
        sender = topics.node_of(msg.topic)
        policy = self._policy()
        refusal = None if policy is None else worker_standing(policy, sender, worker_id, zone)
        if refusal is None:
            return policy is not None
        self.refuse(sender, "worker", refusal, policy)
        return False

    def own(self, what: str, role: str, msg: Message, claimed: str | None) -> bool:
        """Whether a ``what`` (completion, release) names the ``role`` whose topic carried
        it."""
        sender = topics.sender(msg.topic)
        refusal = same_sender(what, sender, claimed)
        if refusal is not None:
            self.refuse(sender, role, refusal, self._policy())
        return refusal is None

    def refuse(
        self, sender: str, kind: str, refusal: IdentityRefusal, policy: Policy | None
    ) -> None:
        self._metrics.identity_refusals.labels(refusal.code).inc()
        seen = (sender, refusal.code, policy.digest if policy is not None else b"")
        if seen in self._audited:
            return
        if len(self._audited) > AUDITED_KEPT:
            self._audited.clear()
        self._audited.add(seen)
        log.warning("refused %s %s [%s]: %s", kind, sender, refusal.code, refusal.reason)
        record = {"node": sender, "kind": kind, "code": refusal.code, "reason": refusal.reason}
        self._audit.add(sender, encode(record), "identity.refused")
