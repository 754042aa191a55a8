"""Serving a new model version without a restart: the node's models folder, watched.

Every ``interval_s`` the watcher takes the folder's signature (name, size and modification
time of each manifest and of every file it names). When it changes and has held still for
one more look (a copy still being written is not read), the folder is loaded again off the
event loop as at start — every manifest validated, every file checked against its sha256 —
reusing the models that did not change, and the registry serves the new set from the next
job on; a job already running finishes on the model it started with. A folder that does
not load keeps the models being served, and the reason is logged once per signature.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from pathlib import Path

from sluicegate.errors import ModelError
from sluicegate.vision.runtime import ModelRegistry

__all__ = ["ModelWatcher", "folder_signature"]

log = logging.getLogger(__name__)
Signature = tuple[tuple[str, int, int], ...]


def folder_signature(folder: Path) -> Signature:
    """(name, size, mtime in ns) of each manifest in ``folder`` and of each file it names."""
    names: set[str] = set()
    for manifest in folder.glob("*.json"):
        names.add(manifest.name)
        try:
            doc = json.loads(manifest.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # half written, or not a manifest: its own stat changes when it is
        if isinstance(doc, dict):
            post = doc.get("postprocess")
            recognizer = post.get("recognizer") if isinstance(post, dict) else None
            for ref in (
                doc.get("file"),
                recognizer.get("file") if isinstance(recognizer, dict) else None,
            ):
                if isinstance(ref, str) and "/" not in ref:
                    names.add(ref)
    out = []
    for name in sorted(names):
        try:
            st = (folder / name).stat()
        except OSError:
            out.append((name, -1, -1))
            continue
        out.append((name, st.st_size, st.st_mtime_ns))
    return tuple(out)


class ModelWatcher:
    """Reloads ``registry`` from ``folder`` when the folder changes; ``changed`` gets the
    changes in words (on the loop) after each reload that changed something."""

    def __init__(
        self,
        registry: ModelRegistry,
        folder: Path,
        *,
        interval_s: float,
        changed: Callable[[list[str]], None] = lambda _changes: None,
        providers: list[str] | None = None,
        intra_op_threads: int = 1,
    ) -> None:
        self.registry = registry
        self.folder = folder
        self.interval_s = interval_s
        self._changed = changed
        self._providers = providers
        self._threads = intra_op_threads
        self._served = folder_signature(folder)
        self._refused: Signature | None = None
        self.reloads = 0

    async def run(self) -> None:
        """Watch until cancelled."""
        seen = self._served
        while True:
            await asyncio.sleep(self.interval_s)
            now = await asyncio.to_thread(folder_signature, self.folder)
            if now == self._served or now == self._refused:
                seen = now
                continue
            if now != seen:  # still changing: look again once it holds still
                seen = now
                continue
            await self._reload(now)

    async def _reload(self, signature: Signature) -> None:
        try:
            newer = await asyncio.to_thread(
                ModelRegistry.from_dir,
                self.folder,
                providers=self._providers,
                intra_op_threads=self._threads,
                known=self.registry,
            )
        except ModelError as exc:
            self._refused = signature
            log.error(
                "models in %s not reloaded, still serving the previous ones: %s", self.folder, exc
            )
            return
        self._served, self._refused = signature, None
        changes = self.registry.take(newer)
        self.reloads += 1
        if changes:
            log.info("models reloaded from %s: %s", self.folder, "; ".join(changes))
            self._changed(changes)
