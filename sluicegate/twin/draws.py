"""What a replayed job costs, drawn from what the trace measured.

Per (edge, model), the compute of the jobs that ran on that edge; per (device class,
model), the amortised compute per job on a pool worker (its batch's time divided by the
batch's jobs, so a batch of ``n`` costs the sum of ``n`` draws); per link class (same zone,
on campus, off site), the time an offloaded job spent outside the worker: the placement
round trip, the transfer there and the result's way back. Where the trace holds no sample,
the figure the node reported (its ``service_ms``) or, for the links, the placement
parameters' latency and bandwidth stand in. Draws come from one seeded generator, in the
order the replay asks for them, so a replay is reproducible.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence

from broker.core.params import PlacementParams
from broker.core.scoring import link_class, transfer_costs
from sluicegate.twin.trace import Trace

DEFAULT_SERVICE_MS = 50.0  # a model nobody measured


class Draws:
    """Sampled service and transfer times for a replay of ``trace``."""

    def __init__(self, trace: Trace, params: PlacementParams, seed: int) -> None:
        self._rng = random.Random(seed)
        self._params = params
        header = trace.header
        worker_class = {w.id: w.device_class for w in header.workers}
        worker_zone = {w.id: w.zone for w in header.workers}
        edge_zone = {e.id: e.zone for e in header.edges}
        self._edge: dict[tuple[str, str], list[float]] = defaultdict(list)
        self._pool: dict[tuple[str, str], list[float]] = defaultdict(list)
        self._link: dict[int, list[float]] = defaultdict(list)
        self._local_overhead: dict[str, list[float]] = defaultdict(list)
        self._edge_spec = {e.id: e.service_ms for e in header.edges}
        self._class_spec: dict[tuple[str, str], float] = {}
        for w in header.workers:
            for model, ms in w.service_ms.items():
                self._class_spec.setdefault((w.device_class, model), ms)
        for job in trace.jobs:
            if job.status != "ok" or job.ran_on is None or job.service_ms <= 0:
                continue
            if job.offloaded and job.ran_on in worker_class:
                self._pool[(worker_class[job.ran_on], job.model)].append(job.service_ms / job.batch)
                outside = job.latency_ms - job.queue_ms - job.service_ms
                link = link_class(
                    edge_zone[job.edge], worker_zone[job.ran_on], params.campus_prefix
                )
                self._link[link].append(max(0.0, outside))
            elif not job.offloaded and job.ran_on == job.edge:
                self._edge[(job.edge, job.model)].append(job.service_ms)
                outside = job.latency_ms - job.queue_ms - job.service_ms
                self._local_overhead[job.edge].append(max(0.0, outside))

    def _pick(self, samples: Sequence[float]) -> float:
        return samples[self._rng.randrange(len(samples))]

    def edge_ms(self, edge: str, model: str) -> float:
        """One job's compute on ``edge``."""
        samples = self._edge.get((edge, model))
        if samples:
            return self._pick(samples)
        return self._edge_spec.get(edge, {}).get(model, DEFAULT_SERVICE_MS)

    def edge_overhead_ms(self, edge: str) -> float:
        """What a local job spends on the edge besides waiting and computing."""
        samples = self._local_overhead.get(edge)
        return self._pick(samples) if samples else 0.0

    def pool_job_ms(self, device_class: str, model: str, spec_ms: float | None) -> float:
        """One job's share of a batch on a worker of ``device_class``."""
        samples = self._pool.get((device_class, model))
        if samples:
            return self._pick(samples)
        if spec_ms is not None:
            return spec_ms
        return self._class_spec.get((device_class, model), DEFAULT_SERVICE_MS)

    def outside_ms(self, origin_zone: str, worker_zone: str, payload_bytes: int) -> float:
        """An offloaded job's time outside the worker: placement, transfer, the way back."""
        link = link_class(origin_zone, worker_zone, self._params.campus_prefix)
        samples = self._link.get(link)
        if samples:
            return self._pick(samples)
        return 2.0 * transfer_costs(payload_bytes, self._params)[link]

    def measured(self) -> dict[str, int]:
        """How many samples each kind of figure rests on (for the report)."""
        return {
            "edge": sum(map(len, self._edge.values())),
            "pool": sum(map(len, self._pool.values())),
            "links": sum(map(len, self._link.values())),
        }
