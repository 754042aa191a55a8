"""The edge's usage records: one for every concluded job that ran here or was ever placed.

A job run on this line PC gets a ``ran`` record (attempt 0: its device time, the model file,
the backend), which settles it: billing takes that run. A job that was placed on a pool
worker and concluded gets a ``settled`` record naming the worker and attempt whose result
this edge delivered (``settled_node``/``settled_attempt``, and the delivered document's
sha256, which the worker's own record of that attempt carries too); every other attempt
of the job that ran is waste. A placed job that concluded with no worker's result (it
expired, or was dead-lettered) is settled with no node: all its attempts are waste. A job
that was neither run nor placed (refused, expired at once) costs nothing and has no record.

The record is appended beside the result's commit (``edge_agent.carry``), in the ledger of
``sluicegate.metering`` (the same as a worker's, ``kind = "edge"``); the result goes out once
both are on disk. :func:`edge_record` is pure; :class:`EdgeMetering` is the thin part that
holds the node's meter.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import ValidationError

from edge_agent.admission import Job, Owners
from policies import Policy
from sluicegate import wire
from sluicegate.metering.meter import Meter
from sluicegate.metering.record import SignedUsage, Usage
from sluicegate.vision.runtime import StageTimes

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Concluded:
    """What the record of one concluded job is made from."""

    job: Job
    result: wire.JobResult
    payload: bytes  # the result document delivered
    times: StageTimes | None  # set when the job ran here
    placed: bool  # it was placed on a worker at least once
    settled_attempt: int  # the attempt whose return is delivered; 0: none
    # The worker that attempt went to, as this edge named it (``<worker>@<campus>`` on a
    # sister campus: the result's own ``ran_on`` names it as its campus does); "": not known.
    worker: str = ""


def edge_record(
    draft: Callable[..., Usage],
    done: Concluded,
    *,
    edge_id: str,
    zone: str,
    owner: str,
    model_sha256: str,
    backend: str,
    device_class: str,
) -> Usage | None:
    """The draft record of ``done`` (``draft`` is the ledger's), or None when it needs none."""
    job, result = done.job, done.result
    digest = hashlib.sha256(done.payload).hexdigest()
    common = {
        "job_id": job.job_id,
        "line": edge_id,
        "owner": owner,
        "data_class": job.data_class[:64],
        "model": job.model[:128],
        "bytes_in": len(job.payload),
        "result_sha256": digest,
        "status": result.status,
    }
    if done.times is not None:
        times = done.times
        device_ms = times.decode_ms + times.preprocess_ms + times.inference_ms
        queue_ms = result.timings_ms.queue_ms
        return draft(
            event="ran",
            attempt=0,
            zone=zone,
            model_sha256=model_sha256,
            backend=backend,
            device_class=device_class,
            device_us=max(0, round(device_ms * 1000.0)),
            queue_us=max(0, round(queue_ms * 1000.0)),
            **common,
        )
    if not done.placed:
        return None
    delivered = done.settled_attempt and result.ran_on.kind == "pool"
    worker = (done.worker or result.ran_on.node) if delivered else ""
    return draft(
        event="settled",
        attempt=done.settled_attempt,
        zone=result.ran_on.zone if worker else zone,
        settled_node=worker,
        settled_attempt=done.settled_attempt if worker else 0,
        **common,
    )


class EdgeMetering:
    """The edge agent's meter and what its records need to know about the edge."""

    def __init__(
        self,
        meter: Meter,
        *,
        edge_id: str,
        zone: str,
        device_class: str,
        backend: str,
        policy: Callable[[], Policy | None],
        model_sha256: Callable[[str], str | None],
    ) -> None:
        self.meter = meter
        self._edge_id = edge_id
        self._zone = zone
        self._device_class = device_class
        self._backend = backend
        self._policy = policy
        self._model_sha256 = model_sha256
        self._owners = Owners(edge_id)
        self.unmetered = 0  # jobs concluded with no record (a value a record cannot hold)

    def record(self, done: Concluded) -> asyncio.Future[list[SignedUsage]] | None:
        """Append the record of ``done``; the future resolves once it is on disk. None
        when the job needs no record, or its record could not be made (logged)."""
        try:
            draft = edge_record(
                self.meter.ledger.draft,
                done,
                edge_id=self._edge_id,
                zone=self._zone,
                owner=self._owners.of(self._policy(), done.job.response_topic),
                model_sha256=self._model_sha256(done.job.model) or "",
                backend=self._backend,
                device_class=self._device_class,
            )
        except ValidationError as exc:
            self.unmetered += 1
            log.error("job %s concluded unmetered: %s", done.job.job_id, exc)
            return None
        if draft is None:
            return None
        return self.meter.record([draft])
