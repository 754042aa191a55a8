"""The broker's writes to Redis that are not on a decision's critical path, batched.

Job status and explanations, released reservations, node documents and the in-flight
bookkeeping of ``broker.inflight`` (Lua scripts included, with a callback for a reply that
someone needs) are queued as they happen and sent in one pipeline per loop turn by
:meth:`BrokerStore.run`, so a burst of decisions or completions costs one round trip of
bookkeeping. Node documents expire when a node goes silent, so Redis holds exactly the
fleet that is alive; they go a few hundred to a script call. Reading a job back serves the
HTTP API of any replica. Every queued operation must be safe to send twice (see
``broker.lua``). Nothing here decides anything.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio as aioredis

from broker import keys
from broker.lua import Command, Commands, Lua, check_cancelled, execute
from sluicegate.errors import StoreUnavailable
from sluicegate.store import reached, reaching

log = logging.getLogger(__name__)

JOB_TTL_S = 24 * 3600  # how long a job's status and explanation stay queryable
NODES_PER_CALL = 200  # node documents written per script call
# KEYS: node documents; ARGV[1]: their expiry (ms), then a (kind, document) pair per key.
NODE_DOCUMENTS = Lua(
    """
local ttl = ARGV[1]
for i, key in ipairs(KEYS) do
  redis.call('HSET', key, ARGV[2 * i], ARGV[2 * i + 1])
  redis.call('PEXPIRE', key, ttl)
end
return #KEYS
"""
)
# (the command, as Redis takes it; the callback for its reply, if any)
_Op = tuple[Command, Callable[[Any], None] | None]


class BrokerStore:
    def __init__(self, client: aioredis.Redis, node_ttl_ms: int) -> None:
        self._client = client
        self._node_ttl_ms = node_ttl_ms
        self._ops: list[_Op] = []
        self._scripts: dict[str, Lua] = {}
        self._wanted = asyncio.Event()
        self._nodes: dict[tuple[str, str], bytes] = {}  # latest document per node and kind
        self.ok = False  # the last round trip succeeded

    def write(self, *command: Any) -> None:
        """Queue one Redis command (its name, then its arguments) for the next round trip."""
        self._ops.append((command, None))
        self._wanted.set()

    def read(self, then: Callable[[Any], None], *command: Any) -> None:
        """Queue one command whose reply ``then`` gets once the round trip ran (not at all
        if it failed: Redis away)."""
        self._ops.append((command, then))
        self._wanted.set()

    def script(
        self,
        script: Lua,
        keys: Sequence[str],
        args: Sequence[Any],
        then: Callable[[Any], None] | None = None,
    ) -> None:
        """Queue one call of ``script``; ``then`` (if any) gets its reply."""
        self._scripts[script.sha] = script
        self._ops.append((script.call(keys, args), then))
        self._wanted.set()

    def job_status(self, job_id: str, fields: dict[str, Any]) -> None:
        """Set some fields of a job's record (each stored as JSON)."""
        data = [(k, json.dumps(v, default=str)) for k, v in fields.items() if v is not None]
        if data:
            self.write("HSET", keys.job(job_id), *(x for pair in data for x in pair))
        self.write("EXPIRE", keys.job(job_id), JOB_TTL_S)

    def job_decision(self, job_id: str, record_json: str) -> None:
        """Store a decision's whole record, already JSON; the job's status fields overlay
        it when read back."""
        self.write("SET", keys.job_decision(job_id), record_json, "EX", JOB_TTL_S)

    def release(self, worker_id: str, job_id: str) -> None:
        """The job holds no slot on the worker any more, and is not in flight there."""
        self.release_slot(worker_id, job_id)
        self.write("ZREM", keys.inflight_on(worker_id), job_id)

    def release_slot(self, worker_id: str, job_id: str) -> None:
        """The job holds no slot on the worker any more (its in-flight listing is left to
        the completion's fencing)."""
        self.write("ZREM", keys.reservations(worker_id), job_id)

    def node_document(self, node: str, kind: str, payload: bytes) -> None:
        """Remember a node's latest document; flushed (with its expiry) by :meth:`flush_nodes`."""
        self._nodes[(node, kind)] = payload

    def flush_nodes(self) -> None:
        """Queue the node documents kept since the last flush, :data:`NODES_PER_CALL` to a
        script call (one command to pack and one reply to read per call, not two per node;
        and Redis busy with one call for well under a millisecond, so a reservation queued
        behind it hardly waits)."""
        nodes, self._nodes = self._nodes, {}
        batch = list(nodes.items())
        for start in range(0, len(batch), NODES_PER_CALL):
            chunk = batch[start : start + NODES_PER_CALL]
            args: list[Any] = [self._node_ttl_ms]
            for (_node, kind), payload in chunk:
                args += (kind, payload)
            self.script(NODE_DOCUMENTS, [keys.node(node) for (node, _kind), _p in chunk], args)
        self.write("PING")

    @reaching("read a job's decision")
    async def job(self, job_id: str) -> dict[str, Any] | None:
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.get(keys.job_decision(job_id))
            pipe.hgetall(keys.job(job_id))
            raw_decision, raw = await pipe.execute()
        if not raw and raw_decision is None:
            return None
        fields = {_text(k): json.loads(v) for k, v in raw.items()}
        decision = json.loads(raw_decision) if raw_decision is not None else None
        return {**(decision if isinstance(decision, dict) else {}), **fields}

    async def run(self) -> None:
        """Send what is queued, one pipeline at a time, for ever."""
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            ops, self._ops = self._ops, []

            def build(commands: Commands, ops: list[_Op] = ops) -> None:
                commands.items.extend(command for command, _then in ops)

            try:
                with reached(f"write {len(ops)} operations"):
                    replies = await execute(self._client, list(self._scripts.values()), build)
                self.ok = True
            except StoreUnavailable as exc:
                self.ok = False
                log.warning("Redis write of %d operations failed: %s", len(ops), exc)
                check_cancelled()
                continue
            for (_command, then), reply in zip(ops, replies, strict=True):
                if then is not None:
                    try:
                        then(reply)
                    except Exception:  # each caller's reply handler fails alone
                        log.exception("handling a Redis reply failed")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
