"""The local demo behind ``sluicegate demo``: the whole campus on one machine, on defaults.

It starts a Mosquitto and a Redis on free ports (or uses ones the user names), then a local
campus (:mod:`sluicegate.app.localcampus`: a broker, edge agents on two lines, a worker in the
fab's data centre and one off-site), with a policy signed by keys made for this run. It runs
secured as a plant does: a campus CA made for the run, a client certificate per node and
per app, the ACL generated from the policy, every node's policy anchor pinned; ``--open``
runs it without TLS, for debugging, and is required with ``--port`` (a Mosquitto the demo
did not configure cannot hold its CA and ACL). On a Mosquitto or Redis the user gave, it
removes what it created when it ends: the retained messages and sessions of its nodes,
and the keys of the empty Redis database it used. It
streams generated inspection images at both lines to the defect detector (``surface-det``)
— wafer images that must stay on campus and OCR crops that may leave — and, part-way
through, a 10x burst on line 1. The live view
shows jobs run locally versus offloaded and where, latency percentiles, deadline
attainment, why jobs were not offloaded, and the count of wafer images that reached the
off-site worker (it must stay 0). Ctrl-C stops the stream, waits for every outstanding
result, then stops the campus, Redis and Mosquitto.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import tempfile
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from sluicegate import wire
from sluicegate.app.campus import APP_OF_LINE, APPS, LINES, Campus
from sluicegate.app.demo_cleanup import clear_mqtt, empty_database, flush_database
from sluicegate.app.localcampus import LocalCampus, cpu_cap_available, start_campus_mosquitto
from sluicegate.app.servers import ServerProcess, free_port, running, start_redis
from sluicegate.client import AsyncClient
from sluicegate.errors import SluicegateError
from sluicegate.vision.synth import encode_jpeg
from sluicegate.vision.synth_boxes import generate

MODEL = "surface-det"
DEADLINE_MS = 200.0
BURST_LINE = "line-1-pc"
VOLLEY = 20
EDGE_CPU = 0.15  # share of one core each edge agent gets, where CPU cgroups allow


@dataclass
class Tally:
    """What the demo has seen so far."""

    submitted: Counter[str] = field(default_factory=Counter)  # by line
    statuses: Counter[str] = field(default_factory=Counter)
    where: Counter[str] = field(default_factory=Counter)  # node that ran the job
    kinds: Counter[str] = field(default_factory=Counter)  # edge / pool
    kept_local: Counter[str] = field(default_factory=Counter)  # offload refusal codes
    in_time: int = 0
    correct: int = 0
    wafer_offsite: int = 0
    unmatched: int = 0  # results that matched no waiting call (late or duplicate)
    latencies_ms: deque[float] = field(default_factory=lambda: deque(maxlen=20000))
    errors: Counter[str] = field(default_factory=Counter)
    started: float = field(default_factory=time.monotonic)
    phase: str = "steady"

    @property
    def answered(self) -> int:
        return sum(self.statuses.values())

    def record(
        self, result: wire.JobResult, truth: frozenset[str], data_class: str, ms: float
    ) -> None:
        self.statuses[result.status] += 1
        self.latencies_ms.append(ms)
        self.where[result.ran_on.node] += 1
        self.kinds[result.ran_on.kind] += 1
        self.in_time += result.status == "ok" and ms <= DEADLINE_MS
        if data_class == "wafer-image" and result.ran_on.zone.startswith("offsite/"):
            self.wafer_offsite += 1
        if result.offload is not None and not result.offload.placed:
            self.kept_local[result.offload.code or "?"] += 1
        if result.outputs is not None:  # right: the kinds of defect found are those there
            self.correct += frozenset(d.label for d in result.outputs.detections) == truth


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def render(t: Tally) -> Group:
    lat = list(t.latencies_ms)
    answered = max(t.answered, 1)
    jobs = Table.grid(padding=(0, 3))
    jobs.add_row(
        f"[b]phase[/] {t.phase}",
        f"[b]submitted[/] {sum(t.submitted.values())}",
        f"[b]answered[/] {t.answered}",
        f"[b]client errors[/] {sum(t.errors.values())}",
    )
    jobs.add_row(
        *(f"[b]{s}[/] {t.statuses.get(s, 0)}" for s in ("ok", "rejected", "failed", "expired"))
    )
    jobs.add_row(
        f"[b]p50[/] {_pct(lat, 50):.1f} ms",
        f"[b]p99[/] {_pct(lat, 99):.1f} ms",
        f"[b]deadline met[/] {100.0 * t.in_time / answered:.1f}%",
        f"[b]defects found right[/] {100.0 * t.correct / max(t.statuses.get('ok', 0), 1):.1f}%",
    )
    where = Table("node", "jobs", "share", box=None)
    for node, count in sorted(t.where.items()):
        where.add_row(node, str(count), f"{100.0 * count / answered:.1f}%")
    compliance = Table.grid(padding=(0, 3))
    colour = "green" if t.wafer_offsite == 0 else "red"
    compliance.add_row(
        f"[b]run locally[/] {t.kinds.get('edge', 0)}",
        f"[b]offloaded[/] {t.kinds.get('pool', 0)}",
        f"[b]wafer images that reached off-site[/] [{colour}]{t.wafer_offsite}[/]",
    )
    reasons = ", ".join(f"{code} {n}" for code, n in t.kept_local.most_common(4)) or "-"
    compliance.add_row(f"[b]kept local after asking[/] {reasons}")
    return Group(
        Panel(jobs, title="Sluicegate campus demo: jobs"),
        Panel(where, title="where jobs ran"),
        Panel(compliance, title="offload and compliance"),
    )


async def _one(
    client: AsyncClient, image: bytes, truth: frozenset[str], data_class: str, tally: Tally
) -> None:
    t0 = time.perf_counter()
    try:
        result = await client.infer(
            image, model=MODEL, deadline_ms=DEADLINE_MS, data_class=data_class, timeout=60.0
        )
    except SluicegateError as exc:
        tally.errors[type(exc).__name__] += 1
        return
    tally.record(result, truth, data_class, (time.perf_counter() - t0) * 1000.0)


def app_client(campus: Campus, line: str) -> AsyncClient:
    """The vision app of ``line``: its own identity, results under its own prefix."""
    app = APP_OF_LINE[line]
    return AsyncClient(
        campus.mqtt(app), edge=line, response_topic=f"{APPS[app][1]}/{uuid.uuid4().hex[:8]}"
    )


async def stream(
    campus: Campus,
    rate: float,
    seconds: float,
    stop: asyncio.Event,
    tally: Tally,
    *,
    live: bool = True,
    burst_at: float = 5.0,
    burst_for: float = 10.0,
) -> None:
    """Steady ``rate`` per line; for ``burst_for`` seconds from ``burst_at``, line 1 bursts to
    ten times that, its camera station firing in volleys of 20 images."""
    rng = np.random.default_rng(2026)
    pool = []
    for i in range(48):
        img, defects = generate(rng, width=640, height=480)
        truth = frozenset(d.label for d in defects)
        pool.append((encode_jpeg(img), truth, "ocr-crop" if i % 3 == 0 else "wafer-image"))
    pending: set[asyncio.Task[None]] = set()
    clients = {line: app_client(campus, line) for line in LINES}
    for c in clients.values():
        await c.connect()
    view = Live(render(tally), console=Console(), refresh_per_second=4) if live else None
    try:
        with view if view is not None else contextlib.nullcontext():
            tally.started = start = time.monotonic()
            due = dict.fromkeys(LINES, start)
            end = start + seconds if seconds > 0 else float("inf")
            while not stop.is_set() and time.monotonic() < end:
                now = time.monotonic()
                burst = burst_at <= now - start < burst_at + burst_for
                tally.phase = "10x burst on line 1" if burst else "steady"
                for line, client in clients.items():
                    volley = VOLLEY if burst and line == BURST_LINE else 1
                    line_rate = rate * (10.0 if burst and line == BURST_LINE else 1.0)
                    while due[line] <= now:
                        for _ in range(volley):
                            image, truth, data_class = pool[int(rng.integers(len(pool)))]
                            job = _one(client, image, truth, data_class, tally)
                            task = asyncio.ensure_future(job)
                            pending.add(task)
                            task.add_done_callback(pending.discard)
                            tally.submitted[line] += 1
                        due[line] += volley / line_rate
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        stop.wait(), max(0.0, min(due.values()) - time.monotonic())
                    )
                if view is not None:
                    view.update(render(tally))
            if pending:
                await asyncio.wait(pending, timeout=70.0)
            tally.unmatched = sum(c.unmatched for c in clients.values())
            if view is not None:
                view.update(render(tally))
    finally:
        for c in clients.values():
            await c.close()


def run_demo(
    *,
    rate: float,
    seconds: float,
    port: int | None,
    redis_port: int | None,
    open_mode: bool = False,
) -> int:
    """Run the demo; returns the exit status (0 when every job was answered and no wafer
    image left the campus)."""
    if port is not None and not open_mode:
        raise SluicegateError(
            f"--port {port} is a Mosquitto this demo did not configure: it cannot hold the "
            "demo's CA, certificates and ACL. Leave --port out (the demo starts a secured "
            "one), or add --open to run without TLS on yours (debugging only)"
        )
    console = Console()
    tally = Tally()
    with contextlib.ExitStack() as stack:
        redis: ServerProcess | None = None
        if redis_port is None:
            redis = stack.enter_context(running(start_redis()))
            redis_url = f"redis://127.0.0.1:{redis.port}/0"
        else:
            db = empty_database(redis_port)
            redis_url = f"redis://127.0.0.1:{redis_port}/{db}"
            stack.callback(flush_database, redis_port, db)
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sg-demo-")))
        edge_cpu = EDGE_CPU if cpu_cap_available() else None
        mqtt_port = port or free_port()
        campus = LocalCampus(
            root,
            mqtt_port=mqtt_port,
            redis_url=redis_url,
            edge_cpu=edge_cpu,
            secure=not open_mode,
        )
        written = campus.write()
        if port is None:
            stack.enter_context(running(start_campus_mosquitto(written)))
        else:
            stack.callback(clear_mqtt, written, campus.nodes)
        mode = "open (no TLS: debugging only)" if open_mode else "TLS, client certificates, ACL"
        console.print(f"[b]campus[/] in {root}: MQTT 127.0.0.1:{mqtt_port} ({mode}), {redis_url}")
        if edge_cpu is not None:
            console.print(f"line PCs emulated as modest machines: {edge_cpu:.0%} of one core each")
        console.print("starting broker-1, line-1-pc, line-2-pc, north-cpu-1, cloud-cpu-1 …")
        try:
            campus.start()

            async def main() -> None:
                stop = asyncio.Event()
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.add_signal_handler(sig, stop.set)
                await stream(written, rate, seconds, stop, tally)

            asyncio.run(main())
        finally:
            campus.stop()
    lost = sum(tally.submitted.values()) - tally.answered
    console.print(
        f"[b]done[/]: {sum(tally.submitted.values())} submitted, {tally.answered} answered "
        f"({dict(tally.statuses)}), {lost} unanswered; ran on {dict(tally.where)}; "
        f"wafer images off-site: {tally.wafer_offsite}"
    )
    return 0 if lost == 0 and tally.wafer_offsite == 0 else 1
