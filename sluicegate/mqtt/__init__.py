"""MQTT v5 for Sluicegate: the only package that imports paho-mqtt.

:mod:`~sluicegate.mqtt.bridge` drives paho from the event loop (the transport every role
uses); :mod:`~sluicegate.mqtt.reader` reads its socket, takes in PUBLISH packets and hands
paho the rest; :mod:`~sluicegate.mqtt.packets` fits paho's packets to our own types;
:mod:`~sluicegate.mqtt.framing` (packets cut from bytes, PUBLISH decoded),
:mod:`~sluicegate.mqtt.wire` (PUBLISH property bytes) and :mod:`~sluicegate.mqtt.routing`
(subscriptions, acks) are plain code that paho never sees.
"""

from sluicegate.mqtt.bridge import MqttTransport
from sluicegate.mqtt.framing import Publish
from sluicegate.transport import Message, Will

__all__ = ["Message", "MqttTransport", "Publish", "Will"]
