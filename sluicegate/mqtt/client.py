"""What one MQTT v5 connection is made of, as paho needs it before it connects: the client
id, manual acks, the credentials, TLS with the node's own certificate, the Last Will.

:class:`~sluicegate.mqtt.bridge.MqttTransport` drives the client this returns; a bad TLS
file is a TransportError naming the settings, before any connection is tried. The client
does not read its socket: the transport reads it, cuts the packets out itself
(:mod:`sluicegate.mqtt.framing`), takes in the PUBLISH packets it can and hands paho the
rest, whole, with :meth:`FedClient.hand` (paho then reads them as from the socket).
"""

from __future__ import annotations

import ssl
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from sluicegate.config import MqttSettings
from sluicegate.errors import TransportError
from sluicegate.mqtt.wire import varint
from sluicegate.transport import Will


class FedClient(paho.Client):
    """A paho client that reads the packets it is handed instead of its socket."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._handed = bytearray()
        self._ended = False

    def hand(self, header: int, body: bytes) -> None:
        """Give paho one whole packet to read (its next ``loop_read`` reads it)."""
        self._handed += bytes([header]) + varint(len(body)) + body

    def hand_end(self) -> None:
        """The connection delivered its last byte: paho's next read finds it lost."""
        self._ended = True

    def restart(self) -> None:
        """A new connection: nothing handed yet."""
        self._handed.clear()
        self._ended = False

    def _sock_recv(self, bufsize: int) -> bytes:
        if self._handed:
            taken = bytes(self._handed[:bufsize])
            del self._handed[:bufsize]
            return taken
        if self._ended:
            return b""
        raise BlockingIOError  # paho's word for "nothing to read now"


def new_client(settings: MqttSettings, client_id: str, will: Will | None) -> FedClient:
    client = FedClient(
        CallbackAPIVersion.VERSION2,
        client_id=client_id,
        protocol=paho.MQTTv5,
        manual_ack=True,
    )
    if settings.username:
        password = settings.password.get_secret_value() if settings.password else None
        client.username_pw_set(settings.username, password)
    if settings.tls_ca_file is not None:
        cert, key = settings.tls_cert_file, settings.tls_key_file
        try:
            client.tls_set(
                ca_certs=str(settings.tls_ca_file),
                certfile=str(cert) if cert is not None else None,
                keyfile=str(key) if key is not None else None,
            )
        except (OSError, ssl.SSLError, ValueError) as exc:
            raise TransportError(
                f"cannot load the TLS files ([mqtt] tls_ca_file {settings.tls_ca_file}, "
                f"tls_cert_file {cert}, tls_key_file {key}): {exc}"
            ) from exc
    if will is not None:
        client.will_set(will.topic, will.payload, qos=will.qos, retain=will.retain)
    return client
