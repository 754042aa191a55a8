"""Attacks on a running, secured campus (real broker, edges and workers as processes, real
Mosquitto and Redis): each is refused, audited where it reaches us, and leaves every other
job unharmed. The transport-level attacks (anonymous clients, an edge speaking for another,
a client claiming a worker's id) are in tests/test_acl.py; enrollment's in
tests/test_enrollment.py."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from policies import parse_policy, signed_envelope
from sluicegate import topics, wire
from sluicegate.app.broker_http import get
from sluicegate.app.campus import Campus
from sluicegate.app.localcampus import LocalCampus
from sluicegate.identity import EXIT_IN_USE
from sluicegate.wire_pool import WorkerCapabilities, WorkerTelemetry
from tests.image_bytes import sample_jpeg
from tests.policies.policy_testkit import base_doc, policy_of, signed
from tests.secure_kit import TlsClient, audited, issue_identity
from tests.support import local_campus, volley, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROGUE_WORKER = "rogue-gpu-1"  # enrolled (a campus certificate), in no pool of the policy
ROGUE_PUBLISHER = "rogue-publisher"  # a misconfigured ACL lets it write the policy topic
LEGIT = {"line-1-pc", "line-2-pc", "north-cpu-1", "cloud-cpu-1"}


@pytest.fixture(scope="module")
def campus(
    tmp_path_factory: pytest.TempPathFactory, fresh_redis_db: Callable[[], str]
) -> Iterator[LocalCampus]:
    with local_campus(tmp_path_factory.mktemp("attacked"), fresh_redis_db(), prepare=_rogues) as lc:
        yield lc


def _rogues(files: Campus) -> None:
    """Enrolled identities the policy does not list, one with a misconfigured ACL line."""
    for name in (ROGUE_WORKER, ROGUE_PUBLISHER):
        issue_identity(files, name)
    with files.acl_file.open("a") as acl:
        acl.write(f"user {ROGUE_PUBLISHER}\ntopic write {topics.policy()}\n\n")


def unharmed(lc: LocalCampus, edge: str = "line-2-pc") -> list[wire.JobResult]:
    results = asyncio.run(volley(lc, edge, 8))
    assert [r.status for r in results] == ["ok"] * len(results), [r.reason for r in results]
    assert {r.ran_on.node for r in results} <= LEGIT
    return results


def _http(lc: LocalCampus, path: str) -> Any:
    url = f"http://127.0.0.1:{lc.http_port}{path}"
    status, body = get(url, lc.campus.console_token("viewer"))
    assert status == 200, (path, status, body[:300])
    return json.loads(body) if path != "/metrics" else body.decode()


def test_a_worker_the_policy_does_not_list_gets_no_work_and_is_audited(campus: LocalCampus) -> None:
    files = campus.write()
    rogue = TlsClient(files, ROGUE_WORKER)
    try:
        caps = WorkerCapabilities(
            worker_id=ROGUE_WORKER,
            zone="campus/fab-north/dc",
            device_class="x86-cpu",
            providers=["CPUExecutionProvider"],
            memory_total_mb=64_000,
            models={"defect-v1": {"version": "1"}},  # type: ignore[dict-item]
            max_batch=64,
            concurrency=64,
        )
        assert not rogue.publish(
            topics.worker_capabilities(ROGUE_WORKER), wire.dump(caps), retain=True
        ).is_failure  # its own topic: the transport lets it speak, the policy does not listen
        telemetry = WorkerTelemetry(
            node=ROGUE_WORKER,
            zone="campus/fab-north/dc",
            ts=time.time(),
            device_class="x86-cpu",
            utilisation=0.0,
            memory_used_mb=0.0,
            memory_total_mb=64_000.0,
            queue_depth=0,
            in_flight=0,
            capacity=64,
            models={},
            results={},
            refused={},
        )
        rogue.publish(topics.worker_telemetry(ROGUE_WORKER), wire.dump(telemetry))
        rogue.subscribe(topics.pool_work_all("campus/fab-north/dc", ROGUE_WORKER))
        refused = wait_until(lambda: audited(campus.redis_url, "identity.refused"), timeout=15)
        assert {(r["node"], r["code"]) for r in refused} >= {(ROGUE_WORKER, "worker.not_in_policy")}
        metrics = _http(campus, "/metrics")
        assert 'sluicegate_identity_refusals_total{code="worker.not_in_policy"}' in metrics
        assert ROGUE_WORKER not in {w["id"] for w in _http(campus, "/fleet")["workers"]}
        results = unharmed(campus, "line-1-pc")  # a burst: some of it is offloaded
        assert ROGUE_WORKER not in {r.ran_on.node for r in results}
        with pytest.raises(queue.Empty):  # and no work reached it
            rogue.get(timeout=0.5)
    finally:
        rogue.publish(topics.worker_capabilities(ROGUE_WORKER), b"", retain=True)
        rogue.close()


def _second(lc: LocalCampus, node: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    files = lc.write()
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "sluicegate.app.cli",
            "edge",
            "run",
            "--config",
            files.node_config(node),
        ],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=90,
    )


def test_a_second_agent_with_an_agents_identity_refuses_to_start_and_says_why(
    campus: LocalCampus, tmp_path: Path
) -> None:
    # On the same machine (the same state directory): refused at once by its lock.
    same = _second(campus, "line-2-pc", {})
    assert same.returncode == EXIT_IN_USE, same.stderr
    assert "already serves from" in same.stderr
    # Elsewhere (its own state directory): it finds the first one alive on the campus.
    other = _second(campus, "line-2-pc", {"SLUICEGATE_OFFLOAD__STATE_DIR": str(tmp_path)})
    assert other.returncode == EXIT_IN_USE, other.stderr
    assert "already served by instance" in other.stderr
    assert campus.alive("line-2-pc")  # the first keeps serving, and answers each job once
    unharmed(campus)


def test_a_retained_policy_signed_by_unknown_keys_is_refused_and_the_policy_kept(
    campus: LocalCampus,
) -> None:
    files = campus.write()
    # The campus's own policy, a later version, signed by a key that is not an officer's;
    # and one that names new officers (a rotation the old ones did not sign).
    text = files.policy_file.read_text().replace("version = 1\n", "version = 98\n", 1)
    same_signers = parse_policy(text.encode(), source="forged")
    new_signers = policy_of(base_doc(version=99, signers=("mallory", "eve"), threshold=1))
    forgeries = [signed_envelope(p, signed(p, "mallory")) for p in (same_signers, new_signers)]
    rogue = TlsClient(files, ROGUE_PUBLISHER)
    watcher = TlsClient(files, "observer")
    try:
        watcher.subscribe(topics.edge_telemetry("line-2-pc"))
        for envelope in forgeries:
            assert not rogue.publish(topics.policy(), envelope, retain=True).is_failure
        wanted = {"policy.unknown_signer", "policy.rotation_not_authorised"}

        def refused() -> wire.EdgeTelemetry | None:
            tel = wire.EdgeTelemetry.model_validate_json(watcher.get(timeout=5).payload)
            return tel if wanted <= set(tel.policy_refused) else None

        tel = wait_until(refused, timeout=15)
        assert tel.policy_version == 1  # it keeps the policy it verified
        unharmed(campus)
    finally:
        rogue.close()
        watcher.close()
        campus.restart("broker-1")  # publishes the real policy retained again


def test_a_job_asking_for_results_on_another_apps_topic_is_refused_before_acceptance(
    campus: LocalCampus,
) -> None:
    files = campus.write()
    thief = TlsClient(files, "app-line-1")  # may submit to line-1-pc
    victim = TlsClient(files, "app-line-2")
    watcher = TlsClient(files, "observer")
    try:
        victim.subscribe("app/line-2/#")
        watcher.subscribe(topics.edge_telemetry("line-1-pc"))
        image = sample_jpeg(4)[0]
        ack = thief.publish(
            topics.edge_submit("line-1-pc"),
            image,
            response_topic="app/line-2/stolen",
            user=[("model", "defect-v1")],
        )
        assert not ack.is_failure  # the app may submit; the edge refuses to answer there

        def counted() -> bool:
            tel = wire.EdgeTelemetry.model_validate_json(watcher.get(timeout=5).payload)
            return tel.events.get("response_topic_not_allowed", 0) >= 1

        assert wait_until(counted, timeout=15)
        with pytest.raises(queue.Empty):
            victim.get(timeout=0.5)
        unharmed(campus, "line-1-pc")
    finally:
        for client in (thief, victim, watcher):
            client.close()
