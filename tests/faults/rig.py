"""A campus to break: Mosquitto with persistence, Redis with an append-only file, the
:class:`~sluicegate.app.localcampus.LocalCampus` processes on them, and optionally one edge
behind a :class:`~tests.faults.proxy.LinkProxy`. It is secured as a plant runs it (TLS,
a certificate per node and app, the generated ACL); the test's own wiretap, the identity
``fault-observer``, is added to the ACL with read access to every campus topic, and the
flooders are apps of the line they flood (``flood-*``, results under ``flood/``).

Every component can be SIGKILLed and restarted on the same port and state directory through
``rig.campus`` (nodes, ``mosquitto``, ``redis``). :class:`RssSampler` records each
component's peak resident memory (the kernel's high-water mark, so a peak between two
samples still counts). :func:`burst` is the load: volleys of jobs with known ids, fast
enough that a one-slot edge offloads. Everything it starts, it stops; the data directories
live under the caller's ``root``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from sluicegate import topics
from sluicegate.app.campus import APPS, LINES, Campus
from sluicegate.app.localcampus import ROLE, LocalCampus, cpu_cap_available, start_campus_mosquitto
from sluicegate.app.servers import ServerProcess, free_port, start_redis
from sluicegate.config import MqttSettings
from tests.faults.app import App
from tests.faults.proxy import LinkProxy
from tests.image_bytes import sample_jpeg
from tests.policies.policy_testkit import key
from tests.secure_kit import issue_identity

IMAGES = [sample_jpeg(seed)[0] for seed in range(8)]
WIRETAP = "fault-observer"
APP = "app-campus"  # submits to both lines
FLOODERS = ("flood-main", "flood-bad", "flood-listen")
FLOOD_RESULTS = "flood"
RIG_APPS = dict(APPS) | {name: (tuple(LINES), FLOOD_RESULTS) for name in FLOODERS}


def add_wiretap(files: Campus) -> None:
    """Give the fault tests' wiretap a certificate and an ACL block that reads everything."""
    issue_identity(files, WIRETAP)
    with files.acl_file.open("a") as acl:
        acl.write(f"# the fault tests' wiretap\nuser {WIRETAP}\n")
        acl.write(f"topic read {topics.ROOT}/#\n\n")


def image_for(job_id: str) -> bytes:
    """One of a few real inspection images, always the same one for a job id."""
    return IMAGES[zlib.crc32(job_id.encode()) % len(IMAGES)]


class Rig:
    """Mosquitto + Redis + a local campus, all crashable; a context manager."""

    def __init__(
        self,
        root: Path,
        *,
        proxied: str | None = None,
        nodes: Iterable[str] | None = None,
        edge_cpu: float | None = None,
        env: Mapping[str, str] | None = None,
        appendfsync: str = "everysec",
        log_level: str = "info",
    ) -> None:
        self.root = root
        self._proxied = proxied
        self._nodes = list(nodes) if nodes is not None else None
        self._edge_cpu = edge_cpu if edge_cpu and cpu_cap_available() else None
        self._env = dict(env or {})
        self._appendfsync = appendfsync
        self._log_level = log_level
        self.mosquitto: ServerProcess | None = None
        self.redis: ServerProcess | None = None
        self.proxy: LinkProxy | None = None
        self._campus: LocalCampus | None = None

    @property
    def campus(self) -> LocalCampus:
        assert self._campus is not None, "the rig is not started"
        return self._campus

    @property
    def mqtt_port(self) -> int:
        assert self.mosquitto is not None
        return self.mosquitto.port

    @property
    def files(self) -> Campus:
        return self.campus.write()

    def mqtt(self, identity: str = APP) -> MqttSettings:
        """How ``identity`` (an app, a flooder, the wiretap) logs in, quick to reconnect."""
        return self.files.mqtt(identity).model_copy(update={"keepalive_s": 5, "reconnect_max_s": 1})

    def start(self) -> Rig:
        for sub in ("mosquitto", "redis", "campus"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        try:
            self.redis = start_redis(
                workdir=self.root / "redis", appendonly=True, appendfsync=self._appendfsync
            )
            mqtt_port = free_port()
            node_env: dict[str, dict[str, str]] = {}
            if self._proxied is not None:
                self.proxy = LinkProxy(mqtt_port).start()
                node_env[self._proxied] = {"SLUICEGATE_MQTT__PORT": str(self.proxy.port)}
            self._campus = LocalCampus(
                self.root / "campus",
                mqtt_port=mqtt_port,
                redis_url=f"redis://127.0.0.1:{self.redis.port}/0",
                key_for=key,
                env=self._env,
                log_level=self._log_level,
                edge_cpu=self._edge_cpu,
                nodes=self._nodes,
                node_env=node_env,
                apps=RIG_APPS,
            )
            files = self._campus.write()
            add_wiretap(files)
            self.mosquitto = start_campus_mosquitto(
                files, workdir=self.root / "mosquitto", persistence=True
            )
            self._campus.servers.update(mosquitto=self.mosquitto, redis=self.redis)
            self._campus.start()
            self.wait_fleet_online()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_fleet_online(self, timeout: float = 20.0) -> None:
        """Wait until the broker counts every running worker online (it needs their first
        telemetry), so a burst finds the fleet the campus really has."""
        campus = self.campus
        broker = [n for n in campus.nodes if ROLE[n] == "broker" and campus.alive(n)]
        workers = {n for n in campus.nodes if ROLE[n] == "pool" and campus.alive(n)}
        if not broker or not workers:
            return
        campus.wait_workers_online(workers, timeout)

    def stop(self) -> None:
        if self._campus is not None:
            self._campus.stop()
        if self.proxy is not None:
            self.proxy.close()
        for server in (self.redis, self.mosquitto):
            if server is not None:
                server.stop()

    def __enter__(self) -> Rig:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def logs(self, lines: int = 15) -> str:
        """The tail of every node's log, for a failing assertion's message."""
        return "\n".join(
            f"--- {node}\n{self.campus.tail(node, lines)}" for node in self.campus.nodes
        )


async def burst(
    app: App,
    edge: str,
    prefix: str,
    *,
    jobs: int,
    volley: int = 10,
    every_s: float = 0.05,
    stop: asyncio.Event | None = None,
) -> list[str]:
    """Submit ``jobs`` jobs to ``edge`` in volleys of ``volley`` every ``every_s`` seconds
    (the pace of a camera station, not a wait for anything); ids ``{prefix}-{n}``. Returns
    the ids submitted. A volley waits for its PUBACKs before the next one is due."""
    ids: list[str] = []
    n = 0
    next_at = time.monotonic()
    while n < jobs and not (stop is not None and stop.is_set()):
        batch = [f"{prefix}-{i}" for i in range(n, min(n + volley, jobs))]
        n += len(batch)
        ids += batch
        await asyncio.gather(*(app.submit(edge, job_id, image_for(job_id)) for job_id in batch))
        next_at += every_s
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
    return ids


class RssSampler:
    """Peak RSS (MiB) per component, sampled from /proc on a thread."""

    def __init__(self, pids: Callable[[], Mapping[str, int | None]], every_s: float = 0.2) -> None:
        self._pids = pids
        self._every_s = every_s
        self.peak_mib: dict[str, float] = {}
        self.last_mib: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            self.sample()

    def sample(self) -> None:
        for name, pid in self._pids().items():
            if pid is None:
                continue
            rss, hwm = read_rss(pid)
            if rss is None:
                continue
            self.last_mib[name] = rss
            self.peak_mib[name] = max(self.peak_mib.get(name, 0.0), hwm or rss)


def read_rss(pid: int) -> tuple[float | None, float | None]:
    """Current and peak resident set (MiB) of ``pid`` from /proc, or Nones if it is gone."""
    rss = hwm = None
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024.0
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) / 1024.0
    return rss, hwm
