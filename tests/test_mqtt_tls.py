"""Real tier: the transport over TLS (``[mqtt] tls_ca_file``) against a real Mosquitto.

paho runs on the event loop, which watches the raw socket while paho reads through the TLS
layer: messages spread over many TLS records, and small ones back to back, must all arrive
whole and in order; a broker whose certificate our CA did not sign is refused by name.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from sluicegate.app.servers import free_port, running, start_mosquitto
from sluicegate.config import READ_GAP_MS_MOST, MqttSettings
from sluicegate.errors import TransportError
from sluicegate.mqtt import Message, MqttTransport

pytestmark = pytest.mark.integration


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[str, ec.EllipticCurvePrivateKey] | None = None,
) -> x509.Certificate:
    """A CA certificate (no ``issuer``), or a server certificate for 127.0.0.1 it signs."""
    now = dt.datetime.now(dt.UTC)
    issuer_name, signer = issuer if issuer is not None else (subject, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), True)
    )
    if issuer is not None:
        names = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), False)
    return builder.sign(signer, hashes.SHA256())


@pytest.fixture
def tls(tmp_path: Path) -> Iterator[tuple[int, Path, Path]]:
    """A Mosquitto with a TLS listener; yields its port, our CA file and another CA's."""
    ca_key, server_key = (
        ec.generate_private_key(ec.SECP256R1()),
        ec.generate_private_key(ec.SECP256R1()),
    )
    ca = _certificate("sluicegate test CA", ca_key)
    server = _certificate("127.0.0.1", server_key, ("sluicegate test CA", ca_key))
    (tmp_path / "ca.pem").write_bytes(_pem(ca))
    (tmp_path / "server.pem").write_bytes(_pem(server))
    (tmp_path / "server.key").write_bytes(
        server_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    stranger_key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "stranger.pem").write_bytes(_pem(_certificate("a stranger", stranger_key)))
    port = free_port()
    lines = (
        f"listener {port} 127.0.0.1",
        f"cafile {tmp_path / 'ca.pem'}",
        f"certfile {tmp_path / 'server.pem'}",
        f"keyfile {tmp_path / 'server.key'}",
    )
    with running(start_mosquitto(extra_config=lines)):  # its plain listener says it is up
        yield port, tmp_path / "ca.pem", tmp_path / "stranger.pem"


async def _next(queue: asyncio.Queue[Message], timeout: float = 10.0) -> Message:
    return await asyncio.wait_for(queue.get(), timeout)


async def test_messages_over_tls_arrive_whole_and_in_order(
    tls: tuple[int, Path, Path], unique: str
) -> None:
    port, ca_file, _ = tls
    settings = MqttSettings(port=port, tls_ca_file=ca_file)
    got: asyncio.Queue[Message] = asyncio.Queue()
    # Sizes from a few bytes to many 16 KB TLS records, then a burst of small messages.
    sizes = (5, 40_000, 300_000, 17, 1_000_000, *[3] * 30)
    payloads = [bytes([i]) * size for i, size in enumerate(sizes)]
    async with (
        MqttTransport(settings, client_id=f"tls-a-{unique}") as a,
        MqttTransport(settings, client_id=f"tls-b-{unique}") as b,
    ):
        await b.subscribe(f"tls/{unique}", got.put_nowait)
        for payload in payloads:
            a.publish_nowait(Message(f"tls/{unique}", payload, qos=1, correlation_data=payload[:1]))
        received = [await _next(got, 5.0) for _ in payloads]
    assert [m.payload for m in received] == payloads
    assert [m.correlation_data for m in received] == [p[:1] for p in payloads]


async def test_with_the_longest_read_gap_a_tls_burst_is_read_whole_in_a_few_wake_ups(
    tls: tuple[int, Path, Path], unique: str
) -> None:
    """Mosquitto writes a TLS record per packet, and a read of a TLS socket returns one
    record: a wake-up reads on until the socket has nothing, not one record per read gap.
    Read one record a gap, the 200 messages would take 200 x 20 ms = 4 s, past the wait."""
    port, ca_file, _ = tls
    settings = MqttSettings(port=port, tls_ca_file=ca_file)
    gap_s = READ_GAP_MS_MOST / 1000.0
    got: list[bytes] = []
    done = asyncio.Event()

    def take(msg: Message) -> None:
        got.append(msg.payload)
        if len(got) == 200:
            done.set()

    async with (
        MqttTransport(settings, client_id=f"tls-g-{unique}", read_gap_s=gap_s) as reader,
        MqttTransport(settings, client_id=f"tls-w-{unique}") as writer,
    ):
        await reader.subscribe(f"tlsg/{unique}", take)
        for i in range(200):
            writer.publish_nowait(Message(f"tlsg/{unique}", b"%d" % i))
        await asyncio.wait_for(done.wait(), 2.5)
    assert got == [b"%d" % i for i in range(200)]


# paho leaves the socket of a failed TLS handshake to the garbage collector, which warns.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_a_broker_certificate_from_another_ca_is_refused(
    tls: tuple[int, Path, Path], unique: str
) -> None:
    port, _, stranger_ca = tls
    settings = MqttSettings(port=port, tls_ca_file=stranger_ca)
    transport = MqttTransport(settings, client_id=f"tls-x-{unique}")
    with pytest.raises(TransportError, match=r"certificate verify failed"):
        await transport.connect(timeout=2.0)
