"""The policy as frozen dataclasses, built once from a validated document.

Everything the hot paths need is precomputed here: zones split into segments, each worker's
zone, broker keys by fingerprint, rules as compiled zone patterns. The only mutable part is
``Policy.verdict_cache``, a bounded memo that ``evaluate`` owns. Nothing here parses text,
touches files or decides trust.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from policies.canonical import canonical_bytes, digest
from policies.keys import decode_public_key, fingerprint
from policies.peers import Peer, peers_of
from policies.schema import PolicyDocument, RolloutDoc
from policies.sealing import decode_seal_key, seal_key_id

Effect = Literal["allow", "deny"]


@dataclass(frozen=True)
class ZonePattern:
    """``campus/fab-north/dc``, ``campus/*/dc`` (``*``: one level), ``campus/**`` (a subtree,
    the zone itself included) or ``**`` (every zone)."""

    text: str
    segments: tuple[str, ...]
    subtree: bool
    literal: bool  # no '*' level: a plain tuple comparison decides

    @classmethod
    def parse(cls, text: str) -> ZonePattern:
        segments = tuple(text.split("/"))
        subtree = segments[-1] == "**"
        if subtree:
            segments = segments[:-1]
        return cls(text, segments, subtree, "*" not in segments)

    def matches(self, zone: tuple[str, ...]) -> bool:
        n = len(self.segments)
        if len(zone) != n and (len(zone) < n or not self.subtree):
            return False
        if self.literal:
            return zone[:n] == self.segments
        return all(p == "*" or p == z for p, z in zip(self.segments, zone, strict=False))


EVERYWHERE = ZonePattern.parse("**")


@dataclass(frozen=True)
class Rule:
    """One allow or deny entry of a data class, ``[origin ->] target``."""

    data_class: str
    effect: Effect
    index: int
    text: str
    origin: ZonePattern
    target: ZonePattern

    @classmethod
    def parse(cls, data_class: str, effect: Effect, index: int, text: str) -> Rule:
        origin, _, target = text.rpartition(" -> ")
        return cls(
            data_class=data_class,
            effect=effect,
            index=index,
            text=text,
            origin=ZonePattern.parse(origin) if origin else EVERYWHERE,
            target=ZonePattern.parse(target),
        )

    @property
    def key(self) -> str:
        """Where the rule sits in the policy file."""
        return f"classes.{self.data_class}.{self.effect}[{self.index}]"

    def matches(self, origin: tuple[str, ...], target: tuple[str, ...]) -> bool:
        return self.target.matches(target) and self.origin.matches(origin)

    def __str__(self) -> str:
        return f"{self.effect}[{self.index}] {self.text!r} of class {self.data_class!r}"


@dataclass(frozen=True)
class DataClass:
    name: str
    description: str
    deny: tuple[Rule, ...]
    allow: tuple[Rule, ...]
    confidential: bool = False  # images travel only sealed to the chosen worker


@dataclass(frozen=True)
class KeyRef:
    key_id: str
    public: bytes


@dataclass(frozen=True)
class Pool:
    name: str
    zone: str
    workers: tuple[str, ...]


@dataclass(frozen=True)
class Worker:
    worker_id: str
    pool: str
    zone: str
    key: bytes
    # Raw X25519 keys edges may seal to, by key id (``policies.sealing.seal_key_id``).
    seal_keys: Mapping[bytes, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class Edge:
    edge_id: str
    zone: str
    key: bytes


@dataclass(frozen=True)
class App:
    """A vision app: which edges it submits to, and where it takes results."""

    app_id: str
    edges: tuple[str, ...]
    results: tuple[str, ...]


@dataclass(frozen=True)
class Condition:
    metric: str
    op: str
    value: float

    def holds(self, measured: float) -> bool:
        if self.op == ">=":
            return measured >= self.value
        if self.op == ">":
            return measured > self.value
        if self.op == "<=":
            return measured <= self.value
        return measured < self.value

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.value:g}"


@dataclass(frozen=True)
class SubhealthRule:
    name: str
    conditions: tuple[Condition, ...]


@dataclass(frozen=True)
class Verdict:
    """The answer to "may ``data_class`` from ``origin`` be processed in ``target``"."""

    allowed: bool
    decision: Literal[
        "allow-rule",
        "deny-rule",
        "default-deny",
        "unknown-class",
        "unknown-origin",
        "unknown-target",
        "peer-agreement",
        "peer-not-agreed",
    ]
    data_class: str
    origin: str
    target: str
    rule: Rule | None = None

    def __str__(self) -> str:
        what = f"{self.data_class!r} from {self.origin!r} to {self.target!r}"
        if self.decision == "allow-rule":
            return f"{what} allowed by {self.rule}"
        if self.decision == "deny-rule":
            return f"{what} denied by {self.rule} (deny wins)"
        if self.decision == "default-deny":
            return f"{what} denied: no allow rule of the class matches (default deny)"
        if self.decision == "unknown-class":
            return f"{what} denied: unknown data class {self.data_class!r}"
        if self.decision == "peer-agreement":
            return f"{what} allowed by the agreement with that campus (its receive terms)"
        if self.decision == "peer-not-agreed":
            return f"{what} denied: the agreement with that campus does not list it"
        if self.decision == "unknown-origin":
            return f"{what} denied: unknown origin zone {self.origin!r}"
        return f"{what} denied: unknown target zone {self.target!r}"


@dataclass(frozen=True)
class Rollout:
    """The policy's ``[rollout]`` table: twin keys (id -> raw public key), whether the next
    version needs a passing verdict, and the thresholds that verdict must have met."""

    twin_keys: Mapping[str, bytes]
    require_verdict: bool
    min_attainment: float
    max_queue_depth: int
    min_burst: float = 1.0  # the arrival factor a verdict's rehearsal must have used, at least
    # The attainment points a candidate may lose against the policy in force, at most
    # (None: not set; the twin judges with its default margin, and a gate asks no margin).
    max_drop_points: float | None = None


@dataclass(frozen=True, eq=False)
class Policy:
    """A loaded policy. Equality is identity; compare ``digest`` to compare content."""

    campus: str
    version: int
    expires: int
    description: str
    signer_threshold: int
    signers: tuple[KeyRef, ...]
    brokers: tuple[KeyRef, ...]
    zones: Mapping[str, str]
    pools: tuple[Pool, ...]
    edges: tuple[Edge, ...]
    apps: tuple[App, ...]
    classes: Mapping[str, DataClass]
    subhealth: tuple[SubhealthRule, ...]
    max_ttl_s: int
    max_skew_s: int
    canonical: bytes = field(repr=False)
    rollout: Rollout | None = field(default=None, kw_only=True)
    peers: Mapping[str, Peer] = field(default_factory=dict, kw_only=True)
    digest: bytes = field(repr=False)
    zone_segments: Mapping[str, tuple[str, ...]] = field(repr=False)
    worker_zones: Mapping[str, str] = field(repr=False)
    workers: Mapping[str, Worker] = field(repr=False)
    edges_by_id: Mapping[str, Edge] = field(repr=False)
    broker_keys_by_fp: Mapping[bytes, tuple[bytes, ...]] = field(repr=False)
    verdict_cache: dict[tuple[str, str, str], Verdict] = field(default_factory=dict, repr=False)

    @property
    def signer_keys(self) -> frozenset[bytes]:
        """The distinct raw public keys of the policy signers."""
        return frozenset(ref.public for ref in self.signers)

    def worker_zone(self, worker_id: str) -> str | None:
        return self.worker_zones.get(worker_id)

    def edge(self, edge_id: str) -> Edge | None:
        """The policy's entry for ``edge_id``: its zone and key, or None if not listed."""
        return self.edges_by_id.get(edge_id)

    def worker(self, worker_id: str) -> Worker | None:
        """The policy's entry for ``worker_id``: its pool, zone and key, or None."""
        return self.workers.get(worker_id)

    def seal_key(self, worker_id: str, key_id: bytes) -> bytes | None:
        """The raw X25519 key ``key_id`` the policy lists for ``worker_id``, or None."""
        worker = self.workers.get(worker_id)
        return worker.seal_keys.get(key_id) if worker is not None else None

    def peers_out(self) -> tuple[str, ...]:
        """The sister campuses this campus may send jobs to (their send terms list a class)."""
        return tuple(sorted(name for name, peer in self.peers.items() if peer.send.classes))

    def peers_into(self, zone: str) -> tuple[str, ...]:
        """The sister campuses whose jobs may run in ``zone`` (their receive terms open it)."""
        return tuple(
            sorted(
                name
                for name, peer in self.peers.items()
                if peer.receive.classes and zone in peer.receive.zones
            )
        )

    def confidential(self, data_class: str) -> bool:
        cls = self.classes.get(data_class)
        return cls is not None and cls.confidential

    def broker_key(self, broker_id: str) -> bytes | None:
        """The placement-signing key listed for broker replica ``broker_id``, or None."""
        for ref in self.brokers:
            if ref.key_id == broker_id:
                return ref.public
        return None

    def node_key(self, node_id: str) -> bytes | None:
        """The key the policy lists for edge, worker or broker ``node_id``, or None."""
        edge = self.edges_by_id.get(node_id)
        if edge is not None:
            return edge.key
        worker = self.workers.get(node_id)
        if worker is not None:
            return worker.key
        return self.broker_key(node_id)

    def listed_keys(self) -> set[bytes]:
        """Every key this policy lists: its signers, brokers, edges and pool workers (whose
        audit records an auditor holding the policy trusts)."""
        keys = {ref.public for ref in (*self.signers, *self.brokers)}
        keys |= {edge.key for edge in self.edges}
        keys |= {worker.key for worker in self.workers.values()}
        return keys

    def role_of(self, public: bytes) -> str | None:
        """Which role ``public`` has in this policy, in words, or None."""
        for role, refs in (("policy signer", self.signers), ("broker", self.brokers)):
            for ref in refs:
                if ref.public == public:
                    return f"{role} {ref.key_id!r}"
        for edge in self.edges:
            if edge.key == public:
                return f"edge {edge.edge_id!r}"
        for worker in self.workers.values():
            if worker.key == public:
                return f"worker {worker.worker_id!r}"
        return None


def rollout_of(doc: RolloutDoc | None) -> Rollout | None:
    """The runtime ``[rollout]`` of a policy document (or of a persisted trust anchor)."""
    if doc is None:
        return None
    return Rollout(
        {k: decode_public_key(v) for k, v in doc.twin_keys.items()},
        doc.require_verdict,
        doc.min_attainment,
        doc.max_queue_depth,
        doc.min_burst if doc.min_burst is not None else 1.0,
        doc.max_drop_points,
    )


def _rules(name: str, effect: Effect, texts: list[str]) -> tuple[Rule, ...]:
    return tuple(Rule.parse(name, effect, i, text) for i, text in enumerate(texts))


def _seal_keys(texts: list[str] | None) -> dict[bytes, bytes]:
    raws = [decode_seal_key(t) for t in texts or ()]
    return {seal_key_id(raw): raw for raw in raws}


def policy_from_document(doc: PolicyDocument) -> Policy:
    """Build the runtime policy from a validated (and semantically checked) document."""
    canonical = canonical_bytes(doc)
    brokers = tuple(KeyRef(k, decode_public_key(v)) for k, v in doc.broker_signers.keys.items())
    by_fp: dict[bytes, tuple[bytes, ...]] = {}
    for ref in brokers:
        by_fp[fingerprint(ref.public)] = (*by_fp.get(fingerprint(ref.public), ()), ref.public)
    pools = tuple(Pool(n, p.zone, tuple(p.workers)) for n, p in doc.pools.items())
    workers = {
        w: Worker(w, name, p.zone, decode_public_key(key), _seal_keys(p.encryption_keys.get(w)))
        for name, p in doc.pools.items()
        for w, key in p.workers.items()
    }
    edges = tuple(Edge(k, e.zone, decode_public_key(e.key)) for k, e in doc.edges.items())
    return Policy(
        campus=doc.campus,
        version=doc.version,
        expires=doc.expires,
        description=doc.description,
        signer_threshold=doc.policy_signers.threshold,
        signers=tuple(KeyRef(k, decode_public_key(v)) for k, v in doc.policy_signers.keys.items()),
        brokers=brokers,
        zones=dict(doc.zones),
        pools=pools,
        edges=edges,
        apps=tuple(App(k, tuple(a.edges), tuple(a.results)) for k, a in doc.apps.items()),
        classes={
            name: DataClass(
                name,
                c.description,
                _rules(name, "deny", c.deny),
                _rules(name, "allow", c.allow),
                c.confidential,
            )
            for name, c in doc.classes.items()
        },
        subhealth=tuple(
            SubhealthRule(s.name, tuple(Condition(c.metric, c.op, c.value) for c in s.when))
            for s in doc.subhealth
        ),
        max_ttl_s=doc.tokens.max_ttl_s,
        max_skew_s=doc.tokens.max_skew_s,
        rollout=rollout_of(doc.rollout),
        peers=peers_of(doc.peers),
        canonical=canonical,
        digest=digest(canonical),
        zone_segments={zone: tuple(zone.split("/")) for zone in doc.zones},
        worker_zones={w: pool.zone for pool in pools for w in pool.workers},
        workers=workers,
        edges_by_id={edge.edge_id: edge for edge in edges},
        broker_keys_by_fp=by_fp,
    )
