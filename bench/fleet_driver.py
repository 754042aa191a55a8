"""Real edges asking for real placements: the fleet benchmarks' driver.

Each driver edge is a campus edge identity (line-1-pc, line-2-pc, ``bench-edge-<k>``) on
its own ``sluicegate.mqtt.MqttTransport`` with its certificate, asking through the edge
agent's own ``edge_agent.offload.PlacementClient``: the same request, the same 50 ms
timeout (``[offload] placement_timeout_ms``'s default), the same check of the broker's
token against the edge's copy of the policy, and the same hand-back (``release``) of a
placement answered after the edge stopped waiting. A placement that arrives in time is
*completed*, not released: the driver tells the simulated worker it was placed on
(``bench/fleet_sim.py``), which sends the worker's ``Completion`` after its service time,
so the broker's slot is freed the way production frees it.

Each request's outcome is recorded: placed (and on which worker, by which replica),
refused (with the broker's code), or timed out, with the answer's latency from
``place()`` to its outcome. A tap on each edge's transport (a wrapper that sees the reply
topic's messages before the client does) records every raw reply, so a job answered twice
(by two replicas, say) is seen even though the client takes only the first answer.
Requests go open-loop at a fixed total rate, or closed-loop with a window outstanding.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench import stats
from edge_agent.admission import Job
from edge_agent.offload import PlacementClient
from edge_agent.rules import Placement
from policies import Policy
from sluicegate.config import OffloadSettings
from sluicegate.mqtt import MqttTransport
from sluicegate.transport import Handler, Message
from sluicegate.vision.image import ImageInfo

TIMEOUT_S = OffloadSettings().placement_timeout_ms / 1000.0
MODEL, CLASS = "defect-v1", "wafer-image"
DEADLINE_S = 2.0  # a generous deadline: placements are refused for capacity, not time
IMAGE = ImageInfo("jpeg", 640, 480)


@dataclass(slots=True)
class Ask:
    """One placement request and what became of it (times: ``time.monotonic``)."""

    job_id: str
    edge: str
    sent: float
    latency_ms: float = float("nan")
    kind: str = ""  # placed | refused | timeout
    code: str = ""
    worker: str = ""
    broker: str = ""
    answered_at: float = 0.0


class Tap:
    """A transport wrapper: every message on a placement reply topic is noted (job id,
    status, replica, worker) before the real handler gets it."""

    def __init__(self, inner: MqttTransport, replies: dict[str, list[tuple[str, str, str]]]):
        self.inner = inner
        self.replies = replies

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def connected(self) -> bool:
        return self.inner.connected

    def publish_nowait(self, message: Message) -> object:
        return self.inner.publish_nowait(message)

    async def subscribe(
        self, topic_filter: str, handler: Handler, *, qos: int = 1, manual_ack: bool = False
    ) -> None:
        if topic_filter.endswith("/placement"):
            inner = handler

            def handler(msg: Message) -> None:
                try:
                    doc = json.loads(msg.payload)
                    note = (
                        doc.get("status", "?"),
                        doc.get("broker_id") or "",
                        doc.get("worker_id") or "",
                    )
                    self.replies.setdefault(doc.get("job_id", "?"), []).append(note)
                except ValueError:
                    pass
                inner(msg)

        await self.inner.subscribe(topic_filter, handler, qos=qos, manual_ack=manual_ack)


class RecordingClient(PlacementClient):
    """The edge's placement client, noting the job ids of the placements it hands back."""

    released_jobs: list[tuple[str, str]]

    def release(self, job_id: str, worker_id: str, attempt: int, reason: str) -> None:
        self.released_jobs.append((job_id, worker_id))
        super().release(job_id, worker_id, attempt, reason)


@dataclass
class Driver:
    identities: list[str]
    settings: Callable[[str], Any]  # identity -> MqttSettings
    policy: Policy
    on_placed: Callable[[Ask], None]
    tag: str = field(default_factory=lambda: f"{int(time.time()) % 100000}")
    replies: dict[str, list[tuple[str, str, str]]] = field(default_factory=dict)
    asks: list[Ask] = field(default_factory=list)

    async def start(self) -> None:
        self.transports: list[MqttTransport] = []
        self.clients: list[RecordingClient] = []
        for identity in self.identities:
            transport = MqttTransport(self.settings(identity), client_id=identity)
            await transport.connect(timeout=15)
            entry = self.policy.edge(identity)
            assert entry is not None, f"{identity} is not an edge of the policy"
            client = RecordingClient(
                Tap(transport, self.replies),
                edge_id=identity,
                zone=entry.zone,
                policy=lambda: self.policy,
                timeout_s=TIMEOUT_S,
                clock=time.time,
            )
            client.released_jobs = []
            await client.start()
            self.transports.append(transport)
            self.clients.append(client)
        self._n = 0
        self._stop_at = 0.0

    async def wait_brokers(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not all(c.broker_available for c in self.clients):
            if time.monotonic() > deadline:
                raise SystemExit("the driver's edges see no broker online")
            await asyncio.sleep(0.1)

    @property
    def released(self) -> list[tuple[str, str]]:
        return [r for c in self.clients for r in c.released_jobs]

    def ask(self) -> Ask:
        """One placement request now, from the next edge in turn."""
        i = self._n
        self._n += 1
        k = i % len(self.clients)
        client, edge = self.clients[k], self.identities[k]
        job_id = f"fl{self.tag}-{i}"
        now = time.time()
        job = Job(
            job_id=job_id,
            model=MODEL,
            payload=job_id.encode(),
            image=IMAGE,
            response_topic="app/bench",
            correlation_data=None,
            priority=5,
            data_class=CLASS,
            received_at=now,
            deadline=now + DEADLINE_S,
        )
        ask = Ask(job_id, edge, time.monotonic())
        self.asks.append(ask)
        future = client.place(job, "queue", 0.2)
        self.last_outcome = future
        future.add_done_callback(lambda f: self._outcome(ask, f))
        return ask

    def _outcome(self, ask: Ask, future: asyncio.Future[Any]) -> None:
        ask.answered_at = time.monotonic()
        ask.latency_ms = (ask.answered_at - ask.sent) * 1000.0
        if future.cancelled():
            ask.kind = "cancelled"
        else:
            result = future.result()
            if isinstance(result, Placement):
                ask.kind, ask.worker = "placed", result.worker_id
                notes = self.replies.get(ask.job_id)
                ask.broker = notes[0][1] if notes else ""
                self.on_placed(ask)
            elif result.code == "broker_timeout":
                ask.kind = "timeout"
            else:
                ask.kind, ask.code = "refused", result.code
        if self._stop_at and ask.answered_at < self._stop_at:
            self.ask()  # closed loop: the next request takes this one's place

    async def drain(self, max_s: float = 15.0, quick_ms: float = 20.0, streak: int = 5) -> float:
        """Ask one placement at a time until ``streak`` answers in a row come within
        ``quick_ms`` (the broker has worked off what queued up for it), for at most
        ``max_s``; the seconds it took. These requests belong to no round."""
        t0 = time.monotonic()
        quick = 0
        while quick < streak and time.monotonic() - t0 < max_s:
            ask = self.ask()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(self.last_outcome)
            await asyncio.sleep(0)  # the outcome's own callback first
            quick = quick + 1 if ask.latency_ms <= quick_ms else 0
        return time.monotonic() - t0

    async def open_loop(self, rate: float, seconds: float) -> list[Ask]:
        """``rate`` requests a second for ``seconds``, on schedule (late ones go at once)."""
        start = len(self.asks)
        t0 = time.monotonic()
        for i in range(int(rate * seconds)):
            delay = t0 + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            self.ask()
        await asyncio.sleep(TIMEOUT_S + 0.05)  # every request answered or timed out
        return self.asks[start:]

    async def closed_loop(self, window: int, seconds: float) -> list[Ask]:
        """``window`` requests outstanding for ``seconds``: each outcome sends the next."""
        start = len(self.asks)
        self._stop_at = time.monotonic() + seconds
        for _ in range(window):
            self.ask()
        await asyncio.sleep(seconds)
        self._stop_at = 0.0
        await asyncio.sleep(TIMEOUT_S + 0.05)
        return self.asks[start:]

    async def close(self) -> None:
        for client in self.clients:
            client.close()
        for transport in self.transports:
            await transport.close()


def summary(
    asks: list[Ask], since: float | None = None, until: float | None = None
) -> dict[str, Any]:
    """Outcome counts and answer latency over every request sent in [since, until): a
    request never answered within the edge's timeout counts as an infinite latency (so
    with more than 1 % timed out, p99 is infinite); ``answered_p99_ms`` is over the
    answers alone."""
    chosen = [
        a for a in asks if (since is None or a.sent >= since) and (until is None or a.sent < until)
    ]
    kinds: dict[str, int] = {}
    codes: dict[str, int] = {}
    for a in chosen:
        kinds[a.kind] = kinds.get(a.kind, 0) + 1
        if a.code:
            codes[a.code] = codes.get(a.code, 0) + 1
    answered = sorted(a.latency_ms for a in chosen if a.kind in ("placed", "refused"))
    n = len(chosen)
    every = answered + [float("inf")] * (n - len(answered))
    in_time = sum(ms <= TIMEOUT_S * 1000.0 for ms in answered)
    return {
        "requests": n,
        "placed": kinds.get("placed", 0),
        "refused": kinds.get("refused", 0),
        "timeout": kinds.get("timeout", 0),
        "codes": codes,
        "p50_ms": stats.percentile(every, 50),
        "p99_ms": stats.percentile(every, 99),
        "max_ms": every[-1] if every else float("nan"),
        "answered_p99_ms": stats.percentile(answered, 99),
        "within_timeout": (in_time / n) if n else float("nan"),
    }
