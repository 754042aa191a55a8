"""A bare paho-mqtt relay, the messaging floor for the edge-path benchmark.

It subscribes to one edge agent's submit topic and answers each request at once, from
paho's callback, with a small JSON result on the request's Response Topic and the same
Correlation Data. No validation, no queue, no compute: what MQTT alone costs.

    python bench/relay.py PORT EDGE_ID [TOPIC [QOS [CA CERT KEY]]]

With TOPIC, it answers requests on that topic instead of the edge's submit topic; QOS (1
unless given) is its subscription's and its replies', to mirror what it stands beside.
With CA, CERT and KEY it logs in over TLS with that client certificate (a secured campus).
"""

from __future__ import annotations

import socket
import ssl
import sys
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sluicegate import topics

REPLY = (
    b'{"v":1,"job_id":"relay","status":"ok","model":"defect-v1","outputs":{"label":"ok",'
    b'"scores":{"ok":0.99,"scratch":0.0,"pit":0.0,"stain":0.0},"detections":[]},"ran_on":'
    b'{"kind":"edge","node":"relay","zone":"bench"},"timings_ms":{"queue_ms":0.0,"decode_ms":'
    b'0.0,"preprocess_ms":0.0,"inference_ms":0.0,"total_ms":0.0}}'
)


def main() -> None:
    port, edge_id = int(sys.argv[1]), sys.argv[2]
    request_topic = sys.argv[3] if len(sys.argv) > 3 else topics.edge_submit(edge_id)
    qos = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    client = paho.Client(CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)

    def on_message(c: paho.Client, _u: Any, msg: paho.MQTTMessage) -> None:
        props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        props.CorrelationData = msg.properties.CorrelationData  # type: ignore[union-attr]
        props.ContentType = "application/json"
        c.publish(msg.properties.ResponseTopic, REPLY, qos=qos, properties=props)  # type: ignore[union-attr]

    def on_connect(c: paho.Client, *_a: Any) -> None:
        c.subscribe(request_topic, qos=qos)
        c.publish(topics.edge_status(edge_id), b'{"state":"online"}', qos=1, retain=True)

    client.on_message = on_message
    client.on_connect = on_connect
    client.on_socket_open = lambda _c, _u, s: s.setsockopt(  # type: ignore[attr-defined]
        socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
    )
    if len(sys.argv) > 7:
        context = ssl.create_default_context(cafile=sys.argv[5])
        context.load_cert_chain(sys.argv[6], sys.argv[7])
        client.tls_set_context(context)
    client.connect("127.0.0.1", port)
    client.loop_forever()


if __name__ == "__main__":
    main()
