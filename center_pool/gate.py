"""The gate every work message passes before its image is looked at: token, then replay,
then (a sealed image) its opening.

For a chunk of messages taken off the transport, :class:`Gate` runs the pure steps of
:mod:`center_pool.intake` (properties, then ``policies.verify`` against the current verified
policy) and the replay check against the shared cache (Redis ``SET NX``, or memory), the
claims of one chunk in one round trip. A cache that cannot answer fails closed. It returns
one verdict per message, in arrival order, and says which refusals belong in the audit log:
every one made before the token passed, and every sealed image that did not open. A sealed
image is opened (``intake.open_work``) only once its nonce is claimed, so a replayed message
costs no decryption and a token tried on another ciphertext is spent. It never decodes,
publishes or writes the log itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from center_pool.intake import (
    POLICY_MISSING,
    Work,
    WorkRefusal,
    check_token,
    open_work,
    read_work,
    refuse,
)
from policies import PlacementClaims, Policy, acheck_replays
from policies.audit import Scalar
from policies.errors import StoreUnavailable
from policies.replay import AsyncReplayCache
from policies.sealing import SealingKey
from sluicegate import topics
from sluicegate.policy_feed import PolicyFeed
from sluicegate.transport import Message
from sluicegate.vision.image import PayloadLimits as Limits

REPLAY_UNAVAILABLE = "token.replay_unavailable"
SHUTTING_DOWN = "shutting_down"
REPLAY_CHUNK = 64  # replay claims in one round trip


@dataclass(frozen=True, slots=True)
class Passed:
    """Token and replay check passed: this worker was placed to run ``work``."""

    work: Work
    claims: PlacementClaims


@dataclass(frozen=True, slots=True)
class Stopped:
    """Refused at the gate; ``audit`` is False only for refusals that judge no token."""

    refusal: WorkRefusal
    work: Work | None
    audit: bool


def audit_data(stopped: Stopped, worker_id: str) -> Mapping[str, Scalar]:
    """The audit record of a gate refusal: reason code, words, and who sent what."""
    work = stopped.work
    props = work.props if work is not None else {}
    return {
        "reason": stopped.refusal.code,
        "message": stopped.refusal.reason[:1000],
        "worker": worker_id,
        "job_id": stopped.refusal.job_id[:128],
        "edge_id": props.get(topics.PROP_EDGE, "")[:128] or stopped.refusal.edge_id,
        "attempt": stopped.refusal.attempt,
        "origin_zone": props.get(topics.PROP_ORIGIN_ZONE),
        "data_class": props.get(topics.PROP_DATA_CLASS),
        "payload_bytes": len(work.payload) if work is not None else None,
    }


class Gate:
    """Checks placement tokens and their nonces for one worker."""

    def __init__(
        self,
        worker_id: str,
        feed: PolicyFeed,
        replay: AsyncReplayCache,
        limits: Limits,
        clock: Callable[[], float],
        keys: Callable[[], Mapping[bytes, SealingKey]] = dict,
    ) -> None:
        """``keys``: the sealing keys this worker holds now, by key id."""
        self.worker_id = worker_id
        self._keys = keys
        self._feed = feed
        self._replay = replay
        self._limits = limits
        self._clock = clock

    async def screen(
        self, chunk: list[tuple[Message, float]], *, accepting: bool
    ) -> list[Passed | Stopped]:
        """One verdict per ``(message, received_at)``, in the order given."""
        policy = self._feed.current
        now = self._clock()
        keys = self._keys()
        verdicts: list[Passed | Stopped] = []
        for msg, received in chunk:
            work = read_work(msg, limits=self._limits, now=received, worker_id=self.worker_id)
            if isinstance(work, WorkRefusal):
                verdicts.append(Stopped(work, None, audit=True))
            elif not accepting:
                reason = f"worker {self.worker_id} is shutting down; ask for a new placement"
                verdicts.append(Stopped(refuse(work, SHUTTING_DOWN, reason), work, audit=False))
            elif policy is None:
                refusal = refuse(work, POLICY_MISSING, self._feed.why_none())
                verdicts.append(Stopped(refusal, work, audit=True))
            else:
                claims = check_token(work, policy, now=now, worker_id=self.worker_id, keys=keys)
                if isinstance(claims, WorkRefusal):
                    verdicts.append(Stopped(claims, work, audit=True))
                else:
                    verdicts.append(Passed(work, claims))
        if policy is not None:
            await self._check_replays(verdicts, policy, now)
        for index, verdict in enumerate(verdicts):
            if isinstance(verdict, Passed) and verdict.work.sealed:
                opened = open_work(verdict.work, verdict.claims, keys, worker_id=self.worker_id)
                if isinstance(opened, WorkRefusal):
                    verdicts[index] = Stopped(opened, verdict.work, audit=True)
                else:
                    verdicts[index] = Passed(opened, verdict.claims)
        return verdicts

    async def _check_replays(
        self, verdicts: list[Passed | Stopped], policy: Policy, now: float
    ) -> None:
        """Claim the nonces of the tokens that passed, a chunk a round trip."""
        pending = [(i, v) for i, v in enumerate(verdicts) if isinstance(v, Passed)]
        for start in range(0, len(pending), REPLAY_CHUNK):
            part = pending[start : start + REPLAY_CHUNK]
            found = await self._claim(policy, [verdict for _i, verdict in part], now)
            for (index, verdict), refusal in zip(part, found, strict=True):
                if refusal is not None:
                    verdicts[index] = Stopped(refusal, verdict.work, audit=True)

    async def _claim(
        self, policy: Policy, passed: list[Passed], now: float
    ) -> list[WorkRefusal | None]:
        tokens = [verdict.claims for verdict in passed]
        try:
            found = await acheck_replays(self._replay, tokens, policy, now=now)
        except StoreUnavailable as exc:  # the cache is down: fail closed, never run unchecked
            reason = (
                f"worker {self.worker_id} cannot check the token for replay "
                f"({type(exc).__name__}: {exc}); refusing rather than risk a replay"
            )
            return [refuse(v.work, REPLAY_UNAVAILABLE, reason) for v in passed]
        return [
            None
            if replayed is None
            else refuse(
                v.work,
                replayed.reason,
                f"placement token refused by worker {self.worker_id}: {replayed}",
            )
            for v, replayed in zip(passed, found, strict=True)
        ]
