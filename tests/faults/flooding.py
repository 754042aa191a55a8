"""Real jobs at a steady rate while an edge is flooded with malformed requests.

:func:`flood_while_serving` runs three phases on one edge of a :class:`~tests.faults.rig.Rig`:
real jobs alone (``before``), real jobs under the flood, real jobs alone again (``after``:
the edge must still serve). It samples the edge's resident memory throughout and counts the
refusals the edge sends back to the flood's response topic. Latency is per real job, from
publication to its first result, as the app sees it. The test asserts completeness only;
``bench/flood.py`` prints the figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from sluicegate.mqtt import MqttTransport
from sluicegate.transport import Message
from tests.faults.app import App
from tests.faults.ledger import Verdict
from tests.faults.malformed import Flooder, Kind
from tests.faults.rig import FLOOD_RESULTS, Rig, image_for, read_rss


@dataclass
class FloodReport:
    verdict: Verdict
    real_by_phase: dict[str, int]
    latency_ms: dict[str, dict[str, float]]  # phase -> p50, p99
    flood_sent: Counter[str]
    flood_dropped_connections: Counter[str]
    refusals: Counter[str]  # by code, as the edge answered the flood
    rss_mib: dict[str, float]  # before (median), peak (during or after), after (last)
    mosquitto_rss_mib: dict[str, float]
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def real_completed(self) -> int:
        return self.verdict.answered


class _Refusals:
    """Listens where the flooders ask for answers: their apps' results prefix."""

    def __init__(self, rig: Rig) -> None:
        self.topic = f"{FLOOD_RESULTS}/{uuid.uuid4().hex[:8]}"
        self.codes: Counter[str] = Counter()
        self._transport = MqttTransport(rig.mqtt("flood-listen"), client_id="flood-listen")

    async def start(self) -> None:
        await self._transport.connect(10.0)
        await self._transport.subscribe(self.topic, self._on, qos=0)

    def _on(self, msg: Message) -> None:
        code = "?"
        with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
            doc = json.loads(msg.payload)
            code = str(doc.get("code") or doc.get("status"))
        self.codes[code] += 1

    async def close(self) -> None:
        await self._transport.close()


async def _steady(
    app: App, edge: str, prefix: str, rate: float, seconds: float, phases: dict[str, str]
) -> None:
    """Submit real jobs at ``rate``/s for ``seconds``; ``phases`` maps each id to the phase
    current when it was published (read from ``phases['now']``)."""
    tasks: set[asyncio.Task[bool]] = set()
    start = time.monotonic()
    n = 0
    while time.monotonic() - start < seconds:
        job_id = f"{prefix}-{n}"
        phases[job_id] = phases["now"]
        task = asyncio.ensure_future(app.submit(edge, job_id, image_for(job_id)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        n += 1
        await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))  # the pace
    if tasks:
        await asyncio.wait(tasks)


async def flood_while_serving(
    rig: Rig,
    *,
    edge: str = "line-1-pc",
    flood_rate: float = 1000.0,
    flood_s: float = 10.0,
    real_rate: float = 20.0,
    before_s: float = 3.0,
    after_s: float = 2.0,
    payload_limit: int,
    settle_timeout: float = 30.0,
    seed: int = 0,
    kinds: list[Kind] | None = None,
) -> FloodReport:
    """Serve real jobs at ``real_rate`` for ``before_s``, then under the flood for
    ``flood_s``, then for ``after_s``; wait (bounded) for every real result."""
    app = await App(rig.mqtt()).start()
    refusals = _Refusals(rig)
    await refusals.start()
    edge_pid = rig.campus.pid(edge)
    assert edge_pid is not None, f"{edge} is not running"
    assert rig.mosquitto is not None
    samples: dict[str, list[float]] = {"before": [], "flood": [], "after": []}
    mosquitto: list[float] = []
    phases: dict[str, str] = {"now": "before"}
    logins = {
        name: (rig.files.client_context(f"flood-{name}"), f"flood-{name}")
        for name in ("main", "bad")
    }
    flooder = Flooder(
        rig.mqtt_port,
        edge,
        logins=logins,
        rate=flood_rate,
        reply_topic=refusals.topic,
        payload_limit=payload_limit,
        seed=seed,
        kinds=kinds,
    )
    stop_sampling = asyncio.Event()

    async def sample() -> None:
        while not stop_sampling.is_set():
            rss, _ = read_rss(edge_pid)
            if rss is not None:
                samples[phases["now"]].append(rss)
            mq, _ = read_rss(rig.mosquitto.pid) if rig.mosquitto else (None, None)
            if mq is not None:
                mosquitto.append(mq)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop_sampling.wait(), 0.1)

    seconds: dict[str, float] = {}
    t0 = time.monotonic()
    sampler = asyncio.ensure_future(sample())
    try:
        load = asyncio.ensure_future(
            _steady(app, edge, "real", real_rate, before_s + flood_s + after_s, phases)
        )
        await asyncio.sleep(before_s)  # the phases are timed: this is the schedule
        phases["now"] = "flood"
        reset_peak_rss(edge_pid)  # from here the kernel's high-water mark is the flood's
        seconds["flood_start"] = time.monotonic() - t0
        flooder.run_for(flood_s)
        await asyncio.to_thread(flooder.join, flood_s + 30.0)
        phases["now"] = "after"
        seconds["flood_end"] = time.monotonic() - t0
        await load
        await app.wait_results(settle_timeout)
        seconds["settled"] = time.monotonic() - t0
    finally:
        flooder.stop()
        stop_sampling.set()
        await sampler
        await refusals.close()
        await app.close()
    _, hwm = read_rss(edge_pid)  # the peak since the flood began, if it could be reset
    peak = max([*samples["flood"], *samples["after"]] or [float("nan")])
    latency: dict[str, dict[str, float]] = {}
    counts: Counter[str] = Counter()
    for job_id in app.ledger.jobs:
        counts[phases.get(job_id, "?")] += 1
    for phase in ("before", "flood", "after"):
        lat = [
            (record.first_result_at - record.published_at) * 1000.0
            for job_id, record in app.ledger.jobs.items()
            if phases.get(job_id) == phase and record.first_result_at is not None
        ]
        latency[phase] = {
            "p50": float(np.percentile(lat, 50)) if lat else float("nan"),
            "p99": float(np.percentile(lat, 99)) if lat else float("nan"),
        }
    before = samples["before"] or [0.0]
    return FloodReport(
        verdict=app.ledger.verdict(),
        real_by_phase=dict(counts),
        latency_ms=latency,
        flood_sent=flooder.sent,
        flood_dropped_connections=flooder.dropped_connections,
        refusals=refusals.codes,
        rss_mib={
            "before": float(np.median(before)),
            "peak": peak,
            "after": samples["after"][-1] if samples["after"] else float("nan"),
            "hwm_since_flood": hwm or float("nan"),
        },
        mosquitto_rss_mib={"peak": max(mosquitto or [0.0])},
        seconds=seconds,
    )


def reset_peak_rss(pid: int) -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of ``pid`` to its current RSS; False where
    that is not allowed (then VmHWM still counts from the process's start)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return True
