"""A subscription a node makes only once its policy opens the topic: a sister campus's work
or returns, which the generated ACL grants only while the policy names such a peer (a
subscription before that would be refused). The shells of the worker and the edge agent
hold one each.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from sluicegate.errors import TransportError
from sluicegate.transport import Handler, Transport

log = logging.getLogger(__name__)


class LateSubscription:
    """One subscription a node makes only once ``topic()`` names it (None: not yet), as a
    policy that opens it may come after the node started (a sister campus's work or
    returns: the ACL grants them only then). :meth:`ensure` at start, :meth:`soon` on each
    policy change; a subscription refused is logged and tried again at the next."""

    def __init__(
        self,
        transport: Transport,
        topic: Callable[[], str | None],
        handler: Handler,
        *,
        what: str,
        manual_ack: bool = False,
    ) -> None:
        self._transport = transport
        self._topic = topic
        self._handler = handler
        self._what = what
        self._manual_ack = manual_ack
        self.topic: str | None = None  # once subscribed
        self._task: asyncio.Task[None] | None = None

    async def ensure(self) -> None:
        topic = self._topic()
        if self.topic is not None or topic is None:
            return
        self.topic = topic
        try:
            await self._transport.subscribe(topic, self._handler, manual_ack=self._manual_ack)
        except TransportError as exc:
            self.topic = None
            log.warning("not subscribed to %s (%s): %s", topic, self._what, exc)
            return
        log.info("subscribed to %s (%s)", topic, self._what)

    def soon(self, *_changed: object) -> None:
        """:meth:`ensure`, from a callback (a policy feed's ``on_change``)."""
        self._task = asyncio.get_running_loop().create_task(self.ensure())
