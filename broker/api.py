"""The broker's HTTP API (aiohttp): health, fleet, jobs, policy, Prometheus metrics, OpenAPI.

A thin shell: every handler asks the :class:`BrokerView` for plain data and renders it as
JSON; nothing here decides anything or touches Redis directly. The OpenAPI description is
served at ``/openapi.json`` and lists exactly the routes registered below.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from aiohttp import web

from broker.metrics import CONTENT_TYPE


class BrokerView(Protocol):
    """What the API needs from the running broker."""

    def health(self) -> dict[str, Any]: ...

    def fleet(self) -> dict[str, Any]: ...

    async def job(self, job_id: str) -> dict[str, Any] | None: ...

    def policy(self) -> dict[str, Any] | None: ...

    def metrics(self) -> bytes: ...


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        text=json.dumps(data, indent=1, default=str), status=status, content_type="application/json"
    )


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status)


OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {
        "title": "Sluicegate campus broker",
        "version": "1",
        "description": "Fleet state, placement explanations, the current policy and metrics.",
    },
    "paths": {
        "/health": {
            "get": {
                "summary": "Liveness and readiness: MQTT and Redis connected, policy held",
                "responses": {
                    "200": {"description": "ready"},
                    "503": {"description": "not ready; the body says what is missing"},
                },
            }
        },
        "/fleet": {
            "get": {
                "summary": "Nodes, zones, capabilities, load, health state and forecast",
                "responses": {"200": {"description": "the fleet as the broker sees it"}},
            }
        },
        "/jobs/{job_id}": {
            "get": {
                "summary": "A job's placement status and the decision's explanation",
                "parameters": [
                    {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "responses": {
                    "200": {"description": "status, worker, top candidates and why"},
                    "404": {"description": "no placement request with this id is known"},
                },
            }
        },
        "/policy": {
            "get": {
                "summary": "The signed policy in force: version, digest, expiry, zones, classes",
                "responses": {
                    "200": {"description": "the policy"},
                    "503": {"description": "no verified policy loaded"},
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics (text exposition format)",
                "responses": {"200": {"description": "metrics"}},
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This description",
                "responses": {"200": {"description": "OpenAPI 3.1 document"}},
            }
        },
    },
}


def make_app(view: BrokerView) -> web.Application:
    """The aiohttp application for ``view``."""

    async def health(_request: web.Request) -> web.Response:
        data = view.health()
        return _json(data, 200 if data.get("ready") else 503)

    async def fleet(_request: web.Request) -> web.Response:
        return _json(view.fleet())

    async def job(request: web.Request) -> web.Response:
        job_id = request.match_info["job_id"]
        data = await view.job(job_id)
        if data is None:
            return _error(404, f"no placement request for job {job_id!r} is known")
        return _json(data)

    async def policy(_request: web.Request) -> web.Response:
        data = view.policy()
        if data is None:
            return _error(503, "the broker holds no verified policy")
        return _json(data)

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=view.metrics(), headers={"Content-Type": CONTENT_TYPE})

    async def openapi(_request: web.Request) -> web.Response:
        return _json(OPENAPI)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/fleet", fleet)
    app.router.add_get("/jobs/{job_id}", job)
    app.router.add_get("/policy", policy)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    return app


async def start_http(view: BrokerView, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve the API; returns the runner (to clean up) and the port actually bound."""
    runner = web.AppRunner(make_app(view), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server  # aiohttp exposes the bound sockets only here
    sockets = getattr(server, "sockets", None) or []
    bound = sockets[0].getsockname()[1] if sockets else port
    return runner, int(bound)
