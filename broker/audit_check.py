"""The broker's own, periodic check of its signed audit log (the hash chain in its Redis
stream): where the chain's verified head is, how many records it covers, and when it was
last verified, for ``/metrics`` and the HTTP view.

Verification is incremental: each pass first re-reads the record at the verified head (a
log cut back or rewritten there fails at once), then checks only the records appended since,
as a continuation of that head (``policies.audit.verify_chain(after=...)``); every
``full_every_s`` a pass starts again from the first record, so an edit deep in the log is
found too. Records are read in chunks and checked on the event loop a slice at a time,
yielding to it between slices (a placement request that arrives meanwhile waits for one
slice, about 2 ms at most); after each chunk the pass rests in proportion to the time it
took, so a long chain never takes more than ``duty`` of a core. (On a worker thread, the
checking held the interpreter lock for its switch interval, 5 ms, each time the loop gave
it up: for the 150 ms of a pass every callback of the loop took 8-15 ms.) Records this
process's own writer stored are checked against the digests it kept of them instead of
their signatures (``policies.audit``: the same bytes it signed), and forgotten by the writer
once verified; a pass from the first record checks their signatures again. It never
writes to the log and never repairs it: a broken chain is counted and named, and stays
broken until an operator looks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from broker.metrics import BrokerMetrics
from policies.audit import AsyncAuditWriter, ChainSummary, decode_record, verify_chain
from policies.errors import AuditChainBroken, AuditError
from policies.model import Policy
from policies.redis_stores import AsyncRedisStreamAuditStore
from sluicegate.errors import StoreUnavailable

log = logging.getLogger(__name__)

INTERVAL_S = 15.0  # between passes
FULL_EVERY_S = 6 * 3600.0  # a pass from the first record, at most this far apart
CHUNK = 1000  # records read and checked per step
SLICE = 8  # records checked between two turns of the loop (signatures: about 2 ms)
DUTY = 0.5  # most of a core a pass takes: it rests (1 - DUTY) / DUTY of each step's time


@dataclass(frozen=True, slots=True)
class AuditStanding:
    """What the last pass found. ``head``: the verified chain's last record hash (hex);
    ``verified_at``: when the chain was last verified up to the log's head (None: never)."""

    head: str | None
    records: int
    verified_at: float | None
    ok: bool
    error: str | None

    def plain(self) -> dict[str, Any]:
        return {
            "head": self.head,
            "records": self.records,
            "verified_at": self.verified_at,
            "ok": self.ok,
            "error": self.error,
        }


class AuditChecker:
    """Verifies one audit stream now and then (every ``interval_s``, by default
    ``INTERVAL_S``). ``trusted()``: the keys its records may be signed by, asked at each
    pass (the broker's own key, and the broker keys of the policy in force). ``writer``:
    the process's own writer to this stream, whose records' digests stand for their
    signatures."""

    def __init__(
        self,
        store: AsyncRedisStreamAuditStore,
        trusted: Callable[[], Collection[bytes]],
        metrics: BrokerMetrics,
        *,
        interval_s: float | None = None,
        full_every_s: float = FULL_EVERY_S,
        chunk: int = CHUNK,
        duty: float = DUTY,
        clock: Callable[[], float] = time.time,
        writer: AsyncAuditWriter | None = None,
    ) -> None:
        if chunk < 1 or not 0.0 < duty <= 1.0:
            raise ValueError(f"chunk = {chunk}, duty = {duty}; accepted: chunk >= 1, 0 < duty <= 1")
        self._store = store
        self._trusted = trusted
        self._metrics = metrics
        self._interval_s = INTERVAL_S if interval_s is None else interval_s
        self._full_every_s = full_every_s
        self._chunk = chunk
        self._rest = (1.0 - duty) / duty
        self._clock = clock
        self._writer = writer
        self._summary: ChainSummary | None = None  # the chain verified so far
        self._full_at: float | None = None  # when the last pass from the first record began
        self.standing = AuditStanding(None, 0, None, False, "not verified yet")

    def plain(self) -> dict[str, Any]:
        """``{head, records, verified_at, ok, error}`` for the HTTP view."""
        return self.standing.plain()

    async def run(self) -> None:
        """Check now, then every ``interval_s``, for the life of the broker."""
        while True:
            await self.check()
            await asyncio.sleep(self._interval_s)

    async def check(self) -> AuditStanding:
        """One pass; its finding is also ``standing`` and the audit metrics."""
        started = self._clock()
        full = self._full_at is None or started - self._full_at >= self._full_every_s
        trusted = frozenset(self._trusted())
        try:
            summary = await self._verify(None if full else self._summary, trusted)
        except AuditError as exc:
            self._metrics.audit_failures.inc()
            log.error("audit log does not verify: %s", exc)
            problem = getattr(exc, "problem", None)
            self._found(ok=False, error=f"{exc.reason}{f' ({problem})' if problem else ''}: {exc}")
            return self.standing
        except StoreUnavailable as exc:
            # The chain is not known to be broken: only its verification grows old.
            self._found(ok=False, error=f"not verified: {exc}")
            return self.standing
        if full:
            self._full_at = started
        if self._writer is not None:
            self._writer.forget(summary.count)
        self._summary = summary
        at = self._clock()
        self._metrics.audit_verified_at.set(at)
        self._found(ok=True, error=None, verified_at=at)
        return self.standing

    async def _verify(self, after: ChainSummary | None, trusted: frozenset[bytes]) -> ChainSummary:
        if after is not None and after.count:
            tip = await self._store.read(after.count - 1, 1)
            if not tip or _hash(tip[0]) != after.head:
                raise AuditChainBroken(
                    f"the head verified before ({after.head.hex()[:16]}…) is gone or "
                    "changed: the log was cut back or rewritten",
                    index=after.count - 1,
                    problem="truncated",
                )
        # A pass from the first record checks every signature, witnessed or not.
        own = self._writer
        witnessed = own.witnessed if own is not None and after is not None else None
        summary = after
        while True:
            seq = summary.count if summary is not None else 0
            entries = await self._store.read(seq, self._chunk)
            if not entries:
                return summary or ChainSummary(0, bytes(32), frozenset())
            busy = 0.0
            for start in range(0, len(entries), SLICE):
                began = time.perf_counter()
                summary = verify_chain(
                    entries[start : start + SLICE], trusted, after=summary, witnessed=witnessed
                )
                busy += time.perf_counter() - began
                await asyncio.sleep(0)  # urgent work that arrived meanwhile goes first
            await asyncio.sleep(busy * self._rest)
            assert summary is not None  # the chunk held a record at least
            if len(entries) < self._chunk:
                return summary

    def _found(self, *, ok: bool, error: str | None, verified_at: float | None = None) -> None:
        summary = self._summary
        count = summary.count if summary is not None else 0
        self._metrics.audit_records.set(count)
        self.standing = AuditStanding(
            head=summary.head.hex() if summary is not None and count else None,
            records=count,
            verified_at=verified_at if verified_at is not None else self.standing.verified_at,
            ok=ok,
            error=error,
        )


def _hash(entry: bytes) -> bytes | None:
    try:
        return decode_record(entry).hash
    except ValueError:
        return None


def trusted_keys(own: bytes, policy: Policy | None) -> frozenset[bytes]:
    """Who may have signed a broker's log: its own key, and the broker keys the policy in
    force lists (a key rotated within them still verifies the records it signed)."""
    listed = [ref.public for ref in policy.brokers] if policy is not None else []
    return frozenset((own, *listed))
