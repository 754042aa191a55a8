"""A worker's sealing keys: the X25519 private keys edges seal its images to, on disk in its
state folder, and which of them it advertises and keeps.

Rules (:func:`plan`, pure over plain data and ``now``):

- the *current* key is the newest held key (by when it was made) that the verified policy
  lists for this worker; with none listed there is no current key, and confidential work
  cannot be placed here until the compliance officer lists one;
- every other held key is kept, so tokens minted for it while a rotation runs still open;
- a key older than the current one that the policy does not list is *retired* from the
  moment that is first seen, and dropped once the policy's ``max_ttl_s`` has passed since
  (no token bound to it can still be valid); a key newer than the current one is never
  dropped: it waits for the officer to list it.

Files (:class:`KeyFolder`): ``<state_dir>/seal-keys/<made-at ms>-<key id hex>.pem``, an
unencrypted PKCS#8 PEM written atomically with mode 0600 (``sluicegate.files``), and beside
a retired key ``<same>.retired`` holding the unix time it was retired, so a restart does
not start its clock again. Nothing here publishes, audits or touches an image.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from policies.audit import Scalar
from policies.errors import KeyFileError
from policies.model import Policy
from policies.sealing import SealingKey, load_sealing_key
from sluicegate.files import write_atomic

log = logging.getLogger(__name__)

FOLDER = "seal-keys"
_NAME = re.compile(r"^(\d{1,16})-([0-9a-f]{16})\.pem$")


@dataclass(frozen=True, slots=True)
class HeldKey:
    """One private key this worker holds; ``retired_at``: when it was first seen superseded
    and unlisted (None: not retired)."""

    key: SealingKey
    made_at: float
    retired_at: float | None = None

    @property
    def key_id(self) -> bytes:
        return self.key.key_id


@dataclass(frozen=True, slots=True)
class Plan:
    """What :func:`plan` decided: the current key id, the keys kept (newest first, their
    ``retired_at`` updated) and the ids to drop."""

    current: bytes | None
    keep: tuple[HeldKey, ...]
    drop: tuple[bytes, ...]


def plan(
    held: Collection[HeldKey], listed: Collection[bytes], *, now: float, max_ttl_s: float
) -> Plan:
    """The rules of the module docstring over ``held`` and the key ids the policy lists."""
    newest = sorted(held, key=lambda h: (h.made_at, h.key_id), reverse=True)
    current = next((h for h in newest if h.key_id in listed), None)
    keep: list[HeldKey] = []
    drop: list[bytes] = []
    for h in newest:
        superseded = current is not None and (h.made_at, h.key_id) < (
            current.made_at,
            current.key_id,
        )
        if h.key_id in listed or not superseded:
            keep.append(replace(h, retired_at=None) if h.retired_at is not None else h)
        elif h.retired_at is None:
            keep.append(replace(h, retired_at=now))
        elif now - h.retired_at >= max_ttl_s:
            drop.append(h.key_id)
        else:
            keep.append(h)
    return Plan(current.key_id if current is not None else None, tuple(keep), tuple(drop))


@dataclass(frozen=True, slots=True)
class Rotation:
    """The current key changed under policy ``version``: from ``previous`` to ``current``
    (ids; None: none), whose text ``public`` the capabilities now advertise."""

    current: bytes | None
    previous: bytes | None
    public: str | None
    version: int

    def audit_data(self, worker_id: str) -> dict[str, Scalar]:
        return {
            "worker": worker_id,
            "key_id": self.current.hex() if self.current is not None else None,
            "previous": self.previous.hex() if self.previous is not None else None,
            "public": self.public,
            "policy_version": self.version,
        }

    def __str__(self) -> str:
        now = self.current.hex() if self.current is not None else "none"
        was = self.previous.hex() if self.previous is not None else "none"
        return f"seals to key {now} from policy v{self.version} (was {was})"


class KeyFolder:
    """The key files in one folder; ``None``: keys in memory only (no state folder)."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self._memory: dict[bytes, HeldKey] = {}

    def _path(self, held: HeldKey) -> Path:
        assert self.folder is not None
        return self.folder / f"{int(held.made_at * 1000)}-{held.key_id.hex()}.pem"

    def load(self) -> list[HeldKey]:
        """Every key held; a file that is not a key is logged and left alone."""
        if self.folder is None:
            return list(self._memory.values())
        if not self.folder.is_dir():
            return []
        out: list[HeldKey] = []
        for path in sorted(self.folder.iterdir()):
            match = _NAME.match(path.name)
            if match is None:
                continue
            try:
                key = load_sealing_key(path)
            except KeyFileError as exc:
                log.error("sealing key file skipped: %s", exc)
                continue
            if key.key_id.hex() != match.group(2):
                log.error("sealing key file %s holds key %s: skipped", path, key.key_id.hex())
                continue
            retired = _retired_at(path.with_suffix(".retired"))
            out.append(HeldKey(key, int(match.group(1)) / 1000.0, retired))
        return out

    def create(self, now: float) -> HeldKey:
        """A new key, made now and written before it returns."""
        held = HeldKey(SealingKey.generate(), now)
        if self.folder is None:
            self._memory[held.key_id] = held
            return held
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomic(self._path(held), held.key.to_pem(), mode=0o600)
        return held

    def apply(self, old: Mapping[bytes, HeldKey], result: Plan) -> None:
        """Write the retirements ``result`` started or ended and delete what it drops."""
        kept = {h.key_id: h for h in result.keep}
        if self.folder is None:
            self._memory = dict(kept)
            return
        for key_id, held in kept.items():
            before = old.get(key_id)
            marker = self._path(held).with_suffix(".retired")
            if held.retired_at is not None and (before is None or before.retired_at is None):
                write_atomic(marker, repr(held.retired_at).encode(), mode=0o600)
            elif held.retired_at is None and before is not None and before.retired_at is not None:
                marker.unlink(missing_ok=True)
        for key_id in result.drop:
            gone = old[key_id]
            self._path(gone).with_suffix(".retired").unlink(missing_ok=True)
            self._path(gone).unlink(missing_ok=True)
            log.info("sealing key %s dropped: retired for longer than a token lives", key_id.hex())


def _retired_at(path: Path) -> float | None:
    try:
        return float(path.read_text().strip())
    except (OSError, ValueError):
        return None


def folder_of(state_dir: Path | None) -> Path | None:
    return state_dir / FOLDER if state_dir is not None else None


class SealKeys:
    """The keys one worker runs with: made on first start, re-planned at each policy."""

    def __init__(self, folder: KeyFolder, *, now: float) -> None:
        self._folder = folder
        held = folder.load()
        if not held:
            made = folder.create(now)
            held = [made]
            log.warning(
                "made sealing key %s (%s): list it in the policy's encryption_keys for this "
                "worker so that confidential work can be placed here",
                made.key_id.hex(),
                made.key.public_text,
            )
        self._held = {h.key_id: h for h in held}
        self.current: bytes | None = None

    @property
    def held(self) -> tuple[HeldKey, ...]:
        return tuple(sorted(self._held.values(), key=lambda h: h.made_at, reverse=True))

    def ring(self) -> dict[bytes, SealingKey]:
        """Key id -> private key: what intake opens sealed work with."""
        return {key_id: h.key for key_id, h in self._held.items()}

    def public_text(self) -> str | None:
        """The current key's ``x25519:`` text (what the capabilities advertise), or None."""
        held = self._held.get(self.current) if self.current is not None else None
        return held.key.public_text if held is not None else None

    def refresh(self, listed: Collection[bytes], *, now: float, max_ttl_s: float) -> bool:
        """Plan again against the key ids the policy lists; True when the current key
        changed. A listed key not held yet is looked for in the folder ('pool seal-key new'
        while the worker runs). A file that cannot be written is logged; the keys in memory
        still count."""
        if any(key_id not in self._held for key_id in listed):
            for held in self._folder.load():
                self._held.setdefault(held.key_id, held)
        result = plan(self._held.values(), listed, now=now, max_ttl_s=max_ttl_s)
        try:
            self._folder.apply(self._held, result)
        except OSError as exc:
            log.error("sealing keys: could not update %s: %s", self._folder.folder, exc)
        self._held = {h.key_id: h for h in result.keep}
        changed = result.current != self.current
        self.current = result.current
        return changed

    def follow(self, policy: Policy, worker_id: str, *, now: float) -> Rotation | None:
        """:meth:`refresh` against what ``policy`` lists for ``worker_id``; the rotation, when
        the current key changed."""
        entry = policy.worker(worker_id)
        listed = set(entry.seal_keys) if entry is not None else set()
        before = self.current
        if not self.refresh(listed, now=now, max_ttl_s=policy.max_ttl_s):
            return None
        return Rotation(self.current, before, self.public_text(), policy.version)
