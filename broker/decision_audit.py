"""Every placement decision into the signed, hash-chained audit log, without slowing them.

Decisions are added as they are answered; a background task writes whatever accumulated
while the previous record was being signed and stored as one record (``placements``), so
the cost of a signature and a Redis round trip is shared by a whole burst. Each decision
keeps its top candidates and the reasons the others were filtered out.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from policies import AsyncAuditWriter
from policies.audit import Scalar

log = logging.getLogger(__name__)


class DecisionAudit:
    def __init__(self, writer: AsyncAuditWriter, clock: Callable[[], float]) -> None:
        self._writer = writer
        self._clock = clock
        self._pending: list[dict[str, Any]] = []
        self._wanted = asyncio.Event()
        self.written = 0  # decisions stored so far

    def add(self, decision: dict[str, Any]) -> None:
        self._pending.append(decision)
        self._wanted.set()

    async def run(self) -> None:
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            batch, self._pending = self._pending, []
            if not batch:
                continue
            data: dict[str, Scalar] = {
                "count": len(batch),
                "jobs": ",".join(str(d["job_id"]) for d in batch),
                "decisions": json.dumps(batch, default=str, separators=(",", ":")),
            }
            try:
                await self._writer.append("placements", data, now=self._clock())
                self.written += len(batch)
            except Exception:
                log.exception("audit append of %d decisions failed", len(batch))
