"""``sluicegate enroll list``: every identity the campus CA made, each with what the signed
policy says of it and, when it is not listed, the ``policy add-node`` line that lists it.

Nodes enroll here as the broker's enrollment endpoint enrolls them (a join token, a key made
by the node, its certificate request proved with the token, ``Authority.decide`` and
``record``); ``ca issue`` makes its own on this machine. The CLI runs in-process.
"""

from __future__ import annotations

import time
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from typer.testing import CliRunner

from policies import SigningKey
from sluicegate import pki
from sluicegate.app.cli import app
from sluicegate.enroll.authority import Authority, EnrollRequest
from sluicegate.enroll.token import claims_for, make_token, parse_token, proof
from tests.policies.policy_testkit import EXAMPLE

ANCHOR = "sha256:" + "ab" * 32


def _cli(*args: str | Path) -> str:
    done = CliRunner().invoke(app, [str(a) for a in args])
    assert done.exit_code == 0, (done.output, done.exception)
    return done.output


def _enroll(authority: Authority, node: str, role: str, zone: str) -> str:
    """Enroll ``node`` as a line PC, worker or app does; the key it made, as text."""
    now = time.time()
    claims = claims_for(
        node=node,
        role=role,  # type: ignore[arg-type]
        zone=zone,
        ttl_s=3600,
        now=now,
        url="https://broker.example:8780/v1/enroll",
        mqtt="mqtt.example:8883",
        ca=authority.ca_fingerprint,
        anchor=ANCHOR,
    )
    claims, secret = parse_token(make_token(authority.token_key, claims))
    key = SigningKey.generate()
    csr = pki.certificate_request(key.private, node)
    request = EnrollRequest(
        claims=claims,
        csr=csr.public_bytes(serialization.Encoding.PEM).decode(),
        proof=proof(secret, csr.public_bytes(serialization.Encoding.DER)),
        role=role,
    )
    authority.record(authority.decide(request, now=now), now=now)
    return key.public_text


def _line(listing: str, head: str) -> tuple[str, str]:
    """The line of ``listing`` that starts with ``head`` (exactly one), and the next."""
    lines = listing.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.startswith(head + " ")]
    return lines[at], lines[at + 1] if at + 1 < len(lines) else ""


def test_every_enrolled_role_is_listed_with_the_line_that_adds_it(tmp_path: Path) -> None:
    ca_dir = tmp_path / "ca"
    _cli("ca", "init", "--ca-dir", ca_dir, "--campus", "fab-north")
    authority = Authority(ca_dir)
    # An app first: the listing used to stop at it with KeyError: 'app'.
    _enroll(authority, "north-inspect", "app", "campus/fab-north")  # in [apps]
    _enroll(authority, "new-app", "app", "campus/fab-north")
    new_pc = _enroll(authority, "line-9-pc", "edge", "campus/fab-north/line-9")
    worker = _enroll(authority, "north-gpu-3", "pool", "campus/fab-north/dc")
    rekeyed = _enroll(authority, "north-l1-pc", "edge", "campus/fab-north/line-1")
    issued = _cli(
        "ca",
        "issue",
        "--ca-dir",
        ca_dir,
        "--node",
        "broker-2",
        "--state-dir",
        tmp_path / "broker-2",
    )
    _cli(
        "ca",
        "issue",
        "--ca-dir",
        ca_dir,
        "--node",
        "recorder",
        "--role",
        "observer",
        "--state-dir",
        tmp_path / "recorder",
    )

    listing = _cli("enroll", "list", "--ca-dir", ca_dir, "--policy", EXAMPLE)

    line, after = _line(listing, "app north-inspect")
    assert line.endswith("(in policy)")
    assert "add-node" not in after
    line, after = _line(listing, "app new-app")
    assert line.endswith("(NOT in policy)")
    assert "add-node <policy.toml> --app new-app --app-edge" in after
    assert "--key" not in after
    line, after = _line(listing, "edge line-9-pc")
    assert f"key {new_pc} (NOT in policy)" in line
    assert f"--edge line-9-pc --zone campus/fab-north/line-9 --key {new_pc}" in after
    line, after = _line(listing, "pool north-gpu-3")
    assert f"--worker north-gpu-3 --pool <pool> --key {worker}" in after
    line, after = _line(listing, "broker broker-2")
    broker_key = issued.rsplit("its key ", 1)[1].strip()
    assert f"key {broker_key} (NOT in policy)" in line
    assert f"--broker broker-2 --key {broker_key} --sign" in after
    assert "--pool" not in after
    line, _ = _line(listing, "observer recorder")
    assert "not a policy entry" in line
    assert "--observer recorder" in line
    line, after = _line(listing, "edge north-l1-pc")  # the policy lists another key
    assert f"key {rekeyed} (in policy with another key" in line
    assert "add-node" not in after


def test_without_a_policy_each_node_is_listed_plainly(tmp_path: Path) -> None:
    ca_dir = tmp_path / "ca"
    _cli("ca", "init", "--ca-dir", ca_dir, "--campus", "fab-north")
    key = _enroll(Authority(ca_dir), "new-app", "app", "campus/fab-north")
    listing = _cli("enroll", "list", "--ca-dir", ca_dir)
    assert listing.splitlines() == [f"app new-app zone campus/fab-north key {key}"]


def test_ca_issue_makes_only_identities_that_do_not_enroll(tmp_path: Path) -> None:
    ca_dir = tmp_path / "ca"
    _cli("ca", "init", "--ca-dir", ca_dir, "--campus", "fab-north")
    done = CliRunner().invoke(
        app,
        [
            "ca",
            "issue",
            "--ca-dir",
            str(ca_dir),
            "--node",
            "line-9-pc",
            "--role",
            "edge",
            "--state-dir",
            str(tmp_path / "pc"),
        ],
    )
    assert done.exit_code == 2
    assert "--role 'edge'" in done.output
    assert "enroll token" in done.output
    assert not (tmp_path / "pc" / "node.key").exists()
    assert Authority(ca_dir).enrolled() == []
