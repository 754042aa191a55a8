"""Test helpers: a plain paho-mqtt v5 client (not ours) and an edge agent on a thread.

The plain client proves the wire contract works for any MQTT v5 client. Waits are on
events with timeouts (queue.get with a timeout), never fixed sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edge_agent.agent import EdgeAgent
from edge_agent.service import serve
from policies import load_signing_key
from policies.edit import add_node
from policies.keys import SigningKey
from policies.signing import add_signature, dump_signatures, sign_policy
from policies.verdict import Body, Candidate, Figures, Thresholds, Verdict, judge, sign_verdict
from sluicegate import AsyncClient, topics, wire
from sluicegate.app.campus import APP_OF_LINE, APPS, OFFICER, Campus
from sluicegate.app.localcampus import LocalCampus, start_campus_mosquitto
from sluicegate.app.servers import free_port, running
from sluicegate.config import Settings
from sluicegate.vision.runtime import ModelRegistry
from sluicegate.wire_pool import PlacementRequest
from tests.policies.policy_testkit import base_doc, key, policy_of, signed, to_toml


@dataclass(frozen=True)
class Received:
    topic: str
    payload: bytes
    correlation_data: bytes | None
    content_type: str | None
    retain: bool


class PlainClient:
    """A bare paho-mqtt v5 client, as a vision app in any language would use MQTT."""

    def __init__(self, port: int, *, host: str = "127.0.0.1") -> None:
        self.inbox: queue.Queue[Received] = queue.Queue()
        self._subacks: queue.Queue[int] = queue.Queue()
        self._connected = threading.Event()
        self.subscribed: set[str] = set()  # free for tests to note what they subscribed
        self.client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"plain-{uuid.uuid4().hex[:8]}",
            protocol=paho.MQTTv5,
        )
        self.client.on_connect = lambda *a: self._connected.set()
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda _c, _u, mid, _rc, _p: self._subacks.put(mid)
        # Like any sensible MQTT client: no Nagle delay on small packets (PUBACKs).
        self.client.on_socket_open = lambda _c, _u, sock: sock.setsockopt(
            socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
        )
        self.client.connect(host, port)
        self.client.loop_start()
        if not self._connected.wait(10):
            raise TimeoutError(f"plain client could not connect to {host}:{port}")

    def _on_message(self, _c: paho.Client, _u: object, msg: paho.MQTTMessage) -> None:
        props = msg.properties
        self.inbox.put(
            Received(
                msg.topic,
                bytes(msg.payload),
                getattr(props, "CorrelationData", None),
                getattr(props, "ContentType", None),
                bool(msg.retain),
            )
        )

    def subscribe(self, topic_filter: str) -> None:
        _rc, mid = self.client.subscribe(topic_filter, qos=1)
        while True:
            if self._subacks.get(timeout=10) == mid:
                return

    def submit(
        self,
        edge_id: str,
        payload: bytes,
        *,
        response_topic: str | None,
        correlation: bytes | None = None,
        content_type: str | None = "image/jpeg",
        user: list[tuple[str, str]] | None = None,
    ) -> None:
        props = Properties(PacketTypes.PUBLISH)
        if response_topic is not None:
            props.ResponseTopic = response_topic
        if correlation is not None:
            props.CorrelationData = correlation
        if content_type is not None:
            props.ContentType = content_type
        if user:
            props.UserProperty = user
        info = self.client.publish(topics.edge_submit(edge_id), payload, qos=1, properties=props)
        info.wait_for_publish(10)

    def next(self, timeout: float = 15.0) -> Received:
        return self.inbox.get(timeout=timeout)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


class Watcher(Protocol):
    """A test's MQTT client that can wait for what it subscribed to (plain or TLS)."""

    def subscribe(self, topic_filter: str) -> Any: ...

    def next(self, timeout: float = ...) -> Any: ...


class AgentThread:
    """A real edge agent (real MQTT transport, real ONNX Runtime) on its own thread."""

    def __init__(self, settings: Settings, registry: ModelRegistry) -> None:
        self.settings = settings
        self._registry = registry
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self.agent: EdgeAgent | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="edge-agent", daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self._started.set()
            self.agent = await serve(
                self.settings, self._stop, registry=self._registry, connect_timeout=10
            )

        try:
            asyncio.run(main())
        except BaseException as exc:
            self.error = exc
            self._started.set()

    def start(self, watcher: Watcher) -> None:
        """Start and wait until the agent's retained status says online."""
        watcher.subscribe(topics.edge_status(self.settings.edge.id))
        self._thread.start()
        while True:
            got = watcher.next(timeout=20)
            if got.topic.endswith("/status") and b'"online"' in got.payload:
                return
            if self.error is not None:
                raise self.error

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(20)
        if self.error is not None:
            raise self.error


def sluicegate_cmd(*args: str) -> list[str]:
    """The installed ``sluicegate`` console script, as a user would run it."""
    return [str(Path(sys.executable).with_name("sluicegate")), *args]


def twin(
    *args: str, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``sluicegate twin ARGS`` as its own process, as an engineer runs it."""
    command = [sys.executable, "-m", "sluicegate.app.cli", "twin", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def params_verdict(digest: str, signer: SigningKey, *, attainment: float = 0.99) -> Verdict:
    """A twin verdict for placement parameters of ``digest``, signed as twin key
    ``twin-1``, judged on made-up figures (``attainment``; one node at a peak of 9)."""
    figures = Figures(attainment=attainment, peak_queue_depth={"north-cpu-1": 9}, violations=0)
    thresholds = Thresholds()
    passed, reasons = judge(figures, thresholds)
    body = Body(
        candidate=Candidate(kind="params", digest=digest),
        trace_sha256="0" * 64,
        thresholds=thresholds,
        figures=figures,
        passed=passed,
        reasons=reasons,
        issued_at=1_796_000_000.0,
    )
    return sign_verdict(body, signer, "twin-1")


@functools.cache
def installed_policy() -> Path:
    """The testkit's signed policy as a file with its ``.sig`` beside it, as an operator
    installs one: what a node on the plain test Mosquitto starts from (its trust anchor).
    Written once per session, in the session's state folder (see conftest)."""
    folder = Path(os.environ.get("XDG_STATE_HOME") or tempfile.mkdtemp()) / "installed-policy"
    folder.mkdir(parents=True, exist_ok=True)
    doc = base_doc()
    path = folder / "campus.toml"
    path.write_text(to_toml(doc), encoding="utf-8")
    officers = signed(policy_of(doc), "officer-alice", "officer-bob")
    path.with_name(path.name + ".sig").write_bytes(dump_signatures(officers))
    return path


def start_agent_process(
    port: int, edge_id: str, *extra: str, policy_file: Path | None = None
) -> subprocess.Popen[bytes]:
    """``sluicegate edge run`` as its own process against the plain test Mosquitto (so with
    ``[mqtt] plaintext``) and with ``policy_file`` (by default :func:`installed_policy`) as
    its bootstrap policy, both set in its environment; returns once it is online."""
    env = {
        **os.environ,
        "SLUICEGATE_MQTT__PLAINTEXT": "true",
        "SLUICEGATE_OFFLOAD__POLICY_FILE": str(policy_file or installed_policy()),
    }
    watcher = PlainClient(port)
    try:
        watcher.subscribe(topics.edge_status(edge_id))
        # Output goes to the test's own (captured) stdout/stderr, shown if the test fails.
        proc = subprocess.Popen(
            sluicegate_cmd("edge", "run", "--port", str(port), "--id", edge_id, *extra), env=env
        )
        while True:
            try:
                got = watcher.next(timeout=1.0)
            except queue.Empty:
                if proc.poll() is not None:
                    raise RuntimeError(f"agent exited with {proc.returncode}") from None
                continue
            if b'"online"' in got.payload:
                return proc
    finally:
        watcher.close()


class ServiceThread:
    """Any role's ``serve(stop)`` coroutine on its own thread and event loop."""

    def __init__(self, main: Callable[[asyncio.Event], Coroutine[Any, Any, Any]]) -> None:
        self._main = main
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="service", daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self.result = await self._main(self._stop)

        try:
            asyncio.run(main())
        except BaseException as exc:
            self.error = exc

    def start(self) -> ServiceThread:
        self._thread.start()
        return self

    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run ``fn()`` on the service's loop (to read its state safely) and return its value."""
        assert self._loop is not None
        done: queue.Queue[Any] = queue.Queue()
        self._loop.call_soon_threadsafe(lambda: done.put(fn()))
        return done.get(timeout=timeout)

    def stop(self) -> None:
        loop = self._loop
        if loop is not None and self._stop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._stop.set)  # (closed: the service has ended)
        self._thread.join(30)
        if self.error is not None:
            raise self.error


def wait_until(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    """Poll ``check`` (a process's HTTP state, say) until it returns something truthy, and
    return that; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)  # the next poll of the state we wait on
    raise AssertionError(f"condition not reached within {timeout} s")


async def until(check: Callable[[], Any], timeout: float = 5.0) -> Any:
    """On the event loop: give the loop back until ``check`` returns something truthy, and
    return that; fail after ``timeout`` seconds. For state that in-memory parts change
    from the loop's callbacks, where there is no event to await."""
    async with asyncio.timeout(timeout):
        while not (value := check()):  # noqa: ASYNC110 - the state has no event of its own
            await asyncio.sleep(0)
    return value


def list_brokers(campus: Campus, ids: tuple[str, ...]) -> dict[str, Path]:
    """Add broker replicas ``ids`` to ``campus``'s policy (each under broker_signers with its
    published test key, written beside the campus's keys) and sign it again as the campus
    officer: a replica starts only with the key the policy lists for its id. Returns each
    replica's key file (its ``[broker] key_file``)."""
    if not ids:
        raise ValueError("list_brokers needs at least one broker id")
    text = campus.policy_file.read_text()
    files = {}
    for broker_id in ids:
        text, policy = add_node(text, "broker", broker_id, key=key(broker_id).public_text)
        files[broker_id] = campus.root / f"{broker_id}.key"
        files[broker_id].write_bytes(key(broker_id).to_pem())
        files[broker_id].chmod(0o600)
    campus.policy_file.write_text(text)
    officer = load_signing_key(campus.key_files[OFFICER])
    bundle = add_signature(None, policy, sign_policy(policy, officer, OFFICER))
    campus.policy_file.with_name(campus.policy_file.name + ".sig").write_bytes(
        dump_signatures(bundle)
    )
    return files


async def volley(
    campus: LocalCampus,
    edge: str,
    n: int,
    *,
    data_class: str = "wafer-image",
    deadline_ms: float = 2000.0,
) -> list[wire.JobResult]:
    """``n`` jobs at once to ``edge`` from its line's own app (the app's identity, results
    on its own topic), as a vision app sends a camera's volley; each answered once."""
    from tests.image_bytes import sample_jpeg

    image = sample_jpeg(5)[0]
    app = APP_OF_LINE[edge]
    reply_to = f"{APPS[app][1]}/volley-{uuid.uuid4().hex[:6]}"
    async with AsyncClient(campus.write().mqtt(app), edge=edge, response_topic=reply_to) as c:
        results = await asyncio.gather(
            *(
                c.infer(
                    image,
                    model="defect-v1",
                    deadline_ms=deadline_ms,
                    data_class=data_class,
                    job_id=f"v-{uuid.uuid4().hex[:8]}",
                )
                for _ in range(n)
            )
        )
        assert c.duplicates == 0
        assert c.unmatched == 0
    return list(results)


@contextlib.contextmanager
def local_campus(
    root: Path,
    redis_url: str,
    *,
    prepare: Callable[[Campus], None] | None = None,
    start: bool = True,
    **kw: Any,
) -> Iterator[LocalCampus]:
    """A whole secured campus as processes (:class:`LocalCampus`: its own Mosquitto with TLS
    and the generated ACL, on the Redis database at ``redis_url``, a ``fresh_redis_db()``),
    started; stopped after. ``prepare`` changes its files before Mosquitto starts (a test's
    own identities and ACL lines); with ``start`` false only Mosquitto runs."""
    from tests.policies.policy_testkit import key

    lc = LocalCampus(
        root,
        mqtt_port=free_port(),
        redis_url=redis_url,
        key_for=key,
        **kw,
    )
    files = lc.write()
    if prepare is not None:
        prepare(files)
    with running(start_campus_mosquitto(files)):
        if not start:
            yield lc
            return
        lc.start()
        try:
            yield lc
        finally:
            lc.stop()


def live_request(
    edge: str, job_id: str, *, deadline_s: float = 5.0, **fields: Any
) -> PlacementRequest:
    """A placement request as an edge sends one now: an 80 KB wafer image for defect-v1,
    due in ``deadline_s``, the edge predicting 2 s locally; ``fields`` override any field."""
    now = time.time()
    base: dict[str, Any] = {
        "job_id": job_id,
        "edge_id": edge,
        "model": "defect-v1",
        "data_class": "wafer-image",
        "payload_sha256": "ab" * 32,
        "payload_bytes": 80_000,
        "priority": 5,
        "deadline_at": now + deadline_s,
        "submitted_at": now,
        "local_estimate_ms": 2000.0,
    }
    return PlacementRequest(**(base | fields))
