"""Every MQTT topic name Sluicegate uses, and the user-property names of the wire contract.

This module is the only place a topic string is spelled out; everything else builds topics
with these functions, the generated Mosquitto ACL included (``sluicegate.acl``). Topics are
versioned (``sluicegate/v1/...``) and are part of the public contract documented in the
README: change them only by adding a new version.

Identity rides on the topic. Every message a node sends on its own behalf goes to a topic
whose last level (or, under ``edge/``, ``worker/`` and ``broker/``, whose second level) is
its own id, and the ACL lets each authenticated node write only those: the receiver reads
who spoke from the topic (:func:`sender`), never from the payload.
"""

from __future__ import annotations

import re

ROOT = "sluicegate/v1"

# User properties of a job request (MQTT v5 PUBLISH to the submit topic).
PROP_MODEL = "model"
PROP_DEADLINE_MS = "deadline-ms"
PROP_DEADLINE_AT = "deadline-at"
PROP_PRIORITY = "priority"
PROP_DATA_CLASS = "data-class"
PROP_JOB_ID = "job-id"
# When the app sent it, unix ms on the app's clock (the client library stamps it): the edge
# records the leg from the app to itself in its trace; it changes no decision.
PROP_SENT_AT = "sent-at"
# Further user properties on a work message (edge -> pool worker).
PROP_TOKEN = "placement-token"
PROP_MODEL_SHA256 = "model-sha256"  # the exact model file the edge runs
PROP_ORIGIN_ZONE = "origin-zone"
PROP_EDGE = "edge-id"
# The attempt a work message (edge -> worker) or a returned result (worker -> edge) belongs
# to: 1 for the first placement of a job, one more for each re-placement. Results from an
# earlier attempt than the edge's current one are discarded (fencing).
PROP_ATTEMPT = "attempt"
PROP_WORKER = "worker-id"
# The app a job is billed to, as the edge sends it with the work (empty when absent).
PROP_OWNER = "owner"
# A work message whose image is sealed to the target worker's key (HPKE, policies.sealing):
# the suite's name, and the image's own content type (the message's own says only sealed).
PROP_SEALED = "sealed"
SEAL_SUITE = "hpke-x25519-sha256-aes128gcm"
PROP_INNER_CONTENT_TYPE = "inner-content-type"
SEALED_CONTENT_TYPE = "application/vnd.sluicegate.sealed"

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_id(kind: str, value: str) -> str:
    """Return ``value`` if it is safe inside a topic level, else raise ``ValueError``."""
    if not _ID.match(value):
        raise ValueError(
            f"invalid {kind} {value!r}: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


def edge_submit(edge_id: str) -> str:
    """Where vision apps publish jobs for one edge agent."""
    return f"{ROOT}/edge/{edge_id}/jobs"


def edge_telemetry(edge_id: str) -> str:
    """Where an edge agent publishes its load once per interval (QoS 0)."""
    return f"{ROOT}/edge/{edge_id}/telemetry"


def edge_trace(edge_id: str) -> str:
    """Where an edge agent publishes the records of the jobs it concluded since its last
    telemetry, for the digital twin's recorder (QoS 0, only when there are some)."""
    return f"{ROOT}/edge/{edge_id}/trace"


def edge_trace_all() -> str:
    """Subscription filter for every edge agent's job records."""
    return f"{ROOT}/edge/+/trace"


def edge_schedule(edge_id: str) -> str:
    """Where a vision app (or the plant's MES, enrolled as an app of the line) announces
    work to come on one edge: a shift change, a batch start, a recipe that doubles the
    camera rate (``wire.Announcement``, QoS 1; a Response Topic gets the answer)."""
    return f"{ROOT}/edge/{edge_id}/schedule"


def edge_announced(edge_id: str) -> str:
    """An edge's accepted announcements still ahead or under way, each with what the edge
    can run of it itself (``wire.EdgeSchedule``; retained, replaced whole on each change,
    expiring with its last window): the brokers' leading signal."""
    return f"{ROOT}/edge/{edge_id}/announced"


def edge_announced_all() -> str:
    """Subscription filter for every edge's announced work."""
    return f"{ROOT}/edge/+/announced"


def edge_status(edge_id: str) -> str:
    """Retained online/offline status of an edge agent; its Last Will says offline."""
    return f"{ROOT}/edge/{edge_id}/status"


def edge_telemetry_all() -> str:
    """Subscription filter for every edge agent's telemetry."""
    return f"{ROOT}/edge/+/telemetry"


def edge_status_all() -> str:
    """Subscription filter for every edge agent's status."""
    return f"{ROOT}/edge/+/status"


def edge_returns(edge_id: str, worker_id: str) -> str:
    """Where pool worker ``worker_id`` returns the results of jobs edge ``edge_id`` offloaded
    to it (QoS 1). The edge owns each accepted job until it is terminal, so every result
    reaches the app through it: that is where duplicates, stale attempts and results from
    a worker the attempt was not placed on are dropped."""
    return f"{ROOT}/edge/{edge_id}/returns/{worker_id}"


def edge_returns_all(edge_id: str) -> str:
    """Subscription filter for the results every worker returns to one edge."""
    return f"{ROOT}/edge/{edge_id}/returns/+"


def edge_inbox(edge_id: str) -> str:
    """Everything addressed to one edge: jobs, placement replies, returns, notices."""
    return f"{ROOT}/edge/{edge_id}/#"


def edge_notices(edge_id: str) -> str:
    """Broker -> edge: a placed job's worker was lost, or the job is dead-lettered (QoS 1)."""
    return f"{ROOT}/edge/{edge_id}/notices"


def client_results(client_id: str) -> str:
    """The response topic the Python client asks results to be sent to."""
    return f"{ROOT}/clients/{client_id}/results"


def pool_work(zone: str, worker_id: str, edge_id: str) -> str:
    """Where edge ``edge_id`` sends a pool worker its work (zone-scoped)."""
    return f"{ROOT}/pool/{zone}/{worker_id}/work/{edge_id}"


def pool_work_all(zone: str, worker_id: str) -> str:
    """Subscription filter for a worker's work from every edge."""
    return f"{ROOT}/pool/{zone}/{worker_id}/work/+"


def worker_telemetry(worker_id: str) -> str:
    """A pool worker's load, every interval (QoS 0). Not under its zone: zones have varying
    depth, and the broker must subscribe to all telemetry without seeing any work topic."""
    return f"{ROOT}/worker/{worker_id}/telemetry"


def worker_status(worker_id: str) -> str:
    """Retained online/offline status of a worker; its Last Will says offline."""
    return f"{ROOT}/worker/{worker_id}/status"


def worker_capabilities(worker_id: str) -> str:
    """Retained: what a worker can run (providers, memory, models, batch size)."""
    return f"{ROOT}/worker/{worker_id}/capabilities"


def worker_all(kind: str) -> str:
    """Subscription filter for every worker's ``telemetry``, ``status`` or ``capabilities``."""
    return f"{ROOT}/worker/+/{kind}"


def placement_request(edge_id: str) -> str:
    """Where edge ``edge_id`` asks the campus broker for a placement."""
    return f"{ROOT}/broker/placement/request/{edge_id}"


def placement_requests_all() -> str:
    """Subscription filter for every edge's placement requests."""
    return f"{ROOT}/broker/placement/request/+"


def placement_requests_shared(group: str = "brokers") -> str:
    """The shared subscription broker replicas use, so each request goes to one of them."""
    return f"$share/{group}/{placement_requests_all()}"


def edge_telemetry_shared(group: str = "brokers") -> str:
    """The shared subscription broker replicas take the edges' telemetry on, so each sample
    goes to one of them (no placement needs it: it is for people and for Redis)."""
    return f"$share/{group}/{edge_telemetry_all()}"


def placement_release(edge_id: str) -> str:
    """Where edge ``edge_id`` hands back a placement it will not use (every replica
    listens)."""
    return f"{ROOT}/broker/placement/release/{edge_id}"


def placement_releases_all() -> str:
    """Subscription filter for every edge's releases."""
    return f"{ROOT}/broker/placement/release/+"


def placement_replies(edge_id: str) -> str:
    """An edge agent's response topic for placement replies."""
    return f"{ROOT}/edge/{edge_id}/placement"


def completion(worker_id: str) -> str:
    """Where worker ``worker_id`` reports each finished job to the broker (no image, no
    outputs)."""
    return f"{ROOT}/broker/completions/{worker_id}"


def completions_all() -> str:
    """Subscription filter for every worker's completion records."""
    return f"{ROOT}/broker/completions/+"


def usage(node_id: str) -> str:
    """Where node ``node_id`` (a worker or an edge) ships its signed usage records to the
    broker replicas (QoS 1; ``sluicegate.metering.shipper``)."""
    return f"{ROOT}/broker/usage/{node_id}"


def usage_all() -> str:
    """Subscription filter for every node's usage records (every replica hears each)."""
    return f"{ROOT}/broker/usage/+"


def usage_acks(node_id: str) -> str:
    """Broker -> node: which of its usage records a replica holds (QoS 1). Under ``node/``,
    for any kind of node, its id the third level as on ``edge/`` and ``worker/``."""
    return f"{ROOT}/node/{node_id}/usage-acks"


def broker_status(broker_id: str) -> str:
    """Retained online/offline status of a broker replica."""
    return f"{ROOT}/broker/{broker_id}/status"


def broker_status_all() -> str:
    """Subscription filter for every broker replica's status."""
    return f"{ROOT}/broker/+/status"


def policy() -> str:
    """The current signed policy, retained."""
    return f"{ROOT}/policy"


def node_probe(node_id: str) -> str:
    """A topic only ``node_id`` writes and reads and nothing in the product listens to:
    ``sluicegate doctor`` times QoS 1 round trips through Mosquitto there (not retained)."""
    return f"{ROOT}/probe/{node_id}"


# -- between sister campuses ---------------------------------------------------------------
# What campus A says to campus B lives under ``peer/A/B/``; the Mosquitto bridge between the
# two carries those two trees and nothing else (``sluicegate.mosquitto.bridge_lines``), and
# on each side the ACL lets only the other campus's bridge write the tree it sends.

PEER_BRIDGE_PREFIX = "peer."  # a bridge's identity: its certificate's CN, from the peer's CA


def peer_tree(sender_campus: str, receiver_campus: str) -> str:
    """Everything campus ``sender_campus`` says to ``receiver_campus`` (a filter)."""
    return f"{ROOT}/peer/{sender_campus}/{receiver_campus}/#"


def peer_agreement(sender_campus: str, receiver_campus: str) -> str:
    """The sender's signed half of the agreement (``policies.agreement``; retained)."""
    return f"{ROOT}/peer/{sender_campus}/{receiver_campus}/agreement"


def peer_summary(sender_campus: str, receiver_campus: str) -> str:
    """What the sender offers the receiver, signed by one of its broker replicas every
    second (retained, expiring): free slots, queue and service time, price per model."""
    return f"{ROOT}/peer/{sender_campus}/{receiver_campus}/summary"


def peer_probe(sender_campus: str, receiver_campus: str) -> str:
    """A broker replica's link probes to the receiver, and its echoes of the receiver's
    probes (``wire_peer.Probe``): the round trip and throughput of the link between them."""
    return f"{ROOT}/peer/{sender_campus}/{receiver_campus}/probe"


def peer_asks(sender_campus: str, receiver_campus: str) -> str:
    """The sender's brokers ask the receiver's for placements of their jobs
    (``wire_pool.PlacementRequest``; its origin is the sending campus, whatever it says)."""
    return f"{ROOT}/peer/{sender_campus}/{receiver_campus}/asks"


def peer_answers(sender_campus: str, receiver_campus: str) -> str:
    """The sender's brokers answer the receiver's asks (``wire_pool.PlacementReply``: a
    placement signed by the sender's broker, or a refusal that says why)."""
    return f"{ROOT}/peer/{sender_campus}/{receiver_campus}/answers"


def peer_usage(sender_campus: str, receiver_campus: str) -> str:
    """Usage records that concern the receiver, countersigned by the sender's broker (QoS 1):
    its workers' runs of the receiver's jobs, its edges' settlements of jobs the receiver's
    workers ran. Each side keeps the other's, so both settle the same jobs."""
    return f"{ROOT}/peer/{sender_campus}/{receiver_campus}/usage"


def peer_asks_shared(sender_campus: str, receiver_campus: str, group: str = "brokers") -> str:
    """The shared subscription the receiver's replicas take a peer's asks on: each ask is
    decided, reserved and answered by one of them."""
    return f"$share/{group}/{peer_asks(sender_campus, receiver_campus)}"


def peer_work(sender_campus: str, receiver_campus: str, worker_id: str, edge_id: str) -> str:
    """Where edge ``edge_id`` of the sending campus sends a job the receiving campus placed
    on its worker ``worker_id`` (the image and what the token is checked against, in a
    ``wire_peer`` envelope: no MQTT property crosses the bridge). The receiver's ACL lets
    only the sender's bridge write it, and the sender's lets only that edge write it."""
    return f"{ROOT}/peer/{sender_campus}/{receiver_campus}/work/{worker_id}/{edge_id}"


def peer_work_all(receiver_campus: str, worker_id: str) -> str:
    """Subscription filter for a worker's work from every sister campus."""
    return f"{ROOT}/peer/+/{receiver_campus}/work/{worker_id}/+"


def peer_returns(sender_campus: str, receiver_campus: str, edge_id: str, worker_id: str) -> str:
    """Where worker ``worker_id`` of the sending campus returns the result of a job that
    edge ``edge_id`` of the receiving campus sent it (in a ``wire_peer`` envelope)."""
    return f"{ROOT}/peer/{sender_campus}/{receiver_campus}/returns/{edge_id}/{worker_id}"


def peer_returns_all(receiver_campus: str, edge_id: str) -> str:
    """Subscription filter for the results sister campuses' workers return to one edge."""
    return f"{ROOT}/peer/+/{receiver_campus}/returns/{edge_id}/+"


def peer_notices(sender_campus: str, receiver_campus: str, edge_id: str) -> str:
    """The sender's brokers tell the receiver's what became of a job the receiver's edge
    ``edge_id`` sent to one of the sender's workers (``wire_pool.JobNotice``: its worker was
    lost); the receiver's broker passes it on to the edge if it relayed that placement."""
    return f"{ROOT}/peer/{sender_campus}/{receiver_campus}/notices/{edge_id}"


def notices_edge(topic: str) -> str:
    """The edge a :func:`peer_notices` topic is addressed to."""
    return topic.rpartition("/")[2]


def peer_notices_all(sender_campus: str, receiver_campus: str) -> str:
    """Subscription filter for the sender's notices to every edge of the receiver."""
    return f"{ROOT}/peer/{sender_campus}/{receiver_campus}/notices/+"


def peer_releases(sender_campus: str, receiver_campus: str) -> str:
    """The sender's brokers hand back placements on the receiver's workers that the
    sender's edges will not use (``wire_pool.PlacementRelease``, the worker named as the
    receiver names it): the receiver frees the slot at once."""
    return f"{ROOT}/peer/{sender_campus}/{receiver_campus}/releases"


def bridge_state(peer_campus: str) -> str:
    """Where this campus's Mosquitto says whether its bridge to ``peer_campus`` is up
    (``1``) or lost (``0``), retained; Mosquitto itself publishes it, to this campus only."""
    return f"{ROOT}/bridge/{peer_campus}/state"


def bridge_peer(topic: str) -> str:
    """The peer campus a :func:`bridge_state` topic is about."""
    return topic.removeprefix(f"{ROOT}/bridge/").partition("/")[0]


def peer_worker(worker_id: str, campus: str) -> str:
    """How an edge names a sister campus's worker among its own: ``<worker>@<campus>`` (no
    worker id can hold an ``@``, so it is never taken for one of this campus's)."""
    return f"{worker_id}@{campus}"


def campus_of(name: str) -> str:
    """The sister campus a :func:`peer_worker` or :func:`peer_edge` name is on; "" for a
    node of this campus's."""
    return name.partition("@")[2]


def peer_edge(edge_id: str, campus: str) -> str:
    """How a campus records a sister campus's edge among its own (the edge of a job the
    peer asked it to place): ``<edge>@<campus>``, as :func:`peer_worker` names workers."""
    return peer_worker(edge_id, campus)


def local_name(name: str) -> str:
    """The node a :func:`peer_worker` or :func:`peer_edge` name gives, as its campus names
    it (a name of this campus's unchanged)."""
    return name.partition("@")[0]


def peer_of(topic: str) -> str:
    """The campus that sent a message on a peer topic (``.../peer/<sender>/<receiver>/...``;
    only its bridge may write there)."""
    parts = topic.split("/")
    return parts[3] if len(parts) > 4 and parts[2] == "peer" else ""


def peer_bridge_identity(campus: str) -> str:
    """The MQTT identity of campus ``campus``'s bridge on a peer's Mosquitto."""
    return PEER_BRIDGE_PREFIX + check_id("campus", campus)


def sender(topic: str) -> str:
    """Who sent a message on a per-sender topic: the last level of a placement request,
    release, completion, return or work topic (the ACL lets only that node write it)."""
    return topic.rsplit("/", 1)[-1]


def node_of(topic: str) -> str:
    """The node a per-node topic belongs to: ``sluicegate/v1/edge/<id>/...``,
    ``.../worker/<id>/...`` or ``.../broker/<id>/...``."""
    parts = topic.split("/")
    return parts[3] if len(parts) > 3 else ""


def client_results_all() -> str:
    """Subscription filter for every client's default response topic."""
    return f"{ROOT}/clients/+/results"


def matches(topic_filter: str, topic: str) -> bool:
    """MQTT topic-filter matching with ``+`` (one level) and ``#`` (the rest)."""
    want = topic_filter.split("/")
    have = topic.split("/")
    for i, level in enumerate(want):
        if level == "#":
            return True
        if i >= len(have) or (level != "+" and level != have[i]):
            return False
    return len(want) == len(have)
