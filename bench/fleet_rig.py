"""The campus the fleet benchmarks run on, and the processes they start: one Mosquitto
(secured: TLS 1.3, a client certificate per identity, the ACL from the policy) and one
Redis on free ports, ``sluicegate broker run`` replicas, and ``bench/fleet_sim.py``.

The campus is ``sluicegate.app.campus.write_campus``'s, secured, with the simulated
workers as its pool workers (zone ``campus/fab-north/dc``, each with the sealing key made
for it, which the simulator advertises), and then, re-signed by the campus officer:

* extra broker replicas (``broker-2`` …) in ``broker_signers``, each with its own key,
  certificate and settings file (``policies.edit.add_node``, kind broker);
* extra driver edges (``bench-edge-3`` …) beyond the campus's line PCs, each with its key
  and certificate (``add_node``, kind edge);
* the ACL generated from that policy (``render_acl``), with a block appended for the
  simulator's identities ``bench-fleet-<k>``: write on every edge's telemetry topic and
  on every worker's capabilities, telemetry, status and completion topics;
* the N simulated edges (``sim-e00001`` …, in line 1's and line 2's zones, each with a
  key of its own), appended to the policy text in one go (``add_node`` parses the whole
  policy per node: minutes for 5,000) and checked by loading the result once. They get
  no ACL block of their own: they never connect; the simulator speaks for them, and the
  generated ACL would otherwise hold 2 N M work/return lines for nobody.

So the broker treats the simulated nodes as the policy's own. Nothing here measures.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil
from annotated_types import MaxLen

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policies import Policy, SigningKey, load_signing_key, parse_policy
from policies.edit import add_node
from policies.schema import PolicyDocument
from policies.signing import add_signature, dump_signatures, sign_policy
from sluicegate import pki, topics, wire
from sluicegate.acl import render_acl
from sluicegate.app.broker_http import get_json
from sluicegate.app.campus import BROKER as BROKER
from sluicegate.app.campus import LINES, OBSERVER, OFFICER, WORKERS, Campus, write_campus
from sluicegate.app.localcampus import start_campus_mosquitto
from sluicegate.app.servers import ServerProcess, free_port, start_redis

ROOT = Path(__file__).resolve().parents[1]
DC = WORKERS["north-cpu-1"][0]
ZONES = tuple(LINES.values())
SIM = "bench-fleet"


def policy_edge_limit() -> int:
    """The most edges a policy may list (``policies.schema``)."""
    for meta in PolicyDocument.model_fields["edges"].metadata:
        if isinstance(meta, MaxLen):
            return int(meta.max_length)
    return 1 << 30


def edge_room(driver_edges: int) -> int:
    """How many simulated edges the policy can list beside the driver's."""
    return policy_edge_limit() - max(driver_edges, len(LINES))


def sim_edge(i: int) -> str:
    return f"sim-e{i:05d}"


def sim_worker(i: int) -> str:
    return f"sim-w{i:03d}"


@dataclass
class FleetCampus:
    """The campus as written: who is who, and where their files are."""

    campus: Campus
    policy: Policy
    edges: list[tuple[str, str]]  # simulated edges (id, zone)
    workers: list[tuple[str, str, str]]  # simulated workers (id, zone, sealing key)
    driver_edges: list[str]  # identities the driver places from
    brokers: dict[str, int]  # replica id -> HTTP port
    sims: list[str]  # the simulator's identities, one per process
    viewer: str = ""

    def broker_config(self, broker_id: str) -> Path:
        return self.campus.node_config(broker_id)


def _identity(campus: Campus, name: str, key: SigningKey) -> None:
    """``name``'s key file and a client certificate from the campus CA."""
    path = campus.root / f"{name}.key"
    pki.write_private(path, key.to_pem())
    campus.key_files[name] = path
    ca = pki.load_authority(campus.root)
    cert = pki.issue(
        ca, key.private.public_key(), name, purpose="client", now=time.time(), days=pki.NODE_DAYS
    )
    campus.cert_file(name).write_bytes(pki.cert_pem(cert))


def _sign(campus: Campus, text: str) -> Policy:
    policy = parse_policy(text.encode(), source=str(campus.policy_file))
    officer = load_signing_key(campus.key_files[OFFICER])
    bundle = add_signature(None, policy, sign_policy(policy, officer, OFFICER))
    campus.policy_file.write_text(text)
    campus.policy_file.with_name(campus.policy_file.name + ".sig").write_bytes(
        dump_signatures(bundle)
    )
    return policy


def _replica_config(campus: Campus, broker_id: str, http_port: int) -> None:
    """broker-1's settings file for another replica: its own id, key, certificate, state
    folder and HTTP port; no enrollment (``ca_dir`` stays with broker-1)."""
    text = campus.node_config(BROKER).read_text()
    text = "\n".join(line for line in text.splitlines() if not line.startswith("ca_dir"))
    text = re.sub(r"^http_port = \d+$", f"http_port = {http_port}", text, flags=re.M)
    campus.node_config(broker_id).write_text(text.replace(BROKER, broker_id) + "\n")


def sim_acl(names: list[str]) -> str:
    rights = [
        topics.edge_telemetry("+"),
        topics.worker_capabilities("+"),
        topics.worker_telemetry("+"),
        topics.worker_status("+"),
        topics.completion("+"),
    ]
    out = ["", "# bench only: the fleet simulator speaks for the simulated edges and workers"]
    for name in names:
        out += [f"user {name}", *(f"topic write {t}" for t in rights), ""]
    return "\n".join(out)


def write_fleet(
    root: Path,
    *,
    edges: int,
    workers: int,
    mqtt_port: int,
    redis_url: str,
    replicas: int = 1,
    driver_edges: int = 2,
    sim_procs: int = 1,
) -> FleetCampus:
    names = {sim_worker(i): (DC, "x86-cpu") for i in range(workers)}
    http = free_port()
    campus = write_campus(
        root,
        lambda _n: SigningKey.generate(),
        mqtt_port=mqtt_port,
        redis_url=redis_url,
        workers=names,
        http_port=http,
        secure=True,
    )
    text = campus.policy_file.read_text()
    brokers = {BROKER: http}
    for k in range(2, replicas + 1):
        key = SigningKey.generate()
        name = f"broker-{k}"
        text, _ = add_node(text, "broker", name, key=key.public_text)
        _identity(campus, name, key)
        brokers[name] = free_port()
        _replica_config(campus, name, brokers[name])
    drivers = list(LINES)[:driver_edges]
    for k in range(len(drivers) + 1, driver_edges + 1):
        key = SigningKey.generate()
        name = f"bench-edge-{k}"
        text, _ = add_node(text, "edge", name, key=key.public_text, zone=ZONES[k % 2])
        _identity(campus, name, key)
        drivers.append(name)
    sims = [f"{SIM}-{k}" for k in range(sim_procs)]
    for name in sims:
        _identity(campus, name, SigningKey.generate())
    acl_policy = parse_policy(text.encode(), source=str(campus.policy_file))
    campus.acl_file.write_text(render_acl(acl_policy, observers=(OBSERVER,)) + sim_acl(sims))
    room = policy_edge_limit() - len(acl_policy.edges)
    if edges > room:
        raise ValueError(f"{edges} simulated edges: the policy may list only {room} more")
    sim_edges = [(sim_edge(i), ZONES[i % 2]) for i in range(1, edges + 1)]
    tables = [
        f'\n[edges.{e}]\nzone = "{zone}"\nkey = "{SigningKey.generate().public_text}"\n'
        for e, zone in sim_edges
    ]
    version = acl_policy.version + 1
    text = re.sub(r"^version = \d+$", f"version = {version}", text, count=1, flags=re.M)
    policy = _sign(campus, text + "".join(tables))
    sim_workers = [(w, zone, campus.seal_keys[w]) for w, (zone, _dc) in names.items()]
    return FleetCampus(
        campus,
        policy,
        sim_edges,
        sim_workers,
        drivers,
        brokers,
        sims,
        viewer=campus.console_token("viewer"),
    )


# -- processes -------------------------------------------------------------------------------


def child_env() -> dict[str, str]:
    """The environment of every child: this checkout's packages first."""
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy so far, all cores (every user's)."""
    t = psutil.cpu_times()
    return float(sum(t) - t.idle - getattr(t, "iowait", 0.0))


def confine(pid: int, cpus: AbstractSet[int]) -> None:
    """Run every thread of process ``pid`` on ``cpus`` only (threads it starts later
    inherit it); a process already gone is left alone."""
    with contextlib.suppress(FileNotFoundError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(tid), cpus)


def speed_reference(runs: int = 5, decodes: int = 2000) -> float:
    """This machine's speed now, for comparing runs made at other hours (a shared VM's
    speed moves by 2x from one day to the next): µs of CPU for the broker's decode of one
    simulated edge sample (``EdgeTelemetry.model_validate_json``), best of ``runs``."""
    from bench.fleet_sim import EdgeState, edge_template

    edge = EdgeState("t", edge_template("sim-e00001", "campus/line-1", 1), 40.0, 400.0, 8.0)
    sample = edge.payload(random.Random(1), time.time())
    best = math.inf
    for _ in range(runs):
        t0 = time.thread_time()
        for _ in range(decodes):
            wire.EdgeTelemetry.model_validate_json(sample)
        best = min(best, (time.thread_time() - t0) / decodes)
    return best * 1e6


def rss_mb(pid: int) -> float:
    try:
        return float(psutil.Process(pid).memory_info().rss) / 2**20
    except psutil.NoSuchProcess:
        return 0.0


@dataclass
class Replica:
    broker_id: str
    http_port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""


def start_replica(
    fleet: FleetCampus,
    broker_id: str,
    logs: Path,
    env: dict[str, str] | None = None,
    code: Path | None = None,
) -> Replica:
    """``sluicegate broker run`` for ``broker_id``; ``env``: settings on top of the
    environment (``SLUICEGATE_BROKER__...``, docs/configuration.md); ``code``: another
    checkout to run it from (a baseline commit's, ``git worktree add``)."""
    log = logs / f"{broker_id}.log"
    argv = [sys.executable, "-m", "sluicegate.app.cli", "broker", "run", "--log-level"]
    argv += ["warning", "--config", str(fleet.broker_config(broker_id))]
    if profile := os.environ.get("SG_BENCH_PROFILE"):  # a cProfile of each replica, to read
        argv[1:1] = ["-m", "cProfile", "-o", f"{profile}.{broker_id}"]
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv,
            cwd=code or ROOT,
            env=child_env() | (env or {}) | ({"PYTHONPATH": str(code)} if code else {}),
            stdout=out,
            stderr=out,
        )
    return Replica(broker_id, fleet.brokers[broker_id], proc, log)


def wait_ready(fleet: FleetCampus, replica: Replica, timeout: float = 60.0) -> None:
    """Until the replica answers ``/health`` ready and counts every worker online."""
    base = f"http://127.0.0.1:{replica.http_port}"
    deadline = time.monotonic() + timeout
    seen = 0
    while time.monotonic() < deadline:
        if replica.proc.poll() is not None:
            raise SystemExit(f"{replica.broker_id} exited:\n{replica.tail()}")
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            status, health = get_json(f"{base}/health", fleet.viewer, timeout=2)
            if status == 200 and health.get("ready"):
                workers = get_json(f"{base}/fleet", fleet.viewer, timeout=5)[1]["workers"]
                seen = sum(1 for w in workers if w.get("online"))
                if seen >= len(fleet.workers):
                    return
        time.sleep(0.2)
    raise SystemExit(
        f"{replica.broker_id} not ready in {timeout:.0f} s ({seen} workers online)\n"
        + replica.tail()
    )


def stop_replica(replica: Replica) -> None:
    if replica.proc.poll() is None:
        replica.proc.terminate()
        try:
            replica.proc.wait(20)
        except subprocess.TimeoutExpired:
            replica.proc.kill()
            replica.proc.wait(5)


class Sim:
    """One ``fleet_sim.py`` process: its commands and replies."""

    def __init__(self, spec: dict[str, Any], workdir: Path, name: str) -> None:
        path = workdir / f"{name}.json"
        path.write_text(json.dumps(spec))
        self.name = name
        self.log = workdir / f"{name}.log"
        with self.log.open("ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(ROOT / "bench" / "fleet_sim.py"), str(path)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=child_env(),
                cwd=ROOT,
            )
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self._in: IO[bytes] = self.proc.stdin
        self._out: IO[bytes] = self.proc.stdout
        ready = self._reply()
        if not ready.get("ready"):
            raise SystemExit(f"{name} did not start: {ready}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _reply(self) -> dict[str, Any]:
        line = self._out.readline()
        if not line:
            raise SystemExit(f"{self.name} exited:\n{self.log.read_text(errors='replace')[-2000:]}")
        doc: dict[str, Any] = json.loads(line)
        return doc

    def send(self, line: str) -> None:
        self._in.write(line.encode() + b"\n")
        self._in.flush()

    def edges(self, count: int, rate: float) -> None:
        self.send(f"edges {count} {rate:.3f}")

    def done(self, worker: str, job: str, attempt: int, edge: str) -> None:
        self.send(f"done {worker} {job} {attempt} {edge}")

    def stats(self) -> dict[str, Any]:
        self.send("stats")
        return self._reply()

    def completion_log(self, path: Path) -> dict[str, float]:
        self.send(f"log {path}")
        self._reply()
        out: dict[str, float] = json.loads(path.read_text())
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError, OSError):
                self.send("quit")
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_sims(
    fleet: FleetCampus, workdir: Path, *, capacity: int, service_ms: float, jitter_ms: float
) -> list[Sim]:
    """One simulator per identity: edges dealt round-robin, every worker in the first."""
    campus = fleet.campus
    sims = []
    for k, name in enumerate(fleet.sims):
        spec = {
            "mqtt": {
                "port": campus.mqtt_port,
                "identity": name,
                "ca": str(campus.ca_file),
                "cert": str(campus.cert_file(name)),
                "key": str(campus.key_files[name]),
            },
            "edges": fleet.edges[k :: len(fleet.sims)],
            "workers": fleet.workers if k == 0 else [],
            "capacity": capacity,
            "service_ms": service_ms,
            "jitter_ms": jitter_ms,
            "policy_version": fleet.policy.version,
            "seed": k + 1,
        }
        sims.append(Sim(spec, workdir, name))
    return sims


def set_edges(sims: list[Sim], count: int, rate: float | None = None) -> None:
    """``count`` simulated edges on, dealt over the simulators as their edges were, at
    ``rate`` messages a second in all (``count``: each once a second)."""
    total = rate if rate is not None else float(count)
    for k, sim in enumerate(sims):
        mine = len(range(k, count, len(sims)))
        sim.edges(mine, total * mine / count if count else 0.0)


@dataclass
class Servers:
    """Mosquitto and Redis for one run, and the folder everything is written in."""

    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="sg-fleet-")))
    redis: ServerProcess | None = None
    mosquitto: ServerProcess | None = None

    def start_redis(self) -> ServerProcess:
        (self.root / "redis").mkdir(parents=True, exist_ok=True)
        self.redis = start_redis(workdir=self.root / "redis")
        return self.redis

    def start_mosquitto(self, campus: Campus) -> ServerProcess:
        (self.root / "mosquitto").mkdir(parents=True, exist_ok=True)
        self.mosquitto = start_campus_mosquitto(campus, workdir=self.root / "mosquitto")
        return self.mosquitto

    def stop(self) -> None:
        """Stop both; remove the folder unless ``SG_BENCH_KEEP`` is set (logs to read)."""
        for server in (self.mosquitto, self.redis):
            if server is not None:
                server.stop()
        if not os.environ.get("SG_BENCH_KEEP"):
            shutil.rmtree(self.root, ignore_errors=True)
