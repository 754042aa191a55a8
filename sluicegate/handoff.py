"""The bound on what a network thread may hand to the event loop before it must wait.

:class:`Budget` counts messages and their bytes together: a taker waits while either limit
is reached, so a slow consumer pushes back on the network thread (and TCP on the sender)
instead of memory growing, whether the messages are many and small or few and large. One
message larger than the whole byte budget still passes when nothing else is held, so no
message can wedge the hand-off. Pure ``threading``; it knows nothing of MQTT.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Budget:
    """At most ``max_items`` items and ``max_bytes`` bytes held at once."""

    def __init__(self, max_items: int, max_bytes: int) -> None:
        if max_items < 1 or max_bytes < 1:
            raise ValueError(
                f"a hand-off budget needs at least 1 item and 1 byte; got {max_items} items "
                f"and {max_bytes} bytes"
            )
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.items = 0
        self.bytes = 0
        self._cond = threading.Condition()

    def _fits(self, size: int) -> bool:
        if self.items >= self.max_items:
            return False
        return self.items == 0 or self.bytes + size <= self.max_bytes

    def take(self, size: int, *, give_up: Callable[[], bool], poll_s: float = 0.5) -> bool:
        """Hold ``size`` bytes as one item, waiting while the budget is spent; False if
        ``give_up()`` turned true while waiting (checked every ``poll_s``)."""
        with self._cond:
            while not self._fits(size):
                if give_up():
                    return False
                self._cond.wait(poll_s)
            self.items += 1
            self.bytes += size
            return True

    def give_back(self, size: int) -> None:
        """Release one item of ``size`` bytes taken before."""
        with self._cond:
            if self.items <= 0:
                raise RuntimeError("hand-off budget released more often than it was taken")
            self.items -= 1
            self.bytes -= size
            self._cond.notify_all()
