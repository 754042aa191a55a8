"""A whole campus on one machine: a broker, two edge agents and two pool workers, each
its own ``sluicegate`` process, on a Mosquitto and a Redis the caller provides.

The demo runs it, and so do the end-to-end tests, so what the tests prove is what the demo
shows. It writes the campus (policy signed with keys made for the run, one config per
node), starts the processes in their own sessions (Ctrl-C reaches only the caller, who then
stops them in order) and waits until every node's retained status says ``online``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from policies import SigningKey
from sluicegate import topics, wire
from sluicegate.campus import BROKER, LINES, WORKERS, Campus, write_campus
from sluicegate.config import MqttSettings
from sluicegate.errors import SluicegateError
from sluicegate.mqtt import MqttTransport
from sluicegate.servers import free_port
from sluicegate.transport import Message

ROLE = {BROKER: "broker"} | dict.fromkeys(LINES, "edge") | dict.fromkeys(WORKERS, "pool")


def status_topic(node: str) -> str:
    role = ROLE[node]
    if role == "broker":
        return topics.broker_status(node)
    return topics.edge_status(node) if role == "edge" else topics.worker_status(node)


class LocalCampus:
    """Start, watch and stop the campus processes."""

    def __init__(
        self,
        root: Path,
        *,
        mqtt_port: int,
        redis_url: str,
        key_for: Callable[[str], SigningKey] = lambda _name: SigningKey.generate(),
        env: dict[str, str] | None = None,
        log_level: str = "warning",
    ) -> None:
        self.root = root
        self.mqtt_port = mqtt_port
        self.redis_url = redis_url
        self._key_for = key_for
        self._env = env or {}
        self._log_level = log_level
        self.campus: Campus | None = None
        self.http_port = free_port()  # the broker's HTTP API
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def nodes(self) -> list[str]:
        return list(ROLE)

    def start(self, timeout: float = 60.0) -> Campus:
        """Write the campus, start every node, return once all are online."""
        self.campus = write_campus(
            self.root,
            self._key_for,
            mqtt_port=self.mqtt_port,
            redis_url=self.redis_url,
            http_port=self.http_port,
        )
        for node in self.nodes:
            self.spawn(node)
        asyncio.run(self._wait_online(self.nodes, timeout))
        return self.campus

    def spawn(self, node: str) -> subprocess.Popen[bytes]:
        assert self.campus is not None
        log = (self.root / f"{node}.log").open("ab")
        argv = [sys.executable, "-m", "sluicegate.cli", ROLE[node], "run"]
        argv += ["--config", str(self.campus.node_config(node)), "--log-level", self._log_level]
        with log:
            proc = subprocess.Popen(
                argv,
                env={**os.environ, **self._env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.processes[node] = proc
        return proc

    def restart(self, node: str, timeout: float = 60.0) -> None:
        self.stop_node(node)
        self.spawn(node)
        asyncio.run(self._wait_online([node], timeout))

    async def _wait_online(self, nodes: list[str], timeout: float) -> None:
        waiting = set(nodes)
        done = asyncio.Event()

        def seen(msg: Message) -> None:
            with contextlib.suppress(ValueError):
                status = wire.NodeStatus.model_validate_json(msg.payload)
                if status.state == "online":
                    waiting.discard(status.node)
            if not waiting:
                done.set()

        watcher = MqttTransport(
            MqttSettings(port=self.mqtt_port), client_id=f"sg-campus-watch-{os.getpid()}"
        )
        await watcher.connect()
        try:
            for node in nodes:
                await watcher.subscribe(status_topic(node), seen)
            deadline = time.monotonic() + timeout
            while not done.is_set():
                for node in nodes:
                    proc = self.processes.get(node)
                    if proc is not None and proc.poll() is not None:
                        raise SluicegateError(
                            f"{node} exited with {proc.returncode}: {self.tail(node)}"
                        )
                if time.monotonic() > deadline:
                    raise SluicegateError(f"not online after {timeout:.0f} s: {sorted(waiting)}")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), 0.5)
        finally:
            await watcher.close()

    def tail(self, node: str, lines: int = 20) -> str:
        path = self.root / f"{node}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def kill(self, node: str) -> None:
        """SIGKILL one node, as a crash would (its Last Will fires)."""
        proc = self.processes[node]
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    def stop_node(self, node: str, timeout: float = 15.0) -> None:
        proc = self.processes.get(node)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def stop(self) -> None:
        """Edges first (they drain their queues), then workers, then the broker."""
        for role in ("edge", "pool", "broker"):
            for node, node_role in ROLE.items():
                if node_role == role:
                    self.stop_node(node)
