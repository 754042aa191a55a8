"""Stamps for bench/offload_trace.py: loaded (as ``sitecustomize``) by every Python process
started with ``bench/trace`` on its ``PYTHONPATH`` and ``SG_TRACE`` set to a directory.

In each campus node (``sluicegate <role> run``) it records, with the wall clock, every
message the MQTT transport hands to a handler and every publish, with the job it belongs
to (the ``job-id`` user property, or ``job_id`` in a JSON payload), and the start and end of
each Redis reservation call of the broker, and when an edge's outbox has committed a job's
acceptance; one file per process, written at exit. Nothing
here changes what the processes do. A measuring tool, not part of Sluicegate.
"""

from __future__ import annotations

import atexit
import importlib.abc
import os
import re
import sys
import time
from typing import Any

_DIR = os.environ.get("SG_TRACE")
_JOB = re.compile(rb'"job_id"\s*:\s*"([^"]+)"')
# Per-sender topics end in the sender's id (``sluicegate.topics.sender``): what they are is
# the level before it.
_PER_SENDER = {"request", "release", "completions", "returns", "work"}


def _what(topic: str) -> str:
    """What a topic carries, in one word: its last level, or the one before the sender's
    id on a per-sender topic (``.../work/line-1-pc`` is ``work``)."""
    levels = topic.rsplit("/", 2)
    if len(levels) == 3 and levels[1] in _PER_SENDER:
        return levels[1]
    return levels[-1]


def _role() -> str | None:
    for i, arg in enumerate(sys.argv[1:], start=1):
        if arg == "run":
            return sys.argv[i - 1]
    return None


def _job(payload: bytes, props: Any) -> str:
    for key, value in props or ():
        if key == "job-id":
            return str(value)
    if payload[:1] == b"{":
        found = _JOB.search(payload[:800])
        if found:
            return found.group(1).decode()
    return "-"


def _install(role: str, lines: list[str]) -> None:
    import broker.reservations as reservations
    import edge_agent.events as ev
    import edge_agent.sequencer as sequencer
    import sluicegate.mqtt as mqtt
    import sluicegate.mqtt.routing as routing

    pid = os.getpid()

    def stamp(kind: str, topic: str, job: str) -> None:
        lines.append(f"{time.time():.6f} {pid} {role} {kind} {_what(topic)} {job}\n")

    handed = routing.call  # where the transport hands each message to its handler

    def call(handler: Any, message: Any) -> None:
        stamp("in", message.topic, _job(message.payload, message.user_properties))
        handed(handler, message)

    published = mqtt.MqttTransport.publish_nowait

    def publish_nowait(self: Any, message: Any) -> int:
        stamp("out", message.topic, _job(message.payload, message.user_properties))
        return published(self, message)

    reserve = reservations.Reservations.reserve_many

    async def reserve_many(self: Any, holds: Any, now_ms: int) -> Any:
        start = time.time()
        granted = await reserve(self, holds, now_ms)
        end = time.time()
        for hold in holds:
            lines.append(f"{start:.6f} {pid} {role} redis reserve {hold.job_id}\n")
            lines.append(f"{end:.6f} {pid} {role} redis reserved {hold.job_id}\n")
        return granted

    dispatched = sequencer.Sequencer.dispatch

    def on_event(self: Any, entry: Any, event: Any, msg: Any = None) -> None:
        if isinstance(event, ev.Accepted):
            lines.append(f"{time.time():.6f} {pid} {role} outbox accepted {entry.job.job_id}\n")
        dispatched(self, entry, event, msg)

    sequencer.Sequencer.dispatch = on_event  # type: ignore[method-assign]
    routing.call = call
    mqtt.MqttTransport.publish_nowait = publish_nowait  # type: ignore[method-assign]
    reservations.Reservations.reserve_many = reserve_many  # type: ignore[method-assign]


class _Hook(importlib.abc.MetaPathFinder):
    """Installs the stamps as the CLI is imported (its modules are importable by then)."""

    def __init__(self, role: str, lines: list[str]) -> None:
        self.role = role
        self.lines = lines

    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        if name == "sluicegate.app.cli":
            sys.meta_path.remove(self)
            _install(self.role, self.lines)


def _start(directory: str, role: str) -> None:
    lines: list[str] = []

    @atexit.register
    def _write() -> None:
        with open(os.path.join(directory, f"{os.getpid()}.log"), "a") as out:
            out.writelines(lines)

    sys.meta_path.insert(0, _Hook(role, lines))


_ROLE = _role()
if _DIR and _ROLE:
    _start(_DIR, _ROLE)
