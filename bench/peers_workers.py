"""Both ends of the wire for ``bench/peers.py``, so that a request's shape (topic, user
property, path) is spelt once: what a user would write instead of the edge agent, three
small serving programs run as processes of their own; and the driver's clients for every
arm (MQTT v5, HTTP, and the broker's usage intake that an agent ships its records to).

The programs serve the job with the agent's own model code (``LoadedModel.infer_bytes``:
decode, preprocess, run, postprocess) on a pool of compute threads, and answer with the
outputs and stage times as JSON:

* ``bare``: a paho MQTT v5 worker. It subscribes to its request topic at QoS 1, runs each
  image (the model named by the request's ``model`` user property) and publishes the result
  QoS 1 to the request's Response Topic with its Correlation Data. No durability.
* ``durable``: the same worker made durable the way the agent is: each job is committed to
  SQLite (WAL, ``synchronous = FULL``, the agent's outbox default) before its PUBACK (manual
  acks), and its result committed (the image dropped) before the result is published. One
  commit per step, on the thread that holds the job (paho's for the acceptance, the compute
  thread's for the result): no group commit, no replay at start (nothing here restarts).
* ``aiohttp``: an HTTP server: ``POST /infer/<model>`` with the image, the JSON in the reply.

Plain TCP, no credentials, as a user's first worker would be. Started by ``bench/peers.py``,
which knows one serves once it answers a job:

    python bench/peers_workers.py bare|durable|aiohttp PORT [--threads 2] [--db FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import socket
import sqlite3
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any, cast

import paho.mqtt.client as paho
from aiohttp import web
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sluicegate import topics
from sluicegate.app.campus import BROKER
from sluicegate.metering.record import SignedUsage
from sluicegate.metering.wire import UsageAck, decode_batch
from sluicegate.vision.runtime import ModelRegistry, default_models_dir

KINDS = ("bare", "durable", "aiohttp")
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS jobs (corr BLOB PRIMARY KEY, response_topic TEXT NOT NULL, "
    "model TEXT NOT NULL, payload BLOB, result BLOB)"
)


def request_topic(kind: str) -> str:
    """Where the MQTT worker ``kind`` takes its requests."""
    return f"bench/peers/{kind}/jobs"


def answer(registry: ModelRegistry, model: str, image: bytes) -> bytes:
    """One job, start to finish: the result document, or a failure's."""
    try:
        outputs, times = registry.get(model).infer_bytes(image)
    except Exception as exc:  # the job's failure, never the worker's
        return json.dumps({"status": "failed", "reason": repr(exc)}).encode()
    doc = {"status": "ok", "model": model, "outputs": asdict(outputs), "timings_ms": asdict(times)}
    return json.dumps(doc).encode()


class Journal:
    """The durable worker's SQLite file: jobs in, results out, one commit each."""

    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(path, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode = WAL")
        self.db.execute("PRAGMA synchronous = FULL")
        self.db.execute(SCHEMA)
        self.lock = threading.Lock()

    def accept(self, corr: bytes, topic: str, model: str, image: bytes) -> None:
        with self.lock, self.db:
            self.db.execute(
                "INSERT INTO jobs VALUES (?, ?, ?, ?, NULL)", (corr, topic, model, image)
            )

    def finish(self, corr: bytes, result: bytes) -> None:
        with self.lock, self.db:
            self.db.execute(
                "UPDATE jobs SET result = ?, payload = NULL WHERE corr = ?", (result, corr)
            )


def mqtt_worker(kind: str, port: int, threads: int, db: Path | None) -> None:
    registry = ModelRegistry.from_dir(default_models_dir())
    pool = ThreadPoolExecutor(threads)
    journal = Journal(db) if kind == "durable" and db is not None else None
    client = paho.Client(
        CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5, manual_ack=journal is not None
    )

    def run(topic: str, corr: bytes, model: str, image: bytes) -> None:
        result = answer(registry, model, image)
        if journal is not None:
            journal.finish(corr, result)
        props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        props.CorrelationData = corr
        props.ContentType = "application/json"
        client.publish(topic, result, qos=1, properties=props)

    def on_message(c: paho.Client, _u: Any, msg: paho.MQTTMessage) -> None:
        props = msg.properties
        topic, corr = props.ResponseTopic, props.CorrelationData  # type: ignore[union-attr]
        model = dict(getattr(props, "UserProperty", [])).get("model", "")
        if journal is not None:
            journal.accept(corr, topic, model, cast(bytes, msg.payload))
            c.ack(msg.mid, msg.qos)
        pool.submit(run, topic, corr, model, cast(bytes, msg.payload))

    client.on_message = on_message
    client.on_connect = lambda c, *_a: c.subscribe(request_topic(kind), qos=1)
    client.on_socket_open = lambda _c, _u, s: s.setsockopt(  # type: ignore[attr-defined]
        socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
    )
    client.connect("127.0.0.1", port)
    client.loop_forever()


def http_server(port: int, threads: int) -> None:
    registry = ModelRegistry.from_dir(default_models_dir())
    pool = ThreadPoolExecutor(threads)

    async def infer(request: web.Request) -> web.Response:
        image = await request.read()
        loop = asyncio.get_running_loop()
        model = request.match_info["model"]
        body = await loop.run_in_executor(pool, answer, registry, model, image)
        return web.Response(body=body, content_type="application/json")

    app = web.Application(client_max_size=16 * 2**20)
    app.router.add_post("/infer/{model}", infer)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


# -- the driver's side: bench/peers.py's clients --------------------------------------------

Call = Callable[[str, str, float], float]  # (correlation, model, timeout s) -> latency ms


class BenchError(RuntimeError):
    """A serving process that died, or answered a job with anything but its result."""


def checked(payload: bytes, node: str | None) -> None:
    """An answer is a result (``status`` ok), from ``node`` itself when one is named."""
    doc = json.loads(payload)
    if doc.get("status") != "ok":
        raise BenchError(f"not a result: {payload[:300]!r}")
    if node is not None and doc["ran_on"]["node"] != node:
        raise BenchError(f"{node} did not run the job itself: {doc['ran_on']}")


def mqtt_client(port: int, tls: ssl.SSLContext | None) -> paho.Client:
    """A connected paho v5 client (over TLS with ``tls``), its loop on its own thread."""
    client = paho.Client(CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
    if tls is not None:
        client.tls_set_context(tls)
    client.on_socket_open = lambda _c, _u, s: s.setsockopt(  # type: ignore[attr-defined]
        socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
    )
    connected = threading.Event()
    client.on_connect = lambda *_a: connected.set()
    client.connect("127.0.0.1", port)
    client.loop_start()
    if not connected.wait(10):
        client.loop_stop()
        raise BenchError(f"no CONNACK from 127.0.0.1:{port}")
    return client


def subscribe(client: paho.Client, topic: str, on_message: Callable[..., None]) -> None:
    granted: list[Any] = []
    done = threading.Event()

    def on_subscribe(_c: paho.Client, _u: object, _mid: int, codes: list[Any], _p: object) -> None:
        granted.extend(codes)
        done.set()

    client.message_callback_add(topic, on_message)
    client.on_subscribe = on_subscribe
    client.subscribe(topic, qos=1)
    if not done.wait(10) or any(code.is_failure for code in granted):
        raise BenchError(f"subscription to {topic} not granted: {granted}")


class MqttArm:
    """Requests to one serving process over MQTT v5: the image QoS 1 on its request topic
    with a Response Topic and Correlation Data; answers matched by correlation."""

    def __init__(
        self, port: int, image: bytes, tls: ssl.SSLContext | None = None, node: str | None = None
    ) -> None:
        self.image, self.node = image, node
        self.client = mqtt_client(port, tls)
        self.pending: dict[bytes, Future[bytes]] = {}
        self.topic = self.results = ""

    def route(self, topic: str, results: str) -> None:
        """Send requests to ``topic``, ask for answers on ``results``."""
        self.topic, self.results = topic, results
        subscribe(self.client, results, self._on_answer)

    def _on_answer(self, _c: paho.Client, _u: object, msg: paho.MQTTMessage) -> None:
        fut = self.pending.get(msg.properties.CorrelationData)  # type: ignore[union-attr]
        if fut is not None and not fut.done():
            fut.set_result(bytes(msg.payload))

    def lane(self) -> contextlib.AbstractContextManager[Call]:
        return contextlib.nullcontext(self.call)

    def call(self, corr: str, model: str, timeout: float) -> float:
        key = corr.encode()
        props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        props.ResponseTopic, props.CorrelationData = self.results, key
        props.ContentType, props.UserProperty = "image/jpeg", [(topics.PROP_MODEL, model)]
        fut: Future[bytes] = Future()
        self.pending[key] = fut
        try:
            t0 = time.perf_counter()
            self.client.publish(self.topic, self.image, qos=1, properties=props)
            payload = fut.result(timeout)
            ms = (time.perf_counter() - t0) * 1000.0
        finally:
            self.pending.pop(key, None)
        checked(payload, self.node)
        return ms

    def tls_session(self) -> str:
        sock = self.client.socket()
        if not isinstance(sock, ssl.SSLSocket):
            return "plain TCP"
        cipher = sock.cipher()
        return f"{sock.version()} {cipher[0] if cipher else ''}"

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


class HttpArm:
    """Requests to the aiohttp server: a keep-alive connection per lane."""

    def __init__(self, port: int, image: bytes) -> None:
        self.port, self.image = port, image

    @contextlib.contextmanager
    def lane(self) -> Iterator[Call]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            yield partial(self._call, conn)
        finally:
            conn.close()

    def _call(self, conn: http.client.HTTPConnection, _corr: str, model: str, _t: float) -> float:
        headers = {"Content-Type": "image/jpeg"}
        t0 = time.perf_counter()
        conn.request("POST", f"/infer/{model}", body=self.image, headers=headers)
        response = conn.getresponse()
        payload = response.read()
        ms = (time.perf_counter() - t0) * 1000.0
        if response.status != 200:
            raise BenchError(f"aiohttp answered {response.status}: {payload[:300]!r}")
        checked(payload, None)
        return ms


class UsageAcker:
    """A broker replica's usage intake on one Mosquitto, for the agents on it: each batch of
    usage records an agent ships acknowledged at once (as ``broker-1`` on the TLS
    Mosquitto: one connection, as that identity holds one), so its ledger marks them as a
    deployed agent's does, and its shipper has no backlog to resend."""

    def __init__(self, port: int, tls: ssl.SSLContext | None) -> None:
        self.acked: dict[str, int] = {}  # records acknowledged, by node
        self.client = mqtt_client(port, tls)

    def add(self, node: str) -> None:
        """Acknowledge ``node``'s records from now on."""
        self.acked[node] = 0
        subscribe(self.client, topics.usage(node), partial(self._on_batch, node))

    def _on_batch(self, node: str, client: paho.Client, _u: object, msg: paho.MQTTMessage) -> None:
        batch = decode_batch(cast(bytes, msg.payload))
        held = [r.record.seq for r in batch if isinstance(r, SignedUsage)]
        self.acked[node] += len(held)
        ack = UsageAck(node=node, broker=BROKER, held=held)
        client.publish(topics.usage_acks(node), ack.model_dump_json(), qos=1)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("kind", choices=KINDS)
    ap.add_argument("port", type=int, help="Mosquitto's port; aiohttp: the port to serve on")
    ap.add_argument("--threads", type=int, default=2, help="compute threads")
    ap.add_argument("--db", type=Path, help="the durable worker's SQLite file")
    args = ap.parse_args()
    if args.kind == "durable" and args.db is None:
        ap.error("durable needs --db")
    if args.kind == "aiohttp":
        http_server(args.port, args.threads)
    else:
        mqtt_worker(args.kind, args.port, args.threads, args.db)


if __name__ == "__main__":
    main()
