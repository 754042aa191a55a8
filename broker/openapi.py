"""The OpenAPI 3.1 description of the broker's HTTP API (``broker.api`` serves it at
``/openapi.json``; ``tests`` hold it to the routes ``broker.api.make_app`` registers): every
route, who may call it, its parameters and answers, and what ``/metrics`` exposes. Data only.
"""

from __future__ import annotations

from typing import Any

from broker.view import FLEET_PAGE, FLEET_PAGE_MAX

DEAD_LETTERS_DEFAULT = 100  # GET /dead-letters?limit=
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
