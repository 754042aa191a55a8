"""The campus's floor: the same jobs carried edge -> broker -> worker -> edge -> app by bare
paho-mqtt v5 processes, for ``bench/campus_burst.py`` to read the campus's machinery against
the simplest thing doing the same work, in the same run (issue 35).

Each role is a process of its own, logged in over TLS with a certificate of its own on a
campus's secured Mosquitto (:func:`add_identities`), answering from paho's callbacks:

* **edge**: takes a job (QoS 1, acked once its commit is done), hashes the image (SHA-256),
  commits it to SQLite (WAL, ``synchronous = FULL``, as the durable worker of
  ``bench/peers.py``). A job it keeps is answered at once (no model: the floor is of the
  machinery beyond the models); one it offloads asks the broker (QoS 0), checks the
  broker's signature on the answer, seals the image to the worker (HPKE) and sends it
  (QoS 1). A result is committed (the image dropped) before it is published to the app
  (QoS 1).
* **broker**: one Redis round trip (the reservation: ``SET NX EX``), a token signed
  (Ed25519, with libsodium as the campus) over the job, the image's digest and the
  worker, the answer (QoS 0).
* **worker**: checks the token's signature, opens the seal, checks the image against the
  token's digest and returns a result of the campus's size to the edge (QoS 1); no model.

Left out, so the floor errs low: usage records, telemetry, completions to the broker, the
worker's replay check, the policy's zone and class checks, acceptance state beyond the row.

    python bench/bare_chain.py edge|broker|worker PORT IDENTITY CA CERT KEY ARGS...

:func:`run_floor` starts the three, drives the jobs as the app (this process) and returns
the CPU each part spent a job.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sqlite3
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nacl.bindings
import paho.mqtt.client as paho
import redis as redis_sync
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import stats  # noqa: E402
from bench.campus_rig import issue_certificate, write_key  # noqa: E402
from policies.keys import SigningKey  # noqa: E402
from policies.sealing import SealingKey, open_sealed, seal  # noqa: E402
from sluicegate.app.campus import Campus  # noqa: E402
from sluicegate.app.traffic import VOLLEY  # noqa: E402

PREFIX = "bench/chain"
JOBS, REQUEST, REPLY, WORK, RETURNS = (
    f"{PREFIX}/{leg}" for leg in ("jobs", "request", "reply", "work", "returns")
)
ROLES = ("edge", "broker", "worker")
APP = "bench-chain-app"
IDENTITIES = (APP, *(f"bench-chain-{role}" for role in ROLES))
WORKER = "north-cpu-1"
# A result as big as the campus's for a surface image (a few detections and the timings).
RESULT = json.dumps(
    {
        "v": 1,
        "status": "ok",
        "model": "surface-det",
        "outputs": {"label": "scratch", "detections": [{"label": "scratch", "box": [1, 2, 3, 4]}]},
        "ran_on": {"kind": "pool", "node": WORKER, "zone": "campus/fab-north/dc"},
        "timings_ms": {"queue_ms": 0.1, "decode_ms": 1.0, "inference_ms": 2.0, "total_ms": 3.0},
    }
).encode()


def _props(corr: bytes, **user: str) -> Properties:
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    props.CorrelationData = corr
    if user:
        props.UserProperty = list(user.items())
    return props


def _user(msg: paho.MQTTMessage) -> dict[str, str]:
    return dict(getattr(msg.properties, "UserProperty", []))


def connect(port: int, tls: ssl.SSLContext, *, manual_ack: bool = False) -> paho.Client:
    """A paho v5 client over TLS with TCP_NODELAY, connected (its loop not started)."""
    client = paho.Client(CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5, manual_ack=manual_ack)
    client.tls_set_context(tls)
    client.on_socket_open = lambda _c, _u, s: s.setsockopt(  # type: ignore[attr-defined]
        socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
    )
    client.connect("127.0.0.1", port)
    return client


# -- the roles (each in a process of its own) ----------------------------------------------------


def edge(client: paho.Client, db_path: str, worker_seal: bytes, broker_key: bytes) -> None:
    db = sqlite3.connect(db_path)
    db.execute("PRAGMA journal_mode = WAL")
    db.execute("PRAGMA synchronous = FULL")
    db.execute("CREATE TABLE jobs (id BLOB PRIMARY KEY, topic TEXT, payload BLOB, result BLOB)")
    waiting: dict[bytes, tuple[bytes, bytes, str]] = {}  # job -> image, digest, its app's topic

    def answer(job: bytes, topic: str, result: bytes) -> None:
        with db:
            db.execute("UPDATE jobs SET result = ?, payload = NULL WHERE id = ?", (result, job))
        client.publish(topic, result, qos=1, properties=_props(job))

    def on_job(msg: paho.MQTTMessage) -> None:
        job, topic = msg.properties.CorrelationData, msg.properties.ResponseTopic  # type: ignore[union-attr]
        digest = hashlib.sha256(msg.payload).digest()
        with db:
            db.execute("INSERT INTO jobs VALUES (?, ?, ?, NULL)", (job, topic, msg.payload))
        client.ack(msg.mid, msg.qos)
        if _user(msg).get("offload") != "1":
            answer(job, topic, RESULT)
            return
        waiting[job] = (bytes(msg.payload), digest, str(topic))
        client.publish(REQUEST, digest, qos=0, properties=_props(job))

    def on_reply(msg: paho.MQTTMessage) -> None:
        job = msg.properties.CorrelationData  # type: ignore[union-attr]
        image, digest, _topic = waiting[job]
        sig = bytes.fromhex(_user(msg)["sig"])
        nacl.bindings.crypto_sign_open(sig + msg.payload, broker_key)  # raises if forged
        if msg.payload[: len(digest)] != digest:
            raise ValueError("a token for another image")
        work = seal(worker_seal, image, job)
        client.publish(
            WORK, work, qos=1, properties=_props(job, token=msg.payload.hex(), sig=sig.hex())
        )

    def on_return(msg: paho.MQTTMessage) -> None:
        job = msg.properties.CorrelationData  # type: ignore[union-attr]
        _image, _digest, topic = waiting.pop(job)
        answer(job, topic, bytes(msg.payload))

    def ack(msg: paho.MQTTMessage) -> None:
        if msg.topic != JOBS:  # a job is acked once committed
            client.ack(msg.mid, msg.qos)

    serve(client, {JOBS: on_job, REPLY: on_reply, RETURNS: on_return}, ack)


def broker(client: paho.Client, redis_port: int, key_seed: bytes) -> None:
    r = redis_sync.Redis(port=redis_port)
    _public, secret = nacl.bindings.crypto_sign_seed_keypair(key_seed)

    def on_request(msg: paho.MQTTMessage) -> None:
        job = msg.properties.CorrelationData  # type: ignore[union-attr]
        r.set(b"bench-chain:" + job, WORKER, nx=True, ex=60)
        token = bytes(msg.payload) + json.dumps([job.hex(), WORKER, time.time() + 5.0]).encode()
        sig = nacl.bindings.crypto_sign(token, secret)[:64]
        client.publish(REPLY, token, qos=0, properties=_props(job, sig=sig.hex()))

    serve(client, {REQUEST: on_request})


def worker(client: paho.Client, seal_seed: bytes, broker_key: bytes) -> None:
    key = SealingKey.from_seed(seal_seed)

    def on_work(msg: paho.MQTTMessage) -> None:
        job = msg.properties.CorrelationData  # type: ignore[union-attr]
        user = _user(msg)
        token = bytes.fromhex(user["token"])
        nacl.bindings.crypto_sign_open(bytes.fromhex(user["sig"]) + token, broker_key)
        image = open_sealed(key, bytes(msg.payload), job)
        if hashlib.sha256(image).digest() != token[:32]:
            raise ValueError("the image is not the token's")
        client.ack(msg.mid, msg.qos)
        client.publish(RETURNS, RESULT, qos=1, properties=_props(job))

    serve(client, {WORK: on_work})


def serve(
    client: paho.Client,
    handlers: Mapping[str, Callable[[paho.MQTTMessage], None]],
    ack: Callable[[paho.MQTTMessage], None] | None = None,
) -> None:
    """Subscribe to each handler's topic (QoS 1) and serve until killed."""

    def on_message(_c: paho.Client, _u: Any, msg: paho.MQTTMessage) -> None:
        handlers[msg.topic](msg)
        if ack is not None:
            ack(msg)

    def on_connect(c: paho.Client, *_a: Any) -> None:
        for topic in handlers:
            c.subscribe(topic, qos=1)

    client.on_message = on_message
    client.on_connect = on_connect
    client.loop_forever()


def role_main(argv: Sequence[str]) -> None:
    role, port, _identity, ca, cert, key, *rest = argv
    tls = ssl.create_default_context(cafile=ca)
    tls.load_cert_chain(cert, key)
    client = connect(int(port), tls, manual_ack=role in ("edge", "worker"))
    if role == "edge":
        edge(client, rest[0], bytes.fromhex(rest[1]), bytes.fromhex(rest[2]))
    elif role == "broker":
        broker(client, int(rest[0]), bytes.fromhex(rest[1]))
    elif role == "worker":
        worker(client, bytes.fromhex(rest[0]), bytes.fromhex(rest[1]))
    else:
        raise SystemExit(f"role {role!r}; known: {', '.join(ROLES)}")


# -- the run (the bench's process plays the app) -------------------------------------------------


def add_identities(campus: Campus) -> None:
    """A certificate from the campus CA for each of the chain's identities, and their ACL
    block (the chain's topics only), before the campus's Mosquitto starts."""
    for name in IDENTITIES:
        key = SigningKey.generate()
        write_key(campus, name, key)
        issue_certificate(campus, name, key)
    with campus.acl_file.open("a") as acl:
        acl.write("\n# bench only: the bare chain (bench/bare_chain.py)\n")
        for name in IDENTITIES:
            acl.write(f"user {name}\ntopic readwrite {PREFIX}/#\n\n")


@dataclass(frozen=True)
class Floor:
    """A floor run: jobs answered, how many offloaded, CPU ms a job by part."""

    answered: int
    offloaded: int
    cpu_ms_per_job: dict[str, float]

    @property
    def total_ms(self) -> float:
        return sum(self.cpu_ms_per_job.values())


def schedule(rate: float, burst_s: float, volley: int = VOLLEY) -> list[float]:
    """Send times (s from the start) of the campus bench's traffic: two lines at ``rate``
    jobs/s for ``burst_s + 2`` s, line 1 at ten times that for ``burst_s`` s from 1 s, in
    volleys of ``volley``."""
    steady = [i / rate for i in range(int((burst_s + 2.0) * rate))]
    line_1 = [t for t in steady if not 1.0 <= t < 1.0 + burst_s]
    every = volley / (10.0 * rate)
    line_1 += [1.0 + k * every for k in range(round(burst_s / every)) for _ in range(volley)]
    return sorted(steady + line_1)


def run_floor(
    campus: Campus,
    redis_port: int,
    servers: Sequence[int],
    images: Sequence[bytes],
    send_at: Sequence[float],
    offload_share: float,
    workdir: Path,
    timeout_s: float = 60.0,
) -> Floor:
    """Start the chain on ``campus``'s Mosquitto (running, with :func:`add_identities`
    done before it started), send ``images`` in turn at ``send_at`` as the app, offloading
    ``offload_share`` of them, wait for every result; CPU a job answered by part: the
    chain's roles as the campus's (edge, broker, pool), the app (this process) and
    ``servers`` (Mosquitto, Redis)."""
    broker_seed, seed = os.urandom(32), os.urandom(32)
    seal_public = SealingKey.from_seed(seed).public
    verify_key, _secret = nacl.bindings.crypto_sign_seed_keypair(broker_seed)
    extra = {
        "edge": [str(workdir / "chain-edge.db"), seal_public.hex(), verify_key.hex()],
        "broker": [str(redis_port), broker_seed.hex()],
        "worker": [seed.hex(), verify_key.hex()],
    }
    procs: dict[str, subprocess.Popen[bytes]] = {}
    tls = campus.client_context(APP)
    app = connect(campus.mqtt_port, tls)
    results = f"{PREFIX}/results/{os.getpid()}"
    done: dict[bytes, float] = {}
    probes: set[bytes] = set()  # answered probes: the chain serves
    all_done = threading.Event()
    subscribed = threading.Event()

    def on_message(_c: paho.Client, _u: Any, msg: paho.MQTTMessage) -> None:
        corr = msg.properties.CorrelationData  # type: ignore[union-attr]
        if corr.startswith(b"probe-"):
            probes.add(corr)
            return
        done[corr] = time.monotonic()
        if len(done) >= len(send_at):
            all_done.set()

    app.on_message = on_message
    app.on_subscribe = lambda *_a: subscribed.set()
    try:
        for role in ROLES:
            name = f"bench-chain-{role}"
            argv = [sys.executable, __file__, role, str(campus.mqtt_port), name]
            argv += [str(campus.ca_file), str(campus.cert_file(name)), str(campus.key_files[name])]
            log = (workdir / f"{name}.log").open("ab")
            procs[role] = subprocess.Popen([*argv, *extra[role]], stdout=log, stderr=log)
        app.loop_start()
        app.subscribe(results, qos=1)
        if not subscribed.wait(10):
            raise TimeoutError(f"no SUBACK for {results}")
        _until_served(app, results, procs, probes)
        done.clear()
        return _drive(
            app, results, images, send_at, offload_share, done, all_done, procs, servers, timeout_s
        )
    finally:
        app.loop_stop()
        app.disconnect()
        for proc in procs.values():
            proc.kill()
            proc.wait(20)


def _send(app: paho.Client, results: str, job: bytes, image: bytes, offload: bool) -> None:
    props = _props(job, offload="1" if offload else "0")
    props.ResponseTopic = results
    app.publish(JOBS, image, qos=1, properties=props)


def _until_served(
    app: paho.Client, results: str, procs: dict[str, subprocess.Popen[bytes]], probes: set[bytes]
) -> None:
    """Probe jobs (offloaded) until one comes back (into ``probes``): every role is
    subscribed."""
    deadline = time.monotonic() + 30.0
    n = 0
    while not probes:
        dead = [role for role, proc in procs.items() if proc.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"the bare chain did not answer (exited: {dead or 'none'})")
        n += 1
        _send(app, results, f"probe-{n}".encode(), RESULT, offload=True)
        time.sleep(0.5)  # a probe's round trip, then the next try


def _drive(
    app: paho.Client,
    results: str,
    images: Sequence[bytes],
    send_at: Sequence[float],
    offload_share: float,
    done: dict[bytes, float],
    all_done: threading.Event,
    procs: dict[str, subprocess.Popen[bytes]],
    servers: Sequence[int],
    timeout_s: float,
) -> Floor:
    def used() -> dict[str, float]:
        out = {part: stats.cpu_s(procs[role].pid) for role, part in PARTS.items()}
        times = os.times()
        out["apps"] = times.user + times.system
        out["servers"] = sum(stats.cpu_s(pid) for pid in servers)
        return out

    before = used()
    start = time.monotonic()
    owed, offloaded = 0.0, 0
    for i, at in enumerate(send_at):
        wait = start + at - time.monotonic()
        if wait > 0:
            time.sleep(wait)  # open loop: each job at its time
        owed += offload_share
        offload = owed >= 1.0
        if offload:
            owed -= 1.0
            offloaded += 1
        _send(app, results, f"job-{i}".encode(), images[i % len(images)], offload)
    if not all_done.wait(timeout_s):
        raise TimeoutError(f"the bare chain answered {len(done)} of {len(send_at)} jobs")
    after = used()
    jobs = len(done)
    per_job = {part: 1000.0 * (after[part] - before[part]) / jobs for part in after}
    return Floor(jobs, offloaded, per_job)


PARTS = {"edge": "edge", "broker": "broker", "worker": "pool"}  # a role as the campus's part


if __name__ == "__main__":
    role_main(sys.argv[1:])
