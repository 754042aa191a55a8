"""An emulated long link between two campuses on one machine: a TCP relay on a free loopback
port that holds every byte a set delay each way, in order (the round trip between two fabs),
and can be cut and mended (a link down and back). TLS passes through it untouched. The
two-campus rig (``sluicegate.app.pair``) and the tests that cut a link run the bridge
through it. Threads of its own; nothing here knows MQTT.
"""

from __future__ import annotations

import heapq
import select
import socket
import threading
import time
from contextlib import suppress


class DelayRelay:
    """A TCP relay on a free loopback port that holds every byte ``delay_s`` each way, in
    order: the long link between two campuses, for the bridge to cross. TLS passes through
    it untouched. ``cut()`` drops every connection and refuses new ones (no listener: a
    connect is refused, as across a link that is down) until ``mend()``."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.delay_s = delay_s
        self._target = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._cut = threading.Event()
        self._mended = threading.Event()
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        listener: socket.socket | None = self._listener
        while not self._stop.is_set():
            if self._cut.is_set():
                if listener is not None:
                    listener.close()
                    listener = None
                self._mended.wait(0.2)
                continue
            if listener is None:
                try:
                    listener = self._listener = socket.create_server(("127.0.0.1", self.port))
                except OSError:  # the port not free again yet
                    self._stop.wait(0.05)
                    continue
            listener.settimeout(0.2)
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set() or self._cut.is_set():  # cut() closed the listener
                    listener = None
                    continue
                return
            if self._cut.is_set():  # accepted as the link was cut: it never carries a byte
                client.close()
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self._target))
            except OSError:  # the far side is down (stopping, or cut): the link fails
                client.close()
                continue
            for sock in (client, server):  # each chunk out when due: no Nagle wait on top
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets += [client, server]
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        due: list[tuple[float, int, bytes]] = []
        n = 0
        while not self._stop.is_set():
            wait = max(0.0, due[0][0] - time.monotonic()) if due else 0.2
            try:
                readable, _, _ = select.select([src], [], [], wait)
                if readable:
                    chunk = src.recv(65536)
                    if not chunk:
                        break
                    n += 1
                    heapq.heappush(due, (time.monotonic() + self.delay_s, n, chunk))
                while due and due[0][0] <= time.monotonic():
                    dst.sendall(heapq.heappop(due)[2])
            except (OSError, ValueError):  # ValueError: the other direction or cut() closed it
                break
        for sock in (src, dst):
            with suppress(OSError):
                sock.close()

    def cut(self) -> None:
        """Close every connection across and refuse new ones until :meth:`mend` (the
        listener closed now, so no reconnect slips through before the accept loop sees it)."""
        self._mended.clear()
        self._cut.set()
        with suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept(): EINVAL
        with suppress(OSError):
            self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def mend(self) -> None:
        self._cut.clear()
        self._mended.set()

    def close(self) -> None:
        self._stop.set()
        self.cut()
        with suppress(OSError):
            self._listener.close()
