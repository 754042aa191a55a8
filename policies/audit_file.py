"""The file backend of the audit log: one record per line, appended, optionally fsynced.

It owns the file layout only: it never verifies, rewrites, truncates or reorders lines, and
it assumes a single writing process per file (run one log per node). A torn last line after a
crash is kept as it is, so ``audit-verify`` reports it instead of hiding it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from policies.audit import MAX_RECORD_BYTES
from policies.errors import AuditError, AuditLogUnreadable


class FileAuditStore:
    """Append-only JSON-lines file. ``fsync=True`` makes each append durable before it returns."""

    def __init__(self, path: Path, *, fsync: bool = False) -> None:
        self.path = path
        self.fsync = fsync

    def append(self, seq: int, entry: bytes) -> None:
        if b"\n" in entry:
            raise AuditError(f"record {seq} contains a newline; records are one line each")
        try:
            with self.path.open("ab") as handle:
                handle.write(entry + b"\n")
                handle.flush()
                if self.fsync:
                    os.fsync(handle.fileno())
        except OSError as exc:
            raise AuditError(f"{self.path}: cannot append: {exc.strerror}") from exc

    def last(self) -> bytes | None:
        try:
            with self.path.open("rb") as handle:
                size = handle.seek(0, os.SEEK_END)
                handle.seek(max(0, size - 2 * MAX_RECORD_BYTES))
                tail = handle.read()
        except FileNotFoundError:
            return None
        lines = tail.rstrip(b"\n").split(b"\n")
        return lines[-1] if lines[-1] else None

    def entries(self) -> Iterator[bytes]:
        """Every line, oldest first. Unlike ``last``, a missing file is an error here: to a
        reader (the verifier) it is far more often a wrong path than a log not yet written."""
        try:
            handle = self.path.open("rb")
        except OSError as exc:
            raise AuditLogUnreadable(f"{self.path}: cannot read: {exc.strerror}") from exc
        with handle:
            for line in handle:
                yield line.rstrip(b"\n")
