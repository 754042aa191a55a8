"""Builders for the broker core tests: policies with pools, wire documents, requests.

Shared by every ``test_broker_core_*`` module; its own tests check that the builders make
what the core expects (a signed-policy-shaped policy, valid wire documents).
"""

from __future__ import annotations

import hashlib
from typing import Any

from broker.core.fleet import Fleet
from broker.core.params import FleetParams, PlacementParams
from policies.model import Policy
from sluicegate.vision.manifest import Requirements
from sluicegate.wire import ModelLoad
from sluicegate.wire_pool import (
    Completion,
    ModelCapability,
    PlacementRequest,
    WorkerCapabilities,
    WorkerTelemetry,
)
from tests.policies.policy_testkit import base_doc, policy_of, workers

NOW = 1_780_000_000.0
N1 = "campus/fab-north/line-1"
NDC = "campus/fab-north/dc"
S1 = "campus/fab-south/line-1"
SDC = "campus/fab-south/dc"
CLOUD = "offsite/cloud-east"
ZONES = (N1, NDC, S1, SDC, CLOUD)
SHA = hashlib.sha256(b"image").hexdigest()
PARAMS = PlacementParams()


def campus_policy(
    pools: dict[str, list[str]] | None = None,
    *,
    subhealth: list[dict[str, Any]] | None = None,
    classes: dict[str, Any] | None = None,
    version: int = 1,
) -> Policy:
    """The testkit's two-fab policy with ``pools`` (zone -> worker ids, each listed with its
    published test key) instead of its own."""
    doc = base_doc(version=version)
    pools = pools if pools is not None else {NDC: ["gpu-1"], SDC: ["npu-1"], CLOUD: ["cloud-1"]}
    doc["pools"] = {
        f"pool-{i}": {"zone": zone, "workers": workers(*ids)}
        for i, (zone, ids) in enumerate(sorted(pools.items()))
        if ids
    }
    doc["classes"]["recipe-overlay"] = {
        "allow": [
            "campus/fab-north/** -> campus/fab-north/**",
            "campus/fab-south/** -> campus/fab-south/**",
        ],
        "deny": ["offsite/**"],
    }
    if classes:
        doc["classes"].update(classes)
    if subhealth is not None:
        doc["subhealth"] = subhealth
    return policy_of(doc)


def caps(
    worker_id: str,
    zone: str,
    *,
    device_class: str = "nvidia-a100",
    models: tuple[str, ...] = ("defect-v1",),
    providers: tuple[str, ...] = ("CUDAExecutionProvider", "CPUExecutionProvider"),
    memory_total_mb: int = 40_000,
    concurrency: int = 2,
    max_batch: int = 8,
    shas: dict[str, str] | None = None,
) -> WorkerCapabilities:
    """A worker's capabilities; ``shas`` gives the sha256 it reports for some models."""
    known = shas or {}
    return WorkerCapabilities(
        worker_id=worker_id,
        zone=zone,
        device_class=device_class,
        providers=list(providers),
        memory_total_mb=memory_total_mb,
        models={m: ModelCapability(version="1", sha256=known.get(m)) for m in models},
        max_batch=max_batch,
        concurrency=concurrency,
    )


def telemetry(
    worker_id: str,
    ts: float,
    *,
    zone: str = NDC,
    queue_depth: int = 0,
    in_flight: int = 0,
    capacity: int = 16,
    utilisation: float = 0.2,
    memory_used_mb: float = 1_000.0,
    memory_bandwidth: float | None = 0.2,
    temperature_c: float | None = 50.0,
    service_ms: dict[str, float] | None = None,
    device_class: str = "nvidia-a100",
    backlog_ms: float | None = None,
) -> WorkerTelemetry:
    return WorkerTelemetry(
        node=worker_id,
        zone=zone,
        ts=ts,
        device_class=device_class,
        utilisation=utilisation,
        memory_used_mb=memory_used_mb,
        memory_total_mb=40_000.0,
        memory_bandwidth=memory_bandwidth,
        temperature_c=temperature_c,
        queue_depth=queue_depth,
        in_flight=in_flight,
        capacity=capacity,
        backlog_ms=backlog_ms,
        models={m: ModelLoad(service_ms=v, completed=1) for m, v in (service_ms or {}).items()},
        results={},
        refused={},
    )


def request(
    job_id: str = "job-1",
    *,
    origin_zone: str = N1,
    model: str = "defect-v1",
    data_class: str = "wafer-image",
    payload_bytes: int = 100_000,
    priority: int = 5,
    deadline_at: float | None = None,
    local_estimate_ms: float | None = None,
    model_sha256: str | None = None,
) -> PlacementRequest:
    return PlacementRequest(
        job_id=job_id,
        edge_id="edge-1",
        origin_zone=origin_zone,
        model=model,
        model_sha256=model_sha256,
        data_class=data_class,
        payload_sha256=SHA,
        payload_bytes=payload_bytes,
        priority=priority,
        deadline_at=deadline_at,
        submitted_at=NOW,
        local_estimate_ms=local_estimate_ms,
    )


def completion(
    job_id: str, worker_id: str, service_ms: float, *, model: str = "defect-v1"
) -> Completion:
    return Completion(
        job_id=job_id,
        worker_id=worker_id,
        status="ok",
        model=model,
        service_ms=service_ms,
        queue_ms=0.0,
        batch_size=1,
        ts=NOW,
    )


def fleet_with(
    policy: Policy,
    workers: list[tuple[WorkerCapabilities, dict[str, Any]]],
    *,
    now: float = NOW,
    params: FleetParams | None = None,
    requirements: dict[str, Requirements] | None = None,
) -> Fleet:
    """A fleet where each worker announced ``caps`` and sent one telemetry sample (``kw``)."""
    fleet = Fleet(params, requirements, policy)
    for cap, kw in workers:
        fleet.apply_capabilities(cap, now)
        fleet.apply_telemetry(telemetry(cap.worker_id, now, zone=cap.zone, **kw), now)
    return fleet


def test_campus_policy_places_workers_in_their_pools() -> None:
    policy = campus_policy({NDC: ["a", "b"], CLOUD: ["c"]})
    assert policy.worker_zone("a") == NDC
    assert policy.worker_zone("c") == CLOUD
    assert policy.worker_zone("gpu-1") is None
    assert "recipe-overlay" in policy.classes


def test_builders_make_valid_wire_documents() -> None:
    fleet = fleet_with(campus_policy(), [(caps("gpu-1", NDC), {"queue_depth": 3})])
    state = fleet.state("gpu-1")
    assert state is not None
    assert state.placeable
    assert state.latest is not None
    assert state.latest.queue_depth == 3
