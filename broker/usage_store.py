"""The broker's usage records in Redis: one atomic insert per record, keyed by (node, seq),
that never overwrites, and the reads an export makes; and, apart, the records sister
campuses sent that concern this campus (kept once each, never over another).

:data:`INSERT` stores a record only when its (node, seq) holds none, indexes it by time and
raises the node's head seq, all in one script, so replicas that each receive every record
store it once whichever comes first; it answers what was held (the digest), or, for a new
record, its neighbours' links and the node's head and count, which the core
(``broker.core.usage``) judges. Every key comes from ``broker.keys``. Decides nothing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from broker import keys
from broker.lua import Commands, Lua, execute
from sluicegate.metering.record import SignedUsage, from_line, to_line
from sluicegate.store import reaching

CONFLICTS_KEPT = 10_000  # per node
PAGE = 2_000
_PREFIX = 128  # digest and prev, hex, before the line

# KEYS: records, by-time, heads. ARGV: node, seq, value, at_ms.
# -> {1, "", before digest | nil, after prev | nil, head seq, records held} for a new record,
#    {0, held digest} for a seq already held.
_INSERT = """
local held = redis.call('HGET', KEYS[1], ARGV[2])
if held then
  return {0, string.sub(held, 1, 64)}
end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1] .. ':' .. ARGV[2])
local seq = tonumber(ARGV[2])
local head = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0')
if seq > head then
  redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
  head = seq
end
local before = false
if seq > 1 then
  local b = redis.call('HGET', KEYS[1], tostring(seq - 1))
  if b then before = string.sub(b, 1, 64) end
end
local after = redis.call('HGET', KEYS[1], tostring(seq + 1))
if after then after = string.sub(after, 65, 128) else after = false end
return {1, '', before, after, head, redis.call('HLEN', KEYS[1])}
"""
INSERT = Lua(_INSERT)

# KEYS: conflicts. ARGV: digest, line, cap. -> 1 kept now, 0 kept before, -1 the cap is reached.
_KEEP = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
if redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then return -1 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""
KEEP = Lua(_KEEP)


@dataclass(frozen=True, slots=True)
class Stored:
    """What the insert found: ``held`` (the digest already held for the seq), or for a new
    record its neighbours (``before``: the digest of seq - 1; ``after``: the prev of seq + 1,
    each when held) and the node's head seq and records held."""

    held: str | None
    before: str | None = None
    after: str | None = None
    head: int = 0
    count: int = 0


def _text(value: object) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _raw(value: object) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


class UsageStore:
    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client

    @reaching("store usage records")
    async def insert_many(self, records: Sequence[tuple[SignedUsage, bytes]]) -> list[Stored]:
        """Each record (countersigned already, with its :meth:`SignedUsage.digest`, which
        screening computed) stored if its (node, seq) is free; one round trip for all."""
        if not records:
            return []

        def build(commands: Commands) -> None:
            for signed, digest in records:
                r = signed.record
                value = digest.hex().encode() + r.prev.encode() + to_line(signed)
                INSERT.queue(
                    commands,
                    (keys.usage_records(r.node), keys.usage_by_time(), keys.usage_heads()),
                    (r.node, r.seq, value, r.at_ms),
                )

        replies = await execute(self._client, (INSERT,), build)
        out = []
        for reply in replies:
            if int(reply[0]) == 0:
                out.append(Stored(held=_text(reply[1])))
            else:
                before, after = _text(reply[2]), _text(reply[3])
                out.append(Stored(None, before, after, int(reply[4]), int(reply[5])))
        return out

    @reaching("keep a conflicting usage record")
    async def keep_conflict(self, signed: SignedUsage) -> bool:
        """Keep ``signed`` aside by its digest (once, whichever replica comes first, at most
        :data:`CONFLICTS_KEPT` per node); whether this call kept it."""
        key = keys.usage_conflicts(signed.record.node)
        args = (signed.digest().hex(), to_line(signed), CONFLICTS_KEPT)
        replies = await execute(self._client, (KEEP,), lambda p: KEEP.queue(p, (key,), args))
        return int(replies[0]) == 1

    @reaching("read usage records")
    async def between(self, from_ms: int, to_ms: int) -> list[SignedUsage]:
        """Every record held whose ``at_ms`` is in ``[from_ms, to_ms]``."""
        wanted: dict[str, list[bytes]] = defaultdict(list)
        offset = 0
        while True:
            page = await self._client.zrangebyscore(
                keys.usage_by_time(), from_ms, to_ms, start=offset, num=PAGE
            )
            for member in page:
                node, _, seq = str(_text(member)).rpartition(":")
                wanted[node].append(seq.encode())
            if len(page) < PAGE:
                break
            offset += PAGE
        out: list[SignedUsage] = []
        for node, seqs in wanted.items():
            for start in range(0, len(seqs), PAGE):
                values = await self._client.hmget(
                    keys.usage_records(node), seqs[start : start + PAGE]
                )
                out += [from_line(_raw(v)[_PREFIX:]) for v in values if v is not None]
        return out

    @reaching("store a sister campus's usage records")
    async def insert_theirs(self, peer: str, records: Sequence[SignedUsage]) -> list[bool]:
        """Each record of ``peer`` kept if its (node, seq) holds none; whether it was new."""
        if not records:
            return []
        pipe = self._client.pipeline(transaction=True)
        for signed in records:
            r = signed.record
            member = f"{r.node}:{r.seq}"
            pipe.hsetnx(keys.usage_peer_records(peer), member, to_line(signed))
            pipe.zadd(keys.usage_peer_by_time(peer), {member: r.at_ms}, nx=True)
        replies = await pipe.execute()
        return [bool(replies[i]) for i in range(0, len(replies), 2)]

    @reaching("read a sister campus's usage records")
    async def theirs_between(self, peer: str, from_ms: int, to_ms: int) -> list[SignedUsage]:
        """Every record of ``peer`` held whose ``at_ms`` is in ``[from_ms, to_ms]``."""
        raw = await self._client.zrangebyscore(keys.usage_peer_by_time(peer), from_ms, to_ms)
        members = [_raw(m) for m in raw]
        out: list[SignedUsage] = []
        for start in range(0, len(members), PAGE):
            values = await self._client.hmget(
                keys.usage_peer_records(peer), members[start : start + PAGE]
            )
            out += [from_line(_raw(v)) for v in values if v is not None]
        return out

    @reaching("read the usage heads")
    async def heads(self) -> dict[str, int]:
        raw = await self._client.hgetall(keys.usage_heads())
        return {(k.decode() if isinstance(k, bytes) else str(k)): int(v) for k, v in raw.items()}
