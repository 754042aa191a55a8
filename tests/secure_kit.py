"""A secured campus for tests: its files (CA, certificates, ACL, policy) and its Mosquitto,
and a bare paho client that logs in with one identity's certificate, as a third-party
app, an intruder or an impostor would.

Identities the campus does not make (an enrolled line PC the policy does not list yet, an
intruder with a certificate of its own) are issued here with the campus CA.
"""

from __future__ import annotations

import json
import queue
import ssl
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import redis as redis_sync
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from policies import SigningKey
from policies.audit import decode_record
from policies.redis_stores import RedisStreamAuditStore, audit_stream_key
from sluicegate import pki
from sluicegate.app.campus import Campus, write_campus
from sluicegate.app.localcampus import start_campus_mosquitto
from sluicegate.app.servers import ServerProcess, free_port, running
from tests.policies.policy_testkit import key


def issue_identity(campus: Campus, name: str, *, signer: SigningKey | None = None) -> None:
    """A key and a client certificate for ``name`` from the campus CA, as enrollment gives
    a node (``signer``: its own key; by default the published test key of that name)."""
    ca = pki.load_authority(campus.root)
    own = signer or key(name)
    cert = pki.issue(
        ca, own.private.public_key(), name, purpose="client", now=_now(), days=pki.NODE_DAYS
    )
    path = campus.root / f"{name}.key"
    pki.write_private(path, own.to_pem())
    campus.cert_file(name).write_bytes(pki.cert_pem(cert))
    campus.key_files[name] = path


def foreign_identity(campus: Campus, name: str, as_identity: str) -> None:
    """A certificate for ``name`` from a CA that is not the campus's, kept as identity
    ``as_identity`` (so the campus's own ``name`` stays as it is)."""
    other = pki.new_authority("elsewhere", now=_now())
    own = key(name)
    cert = pki.issue(other, own.private.public_key(), name, purpose="client", now=_now(), days=30)
    path = campus.root / f"{as_identity}.key"
    pki.write_private(path, own.to_pem())
    campus.cert_file(as_identity).write_bytes(pki.cert_pem(cert))
    campus.key_files[as_identity] = path


def _now() -> float:
    import time

    return time.time()


@dataclass
class Got:
    topic: str
    payload: bytes
    retain: bool


class TlsClient:
    """A paho MQTT v5 client logged in as ``identity`` (its certificate's CN)."""

    def __init__(
        self,
        campus: Campus,
        identity: str | None,
        *,
        client_id: str | None = None,
        timeout: float = 10.0,
    ) -> None:
        self.inbox: queue.Queue[Got] = queue.Queue()
        self._subacks: queue.Queue[tuple[int, list[ReasonCode]]] = queue.Queue()
        self._pubacks: dict[int, ReasonCode] = {}
        self._acked = threading.Condition()
        self.connack: ReasonCode | None = None
        self._connected = threading.Event()
        self.client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id or f"tls-{uuid.uuid4().hex[:8]}",
            protocol=paho.MQTTv5,
        )
        context = ssl.create_default_context(cafile=str(campus.ca_file))
        if identity is not None:
            context.load_cert_chain(campus.cert_file(identity), campus.key_files[identity])
        self.client.tls_set_context(context)
        self.client.on_connect = self._on_connect
        self.lost: str | None = None
        self.client.on_disconnect = self._on_disconnect
        self.client.on_message = lambda _c, _u, m: self.inbox.put(
            Got(m.topic, bytes(m.payload), bool(m.retain))
        )
        self.client.on_subscribe = lambda _c, _u, mid, codes, _p: self._subacks.put((mid, codes))
        self.client.on_publish = self._on_publish
        self.client.connect("127.0.0.1", campus.mqtt_port)
        self.client.loop_start()
        if not self._connected.wait(timeout):
            self.close()
            raise TimeoutError(f"{identity} got no CONNACK")
        if self.connack is None or self.connack.is_failure:
            self.close()
            raise ConnectionRefusedError(f"no session: {self.connack or self.lost}")

    def _on_connect(
        self, _c: paho.Client, _u: object, _f: object, rc: ReasonCode, _p: object
    ) -> None:
        if self.lost is None:
            self.connack = rc
        self._connected.set()

    def _on_disconnect(
        self, _c: paho.Client, _u: object, _f: object, rc: ReasonCode, _p: object
    ) -> None:
        self.lost = str(rc)
        self._connected.set()  # whoever waits for the CONNACK stops waiting

    def _on_publish(
        self, _c: paho.Client, _u: object, mid: int, rc: ReasonCode, _p: object
    ) -> None:
        with self._acked:
            self._pubacks[mid] = rc
            self._acked.notify_all()

    def subscribe(self, topic_filter: str) -> list[ReasonCode]:
        _rc, mid = self.client.subscribe(topic_filter, qos=1)
        while True:
            got, codes = self._subacks.get(timeout=10)
            if got == mid:
                return codes

    def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        retain: bool = False,
        response_topic: str | None = None,
        user: list[tuple[str, str]] | None = None,
    ) -> ReasonCode:
        """Publish at QoS 1 and return the broker's PUBACK reason code."""
        props = Properties(PacketTypes.PUBLISH)
        if response_topic is not None:
            props.ResponseTopic = response_topic
        if user:
            props.UserProperty = user
        info = self.client.publish(topic, payload, qos=1, retain=retain, properties=props)
        with self._acked:
            if not self._acked.wait_for(lambda: info.mid in self._pubacks, 10):
                raise TimeoutError(f"no PUBACK for {topic}")
            return self._pubacks.pop(info.mid)

    def get(self, timeout: float = 10.0) -> Got:
        return self.inbox.get(timeout=timeout)

    next = get  # what tests.support.AgentThread.start waits with

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def refused_login(campus: Campus, identity: str | None) -> str:
    """Why a login as ``identity`` (None: no certificate) got no session (no CONNACK, or a
    refusal); AssertionError if it logs in."""
    try:
        client = TlsClient(campus, identity, timeout=5.0)
    except (OSError, ConnectionRefusedError) as exc:  # ssl.SSLError is an OSError
        return f"{type(exc).__name__}: {exc}"
    client.close()
    raise AssertionError(f"{identity!r} logged in")


def audit_records(redis_url: str, kind: str, node: str = "broker-1") -> list[dict[str, Any]]:
    """The data of each record of ``kind`` in ``node``'s audit log in Redis, oldest first."""
    client = redis_sync.Redis.from_url(redis_url)
    try:
        store = RedisStreamAuditStore(client, audit_stream_key(node))
        records = [decode_record(entry) for entry in store.entries()]
    finally:
        client.close()
    return [dict(r.data) for r in records if r.kind == kind]


def audited(redis_url: str, kind: str, node: str = "broker-1") -> list[dict[str, Any]]:
    """The decisions the records of ``kind`` in ``node``'s audit log hold, decoded (each
    record holds a JSON list of them)."""
    out: list[dict[str, Any]] = []
    for data in audit_records(redis_url, kind, node):
        out += json.loads(str(data["decisions"]))
    return out


@contextmanager
def secured_campus(
    root: Path, redis_url: str = "redis://127.0.0.1:1/0"
) -> Iterator[tuple[Campus, ServerProcess]]:
    """The campus's files under ``root`` and its secured Mosquitto."""
    campus = write_campus(root, key, mqtt_port=free_port(), redis_url=redis_url)
    (root / "mosquitto").mkdir(exist_ok=True)
    with running(start_campus_mosquitto(campus, workdir=root / "mosquitto")) as server:
        yield campus, server
