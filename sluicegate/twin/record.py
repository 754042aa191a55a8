"""The recorder behind ``sluicegate twin record``: it listens to a running campus as an
observer and writes what it heard as a trace (``docs/twin.md``).

A thin shell over :class:`~sluicegate.twin.capture.Capture`: it connects with the observer's
own identity (its certificate; the ACL lets an observer read and write nothing else), takes
the retained policy, capabilities and status as they stand, hands every message to the
capture with the time it arrived, and, once the time is up or ``stop`` is set, waits until
every edge has sent its telemetry once more (its last records come just before it; two
intervals at most), then writes the file. It publishes nothing, so the campus does no more
work than its edges' one extra message per telemetry interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from sluicegate import identity
from sluicegate.config import MqttSettings
from sluicegate.errors import ConfigError
from sluicegate.mqtt import MqttTransport
from sluicegate.transport import Message
from sluicegate.twin import trace as tr
from sluicegate.twin.capture import Capture

log = logging.getLogger(__name__)

CATCH_UP_INTERVALS = 2.0  # how long, in telemetry intervals, the end waits for the edges


@dataclass(frozen=True)
class Recorded:
    """A trace written, and what was left out of it."""

    path: Path
    digest: str
    trace: tr.Trace
    left_out: dict[str, int]  # records not in the trace, by why
    refused: dict[str, int]  # documents refused, by kind
    notes: list[str]  # the first refusals, in words
    edge_dropped: int  # records the edges dropped themselves (their batch was full)
    unbatched: int  # offloaded jobs whose worker's completion was not heard (batch: 1)

    def summary(self) -> str:
        """What was written, in one paragraph."""
        t = self.trace
        edges = ", ".join(e.id for e in t.header.edges)
        workers = ", ".join(w.id for w in t.header.workers) or "none"
        lines = [
            f"wrote {self.path} (sha256 {self.digest[:16]}…): {len(t.jobs)} jobs over "
            f"{t.duration_s:.1f} s from edges {edges}; workers {workers}; "
            f"{len(t.telemetry)} telemetry records, {len(t.events)} node events"
        ]
        left = {why: n for why, n in sorted(self.left_out.items()) if n}
        if left:
            lines.append("left out: " + ", ".join(f"{n} {why}" for why, n in left.items()))
        if self.refused:
            kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(self.refused.items()))
            lines.append(f"refused documents: {kinds} (first: {self.notes[0]})")
        if self.edge_dropped:
            lines.append(f"the edges dropped {self.edge_dropped} records (their batch was full)")
        if self.unbatched:
            lines.append(
                f"{self.unbatched} offloaded jobs without their worker's completion: "
                "recorded as run alone (batch 1)"
            )
        return "\n".join(lines)


def client_id(mqtt: MqttSettings) -> str:
    """The observer's certificate name under TLS (Mosquitto makes it the client id); a
    name of this process's own in plaintext mode."""
    return identity.certificate_name(mqtt) or f"sg-twin-record-{os.getpid()}"


def check(mqtt: MqttSettings, out: Path) -> None:
    """Refuse before connecting: no identity to connect as, or nowhere to write."""
    if mqtt.tls_ca_file is None and not mqtt.plaintext:
        raise ConfigError(
            "the recorder connects as an observer: set [mqtt] tls_ca_file, tls_cert_file and "
            "tls_key_file to the observer's certificate (or plaintext = true, for debugging)"
        )
    if not out.parent.is_dir():
        raise ConfigError(f"cannot write {out}: the folder {out.parent} does not exist")


async def record(
    mqtt: MqttSettings,
    out: Path,
    stop: asyncio.Event,
    *,
    seconds: float | None = None,
    telemetry_interval_s: float | None = None,
    params: Mapping[str, object] | None = None,
    policy_text: str | None = None,
    ready: asyncio.Event | None = None,
    clock: Callable[[], float] = time.time,
    connect_timeout: float = 10.0,
) -> Recorded:
    """Record the campus ``mqtt`` reaches for ``seconds`` (None: until ``stop`` is set) and
    write the trace to ``out``. ``ready`` is set once every subscription is made: jobs that
    arrive from then on are in the trace. The other arguments go to :class:`Capture`."""
    check(mqtt, out)
    transport = MqttTransport(mqtt, client_id=client_id(mqtt))
    await transport.connect(timeout=connect_timeout)
    caught_up = asyncio.Event()
    try:
        capture = Capture(
            clock(),
            params=params,
            telemetry_interval_s=telemetry_interval_s,
            policy_text=policy_text,
        )

        def heard(msg: Message) -> None:
            why = capture.offer(msg.topic, msg.payload, now=clock(), retained=msg.retain)
            if why is not None:
                log.warning("refused a document: %s", why)
            if capture.caught_up():
                caught_up.set()

        for topic_filter in capture.filters():
            await transport.subscribe(topic_filter, heard, qos=1)
        if ready is not None:
            ready.set()
        log.info("recording: subscribed to %s", ", ".join(capture.filters()))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)
        capture.stop(clock())
        interval = capture.interval_s() or 1.0
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(caught_up.wait(), CATCH_UP_INTERVALS * interval)
    finally:
        await transport.close()
    trace = capture.trace()
    try:
        digest = tr.write(out, trace)
    except OSError as exc:
        raise ConfigError(f"cannot write {out}: {exc.strerror}") from exc
    return Recorded(
        out,
        digest,
        trace,
        dict(capture.left_out),
        dict(capture.refused),
        list(capture.notes),
        capture.edge_dropped(),
        capture.unbatched,
    )
