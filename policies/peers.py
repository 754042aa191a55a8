"""A policy's sister campuses as frozen values: who each peer is and the terms each way.

Built once from a validated ``[peers.<campus>]`` table. ``Terms`` compare as sets and
numbers, so two entries written in another order or spelling match when they say the same.
Nothing here decides whether an agreement is in force: that is ``policies.agreement``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from policies.keys import decode_public_key
from policies.schema import PeerDoc, TermsDoc


@dataclass(frozen=True)
class Terms:
    """One direction of an agreement, as the campus that wrote it signed it."""

    classes: frozenset[str] = frozenset()
    zones: frozenset[str] = frozenset()
    max_jobs_per_s: float = 0.0
    max_bytes_per_s: float = 0.0
    currency: str = ""
    device_second: float = 0.0
    job: float = 0.0

    @classmethod
    def of(cls, doc: TermsDoc) -> Terms:
        return cls(
            frozenset(doc.classes),
            frozenset(doc.zones),
            doc.max_jobs_per_s,
            doc.max_bytes_per_s,
            doc.currency,
            doc.device_second,
            doc.job,
        )

    def as_json(self) -> dict[str, Any]:
        """Plain JSON, lists sorted: the form a signed statement carries."""
        return {
            "classes": sorted(self.classes),
            "zones": sorted(self.zones),
            "max_jobs_per_s": self.max_jobs_per_s,
            "max_bytes_per_s": self.max_bytes_per_s,
            "currency": self.currency,
            "device_second": self.device_second,
            "job": self.job,
        }

    def differences(self, other: Terms) -> list[str]:
        """The fields where ``other`` says something else, each as ``name: ours vs theirs``."""
        out = []
        for name, mine, theirs in (
            ("classes", sorted(self.classes), sorted(other.classes)),
            ("zones", sorted(self.zones), sorted(other.zones)),
            ("max_jobs_per_s", self.max_jobs_per_s, other.max_jobs_per_s),
            ("max_bytes_per_s", self.max_bytes_per_s, other.max_bytes_per_s),
            ("currency", self.currency, other.currency),
            ("device_second", self.device_second, other.device_second),
            ("job", self.job, other.job),
        ):
            if mine != theirs:
                out.append(f"{name}: {mine!r} vs {theirs!r}")
        return out


@dataclass(frozen=True)
class Peer:
    """A sister campus as this policy names it: its CA certificate's fingerprint, its broker
    replicas' keys (which sign its summaries and placements), its officers' keys and threshold
    (which sign its half of the agreement), and the terms: ``send`` is what this campus may
    send there, ``receive`` what it takes from there."""

    campus: str
    description: str
    ca_fingerprint: str
    brokers: Mapping[str, bytes]
    officer_threshold: int
    officer_keys: frozenset[bytes]
    send: Terms
    receive: Terms

    @classmethod
    def of(cls, campus: str, doc: PeerDoc) -> Peer:
        return cls(
            campus=campus,
            description=doc.description,
            ca_fingerprint=doc.ca_fingerprint,
            brokers={k: decode_public_key(v) for k, v in doc.brokers.items()},
            officer_threshold=doc.officers.threshold,
            officer_keys=frozenset(decode_public_key(v) for v in doc.officers.keys.values()),
            send=Terms.of(doc.send),
            receive=Terms.of(doc.receive),
        )


def peers_of(docs: Mapping[str, PeerDoc]) -> dict[str, Peer]:
    return {name: Peer.of(name, doc) for name, doc in docs.items()}
