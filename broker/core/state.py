"""What the broker knows about one worker, as frozen values built from its wire documents.

:class:`Capabilities` comes from the worker's retained capabilities document,
:class:`TelemetrySample` from each telemetry message, and :class:`WorkerState` holds both
plus a bounded history of samples, whether the worker is online and when it was last
heard from. Converting from the pydantic wire models happens here, once; nothing in this
module keeps state, reads a clock or knows about reservations, policy or scoring.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from policies.sealing import decode_seal_key
from sluicegate.wire_pool import WorkerCapabilities, WorkerTelemetry


def model_key(name: str, sha256: str | None) -> str:
    """How placement looks a model up: by name, or by name and exact file when the request
    names the sha256 the edge runs (``defect-v1@3f9c…``)."""
    return f"{name}@{sha256}" if sha256 else name


def model_name(key: str) -> str:
    return key.partition("@")[0]


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a worker can run: its declared zone and device class, the ONNX Runtime
    providers it has, its memory, the models it has loaded, batch size and concurrency.

    ``models`` are the keys placement finds the worker under: each model's name and, for a
    model whose sha256 the worker reports, its :func:`model_key` with that sha256."""

    zone: str
    device_class: str
    providers: frozenset[str]
    memory_total_mb: float
    models: tuple[str, ...]  # sorted
    max_batch: int
    concurrency: int
    seal_key: bytes | None = None  # its current sealing key (raw X25519); None: none or bad

    @classmethod
    def from_wire(cls, caps: WorkerCapabilities) -> Capabilities:
        keys = set(caps.models)
        keys |= {model_key(n, m.sha256) for n, m in caps.models.items() if m.sha256}
        return cls(
            zone=caps.zone,
            device_class=caps.device_class,
            providers=frozenset(caps.providers),
            memory_total_mb=float(caps.memory_total_mb),
            models=tuple(sorted(keys)),
            max_batch=caps.max_batch,
            concurrency=caps.concurrency,
            seal_key=_seal_key(caps.seal_key),
        )

    @property
    def names(self) -> tuple[str, ...]:
        """The models' names, each once."""
        return tuple(m for m in self.models if "@" not in m)


def _seal_key(text: str | None) -> bytes | None:
    if text is None:
        return None
    try:
        return decode_seal_key(text)
    except ValueError:  # an unreadable key is no key: nothing is sealed to it
        return None


@dataclass(frozen=True, slots=True)
class TelemetrySample:
    """One telemetry message, as the broker keeps it. ``ts`` is the worker's clock (used
    only for trends within that worker); ``received_at`` is the broker's."""

    ts: float
    received_at: float
    queue_depth: int
    in_flight: int
    capacity: int
    utilisation: float
    memory_used_mb: float
    memory_bandwidth: float | None
    temperature_c: float | None
    service_ms: Mapping[str, float]  # per-model moving average the worker reports
    backlog_ms: float | None = None  # its queued and running jobs, each at its own model

    @classmethod
    def from_wire(cls, tel: WorkerTelemetry, received_at: float) -> TelemetrySample:
        return cls(
            ts=tel.ts,
            received_at=received_at,
            queue_depth=tel.queue_depth,
            in_flight=tel.in_flight,
            capacity=tel.capacity,
            utilisation=tel.utilisation,
            memory_used_mb=tel.memory_used_mb,
            memory_bandwidth=tel.memory_bandwidth,
            temperature_c=tel.temperature_c,
            service_ms={m: load.service_ms for m, load in tel.models.items()},
            backlog_ms=tel.backlog_ms,
        )

    @property
    def load(self) -> float:
        """Jobs held (queued and running) as a fraction of capacity, without reservations."""
        return (self.queue_depth + self.in_flight) / self.capacity

    def metrics(self) -> dict[str, float]:
        """The metrics sub-health rules may name; a metric the worker did not report is
        absent, so no rule fires on data we do not have."""
        out = {"utilisation": self.utilisation, "load": self.load}
        if self.memory_bandwidth is not None:
            out["memory_bandwidth"] = self.memory_bandwidth
        if self.temperature_c is not None:
            out["temperature_c"] = self.temperature_c
        return out


@dataclass(frozen=True, slots=True)
class WorkerState:
    """A worker as last heard of. ``samples`` is oldest first and bounded."""

    worker_id: str
    capabilities: Capabilities | None = None
    samples: tuple[TelemetrySample, ...] = ()
    online: bool = False
    last_seen: float = 0.0

    @property
    def latest(self) -> TelemetrySample | None:
        return self.samples[-1] if self.samples else None

    @property
    def placeable(self) -> bool:
        """Online, with capabilities and at least one telemetry sample: enough to score."""
        return self.online and self.capabilities is not None and bool(self.samples)

    def with_sample(self, sample: TelemetrySample, history: int) -> WorkerState:
        samples = (*self.samples[-(history - 1) :], sample) if history > 1 else (sample,)
        return WorkerState(self.worker_id, self.capabilities, samples, True, sample.received_at)
