"""Enrollment as a plant engineer and an operator run it: a join token from ``sluicegate
enroll token``, ``sluicegate edge install --join`` on the new line PC, the officers' ``policy
add-node``, and the node serving once the signed policy lists it; and every kind of bad
token refused by name and audited, against a real campus broker, Mosquitto and Redis."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sluicegate import AsyncClient, pki, topics, wire
from sluicegate.app.broker_http import get_json
from sluicegate.app.campus import Campus
from sluicegate.app.localcampus import LocalCampus, start_campus_mosquitto
from sluicegate.app.servers import ServerProcess, free_port, running
from sluicegate.enroll.authority import Authority
from sluicegate.enroll.token import JoinClaims, make_token, parse_token
from sluicegate.wire_pool import PlacementReply, PlacementRequest
from tests.image_bytes import sample_jpeg
from tests.policies.policy_testkit import key
from tests.secure_kit import TlsClient, audited
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NEW_PC, NEW_ZONE, NEW_APP = "line-3-pc", "campus/fab-north/line-2", "app-line-3"


@pytest.fixture(scope="module")
def plant(
    tmp_path_factory: pytest.TempPathFactory, fresh_redis_db: Callable[[], str]
) -> Iterator[tuple[LocalCampus, ServerProcess]]:
    root = tmp_path_factory.mktemp("enroll-campus")
    campus = LocalCampus(
        root,
        mqtt_port=free_port(),
        redis_url=fresh_redis_db(),
        key_for=key,
        nodes=("broker-1", "north-cpu-1"),
    )
    with running(start_campus_mosquitto(campus.write())) as mosquitto:
        campus.start()
        yield campus, mosquitto
        campus.stop()


def cli(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sluicegate.app.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def token(campus: LocalCampus, node: str, role: str, zone: str, ttl: str = "1h") -> str:
    files = campus.write()
    done = cli(
        "enroll",
        "token",
        "--ca-dir",
        files.root,
        "--node",
        node,
        "--role",
        role,
        "--zone",
        zone,
        "--url",
        f"http://127.0.0.1:{campus.http_port}/v1/enroll",
        "--mqtt",
        f"127.0.0.1:{files.mqtt_port}",
        "--policy",
        files.policy_file,
        "--ttl",
        ttl,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def as_identity(files: Campus, name: str, state: Path) -> None:
    """Let the test log in with the key and certificate enrollment left in ``state``."""
    shutil.copy(state / "node.pem", files.cert_file(name))
    files.key_files[name] = state / "node.key"


def test_bad_join_tokens_are_refused_by_name_and_audited(
    plant: tuple[LocalCampus, ServerProcess], tmp_path: Path
) -> None:
    campus, _ = plant
    files = campus.write()
    good = token(campus, "line-7-pc", "edge", NEW_ZONE)
    first = cli("edge", "install", "--join", good, "--root", tmp_path / "a")
    assert first.returncode == 0, first.stderr
    cases: dict[str, tuple[list[str | Path], str]] = {}
    # Used once already.
    cases["join.reused"] = (["edge", "install", "--join", good, "--root", tmp_path / "b"], "")
    # For an edge, used to install a worker.
    scoped = token(campus, "line-8-pc", "edge", NEW_ZONE)
    cases["join.wrong_scope"] = (
        ["pool", "install", "--join", scoped, "--root", tmp_path / "c"],
        "",
    )
    # Made by this campus's authority, but aged past its expiry.
    claims, _ = parse_token(token(campus, "line-9-pc", "edge", NEW_ZONE))
    authority = Authority(files.root)
    old = JoinClaims(**{**claims.model_dump(), "exp": int(time.time()) - 60})
    expired = make_token(authority.token_key, old)
    cases["join.expired"] = (["edge", "install", "--join", expired, "--root", tmp_path / "d"], "")
    # A claim changed after it was made: another node's name.
    forged_claims = JoinClaims(**{**claims.model_dump(), "node": "line-1-pc"})
    forged = make_token(b"\x00" * 32, forged_claims)
    cases["join.bad_proof"] = (["edge", "install", "--join", forged, "--root", tmp_path / "e"], "")
    for code, (argv, _) in cases.items():
        done = cli(*argv)
        assert done.returncode == 2, (code, done.stdout, done.stderr)
        assert code in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
        assert not (Path(argv[-1]) / "etc/sluicegate/edge.toml").exists()
    refused = wait_until(
        lambda: (r := audited(campus.redis_url, "enroll.refused")) and len(r) >= len(cases) and r,
        timeout=15,
    )
    assert {r["code"] for r in refused} >= set(cases)
    issued = audited(campus.redis_url, "enroll.issued")
    assert [r["node"] for r in issued if r["token"] == claims.id] == []
    assert "line-7-pc" in {r["node"] for r in issued}


def test_an_enrolled_line_pc_gets_placements_only_once_the_signed_policy_lists_it(
    plant: tuple[LocalCampus, ServerProcess], tmp_path: Path
) -> None:
    campus, mosquitto = plant
    files = campus.write()
    root = tmp_path / "line-pc"
    done = cli("edge", "install", "--join", token(campus, NEW_PC, "edge", NEW_ZONE), "--root", root)
    assert done.returncode == 0, done.stderr
    state = root / "var/lib/sluicegate/edge"
    assert (state / "node.key").stat().st_mode & 0o077 == 0  # its key, private, made here
    cert = pki.read_cert(state / "node.pem")
    pki.check_issued(cert, pki.read_cert(files.ca_file), now=time.time())
    assert pki.common_name(cert) == NEW_PC
    assert (state / "policy-anchor.json").exists()  # pinned: no trust on first use
    config_path = root / "etc/sluicegate/edge.toml"
    config = config_path.read_text()
    assert f'id = "{NEW_PC}"' in config
    assert str(state / "node.pem") in config
    listing = cli("enroll", "list", "--ca-dir", files.root, "--policy", files.policy_file)
    assert f"edge {NEW_PC}" in listing.stdout
    assert "NOT in policy" in listing.stdout

    # Enrolled but not listed: its requests are refused by name, and audited.
    as_identity(files, NEW_PC, state)
    job = f"probe-{uuid.uuid4().hex[:8]}"
    reply = ask_as(files, NEW_PC, job)
    assert (reply.status, reply.code) == ("refused", "edge.not_in_policy"), reply
    assert "not listed" in (reply.reason or "")
    assert wait_until(lambda: _job(campus, job), timeout=10)["code"] == "edge.not_in_policy"

    # The officers list it (and an app for its line), sign, regenerate the ACL.
    new_key = next(
        line.split(" key ")[1].split()[0]
        for line in listing.stdout.splitlines()
        if line.startswith(f"edge {NEW_PC}")
    )
    officer = files.key_files["officer"]
    for argv in (
        ["--edge", NEW_PC, "--zone", NEW_ZONE, "--key", new_key],
        ["--app", NEW_APP, "--app-edge", NEW_PC, "--results", "app/line-3"],
    ):
        added = cli("policy", "add-node", files.policy_file, *argv, "--sign", officer)
        assert added.returncode == 0, added.stderr
    acl = cli("policy", "acl", files.policy_file, "--observer", "observer", "--out", files.acl_file)
    assert acl.returncode == 0, acl.stderr
    os.kill(mosquitto.pid, signal.SIGHUP)  # Mosquitto reloads its ACL
    campus.restart("broker-1")  # serves (and publishes) the new version

    with (tmp_path / "edge.log").open("wb") as log:
        edge = subprocess.Popen(
            [sys.executable, "-m", "sluicegate.app.cli", "edge", "run", "--config", config_path],
            env={**os.environ, "SLUICEGATE_OFFLOAD__QUEUE_BOUND": "0"},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_online(files, NEW_PC)
        app_dir = tmp_path / "app"
        enrolled = cli(
            "enroll", "app", "--join", token(campus, NEW_APP, "app", NEW_ZONE), "--out-dir", app_dir
        )
        assert enrolled.returncode == 0, enrolled.stderr
        as_identity(files, NEW_APP, app_dir)
        results = asyncio.run(volley(files))
        assert all(r.status == "ok" for r in results), [r.reason for r in results]
        ran = {r.ran_on.node for r in results}
        assert ran <= {NEW_PC, "north-cpu-1"}
        asked = [r.offload for r in results if r.offload is not None]
        assert asked
        assert not any(o.code == "edge.not_in_policy" for o in asked)
        assert "north-cpu-1" in ran, [o.code for o in asked]  # placed, once listed
    finally:
        edge.send_signal(signal.SIGTERM)
        edge.wait(30)
        print((tmp_path / "edge.log").read_text()[-3000:])


def ask_as(files: Campus, edge: str, job: str) -> PlacementReply:
    client = TlsClient(files, edge)
    try:
        client.subscribe(topics.placement_replies(edge))
        request = PlacementRequest(
            job_id=job,
            edge_id=edge,
            model="defect-v1",
            data_class="wafer-image",
            payload_sha256="0" * 64,
            payload_bytes=10,
            priority=5,
            submitted_at=time.time(),
        )
        client.publish(topics.placement_request(edge), wire.dump(request))
        got = client.get()
        return PlacementReply.model_validate_json(got.payload)
    finally:
        client.close()


def wait_online(files: Campus, node: str) -> None:
    watcher = TlsClient(files, "observer")
    try:
        watcher.subscribe(topics.edge_status(node))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            got = watcher.get(timeout=max(0.1, deadline - time.monotonic()))
            if wire.NodeStatus.model_validate_json(got.payload).state == "online":
                return
        raise AssertionError(f"{node} not online")
    finally:
        watcher.close()


async def volley(files: Campus) -> list[wire.JobResult]:
    image = sample_jpeg(3)[0]
    settings = files.mqtt(NEW_APP)
    async with AsyncClient(settings, edge=NEW_PC, response_topic="app/line-3/results") as app:
        return list(
            await asyncio.gather(
                *(
                    app.infer(image, model="defect-v1", deadline_ms=5000, data_class="wafer-image")
                    for _ in range(8)
                )
            )
        )


def _job(campus: LocalCampus, job_id: str) -> dict[str, Any] | None:
    url = f"http://127.0.0.1:{campus.http_port}/jobs/{job_id}"
    status, body = get_json(url, campus.campus.console_token("viewer"))
    if status == 404:
        return None
    assert status == 200, (status, body)
    return dict(body)
