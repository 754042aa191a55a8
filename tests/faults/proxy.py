"""A TCP proxy between one client and Mosquitto that a test can cut and heal.

It forwards bytes both ways on its own thread and event loop, so a blocking test (or a
:class:`~sluicegate.app.localcampus.LocalCampus` start) can run beside it. ``cut("blackhole")``
models a dead link: established connections stay open but nothing crosses them any more, and
new connections are accepted and then ignored, so each side learns of the loss only through
its MQTT keepalive. ``cut("drop")`` closes every connection and refuses new ones (a peer
that went away cleanly). ``heal()`` forwards again; black-holed connections are closed then,
so the client reconnects on a fresh one. The proxy never looks inside the bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from sluicegate.app.servers import free_port

T = TypeVar("T")
CutMode = Literal["blackhole", "drop"]


@dataclass(eq=False)
class _Link:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None
    blackholed: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def close(self) -> None:
        for writer in (self.client, self.upstream):
            if writer is not None:
                with contextlib.suppress(Exception):
                    writer.close()


class LinkProxy:
    """Forward ``127.0.0.1:port`` to ``target``; ``cut`` and ``heal`` from any thread."""

    def __init__(self, target_port: int, *, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self.state: Literal["open"] | CutMode = "open"
        self.accepted = 0  # connections accepted since start
        self.forwarded_bytes = 0
        self.discarded_bytes = 0  # bytes that fell into the black hole
        self._links: set[_Link] = set()
        self._server: asyncio.Server | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="link-proxy")

    def start(self) -> LinkProxy:
        self._thread.start()
        self._call(self._listen())
        return self

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> LinkProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def cut(self, mode: CutMode = "blackhole") -> None:
        """Stop forwarding: ``blackhole`` (silence, keepalives expire) or ``drop`` (close
        all and refuse new connections)."""
        if mode not in ("blackhole", "drop"):
            raise ValueError(f"cut mode {mode!r} is not 'blackhole' or 'drop'")
        self._call(self._cut(mode))

    def heal(self) -> None:
        """Forward again; black-holed connections are closed so the client reconnects."""
        self._call(self._heal())

    @property
    def connections(self) -> int:
        """Connections open through the proxy now (forwarding or black-holed)."""
        return len(self._links)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    # -- on the proxy's loop ------------------------------------------------------------------

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self._links):
            link.close()
            for task in link.tasks:
                task.cancel()
        self._links.clear()

    async def _cut(self, mode: CutMode) -> None:
        self.state = mode
        for link in list(self._links):
            if mode == "drop":
                link.close()
                self._links.discard(link)
            else:
                link.blackholed = True
        if mode == "drop" and self._server is not None:
            self._server.close()  # new connections are refused, not accepted
            self._server = None

    async def _heal(self) -> None:
        self.state = "open"
        for link in list(self._links):
            if link.blackholed:
                link.close()
                self._links.discard(link)
        if self._server is None:
            await self._listen()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self.state == "drop":
            writer.close()
            return
        upstream_reader: asyncio.StreamReader | None = None
        upstream: asyncio.StreamWriter | None = None
        if self.state == "open":
            try:
                upstream_reader, upstream = await asyncio.open_connection(*self.target)
            except OSError:
                writer.close()
                return
        link = _Link(writer, upstream, blackholed=self.state == "blackhole")
        self._links.add(link)
        link.tasks.append(asyncio.ensure_future(self._pump(link, reader, upstream)))
        if upstream_reader is not None:
            link.tasks.append(asyncio.ensure_future(self._pump(link, upstream_reader, writer)))

    async def _pump(
        self, link: _Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None
    ) -> None:
        try:
            while data := await reader.read(65536):
                if link.blackholed or writer is None:
                    self.discarded_bytes += len(data)
                    continue
                self.forwarded_bytes += len(data)
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        # One side closed. Through a working link the other side learns at once; into a
        # black hole nothing passes, not even the close.
        if not link.blackholed:
            link.close()
            self._links.discard(link)
