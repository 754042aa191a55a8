"""The broker's HTTP API (aiohttp): health, fleet, jobs, dead letters, policy, Prometheus
metrics, enrollment of new nodes (on the replica holding the campus CA), OpenAPI, and the
operator's console (``broker.console``). Every view but ``/health``, ``/metrics``,
``/openapi.json`` and ``/v1/enroll`` needs a viewer's login or token; actions an operator's.

A thin shell: every handler asks the :class:`BrokerView` for plain data and renders it as
JSON; nothing here decides anything or touches Redis directly. A view that needs Redis
while it is away raises ``StoreUnavailable``: every route answers that with 503 and the
reason, never a stack trace. The OpenAPI description is
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


DEAD_LETTERS_DEFAULT = 100
DEAD_LETTERS_MAX = 1000

# What /metrics exposes beyond the placement histograms, for the OpenAPI description.
METRICS_DOC = (
    "Prometheus text format. Counters are per replica (sum them for the campus): "
    "sluicegate_placement_decisions_total{outcome}, sluicegate_placement_refusals_total{code}, "
    "sluicegate_completions_total{status}, "
    "sluicegate_shadow_decisions_total{outcome} (with a shadow candidate: same, moved, "
    "candidate_refused, candidate_placed, refused_otherwise), "
    "sluicegate_worker_losses_total{cause} (worker deaths this replica acted on; cause "
    "last_will or silent), "
    "sluicegate_replacements_total{reason} (jobs whose worker died, sent back to their edge "
    "to be placed again; reason last_will or silent), "
    "sluicegate_dead_letters_total (jobs dead-lettered after max_worker_crashes workers died "
    "holding them), "
    "sluicegate_placements_released_total (placements an edge handed back unused; the "
    "slot freed at once), "
    "sluicegate_stale_completions_total (completions of an attempt older than the job's "
    "current one, or after its dead letter: discarded and audited). Histograms: "
    "sluicegate_placement_decision_seconds, sluicegate_offloaded_job_seconds. Gauges: "
    "sluicegate_queue_depth{node,kind} (pool workers), sluicegate_edge_queued_jobs{zone}, "
    "sluicegate_placement_waiting, sluicegate_workers{state}, "
    "sluicegate_offload_ratio (of the jobs the edges answered ok, the share a pool ran), "
    "sluicegate_edge_finished_jobs{zone,ran_on}, sluicegate_pool_predicted_demand{pool}, "
    "sluicegate_pool_desired_workers{pool}."
)


OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {
        "title": "Sluicegate campus broker",
        "version": "1",
        "description": "Fleet state, placement explanations, the current policy and metrics.",
    },
    "components": {
        "securitySchemes": {
            "token": {"type": "http", "scheme": "bearer", "description": "a console token"},
            "session": {"type": "apiKey", "in": "cookie", "name": "sg_session"},
        }
    },
    "security": [{"token": []}, {"session": []}],
    "paths": {
        "/health": {
            "get": {
                "summary": (
                    "Liveness and readiness: MQTT and Redis connected, policy held,"
                    " placement requests subscribed"
                ),
                "responses": {
                    "200": {"description": "ready"},
                    "503": {"description": "not ready; the body says what is missing"},
                },
            }
        },
        "/fleet": {
            "get": {
                "summary": "Nodes, zones, capabilities, load, health state and forecast",
                "description": (
                    "Every worker and a page of the edges, in id order: limit (1 to "
                    f"{FLEET_PAGE_MAX}, default {FLEET_PAGE}) edges after the id 'after'; "
                    "zone, a prefix, keeps only nodes in zones under it. page.next_after "
                    "is the 'after' of the next page (null on the last); page.edges counts "
                    "the edges that match."
                ),
                "parameters": [
                    {"name": "limit", "in": "query", "schema": {"type": "integer"}},
                    {"name": "after", "in": "query", "schema": {"type": "string"}},
                    {"name": "zone", "in": "query", "schema": {"type": "string"}},
                ],
                "responses": {
                    "200": {"description": "the fleet as the broker sees it"},
                    "400": {"description": "a limit out of range, or a parameter too long"},
                },
            }
        },
        "/jobs/{job_id}": {
            "get": {
                "summary": "A job's placement status, the decision's explanation and its attempts",
                "description": (
                    "status is placed, refused, released (its edge handed the placement "
                    "back unused: 'released' says which attempt and why), "
                    "completed:<status>, worker_lost or dead_letter. 'inflight' (while the "
                    "job is placed and not completed, and for a dead letter) holds edge, "
                    "worker, attempt, crashes (workers that died holding the job), "
                    "crashed_on, deadline_at, placed_at, "
                    "lost_attempt, released_attempt and released_at (an attempt handed "
                    "back unused) and, once dead-lettered, dead_letter {reason, at}."
                ),
                "parameters": [
                    {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "responses": {
                    "200": {"description": "status, worker, top candidates and why; in flight"},
                    "404": {"description": "no placement request with this id is known"},
                    "503": {"description": "{code: store_unavailable, error}: Redis is away"},
                },
            }
        },
        "/dead-letters": {
            "get": {
                "summary": "Dead-lettered jobs, newest first, each with its reason",
                "description": (
                    "A job is dead-lettered when max_worker_crashes workers died holding it; "
                    "its edge is told and answers the app status failed, code dead_letter. "
                    "Kept for seven days."
                ),
                "parameters": [
                    {
                        "name": "limit",
                        "in": "query",
                        "required": False,
                        "schema": {
                            "type": "integer",
                            "minimum": 1,
                            "maximum": DEAD_LETTERS_MAX,
                            "default": DEAD_LETTERS_DEFAULT,
                        },
                    }
                ],
                "responses": {
                    "200": {
                        "description": (
                            "{dead_letters: [{job_id, reason, at, edge, worker, attempt, "
                            "crashes, crashed_on, ...}], limit}"
                        )
                    },
                    "400": {"description": "limit is not an integer 1..1000"},
                    "503": {"description": "{code: store_unavailable, error}: Redis is away"},
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
        "/placement": {
            "get": {
                "summary": "The placement parameters in force: digest, source, values, and a "
                "candidate set refused at start (a gated rollout without its verdict)",
                "responses": {"200": {"description": "the parameters"}},
            }
        },
        "/shadow": {
            "get": {
                "summary": "The shadow candidate's decisions beside production's: agreement, "
                "jobs moved and to where, its refusals, placements the policy in force forbids, "
                "the recent differences",
                "responses": {
                    "200": {"description": "the comparison"},
                    "404": {"description": "no shadow candidate configured"},
                },
            }
        },
        "/peers": {
            "get": {
                "summary": "Each sister campus the policy lists: where the agreement stands and "
                "why, its half's version, what its latest fresh summary offers, the link's "
                "round trip and throughput, and what was refused from it, by reason",
                "responses": {"200": {"description": "the peers"}},
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics (text exposition format)",
                "description": METRICS_DOC,
                "responses": {"200": {"description": "metrics"}},
            }
        },
        "/v1/enroll": {
            "post": {
                "summary": "Enroll a new node with a join token (sluicegate <role> install --join)",
                "description": "Body: {claims, csr (PEM, CN = the node id, its own Ed25519 "
                "key), proof (the token secret's MAC over the CSR), role}. The token's secret "
                "is never sent. Each token enrolls one node once; every issue and refusal is "
                "audited (enroll.issued / enroll.refused).",
                "responses": {
                    "200": {"description": "certificate, campus CA, signed policy in force"},
                    "400": {"description": "join.malformed"},
                    "403": {"description": "join.bad_proof, join.expired, join.wrong_scope"},
                    "409": {"description": "join.reused"},
                    "503": {"description": "this replica does not serve enrollment"},
                },
            }
        },
        "/console/api/snapshot": {
            "get": {
                "summary": "The console's campus document: zones, lines, pools, compliance",
                "description": "Viewer. The same document /console/api/events pushes (server-"
                "sent events, event 'snapshot', once per [console] push_interval_s).",
                "responses": {"200": {"description": "the snapshot"}, "401": {}, "403": {}},
            }
        },
        "/console/api/events": {
            "get": {
                "summary": "The live snapshot stream (text/event-stream)",
                "responses": {"200": {"description": "server-sent events"}, "401": {}},
            }
        },
        "/console/api/jobs/{job_id}": {
            "get": {
                "summary": "A job's story: its path, decision with ranked candidates and "
                "score parts, placement in flight, audit records, the edge's record",
                "parameters": [
                    {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "responses": {"200": {"description": "the job"}, "404": {}, "401": {}},
            }
        },
        "/console/api/actions": {
            "post": {
                "summary": "An operator's action: {action: drain|cordon|uncordon|pause|resume"
                "|release, target, note} (release: target a dead letter's job id); audited as "
                "operator.<action>",
                "responses": {
                    "200": {"description": "done"},
                    "400": {"description": "a malformed action"},
                    "403": {"description": "the caller is not an operator"},
                    "404": {"description": "no such worker or line in the policy"},
                    "409": {"description": "already held, or not held"},
                    "415": {"description": "not application/json"},
                },
            }
        },
        "/console/api/whoami": {
            "get": {
                "summary": "The caller's name and role",
                "responses": {"200": {"description": "{name, role, via}"}, "401": {}},
            }
        },
        "/v1/usage/export": {
            "get": {
                "summary": "The usage records of a period, countersigned, then the signed "
                "manifest (application/x-ndjson)",
                "description": "Viewer. One line per record whose at_ms falls in [from, to] "
                "(ordered by node, then seq), each signed by its node and countersigned by the "
                "replica that stored it; the last line is this replica's signed manifest "
                "(each node's head, the records' sha256). 'sluicegate meter verify' checks it. "
                "With peer=<campus>: the settlement export with that sister campus (our records "
                "of the jobs between us, then theirs as their broker countersigned them; "
                "'sluicegate meter peer-report' checks and settles it).",
                "parameters": [
                    *(
                        {"name": n, "in": "query", "required": True, "schema": {"type": "number"}}
                        for n in ("from", "to")
                    ),
                    {
                        "name": "peer",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string"},
                    },
                ],
                "responses": {
                    "200": {"description": "the export"},
                    "400": {"description": "from or to missing, not unix seconds, or from > to"},
                    "404": {"description": "this broker takes no usage records"},
                    "503": {"description": "{code: store_unavailable, error}: Redis is away"},
                },
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
