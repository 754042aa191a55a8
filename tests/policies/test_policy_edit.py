"""Adding nodes to a policy the way officers do (``policies.edit``, ``policy add-node``), and
the policy's identity lookups that the broker, edges and workers ask."""

from __future__ import annotations

from pathlib import Path

import pytest
from policy_testkit import EXAMPLE, base_doc, key, policy_of, to_toml
from typer.testing import CliRunner

from policies.cli import app
from policies.edit import add_node
from policies.errors import KeyFileError, PolicyError, PolicyParseError
from policies.loader import load_policy
from policies.sealing import SealingKey
from policies.signing import accept_policy, parse_signatures

TEXT = EXAMPLE.read_text()
NEW = key("line-5-pc").public_text
SEAL = SealingKey.from_seed(bytes(range(32)))


@pytest.mark.parametrize(
    ("kind", "node", "options", "check"),
    [
        (
            "edge",
            "line-5-pc",
            {"key": NEW, "zone": "campus/fab-north/line-2"},
            lambda p: p.edge("line-5-pc").zone == "campus/fab-north/line-2",
        ),
        (
            "worker",
            "north-gpu-3",
            {"key": NEW, "pool": "north-dc-gpu"},
            lambda p: p.worker("north-gpu-3").zone == "campus/fab-north/dc",
        ),
        (
            "worker",
            "west-gpu-1",
            {"key": NEW, "pool": "west", "zone": "campus/fab-north/dc"},
            lambda p: p.worker("west-gpu-1").pool == "west",
        ),
        (
            "worker",
            "north-gpu-3",
            {"key": NEW, "pool": "north-dc-gpu", "encryption_key": SEAL.public_text},
            lambda p: p.seal_key("north-gpu-3", SEAL.key_id) == SEAL.public,
        ),
        (
            "worker",
            "west-gpu-2",
            {
                "key": NEW,
                "pool": "west",
                "zone": "campus/fab-north/dc",
                "encryption_key": SEAL.public_text,
            },
            lambda p: p.seal_key("west-gpu-2", SEAL.key_id) == SEAL.public,
        ),
        ("broker", "broker-2", {"key": NEW}, lambda p: p.broker_key("broker-2") is not None),
        (
            "app",
            "line-5-app",
            {"edges": ["north-l1-pc"], "results": ["app/line-5"]},
            lambda p: {a.app_id: a.results for a in p.apps}["line-5-app"] == ("app/line-5",),
        ),
    ],
)
def test_add_node_raises_the_version_and_keeps_the_comments(
    kind: str, node: str, options: dict[str, object], check: object
) -> None:
    text, policy = add_node(TEXT, kind, node, **options)  # type: ignore[arg-type]
    assert policy.version == load_policy(EXAMPLE).version + 1
    assert "# Root of trust: two of these three compliance officers" in text
    assert callable(check)
    assert check(policy)


@pytest.mark.parametrize(
    ("kind", "node", "options", "message"),
    [
        ("edge", "north-l1-pc", {"key": NEW, "zone": "campus/fab-north/line-1"}, "already"),
        ("edge", "line-5-pc", {"key": NEW}, "needs its zone"),
        ("edge", "line-5-pc", {"zone": "campus/fab-north/line-1"}, "needs its key"),
        ("edge", "line-5-pc", {"key": NEW, "zone": "Campus/Nowhere"}, "zone"),
        ("worker", "north-gpu-3", {"key": NEW}, "needs its pool"),
        ("worker", "north-gpu-3", {"key": NEW, "pool": "nope"}, "known: north-dc-gpu"),
        ("app", "line-5-app", {}, "edges it submits to"),
        (
            "worker",
            "north-gpu-3",
            {"key": NEW, "pool": "north-dc-gpu", "encryption_key": "x"},
            "x25519",
        ),
        (
            "edge",
            "line-5-pc",
            {"key": NEW, "zone": "campus/fab-north/line-1", "encryption_key": SEAL.public_text},
            "only a worker",
        ),
        ("app", "line-5-app", {"edges": ["ghost-pc"]}, "known edges"),
    ],
)
def test_add_node_refuses_what_would_not_load(
    kind: str, node: str, options: dict[str, object], message: str
) -> None:
    with pytest.raises(PolicyParseError, match=message):
        add_node(TEXT, kind, node, **options)  # type: ignore[arg-type]


def test_add_node_refuses_a_broken_key_and_broken_toml() -> None:
    with pytest.raises(KeyFileError):
        add_node(TEXT, "broker", "broker-2", key="ed25519:short")
    with pytest.raises(PolicyParseError, match="not valid TOML"):
        add_node("version = = 1", "broker", "broker-2", key=NEW)


def test_policy_lookups_name_each_nodes_entry() -> None:
    policy = load_policy(EXAMPLE)
    assert policy.edge("north-l1-pc") is not None
    assert policy.edge("ghost") is None
    assert policy.worker("cloud-gpu-1") is not None
    assert policy.worker("cloud-gpu-1").zone == "offsite/cloud-east"  # type: ignore[union-attr]
    assert policy.node_key("north-l1-pc") == key("north-l1-pc").public
    assert policy.node_key("north-gpu-1") == key("north-gpu-1").public
    assert policy.node_key("broker-1") == key("broker-1").public
    assert policy.node_key("ghost") is None
    assert policy.broker_key("ghost") is None
    assert policy.role_of(key("north-gpu-2").public) == "worker 'north-gpu-2'"
    assert policy.role_of(key("nobody").public) is None
    doc = base_doc()
    doc["apps"] = {"inspect": {"edges": ["north-l1-pc"], "results": ["app/n"]}}
    assert [a.app_id for a in policy_of(doc).apps] == ["inspect"]


def test_add_node_command_writes_signs_and_says_what_is_next(tmp_path: Path) -> None:
    runner = CliRunner()
    policy_file = tmp_path / "policy.toml"
    policy_file.write_text(to_toml(base_doc()))
    officer = tmp_path / "alice.key"
    officer.write_bytes(key("officer-alice").to_pem())
    args = ["add-node", str(policy_file), "--edge", "line-5-pc", "--key", NEW]
    result = runner.invoke(app, [*args, "--zone", "campus/fab-north/line-1"])
    assert result.exit_code == 0, result.output
    assert "now v2" in result.output
    assert "sign it:" in result.output
    again = runner.invoke(app, [*args, "--zone", "campus/fab-north/line-1"])
    assert again.exit_code == 1
    assert "already listed" in again.output
    both = runner.invoke(app, ["add-node", str(policy_file), "--edge", "a", "--broker", "b"])
    assert both.exit_code == 1
    assert "exactly one" in both.output
    signed = runner.invoke(
        app,
        [
            "add-node",
            str(policy_file),
            "--broker",
            "broker-2",
            "--key",
            NEW,
            "--sign",
            str(officer),
        ],
    )
    assert signed.exit_code == 0, signed.output
    policy = load_policy(policy_file)
    assert policy.version == 3
    bundle = parse_signatures(policy_file.with_name("policy.toml.sig").read_bytes())
    assert bundle.digest == policy.digest
    assert "1 of 2 required" in signed.output
    with pytest.raises(PolicyError, match="needs 2 distinct signer keys"):
        accept_policy(policy, bundle, now=1_780_000_000.0, anchor=None)
    app_args = ["--app", "inspect", "--app-edge", "line-5-pc", "--results", "app/l5"]
    added = runner.invoke(app, ["add-node", str(policy_file), *app_args])
    assert added.exit_code == 0, added.output
    assert [a.app_id for a in load_policy(policy_file).apps] == ["inspect"]
