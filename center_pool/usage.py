"""The usage record of one attempt a worker ran: what the job was (id, attempt, token, line,
owner, class), what ran it (zone, model file, backend, device class), and what it took (its
share of the batch's device time, its queue time, the bytes it came with, the digest of the
result document sent). Built here (:func:`attempt_record`, no I/O: the ledger only
validates the draft), and a batch's results held until its records are on disk
(:class:`BatchRecords`), which never keeps a result back when the ledger fails.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Sequence
from functools import partial

from center_pool.intake import WorkItem
from sluicegate.config import PoolSettings
from sluicegate.errors import LedgerError
from sluicegate.metering.ledger import Ledger
from sluicegate.metering.meter import Meter
from sluicegate.metering.record import SignedUsage, Usage

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
            campus=item.peer,
        )
    except ValueError as exc:  # pydantic's ValidationError, naming the field
        log.error("job %s ran unmetered: its usage record is invalid: %s", item.job_id, exc)
        return None


class BatchRecords:
    """A batch's records in one transaction of ``meter``'s ledger, and its results and
    completions sent once that is durable (at once without a meter, or when it fails:
    those attempts are counted unmetered). ``after`` runs once the sends are out."""

    def __init__(self, meter: Meter | None, after: Callable[[], None]) -> None:
        self._meter = meter
        self._after = after
        self.pending = 0  # batches whose results wait for their records' commit
        self.unmetered = 0  # attempts that ran and went out without a usage record

    def send_after(self, drafts: Sequence[Usage], sends: list[Callable[[], None]]) -> None:
        recording = None
        if drafts and self._meter is not None:
            try:
                recording = self._meter.record(drafts)
            except LedgerError as exc:  # not open (any more): the results go all the same
                self.unmetered += len(drafts)
                log.error("%d job(s) ran unmetered: %s", len(drafts), exc)
        if recording is None:
            for send in sends:
                send()
            return
        self.pending += 1
        recording.add_done_callback(partial(self._recorded, sends, len(drafts)))

    def _recorded(
        self, sends: list[Callable[[], None]], count: int, fut: asyncio.Future[list[SignedUsage]]
    ) -> None:
        self.pending -= 1
        if fut.cancelled() or fut.exception() is not None:
            self.unmetered += count
            why = "cancelled" if fut.cancelled() else fut.exception()
            log.error(
                "%d job(s) ran unmetered: their usage records were not written: %s", count, why
            )
        for send in sends:
            send()
        self._after()
