"""A sister campus's broker asks this campus's broker for a placement, across the bridge:
the running broker (``sluicegate broker run``'s ``serve``) decides it inside its own policy
(only where its [peers] receive terms open, as the peer's origin ``peer:<campus>``),
reserves, signs the token and answers on the peer's topic; it refuses, saying why, what the
agreement does not list, an ask with no agreement in force, and asks past the peer's limits
(issue 39, part 4). Real processes: two CAs, two secured Mosquittos, the bridge, Redis, and
south's broker; south's worker is played by hand (capabilities and telemetry)."""

from __future__ import annotations

import queue
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from broker.peers import half_file
from broker.run import serve
from policies import tokens
from policies.agreement import statement_for
from policies.model import Policy
from policies.signing import add_signature, dump_signatures, sign_policy
from sluicegate import pki, topics, wire
from sluicegate.app.broker_http import get_json, token_beside
from sluicegate.app.campus import write_console_users
from sluicegate.app.servers import free_port
from sluicegate.config import Settings, load_settings
from sluicegate.wire_pool import JobNotice, PlacementRelease, PlacementReply
from tests.peer_kit import WIRETAP, Site, bridged_sites
from tests.policies.policy_testkit import PARTS_TERMS, SITE_ZONES, key
from tests.secure_kit import TlsClient
from tests.support import ServiceThread, live_request
from tests.test_broker_core_kit import caps as kit_caps
from tests.test_broker_core_kit import telemetry as kit_telemetry

pytestmark = pytest.mark.integration

NORTH, SOUTH = "north-site", "south-site"
WORKER = "south-site-gpu-1"  # in south's data centre, the zone its terms open to north
TERMS = {**PARTS_TERMS, "max_jobs_per_s": 4.0}  # few, so the limit is reached in the test


def sign_half(site: Site, policy: Policy, peer: str, officers: tuple[str, ...]) -> bytes:
    half = statement_for(policy, peer)
    for name in officers:
        half = half.signed_by(key(name), name)
    half_file(site.campus.root, policy.campus, peer).write_bytes(half.to_bytes())
    return half.to_bytes()


def broker_config(site: Site, redis_url: str) -> Path:
    """South's broker as an operator configures it: its key, its signed policy, Redis."""
    root = site.campus.root
    bundle = None
    for officer in ("officer-dan", "officer-erin"):
        bundle = add_signature(bundle, site.policy, sign_policy(site.policy, key(officer), officer))
    assert bundle is not None
    (root / "policy.toml.sig").write_bytes(dump_signatures(bundle))
    signer = root / "broker-signing.key"
    pki.write_private(signer, key(site.broker).to_pem())
    config = root / "broker.toml"
    config.write_text(
        f"[mqtt]\nport = {site.campus.mqtt_port}\nkeepalive_s = 5\nreconnect_max_s = 2\n"
        f'tls_ca_file = "{site.campus.ca_file}"\n'
        f'tls_cert_file = "{site.campus.cert_file(site.broker)}"\n'
        f'tls_key_file = "{site.campus.key_files[site.broker]}"\n'
        f'\n[broker]\nid = "{site.broker}"\nredis_url = "{redis_url}"\n'
        f"http_port = {free_port()}\n"
        f'key_file = "{signer}"\npolicy_file = "{site.campus.policy_file}"\n'
        f'state_dir = "{root / "state"}"\n'
        f'\n[console]\nusers_file = "{write_console_users(root)}"\n'
    )
    return config


@pytest.fixture(scope="module")
def sites(
    tmp_path_factory: pytest.TempPathFactory, fresh_redis_db: Callable[[], str]
) -> Iterator[tuple[Site, Site, TlsClient, Settings]]:
    with bridged_sites(tmp_path_factory.mktemp("placing"), send=TERMS) as (north, south):
        settings = load_settings(broker_config(south, fresh_redis_db()))
        sign_half(south, south.policy, NORTH, ("officer-dan", "officer-erin"))
        watcher = TlsClient(south.campus, WIRETAP)
        watcher.subscribe(topics.broker_status(south.broker))
        broker = ServiceThread(lambda stop: serve(settings, stop, connect_timeout=10)).start()
        try:
            while b'"online"' not in watcher.get(timeout=30).payload:
                pass
        except queue.Empty:
            broker.stop()
            raise
        watcher.close()
        south.issue(WORKER)
        worker = TlsClient(south.campus, WORKER)
        try:
            play_worker(worker)
            yield north, south, worker, settings
        finally:
            worker.close()
            broker.stop()


def play_worker(client: TlsClient) -> None:
    """South's worker, as it announces itself and reports its load."""
    zone = SITE_ZONES[SOUTH]
    providers = ("CPUExecutionProvider",)
    caps = kit_caps(WORKER, zone, device_class="cpu", providers=providers, concurrency=1)
    tel = kit_telemetry(WORKER, time.time(), zone=zone, device_class="cpu")
    topic = topics.worker_capabilities(WORKER)
    assert not client.publish(topic, wire.dump(caps), retain=True).is_failure
    assert not client.publish(topics.worker_telemetry(WORKER), wire.dump(tel)).is_failure


class Asker:
    """North's broker, asking south's across the bridge and reading the answers."""

    def __init__(self, north: Site) -> None:
        self.client = TlsClient(north.campus, north.broker)
        self.client.subscribe(topics.peer_answers(SOUTH, NORTH))

    def ask(self, data_class: str = "ocr-crop", payload_bytes: int = 80_000) -> PlacementReply:
        job = uuid.uuid4().hex
        request = live_request(
            "north-l1-pc", job, data_class=data_class, payload_bytes=payload_bytes
        )
        sent = self.client.publish(
            topics.peer_asks(NORTH, SOUTH), request.model_dump_json().encode()
        )
        assert not sent.is_failure
        while True:
            got = self.client.get(timeout=15)
            answer = PlacementReply.model_validate_json(got.payload)
            if answer.job_id == job:
                return answer


def test_a_peer_s_job_is_placed_inside_this_campus_s_policy_and_answered_across(
    sites: tuple[Site, Site, TlsClient, Settings],
) -> None:
    north, south, worker, settings = sites
    asker = Asker(north)
    try:
        # No half of north's yet: south has no agreement in force, and says so.
        refused = asker.ask()
        assert (refused.status, refused.code) == ("refused", "no_agreement"), refused
        half = sign_half(north, north.policy, SOUTH, ("officer-alice", "officer-bob"))
        assert not asker.client.publish(
            topics.peer_agreement(NORTH, SOUTH), half, retain=True
        ).is_failure
        deadline = time.monotonic() + 20
        answer = asker.ask()
        while answer.status != "placed" and time.monotonic() < deadline:
            play_worker(worker)  # telemetry again, as a worker sends it every second
            answer = asker.ask()
        assert answer.status == "placed", answer
        assert (answer.worker_id, answer.broker_id) == (WORKER, south.broker)
        assert answer.token is not None
        claims = tokens.verify(
            answer.token,
            south.policy,  # what south's worker will check
            now=time.time(),
            job_id=answer.job_id,
            payload_sha256=bytes.fromhex("ab" * 32),
            worker_id=WORKER,
            origin_zone="peer:north-site",
            data_class="ocr-crop",
        )
        assert (claims.origin_zone, claims.target_zone) == ("peer:north-site", SITE_ZONES[SOUTH])

        # A class the agreement does not list: refused by south's own policy, in words.
        wafer = asker.ask(data_class="wafer-image")
        assert (wafer.status, wafer.code) == ("refused", "policy_denied"), wafer
        assert "agreement with that campus does not list it" in (wafer.reason or "")

        # Past the receive terms' 4 jobs a second: refused, naming the limit.
        codes = [asker.ask().code for _ in range(8)]
        assert "peer_rate_limit" in codes
        too_big = asker.ask(payload_bytes=30_000_000)
        assert too_big.code in ("peer_bytes_limit", "peer_rate_limit")

        # An ask that is no placement request: answered bad_request, naming the field.
        asker.client.publish(topics.peer_asks(NORTH, SOUTH), b'{"job_id": 7}')
        while True:
            bad = PlacementReply.model_validate_json(asker.client.get(timeout=15).payload)
            if bad.job_id == "?":
                break
        assert (bad.status, bad.code) == ("refused", "bad_request")
        assert "job_id" in (bad.reason or "")

        # What south's operators see of north: GET /peers.
        url = f"http://127.0.0.1:{settings.broker.http_port}/peers"
        status, shown = get_json(url, token_beside(settings.console.users_file), timeout=10)
        assert status == 200, shown
        (peer,) = shown["peers"]
        assert (peer["peer"], peer["standing"], peer["half_version"]) == (NORTH, "in_force", 1)
        assert shown["refused"]["ask.no_agreement"] == 1
        assert shown["refused"]["ask.peer_rate_limit"] >= 1
        assert shown["refused"]["ask.malformed"] == 1
    finally:
        asker.client.close()


def test_a_peer_s_placement_handed_back_is_freed_and_a_lost_worker_is_told_across(
    sites: tuple[Site, Site, TlsClient, Settings],
) -> None:
    north, _south, worker, settings = sites
    asker = Asker(north)
    asker.client.subscribe(topics.peer_notices_all(SOUTH, NORTH))
    half = sign_half(north, north.policy, SOUTH, ("officer-alice", "officer-bob"))
    asker.client.publish(topics.peer_agreement(NORTH, SOUTH), half, retain=True)
    users = token_beside(settings.console.users_file)
    base = f"http://127.0.0.1:{settings.broker.http_port}"

    def placed() -> PlacementReply:
        deadline = time.monotonic() + 30
        answer = asker.ask()
        while answer.status != "placed" and time.monotonic() < deadline:
            play_worker(worker)  # its telemetry again, as it sends it every second
            answer = asker.ask()  # (past the 4 jobs/s limit: refused until it refills)
        assert answer.status == "placed", answer
        return answer

    try:
        # North's edge will not use a placement: north's broker hands it back across.
        unused = placed()
        release = PlacementRelease(
            job_id=unused.job_id,
            edge_id="north-l1-pc",  # as north names it: south records it as north's edge
            worker_id=WORKER,
            attempt=1,
            reason="placed after the edge stopped waiting",
        )
        asker.client.publish(topics.peer_releases(NORTH, SOUTH), wire.dump(release))
        deadline = time.monotonic() + 15
        record: dict[str, object] = {}
        while record.get("status") != "released" and time.monotonic() < deadline:
            status, record = get_json(f"{base}/jobs/{unused.job_id}", users, timeout=10)
            assert status == 200, record
        assert record["status"] == "released", record

        # South's worker dies with a job of north's: the notice goes back across, to
        # north's broker (which passes it on to the edge that sent the job).
        held = placed()
        offline = wire.NodeStatus(node=WORKER, kind="pool", zone=SITE_ZONES[SOUTH], state="offline")
        worker.publish(topics.worker_status(WORKER), wire.dump(offline), retain=True)
        told: dict[str, JobNotice] = {}  # every job of north's it held, this one among them
        while held.job_id not in told:
            got = asker.client.get(timeout=20)
            if "/notices/" in got.topic:
                assert got.topic == topics.peer_notices(SOUTH, NORTH, "north-l1-pc")
                notice = JobNotice.model_validate_json(got.payload)
                told[notice.job_id] = notice
        notice = told[held.job_id]
        assert (notice.attempt, notice.kind, notice.worker_id) == (1, "worker_lost", WORKER)
        assert unused.job_id not in told  # handed back: no longer on the worker
    finally:
        online = wire.NodeStatus(node=WORKER, kind="pool", zone=SITE_ZONES[SOUTH], state="online")
        worker.publish(topics.worker_status(WORKER), wire.dump(online), retain=True)
        play_worker(worker)
        asker.client.close()
