"""The usage record of one attempt a worker ran: what the job was (id, attempt, token, line,
owner, class), what ran it (zone, model file, backend, device class), and what it took (its
share of the batch's device time, its queue time, the bytes it came with, the digest of the
result document sent). Built here, written by the worker's ``sluicegate.metering`` meter
before the result leaves. No I/O: the ledger only validates the draft.
"""

from __future__ import annotations

import hashlib
import logging

from center_pool.intake import WorkItem
from sluicegate.config import PoolSettings
from sluicegate.metering.ledger import Ledger
from sluicegate.metering.record import Usage

log = logging.getLogger(__name__)


def attempt_record(
    ledger: Ledger,
    item: WorkItem,
    settings: PoolSettings,
    *,
    model_sha256: str,
    backend: str,
    batch_size: int,
    status: str,
    queue_ms: float,
    device_ms: float,
    result: bytes | None,
    now: float,
) -> Usage | None:
    """The draft record (its seq and prev the ledger's), or None, logged, when a value
    cannot be held by a record (the job's result goes out all the same)."""
    try:
        return ledger.draft(
            at_ms=int(now * 1000),
            event="ran",
            job_id=item.job_id,
            attempt=item.attempt,
            token_id=item.token_id,
            line=item.edge_id,
            owner=item.owner,
            data_class=item.data_class,
            zone=settings.zone,
            model=item.model,
            model_sha256=model_sha256,
            backend=backend,
            device_class=settings.device_class,
            device_us=max(0, round(device_ms * 1000.0)),
            queue_us=max(0, round(queue_ms * 1000.0)),
            batch_size=max(1, batch_size),
            bytes_in=item.bytes_in,
            result_sha256=hashlib.sha256(result).hexdigest() if result is not None else "",
            status=status,
        )
    except ValueError as exc:  # pydantic's ValidationError, naming the field
        log.error("job %s ran unmetered: its usage record is invalid: %s", item.job_id, exc)
        return None
