"""Replay protection for placement tokens: the ``ReplayCache`` protocol and a bounded
in-memory implementation (Redis ones live in ``policies.redis_stores``).

A nonce must be remembered until the token it came from could no longer pass ``verify``
(expiry plus the allowed clock skew). The in-memory cache is bounded by entries; when full it
drops expired nonces first and, if none are expired, refuses the token (fail closed) rather
than forget a nonce that could still be replayed. Pure: no I/O, ``now`` is passed in.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Protocol

from policies.errors import ReplayCacheFull, TokenReplayed
from policies.model import Policy
from policies.tokens import PlacementClaims


class ReplayCache(Protocol):
    def claim(self, nonce: bytes, until: float, now: float) -> bool:
        """Record ``nonce`` until ``until``; True if it was not already recorded."""


class AsyncReplayCache(Protocol):
    async def claim(self, nonce: bytes, until: float, now: float) -> bool:
        """Record ``nonce`` until ``until``; True if it was not already recorded."""

    async def claim_many(self, wanted: Sequence[tuple[bytes, float]], now: float) -> list[bool]:
        """``claim`` each ``(nonce, until)`` in turn, in one round trip where the store
        allows; a result each, in order."""


class MemoryReplayCache:
    """At most ``max_entries`` nonces; expired ones are dropped before any refusal."""

    def __init__(self, max_entries: int = 100_000) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.max_entries = max_entries
        self._until: dict[bytes, float] = {}
        self._heap: list[tuple[float, bytes]] = []

    def __len__(self) -> int:
        return len(self._until)

    def _purge(self, now: float) -> None:
        heap = self._heap
        while heap and heap[0][0] < now:
            until, nonce = heapq.heappop(heap)
            if self._until.get(nonce) == until:
                del self._until[nonce]

    def claim(self, nonce: bytes, until: float, now: float) -> bool:
        if nonce in self._until and self._until[nonce] >= now:
            return False
        if len(self._until) >= self.max_entries:
            self._purge(now)
            if len(self._until) >= self.max_entries:
                raise ReplayCacheFull(
                    f"replay cache holds {len(self._until)} unexpired nonces (max_entries "
                    f"{self.max_entries}); refusing rather than forgetting one. Size it at "
                    "least tokens/s x (max token lifetime + skew)"
                )
        self._until[nonce] = until
        heapq.heappush(self._heap, (until, nonce))
        return True


def replay_until(claims: PlacementClaims, policy: Policy) -> float:
    """Until when a token's nonce must be remembered (seconds since the epoch)."""
    return (claims.expires_at_ms + policy.max_skew_s * 1000) / 1000


def _replayed(claims: PlacementClaims) -> TokenReplayed:
    return TokenReplayed(
        f"nonce {claims.nonce.hex()} of job {claims.job_id!r} was already used; "
        "accepted: a token whose nonce this verifier has not seen"
    )


def check_replay(
    cache: ReplayCache, claims: PlacementClaims, policy: Policy, *, now: float
) -> None:
    """Raise ``TokenReplayed`` if the token was seen before; else remember it."""
    if not cache.claim(claims.nonce, replay_until(claims, policy), now):
        raise _replayed(claims)


async def acheck_replay(
    cache: AsyncReplayCache, claims: PlacementClaims, policy: Policy, *, now: float
) -> None:
    """``check_replay`` for asyncio callers (e.g. the worker with ``AsyncRedisReplayCache``)."""
    if not await cache.claim(claims.nonce, replay_until(claims, policy), now):
        raise _replayed(claims)


async def acheck_replays(
    cache: AsyncReplayCache, tokens: Sequence[PlacementClaims], policy: Policy, *, now: float
) -> list[TokenReplayed | None]:
    """``acheck_replay`` for several tokens in one claim of the cache: for each, in order,
    the refusal if it was seen before (None: claimed now). A second token with the same
    nonce in ``tokens`` is a replay of the first."""
    wanted = [(claims.nonce, replay_until(claims, policy)) for claims in tokens]
    claimed = await cache.claim_many(wanted, now)
    return [None if ok else _replayed(c) for c, ok in zip(tokens, claimed, strict=True)]
