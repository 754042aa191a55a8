"""The local demo behind ``sluicegate demo``: everything on one machine, on defaults.

It starts a Mosquitto on a free port (or uses one the user names), an edge agent as a
separate ``sluicegate edge run`` process, and streams generated inspection images at it
through the Python client, showing results live: counts by status, accuracy against the
generator's ground truth, latency percentiles and the agent's own telemetry. Ctrl-C stops
the stream, waits for every outstanding result, then stops the agent and the broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from sluicegate import topics, wire
from sluicegate.client import AsyncClient
from sluicegate.config import MqttSettings
from sluicegate.errors import SluicegateError
from sluicegate.mqtt import Message, MqttTransport
from sluicegate.servers import ServerProcess, running, start_mosquitto
from sluicegate.vision.synth import encode_jpeg, generate

EDGE_ID = "demo-edge"
EDGE_ZONE = "campus/fab-north/line-1"
MODEL = "defect-v1"


@dataclass
class Tally:
    """What the demo has seen so far."""

    submitted: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    correct: int = 0
    latencies_ms: deque[float] = field(default_factory=lambda: deque(maxlen=5000))
    recent: deque[tuple[str, str, str, float, float]] = field(
        default_factory=lambda: deque(maxlen=8)
    )
    errors: Counter[str] = field(default_factory=Counter)
    telemetry: wire.EdgeTelemetry | None = None
    started: float = field(default_factory=time.monotonic)

    @property
    def answered(self) -> int:
        return sum(self.statuses.values())


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def render(t: Tally) -> Group:
    elapsed = max(time.monotonic() - t.started, 1e-9)
    lat = list(t.latencies_ms)
    ok = t.statuses.get("ok", 0)
    summary = Table.grid(padding=(0, 3))
    summary.add_row(
        f"[b]submitted[/] {t.submitted}",
        f"[b]answered[/] {t.answered}",
        f"[b]outstanding[/] {t.submitted - t.answered - sum(t.errors.values())}",
        f"[b]rate[/] {t.answered / elapsed:.1f}/s",
    )
    summary.add_row(
        *(f"[b]{s}[/] {t.statuses.get(s, 0)}" for s in ("ok", "rejected", "failed", "expired"))
    )
    summary.add_row(
        f"[b]accuracy[/] {100.0 * t.correct / ok:.1f}%" if ok else "[b]accuracy[/] -",
        f"[b]p50[/] {_pct(lat, 50):.1f} ms",
        f"[b]p99[/] {_pct(lat, 99):.1f} ms",
        f"[b]client errors[/] {sum(t.errors.values())}",
    )
    agent = Table.grid(padding=(0, 3))
    tel = t.telemetry
    if tel is not None:
        service = ", ".join(f"{k} {v.service_ms:.2f} ms" for k, v in tel.models.items()) or "-"
        agent.add_row(
            f"[b]queue[/] {tel.queue_depth}/{tel.queue_capacity}",
            f"[b]in flight[/] {tel.in_flight}/{tel.concurrency}",
            f"[b]cpu[/] {tel.cpu_percent:.0f}%",
            f"[b]rss[/] {tel.memory_rss_mb:.0f} MB",
        )
        agent.add_row(f"[b]service time[/] {service}")
    recent = Table("job", "truth", "model says", "score", "latency", box=None)
    for job, truth, label, score, ms in t.recent:
        mark = "[green]" if truth == label else "[red]"
        recent.add_row(job[:8], truth, f"{mark}{label}[/]", f"{score:.3f}", f"{ms:.1f} ms")
    return Group(
        Panel(summary, title="Sluicegate demo: jobs"),
        Panel(agent, title=f"edge agent {EDGE_ID} ({EDGE_ZONE})"),
        Panel(recent, title="latest results"),
    )


def _start_agent(port: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ, SLUICEGATE_EDGE__TELEMETRY_INTERVAL_S="0.5")
    argv = [sys.executable, "-m", "sluicegate.cli", "edge", "run", "--port", str(port)]
    argv += ["--id", EDGE_ID, "--zone", EDGE_ZONE, "--log-level", "warning"]
    # Own session: Ctrl-C reaches only the demo, which then stops the agent in order.
    return subprocess.Popen(argv, env=env, start_new_session=True)


async def _wait_online(
    mqtt: MqttSettings, agent: subprocess.Popen[bytes], tally: Tally
) -> MqttTransport:
    """Wait for the agent's retained ``online``; the returned watcher keeps feeding telemetry."""
    online = asyncio.Event()

    def on_status(msg: Message) -> None:
        with contextlib.suppress(ValueError):
            if wire.NodeStatus.model_validate_json(msg.payload).state == "online":
                online.set()

    def on_telemetry(msg: Message) -> None:
        with contextlib.suppress(ValueError):
            tally.telemetry = wire.EdgeTelemetry.model_validate_json(msg.payload)

    watcher = MqttTransport(mqtt, client_id=f"sg-demo-watch-{os.getpid()}")
    await watcher.connect()
    await watcher.subscribe(topics.edge_status(EDGE_ID), on_status)
    await watcher.subscribe(topics.edge_telemetry(EDGE_ID), on_telemetry, qos=0)
    deadline = time.monotonic() + 60.0
    try:
        while not online.is_set():
            if agent.poll() is not None:
                raise SluicegateError(f"the edge agent exited with status {agent.returncode}")
            if time.monotonic() > deadline:
                raise SluicegateError("the edge agent did not come online within 60 s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(online.wait(), 0.5)
    except BaseException:
        await watcher.close()
        raise
    return watcher


async def _one(client: AsyncClient, image: bytes, truth: str, tally: Tally) -> None:
    t0 = time.perf_counter()
    try:
        result = await client.infer(image, model=MODEL, deadline_ms=2000.0, timeout=30.0)
    except SluicegateError as exc:
        tally.errors[type(exc).__name__] += 1
        return
    ms = (time.perf_counter() - t0) * 1000.0
    tally.statuses[result.status] += 1
    tally.latencies_ms.append(ms)
    if result.outputs is not None and result.outputs.label is not None:
        label = result.outputs.label
        tally.correct += label == truth
        score = result.outputs.scores.get(label, 0.0)
        tally.recent.appendleft((result.job_id, truth, label, score, ms))


async def _stream(
    mqtt: MqttSettings, rate: float, seconds: float, stop: asyncio.Event, tally: Tally
) -> None:
    rng = np.random.default_rng(2026)
    pool = []
    for _ in range(48):
        img, truth = generate(rng)
        pool.append((encode_jpeg(img), truth))
    console = Console()
    pending: set[asyncio.Task[None]] = set()
    async with AsyncClient(mqtt, edge=EDGE_ID) as client:
        tally.started = time.monotonic()
        with Live(render(tally), console=console, refresh_per_second=4) as live:
            period = 1.0 / rate
            next_at = time.monotonic()
            end = next_at + seconds if seconds > 0 else float("inf")
            while not stop.is_set() and time.monotonic() < end:
                image, truth = pool[int(rng.integers(len(pool)))]
                task = asyncio.ensure_future(_one(client, image, truth, tally))
                pending.add(task)
                task.add_done_callback(pending.discard)
                tally.submitted += 1
                next_at += period
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), max(0.0, next_at - time.monotonic()))
                live.update(render(tally))
            if pending:
                await asyncio.wait(pending, timeout=35.0)
            live.update(render(tally))


def run_demo(*, rate: float, seconds: float, port: int | None) -> int:
    """Run the demo; returns the exit status (0 when every submitted job was answered)."""
    console = Console()
    tally = Tally()

    def stream(broker_port: int) -> None:
        mqtt = MqttSettings(port=broker_port)
        agent = _start_agent(broker_port)
        try:

            async def main() -> None:
                stop = asyncio.Event()
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.add_signal_handler(sig, stop.set)
                console.print(f"[b]broker[/] 127.0.0.1:{broker_port}  waiting for the agent…")
                watcher = await _wait_online(mqtt, agent, tally)
                try:
                    await _stream(mqtt, rate, seconds, stop, tally)
                finally:
                    await watcher.close()

            asyncio.run(main())
        finally:
            if agent.poll() is None:
                agent.send_signal(signal.SIGTERM)
                try:
                    agent.wait(15)
                except subprocess.TimeoutExpired:
                    agent.kill()
                    agent.wait()

    if port is not None:
        stream(port)
    else:
        server: ServerProcess = start_mosquitto()
        with running(server):
            stream(server.port)
    lost = tally.submitted - tally.answered
    console.print(
        f"[b]done[/]: {tally.submitted} submitted, {tally.answered} answered "
        f"({dict(tally.statuses)}), {lost} unanswered"
    )
    return 0 if lost == 0 else 1
