"""A whole campus on one machine: a broker, two edge agents and two pool workers, each its own
``sluicegate`` process, on a Mosquitto and a Redis the caller provides.

The demo runs it, and so do the end-to-end and fault tests, so what the tests prove is what
the demo shows. It writes the campus (policy signed with keys made for the run, the campus
CA and every identity's certificate, the ACL, one config per node: :meth:`write`), the
caller starts Mosquitto on it (:func:`start_campus_mosquitto`: TLS, client certificates, the
generated ACL), then :meth:`start` starts the processes in their own sessions (Ctrl-C
reaches only the caller, who then stops them in order) and waits until every node's retained
status says ``online``. Every edge and worker serves its ``/metrics`` on a free localhost
port of its own (:meth:`metrics_urls`). Line PCs can be emulated as modest machines (their
compute threads capped to a share of a core) and every node timed before it serves, as at
install (:meth:`calibrate`; :mod:`sluicegate.app.calibration`). For fault injection it can
SIGKILL any node, or the Mosquitto and Redis it was given, and start it again on the same
ports, configuration and state directory (an edge's outbox survives). It never deletes a
node's state: the caller owns ``root``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from policies import SigningKey
from sluicegate import topics, wire
from sluicegate.app.broker_http import get_json
from sluicegate.app.calibration import calibrate, cap_cpu, cpu_cap_available, named_threads
from sluicegate.app.campus import (
    BROKER,
    FAB,
    LINES,
    OBSERVER,
    WORKERS,
    AppSpec,
    Campus,
    write_campus,
)
from sluicegate.app.servers import ServerProcess, free_port, start_mosquitto
from sluicegate.errors import SluicegateError
from sluicegate.mqtt import MqttTransport
from sluicegate.threads import EDGE_COMPUTE, POOL_COMPUTE
from sluicegate.transport import Message
from sluicegate.vision.priors import Prior

ROLE = {BROKER: "broker"} | dict.fromkeys(LINES, "edge") | dict.fromkeys(WORKERS, "pool")
__all__ = ["ROLE", "SERVERS", "LocalCampus", "cpu_cap_available", "start_campus_mosquitto"]

SERVERS = ("mosquitto", "redis")  # what :meth:`LocalCampus.kill` accepts beside the nodes


def status_topic(node: str) -> str:
    role = ROLE[node]
    if role == "broker":
        return topics.broker_status(node)
    return topics.edge_status(node) if role == "edge" else topics.worker_status(node)


class LocalCampus:
    """Start, watch, crash, restart and stop the campus processes."""

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
        worker_cpu: float | None = None,
        nodes: Collection[str] | None = None,
        node_env: Mapping[str, Mapping[str, str]] | None = None,
        servers: Mapping[str, ServerProcess] | None = None,
        secure: bool = True,
        apps: Mapping[str, AppSpec] | None = None,
        campus: str = "demo-campus",
        fab: str = FAB,
        peers: str = "",
        also_confidential: Collection[str] = (),
        standby: Collection[str] = (),
    ) -> None:
        """``edge_cpu``: emulate line PCs with a modest inference budget by capping each
        edge agent's compute threads to this share of one core (a CPU cgroup, which leaves
        its messaging threads alone); None runs them uncapped. ``worker_cpu``: the same for
        each pool worker's model threads, so that a worker added brings capacity of its own
        as on a machine of its own (None: uncapped). ``nodes``: start only these
        (default: all of :data:`ROLE`). ``node_env``: extra environment for one node, e.g.
        ``{"line-1-pc": {"SLUICEGATE_MQTT__PORT": "..."}}`` to route it through a proxy.
        ``servers``: the ``mosquitto`` / ``redis`` processes the campus runs on, so that
        :meth:`kill` and :meth:`restart` reach them too. ``secure=False``: no TLS, anonymous
        MQTT, for debugging only. ``apps``: the vision apps its policy lists (default
        :data:`~sluicegate.app.campus.APPS`). ``campus``, ``fab``, ``peers``: its name, the
        zone its lines are under and its ``[peers]`` tables; ``also_confidential``: classes
        besides wafer images that travel only sealed (``write_campus``). ``standby``: pool
        workers written, listed and given their ports but not started by :meth:`start`;
        :meth:`spawn` starts one when a scaler wants it."""
        unknown = set(nodes or ()) - set(ROLE)
        if unknown:
            raise SluicegateError(f"unknown nodes {sorted(unknown)}; known: {', '.join(ROLE)}")
        if any(ROLE.get(node) != "pool" for node in standby):
            raise SluicegateError(f"standby nodes must be pool workers, not {sorted(standby)}")
        unknown = set(servers or {}) - set(SERVERS)
        if unknown:
            raise SluicegateError(f"unknown servers {sorted(unknown)}; known: mosquitto, redis")
        self.root = root
        self.mqtt_port = mqtt_port
        self.redis_url = redis_url
        self._key_for = key_for
        self._env = env or {}
        self._node_env = {node: dict(extra) for node, extra in (node_env or {}).items()}
        self._log_level = log_level
        self._cpu = {"edge": edge_cpu, "pool": worker_cpu}  # each role's model threads' cap
        self._cgroups: dict[int, Path] = {}  # a capped node's pid -> its CPU cgroup
        self._nodes = [node for node in ROLE if nodes is None or node in nodes]
        self.standby = frozenset(standby)
        self.servers: dict[str, ServerProcess] = dict(servers or {})
        self.campus: Campus | None = None
        self.secure = secure
        self._apps = apps
        self._campus_name, self._fab, self._peers = campus, fab, peers
        self._also_confidential = tuple(also_confidential)
        self.models_dirs: dict[str, Path] = {}  # by role, once calibrated
        self.http_port = free_port()  # the broker's HTTP API
        # Each edge's and worker's /metrics, on 127.0.0.1 (kept across restarts).
        self.metrics_ports = {n: free_port() for n in self._nodes if ROLE[n] != "broker"}
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def nodes(self) -> list[str]:
        return list(self._nodes)

    def write(self) -> Campus:
        """Write the campus's files (once): what Mosquitto and every node need."""
        if self.campus is None:
            self.campus = write_campus(
                self.root,
                self._key_for,
                mqtt_port=self.mqtt_port,
                redis_url=self.redis_url,
                http_port=self.http_port,
                secure=self.secure,
                apps=self._apps,
                campus=self._campus_name,
                fab=self._fab,
                peers=self._peers,
                also_confidential=self._also_confidential,
            )
        return self.campus

    def metrics_urls(self) -> dict[str, str]:
        """Each edge's and worker's ``/metrics`` URL, by node id."""
        return {n: f"http://127.0.0.1:{port}/metrics" for n, port in self.metrics_ports.items()}

    def start(self, timeout: float = 60.0) -> Campus:
        """Write the campus if not yet written, start every node but the standby workers,
        return once all are online."""
        campus = self.write()
        started = [node for node in self.nodes if node not in self.standby]
        for node in started:
            self.spawn(node)
        asyncio.run(self._wait_online(started, timeout))
        self.cap()  # a node is online once its compute threads exist
        return campus

    def spawn(self, node: str) -> subprocess.Popen[bytes]:
        """Start ``node``'s process (its config and state directory as before)."""
        assert self.campus is not None
        log = (self.root / f"{node}.log").open("ab")
        argv = [sys.executable, "-m", "sluicegate.app.cli", ROLE[node], "run"]
        argv += ["--config", str(self.campus.node_config(node)), "--log-level", self._log_level]
        own = {}
        if node in self.metrics_ports:
            own[f"SLUICEGATE_{ROLE[node].upper()}__METRICS_PORT"] = str(self.metrics_ports[node])
        if ROLE[node] in self.models_dirs:
            own[f"SLUICEGATE_{ROLE[node].upper()}__MODELS_DIR"] = str(self.models_dirs[ROLE[node]])
        with log:
            proc = subprocess.Popen(
                argv,
                env={**os.environ, **self._env, **own, **self._node_env.get(node, {})},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.processes[node] = proc
        return proc

    def calibrate(self, runs: int = 3) -> dict[str, list[Prior]]:
        """Before :meth:`start`: time the models as a plant engineer does on each node at
        install (``sluicegate models bench``): each kind of node's under its CPU cap, if
        any; each role then serves from a models folder of its own holding
        its figures as service-time priors (:func:`~sluicegate.app.calibration.calibrate`),
        so predictions start calibrated. Returns the figures by role."""
        found = {}
        for role in ("edge", "pool"):
            share = self._cpu[role]
            folder, found[role] = calibrate(self.root / f"{role}-models", share, runs=runs)
            self.models_dirs[role] = folder
        return found

    def cap(self) -> None:
        """Cap the model threads of each running edge and worker whose role has a cap, once
        they exist (a node started a moment ago may not have them yet: call again)."""
        for node in self.nodes:
            share, proc = self._cpu.get(ROLE[node]), self.processes.get(node)
            if share is None or proc is None or proc.poll() is not None:
                continue
            if proc.pid in self._cgroups:
                continue
            name = EDGE_COMPUTE if ROLE[node] == "edge" else POOL_COMPUTE
            threads = named_threads(proc.pid, name)
            if threads:
                group = cap_cpu(threads, share, f"sluicegate-{node}-{proc.pid}")
                self._cgroups[proc.pid] = group

    def pid(self, name: str) -> int | None:
        """The process id of a node or server now, or None when it is not running."""
        if name in self.servers:
            server = self.servers[name]
            return server.pid if server.alive else None
        proc = self.processes.get(name)
        return proc.pid if proc is not None and proc.poll() is None else None

    def alive(self, name: str) -> bool:
        return self.pid(name) is not None

    def wait_workers_online(self, workers: Collection[str], timeout: float = 30.0) -> None:
        """Until the broker's ``/fleet`` counts ``workers`` online (it needs their first
        telemetry): a job offered before then is refused (``no_worker``) and runs on its
        edge, so a bench's warm-up or a burst would not meet the fleet the campus has."""
        assert self.campus is not None, "not written"
        url = f"http://127.0.0.1:{self.http_port}/fleet"
        token = self.campus.console_token("viewer")
        wanted = set(workers)
        deadline = time.monotonic() + timeout
        online: set[str] = set()
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError, KeyError):
                fleet = get_json(url, token, timeout=2)[1]["workers"]
                online = {w["id"] for w in fleet if w.get("online")}
                if wanted <= online:
                    return
            time.sleep(0.1)  # the next look at the broker's fleet
        raise SluicegateError(f"the broker sees {sorted(online)} online, not {sorted(wanted)}")

    def kill(self, name: str) -> None:
        """SIGKILL one node (its Last Will fires) or server, as a crash would."""
        if name in self.servers:
            self.servers[name].kill()
            return
        if name not in ROLE:
            raise SluicegateError(f"unknown node {name!r}; known: {', '.join(ROLE)}, {SERVERS}")
        proc = self.processes.get(name)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def restart(self, name: str, timeout: float = 60.0, *, kill: bool = False) -> None:
        """Stop ``name`` (SIGTERM, or SIGKILL with ``kill``) if it runs, start it again on
        the same ports, configuration and state, and return once it is back: a node once
        its new process says ``online``, a server once it answers its protocol's ping."""
        if name in self.servers:
            self.servers[name].restart(timeout, kill=kill)
            return
        if kill:
            self.kill(name)
        else:
            self.stop_node(name)
        asyncio.run(self._respawn(name, timeout))
        self.cap()

    async def _respawn(self, node: str, timeout: float) -> None:
        # Subscribe first and count only a live (not retained) "online": the retained copy
        # may still be the dead process's, before Mosquitto has published its Last Will.
        online = asyncio.Event()

        def seen(msg: Message) -> None:
            with contextlib.suppress(ValueError):
                status = wire.NodeStatus.model_validate_json(msg.payload)
                if not msg.retain and status.node == node and status.state == "online":
                    online.set()

        watcher = self._watcher(f"restart-{node}")
        await watcher.connect()
        try:
            await watcher.subscribe(status_topic(node), seen)
            self.spawn(node)
            await self._until(online, [node], timeout, lambda: [node])
        finally:
            await watcher.close()

    def _watcher(self, purpose: str) -> MqttTransport:
        assert self.campus is not None
        client_id = OBSERVER  # its certificate's name; open mode: one of its own
        if not self.secure:
            client_id = f"sg-campus-{purpose}-{os.getpid()}-{time.monotonic_ns() % 10**9}"
        return MqttTransport(self.campus.mqtt(OBSERVER), client_id=client_id)

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

        watcher = self._watcher("watch")
        await watcher.connect()
        try:
            for node in nodes:
                await watcher.subscribe(status_topic(node), seen)
            await self._until(done, nodes, timeout, lambda: sorted(waiting))
        finally:
            await watcher.close()

    async def _until(
        self,
        done: asyncio.Event,
        nodes: list[str],
        timeout: float,
        waiting: Callable[[], list[str]],
    ) -> None:
        deadline = time.monotonic() + timeout
        while not done.is_set():
            for node in nodes:
                proc = self.processes.get(node)
                if proc is not None and proc.poll() is not None:
                    raise SluicegateError(
                        f"{node} exited with {proc.returncode}: {self.tail(node)}"
                    )
            if time.monotonic() > deadline:
                raise SluicegateError(f"not online after {timeout:.0f} s: {waiting()}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 0.5)

    def tail(self, node: str, lines: int = 20) -> str:
        path = self.root / f"{node}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

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
        """Edges first (they drain their queues), then workers, then the broker. The
        servers given in ``servers`` are the caller's to stop."""
        for role in ("edge", "pool", "broker"):
            for node in self.nodes:
                if ROLE[node] == role:
                    self.stop_node(node)
        for group in self._cgroups.values():
            with contextlib.suppress(OSError):
                group.rmdir()
        self._cgroups.clear()


def start_campus_mosquitto(
    campus: Campus, *, workdir: Path | None = None, persistence: bool = False
) -> ServerProcess:
    """A Mosquitto on ``campus.mqtt_port`` set up as the campus needs: secured with its CA,
    certificates and ACL (open, for a campus written with ``secure=False``); ``workdir``
    and ``persistence`` as for :func:`~sluicegate.app.servers.start_mosquitto`."""
    if not campus.secure:
        return start_mosquitto(port=campus.mqtt_port, workdir=workdir, persistence=persistence)
    return start_mosquitto(
        port=campus.mqtt_port,
        workdir=workdir,
        persistence=persistence,
        tls=campus.listener_tls(),
        probe=campus.client_context(),
    )
