"""The node's copy of the signed compliance policy: where it comes from and when it changes.

Edge agents and pool workers hold the policy they last *verified*, never one they were merely
sent. It starts from what this node persisted (the last accepted envelope and its trust
anchor, in ``state_dir``, pinned at enrollment) and an optional bootstrap policy file with
its ``.sig`` beside it, then follows the retained ``sluicegate/v1/policy`` message. Every
candidate goes through ``policies.open_envelope`` against the pinned anchor, so a tampered,
unsigned, expired, older or foreign-signed policy is refused (and counted by reason) while
the node keeps what it holds. Nothing from the network is trusted on first use: a node with
no pinned anchor refuses every policy message and refuses to start
(:meth:`PolicyFeed.require_anchor`).

:func:`consider` is the pure decision; :class:`PolicyFeed` is the shell that reads and
writes the state files (atomically: envelope first, then anchor, so a crash can only leave the
anchor behind the envelope, never ahead of it) and subscribes to the transport. It never
accepts a policy it did not verify and never goes back to an older version.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from policies import Policy, TrustAnchor, load_policy, open_envelope, signed_envelope
from policies.errors import PolicyError, PolicyParseError, PolicyRollback
from policies.loader import read_bytes
from policies.signing import dump_anchor, parse_anchor, parse_signatures
from policies.verdict import read_verdict
from sluicegate import topics
from sluicegate.errors import ConfigError
from sluicegate.files import write_atomic
from sluicegate.transport import Message, Transport

log = logging.getLogger(__name__)

ANCHOR_FILE = "policy-anchor.json"
ENVELOPE_FILE = "policy-envelope.json"
NO_ANCHOR = "policy.no_anchor"


@dataclass(frozen=True, slots=True)
class Accepted:
    """A verified policy and the anchor to persist; ``changed`` is False for the one held."""

    policy: Policy
    anchor: TrustAnchor
    changed: bool


@dataclass(frozen=True, slots=True)
class Refused:
    """Why a candidate policy was not taken: the ``PolicyError.reason`` code and its words."""

    reason: str
    message: str


def consider(
    data: bytes,
    *,
    now: float,
    anchor: TrustAnchor | None,
    held: Policy | None,
    source: str,
    local: bool = False,
) -> Accepted | Refused:
    """Decide whether the ``signed_envelope`` bytes ``data`` may replace ``held``.

    With no ``anchor`` only a ``local`` file (one the operator installed on this node) can
    start the chain of trust; a message from the network is refused.
    """
    if anchor is None and not local:
        return Refused(
            NO_ANCHOR,
            f"{source}: this node has no pinned trust anchor and trusts no policy from the "
            "network on first use; enroll it ('sluicegate edge install --join TOKEN') or "
            "install the signed policy file with its .sig as its bootstrap policy",
        )
    try:
        policy, accepted = open_envelope(data, now=now, anchor=anchor, source=source)
    except PolicyError as exc:
        return Refused(exc.reason, str(exc))
    changed = held is None or held.digest != policy.digest
    return Accepted(policy, accepted, changed)


def bootstrap_envelope(path: Path) -> bytes:
    """The ``signed_envelope`` of a policy file and its detached ``.sig`` beside it, with
    the twin verdict in ``.verdict`` beside it when there is one (a gated rollout)."""
    sig_path = path.with_name(path.name + ".sig")
    verdict_path = path.with_name(path.name + ".verdict")
    try:
        policy = load_policy(path)
        bundle = parse_signatures(read_bytes(sig_path), source=str(sig_path))
        verdict = (
            read_verdict(read_bytes(verdict_path), source=str(verdict_path))
            if verdict_path.exists()
            else None
        )
    except PolicyParseError as exc:
        raise ConfigError(
            f"bootstrap policy {path} cannot be used: {exc}; expected a TOML policy file "
            f"with its signatures in {sig_path.name} (sluicegate policy sign)"
        ) from exc
    return signed_envelope(policy, bundle, verdict)


class PolicyFeed:
    """The current verified policy of one node. ``load()`` once, then ``await start(t)``."""

    def __init__(
        self,
        *,
        node: str,
        policy_file: Path | None = None,
        state_dir: Path | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.node = node
        self._policy_file = policy_file
        self._state_dir = state_dir
        self._clock = clock
        self._policy: Policy | None = None
        self._envelope: bytes | None = None
        self._anchor: TrustAnchor | None = None
        self._callbacks: list[Callable[[Policy], None]] = []
        self.refused: Counter[str] = Counter()
        self.last_refusal: Refused | None = None
        self.file_refusal: Refused | None = None  # the bootstrap file's, when it was refused
        self.accepted = 0

    # -- reading ------------------------------------------------------------------------------

    @property
    def current(self) -> Policy | None:
        """The verified policy, or None if there is none or it has expired since."""
        policy = self._policy
        if policy is None or self._clock() >= policy.expires:
            return None
        return policy

    @property
    def held(self) -> Policy | None:
        """The last accepted policy even if it has expired (for reports, not decisions)."""
        return self._policy

    @property
    def anchor(self) -> TrustAnchor | None:
        return self._anchor

    @property
    def envelope(self) -> bytes | None:
        """The signed envelope of the policy held (what enrollment hands a new node)."""
        return self._envelope

    def why_none(self) -> str:
        """Why ``current`` is None, in words an operator can act on."""
        policy = self._policy
        if policy is not None:
            return (
                f"node {self.node}'s policy v{policy.version} has expired; publish a newer "
                f"signed policy on {topics.policy()}"
            )
        last = f" (last refusal: {self.last_refusal.message})" if self.last_refusal else ""
        return (
            f"node {self.node} holds no verified policy yet: none arrived on {topics.policy()} "
            f"and no bootstrap policy file was accepted{last}"
        )

    def on_change(self, callback: Callable[[Policy], None]) -> None:
        """Call ``callback(policy)`` each time a different verified policy is taken."""
        self._callbacks.append(callback)

    # -- taking candidates --------------------------------------------------------------------

    def offer(self, data: bytes, *, source: str, local: bool = False) -> Accepted | Refused:
        """Consider one signed envelope; keep it if it verifies and is not older.

        ``local`` marks a file the operator installed on this node (the bootstrap policy, the
        persisted state): with no anchor yet, installing it is the out-of-band pin.
        """
        verdict = consider(
            data,
            now=self._clock(),
            anchor=self._anchor,
            held=self._policy,
            source=source,
            local=local,
        )
        if isinstance(verdict, Refused):
            self.refused[verdict.reason] += 1
            self.last_refusal = verdict
            # An older version than the one held (the broker's own retained one, just
            # replaced) is expected and harmless: counted, told at INFO. The rest may be
            # tampering or a wrong signer: a warning.
            level = logging.INFO if verdict.reason == PolicyRollback.reason else logging.WARNING
            log.log(
                level, "%s refused a policy [%s]: %s", self.node, verdict.reason, verdict.message
            )
            return verdict
        if verdict.changed or verdict.anchor != self._anchor:
            self._persist(data, verdict.anchor)
        self._anchor = verdict.anchor
        if not verdict.changed:
            return verdict
        self._policy = verdict.policy
        self._envelope = data
        self.accepted += 1
        policy = verdict.policy
        log.info(
            "%s accepted policy %r v%d from %s", self.node, policy.campus, policy.version, source
        )
        for callback in self._callbacks:
            try:
                callback(policy)
            except Exception:  # each subscriber's callback fails alone
                log.exception("policy change callback failed")
        return verdict

    def load(self) -> None:
        """Read the persisted anchor and envelope, then the bootstrap file (sync, at start)."""
        state = self._state_dir
        if state is not None:
            state.mkdir(parents=True, exist_ok=True)
            anchor_path = state / ANCHOR_FILE
            if anchor_path.exists():
                try:
                    self._anchor = parse_anchor(read_bytes(anchor_path), source=str(anchor_path))
                except PolicyParseError as exc:
                    raise ConfigError(
                        f"persisted policy anchor {anchor_path} is unreadable ({exc}); restore "
                        "it from a backup or remove it to trust the bootstrap policy again"
                    ) from exc
            envelope_path = state / ENVELOPE_FILE
            if envelope_path.exists():
                self.offer(envelope_path.read_bytes(), source=str(envelope_path), local=True)
        if self._policy_file is not None:
            envelope = bootstrap_envelope(self._policy_file)
            taken = self.offer(envelope, source=str(self._policy_file), local=True)
            self.file_refusal = taken if isinstance(taken, Refused) else None

    def require_anchor(self) -> None:
        """Refuse to start without a pinned trust anchor (after :meth:`load`)."""
        if self._anchor is None:
            where = f" in {self._state_dir}" if self._state_dir is not None else ""
            last = f"; {self.last_refusal.message}" if self.last_refusal else ""
            raise ConfigError(
                f"node {self.node} has no pinned policy trust anchor{where} and trusts no "
                "policy from the network on first use: enroll it ('sluicegate edge install "
                "--join TOKEN' or 'pool install --join TOKEN'), or set its policy_file to the "
                f"signed campus policy (with its .sig beside it){last}"
            )

    async def start(self, transport: Transport) -> None:
        """Follow the retained policy topic (it arrives right after the subscription)."""
        await transport.subscribe(topics.policy(), self.on_message, qos=1)

    def on_message(self, message: Message) -> None:
        if not message.payload:  # a cleared retained message: nothing to consider
            return
        self.offer(message.payload, source=message.topic)

    def _persist(self, envelope: bytes, anchor: TrustAnchor) -> None:
        state = self._state_dir
        if state is None:
            return
        try:
            write_atomic(state / ENVELOPE_FILE, envelope)
            write_atomic(state / ANCHOR_FILE, dump_anchor(anchor))
        except OSError as exc:
            # The node keeps the verified policy in memory; only restart protection suffers.
            log.error(
                "%s could not persist policy v%d in %s: %s", self.node, anchor.version, state, exc
            )
