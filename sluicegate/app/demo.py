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
streams the vision apps' traffic at both lines (:mod:`sluicegate.app.traffic`): surface
images to the defect detector (``surface-det``, campus only) and label crops to the OCR
pipeline (``ocr-ppocrv4``, may leave), and, part-way through, a 10x burst on line 1. The
line PCs are calibrated first, as a plant engineer does at install: ``sluicegate models
bench`` under the same CPU cap, its figures the edges' service-time priors. The live view
shows, per kind of job, deadline attainment and how many ran locally or were offloaded, and
where the time of the jobs that missed their deadline went (:mod:`sluicegate.app.missed`);
the latest answers (the defects found, the text read, where each ran); latency percentiles,
where jobs ran, why jobs were not offloaded, and the count of wafer images that reached the
off-site worker (it must stay 0). Ctrl-C stops the stream, waits for every outstanding
result, then stops the campus, Redis and Mosquitto.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import tempfile
from pathlib import Path

import numpy as np
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from sluicegate.app.campus import OBSERVER
from sluicegate.app.demo_cleanup import clear_mqtt, empty_database, flush_database
from sluicegate.app.localcampus import LocalCampus, cpu_cap_available, start_campus_mosquitto
from sluicegate.app.missed import shares, summary
from sluicegate.app.servers import ServerProcess, free_port, running, start_redis
from sluicegate.app.traffic import KINDS, Tally, stream
from sluicegate.errors import SluicegateError

EDGE_CPU = 0.15  # share of one core each edge agent gets, where CPU cgroups allow


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def _share(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def render(t: Tally) -> Group:
    lat = list(t.latencies_ms)
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
        f"[b]deadline met[/] {_share(t.in_time, t.answered)}",
    )
    kinds = Table("job", "model", "deadline", "answered", "met", "right", "local", "offloaded")
    kinds.box = None
    for kind in KINDS:
        k = t.by_kind[kind.name]
        kinds.add_row(
            kind.name,
            kind.model,
            f"{kind.deadline_ms:g} ms",
            str(k.answered),
            _share(k.in_time, k.answered),
            _share(k.right, k.ok),
            str(k.local),
            str(k.offloaded),
        )
    missed = Table.grid(padding=(0, 1))
    for kind in KINDS:
        k = t.by_kind[kind.name]
        missed.add_row(f"[b]{kind.name}[/]", summary(k.misses, k.answered))
        if k.misses.total:
            missed.add_row("", shares(k.misses))
    latest = Table("line", "job", "ran on", "found", "ms", box=None)
    for a in (a for kind in KINDS for a in t.recent[kind.name]):
        ran = f"{a.ran_on} (local)" if a.local else f"[cyan]{a.ran_on} (offloaded)[/]"
        found = a.found if a.right else f"[yellow]{a.found}[/]"
        shown = found if a.status == "ok" else f"[red]{a.status}: {a.found}[/]"
        latest.add_row(a.line, a.kind, ran, shown, f"{a.ms:.0f}")
    where = Table("node", "jobs", "share", box=None)
    for node, count in sorted(t.where.items()):
        where.add_row(node, str(count), _share(count, t.answered))
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
        Panel(kinds, title="by kind of job"),
        Panel(missed, title="where the missed jobs' time went"),
        Panel(latest, title="latest answers"),
        Panel(where, title="where jobs ran"),
        Panel(compliance, title="offload and compliance"),
    )


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
        console.print("timing the models on each kind of node (sluicegate models bench) …")
        for role, priors in campus.calibrate().items():
            figures = ", ".join(f"{p.model} {p.image_ms:.1f} ms" for p in priors)
            console.print(f"  {'line PC' if role == 'edge' else 'worker'}: {figures} per image")
        console.print("starting broker-1, line-1-pc, line-2-pc, north-cpu-1, cloud-cpu-1 …")
        try:
            campus.start()
            urls = ", ".join(f"{n} {url}" for n, url in campus.metrics_urls().items())
            console.print(
                f"Prometheus metrics: broker http://127.0.0.1:{campus.http_port}/metrics, {urls}"
            )
            console.print(
                f"operator's console: http://127.0.0.1:{campus.http_port}/console (log in with "
                f"the token in {written.root / 'console-operator.token'}, or the viewer's in "
                "console-viewer.token beside it)"
            )
            observer = written.node_config(OBSERVER)
            console.print(
                f"record it from another shell: sluicegate twin record --config {observer} "
                "--out trace.jsonl.gz"
            )

            async def main() -> None:
                stop = asyncio.Event()
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.add_signal_handler(sig, stop.set)
                with Live(render(tally), console=console, refresh_per_second=4) as view:
                    refresh = lambda: view.update(render(tally))  # noqa: E731
                    await stream(written, rate, seconds, stop, tally, on_tick=refresh)

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
