"""The placement rules themselves, as small pure functions shared by the fleet index and the
brute-force reference, so that both apply exactly one definition.

A worker is classified per model it has loaded (:func:`classify`, first reason wins:
offline, zone mismatch, missing provider, too little free memory, full, sub-healthy, ok).
An eligible worker is scored by predicted completion time::

    free      = when the work ahead there runs out, ms on the broker's clock (:func:`free_at_ms`)
    wait      = max(0, free - now)                                (:func:`wait_at`)
    predicted = transfer + service + wait
    score     = transfer + service + max(0, key - now)            (:func:`load_key`)

``free`` starts from the worker's last telemetry: the backlog it reports holding (each
queued and running job at its own model's service time, so a detector job behind OCR runs
waits for those runs), shared by its slots, from the moment the sample arrived; each job
placed there since adds its model's service time there (shared by the slots), starting no
earlier than it was placed. Time drains it: a sample a second old no longer counts the
second of work the worker has done since. ``key`` adds ``FleetParams.forecast_penalty``
times the wait ahead (as of the sample) when the load forecast crosses capacity. Both are
instants, not durations, so they do not change as the clock runs and the index can keep
workers ordered by ``key``; transfer depends only on the zone pair and service only on
(model, device class). Nothing here keeps state or reads a clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from broker.core.params import PlacementParams
from broker.core.state import Capabilities, TelemetrySample
from sluicegate.vision.manifest import Requirements

# Per-(worker, model) status; ``classify`` checks them from OFFLINE back to OK (first wins).
OK, SUBHEALTHY, FULL, NO_MEMORY, NO_PROVIDER, ZONE_MISMATCH, OFFLINE, CORDONED = range(8)
STATUS_NAMES = (
    "eligible",
    "subhealthy",
    "full",
    "memory",
    "provider",
    "zone_mismatch",
    "offline",
    "cordoned",
)
ELIGIBLE = (OK, SUBHEALTHY)


@dataclass(frozen=True, slots=True)
class Need:
    """A model's requirements, ready for the hot path."""

    providers: frozenset[str] = frozenset()  # any one of these; empty: any provider
    memory_mb: float = 0.0

    @classmethod
    def of(cls, req: Requirements) -> Need:
        return cls(frozenset(req.providers), float(req.memory_mb))

    def describe(self) -> str:
        parts = []
        if self.providers:
            parts.append(f"any of providers {', '.join(sorted(self.providers))}")
        if self.memory_mb:
            parts.append(f"{self.memory_mb:g} MiB free memory")
        return " and ".join(parts) or "nothing in particular"


NO_NEEDS = Need()


def needs_of(requirements: Mapping[str, Requirements]) -> dict[str, Need]:
    return {model: Need.of(req) for model, req in requirements.items()}


def classify(
    caps: Capabilities | None,
    sample: TelemetrySample | None,
    online: bool,
    reserved: int,
    need: Need,
    policy_zone: str,
    subhealthy: bool,
    marked_full: bool = False,
    cordoned: bool = False,
) -> int:
    """The status of one worker for one model it has loaded. ``marked_full``: the shell
    learnt (from a refused shared reservation) that the worker has no room left;
    ``cordoned``: an operator took it out of placement (drain or cordon)."""
    if not online or caps is None or sample is None:
        return OFFLINE
    if cordoned:
        return CORDONED
    if policy_zone != caps.zone:
        return ZONE_MISMATCH
    if need.providers and need.providers.isdisjoint(caps.providers):
        return NO_PROVIDER
    if need.memory_mb and need.memory_mb > caps.memory_total_mb - sample.memory_used_mb:
        return NO_MEMORY
    if marked_full or sample.queue_depth + sample.in_flight + reserved >= sample.capacity:
        return FULL
    return SUBHEALTHY if subhealthy else OK


def per_job_ms(sample: TelemetrySample, default_ms: float) -> float:
    """A worker's mean job, ms: its backlog over the jobs it holds, else the mean of the
    service times it reports, else ``default_ms``."""
    held = sample.queue_depth + sample.in_flight
    if sample.backlog_ms is not None and held:
        return sample.backlog_ms / held
    if sample.service_ms:
        return sum(sample.service_ms.values()) / len(sample.service_ms)
    return default_ms


def step_ms(
    sample: TelemetrySample, model: str | None, concurrency: int, default_ms: float
) -> float:
    """How much later the worker frees up for a job of ``model`` placed on it: the model's
    service time there as it reports it (else its mean job) over its slots."""
    ms = sample.service_ms.get(model) if model is not None else None
    return (ms if ms is not None else per_job_ms(sample, default_ms)) / concurrency


Placement = tuple[float, str | None]  # (when, ms on the broker's clock; the job's model)


def free_at_ms(
    sample: TelemetrySample, placed: Iterable[Placement], concurrency: int, default_ms: float
) -> float:
    """When the work ahead on the worker runs out, ms on the broker's clock: the backlog
    it reported (older telemetry: its jobs at its mean job) shared by its slots from the
    moment the sample arrived, then each job placed there since (``placed``, in order),
    each starting no earlier than it was placed."""
    held = sample.backlog_ms
    if held is None:
        held = (sample.queue_depth + sample.in_flight) * per_job_ms(sample, default_ms)
    free = sample.received_at * 1000.0 + held / concurrency
    for when, model in placed:
        free = after_placing(free, when, step_ms(sample, model, concurrency, default_ms))
    return free


def after_placing(free: float, when_ms: float, step: float) -> float:
    """``free`` once one more job, placed at ``when_ms``, is queued behind the work."""
    return (free if free > when_ms else when_ms) + step


def load_key(free: float, since_ms: float, crosses: bool, penalty: float) -> float:
    """The instant the index orders workers by: ``free``, with the wait ahead as of
    ``since_ms`` (the sample's arrival) multiplied by ``penalty`` when crossing."""
    if crosses and free > since_ms:
        return free + (penalty - 1.0) * (free - since_ms)
    return free


def wait_at(instant: float, now_ms: float) -> float:
    """Milliseconds from ``now_ms`` until ``instant``, never negative."""
    return instant - now_ms if instant > now_ms else 0.0


def transfer_costs(payload_bytes: int, params: PlacementParams) -> tuple[float, float, float]:
    """Milliseconds to move the payload over each link class: latency + bytes / bandwidth."""
    lat, bw = params.link_latency_ms, params.link_mb_per_s
    return (
        lat[0] + payload_bytes / (bw[0] * 1000.0),
        lat[1] + payload_bytes / (bw[1] * 1000.0),
        lat[2] + payload_bytes / (bw[2] * 1000.0),
    )
