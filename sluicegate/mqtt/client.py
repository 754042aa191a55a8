"""What one MQTT v5 connection is made of, as paho needs it before it connects: the client
id, manual acks, the credentials, TLS with the node's own certificate, the Last Will.

:class:`~sluicegate.mqtt.bridge.MqttTransport` drives the client this returns; a bad TLS
file is a TransportError naming the settings, before any connection is tried.
"""

from __future__ import annotations

import ssl

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from sluicegate.config import MqttSettings
from sluicegate.errors import TransportError
from sluicegate.transport import Will


def new_client(settings: MqttSettings, client_id: str, will: Will | None) -> paho.Client:
    client = paho.Client(
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
