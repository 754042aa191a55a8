"""What a policy says of the node reading it: an edge or pool worker it does not list, one it
puts in another zone, one it lists with another key; said once by the node when it takes
the policy, and again when a later version puts it right.

The real tier runs an edge agent the policy does not list on a real Mosquitto: it serves,
and its log says it will get no placement and how to be listed.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest

from policies import SigningKey
from policies.keys import public_key_of
from sluicegate.app.servers import ServerProcess
from sluicegate.config import load_settings
from sluicegate.policy_standing import StandingLog, standing
from sluicegate.vision.runtime import ModelRegistry, default_models_dir
from tests.policies.policy_testkit import base_doc, key, policy_of
from tests.support import AgentThread, PlainClient, installed_policy

POLICY = policy_of(base_doc())
EDGE = next(iter(POLICY.edges))
WORKER = next(iter(POLICY.workers.values()))


def test_a_nodes_own_key_is_read_when_there_is_one(tmp_path: Path) -> None:
    own = key("reader")
    path = tmp_path / "node.key"
    path.write_bytes(own.to_pem())
    assert public_key_of(path) == own.public
    assert public_key_of(None) is None
    assert public_key_of(tmp_path / "missing.key") is None  # nothing to compare with


def test_a_listed_node_as_configured_has_nothing_said() -> None:
    assert standing(POLICY, "edge", EDGE.edge_id, EDGE.zone, EDGE.key) is None
    assert standing(POLICY, "pool", WORKER.worker_id, WORKER.zone, WORKER.key) is None
    assert standing(POLICY, "edge", EDGE.edge_id, None, None) is None  # nothing to compare


def test_an_unlisted_edge_is_told_it_gets_no_placement_and_the_line_that_lists_it() -> None:
    own = SigningKey.generate()
    found = standing(POLICY, "edge", "line-9-pc", "campus/x/line-9", own.public)
    assert found is not None
    assert found.text == (
        f"policy v{POLICY.version} does not list edge line-9-pc: the broker places none of "
        "its jobs: all run here"
    )
    assert (
        "sluicegate policy add-node <policy.toml> --edge line-9-pc --zone campus/x/line-9 "
        f"--key {own.public_text} --sign <officer key>"
    ) in found.fix


def test_an_unlisted_worker_is_told_the_broker_places_nothing_on_it() -> None:
    found = standing(POLICY, "pool", "gpu-9", "campus/dc", None)
    assert found is not None
    assert "does not list worker gpu-9: the broker places nothing on it" in found.text
    assert "--worker gpu-9 --pool <pool> --key <its key>" in found.fix


def test_another_zone_or_another_key_is_named_with_both_values() -> None:
    moved = standing(POLICY, "edge", EDGE.edge_id, "campus/elsewhere", None)
    assert moved is not None
    assert f"in zone {EDGE.zone!r}, its configuration says 'campus/elsewhere'" in moved.text
    other = SigningKey.generate()
    rekeyed = standing(POLICY, "pool", WORKER.worker_id, WORKER.zone, other.public)
    assert rekeyed is not None
    assert f"not its own {other.public_text}" in rekeyed.text


def test_the_log_warns_and_says_when_a_later_version_puts_it_right(
    caplog: pytest.LogCaptureFixture,
) -> None:
    said = StandingLog(f"edge {EDGE.edge_id}")
    caplog.set_level(logging.INFO, logger="sluicegate.policy_standing")
    said.heard(POLICY, standing(POLICY, "edge", EDGE.edge_id, "campus/elsewhere", None))
    said.heard(POLICY, None)
    said.heard(POLICY, None)  # nothing more to say
    assert [(r.levelname, r.getMessage()[:30]) for r in caplog.records] == [
        ("WARNING", f"policy v{POLICY.version} puts edge {EDGE.edge_id}"[:30]),
        ("INFO", f"policy v{POLICY.version} lists edge {EDGE.edge_id}"[:30]),
    ]


@pytest.mark.integration
def test_an_edge_the_policy_does_not_list_serves_and_says_it_gets_no_placement(
    mosquitto: ServerProcess,
    tmp_path_factory: pytest.TempPathFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = tmp_path_factory.mktemp("unlisted-edge")
    own = key("unlisted-edge")
    key_file = state / "edge.key"
    key_file.write_bytes(own.to_pem())
    edge_id = f"edge-{uuid.uuid4().hex[:8]}"
    settings = load_settings(
        mqtt={"port": mosquitto.port, "plaintext": True},
        offload={"policy_file": installed_policy(), "state_dir": str(state)},
        edge={"id": edge_id, "zone": "campus/test/line-9", "key_file": str(key_file)},
    )
    caplog.set_level(logging.WARNING, logger="sluicegate.policy_standing")
    watcher = PlainClient(mosquitto.port)
    agent = AgentThread(settings, ModelRegistry.from_dir(default_models_dir()))
    try:
        agent.start(watcher)  # it serves
    finally:
        watcher.close()
        agent.stop()
    said = [r.getMessage() for r in caplog.records]
    assert any(f"does not list edge {edge_id}: the broker places none" in m for m in said), said
    assert any(
        f"--edge {edge_id} --zone campus/test/line-9 --key {own.public_text}" in m for m in said
    )
