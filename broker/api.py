"""The broker's HTTP API (aiohttp): health, fleet, jobs, dead letters, policy, Prometheus
metrics, enrollment of new nodes (on the replica holding the campus CA), OpenAPI, and the
operator's console (``broker.console``). Every view but ``/health``, ``/metrics``,
``/openapi.json`` and ``/v1/enroll`` needs a viewer's login or token; actions an operator's.

A thin shell: every handler asks the :class:`BrokerView` for plain data and renders it as
JSON; nothing here decides anything or touches Redis directly. A view that needs Redis
while it is away raises ``StoreUnavailable``: every route answers that with 503 and the
reason, never a stack trace. The OpenAPI description (``broker.openapi``) is
served at ``/openapi.json`` and lists exactly the routes registered below.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web

from broker.console.board import Console as Board
from broker.console.routes import Access, add_console, guard
from broker.metrics import CONTENT_TYPE
from broker.openapi import DEAD_LETTERS_DEFAULT, DEAD_LETTERS_MAX, OPENAPI
from broker.view import FLEET_PAGE, FLEET_PAGE_MAX
from sluicegate.errors import StoreUnavailable

Console = tuple[Board, Access]


class BrokerView(Protocol):
    """What the API needs from the running broker."""

    def health(self) -> dict[str, Any]: ...

    def fleet(
        self, *, zone: str = "", after: str = "", limit: int = FLEET_PAGE
    ) -> dict[str, Any]: ...

    async def job(self, job_id: str) -> dict[str, Any] | None: ...

    async def dead_letters(self, limit: int) -> list[dict[str, Any]]: ...

    def policy(self) -> dict[str, Any] | None: ...

    def placement(self) -> dict[str, Any]: ...

    def shadow(self) -> dict[str, Any] | None: ...

    def peers(self) -> dict[str, Any]: ...

    def metrics(self) -> bytes: ...

    async def usage_export(self, from_ms: int, to_ms: int, peer: str = "") -> bytes | None: ...


class Enrollment(Protocol):
    """The enrollment desk (``broker.enrollment``): status and document for a request."""

    async def enroll(self, body: bytes) -> tuple[int, dict[str, Any]]: ...


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        text=json.dumps(data, indent=1, default=str), status=status, content_type="application/json"
    )


# Where /fleet's edges, JSON already, go into the response.
_SPLICE = "edges go here"
_SPLICED = json.dumps(_SPLICE)


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status)


@web.middleware
async def _store_away(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except StoreUnavailable as exc:
        return _json({"code": "store_unavailable", "error": str(exc)}, 503)


def make_app(
    view: BrokerView, enrollment: Enrollment, console: Console | None = None
) -> web.Application:
    """The aiohttp application for ``view``, the enrollment desk and, with ``console``
    (the board and who may use it), the console and a login for every view."""

    async def health(_request: web.Request) -> web.Response:
        data = view.health()
        return _json(data, 200 if data.get("ready") else 503)

    async def fleet(request: web.Request) -> web.Response:
        raw = request.query.get("limit", str(FLEET_PAGE))
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 5) or not (
            1 <= int(raw) <= FLEET_PAGE_MAX
        ):
            return _error(400, f"limit={raw[:40]!r}: expected an integer 1 to {FLEET_PAGE_MAX}")
        zone, after = request.query.get("zone", ""), request.query.get("after", "")
        if len(zone) > 256 or len(after) > 256:
            return _error(400, "zone and after are at most 256 characters")
        data = view.fleet(zone=zone, after=after, limit=int(raw))
        edges: list[bytes] = data.pop("edges")
        # "edges" is the last member: its value is the placeholder's last occurrence.
        head, _, tail = json.dumps({**data, "edges": _SPLICE}, indent=1, default=str).rpartition(
            _SPLICED
        )
        rows = b",\n".join(edges).decode()
        return web.Response(text=f"{head}[{rows}]{tail}", content_type="application/json")

    async def job(request: web.Request) -> web.Response:
        job_id = request.match_info["job_id"]
        data = await view.job(job_id)
        if data is None:
            return _error(404, f"no placement request for job {job_id!r} is known")
        return _json(data)

    async def dead_letters(request: web.Request) -> web.Response:
        raw = request.query.get("limit", str(DEAD_LETTERS_DEFAULT))
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 4) or not (
            1 <= int(raw) <= DEAD_LETTERS_MAX
        ):
            return _error(400, f"limit={raw[:40]!r}: expected an integer 1 to {DEAD_LETTERS_MAX}")
        limit = int(raw)
        return _json({"dead_letters": await view.dead_letters(limit), "limit": limit})

    async def policy(_request: web.Request) -> web.Response:
        data = view.policy()
        if data is None:
            return _error(503, "the broker holds no verified policy")
        return _json(data)

    async def placement(_request: web.Request) -> web.Response:
        return _json(view.placement())

    async def shadow(_request: web.Request) -> web.Response:
        data = view.shadow()
        if data is None:
            return _error(
                404, "no shadow candidate: set [broker] shadow_policy_file or shadow_placement_file"
            )
        return _json(data)

    async def peers(_request: web.Request) -> web.Response:
        return _json(view.peers())

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=view.metrics(), headers={"Content-Type": CONTENT_TYPE})

    async def openapi(_request: web.Request) -> web.Response:
        return _json(OPENAPI)

    async def usage_export(request: web.Request) -> web.Response:
        period = export_period(request.query.get("from"), request.query.get("to"))
        if isinstance(period, str):
            return _error(400, period)
        peer = request.query.get("peer", "")
        try:
            body = await view.usage_export(*period, peer)
        except KeyError:
            return _error(404, f"no sister campus {peer[:64]!r} in the policy in force")
        if body is None:
            return _error(404, "this broker takes no usage records")
        return web.Response(body=body, content_type="application/x-ndjson")

    async def enroll(request: web.Request) -> web.Response:
        status, doc = await enrollment.enroll(await request.read())
        return _json(doc, status)

    guards = [guard(console[1])] if console is not None else []
    app = web.Application(client_max_size=64 * 1024, middlewares=[*guards, _store_away])
    if console is not None:
        add_console(app, console[0], console[1], view.job)
    app.router.add_get("/health", health)
    app.router.add_get("/fleet", fleet)
    app.router.add_get("/jobs/{job_id}", job)
    app.router.add_get("/dead-letters", dead_letters)
    app.router.add_get("/policy", policy)
    app.router.add_get("/placement", placement)
    app.router.add_get("/shadow", shadow)
    app.router.add_get("/peers", peers)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/enroll", enroll)
    app.router.add_get("/v1/usage/export", usage_export)
    app.router.add_get("/openapi.json", openapi)
    return app


def export_period(start: str | None, end: str | None) -> tuple[int, int] | str:
    """``from`` and ``to`` (unix seconds) as milliseconds, or what is wrong with them."""
    got: list[int] = []
    for name, raw in (("from", start), ("to", end)):
        if raw is None:
            return f"{name} is missing: give ?from=<unix seconds>&to=<unix seconds>"
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not 0 <= value < 1e11:  # NaN fails too
            return f"{name}={raw[:40]!r}: expected unix seconds, e.g. {name}=1796000000"
        got.append(int(value * 1000))
    if got[0] > got[1]:
        return f"from ({start}) is after to ({end})"
    return got[0], got[1]


async def start_http(
    view: BrokerView,
    enrollment: Enrollment,
    host: str,
    port: int,
    console: Console | None = None,
) -> tuple[web.AppRunner, int]:
    """Serve the API; returns the runner (to clean up) and the port actually bound."""
    runner = web.AppRunner(make_app(view, enrollment, console), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server  # aiohttp exposes the bound sockets only here
    sockets = getattr(server, "sockets", None) or []
    bound = sockets[0].getsockname()[1] if sockets else port
    return runner, int(bound)
