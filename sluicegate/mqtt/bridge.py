"""The bridge between paho-mqtt (MQTT v5) and asyncio: the transport every role uses.

paho runs on the event loop, through its external-loop interface: the loop watches the
socket (:mod:`sluicegate.mqtt.watch`: reads a burst at a time, paho's writes, the broker's
read gap), and a small task calls ``loop_misc`` for keepalive. Reading is
:mod:`sluicegate.mqtt.reader`'s: PUBLISH packets routed here and the rest handed to paho.
paho's callbacks run on the loop thread; a message is converted into our own
:class:`~sluicegate.transport.Message` and handed to its handler at once. A publish made on
the loop outside a read is written at once; one made by a handler right after the read
that ran it. There is no network thread: under load a second thread cost about a third
more CPU per message than the work itself, in GIL hand-offs and wake-ups
(docs/performance.md). Handlers must therefore be quick and must never wait on the
transport themselves; while they run nothing is read, so TCP pushes back on the sender
instead of memory growing.

Only the TCP (and TLS) connect, which blocks, runs on a worker thread; the transport
connects, and reconnects whenever the connection is lost, with exponential backoff between
failed attempts. It re-subscribes after every reconnect, sets ``TCP_NODELAY`` (Nagle would
add ~40 ms a hop) and can register a Last Will. Broker acks are matched to waiting callers.

Acknowledgements are ours, not paho's (``Client(manual_ack=True)``): a message of an
ordinary subscription is acked as it is handed over, as paho itself would; one matching a
``manual_ack`` subscription carries an ack handle and is acked only when its handler calls
:meth:`MqttTransport.ack`. Which subscriptions a message goes to, which messages are parked
for a subscription still to come and which acks are stale is kept by
:class:`~sluicegate.mqtt.routing.Subscriptions`; this module owns paho, its callbacks and its
socket. The CONNECT's Receive Maximum (``max_pending``) keeps the broker from sending more
unacked messages than that, parked ones included.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Sized
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from sluicegate.config import MqttSettings
from sluicegate.errors import PublishRefused, TransportError
from sluicegate.mqtt.client import new_client
from sluicegate.mqtt.framing import Publish
from sluicegate.mqtt.packets import from_paho, new_properties, publish_properties
from sluicegate.mqtt.reader import SocketReader
from sluicegate.mqtt.routing import AckTable, Subscription, Subscriptions
from sluicegate.mqtt.watch import SocketWatch
from sluicegate.transport import Handler, Message, Will

__all__ = ["MqttTransport"]

log = logging.getLogger(__name__)

_OK = (MQTTErrorCode.MQTT_ERR_SUCCESS, MQTTErrorCode.MQTT_ERR_NO_CONN)
MISC_INTERVAL_S = 1.0  # how often paho's keepalive bookkeeping runs
CLOSE_TIMEOUT_S = 2.0  # how long close() waits for its DISCONNECT to go out


class MqttTransport:
    """An asyncio MQTT v5 client: paho driven by the event loop."""

    def __init__(
        self,
        settings: MqttSettings,
        *,
        client_id: str,
        will: Will | None = None,
        clean_start: bool = True,
        session_expiry_s: int = 0,
        max_pending: int = 1024,
        read_gap_s: float = 0.0,
    ) -> None:
        self._settings = settings
        self._client_id = client_id
        self._clean_start = clean_start
        self._session_expiry_s = session_expiry_s
        self._max_pending = max_pending
        self._routing: Subscriptions[Publish] = Subscriptions(max_pending, self._convert)
        self._connect_hooks: list[Callable[[], None]] = []
        self._disconnect_hooks: list[Callable[[], None]] = []
        self._acks = AckTable()
        self._sub_acks = AckTable()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._connected = asyncio.Event()
        self._lost = asyncio.Event()  # the current connection (or attempt) is over
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._last_error: str | None = None
        self._connacks = 0  # connections that got as far as a CONNACK
        self._client = new_client(settings, client_id, will)
        # After a read that drained the socket, the loop stops watching it ``read_gap_s``.
        reader = SocketReader(self._client, self._routing.deliver, settings.host)
        self._socket = SocketWatch(self._client, reader, read_gap_s)
        self._client.on_connect = self._on_connect
        self._client.on_disconnect = self._on_disconnect
        self._client.on_publish = self._on_publish
        self._client.on_subscribe = self._on_subscribe
        self._client.on_message = self._on_message
        self._client.on_socket_open = self._on_socket_open
        self._client.on_socket_close = self._on_socket_close
        self._client.on_socket_register_write = self._on_register_write
        self._client.on_socket_unregister_write = self._on_unregister_write

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def client_id(self) -> str:
        return self._client_id

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def stale_acks(self) -> int:
        """Acks dropped because their connection was lost."""
        return self._routing.stale_acks

    @property
    def _parked(self) -> Sized:
        """The messages parked for a subscription still to come (the tests watch them)."""
        return self._routing.parked

    async def connect(self, timeout: float | None = 10.0) -> None:
        """Start connecting (and reconnecting) and wait for the first CONNACK.

        With ``timeout=None`` it waits for as long as the broker takes to appear, retrying
        with backoff; otherwise a broker that does not answer in time is a TransportError.
        """
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        props = new_properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = self._session_expiry_s
        # MQTT v5 flow control: the broker keeps at most this many QoS >= 1 messages unacked
        # with us, so manual acks bound what waits here, parked messages included.
        props.ReceiveMaximum = min(self._max_pending, 65_535)  # the most MQTT allows
        self._client.connect_async(
            self._settings.host,
            self._settings.port,
            keepalive=self._settings.keepalive_s,
            clean_start=self._clean_start,
            properties=props,
        )
        self._tasks = [
            asyncio.ensure_future(self._keep_connected()),
            asyncio.ensure_future(self._misc()),
        ]
        try:
            await asyncio.wait_for(self._connected.wait(), timeout)
        except TimeoutError:
            await self.close()
            where = f"{self._settings.host}:{self._settings.port}"
            detail = f" ({self._last_error})" if self._last_error else ""
            raise TransportError(
                f"no MQTT broker answered at {where} within {timeout}s{detail}; "
                "check [mqtt] host/port or SLUICEGATE_MQTT__HOST / SLUICEGATE_MQTT__PORT"
            ) from None

    async def close(self) -> None:
        """Send DISCONNECT (no Last Will), stop the connection's tasks and fail pending
        waits."""
        self._closing = True
        if self._socket.fd is not None and self.connected:
            self._lost.clear()
            self._client.disconnect()  # paho closes the socket once the packet is out
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._lost.wait(), CLOSE_TIMEOUT_S)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        sock = self._client.socket()
        self._socket.unwatch()
        if sock is not None:  # a connection that never finished its goodbye
            with contextlib.suppress(OSError):
                sock.close()
        self._connected.clear()
        closed = TransportError("transport closed before the broker acked")
        self._acks.fail_all(closed)
        self._sub_acks.fail_all(closed)

    async def __aenter__(self) -> MqttTransport:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def on_connect(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` on the loop after every successful (re)connect."""
        self._connect_hooks.append(hook)

    def on_disconnect(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` on the loop whenever an established connection is lost."""
        self._disconnect_hooks.append(hook)

    async def _keep_connected(self) -> None:
        """Connect; whenever the connection is lost, connect again, waiting between
        attempts with exponential backoff (from the shortest wait again once connected).

        Even after a connection that was up it waits the shortest delay first: the broker
        may not yet have let go of the old connection of this client id (a session taken
        over mid-delivery would deliver a message again)."""
        where = f"{self._settings.host}:{self._settings.port}"
        delay = float(self._settings.reconnect_min_s)
        while not self._closing:
            self._lost.clear()
            connacks = self._connacks
            try:
                # The TCP (and TLS) connect blocks; paho queues the CONNECT, which goes out
                # once the loop watches the new socket.
                rc = await asyncio.to_thread(self._client.reconnect)
            except (OSError, ValueError) as exc:
                rc, self._last_error = None, f"cannot reach {where}: {exc}"
            if rc == MQTTErrorCode.MQTT_ERR_SUCCESS and not self._closing:
                self._socket.watch(asyncio.get_running_loop())
                await self._lost.wait()
                if self._connacks > connacks:  # it was up: back to the shortest wait
                    delay = float(self._settings.reconnect_min_s)
            elif rc is not None:
                self._last_error = f"connecting to {where} failed: {paho.error_string(rc)}"
            if self._closing:
                return
            log.warning("MQTT broker at %s: connecting again in %.0f s", where, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2.0, float(self._settings.reconnect_max_s))

    async def _misc(self) -> None:
        """paho's periodic work: PINGREQ when idle, and noticing a broker gone silent."""
        while True:
            await asyncio.sleep(MISC_INTERVAL_S)
            if self._socket.fd is not None:
                self._socket.paho(self._client.loop_misc)

    # -- paho's socket callbacks (the watch itself: sluicegate.mqtt.watch) -------------------

    def _on_loop_thread(self) -> bool:
        return threading.get_ident() == self._loop_thread

    def _on_socket_open(self, _client: paho.Client, _userdata: Any, sock: Any) -> None:
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _on_socket_close(self, _client: paho.Client, _userdata: Any, _sock: Any) -> None:
        if self._on_loop_thread():
            self._socket.unwatch()

    def _on_register_write(self, _client: paho.Client, _userdata: Any, _sock: Any) -> None:
        # From the connecting thread (the CONNECT), watch() adds the writer afterwards.
        if self._on_loop_thread():
            self._socket.want_write(True)

    def _on_unregister_write(self, _client: paho.Client, _userdata: Any, _sock: Any) -> None:
        if self._on_loop_thread():
            self._socket.want_write(False)

    # -- publish / subscribe ----------------------------------------------------------------

    def publish_nowait(self, message: Message) -> int:
        """Hand ``message`` to paho (written at once, from outside paho's callbacks) and
        return its message id; QoS ≥ 1 is retried by paho (also across reconnects) until the
        broker acks it."""
        topic = message.topic
        props = publish_properties(
            message.response_topic,
            message.correlation_data,
            message.content_type,
            message.user_properties,
            message.message_expiry_s,
        )
        try:
            info = self._client.publish(
                topic, message.payload, qos=message.qos, retain=message.retain, properties=props
            )
        except ValueError as exc:  # paho's word for a topic or payload MQTT does not allow
            raise TransportError(f"publish to {topic!r} refused: {exc}") from exc
        if info.rc not in _OK:
            raise TransportError(f"publish to {topic!r} refused: {paho.error_string(info.rc)}")
        self._socket.published(on_loop=self._on_loop_thread())
        return info.mid

    async def publish(self, message: Message, *, wait: bool = False) -> None:
        """Publish ``message``; with ``wait`` and QoS ≥ 1, return only once the broker has
        acked."""
        mid = self.publish_nowait(message)
        if wait and message.qos > 0:
            await self._await_ack(self._acks, mid)

    async def subscribe(
        self, topic_filter: str, handler: Handler, *, qos: int = 1, manual_ack: bool = False
    ) -> None:
        """Call ``handler(message)`` on the loop for each message matching ``topic_filter``.

        With ``manual_ack`` the handler must :meth:`ack` each QoS ≥ 1 message; until it
        does, the broker holds the message for this session and redelivers it after a
        reconnect. When connected, returns once the broker has acknowledged the subscription
        (SUBACK); otherwise it is made on the next (re)connect, before any on-connect hook.
        """
        self._routing.add(Subscription(topic_filter, qos, handler, manual_ack))
        if not self.connected:
            return
        result, mid = self._client.subscribe(topic_filter, qos=qos)
        if result != MQTTErrorCode.MQTT_ERR_SUCCESS or mid is None:
            raise TransportError(
                f"subscribe to {topic_filter!r} failed: {paho.error_string(result)}"
            )
        await self._await_ack(self._sub_acks, mid)

    async def unsubscribe(self, topic_filter: str) -> None:
        self._routing.remove(topic_filter)
        if self.connected:
            self._client.unsubscribe(topic_filter)

    def ack(self, message: Message) -> None:
        """PUBACK a message of a ``manual_ack`` subscription.

        A no-op for QoS 0 and for messages acked automatically; dropped (and counted in
        ``stale_acks``) when the connection it arrived on is gone, since the broker then
        redelivers it and the old packet id may already name another message.
        """
        handle = self._routing.due(message.ack_handle)
        if handle is not None:
            self._client.ack(handle.mid, handle.qos)

    async def _await_ack(self, table: AckTable, mid: int) -> None:
        fut = table.expect(mid, asyncio.get_running_loop())
        try:
            await fut
        finally:
            table.forget(mid)

    # -- paho's callbacks (on the loop, inside loop_read / loop_write) -------------------

    def _on_message(self, _client: paho.Client, _userdata: Any, msg: paho.MQTTMessage) -> None:
        self._routing.deliver(from_paho(msg))  # QoS 2: the reader routes QoS 0 and 1

    def _convert(self, msg: Publish, subs: list[Subscription], generation: int) -> Message:
        """Our message, with an ack handle when a manual-ack subscription wants it; acked
        here otherwise."""
        handle = self._routing.handle(msg, subs, generation)
        if handle is None and msg.qos > 0 and generation == self._routing.generation:
            self._client.ack(msg.mid, msg.qos)
        return msg.message(handle)

    def _on_connect(
        self,
        client: paho.Client,
        _userdata: Any,
        _flags: Any,
        reason_code: ReasonCode,
        _properties: Properties | None,
    ) -> None:
        if reason_code.is_failure:
            self._last_error = f"broker refused the connection: {reason_code}"
            log.warning("MQTT connect refused by %s: %s", self._settings.host, reason_code)
            return
        self._connacks += 1
        self._routing.new_generation()
        renewal = self._routing.renewal()
        if renewal:
            client.subscribe(renewal)
        self._set_connected(True)

    def _on_disconnect(
        self,
        _client: paho.Client,
        _userdata: Any,
        _flags: Any,
        reason_code: ReasonCode,
        _properties: Properties | None,
    ) -> None:
        self._routing.new_generation()
        if not self._closing:
            self._last_error = f"disconnected: {reason_code}"
            log.warning("MQTT connection lost (%s); reconnecting", reason_code)
        if self._on_loop_thread():
            self._lost_connection()
        elif self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._lost_connection)

    def _lost_connection(self) -> None:
        self._socket.unwatch()
        self._lost.set()
        self._set_connected(False)

    def _on_subscribe(
        self,
        _client: paho.Client,
        _userdata: Any,
        mid: int,
        reason_codes: list[ReasonCode],
        _properties: Properties | None,
    ) -> None:
        refused = [str(rc) for rc in reason_codes if rc.is_failure]
        error = None
        if refused:
            error = TransportError(f"broker refused the subscription: {', '.join(refused)}")
        self._sub_acks.acked(mid, error)

    def _on_publish(
        self,
        _client: paho.Client,
        _userdata: Any,
        mid: int,
        reason_code: ReasonCode,
        _properties: Properties | None,
    ) -> None:
        error = None
        if reason_code.is_failure:
            error = PublishRefused(
                f"broker refused publish (mid {mid}): {reason_code}", str(reason_code)
            )
        self._acks.acked(mid, error)

    def _set_connected(self, up: bool) -> None:
        was_up = self._connected.is_set()
        if up:
            self._connected.set()
        else:
            self._connected.clear()
            # A lost SUBACK never comes; the subscription is renewed on reconnect anyway.
            self._sub_acks.fail_all(None)
        if up or was_up:
            for hook in self._connect_hooks if up else self._disconnect_hooks:
                try:
                    hook()
                except Exception:  # each hook fails alone
                    log.exception("connection hook failed")
