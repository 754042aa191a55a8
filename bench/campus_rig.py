"""One local campus as the campus benches drive it, open or secured, and the clients that
drive it: what ``bench/tls_overhead.py`` runs twice side by side.

Each campus has its own Redis and its own Mosquitto on a free port, and every node of
``sluicegate.app.localcampus`` (broker-1, line-1-pc, line-2-pc, north-cpu-1, cloud-cpu-1) as its
own process. line-1-pc offers every job (``SLUICEGATE_OFFLOAD__QUEUE_BOUND=0``); line-2-pc
has offloading switched off, so every job it takes runs there. Secured means what
``start_campus_mosquitto`` serves: TLS 1.3, a client certificate per identity (Ed25519 for
nodes), its CN as the username, the ACL generated from the policy. Open means plain TCP
and anonymous clients; the policy, the nodes and the clients are otherwise the same.

Clients, each its own MQTT connection (a secured Mosquitto makes the certificate's name
the client id, so one identity is one connection):

* app-line-1 submits to line-1-pc and app-line-2 to line-2-pc, as the apps the policy
  lists, results under their own prefixes (``app/line-1/...``, ``app/line-2/...``);
* ``bench-direct`` plays an edge for the bare-worker baseline: it publishes the image with
  a token it minted with the campus broker key (sealed to the worker's key, as wafer images
  travel) straight to north-cpu-1's work topic and reads the result on its returns topic.
  A worker runs only work from an edge its policy lists, so before anything starts the
  bench adds ``bench-direct`` to the policy as an edge in line 1's zone
  (``policies.edit.add_node``, re-signed as the campus officer) and, secured, issues it a
  certificate from the campus CA and regenerates the ACL from the amended policy
  (``render_acl``, what ``sluicegate policy acl`` writes): the rights of any edge in that
  zone, nothing more;
* ``bench-floor`` and ``bench-relay``, the messaging floor's driver and ``bench/relay.py``
  on ``bench/...`` topics. No campus identity may touch those, so a secured campus gets
  certificates for both and an ACL block appended for them, as tests/faults/rig.py does
  for its wiretap.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from bench.edge_path import Driver
from bench.offload_path import (
    CLASS,
    RELAY_TOPIC,
    direct_work,
    relay_ready,
    send_work,
    wait_workers_online,
)
from policies import Policy, SigningKey, load_signing_key
from policies.edit import add_node
from policies.signing import add_signature, dump_signatures, sign_policy
from sluicegate import pki, topics
from sluicegate.acl import render_acl
from sluicegate.app.campus import APPS, LINES, OBSERVER, OFFICER, WORKERS, Campus
from sluicegate.app.localcampus import LocalCampus, start_campus_mosquitto
from sluicegate.app.servers import ServerProcess, free_port, start_redis

ROOT = Path(__file__).resolve().parents[1]
SECURITY = ("open", "secure")
OFFLOAD_EDGE, LOCAL_EDGE = "line-1-pc", "line-2-pc"
WORKER = "north-cpu-1"
ZONE = WORKERS[WORKER][0]
DIRECT_EDGE = "bench-direct"  # the baseline's edge, added to the policy; the driver plays it
DIRECT_ZONE = LINES[OFFLOAD_EDGE]
FLOOR, RELAY = "bench-floor", "bench-relay"
FLOOR_RESULTS = "bench/floor"
MODEL = "defect-v1"


@dataclass
class CampusDriver(Driver):
    """``edge_path``'s driver logged in as one identity: over TLS with its certificate when
    ``tls`` is given, results on ``results`` (a topic that identity may read)."""

    tls: ssl.SSLContext | None = None
    results: str = ""

    def __post_init__(self) -> None:
        self.topic = self.results
        self.client = paho.Client(CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
        if self.tls is not None:
            self.client.tls_set_context(self.tls)
        self.client.on_message = self._on_message
        self.client.on_socket_open = lambda _c, _u, s: s.setsockopt(  # type: ignore[attr-defined]
            socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
        )
        connected = threading.Event()
        self.client.on_connect = lambda *a: connected.set()
        self.client.connect("127.0.0.1", self.port)
        self.client.loop_start()
        if not connected.wait(10):
            raise TimeoutError(f"no CONNACK from 127.0.0.1:{self.port}")
        self.listen(self.topic)

    def listen(self, topic: str) -> None:
        """Collect results on ``topic``; a refused subscription (the ACL) is an error."""
        granted: list[Any] = []
        subscribed = threading.Event()

        def on_subscribe(_c: object, _u: object, _mid: int, codes: list[Any], _p: object) -> None:
            granted.extend(codes)
            subscribed.set()

        self.client.on_subscribe = on_subscribe
        self.client.subscribe(topic, qos=1)
        if not subscribed.wait(10):
            raise TimeoutError(f"no SUBACK for {topic}")
        if any(code.is_failure for code in granted):
            raise PermissionError(f"subscription to {topic} refused: {granted}")


def write_key(campus: Campus, name: str, key: SigningKey) -> None:
    path = campus.root / f"{name}.key"
    pki.write_private(path, key.to_pem())
    campus.key_files[name] = path


def issue_certificate(campus: Campus, name: str, key: SigningKey) -> None:
    """A client certificate for ``name`` from the campus CA, as enrollment gives a node."""
    ca = pki.load_authority(campus.root)
    cert = pki.issue(
        ca, key.private.public_key(), name, purpose="client", now=time.time(), days=pki.NODE_DAYS
    )
    campus.cert_file(name).write_bytes(pki.cert_pem(cert))


def add_direct_edge(campus: Campus) -> Policy:
    """List ``bench-direct`` in the campus policy (signed again by the officer); secured,
    give it a certificate and regenerate the ACL from the amended policy. Before any node
    starts: they all read the policy file."""
    key = SigningKey.generate()
    text, policy = add_node(
        campus.policy_file.read_text(), "edge", DIRECT_EDGE, key=key.public_text, zone=DIRECT_ZONE
    )
    campus.policy_file.write_text(text)
    officer = load_signing_key(campus.key_files[OFFICER])
    bundle = add_signature(None, policy, sign_policy(policy, officer, OFFICER))
    campus.policy_file.with_name(campus.policy_file.name + ".sig").write_bytes(
        dump_signatures(bundle)
    )
    write_key(campus, DIRECT_EDGE, key)
    if campus.secure:
        issue_certificate(campus, DIRECT_EDGE, key)
        campus.acl_file.write_text(render_acl(policy, observers=(OBSERVER,)))
    return policy


def add_floor_identities(campus: Campus) -> None:
    """Certificates for the floor's driver and relay, and their ACL block (secured only)."""
    for name in (FLOOR, RELAY):
        key = SigningKey.generate()
        write_key(campus, name, key)
        issue_certificate(campus, name, key)
    relay_topics = RELAY_TOPIC.rsplit("/", 1)[0] + "/#"
    with campus.acl_file.open("a") as acl:
        acl.write("\n# bench only: the messaging floor's driver and relay\n")
        acl.write(f"user {FLOOR}\ntopic write {relay_topics}\ntopic read {FLOOR_RESULTS}/#\n\n")
        acl.write(f"user {RELAY}\ntopic read {relay_topics}\ntopic write {FLOOR_RESULTS}/#\n")


class CampusRig:
    """A campus, its servers and its clients; a context manager that stops all of them."""

    def __init__(self, root: Path, security: str, *, env: dict[str, str] | None = None) -> None:
        if security not in SECURITY:
            raise ValueError(f"security {security!r}; known: {', '.join(SECURITY)}")
        self.root = root
        self.security = security
        self._env = env or {}
        self._stack = contextlib.ExitStack()
        self.redis: ServerProcess | None = None
        self.mosquitto: ServerProcess | None = None
        self.local: LocalCampus | None = None
        self.relay: subprocess.Popen[bytes] | None = None
        self.drivers: dict[str, CampusDriver] = {}

    @property
    def campus(self) -> Campus:
        assert self.local is not None, "not started"
        assert self.local.campus is not None, "not written"
        return self.local.campus

    def __enter__(self) -> CampusRig:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self) -> None:
        for sub in ("redis", "mosquitto", "campus"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.redis = start_redis(workdir=self.root / "redis")
        self.local = LocalCampus(
            self.root / "campus",
            mqtt_port=free_port(),
            redis_url=f"redis://127.0.0.1:{self.redis.port}/0",
            env=self._env,
            node_env={
                OFFLOAD_EDGE: {"SLUICEGATE_OFFLOAD__QUEUE_BOUND": "0"},
                LOCAL_EDGE: {"SLUICEGATE_OFFLOAD__ENABLED": "false"},
            },
            secure=self.security == "secure",
        )
        campus = self.local.write()
        self.policy = add_direct_edge(campus)
        if campus.secure:
            add_floor_identities(campus)
        self.mosquitto = start_campus_mosquitto(campus, workdir=self.root / "mosquitto")
        self.local.start()
        wait_workers_online(self.local, WORKERS)
        self.broker_key = load_signing_key(campus.key_files["broker-1"])
        self.relay = subprocess.Popen(self._relay_argv())
        self.drivers = {
            OFFLOAD_EDGE: self._driver("app-line-1", f"{APPS['app-line-1'][1]}/bench"),
            LOCAL_EDGE: self._driver("app-line-2", f"{APPS['app-line-2'][1]}/bench"),
            DIRECT_EDGE: self._driver(DIRECT_EDGE, topics.edge_returns(DIRECT_EDGE, WORKER)),
            FLOOR: self._driver(FLOOR, f"{FLOOR_RESULTS}/{os.getpid()}"),
        }
        relay_ready(self.drivers[FLOOR])

    def pids(self) -> dict[str, int]:
        """The process id of every node, server and the relay of this campus."""
        assert self.local is not None
        assert self.mosquitto is not None
        assert self.redis is not None
        assert self.relay is not None
        out = {node: proc.pid for node, proc in self.local.processes.items()}
        return out | {
            "mosquitto": self.mosquitto.pid,
            "redis": self.redis.pid,
            "relay": self.relay.pid,
        }

    def tls_session(self) -> dict[str, str]:
        """What a client's TLS handshake with this campus's Mosquitto negotiates (a fresh
        connection as ``bench-floor``; open: nothing)."""
        campus = self.campus
        if not campus.secure:
            return {}
        context = campus.client_context(FLOOR)
        with (
            socket.create_connection(("127.0.0.1", campus.mqtt_port), timeout=10) as raw,
            context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
        ):
            cipher = tls.cipher()
            cert = tls.getpeercert() or {}
            return {
                "version": tls.version() or "",
                "cipher": cipher[0] if cipher else "",
                "server": _common_name(cert),
            }

    def _relay_argv(self) -> list[str]:
        campus = self.campus
        argv = [sys.executable, str(ROOT / "bench" / "relay.py"), str(campus.mqtt_port), RELAY]
        argv += [RELAY_TOPIC, "1"]
        if campus.secure:
            argv += [
                str(campus.ca_file),
                str(campus.cert_file(RELAY)),
                str(campus.key_files[RELAY]),
            ]
        return argv

    def _driver(self, identity: str, results: str) -> CampusDriver:
        campus = self.campus
        tls = campus.client_context(identity) if campus.secure else None
        return CampusDriver(campus.mqtt_port, tls=tls, results=results)

    def stop(self) -> None:
        for driver in self.drivers.values():
            driver.close()
        self.drivers = {}
        if self.relay is not None:
            self.relay.kill()
            self.relay.wait(20)
            self.relay = None
        if self.local is not None:
            self.local.stop()
        for server in (self.mosquitto, self.redis):
            if server is not None:
                server.stop()
        self.mosquitto = self.redis = None

    # One timed request each, in ms from publish to result; the result's JSON beside it.

    def _job(self, who: str, job_id: str, image: bytes, **kw: Any) -> tuple[float, dict[str, Any]]:
        self.drivers[who].submit(who, job_id.encode(), image, **kw)
        return self._result(who, job_id)

    def _result(self, who: str, job_id: str) -> tuple[float, dict[str, Any]]:
        driver = self.drivers[who]
        corr = job_id.encode()
        ms = driver.wait(corr)
        doc: dict[str, Any] = json.loads(driver.done.pop(corr)[1])
        driver.sent.pop(corr, None)
        return ms, doc

    def local_job(self, job_id: str, image: bytes) -> tuple[float, dict[str, Any]]:
        """A job app-line-2 submits to line-2-pc, which runs it itself."""
        return self._job(LOCAL_EDGE, job_id, image, user=[(topics.PROP_MODEL, MODEL)])

    def offloaded_job(self, job_id: str, image: bytes) -> tuple[float, dict[str, Any]]:
        """A wafer image app-line-1 submits to line-1-pc, which offloads it."""
        user = [
            (topics.PROP_MODEL, MODEL),
            (topics.PROP_DATA_CLASS, CLASS),
            (topics.PROP_JOB_ID, job_id),
            (topics.PROP_DEADLINE_MS, "200"),
        ]
        return self._job(OFFLOAD_EDGE, job_id, image, user=user)

    def direct_job(self, job_id: str, image: bytes, digest: bytes) -> tuple[float, dict[str, Any]]:
        """The same image straight to north-cpu-1, as ``bench-direct`` with its own token
        (and sealed to the worker, as wafer images travel: ``offload_path.direct_work``)."""
        work = direct_work(
            self.policy,
            self.broker_key,
            job_id=job_id,
            image=image,
            digest=digest,
            edge=DIRECT_EDGE,
            origin_zone=DIRECT_ZONE,
            worker=WORKER,
            now=time.time(),
        )
        topic = topics.pool_work(ZONE, WORKER, DIRECT_EDGE)
        send_work(self.drivers[DIRECT_EDGE], job_id.encode(), work, topic)
        return self._result(DIRECT_EDGE, job_id)

    def floor(self, corr: str, payload: bytes) -> float:
        """A QoS 1 round trip of ``payload`` through the bare relay."""
        ms, _doc = self._job(FLOOR, corr, payload, topic=RELAY_TOPIC)
        return ms


def _common_name(cert: dict[str, Any]) -> str:
    """The commonName of a certificate as ``SSLSocket.getpeercert`` returns it."""
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return ""
