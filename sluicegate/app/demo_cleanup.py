"""What the demo leaves behind on servers it did not start, taken away again.

On a Redis the user named, the demo works in a database that was empty when it began
(:func:`empty_database`) and flushes exactly that one at the end. On a Mosquitto the user
named (open mode only), it clears the retained messages its nodes published (statuses,
capabilities, the policy) and ends its nodes' persistent sessions, so nothing it made
outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable

import redis as redis_sync

from sluicegate import topics
from sluicegate.app.campus import Campus
from sluicegate.app.localcampus import ROLE
from sluicegate.errors import SluicegateError
from sluicegate.mqtt import MqttTransport
from sluicegate.transport import Message

DATABASES = range(1, 16)  # Redis's default 16 databases; 0 is left to the user


def empty_database(port: int, host: str = "127.0.0.1") -> int:
    """The first of databases 1-15 on the Redis at ``port`` that holds no key."""
    for db in DATABASES:
        client = redis_sync.Redis(host=host, port=port, db=db)
        try:
            if client.dbsize() == 0:
                return db
        except redis_sync.RedisError as exc:
            raise SluicegateError(f"cannot use the Redis at {host}:{port}: {exc}") from exc
        finally:
            client.close()
    raise SluicegateError(
        f"the Redis at {host}:{port} has no empty database among 1-15 for the demo to use "
        "and remove afterwards; free one, or leave --redis-port out"
    )


def flush_database(port: int, db: int, host: str = "127.0.0.1") -> None:
    client = redis_sync.Redis(host=host, port=port, db=db)
    with contextlib.suppress(redis_sync.RedisError):
        client.flushdb()
    client.close()


def retained_topics(nodes: Iterable[str], roles: dict[str, str]) -> list[str]:
    """The retained topics the demo's nodes publish."""
    out = [topics.policy()]
    for node in nodes:
        role = roles[node]
        if role == "edge":
            out.append(topics.edge_status(node))
        elif role == "pool":
            out += [topics.worker_status(node), topics.worker_capabilities(node)]
        else:
            out.append(topics.broker_status(node))
    return out


def clear_mqtt(campus: Campus, nodes: Iterable[str]) -> None:
    """Clear the retained messages and persistent sessions the demo's nodes left."""
    names = list(nodes)

    async def clear() -> None:
        settings = campus.mqtt("observer")
        async with MqttTransport(settings, client_id="sg-demo-cleanup") as t:
            for topic in retained_topics(names, ROLE):
                await t.publish(Message(topic, b"", qos=1, retain=True), wait=True)
        for node in names:  # end the persistent sessions of edges and workers
            if ROLE[node] in ("edge", "pool"):
                client_id = f"sg-{ROLE[node]}-{node}"
                session = MqttTransport(settings, client_id=client_id, clean_start=True)
                await session.connect()
                await session.close()

    with contextlib.suppress(SluicegateError, OSError):
        asyncio.run(clear())
