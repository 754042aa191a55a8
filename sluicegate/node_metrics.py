"""``/metrics`` of an edge agent or a pool worker: one prometheus_client registry served over
HTTP (aiohttp) from the node's own event loop, started and stopped by its service.

The registry holds a custom collector that reads the node's figures when scraped
(``edge_agent.metrics``, ``center_pool.metrics``), so a scrape runs on the loop that owns
those figures and never sees a half-made change. Metrics are a window on the node, never a
condition of its work: an address that cannot be bound is logged as an error naming it and
the setting that chose it, and the node serves jobs without metrics.
"""

from __future__ import annotations

import logging

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import HistogramMetricFamily

from sluicegate.buckets import Snapshot

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PATH = "/metrics"


def add_histogram(family: HistogramMetricFamily, labels: list[str], figures: Snapshot) -> None:
    """One labelled histogram of ``family`` from plain bucket figures."""
    buckets = [(repr(float(bound)), float(n)) for bound, n in figures.buckets]
    buckets.append(("+Inf", float(figures.count)))
    family.add_metric(labels, buckets, figures.total)


class MetricsServer:
    """Serves ``registry`` on ``http://host:port/metrics`` while started. ``setting`` names
    where the address comes from (``[edge] metrics_host/metrics_port``), for the error a
    port that cannot be bound logs."""

    def __init__(self, registry: CollectorRegistry, *, host: str, port: int, setting: str) -> None:
        self._registry = registry
        self.host = host
        self._wanted = port
        self._setting = setting
        self._runner: web.AppRunner | None = None
        self.port: int | None = None  # the bound port while serving (0 asks for any free one)

    @property
    def url(self) -> str | None:
        """Where ``/metrics`` is served now; None when it is not."""
        if self.port is None:
            return None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{PATH}"

    async def start(self) -> int | None:
        """Listen; returns the bound port, or None (logged) when the address cannot be
        bound."""
        app = web.Application()
        app.router.add_get(PATH, self._metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self._wanted)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            log.error(
                "metrics not served: cannot listen on %s:%d (set by %s): %s; the node serves "
                "jobs without /metrics",
                self.host,
                self._wanted,
                self._setting,
                exc.strerror or exc,
            )
            return None
        self._runner = runner
        address = runner.addresses[0]
        self.port = int(address[1])
        log.info("metrics served on %s", self.url)
        return self.port

    async def stop(self) -> None:
        runner, self._runner, self.port = self._runner, None, None
        if runner is not None:
            await runner.cleanup()

    async def _metrics(self, _request: web.Request) -> web.Response:
        body = generate_latest(self._registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})
