"""The Python client for vision apps: submit an image, get a typed result.

``AsyncClient`` is the real implementation: it subscribes once to its own response topic
and matches results to waiting calls by MQTT correlation data (``dict[bytes, Future]``,
each entry removed in ``finally``). Every wait races a timeout and the loss of the
connection. ``Client`` is the blocking face of the same thing, running an event loop on a
background thread. Any MQTT v5 client can submit without this module; it is a convenience.

The edge answers each accepted job exactly once, except that a result it published just
before dying may be published again after its restart. The client remembers the job ids it
has handed to callers (the most recent ``remember`` of them) and drops such a second result,
counting it in ``duplicates``; a result nobody waits for any more (it came after a timeout)
is counted in ``unmatched``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Coroutine
from typing import Any, TypeVar

import numpy as np
from pydantic import ValidationError

from sluicegate import topics, wire
from sluicegate.config import MqttSettings
from sluicegate.errors import RequestTimeout, TransportError, WireError
from sluicegate.identity import certificate_name
from sluicegate.mqtt import Message, MqttTransport
from sluicegate.vision.synth import encode_jpeg

T = TypeVar("T")
Image = bytes | bytearray | memoryview | np.ndarray[Any, Any]


def _sniff_content_type(data: bytes) -> str | None:
    if data[:3] == b"\xff\xd8\xff":
        return "image/jpeg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "image/png"
    return None


def encode_image(image: Image, *, jpeg_quality: int = 90) -> tuple[bytes, str | None]:
    """Bytes to send and their content type; a NumPy (BGR) image is JPEG-encoded."""
    if isinstance(image, np.ndarray):
        return encode_jpeg(image, quality=jpeg_quality), "image/jpeg"
    data = bytes(image)
    return data, _sniff_content_type(data)


class AsyncClient:
    """Submit jobs to one edge agent over MQTT v5 and await their results."""

    def __init__(
        self,
        mqtt: MqttSettings | None = None,
        *,
        edge: str = "edge-1",
        client_id: str | None = None,
        response_topic: str | None = None,
        default_timeout: float = 30.0,
        remember: int = 10_000,
    ) -> None:
        """``mqtt`` with a client certificate connects as the app that certificate names
        (Mosquitto makes its CN the client id); ``response_topic`` is where results come,
        by default ``sluicegate/v1/clients/<client id>/results``, else one under the app's
        own results prefix in the policy."""
        self._mqtt = mqtt or MqttSettings()
        self.edge = topics.check_id("edge id", edge)
        named = certificate_name(self._mqtt)
        self.client_id = named or client_id or f"sg-client-{uuid.uuid4().hex[:12]}"
        self.response_topic = response_topic or topics.client_results(self.client_id)
        self._default_timeout = default_timeout
        self._pending: dict[bytes, asyncio.Future[wire.JobResult]] = {}
        self._announcing: dict[bytes, asyncio.Future[wire.AnnouncementReply]] = {}
        self._transport = MqttTransport(self._mqtt, client_id=self.client_id)
        self._lost = asyncio.Event()
        self.unmatched = 0  # results for no waiting call: late, after a timeout
        self.duplicates = 0  # a second result for a job id already handed to a caller
        self._delivered: OrderedDict[str, None] = OrderedDict()  # job ids, oldest first
        self._remember = remember

    async def connect(self, timeout: float = 10.0) -> None:
        self._transport.on_disconnect(self._lost.set)
        self._transport.on_connect(self._lost.clear)
        await self._transport.connect(timeout)
        await self._transport.subscribe(self.response_topic, self._on_result, qos=1)

    async def close(self) -> None:
        self._lost.set()
        await self._transport.close()

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _on_result(self, msg: Message) -> None:
        key = msg.correlation_data
        if key is not None and key in self._announcing:
            self._on_reply(self._announcing[key], msg)
            return
        fut = self._pending.get(key) if key is not None else None
        try:
            result = wire.JobResult.model_validate_json(msg.payload)
        except ValidationError as exc:
            if fut is not None and not fut.done():
                fut.set_exception(WireError(f"malformed result on {msg.topic}: {exc}"))
            return
        if fut is None or fut.done():
            if result.job_id in self._delivered:
                self.duplicates += 1  # the edge published it again after a restart
            else:
                self.unmatched += 1  # late: the call has already finished
            return
        fut.set_result(result)
        self._delivered[result.job_id] = None
        self._delivered.move_to_end(result.job_id)
        if len(self._delivered) > self._remember:
            self._delivered.popitem(last=False)

    async def infer(
        self,
        image: Image,
        *,
        model: str,
        deadline_ms: float | None = None,
        priority: int | None = None,
        data_class: str | None = None,
        job_id: str | None = None,
        content_type: str | None = None,
        timeout: float | None = None,
    ) -> wire.JobResult:
        """Submit one image and wait for its result (whatever its status)."""
        submitted = repr(round(time.time() * 1000.0, 3))  # its sent-at: the app's clock starts
        payload, sniffed = encode_image(image)
        props: list[tuple[str, str]] = [(topics.PROP_MODEL, model)]
        if deadline_ms is not None:
            props.append((topics.PROP_DEADLINE_MS, repr(float(deadline_ms))))
        if priority is not None:
            props.append((topics.PROP_PRIORITY, str(priority)))
        if data_class is not None:
            props.append((topics.PROP_DATA_CLASS, data_class))
        if job_id is not None:
            props.append((topics.PROP_JOB_ID, job_id))
        correlation = uuid.uuid4().bytes
        props.append((topics.PROP_SENT_AT, submitted))
        fut: asyncio.Future[wire.JobResult] = asyncio.get_running_loop().create_future()
        self._pending[correlation] = fut
        wait_s = timeout if timeout is not None else self._default_timeout
        try:
            await self._transport.publish(
                Message(
                    topics.edge_submit(self.edge),
                    payload,
                    qos=1,
                    response_topic=self.response_topic,
                    correlation_data=correlation,
                    content_type=content_type or sniffed,
                    user_properties=tuple(props),
                )
            )
            return await self._race(fut, wait_s)
        finally:
            self._pending.pop(correlation, None)

    async def announce(
        self,
        announcement_id: str,
        *,
        starts_at: float,
        ends_at: float,
        rate_per_s: float,
        model: str,
        data_class: str = "generic",
        reason: str = "",
        withdraw: bool = False,
        timeout: float | None = None,
    ) -> wire.AnnouncementReply:
        """Tell the edge of work to come (a shift change, a batch start, a faster recipe):
        ``rate_per_s`` images a second in all, for ``model``, from ``starts_at`` to
        ``ends_at`` (unix seconds). The same id again replaces it; ``withdraw`` takes it
        back. Returns the edge's answer: accepted, withdrawn, or refused with a code."""
        doc = wire.Announcement(
            announcement_id=announcement_id,
            starts_at=starts_at,
            ends_at=ends_at,
            rate_per_s=rate_per_s,
            model=model,
            data_class=data_class,
            reason=reason,
            withdraw=withdraw,
        )
        correlation = uuid.uuid4().bytes
        fut: asyncio.Future[wire.AnnouncementReply] = asyncio.get_running_loop().create_future()
        self._announcing[correlation] = fut
        try:
            await self._transport.publish(
                Message(
                    topics.edge_schedule(self.edge),
                    doc.model_dump_json().encode(),
                    qos=1,
                    response_topic=self.response_topic,
                    correlation_data=correlation,
                    content_type="application/json",
                )
            )
            return await self._race(fut, timeout if timeout is not None else self._default_timeout)
        finally:
            self._announcing.pop(correlation, None)

    @staticmethod
    def _on_reply(fut: asyncio.Future[wire.AnnouncementReply], msg: Message) -> None:
        if fut.done():
            return
        try:
            fut.set_result(wire.AnnouncementReply.model_validate_json(msg.payload))
        except ValidationError as exc:
            fut.set_exception(WireError(f"malformed announcement reply on {msg.topic}: {exc}"))

    async def _race(self, fut: asyncio.Future[T], wait_s: float) -> T:
        lost = asyncio.ensure_future(self._lost.wait())
        waiters: set[asyncio.Future[Any]] = {fut, lost}
        try:
            done, _ = await asyncio.wait(
                waiters, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            lost.cancel()
        if fut in done:
            return fut.result()
        fut.cancel()
        if lost in done:
            raise TransportError(
                "connection to the MQTT broker was lost (or the client closed) while waiting "
                "for a result; the job may still run, resubmit with the same job-id to be safe"
            )
        raise RequestTimeout(
            f"no result from edge {self.edge!r} within {wait_s}s; is its agent running?"
        )


class Client:
    """Blocking client: the same calls as :class:`AsyncClient`, on a private event loop."""

    def __init__(
        self,
        mqtt: MqttSettings | None = None,
        *,
        edge: str = "edge-1",
        client_id: str | None = None,
        response_topic: str | None = None,
        default_timeout: float = 30.0,
        connect_timeout: float = 10.0,
        remember: int = 10_000,
    ) -> None:
        """The arguments of :class:`AsyncClient`."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="sluicegate-client", daemon=True
        )
        self._thread.start()
        try:
            make = _make_async(mqtt, edge, client_id, response_topic, default_timeout, remember)
            self._async = self._call(make, None)
            self._call(self._async.connect(connect_timeout), None)
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def announce(self, announcement_id: str, **kwargs: Any) -> wire.AnnouncementReply:
        """:meth:`AsyncClient.announce`, blocking."""
        return self._call(self._async.announce(announcement_id, **kwargs), None)

    def infer(self, image: Image, *, model: str, **kwargs: Any) -> wire.JobResult:
        """Submit one image and block until its result arrives (or the timeout)."""
        return self._call(self._async.infer(image, model=model, **kwargs), None)

    @property
    def duplicates(self) -> int:
        """Second results for job ids already returned, dropped (see AsyncClient)."""
        return self._async.duplicates

    def close(self) -> None:
        if self._loop.is_running():
            with contextlib.suppress(Exception):
                self._call(self._async.close(), 10.0)
        self._stop_loop()

    def _stop_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10.0)
        if not self._loop.is_closed():
            self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _make_async(
    mqtt: MqttSettings | None,
    edge: str,
    client_id: str | None,
    response_topic: str | None,
    timeout: float,
    remember: int,
) -> AsyncClient:
    # The AsyncClient creates asyncio primitives, so it is built on the client's own loop.
    return AsyncClient(
        mqtt,
        edge=edge,
        client_id=client_id,
        response_topic=response_topic,
        default_timeout=timeout,
        remember=remember,
    )
