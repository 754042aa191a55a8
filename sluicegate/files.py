"""Writing a file so that a crash never leaves half of it: the one way every role replaces
its state files (the pinned policy, keys and certificates, installed configs and units).
"""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, data: bytes, *, mode: int | None = None) -> None:
    """Replace ``path`` with ``data`` in one step, on disk before it returns; with ``mode``
    the file has exactly that mode from its creation (a key: 0600), whatever the umask."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if mode is not None:
            os.chmod(tmp, mode)  # the umask may have narrowed it
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
