"""The Mosquitto ACL of a campus, generated from its signed policy and ``sluicegate.topics``.

Each MQTT user is an identity the transport proved: the CN of the node's TLS client
certificate (``use_identity_as_username``), which is also its client id
(``use_username_as_clientid``). Rights come in two layers:

- **Own topics, for every authenticated user** (``pattern`` lines, ``%u`` = its username):
  a node may write only the topics that carry its own id (telemetry, job records, status,
  announced work, capabilities, placement requests and releases, completions, usage
  records) and read its
  own inbox, its usage acknowledgements and the policy;
  its probe topic it may both write and read (``sluicegate doctor``'s round trips). So
  a node the policy does not list yet can still ask, and be refused by name, but can speak
  for no one else.
- **Between roles, per user, from the policy**: a worker reads its own zone-scoped work
  topic and returns results only to the edges that may place work on it; an edge writes
  work only to workers in zones some data class from its zone may reach, and answers only
  on the response topics of the apps that may submit to it; an app submits and announces
  work to come only to its edges; a broker replica reads requests, telemetry and announced
  work (never a work topic: no images), answers edges and publishes the retained policy.
  Observers (monitoring, the twin's recorder) read status, telemetry, the edges' job
  records and announced work, the workers' completions and the policy: never an image, a
  result or a token. Broker replicas read every node's usage
  records and acknowledge them on each node's own acks topic.
- **Sister campuses** (``[peers]``): a peer's bridge (``peer.<campus>``, a certificate from
  this campus's CA) writes only what that campus says to this one and reads only what this
  one says to it, and may not read this campus's policy; broker replicas write and read
  what brokers say to each other there (halves, summaries, probes, asks and answers, usage
  records, notices of lost workers, placements handed back), never
  a work or returns topic. An edge writes work to the workers of the peers its
  campus may send to and reads their results to it; a worker in a zone a peer's receive
  terms open reads that work and returns its results.

Anonymous clients get nothing (the Mosquitto configuration sets ``allow_anonymous false``).
Every topic comes from ``sluicegate.topics``; none is spelled here. Pure: returns text.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from policies.canonical import digest_text
from policies.evaluate import reachable_zones
from policies.model import Policy
from sluicegate import topics

SELF = "%u"  # Mosquitto's pattern substitution: the user's own name

Rule = tuple[str, str]  # (access, topic filter)


@dataclass(frozen=True)
class UserRules:
    """One ``user`` block: who, in words, and what it may read and write."""

    name: str
    comment: str
    rules: tuple[Rule, ...]


def own_topics() -> list[Rule]:
    """What every authenticated node may do under its own id."""
    return [
        ("write", topics.edge_telemetry(SELF)),
        ("write", topics.edge_trace(SELF)),
        ("write", topics.edge_status(SELF)),
        ("write", topics.edge_announced(SELF)),
        ("read", topics.edge_inbox(SELF)),
        ("write", topics.placement_request(SELF)),
        ("write", topics.placement_release(SELF)),
        ("write", topics.worker_telemetry(SELF)),
        ("write", topics.worker_status(SELF)),
        ("read", topics.worker_status(SELF)),
        ("write", topics.worker_capabilities(SELF)),
        ("write", topics.completion(SELF)),
        ("write", topics.usage(SELF)),
        ("read", topics.usage_acks(SELF)),
        ("read", topics.client_results(SELF)),
        ("read", topics.policy()),
        ("read", topics.broker_status_all()),
        ("write", topics.node_probe(SELF)),
        ("read", topics.node_probe(SELF)),
    ]


def results_filter(prefix: str) -> str:
    """The topic filter of an app's results prefix (``app/line-3`` -> ``app/line-3/#``)."""
    return f"{prefix}/#"


def _senders(policy: Policy) -> dict[str, list[str]]:
    """Zone -> the edges that may send work there (only they get results back from it)."""
    out: dict[str, list[str]] = {}
    for edge in sorted(policy.edges, key=lambda e: e.edge_id):
        if edge.zone in policy.zones:
            for zone in reachable_zones(policy, edge.zone):
                out.setdefault(zone, []).append(edge.edge_id)
    return out


def worker_users(policy: Policy) -> list[UserRules]:
    senders = _senders(policy)
    out = []
    for worker_id in sorted(policy.workers):
        worker = policy.workers[worker_id]
        rules = [("read", topics.pool_work_all(worker.zone, worker_id))]
        rules += [
            ("write", topics.edge_returns(edge_id, worker_id))
            for edge_id in senders.get(worker.zone, [])
        ]
        # Work from the sister campuses whose receive terms open its zone, results back.
        peers = policy.peers_into(worker.zone)
        if peers:
            rules.append(("read", topics.peer_work_all(policy.campus, worker_id)))
        rules += [
            ("write", topics.peer_returns(policy.campus, peer, "+", worker_id)) for peer in peers
        ]
        out.append(
            UserRules(
                worker_id, f"worker of pool {worker.pool!r} in zone {worker.zone}", tuple(rules)
            )
        )
    return out


def edge_users(policy: Policy) -> list[UserRules]:
    out = []
    for edge in sorted(policy.edges, key=lambda e: e.edge_id):
        zones = set(reachable_zones(policy, edge.zone)) if edge.zone in policy.zones else set()
        rules = [
            ("write", topics.pool_work(w.zone, w.worker_id, edge.edge_id))
            for w in sorted(policy.workers.values(), key=lambda w: w.worker_id)
            if w.zone in zones
        ]
        # Work to the sister campuses its jobs may go to, their results back.
        peers = policy.peers_out()
        rules += [("write", topics.peer_work(policy.campus, p, "+", edge.edge_id)) for p in peers]
        if peers:
            rules.append(("read", topics.peer_returns_all(policy.campus, edge.edge_id)))
        for app in sorted(policy.apps, key=lambda a: a.app_id):
            if edge.edge_id in app.edges:
                rules.append(("write", topics.client_results(app.app_id)))
                rules += [("write", results_filter(prefix)) for prefix in app.results]
        out.append(UserRules(edge.edge_id, f"edge in zone {edge.zone}", tuple(rules)))
    return out


def app_users(policy: Policy) -> list[UserRules]:
    out = []
    for app in sorted(policy.apps, key=lambda a: a.app_id):
        rules: list[Rule] = []
        for edge_id in app.edges:
            rules += [
                ("write", topics.edge_submit(edge_id)),
                ("write", topics.edge_schedule(edge_id)),
                ("read", topics.edge_status(edge_id)),
            ]
        rules += [("read", results_filter(prefix)) for prefix in app.results]
        out.append(UserRules(app.app_id, f"vision app on {', '.join(app.edges)}", tuple(rules)))
    return out


def broker_users(policy: Policy) -> list[UserRules]:
    reads = [
        topics.placement_requests_all(),
        topics.placement_releases_all(),
        topics.completions_all(),
        topics.usage_all(),  # usage records (broker.metering)
        topics.edge_telemetry_all(),
        topics.edge_trace_all(),  # job records, for the console
        topics.edge_status_all(),
        topics.edge_announced_all(),  # announced work: the demand signal's leading part
        topics.worker_all("telemetry"),
        topics.worker_all("status"),
        topics.worker_all("capabilities"),
    ]
    out = []
    for ref in sorted(policy.brokers, key=lambda r: r.key_id):
        rules = [("read", topic) for topic in reads]
        rules += [
            ("write", topics.placement_replies("+")),
            ("write", topics.edge_notices("+")),
            ("write", topics.usage_acks("+")),
            ("write", topics.broker_status(ref.key_id)),
            ("write", topics.policy()),
        ]
        for peer in sorted(policy.peers):  # what brokers say to each other: never a work topic
            rules.append(("read", topics.bridge_state(peer)))  # Mosquitto's word on the link
            for topic in (
                topics.peer_agreement,
                topics.peer_summary,
                topics.peer_probe,
                topics.peer_asks,
                topics.peer_answers,
                topics.peer_usage,
                topics.peer_notices_all,
                topics.peer_releases,
            ):
                rules += [
                    ("write", topic(policy.campus, peer)),
                    ("read", topic(peer, policy.campus)),
                ]
        out.append(UserRules(ref.key_id, "campus broker replica", tuple(rules)))
    return out


def peer_users(policy: Policy) -> list[UserRules]:
    """Each sister campus's bridge: what it says to us in, what we say to it out."""
    return [
        UserRules(
            topics.peer_bridge_identity(peer),
            f"the bridge of sister campus {peer!r}: its own tree in, ours to it out",
            (
                # Every authenticated user may read the policy (a pattern); not a peer's
                # bridge: our nodes, zones and keys are this campus's own. A user's deny
                # line is checked before the patterns.
                ("deny", topics.policy()),
                ("write", topics.peer_tree(peer, policy.campus)),
                ("read", topics.peer_tree(policy.campus, peer)),
            ),
        )
        for peer in sorted(policy.peers)
    ]


def observer_users(names: Iterable[str]) -> list[UserRules]:
    # What the digital twin's recorder reads: no image, no model output, no token.
    reads = [
        topics.edge_status_all(),
        topics.edge_telemetry_all(),
        topics.edge_trace_all(),
        topics.edge_announced_all(),
        topics.worker_all("telemetry"),
        topics.worker_all("status"),
        topics.worker_all("capabilities"),
        topics.completions_all(),
        topics.policy(),
    ]
    return [
        UserRules(
            name,
            "observer (monitoring, the twin's recorder): status, telemetry, job records, "
            "completions and the policy, read only",
            tuple(("read", topic) for topic in reads),
        )
        for name in sorted(set(names))
    ]


def acl_users(policy: Policy, observers: Sequence[str] = ()) -> list[UserRules]:
    """Every ``user`` block of the ACL, in a fixed order."""
    return (
        broker_users(policy)
        + edge_users(policy)
        + worker_users(policy)
        + app_users(policy)
        + peer_users(policy)
        + observer_users(observers)
    )


def render_acl(policy: Policy, *, observers: Sequence[str] = ()) -> str:
    """The Mosquitto ``acl_file`` text for ``policy``; deterministic for given inputs."""
    out = [
        "# Mosquitto ACL generated by 'sluicegate policy acl'. Do not edit: regenerate it.",
        f"# policy {policy.campus!r} version {policy.version} {digest_text(policy.digest)}",
        "# Users are the CNs of client certificates from the campus CA.",
        "",
        "# Every authenticated node: the topics that carry its own id (%u).",
    ]
    out += [f"pattern {access} {topic}" for access, topic in own_topics()]
    out.append("")
    for user in acl_users(policy, observers):
        out += [f"# {user.comment}", f"user {user.name}"]
        out += [f"topic {access} {topic}" for access, topic in user.rules]
        out.append("")
    return "\n".join(out)
