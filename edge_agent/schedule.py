"""The edge's announced work: what its apps say is coming, taken in, answered and reported.

An app publishes a ``wire.Announcement`` on ``topics.edge_schedule`` (only the apps of this
edge may write there). Each is read once here: a malformed one is refused
``bad_announcement`` naming the field, the rest go through the pure
:class:`sluicegate.schedule.Book` (a window over, too long, too far ahead, for a model this
edge does not serve, too many at once: each refused by name). The sender gets a
``wire.AnnouncementReply`` on its Response Topic, when the policy lets this edge answer
there (as for a job); and on every change the edge publishes its book whole on
``topics.edge_announced`` (retained, expiring with its last window), each window with the
images a second it runs itself of that model (its compute slots over its service time),
which the brokers read as the leading part of their demand signal. No job's path goes
through here.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Collection

from pydantic import ValidationError

from edge_agent.admission import results_topics
from policies.model import Policy
from sluicegate import topics, wire
from sluicegate.schedule import Book, Refused, local_rates
from sluicegate.transport import Message, Transport

log = logging.getLogger(__name__)
RESULT_CONTENT_TYPE = "application/json"


class Schedule:
    """One edge's announcements (loop thread only)."""

    def __init__(
        self,
        *,
        edge_id: str,
        zone: str,
        transport: Transport,
        models: Callable[[], Collection[str]],
        local_per_s: Callable[[str], float],
        policy: Callable[[], Policy | None],
        clock: Callable[[], float],
    ) -> None:
        self._edge_id = edge_id
        self._zone = zone
        self._transport = transport
        self._models = models
        self._local_per_s = local_per_s
        self._policy = policy
        self._clock = clock
        self.book = Book()
        self.answered: Counter[str] = Counter()  # accepted, withdrawn, or the refusal's code

    def on_message(self, msg: Message) -> None:
        now = self._clock()
        try:
            a = wire.Announcement.model_validate_json(msg.payload)
        except ValidationError as exc:
            self._answer(msg, None, Refused("bad_announcement", _first_error(exc)))
            return
        refused = self.book.take(a, now, self._models())
        self._answer(msg, a, refused)
        if refused is None:
            self.publish(now)

    def report(self, now: float) -> wire.EdgeSchedule:
        """The book as the brokers are told it."""
        live = self.book.live(now)
        windows = [
            wire.Announced(
                announcement_id=a.announcement_id,
                starts_at=a.starts_at,
                ends_at=a.ends_at,
                rate_per_s=a.rate_per_s,
                model=a.model,
                data_class=a.data_class,
                local_per_s=round(local, 3),
                reason=a.reason,
            )
            for a, local in zip(live, local_rates(live, self._local_per_s), strict=True)
        ]
        return wire.EdgeSchedule(node=self._edge_id, zone=self._zone, ts=now, windows=windows)

    def publish(self, now: float) -> None:
        """The book, retained until its last window ends (an empty book clears it)."""
        doc = self.report(now)
        last = max((w.ends_at for w in doc.windows), default=now)
        self._transport.publish_nowait(
            Message(
                topics.edge_announced(self._edge_id),
                doc.model_dump_json().encode() if doc.windows else b"",
                qos=1,
                retain=True,
                message_expiry_s=max(1, math.ceil(last - now)) if doc.windows else None,
            )
        )

    def _answer(self, msg: Message, a: wire.Announcement | None, refused: Refused | None) -> None:
        what = a.announcement_id if a is not None else None
        if refused is not None:
            self.answered[refused.code] += 1
            reply = wire.AnnouncementReply(
                announcement_id=what, status="refused", code=refused.code, reason=refused.reason
            )
            log.warning("announcement %s refused [%s]: %s", what, refused.code, refused.reason)
        else:
            status = "withdrawn" if a is not None and a.withdraw else "accepted"
            self.answered[status] += 1
            reply = wire.AnnouncementReply(announcement_id=what, status=status)
            log.info("announcement %s %s", what, status)
        topic = msg.response_topic
        if topic is None:
            return
        policy = self._policy()
        allowed = results_topics(policy, self._edge_id) if policy is not None else ()
        if allowed and not any(topics.matches(f, topic) for f in allowed):
            log.warning(
                "announcement %s: may not answer on Response Topic %r (the policy lets this "
                "edge's apps take answers on %s)",
                what,
                topic,
                ", ".join(allowed),
            )
            return
        self._transport.publish_nowait(
            Message(
                topic,
                reply.model_dump_json().encode(),
                qos=1,
                correlation_data=msg.correlation_data,
                content_type=RESULT_CONTENT_TYPE,
            )
        )


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "the document"
    return f"{where}: {err['msg']}"
