"""The generated Mosquitto ACL: its shape, that it covers every topic of ``sluicegate.topics``
(a topic added without its rule fails here), and what a real, secured Mosquitto lets each
identity do with it: the attacks a plant must withstand, at the transport."""

from __future__ import annotations

import inspect
import queue
from pathlib import Path

import pytest
from typer.testing import CliRunner

from policies.evaluate import reachable_zones
from policies.loader import load_policy
from sluicegate import topics
from sluicegate.acl import render_acl
from sluicegate.app.campus import Campus
from sluicegate.app.cli import app
from tests.policies.policy_testkit import EXAMPLE, PARTS_TERMS, base_doc, key, policy_of, site_doc
from tests.secure_kit import (
    TlsClient,
    foreign_identity,
    issue_identity,
    refused_login,
    secured_campus,
)

POLICY = load_policy(EXAMPLE)
NORTH_DC = "campus/fab-north/dc"


def block(text: str, user: str) -> list[str]:
    return text.split(f"user {user}\n")[1].split("\n\n")[0].splitlines()


def allows(text: str, user: str, access: str, topic: str) -> bool:
    """Mosquitto's decision for ``user`` (patterns with %u, then its own block)."""
    own: list[list[str]] = []
    if f"user {user}\n" in text:
        own = [line.split(" ", 2)[1:] for line in block(text, user) if line.startswith("topic")]
    if any(a == "deny" and topics.matches(t, topic) for a, t in own):
        return False  # a user's deny line is checked first
    rules = [line.split(" ", 2)[1:] for line in text.splitlines() if line.startswith("pattern ")]
    rules = [[a, t.replace("%u", user)] for a, t in rules] + own
    return any(a in (access, "readwrite") and topics.matches(t, topic) for a, t in rules)


def test_every_node_writes_only_topics_that_carry_its_own_id() -> None:
    text = render_acl(POLICY)
    patterns = [line for line in text.splitlines() if line.startswith("pattern write")]
    assert patterns, text
    assert all("%u" in line for line in patterns)
    assert text == render_acl(POLICY)  # deterministic
    assert "user anonymous" not in text


def test_workers_read_only_their_own_work_and_answer_only_edges_that_reach_them() -> None:
    text = render_acl(POLICY)
    north = block(text, "north-gpu-1")
    assert [r for r in north if r.startswith("topic read")] == [
        f"topic read sluicegate/v1/pool/{NORTH_DC}/north-gpu-1/work/+"
    ]
    assert "topic write sluicegate/v1/edge/north-l1-pc/returns/north-gpu-1" in north
    cloud = block(text, "cloud-gpu-1")
    assert "topic write sluicegate/v1/edge/south-l2-pc/returns/cloud-gpu-1" in cloud
    assert not any("#" in r for r in cloud)
    # Where no class from an edge's zone may go, its workers get nothing of that edge's.
    doc = base_doc()
    doc["classes"] = {"wafer-image": {"allow": ["campus/fab-north/**"]}}
    doc["edges"]["south-l1-pc"] = {"zone": "campus/fab-south/line-1", "key": key("s").public_text}
    narrow = render_acl(policy_of(doc))
    assert reachable_zones(policy_of(doc), "campus/fab-south/line-1") == [
        "campus/fab-north/dc",
        "campus/fab-north/line-1",
    ]
    assert not any("/work/" in r for r in block(narrow, "south-npu-1")[2:] if "write" in r)
    assert "topic write sluicegate/v1/edge/south-l1-pc/returns/south-npu-1" not in narrow
    assert "topic write sluicegate/v1/edge/south-l1-pc/returns/north-gpu-1" in narrow


def test_edges_send_work_only_where_a_class_may_go_and_answer_only_their_apps() -> None:
    text = render_acl(POLICY)
    edge = block(text, "north-l1-pc")
    assert f"topic write sluicegate/v1/pool/{NORTH_DC}/north-gpu-1/work/north-l1-pc" in edge
    assert "topic write sluicegate/v1/pool/offsite/cloud-east/cloud-gpu-1/work/north-l1-pc" in edge
    assert "topic write app/fab-north/#" in edge
    assert "topic write sluicegate/v1/clients/north-inspect/results" in edge
    assert not any("app/fab-south" in r or "south-inspect" in r for r in edge)
    app = block(text, "north-inspect")
    assert "topic write sluicegate/v1/edge/north-l1-pc/jobs" in app
    assert "topic read app/fab-north/#" in app
    assert not any("south" in r for r in app)


def test_brokers_read_requests_and_telemetry_but_never_a_work_topic() -> None:
    text = render_acl(POLICY, observers=("ops",))
    broker = block(text, "broker-1")
    assert "topic read sluicegate/v1/broker/placement/request/+" in broker
    assert "topic write sluicegate/v1/edge/+/placement" in broker
    assert "topic write sluicegate/v1/policy" in broker
    assert not any("/pool/" in r or "returns" in r or "/jobs" in r for r in broker)
    ops = block(text, "ops")
    assert all(r.startswith("topic read") for r in ops[2:])
    assert not any("/pool/" in r or "results" in r for r in ops)


def test_observers_read_what_the_twins_recorder_needs_and_write_nothing() -> None:
    text = render_acl(POLICY, observers=("ops",))
    for topic in (
        topics.edge_trace("north-l1-pc"),
        topics.edge_telemetry("north-l1-pc"),
        topics.worker_capabilities("north-gpu-1"),
        topics.completion("north-gpu-1"),
        topics.policy(),
    ):
        assert allows(text, "ops", "read", topic), topic
    for topic in (
        topics.edge_trace("north-l1-pc"),
        topics.completion("north-gpu-1"),
        topics.pool_work(NORTH_DC, "north-gpu-1", "north-l1-pc"),
        topics.edge_returns("north-l1-pc", "north-gpu-1"),
    ):
        assert not allows(text, "ops", "write", topic), topic
    assert not allows(text, "ops", "read", topics.pool_work(NORTH_DC, "north-gpu-1", "x"))
    assert not allows(text, "ops", "read", topics.edge_returns("north-l1-pc", "north-gpu-1"))


# Every topic function, with who writes it in the example policy and who reads it. A topic
# function added to sluicegate.topics without a row here fails the coverage test below.
FLOWS: dict[str, list[tuple[str, str, str]]] = {
    "edge_submit": [("north-inspect", "write", topics.edge_submit("north-l1-pc"))],
    "edge_schedule": [
        ("north-inspect", "write", topics.edge_schedule("north-l1-pc")),
        ("north-l1-pc", "read", topics.edge_schedule("north-l1-pc")),
    ],
    "edge_announced": [
        ("north-l1-pc", "write", topics.edge_announced("north-l1-pc")),
        ("broker-1", "read", topics.edge_announced("north-l1-pc")),
        ("ops", "read", topics.edge_announced("north-l1-pc")),
    ],
    "edge_telemetry": [
        ("north-l1-pc", "write", topics.edge_telemetry("north-l1-pc")),
        ("broker-1", "read", topics.edge_telemetry("north-l1-pc")),
    ],
    "edge_trace": [
        ("north-l1-pc", "write", topics.edge_trace("north-l1-pc")),
        ("ops", "read", topics.edge_trace("north-l1-pc")),
    ],
    "edge_status": [
        ("north-l1-pc", "write", topics.edge_status("north-l1-pc")),
        ("north-inspect", "read", topics.edge_status("north-l1-pc")),
    ],
    "edge_returns": [
        ("north-gpu-1", "write", topics.edge_returns("north-l1-pc", "north-gpu-1")),
        ("north-l1-pc", "read", topics.edge_returns("north-l1-pc", "north-gpu-1")),
    ],
    "edge_notices": [
        ("broker-1", "write", topics.edge_notices("north-l1-pc")),
        ("north-l1-pc", "read", topics.edge_notices("north-l1-pc")),
    ],
    "client_results": [
        ("north-l1-pc", "write", topics.client_results("north-inspect")),
        ("north-inspect", "read", topics.client_results("north-inspect")),
    ],
    "pool_work": [
        ("north-l1-pc", "write", topics.pool_work(NORTH_DC, "north-gpu-1", "north-l1-pc")),
        ("north-gpu-1", "read", topics.pool_work(NORTH_DC, "north-gpu-1", "north-l1-pc")),
    ],
    "worker_telemetry": [
        ("north-gpu-1", "write", topics.worker_telemetry("north-gpu-1")),
        ("broker-1", "read", topics.worker_telemetry("north-gpu-1")),
    ],
    "worker_status": [
        ("north-gpu-1", "write", topics.worker_status("north-gpu-1")),
        ("broker-1", "read", topics.worker_status("north-gpu-1")),
    ],
    "worker_capabilities": [
        ("north-gpu-1", "write", topics.worker_capabilities("north-gpu-1")),
        ("broker-1", "read", topics.worker_capabilities("north-gpu-1")),
    ],
    "placement_request": [
        ("north-l1-pc", "write", topics.placement_request("north-l1-pc")),
        ("broker-1", "read", topics.placement_request("north-l1-pc")),
    ],
    "placement_release": [
        ("north-l1-pc", "write", topics.placement_release("north-l1-pc")),
        ("broker-1", "read", topics.placement_release("north-l1-pc")),
    ],
    "placement_replies": [
        ("broker-1", "write", topics.placement_replies("north-l1-pc")),
        ("north-l1-pc", "read", topics.placement_replies("north-l1-pc")),
    ],
    "completion": [
        ("north-gpu-1", "write", topics.completion("north-gpu-1")),
        ("broker-1", "read", topics.completion("north-gpu-1")),
    ],
    "usage": [
        ("north-gpu-1", "write", topics.usage("north-gpu-1")),
        ("north-l1-pc", "write", topics.usage("north-l1-pc")),
        ("broker-1", "read", topics.usage("north-gpu-1")),
        ("broker-1", "read", topics.usage("north-l1-pc")),
    ],
    "usage_acks": [
        ("broker-1", "write", topics.usage_acks("north-gpu-1")),
        ("north-gpu-1", "read", topics.usage_acks("north-gpu-1")),
        ("north-l1-pc", "read", topics.usage_acks("north-l1-pc")),
    ],
    "broker_status": [
        ("broker-1", "write", topics.broker_status("broker-1")),
        ("north-l1-pc", "read", topics.broker_status("broker-1")),
    ],
    "policy": [
        ("broker-1", "write", topics.policy()),
        ("north-l1-pc", "read", topics.policy()),
        ("north-gpu-1", "read", topics.policy()),
    ],
    "node_probe": [
        (node, access, topics.node_probe(node))
        for node in ("north-l1-pc", "north-gpu-1", "broker-1")
        for access in ("write", "read")
    ],
}
# Filters and helpers: they name no topic of their own.
NOT_TOPICS = {
    "check_id",
    "matches",
    "sender",
    "node_of",
    "peer_tree",
    "peer_of",
    "peer_bridge_identity",
    "peer_worker",
    "peer_edge",
    "local_name",
    "campus_of",
    "bridge_peer",
    "notices_edge",
}

# Between sister campuses, on the ACL of a campus ("north-site") whose policy names a peer.
PEERED = policy_of(site_doc("north-site", "south-site", send=PARTS_TERMS, receive=PARTS_TERMS))
SOUTH_BRIDGE = topics.peer_bridge_identity("south-site")
N_EDGE, N_WORKER, S_EDGE, S_WORKER = (
    "north-l1-pc",
    "north-site-gpu-1",
    "south-pc",
    "south-site-gpu-1",
)
PEER_FLOWS: dict[str, list[tuple[str, str, str]]] = {
    name: [
        ("north-site-broker-1", "write", fn("north-site", "south-site")),
        (SOUTH_BRIDGE, "read", fn("north-site", "south-site")),
        (SOUTH_BRIDGE, "write", fn("south-site", "north-site")),
        ("north-site-broker-1", "read", fn("south-site", "north-site")),
    ]
    for name, fn in (
        ("peer_agreement", topics.peer_agreement),
        ("peer_summary", topics.peer_summary),
        ("peer_probe", topics.peer_probe),
        ("peer_asks", topics.peer_asks),
        ("peer_answers", topics.peer_answers),
        ("peer_usage", topics.peer_usage),
        ("peer_releases", topics.peer_releases),
    )
}
PEER_FLOWS["peer_notices"] = [
    ("north-site-broker-1", "write", topics.peer_notices("north-site", "south-site", S_EDGE)),
    (SOUTH_BRIDGE, "read", topics.peer_notices("north-site", "south-site", S_EDGE)),
    (SOUTH_BRIDGE, "write", topics.peer_notices("south-site", "north-site", N_EDGE)),
    ("north-site-broker-1", "read", topics.peer_notices("south-site", "north-site", N_EDGE)),
]
# Mosquitto itself publishes its bridge's state, to this campus only: the brokers read it.
PEER_FLOWS["bridge_state"] = [
    ("north-site-broker-1", "read", topics.bridge_state("south-site")),
]
# A job's image and its result, each way: our edge to their worker, their edge to ours.
PEER_FLOWS["peer_work"] = [
    (N_EDGE, "write", topics.peer_work("north-site", "south-site", S_WORKER, N_EDGE)),
    (SOUTH_BRIDGE, "read", topics.peer_work("north-site", "south-site", S_WORKER, N_EDGE)),
    (SOUTH_BRIDGE, "write", topics.peer_work("south-site", "north-site", N_WORKER, S_EDGE)),
    (N_WORKER, "read", topics.peer_work("south-site", "north-site", N_WORKER, S_EDGE)),
]
PEER_FLOWS["peer_returns"] = [
    (N_WORKER, "write", topics.peer_returns("north-site", "south-site", S_EDGE, N_WORKER)),
    (SOUTH_BRIDGE, "read", topics.peer_returns("north-site", "south-site", S_EDGE, N_WORKER)),
    (SOUTH_BRIDGE, "write", topics.peer_returns("south-site", "north-site", N_EDGE, S_WORKER)),
    (N_EDGE, "read", topics.peer_returns("south-site", "north-site", N_EDGE, S_WORKER)),
]


def test_every_topic_of_the_topics_module_has_its_flows_in_the_acl() -> None:
    functions = {
        name
        for name, fn in inspect.getmembers(topics, inspect.isfunction)
        if fn.__module__ == topics.__name__
        and name not in NOT_TOPICS
        and not name.endswith(("_all", "_shared", "_inbox"))
    }
    assert functions == set(FLOWS) | set(PEER_FLOWS), "add the topic's writer and reader"
    text = render_acl(POLICY, observers=("ops",))
    for name, flows in FLOWS.items():
        for user, access, topic in flows:
            assert allows(text, user, access, topic), f"{name}: {user} may not {access} {topic}"
    peered = render_acl(PEERED)
    for name, flows in PEER_FLOWS.items():
        for user, access, topic in flows:
            assert allows(peered, user, access, topic), f"{name}: {user} may not {access} {topic}"


@pytest.mark.parametrize(
    ("user", "access", "topic"),
    [
        (SOUTH_BRIDGE, "write", topics.peer_summary("north-site", "south-site")),  # forge ours
        (SOUTH_BRIDGE, "read", topics.peer_summary("north-site", "west-site")),
        (SOUTH_BRIDGE, "write", topics.edge_submit("north-l1-pc")),
        (SOUTH_BRIDGE, "read", topics.edge_telemetry("north-l1-pc")),
        (SOUTH_BRIDGE, "read", topics.policy()),
        ("north-l1-pc", "write", topics.peer_summary("north-site", "south-site")),
        ("north-l1-pc", "read", topics.peer_agreement("south-site", "north-site")),
        ("north-site-broker-1", "write", topics.peer_summary("south-site", "north-site")),
        # an edge sends only its own work, a worker reads only its own and returns as itself
        (N_EDGE, "write", topics.peer_work("north-site", "south-site", S_WORKER, "other-pc")),
        (N_EDGE, "read", topics.peer_returns("south-site", "north-site", "other-pc", S_WORKER)),
        (N_EDGE, "read", topics.peer_work("south-site", "north-site", N_WORKER, S_EDGE)),
        (N_WORKER, "read", topics.peer_work("south-site", "north-site", "other-gpu", S_EDGE)),
        (N_WORKER, "write", topics.peer_returns("north-site", "south-site", S_EDGE, "other-gpu")),
        (N_WORKER, "write", topics.peer_work("north-site", "south-site", S_WORKER, N_WORKER)),
        (
            "north-site-broker-1",
            "read",
            topics.peer_work("south-site", "north-site", N_WORKER, S_EDGE),
        ),
        # nobody but Mosquitto says a bridge's state; no peer's bridge hears it
        ("north-site-broker-1", "write", topics.bridge_state("south-site")),
        (N_EDGE, "write", topics.bridge_state("south-site")),
        (SOUTH_BRIDGE, "write", topics.bridge_state("south-site")),
        (SOUTH_BRIDGE, "read", topics.bridge_state("south-site")),
        # notices to an edge come from our brokers, never straight from a peer's
        (SOUTH_BRIDGE, "write", topics.edge_notices(N_EDGE)),
        (N_EDGE, "read", topics.peer_notices("south-site", "north-site", N_EDGE)),
    ],
)
def test_a_peer_s_bridge_and_the_campus_s_nodes_stay_in_their_lanes(
    user: str, access: str, topic: str
) -> None:
    assert not allows(render_acl(PEERED), user, access, topic)


@pytest.mark.parametrize(
    ("user", "access", "topic"),
    [
        ("north-l1-pc", "write", topics.edge_telemetry("north-l2-pc")),
        ("north-l1-pc", "write", topics.edge_trace("north-l2-pc")),
        ("north-l1-pc", "read", topics.edge_trace("north-l2-pc")),
        ("north-l1-pc", "write", topics.placement_request("north-l2-pc")),
        ("north-l1-pc", "write", topics.placement_release("north-l2-pc")),
        ("north-l1-pc", "write", topics.pool_work(NORTH_DC, "north-gpu-1", "north-l2-pc")),
        ("north-l1-pc", "write", topics.edge_returns("north-l1-pc", "north-gpu-1")),
        ("north-l1-pc", "write", topics.policy()),
        ("north-l1-pc", "write", "app/fab-south/results"),
        ("north-l1-pc", "read", topics.pool_work(NORTH_DC, "north-gpu-1", "north-l1-pc")),
        ("north-gpu-1", "read", topics.pool_work(NORTH_DC, "north-gpu-2", "north-l1-pc")),
        ("north-gpu-1", "write", topics.completion("north-gpu-2")),
        ("north-gpu-1", "write", topics.edge_notices("north-l1-pc")),
        ("north-gpu-1", "write", topics.edge_returns("north-l1-pc", "north-gpu-2")),
        ("broker-1", "read", topics.pool_work(NORTH_DC, "north-gpu-1", "north-l1-pc")),
        ("broker-1", "write", topics.edge_returns("north-l1-pc", "broker-1")),
        ("north-inspect", "write", topics.edge_submit("south-l1-pc")),
        ("north-inspect", "write", topics.edge_schedule("south-l1-pc")),
        ("north-l1-pc", "write", topics.edge_announced("north-l2-pc")),
        ("stranger", "write", topics.edge_schedule("north-l1-pc")),
        ("north-inspect", "read", topics.client_results("south-inspect")),
        ("stranger", "read", topics.edge_telemetry("north-l1-pc")),
        ("stranger", "write", topics.edge_submit("north-l1-pc")),
        ("north-l1-pc", "read", topics.node_probe("north-gpu-1")),
        ("north-gpu-1", "write", topics.node_probe("north-l1-pc")),
        ("north-gpu-1", "write", topics.usage("north-gpu-2")),
        ("north-gpu-1", "read", topics.usage("north-gpu-2")),
        ("north-gpu-1", "read", topics.usage_acks("north-gpu-2")),
        ("north-gpu-1", "write", topics.usage_acks("north-gpu-1")),
        ("north-l1-pc", "write", topics.usage("north-gpu-1")),
        ("observer-x", "read", topics.usage("north-gpu-1")),
    ],
)
def test_what_no_identity_may_do(user: str, access: str, topic: str) -> None:
    assert not allows(render_acl(POLICY), user, access, topic)


# -- a real, secured Mosquitto --------------------------------------------------------


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Campus:
    root = tmp_path_factory.mktemp("acl-campus")
    with secured_campus(root) as (campus, _server):
        issue_identity(campus, "line-9-pc")  # enrolled: a campus certificate, not in policy
        foreign_identity(campus, "line-1-pc", "impostor")  # the right name, another CA
        yield campus


def nothing(client: TlsClient, wait: float = 0.5) -> bool:
    try:
        got = client.get(timeout=wait)
    except queue.Empty:
        return True
    raise AssertionError(f"unexpected delivery {got}")


@pytest.mark.integration
def test_anonymous_and_foreign_certificates_cannot_connect(secured: Campus) -> None:
    # TLS 1.3: the server's "certificate required" / "unknown CA" alert comes after the
    # client's handshake, so the refusal is a connection closed before any CONNACK.
    assert refused_login(secured, None)
    assert refused_login(secured, "impostor")  # CN line-1-pc, but from another CA
    TlsClient(secured, "line-1-pc").close()  # the real one logs in


@pytest.mark.integration
def test_an_edge_cannot_speak_for_another_edge(secured: Campus) -> None:
    watcher = TlsClient(secured, "observer")
    broker = TlsClient(secured, "broker-1")
    edge = TlsClient(secured, "line-2-pc")
    try:
        watcher.subscribe(topics.edge_telemetry_all())
        broker.subscribe(topics.placement_requests_all())
        for topic in (topics.edge_telemetry("line-1-pc"), topics.placement_request("line-1-pc")):
            assert edge.publish(topic, b"forged").is_failure  # PUBACK: not authorised
        edge.publish(topics.edge_telemetry("line-2-pc"), b"own")
        edge.publish(topics.placement_request("line-2-pc"), b"own")
        got = watcher.get()
        assert (got.topic, got.payload) == (topics.edge_telemetry("line-2-pc"), b"own")
        got = broker.get()
        assert (got.topic, got.payload) == (topics.placement_request("line-2-pc"), b"own")
        assert nothing(watcher)
        assert nothing(broker)
    finally:
        for client in (watcher, broker, edge):
            client.close()


@pytest.mark.integration
def test_a_client_claiming_a_workers_id_reads_none_of_its_work(secured: Campus) -> None:
    # With the worker's name as its client id but another identity's certificate: Mosquitto
    # replaces the client id by the certificate's name, and the ACL gives it nothing.
    intruder = TlsClient(secured, "line-9-pc", client_id="north-cpu-1")
    worker = TlsClient(secured, "north-cpu-1")
    edge = TlsClient(secured, "line-2-pc")
    try:
        intruder.subscribe(topics.pool_work_all("campus/fab-north/dc", "north-cpu-1"))
        intruder.subscribe("sluicegate/v1/pool/#")
        worker.subscribe(topics.pool_work_all("campus/fab-north/dc", "north-cpu-1"))
        sent = topics.pool_work("campus/fab-north/dc", "north-cpu-1", "line-2-pc")
        edge.publish(sent, b"image")
        got = worker.get()
        assert (got.topic, got.payload) == (sent, b"image")
        assert nothing(intruder)
    finally:
        for client in (intruder, worker, edge):
            client.close()


def test_policy_acl_writes_to_stdout_and_to_a_file(tmp_path: Path) -> None:
    runner = CliRunner()
    done = runner.invoke(app, ["policy", "acl", str(EXAMPLE)])
    assert done.exit_code == 0, done.output
    assert done.output.startswith("# Mosquitto ACL generated")
    target = tmp_path / "acl"
    done = runner.invoke(app, ["policy", "acl", str(EXAMPLE), "--out", str(target)])
    assert done.exit_code == 0, done.output
    assert target.read_text() == render_acl(load_policy(EXAMPLE))


def test_policy_acl_names_a_bad_policy_file(tmp_path: Path) -> None:
    bad = tmp_path / "campus.toml"
    bad.write_text('version = "x"\n')
    done = CliRunner().invoke(app, ["policy", "acl", str(bad)])
    assert done.exit_code == 1
    assert "campus.toml" in done.output
