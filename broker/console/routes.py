"""The console's HTTP side on the broker's aiohttp app: who may see what, the pages, the
live stream, job lookup and operators' actions.

Every route but ``/health``, ``/metrics``, ``/openapi.json``, ``/v1/enroll`` (its own join
tokens) and the login page needs a caller: a bearer token (``Authorization: Bearer``) or
the session cookie a login sets. Viewing needs the viewer role, acting the operator role;
with ``[console] open`` (debugging only) an anonymous caller may view, never act. Pages and
scripts are files of this package, served from here: nothing is fetched from elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from broker.console.auth import Role, Sessions, Users, Who
from broker.console.board import Console
from broker.console.holds import ActionRefused

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"
COOKIE = "sg_session"
PUBLIC = frozenset({"/health", "/metrics", "/openapi.json", "/v1/enroll", "/console/login"})
HEARTBEAT_S = 15.0
MAX_STREAMS = 64  # live streams one broker serves at once
WHO = web.RequestKey("who", Who)


class Access:
    """The users file, the sessions, and whether anonymous viewing is allowed."""

    def __init__(
        self,
        users: Users,
        sessions: Sessions,
        *,
        open_viewing: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.users = users
        self.sessions = sessions
        self.open_viewing = open_viewing
        self._clock = clock

    def who(self, request: web.Request) -> Who | None:
        header = request.headers.get("Authorization", "")
        if header.startswith("Bearer "):
            return self.users.bearer(header[7:].strip())
        cookie = request.cookies.get(COOKIE)
        if cookie:
            return self.sessions.check(cookie, self._clock())
        if self.open_viewing:
            return Who("anonymous", "viewer", "open")
        return None


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        text=json.dumps(data, default=str), status=status, content_type="application/json"
    )


def _refuse(request: web.Request, status: int, message: str) -> web.StreamResponse:
    if status == 401 and request.method == "GET" and request.path in ("/console", "/console/"):
        raise web.HTTPSeeOther("/console/login")
    headers = {"WWW-Authenticate": 'Bearer realm="sluicegate"'} if status == 401 else None
    return web.Response(
        text=json.dumps({"error": message}),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def guard(access: Access) -> Any:
    """The middleware that admits callers by role (operators for anything but GET)."""

    @web.middleware
    async def middleware(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        path = request.path
        if path in PUBLIC or path.startswith("/console/static/"):
            return await handler(request)
        who = access.who(request)
        if who is None:
            return _refuse(request, 401, "log in or send 'Authorization: Bearer <token>'")
        needed: Role = "viewer" if request.method in ("GET", "HEAD") else "operator"
        if path == "/console/logout":
            needed = "viewer"
        if not who.may(needed):
            return _refuse(request, 403, f"{who.name} is a {who.role}; this needs an {needed}")
        request[WHO] = who
        return await handler(request)

    return middleware


def add_console(
    app: web.Application,
    console: Console,
    access: Access,
    job: Callable[[str], Awaitable[dict[str, Any] | None]],
) -> None:
    """The console's routes on ``app``; ``job``: the broker's own job view (/jobs/{id})."""

    async def page(_request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / "index.html")

    async def login_page(_request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / "login.html")

    async def login(request: web.Request) -> web.StreamResponse:
        form = await request.post()
        name, password = str(form.get("name", "")), str(form.get("password", ""))
        who = access.users.login(name, password) if name else access.users.bearer(password)
        if who is None:
            log.warning("console: failed login for %r from %s", name[:60], request.remote)
            raise web.HTTPSeeOther("/console/login?failed=1")
        response = web.HTTPSeeOther("/console")
        response.set_cookie(
            COOKIE,
            access.sessions.issue(who, time.time()),
            max_age=int(access.sessions.ttl_s),
            httponly=True,
            samesite="Strict",
            path="/",
            secure=request.secure,
        )
        raise response

    async def logout(_request: web.Request) -> web.StreamResponse:
        response = web.HTTPSeeOther("/console/login")
        response.del_cookie(COOKIE, path="/")
        raise response

    async def whoami(request: web.Request) -> web.Response:
        who = request[WHO]
        return _json({"name": who.name, "role": who.role, "via": who.via})

    async def snapshot(_request: web.Request) -> web.Response:
        return _json(console.snapshot())

    async def events(request: web.Request) -> web.StreamResponse:
        if console.watching >= MAX_STREAMS:
            return _json(
                {
                    "error": f"{MAX_STREAMS} dashboards are open on this broker already; close "
                    "one, or poll /console/api/snapshot"
                },
                503,
            )
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        await response.prepare(request)
        queue = console.subscribe()
        try:
            while True:
                try:
                    text = await asyncio.wait_for(queue.get(), HEARTBEAT_S)
                except TimeoutError:
                    await response.write(b": keep-alive\n\n")
                    continue
                if not text:  # the console is closing: end the stream
                    break
                await response.write(b"event: snapshot\ndata: " + text.encode() + b"\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            console.unsubscribe(queue)
        return response

    async def job_story(request: web.Request) -> web.Response:
        job_id = request.match_info["job_id"]
        story = await console.job(job_id, await job(job_id))
        if story["placement"] is None and story["edge_record"] is None and not story["audit"]:
            return _json({"error": f"no job {job_id!r} is known to this broker"}, 404)
        return _json(story)

    async def action(request: web.Request) -> web.Response:
        if request.content_type != "application/json":
            return _json({"error": "send the action as application/json"}, 415)
        who = request[WHO]
        try:
            done = await console.act(who, await request.read())
        except ActionRefused as exc:
            return _json({"error": str(exc)}, exc.status)
        return _json(done)

    async def static(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        path = STATIC / name
        if "/" in name or name.startswith(".") or not path.is_file():
            raise web.HTTPNotFound()
        return web.FileResponse(path)

    app.router.add_get("/console", page)
    app.router.add_get("/console/", page)
    app.router.add_get("/console/login", login_page)
    app.router.add_post("/console/login", login)
    app.router.add_post("/console/logout", logout)
    app.router.add_get("/console/api/whoami", whoami)
    app.router.add_get("/console/api/snapshot", snapshot)
    app.router.add_get("/console/api/events", events)
    app.router.add_get("/console/api/jobs/{job_id}", job_story)
    app.router.add_post("/console/api/actions", action)
    app.router.add_get("/console/static/{name}", static)
