"""The one bridge between paho-mqtt (MQTT v5) and asyncio; no other module imports paho.

paho runs its network loop on its own thread. Its callbacks only convert what arrived into
our own :class:`~sluicegate.transport.Message` and hand it to the event loop with
``loop.call_soon_threadsafe`` — coalesced, so a burst costs one wake-up of the loop, not
one per message. Broker acks are matched to waiting callers in an ack table; an ack nobody
waits for never wakes the loop. The transport reconnects with exponential backoff,
re-subscribes after every reconnect, sets ``TCP_NODELAY`` (Nagle would add ~40 ms a hop)
and can register a Last Will.

Hand-off is bounded: when handlers fall ``max_pending`` messages or ``max_pending_bytes``
of payload behind (:class:`~sluicegate.handoff.Budget`), paho's thread waits, so TCP pushes
back on the sender instead of memory growing. Handlers must therefore
be quick and must never wait on the transport themselves.

Acknowledgements are ours, not paho's (``Client(manual_ack=True)``): a message of an
ordinary subscription is acked on paho's thread as it is handed over, as paho itself would;
one matching a ``manual_ack`` subscription carries an ack handle and is acked only when its
handler calls :meth:`MqttTransport.ack`. ``client.ack`` only appends a packet to paho's
outgoing deque (as ``publish`` does from the loop), so it is safe from the loop thread. A
handle remembers the connection it arrived on: an ack after that connection was lost is
dropped, since the broker redelivers the message on the new connection under a packet id
that may by then name another message. A QoS ≥ 1 message that no subscription of this
process claims yet (a persistent session delivers queued messages right after CONNACK,
before the role has subscribed again) is parked unacked and handed to the first matching
subscription made on the same connection. The CONNECT's Receive Maximum (``max_pending``)
keeps the broker from sending more unacked messages than that, parked ones included.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from sluicegate.config import MqttSettings
from sluicegate.errors import TransportError
from sluicegate.handoff import Budget
from sluicegate.mqtt_wire import pack_publish_properties
from sluicegate.topics import matches
from sluicegate.transport import Handler, Message, UserProperties, Will

__all__ = ["Message", "MqttTransport", "Will", "to_message"]

log = logging.getLogger(__name__)

_OK = (MQTTErrorCode.MQTT_ERR_SUCCESS, MQTTErrorCode.MQTT_ERR_NO_CONN)


def _new_properties(packet_type: int) -> Properties:
    return Properties(packet_type)  # type: ignore[no-untyped-call]


class _PublishProperties(Properties):
    """PUBLISH properties already packed (:mod:`sluicegate.mqtt_wire`).

    paho's :class:`Properties` rebuilds its name tables for every instance and scans all
    27 property names on every ``pack()``: about 60 µs a message on the broker's hot path,
    paid again on paho's thread. paho only ever calls ``pack()`` on a PUBLISH's
    properties, so this subclass keeps the packed bytes and skips the generic machinery.
    """

    def __init__(self, packed: bytes) -> None:  # no super().__init__: that is the cost
        object.__setattr__(self, "packetType", PacketTypes.PUBLISH)
        object.__setattr__(self, "_packed", packed)

    def pack(self) -> bytes:
        packed: bytes = object.__getattribute__(self, "_packed")
        return packed


def _properties(
    response_topic: str | None,
    correlation_data: bytes | None,
    content_type: str | None,
    user_properties: UserProperties,
    message_expiry_s: int | None = None,
) -> Properties | None:
    packed = pack_publish_properties(
        response_topic, correlation_data, content_type, user_properties, message_expiry_s
    )
    return None if packed is None else _PublishProperties(packed)


@dataclass(frozen=True, slots=True)
class _AckHandle:
    """What :meth:`MqttTransport.ack` needs: the packet id on the connection it came on."""

    owner: object
    generation: int
    mid: int
    qos: int


def to_message(msg: paho.MQTTMessage, ack_handle: object = None) -> Message:
    """Convert a paho message into our own :class:`Message` (called on paho's thread)."""
    props = msg.properties
    response_topic = correlation = content_type = expiry = None
    user: UserProperties = ()
    if props is not None:
        response_topic = getattr(props, "ResponseTopic", None)
        correlation = getattr(props, "CorrelationData", None)
        content_type = getattr(props, "ContentType", None)
        expiry = getattr(props, "MessageExpiryInterval", None)
        user = tuple((str(k), str(v)) for k, v in getattr(props, "UserProperty", ()))
    return Message(
        topic=msg.topic,
        payload=bytes(msg.payload),
        qos=msg.qos,
        retain=bool(msg.retain),
        response_topic=response_topic,
        correlation_data=bytes(correlation) if correlation is not None else None,
        content_type=content_type,
        user_properties=user,
        message_expiry_s=expiry,
        ack_handle=ack_handle,
        dup=bool(msg.dup),
    )


def _matching(topic_filter: str) -> str:
    """The filter messages arrive under: a shared subscription ``$share/group/f`` delivers
    messages whose topics match ``f``."""
    if topic_filter.startswith("$share/"):
        return topic_filter.split("/", 2)[2]
    return topic_filter


@dataclass(frozen=True)
class _Subscription:
    topic_filter: str
    qos: int
    handler: Handler
    manual_ack: bool = False
    pattern: str = field(init=False)  # what arriving topics match: the filter sans $share

    def __post_init__(self) -> None:
        object.__setattr__(self, "pattern", _matching(self.topic_filter))

    def matches(self, topic: str) -> bool:
        return matches(self.pattern, topic)


class _AckTable:
    """Matches broker acks (paho's thread) to futures awaited on the loop.

    paho reports an ack while holding its own outgoing-message lock, so this table's lock
    is only ever taken inside paho's, never around a call into paho: no lock-order cycle.
    An ack that beats its waiter's registration is remembered briefly in ``early``
    (bounded; message ids recycle only after 65,535 publishes).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[int, asyncio.Future[None]] = {}
        self._early: OrderedDict[int, Exception | None] = OrderedDict()

    def expect(self, mid: int, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """A future for the ack of ``mid`` (loop thread, right after the packet was queued)."""
        fut: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if mid in self._early:
                _settle(fut, self._early.pop(mid))
            else:
                self._waiting[mid] = fut
        return fut

    def forget(self, mid: int) -> None:
        with self._lock:
            self._waiting.pop(mid, None)

    def acked(self, mid: int, error: Exception | None) -> asyncio.Future[None] | None:
        """Record an ack (paho's thread); returns the future to settle on the loop, if any."""
        with self._lock:
            fut = self._waiting.pop(mid, None)
            if fut is None:
                self._early[mid] = error
                if len(self._early) > 1024:
                    self._early.popitem(last=False)
            return fut

    def fail_all(self, error: Exception | None) -> None:
        """Settle every waiter (loop thread): on close, or a SUBACK lost with its connection."""
        with self._lock:
            waiting = list(self._waiting.values())
            self._waiting.clear()
        for fut in waiting:
            _settle(fut, error)


def _settle(fut: asyncio.Future[None], error: Exception | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


class MqttTransport:
    """An asyncio MQTT v5 client over paho's threaded network loop."""

    def __init__(
        self,
        settings: MqttSettings,
        *,
        client_id: str,
        will: Will | None = None,
        clean_start: bool = True,
        session_expiry_s: int = 0,
        max_pending: int = 1024,
        max_pending_bytes: int = 64 * 2**20,
    ) -> None:
        self._settings = settings
        self._client_id = client_id
        self._clean_start = clean_start
        self._session_expiry_s = session_expiry_s
        # Replaced, never mutated, so paho's thread can read it without a lock.
        self._subs: dict[str, _Subscription] = {}
        self._connect_hooks: list[Callable[[], None]] = []
        self._disconnect_hooks: list[Callable[[], None]] = []
        self._acks = _AckTable()
        self._sub_acks = _AckTable()
        self._budget = Budget(max_pending, max_pending_bytes)
        self._inbox: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()
        self._inbox_lock = threading.Lock()
        self._drain_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connected = asyncio.Event()
        self._closing = False
        self._last_error: str | None = None
        # Connection generation: bumped on paho's thread at every connect and disconnect,
        # under _ack_lock, which an ack holds while it checks and queues its PUBACK.
        self._ack_lock = threading.Lock()
        self._generation = 0
        self._max_parked = max_pending
        self._parked: deque[tuple[paho.MQTTMessage, int]] = deque()  # (message, generation)
        self._park_lock = threading.Lock()
        self.stale_acks = 0  # acks dropped because their connection was lost
        self._client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=paho.MQTTv5,
            reconnect_on_failure=True,
            manual_ack=True,
        )
        self._client.reconnect_delay_set(settings.reconnect_min_s, settings.reconnect_max_s)
        if settings.username:
            password = settings.password.get_secret_value() if settings.password else None
            self._client.username_pw_set(settings.username, password)
        if settings.tls_ca_file is not None:
            self._client.tls_set(ca_certs=str(settings.tls_ca_file))
        if will is not None:
            self._client.will_set(will.topic, will.payload, qos=will.qos, retain=will.retain)
        self._client.on_connect = self._on_connect
        self._client.on_connect_fail = self._on_connect_fail
        self._client.on_disconnect = self._on_disconnect
        self._client.on_publish = self._on_publish
        self._client.on_subscribe = self._on_subscribe
        self._client.on_socket_open = self._on_socket_open
        self._client.on_message = self._on_message

    # -- lifecycle (loop thread) -------------------------------------------------------------

    @property
    def client_id(self) -> str:
        return self._client_id

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    async def connect(self, timeout: float | None = 10.0) -> None:
        """Start the network thread and wait for the first CONNACK.

        With ``timeout=None`` it waits for as long as the broker takes to appear, retrying
        with backoff; otherwise a broker that does not answer in time is a TransportError.
        """
        self._loop = asyncio.get_running_loop()
        props = _new_properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = self._session_expiry_s
        # MQTT v5 flow control: the broker keeps at most this many QoS >= 1 messages unacked
        # with us, so manual acks bound what waits here, parked messages included.
        props.ReceiveMaximum = min(self._max_parked, 65_535)  # the most MQTT allows
        self._client.connect_async(
            self._settings.host,
            self._settings.port,
            keepalive=self._settings.keepalive_s,
            clean_start=self._clean_start,
            properties=props,
        )
        self._client.loop_start()
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
        """Send DISCONNECT (no Last Will), stop the network thread and fail pending waits."""
        self._closing = True
        self._client.disconnect()
        await asyncio.to_thread(self._client.loop_stop)
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

    # -- publish / subscribe (loop thread) -----------------------------------------------------

    def publish_nowait(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 0,
        retain: bool = False,
        response_topic: str | None = None,
        correlation_data: bytes | None = None,
        content_type: str | None = None,
        user_properties: UserProperties = (),
        message_expiry_s: int | None = None,
    ) -> int:
        """Queue a message in paho now and return its message id; QoS ≥ 1 is retried by
        paho (also across reconnects) until the broker acks it."""
        props = _properties(
            response_topic, correlation_data, content_type, user_properties, message_expiry_s
        )
        info = self._client.publish(topic, payload, qos=qos, retain=retain, properties=props)
        if info.rc not in _OK:
            raise TransportError(f"publish to {topic!r} refused: {paho.error_string(info.rc)}")
        return info.mid

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 0,
        retain: bool = False,
        response_topic: str | None = None,
        correlation_data: bytes | None = None,
        content_type: str | None = None,
        user_properties: UserProperties = (),
        wait: bool = False,
        message_expiry_s: int | None = None,
    ) -> None:
        """Publish; with ``wait`` and QoS ≥ 1, return only once the broker has acked."""
        mid = self.publish_nowait(
            topic,
            payload,
            qos=qos,
            retain=retain,
            response_topic=response_topic,
            correlation_data=correlation_data,
            content_type=content_type,
            user_properties=user_properties,
            message_expiry_s=message_expiry_s,
        )
        if wait and qos > 0:
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
        sub = _Subscription(topic_filter, qos, handler, manual_ack)
        with self._park_lock:
            self._subs = {**self._subs, topic_filter: sub}
            claimed = [p for p in self._parked if sub.matches(p[0].topic)]
            for parked in claimed:
                self._parked.remove(parked)
        loop = asyncio.get_running_loop()
        for msg, generation in claimed:
            loop.call_soon(self._call, sub.handler, self._convert(msg, [sub], generation))
        if not self.connected:
            return
        result, mid = self._client.subscribe(topic_filter, qos=qos)
        if result != MQTTErrorCode.MQTT_ERR_SUCCESS or mid is None:
            raise TransportError(
                f"subscribe to {topic_filter!r} failed: {paho.error_string(result)}"
            )
        await self._await_ack(self._sub_acks, mid)

    async def unsubscribe(self, topic_filter: str) -> None:
        with self._park_lock:
            self._subs = {f: s for f, s in self._subs.items() if f != topic_filter}
        if self.connected:
            self._client.unsubscribe(topic_filter)

    def ack(self, message: Message) -> None:
        """PUBACK a message of a ``manual_ack`` subscription (loop thread).

        A no-op for QoS 0 and for messages acked automatically; dropped (and counted in
        ``stale_acks``) when the connection it arrived on is gone, since the broker then
        redelivers it and the old packet id may already name another message.
        """
        handle = message.ack_handle
        if not isinstance(handle, _AckHandle) or handle.owner is not self or handle.qos == 0:
            return
        with self._ack_lock:
            if handle.generation != self._generation:
                self.stale_acks += 1
                return
            self._client.ack(handle.mid, handle.qos)

    async def _await_ack(self, table: _AckTable, mid: int) -> None:
        fut = table.expect(mid, asyncio.get_running_loop())
        try:
            await fut
        finally:
            table.forget(mid)

    # -- paho's thread ---------------------------------------------------------------------------

    def _hand_off(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop; one loop wake-up drains a whole burst."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with self._inbox_lock:
            self._inbox.append((fn, args))
            if self._drain_scheduled:
                return
            self._drain_scheduled = True
        with contextlib.suppress(RuntimeError):  # the loop closed under us: nothing to run
            loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        while True:
            with self._inbox_lock:
                if not self._inbox:
                    self._drain_scheduled = False
                    return
                batch = list(self._inbox)
                self._inbox.clear()
            for fn, args in batch:
                fn(*args)

    def _on_message(self, _client: paho.Client, _userdata: Any, msg: paho.MQTTMessage) -> None:
        with self._park_lock:
            subs = [s for s in self._subs.values() if s.matches(msg.topic)]
            if not subs:
                self._park(msg)
                return
        message = self._convert(msg, subs, self._generation)
        size = len(message.payload)
        for sub in subs:
            if not self._budget.take(size, give_up=self._is_closing):
                return
            self._hand_off(self._deliver, sub.handler, message)

    def _is_closing(self) -> bool:
        return self._closing

    def _park(self, msg: paho.MQTTMessage) -> None:
        """Keep an unclaimed QoS ≥ 1 message, unacked, for a subscription still to come
        (paho's thread, holding _park_lock)."""
        if msg.qos == 0:
            return
        self._parked.append((msg, self._generation))
        if len(self._parked) > self._max_parked:
            dropped, _ = self._parked.popleft()
            log.warning(
                "no subscription claimed a message on %s; left unacked for the broker to "
                "redeliver after a reconnect",
                dropped.topic,
            )

    def _convert(
        self, msg: paho.MQTTMessage, subs: list[_Subscription], generation: int
    ) -> Message:
        """Our message, with an ack handle when a manual-ack subscription wants it; acked
        here otherwise (any thread: ``client.ack`` only queues a packet)."""
        handle = None
        if msg.qos > 0:
            if any(s.manual_ack for s in subs):
                handle = _AckHandle(self, generation, msg.mid, msg.qos)
            else:
                with self._ack_lock:
                    if generation == self._generation:
                        self._client.ack(msg.mid, msg.qos)
        return to_message(msg, handle)

    def _deliver(self, handler: Handler, message: Message) -> None:
        try:
            self._call(handler, message)
        finally:
            self._budget.give_back(len(message.payload))

    def _call(self, handler: Handler, message: Message) -> None:
        try:
            handler(message)
        except Exception:
            log.exception("handler for %s failed; the transport keeps serving", message.topic)

    def _on_socket_open(self, _client: paho.Client, _userdata: Any, sock: Any) -> None:
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

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
        self._new_generation()
        subs = list(self._subs.values())
        if subs:
            client.subscribe([(s.topic_filter, s.qos) for s in subs])
        self._hand_off(self._set_connected, True)

    def _on_connect_fail(self, _client: paho.Client, _userdata: Any) -> None:
        where = f"{self._settings.host}:{self._settings.port}"
        self._last_error = f"cannot reach {where}"
        log.warning("cannot reach the MQTT broker at %s; retrying with backoff", where)

    def _on_disconnect(
        self,
        _client: paho.Client,
        _userdata: Any,
        _flags: Any,
        reason_code: ReasonCode,
        _properties: Properties | None,
    ) -> None:
        self._new_generation()
        if not self._closing:
            self._last_error = f"disconnected: {reason_code}"
            log.warning("MQTT connection lost (%s); reconnecting with backoff", reason_code)
        self._hand_off(self._set_connected, False)

    def _new_generation(self) -> None:
        """A connection began or ended (paho's thread): acks of earlier messages are void,
        and parked messages come again from the broker if they are still owed."""
        with self._ack_lock:
            self._generation += 1
        with self._park_lock:
            self._parked.clear()

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
        fut = self._sub_acks.acked(mid, error)
        if fut is not None:
            self._hand_off(_settle, fut, error)

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
            error = TransportError(f"broker refused publish (mid {mid}): {reason_code}")
        fut = self._acks.acked(mid, error)
        if fut is not None:
            self._hand_off(_settle, fut, error)

    # -- back on the loop ------------------------------------------------------------------------

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
                except Exception:
                    log.exception("connection hook failed")
