"""One process per broker replica id, held by a lease in Redis.

A replica takes ``keys.replica_lease(id)`` before it connects to MQTT (SET NX with a short
expiry) and renews it every second, but only while the value is still its own instance
(one Lua script). A second process with the same id finds the lease held: it waits one
expiry for a dead holder's lease to lapse, and refuses to start if the holder is still
renewing it, saying which instance holds it. A holder that froze past the expiry and finds
its lease taken is fenced: it stops serving. One that finds its lease gone, taken by nobody,
takes it again: a Redis failover (Sentinel promotes a replica a few seconds after the last
renewal it saw, and the lease expired there meanwhile) or a Redis restarted empty must not
stop every replica. Redis is the replicas' shared truth already (reservations), so no MQTT
session games are needed here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis.asyncio as aioredis

from broker import keys
from sluicegate.errors import IdentityInUse, StoreUnavailable
from sluicegate.instance import Instance
from sluicegate.store import reached, reaching

log = logging.getLogger(__name__)

TTL_MS = 3000
RENEW_S = 1.0

# KEYS[1] lease; ARGV: instance, ttl ms. 1: renewed (or taken again: nobody held it);
# 0: someone else holds it.
RENEW = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""


class ReplicaLease:
    def __init__(self, redis: aioredis.Redis, broker_id: str, me: Instance) -> None:
        self._redis = redis
        self._key = keys.replica_lease(broker_id)
        self._id = broker_id
        self._value = f"{me.id} {me.host} {me.since:.0f}"
        self.lost = asyncio.Event()
        self.reason = ""

    @reaching("take the replica lease")
    async def acquire(self) -> None:
        """Take the lease, waiting one expiry for a dead holder's; IdentityInUse if a live
        process holds it."""
        holder = None
        for _ in range(2):
            if await self._redis.set(self._key, self._value, nx=True, px=TTL_MS):
                return
            holder = await self._redis.get(self._key)
            if holder is None:
                continue
            await asyncio.sleep(TTL_MS / 1000.0)  # a dead holder's lease lapses meanwhile
        if await self._redis.set(self._key, self._value, nx=True, px=TTL_MS):
            return
        who = holder.decode() if isinstance(holder, bytes) else str(holder)
        raise IdentityInUse(
            f"broker replica {self._id} is already served by another process (instance, "
            f"host, start: {who}); stop it first, or give this replica its own [broker] id"
        )

    async def keep(self) -> None:
        """Renew until cancelled; set ``lost`` if another process took the lease."""
        while True:
            await asyncio.sleep(RENEW_S)
            try:
                with reached("renew the replica lease"):
                    held = await self._redis.eval(RENEW, 1, self._key, self._value, TTL_MS)
            except StoreUnavailable as exc:  # Redis away: placements stop anyway; keep trying
                log.warning("broker %s: cannot renew its replica lease: %s", self._id, exc)
                continue
            if not held:
                self.reason = (
                    f"broker replica {self._id}'s lease was taken by another process while "
                    "this one did not renew it; this process stops serving"
                )
                log.error("fenced: %s", self.reason)
                self.lost.set()
                return

    async def release(self) -> None:
        with contextlib.suppress(StoreUnavailable), reached("release the replica lease"):
            if await self._redis.get(self._key) == self._value.encode():
                await self._redis.delete(self._key)
