"""Malformed job requests, and a flooder that sends them at a fixed rate over a raw socket.

The packets are encoded here by hand (MQTT v5 CONNECT and QoS 0 PUBLISH), so they can be
what no well-behaved client library would send, such as user properties that are not valid
UTF-8, and so the flood costs the sender almost nothing. :data:`KINDS` is the mixture: each
kind names one way a request breaks the wire contract, with its share of the flood. Requests
that are not valid MQTT (bad UTF-8) go over connections of their own, since Mosquitto closes
a connection that sends one. No kind ever carries a job id a real job uses.
"""

from __future__ import annotations

import contextlib
import random
import socket
import ssl
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from sluicegate import topics
from tests.image_bytes import corrupt_jpeg, jpeg_header_only, png_header_only, sample_jpeg

Str = str | bytes


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n % 128, n // 128
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _str(value: Str) -> bytes:
    data = value.encode() if isinstance(value, str) else value
    return struct.pack(">H", len(data)) + data


def connect_packet(client_id: str, keepalive_s: int = 60) -> bytes:
    """MQTT v5 CONNECT with a clean start and no properties."""
    body = _str("MQTT") + bytes([5, 0x02]) + struct.pack(">H", keepalive_s) + b"\x00"
    body += _str(client_id)
    return b"\x10" + _varint(len(body)) + body


def publish_packet(
    topic: str,
    payload: bytes,
    *,
    response_topic: str | None = None,
    correlation: bytes | None = None,
    content_type: str | None = None,
    user: list[tuple[Str, Str]] | None = None,
) -> bytes:
    """MQTT v5 PUBLISH at QoS 0 with the given properties (values may be raw bytes)."""
    props = b""
    if content_type is not None:
        props += b"\x03" + _str(content_type)
    if response_topic is not None:
        props += b"\x08" + _str(response_topic)
    if correlation is not None:
        props += b"\x09" + _str(correlation)
    for key, value in user or []:
        props += b"\x26" + _str(key) + _str(value)
    body = _str(topic) + _varint(len(props)) + props + payload
    return b"\x30" + _varint(len(body)) + body


@dataclass(frozen=True)
class Kind:
    name: str
    weight: float
    build: Callable[[random.Random, str, int], bytes]  # rng, reply topic, payload limit
    own_connection: bool = False  # Mosquitto drops the connection that sends it


GOOD_JPEG = sample_jpeg(3)[0]
CORRUPT = corrupt_jpeg(3)
MODEL = [(topics.PROP_MODEL, "defect-v1")]


def _kinds() -> list[Kind]:
    def simple(
        name: str,
        weight: float,
        payload: Callable[[random.Random, int], bytes],
        user: Callable[[random.Random], list[tuple[Str, Str]]] = lambda _r: list(MODEL),
        content_type: str | None = "image/jpeg",
        reply: bool = True,
        own_connection: bool = False,
    ) -> Kind:
        def build(rng: random.Random, topic_reply: str, limit: int) -> bytes:
            return publish_packet(
                "",  # the flooder fills in the topic
                payload(rng, limit),
                response_topic=topic_reply if reply else None,
                correlation=f"flood-{name}-{rng.getrandbits(32)}".encode(),
                content_type=content_type,
                user=user(rng),
            )

        return Kind(name, weight, build, own_connection)

    def garbage(rng: random.Random, _limit: int) -> bytes:
        return rng.randbytes(rng.randint(1, 4096))

    def past_deadline(_rng: random.Random) -> list[tuple[Str, Str]]:
        return [*MODEL, (topics.PROP_DEADLINE_AT, repr((time.time() - 60) * 1000.0))]

    return [
        simple("no_response_topic", 10, lambda _r, _l: GOOD_JPEG, reply=False),
        simple("garbage_payload", 12, garbage),
        simple("empty_payload", 4, lambda _r, _l: b""),
        simple("wrong_content_type", 8, lambda _r, _l: GOOD_JPEG, content_type="text/plain"),
        simple("mismatched_content_type", 4, lambda _r, _l: GOOD_JPEG, content_type="image/png"),
        simple("huge_png_header", 8, lambda _r, _l: png_header_only(60_000, 60_000)),
        simple("huge_jpeg_header", 6, lambda _r, _l: jpeg_header_only(65_000, 65_000)),
        simple(
            "bad_deadline",
            8,
            lambda _r, _l: GOOD_JPEG,
            user=lambda r: [*MODEL, (topics.PROP_DEADLINE_MS, r.choice(["-5", "nan", "soon"]))],
        ),
        simple("past_deadline", 4, lambda _r, _l: GOOD_JPEG, user=past_deadline),
        simple(
            "unknown_model",
            8,
            lambda _r, _l: GOOD_JPEG,
            user=lambda _r: [(topics.PROP_MODEL, "defect-v9")],
        ),
        simple("missing_model", 4, lambda _r, _l: GOOD_JPEG, user=lambda _r: []),
        simple(
            "bad_priority_and_class",
            4,
            lambda _r, _l: GOOD_JPEG,
            user=lambda _r: [
                *MODEL,
                (topics.PROP_PRIORITY, "99"),
                (topics.PROP_DATA_CLASS, "Not A Class"),
            ],
        ),
        simple(
            "bad_job_id",
            4,
            lambda _r, _l: GOOD_JPEG,
            user=lambda _r: [*MODEL, (topics.PROP_JOB_ID, "../../etc/passwd")],
        ),
        simple(
            "many_user_properties",
            2,
            lambda _r, _l: GOOD_JPEG,
            user=lambda _r: [*MODEL, *((f"x-{i}", "y" * 64) for i in range(200))],
        ),
        # Just under the edge's payload limit: passes the size check, refused at the header.
        simple("near_limit_payload", 1, lambda _r, limit: b"\xff\xd8\xff" + bytes(limit - 64)),
        simple("over_limit_payload", 1, lambda _r, limit: b"\xff\xd8\xff" + bytes(limit + 1)),
        # A real header over a broken body: admitted, then fails to decode on a compute slot.
        simple("corrupt_jpeg_body", 2, lambda _r, _l: CORRUPT),
        simple(
            "invalid_utf8_user_property",
            2,
            lambda _r, _l: GOOD_JPEG,
            user=lambda _r: [(b"model", b"defect-\xff\xfe"), (b"\xc3\x28", b"x")],
            own_connection=True,
        ),
    ]


KINDS = _kinds()


_WOULD_BLOCK = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


class Flooder:
    """Publish malformed requests to one edge's submit topic at ``rate`` per second, over
    two raw connections (``main``, ``bad``), each logged in as its own app through
    ``logins`` (a TLS client context with the app's certificate, and its client id); without
    ``logins``, plain TCP to an open Mosquitto."""

    def __init__(
        self,
        port: int,
        edge: str,
        *,
        logins: dict[str, tuple[ssl.SSLContext, str]] | None = None,
        rate: float,
        reply_topic: str,
        payload_limit: int,
        seed: int = 0,
        kinds: list[Kind] | None = None,
    ) -> None:
        self._port = port
        self._logins = logins
        self._topic = topics.edge_submit(edge)
        self._rate = rate
        self._reply = reply_topic
        self._limit = payload_limit
        self._rng = random.Random(seed)
        self._kinds = kinds or KINDS
        self._weights = [k.weight for k in self._kinds]
        self.sent: Counter[str] = Counter()
        self.sent_bytes = 0
        self.dropped_connections: Counter[str] = Counter()  # by connection: main, bad
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_for(self, seconds: float) -> None:
        """Flood for ``seconds`` on a thread; :meth:`join` waits for the end."""
        self._thread = threading.Thread(target=self._run, args=(seconds,), name="flooder")
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def stop(self) -> None:
        self._stop.set()
        self.join(10)

    def _connect(self, name: str) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self._port), timeout=5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client_id = f"flood-{name}-{self._rng.getrandbits(32):08x}"
        if self._logins is not None:
            context, client_id = self._logins[name]
            sock = context.wrap_socket(sock, server_hostname="127.0.0.1")
        sock.sendall(connect_packet(client_id))
        ack = sock.recv(64)
        if ack[:1] != b"\x20":
            raise ConnectionError(f"flood connection refused: {ack!r}")
        sock.setblocking(False)
        return sock

    def _packet(self, kind: Kind) -> bytes:
        raw = kind.build(self._rng, self._reply, self._limit)
        # Put the real topic in place of the empty one the kind was built with.
        return _with_topic(raw, self._topic)

    def _run(self, seconds: float) -> None:
        socks = {"main": self._connect("main"), "bad": self._connect("bad")}
        start = time.monotonic()
        n = 0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now - start >= seconds:
                    return
                due = int((now - start) * self._rate) + 1
                while n < due:
                    kind = self._rng.choices(self._kinds, self._weights)[0]
                    packet = self._packet(kind)
                    which = "bad" if kind.own_connection else "main"
                    socks[which] = self._send(socks[which], which, packet)
                    self.sent[kind.name] += 1
                    self.sent_bytes += len(packet)
                    n += 1
                self._stop.wait(0.005)  # the pacing tick of the flood
        finally:
            for sock in socks.values():
                with contextlib.suppress(OSError):
                    sock.close()

    def _send(self, sock: socket.socket, name: str, packet: bytes) -> socket.socket:
        """Send ``packet``; a connection Mosquitto closed is replaced (and counted)."""
        view = memoryview(packet)
        while view:
            try:
                with contextlib.suppress(*_WOULD_BLOCK):
                    if sock.recv(65536) == b"":
                        raise ConnectionResetError("closed by Mosquitto")
                sent = sock.send(view)
                view = view[sent:]
            except _WOULD_BLOCK:
                time.sleep(0.001)  # the socket buffer is full: Mosquitto pushes back
            except OSError:
                self.dropped_connections[name] += 1
                with contextlib.suppress(OSError):
                    sock.close()
                sock = self._connect(name)
                view = memoryview(packet)
        return sock


def _with_topic(packet: bytes, topic: str) -> bytes:
    # Re-encode the fixed header: the body's topic was the empty string.
    i = 1
    while packet[i] & 0x80:
        i += 1
    body = packet[i + 1 :]
    assert body[:2] == b"\x00\x00", "kinds are built with an empty topic"
    body = _str(topic) + body[2:]
    return packet[:1] + _varint(len(body)) + body
