"""MQTT v5 for Sluicegate: the only package that imports paho-mqtt.

:mod:`~sluicegate.mqtt.bridge` drives paho from the event loop (the transport every role
uses); :mod:`~sluicegate.mqtt.packets` fits paho's packets to our own types;
:mod:`~sluicegate.mqtt.wire` (PUBLISH property bytes) and :mod:`~sluicegate.mqtt.routing`
(subscriptions, acks) are plain code that paho never sees.
"""

from sluicegate.mqtt.bridge import MqttTransport
from sluicegate.mqtt.packets import to_message
from sluicegate.transport import Message, Will

__all__ = ["Message", "MqttTransport", "Will", "to_message"]
