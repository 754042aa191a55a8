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
from sluicegate.threads import EDGE_COMPUTE
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
        edge_cpu: float | None = None,
    ) -> None:
        """``edge_cpu``: emulate line PCs with a modest inference budget by capping each
        edge agent's compute threads to this share of one core (a CPU cgroup, which leaves
        its messaging threads alone); None runs them uncapped."""
        self.root = root
        self.mqtt_port = mqtt_port
        self.redis_url = redis_url
        self._key_for = key_for
        self._env = env or {}
        self._log_level = log_level
        self._edge_cpu = edge_cpu
        self._cgroups: list[Path] = []
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
        self._cap_edges()  # an edge is online once its compute threads exist
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

    def _cap_edges(self) -> None:
        if self._edge_cpu is None:
            return
        for node, role in ROLE.items():
            proc = self.processes.get(node)
            if role == "edge" and proc is not None:
                threads = named_threads(proc.pid, EDGE_COMPUTE)
                group = cap_cpu(threads, self._edge_cpu, f"sluicegate-{node}-{proc.pid}")
                self._cgroups.append(group)

    def restart(self, node: str, timeout: float = 60.0) -> None:
        self.stop_node(node)
        self.spawn(node)
        asyncio.run(self._wait_online([node], timeout))
        if ROLE[node] == "edge":
            self._cap_edges()

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
        for group in self._cgroups:
            with contextlib.suppress(OSError):
                group.rmdir()
        self._cgroups.clear()


CGROUP_V1 = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 10_000  # short: a slow CPU, not one that stalls for tens of ms


def cpu_cap_available() -> bool:
    """Whether :func:`cap_cpu` can work here (a writable cgroup v1 CPU hierarchy, which is
    what lets single threads be capped)."""
    return (CGROUP_V1 / "cpu.cfs_quota_us").exists() and os.access(CGROUP_V1, os.W_OK)


def named_threads(pid: int, name: str) -> list[int]:
    """Thread ids of ``pid`` whose OS name is ``name`` (see :mod:`sluicegate.threads`)."""
    tids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            if (task / "comm").read_text().strip() == name:
                tids.append(int(task.name))
    return tids


def cap_cpu(tids: list[int], share: float, name: str) -> Path:
    """Put threads ``tids`` in a new CPU cgroup limited to ``share`` of one core."""
    if not tids:
        raise SluicegateError(f"no threads to cap for {name}")
    quota = max(1000, int(PERIOD_US * share))  # the kernel refuses less than 1 ms
    group = CGROUP_V1 / name
    try:
        group.mkdir(exist_ok=True)
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(quota))
        for tid in tids:
            (group / "tasks").write_text(str(tid))
    except OSError as exc:
        raise SluicegateError(
            f"cannot cap threads {tids} to {share:.0%} of a core: no writable CPU cgroup ({exc})"
        ) from exc
    return group
