"""The worker's compliance plumbing: its audit key, its replay cache and its audit sink.

Every work message refused before its placement token passed becomes a signed, hash-chained
record (``policies.AsyncAuditWriter``) in a file, a Redis stream or, when neither is
configured, memory (with a loud warning: such a log dies with the process). Records are
written by one task in arrival order, so the chain never forks; when the store falls behind,
intake waits (:meth:`AuditSink.room`) rather than drop a record. A store that fails is
logged and counted; the worker keeps serving.

Nonces of accepted tokens go to Redis (``SET NX``, shared by every worker on the campus) or
to a bounded in-memory cache for a single worker.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path

from center_pool.errors import AuditSetupError
from policies import AsyncAuditWriter, MemoryReplayCache, SigningKey, load_signing_key
from policies.audit import Scalar
from policies.audit_file import FileAuditStore
from policies.errors import AuditError, KeyFileError, StoreUnavailable

log = logging.getLogger(__name__)

REFUSED = "work.refused"
POLICY_ACCEPTED = "policy.accepted"
SEAL_KEY_ROTATED = "worker.seal_key_rotated"  # the key edges seal this worker's images to


def check_cancelled() -> None:
    """Raise the cancellation the current task was sent if an await swallowed it: redis-py's
    asyncio client can (redis/redis-py#2028), and a loop over Redis would never end."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def load_worker_key(path: Path | None, worker_id: str) -> SigningKey:
    """The key that signs this worker's audit records; an ephemeral one if none is set."""
    if path is None:
        key = SigningKey.generate()
        log.warning(
            "worker %s has no [pool] key_file: its audit records are signed with an ephemeral "
            "key %s (trust it when verifying this run's log; configure a key file to keep one)",
            worker_id,
            key.public_text,
        )
        return key
    try:
        return load_signing_key(path)
    except KeyFileError as exc:
        raise AuditSetupError(
            f"[pool] key_file {path}: {exc}; create one with 'sluicegate policy keygen'"
        ) from exc


class MemoryAsyncReplayCache:
    """``policies.MemoryReplayCache`` behind the async interface the worker uses."""

    def __init__(self, max_entries: int = 100_000) -> None:
        self._cache = MemoryReplayCache(max_entries)

    async def claim(self, nonce: bytes, until: float, now: float) -> bool:
        return self._cache.claim(nonce, until, now)

    async def claim_many(self, wanted: Sequence[tuple[bytes, float]], now: float) -> list[bool]:
        return [self._cache.claim(nonce, until, now) for nonce, until in wanted]


class AsyncFileAuditStore:
    """``policies.audit_file.FileAuditStore`` with its file calls off the event loop."""

    def __init__(self, path: Path, *, fsync: bool = False) -> None:
        self.file = FileAuditStore(path, fsync=fsync)

    async def append(self, seq: int, entry: bytes) -> None:
        await asyncio.to_thread(self.file.append, seq, entry)

    async def last(self) -> bytes | None:
        return await asyncio.to_thread(self.file.last)


class MemoryAuditStore:
    """An audit log in a list: for tests, and the last resort when nothing is configured."""

    def __init__(self) -> None:
        self.entries: list[bytes] = []

    async def append(self, seq: int, entry: bytes) -> None:
        self.entries.append(entry)

    async def last(self) -> bytes | None:
        return self.entries[-1] if self.entries else None


class AuditSink:
    """Writes audit records in order on one task; callers enqueue without waiting."""

    def __init__(self, writer: AsyncAuditWriter, *, high_water: int = 1000) -> None:
        self.writer = writer
        self.high_water = high_water
        self._pending: deque[tuple[str, dict[str, Scalar], float]] = deque()
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        self._room = asyncio.Event()
        self._room.set()
        self.written = 0
        self.failed = 0

    @property
    def public_key(self) -> bytes:
        return self.writer.key.public

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, kind: str, data: Mapping[str, Scalar], *, now: float) -> None:
        self._pending.append((kind, dict(data), now))
        if len(self._pending) >= self.high_water:
            self._room.clear()
        self._drained.clear()
        self._wake.set()

    async def room(self) -> None:
        """Return once fewer than ``high_water`` records wait (intake's back-pressure)."""
        await self._room.wait()

    async def run(self) -> None:
        """Write records until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                kind, data, now = self._pending[0]
                try:
                    await self.writer.append(kind, data, now=now)
                    self.written += 1
                except (StoreUnavailable, AuditError) as exc:
                    self.failed += 1
                    log.error("audit record %s %s could not be written: %s", kind, data, exc)
                self._pending.popleft()
                check_cancelled()
                if len(self._pending) < self.high_water:
                    self._room.set()
            self._drained.set()

    async def flush(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for every submitted record to be written."""
        try:
            await asyncio.wait_for(self._drained.wait(), timeout)
        except TimeoutError:
            log.error("%d audit record(s) not written before shutdown", len(self._pending))
