"""Which process this is: an instance id, when it started, on which host. Each node's
retained status carries it (``wire.node_status``), so two processes serving one identity
can tell each other apart (``sluicegate.identity``).
"""

from __future__ import annotations

import socket
import time
import uuid
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Instance:
    """One process serving a node: a random id, when it started, on which host."""

    id: str
    since: float
    host: str

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since))
        return f"instance {self.id} on host {self.host!r}, serving since {started}"


_PROCESS = Instance(uuid.uuid4().hex[:16], time.time(), socket.gethostname())


def this_process() -> Instance:
    """The instance this process is (the same for every role it runs)."""
    return _PROCESS
