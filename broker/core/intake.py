"""Which telemetry the broker still has to read, and which it lets go: the rules, pure.

Telemetry is worth only its latest sample per node, so the broker keeps at most one unread
sample per node in a :class:`Backlog`: a sample that arrives before the previous one was
read replaces it (*coalesced*: nothing of value is lost, the newer figures supersede the
older). Reading happens in slices between urgent work (placement requests, releases,
completions are never queued here). When the broker falls so far behind that a sample has
waited longer than ``shed_after_s`` unread, it is *shed*: dropped unread, counted, and the
node's previous sample stays in the view until a fresh one is read. Under overload the
fleet view therefore grows older, visibly, while placements keep their pace. The clock is
passed in; nothing here reads one, decodes anything or does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Taken:
    """One slice read from the backlog: ``(node, payload)`` to read, and how many shed."""

    samples: list[tuple[str, bytes]]
    shed: int


@dataclass(slots=True)
class Backlog:
    """The unread latest sample of each node, oldest arrival first."""

    shed_after_s: float
    # node -> (payload, arrived); a dict keeps insertion order, and a node's entry is
    # moved to the end when replaced, so the first entries are always the oldest.
    _unread: dict[str, tuple[bytes, float]] = field(default_factory=dict)
    coalesced: int = 0  # replaced before being read, since start
    shed: int = 0  # dropped unread after shed_after_s, since start

    def __len__(self) -> int:
        return len(self._unread)

    def offer(self, node: str, payload: bytes, now: float) -> None:
        """Keep ``payload`` as ``node``'s latest unread sample."""
        if self._unread.pop(node, None) is not None:
            self.coalesced += 1
        self._unread[node] = (payload, now)

    def oldest_age(self, now: float) -> float:
        """How long the oldest unread sample has waited (0 when none)."""
        for _payload, arrived in self._unread.values():
            return max(0.0, now - arrived)
        return 0.0

    def take(self, most: int, now: float) -> Taken:
        """Up to ``most`` samples to read, oldest first; samples older than
        ``shed_after_s`` are dropped on the way and counted."""
        samples: list[tuple[str, bytes]] = []
        shed = 0
        unread = self._unread
        while unread and len(samples) < most:
            node = next(iter(unread))
            payload, arrived = unread.pop(node)
            if now - arrived > self.shed_after_s:
                shed += 1
            else:
                samples.append((node, payload))
        self.shed += shed
        return Taken(samples, shed)
