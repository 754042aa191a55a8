"""A Redis master, one replica and three sentinels as real processes, on free ports, and a
fault-test campus on them.

:class:`SentinelGroup` starts the servers (``sluicegate.app.servers``: ``start_redis`` with
``--replicaof``, ``start_sentinel``), waits until the replica is in sync and every sentinel
knows the replica and the two others (before that a failover cannot happen), and gives the
``redis+sentinel://`` URL every role is pointed at. A failover is waited for as an event:
the sentinels answering ``SENTINEL get-master-addr-by-name`` with another port, and that
server saying it is a master, polled with a timeout. :class:`SentinelRig` is the fault
tests' :class:`~tests.faults.rig.Rig` (Mosquitto with persistence, the campus processes,
the wiretap) with its Redis replaced by such a group.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import redis

from sluicegate.app.localcampus import LocalCampus, start_campus_mosquitto
from sluicegate.app.servers import ServerProcess, free_port, start_redis, start_sentinel
from sluicegate.errors import SluicegateError
from tests.faults.rig import RIG_APPS, Rig, add_wiretap
from tests.policies.policy_testkit import key

SERVICE = "sg-campus"
DOWN_AFTER_MS = 1000  # a master silent this long is down (Sentinel's default is 30 s)
FAILOVER_TIMEOUT_MS = 3000


def _until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SluicegateError(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.05)  # polling interval while waiting on the servers' own state


def _ask(port: int, *command: str) -> object:
    """One command to a server on 127.0.0.1:``port``; None when it does not answer."""
    client = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)
    try:
        return client.execute_command(*command)
    except (redis.RedisError, OSError):
        return None
    finally:
        client.close()


class SentinelGroup:
    """Master, replica, three sentinels; a context manager that stops all it started."""

    def __init__(self, root: Path, *, service: str = SERVICE) -> None:
        self.root = root
        self.service = service
        self.servers: list[ServerProcess] = []  # master, replica, then the sentinels
        self.sentinels: list[ServerProcess] = []

    def start(self) -> SentinelGroup:
        try:
            master = self._add(start_redis(workdir=self._dir("redis-a")))
            replica = ("--replicaof", "127.0.0.1", str(master.port))
            self._add(start_redis(workdir=self._dir("redis-b"), extra_args=replica))
            for n in range(3):
                sentinel = start_sentinel(
                    master.port,
                    service=self.service,
                    down_after_ms=DOWN_AFTER_MS,
                    failover_timeout_ms=FAILOVER_TIMEOUT_MS,
                    workdir=self._dir(f"sentinel-{n}"),
                )
                self.sentinels.append(self._add(sentinel))
            self.wait_ready(master.port)
        except BaseException:
            self.stop()
            raise
        return self

    def _dir(self, name: str) -> Path:
        folder = self.root / name
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def _add(self, server: ServerProcess) -> ServerProcess:
        self.servers.append(server)
        return server

    def url(self, db: int) -> str:
        """The URL every role is given: the sentinels, the service, database ``db``."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}/{db}"

    def server(self, port: int) -> ServerProcess:
        """The Redis server (master or replica) on ``port``."""
        for server in self.servers[:2]:
            if server.port == port:
                return server
        raise SluicegateError(f"no Redis server of the group on port {port}")

    def master_port(self) -> int | None:
        """The master's port as the sentinels agree on it (None: they do not, yet)."""
        seen = set()
        for sentinel in self.sentinels:
            if not sentinel.alive:
                continue
            reply = _ask(sentinel.port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
            if not isinstance(reply, list | tuple) or len(reply) != 2:
                return None
            seen.add(int(reply[1]))
        return seen.pop() if len(seen) == 1 else None

    def role(self, port: int) -> str | None:
        reply = _ask(port, "ROLE")
        if not isinstance(reply, list | tuple) or not reply:
            return None
        first = reply[0]
        return first.decode() if isinstance(first, bytes) else str(first)

    def wait_ready(self, master: int, timeout: float = 30.0) -> None:
        """Until ``master`` has a replica in sync and every sentinel knows it, the replica
        and the two other sentinels."""
        replica = next(s.port for s in self.servers[:2] if s.port != master)

        def in_sync() -> bool:
            reply = _ask(replica, "INFO", "replication")
            return isinstance(reply, dict) and reply.get("master_link_status") == "up"

        def known() -> bool:
            for sentinel in self.sentinels:
                state = _ask(sentinel.port, "SENTINEL", "MASTER", self.service)
                if not isinstance(state, dict):
                    return False
                fields = {(k.decode() if isinstance(k, bytes) else k): v for k, v in state.items()}
                if int(fields.get("num-slaves", 0)) < 1:
                    return False
                if int(fields.get("num-other-sentinels", 0)) < len(self.sentinels) - 1:
                    return False
            return self.master_port() == master

        _until(in_sync, timeout, f"replica on {replica} in sync with {master}")
        _until(known, timeout, "every sentinel knows the master, its replica and the others")

    def wait_promoted(self, old: int, timeout: float = 30.0) -> int:
        """Until the sentinels name another master than ``old`` and it says it is one;
        returns its port."""
        promoted: list[int] = []

        def done() -> bool:
            now = self.master_port()
            if now is None or now == old or self.role(now) != "master":
                return False
            promoted.append(now)
            return True

        _until(done, timeout, f"the sentinels promote a replica in place of {old}")
        return promoted[-1]

    def wait_demoted(self, old: int, timeout: float = 30.0) -> None:
        """Until the old master on ``old`` (still running) says it is a replica: from then
        on it refuses writes (``READONLY``). Before, it takes them, and they are lost: the
        sentinels have promoted another server already."""
        _until(lambda: self.role(old) == "slave", timeout, f"{old} demoted to a replica")

    def failover(self) -> None:
        """A planned failover (``SENTINEL FAILOVER``): the master is demoted, not killed."""
        reply = _ask(self.sentinels[0].port, "SENTINEL", "FAILOVER", self.service)
        if reply is None:
            raise SluicegateError("sentinel refused SENTINEL FAILOVER")

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()
        self.servers.clear()
        self.sentinels.clear()

    def __enter__(self) -> SentinelGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def sentinel_group(root: Path) -> Iterator[SentinelGroup]:
    """A started :class:`SentinelGroup` whose folders go when the block ends."""
    with SentinelGroup(root) as group:
        yield group
    shutil.rmtree(root, ignore_errors=True)


class SentinelRig(Rig):
    """The fault tests' campus with its Redis behind three sentinels, on database ``db``."""

    def __init__(
        self,
        root: Path,
        *,
        db: int,
        nodes: Iterable[str] | None = None,
        env: Mapping[str, str] | None = None,
        edge_cpu: float | None = None,
    ) -> None:
        super().__init__(root, nodes=nodes, env=env, edge_cpu=edge_cpu)
        self.db = db
        self.group = SentinelGroup(root / "sentinels")

    def start(self) -> SentinelRig:
        for sub in ("mosquitto", "campus"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        try:
            self.group.start()
            self._campus = LocalCampus(
                self.root / "campus",
                mqtt_port=free_port(),
                redis_url=self.group.url(self.db),
                key_for=key,
                env=self._env,
                log_level=self._log_level,
                edge_cpu=self._edge_cpu,
                nodes=self._nodes,
                apps=RIG_APPS,
            )
            files = self._campus.write()
            add_wiretap(files)
            self.mosquitto = start_campus_mosquitto(
                files, workdir=self.root / "mosquitto", persistence=True
            )
            self._campus.servers.update(mosquitto=self.mosquitto)
            self._campus.start()
            self.wait_fleet_online()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        super().stop()
        self.group.stop()

    def __enter__(self) -> SentinelRig:
        return self.start()
