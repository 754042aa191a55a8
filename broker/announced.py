"""The lines' announced work, as their edges report it: the leading part of the demand
signal (``broker.core.demand.announced_per_pool``).

Each edge publishes its accepted announcements whole, retained, on
``topics.edge_announced`` (``edge_agent.schedule``); every replica reads them all (few, and
rare). A document is read once here: it must parse, name the edge its topic names (the ACL
lets only that edge write there) and come from an edge the policy lists; an empty payload
clears the edge's book. What fails is counted by reason and logged, and the edge's earlier
book stays.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from pydantic import ValidationError

from policies.model import Policy
from sluicegate import topics
from sluicegate.transport import Message
from sluicegate.wire import EdgeSchedule

log = logging.getLogger(__name__)


class Announced:
    """Every edge's announced work this replica holds (loop thread only)."""

    def __init__(self, policy: Callable[[], Policy | None]) -> None:
        self._policy = policy
        self.schedules: dict[str, EdgeSchedule] = {}
        self.refused: Counter[str] = Counter()

    def on_message(self, msg: Message) -> None:
        edge = topics.node_of(msg.topic)
        if not msg.payload:
            self.schedules.pop(edge, None)
            return
        try:
            doc = EdgeSchedule.model_validate_json(msg.payload)
        except ValidationError as exc:
            self._refuse("malformed", edge, str(exc.errors()[0]["msg"]))
            return
        if doc.node != edge:
            self._refuse("not_its_topic", edge, f"names edge {doc.node!r}")
            return
        policy = self._policy()
        if policy is not None and policy.edge(edge) is None:
            self._refuse("unlisted_edge", edge, "the policy lists no such edge")
            return
        self.schedules[edge] = doc

    def _refuse(self, code: str, edge: str, why: str) -> None:
        self.refused[code] += 1
        log.warning("announced work of edge %s ignored [%s]: %s", edge, code, why)
