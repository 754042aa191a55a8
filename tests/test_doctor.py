"""``sluicegate doctor`` and ``sluicegate mosquitto config``.

The judgements are tabled with facts made up here (pure tier). The real tier runs doctor
against a secured campus (its CA, certificates, generated ACL and a real Mosquitto), healthy
and then with one fault injected at a time: a wrong CA, an expired certificate, an
unreachable broker, a policy from a signer the anchor does not trust, a state folder that
cannot be written, a Mosquitto without ``set_tcp_nodelay``; each must be named with its
fix. Doctor must never log in as a running node, nor disturb a stopped node's session.
"""

from __future__ import annotations

import asyncio
import getpass
import shutil
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from typer.testing import CliRunner

from policies import TrustAnchor, load_policy
from policies.signing import add_signature, dump_anchor, dump_signatures, sign_policy
from sluicegate import identity, pki, topics
from sluicegate.app.campus import Campus, write_campus
from sluicegate.app.cli import app
from sluicegate.app.localcampus import LocalCampus
from sluicegate.app.servers import free_port, running, start_mosquitto_conf
from sluicegate.config import MqttSettings
from sluicegate.doctor import judge as j
from sluicegate.doctor import judge_node as jn
from sluicegate.doctor.facts import (
    BrokerClock,
    Connect,
    Finding,
    Handshake,
    Models,
    PolicyState,
    RoundTrip,
    Running,
    StateDir,
    TlsFiles,
    Warn,
)
from sluicegate.doctor.run import Report, diagnose, infer_role
from sluicegate.mosquitto import secure_listener
from sluicegate.mqtt import Message, MqttTransport
from sluicegate.policy_feed import ANCHOR_FILE
from tests.policies.policy_testkit import base_doc, key, policy_of, toml_value
from tests.secure_kit import TlsClient, refused_login

NOW = 1_780_000_000.0
EDGE = "line-1-pc"
GIB = 1024**3


def _ca(name: str = "campus", *, now: float = NOW) -> pki.Authority:
    return pki.new_authority(name, now=now)


def _client_cert(ca: pki.Authority, *, now: float = NOW, days: int = 365) -> x509.Certificate:
    return pki.issue(ca, key(EDGE).private.public_key(), EDGE, purpose="client", now=now, days=days)


def _files(ca: pki.Authority | None, cert: x509.Certificate | None, **kw: Any) -> TlsFiles:
    return TlsFiles(
        Path("/s/ca.pem"),
        ca.cert if ca is not None else None,
        kw.get("ca_error"),
        Path("/s/node.pem"),
        cert,
        kw.get("cert_error"),
        kw.get("key_error"),
    )


# -- the judgements, from facts made up here ------------------------------------------------


def test_a_finding_prints_as_one_line_per_verdict_and_warning() -> None:
    assert Finding("OK", "models", "defect-v1 verified").lines() == [
        "OK models: defect-v1 verified"
    ]
    assert Finding("FAIL", "clock", "off by 9 s", "use NTP").lines() == [
        "FAIL clock: off by 9 s — fix: use NTP"
    ]
    assert Finding("SKIP", "models", "a broker runs none").lines() == [
        "SKIP models: a broker runs none"
    ]
    warned = Finding("OK", "clock", "2.5 s", warnings=(Warn("2.5 s behind", "use NTP"),))
    assert warned.lines() == ["OK clock: 2.5 s", "WARN clock: 2.5 s behind — fix: use NTP"]


@pytest.mark.parametrize(
    ("p50_ms", "connect_ms", "suspected"),
    [
        (44.5, 0.2, True),  # measured before: Nagle's ~40 ms on loopback
        (20.0, 1.9, True),
        (11.0, 0.2, False),
        (19.9, 0.2, False),
        (44.5, 2.0, False),  # a far network: cannot tell Nagle from distance
        (44.5, None, False),
    ],
)
def test_nagle_is_a_slow_round_trip_over_a_near_network(
    p50_ms: float, connect_ms: float | None, suspected: bool
) -> None:
    assert jn.nagle_suspected(p50_ms, connect_ms) is suspected
    finding = jn.judge_round_trip(RoundTrip("t", (p50_ms,) * 3), connect_ms)
    assert (finding.status == "FAIL") is suspected
    if suspected:
        assert finding.fix == jn.NODELAY_FIX
        assert "set_tcp_nodelay true in mosquitto.conf" in finding.lines()[0]


@pytest.mark.parametrize(
    ("stage", "in_fix"),
    [
        ("login", "TLS checks"),
        ("subscribe", "sluicegate policy acl"),
        ("publish", "sluicegate policy acl"),
        ("deliver", "let it drain"),
    ],
)
def test_a_failed_round_trip_names_what_to_do(stage: Any, in_fix: str) -> None:
    finding = jn.judge_round_trip(RoundTrip("sluicegate/v1/probe/x", error="no", stage=stage), 0.1)
    assert finding.status == "FAIL"
    assert in_fix in finding.fix


@pytest.mark.parametrize(
    ("date", "sent", "received", "max_skew", "status", "warned"),
    [
        (NOW, NOW, NOW + 0.01, None, "OK", False),
        (NOW - 3, NOW, NOW + 0.01, None, "OK", True),  # about 2.5 s: warn
        (NOW + 7, NOW, NOW + 0.01, None, "FAIL", False),  # beyond the default 5 s
        (NOW + 7, NOW, NOW + 0.01, 10, "OK", True),  # within the policy's 10 s
        (NOW + 4, NOW, NOW + 0.01, 2, "FAIL", False),  # beyond the policy's 2 s
        (NOW + 6, NOW, NOW + 2.0, None, "OK", True),  # a slow answer: not provably 5 s off
    ],
)
def test_clock_skew_from_the_date_header(
    date: float, sent: float, received: float, max_skew: int | None, status: str, warned: bool
) -> None:
    finding = j.judge_clock(BrokerClock("http://b:8780", sent, received, date=date), max_skew)
    assert finding.status == status
    assert bool(finding.warnings) is warned
    if status == "FAIL":
        assert "NTP" in finding.fix


def test_clock_without_an_answer_or_a_date_fails_naming_the_flag() -> None:
    gone = j.judge_clock(BrokerClock("http://b:1", NOW, NOW, error="refused"), None)
    assert gone.status == "FAIL"
    assert "--broker-url" in gone.fix
    assert j.judge_clock(BrokerClock("http://b:1", NOW, NOW), None).status == "FAIL"


@pytest.mark.parametrize(
    ("state", "status", "words"),
    [
        (StateDir(Path("/s"), "[pool] state_dir", True, True, free_bytes=5 * GIB), "OK", ""),
        (StateDir(Path("/s"), "[pool] state_dir", False, False, free_bytes=5 * GIB), "OK", ""),
        (StateDir(Path("/s"), "[pool] state_dir", True, False), "FAIL", "is a file"),
        (
            StateDir(Path("/f/s"), "[pool] state_dir", False, False, blocker="/f is a file"),
            "FAIL",
            "cannot be created",
        ),
        (
            StateDir(Path("/s"), "[pool] state_dir", True, True, write_error="Read-only"),
            "FAIL",
            "no file can be written",
        ),
        (StateDir(Path("/s"), "[pool] state_dir", True, True, free_bytes=50 << 20), "FAIL", "free"),
        (StateDir(Path("/s"), "[pool] state_dir", True, True, free_bytes=GIB // 2), "OK", "warn"),
    ],
)
def test_the_state_folder(state: StateDir, status: str, words: str) -> None:
    finding = jn.judge_state_dir(state)
    assert finding.status == status
    if status == "FAIL":
        assert words in finding.detail
        assert "[pool] state_dir" in finding.fix
    assert bool(finding.warnings) is (words == "warn")


POLICY = policy_of(base_doc())
ANCHOR = TrustAnchor.of(POLICY)
EXPIRES = POLICY.expires


@pytest.mark.parametrize(
    ("state", "now", "status", "words"),
    [
        (PolicyState("p", POLICY, ANCHOR), NOW, "OK", "'acme' v1 verified"),
        (
            PolicyState("p", None, ANCHOR, ("policy.unknown_signer",), "signature 0 ..."),
            NOW,
            "FAIL",
            "[policy.unknown_signer]",
        ),
        (
            PolicyState("p", None, ANCHOR, ("policy.threshold_not_met",), "needs 2"),
            NOW,
            "FAIL",
            "[policy.threshold_not_met]",
        ),
        # A newer pinned policy beside an older bootstrap file: it works, and says so.
        (PolicyState("p", POLICY, ANCHOR, ("policy.rollback",), "older"), NOW, "OK", "warn"),
        (PolicyState("p", POLICY, ANCHOR), EXPIRES, "FAIL", "expired"),
        (PolicyState("p", POLICY, ANCHOR), EXPIRES - 86400, "OK", "warn"),
        (PolicyState("p", error="no pinned policy trust anchor"), NOW, "FAIL", "anchor"),
        (PolicyState("p", None, None), NOW, "FAIL", "anchor"),
    ],
)
def test_the_pinned_policy(state: PolicyState, now: float, status: str, words: str) -> None:
    finding = jn.judge_policy(state, "edge", "[offload] policy_file", now=now)
    assert finding.status == status, finding
    if words != "warn":
        assert words in finding.detail
    assert bool(finding.warnings) is (words == "warn")
    if status == "FAIL":
        assert finding.fix


def test_the_node_certificate_is_the_cas_current_one() -> None:
    campus, other = _ca(), _ca("elsewhere")
    good = j.judge_node_cert(_files(campus, _client_cert(campus)), "edge", now=NOW)
    assert good.status == "OK"
    assert not good.warnings
    soon = j.judge_node_cert(_files(campus, _client_cert(campus, days=20)), "edge", now=NOW)
    assert soon.status == "OK"
    assert "expires in 20 days" in soon.warnings[0].text
    expired = _client_cert(campus, now=NOW - 400 * 86400, days=30)
    finding = j.judge_node_cert(_files(campus, expired), "edge", now=NOW)
    assert finding.status == "FAIL"
    assert "expired" in finding.detail
    assert "sluicegate edge install --join" in finding.fix
    foreign = j.judge_node_cert(_files(other, _client_cert(campus)), "pool", now=NOW)
    assert foreign.status == "FAIL"
    assert "was not issued by" in foreign.detail
    later = j.judge_node_cert(
        _files(campus, _client_cert(campus, now=NOW + 86400)), "edge", now=NOW
    )
    assert later.status == "FAIL"
    assert "clock" in later.fix
    broken = j.judge_node_cert(
        _files(campus, _client_cert(campus), key_error="mismatch"), "x", now=NOW
    )
    assert broken.status == "FAIL"
    assert "tls_key_file" in broken.fix


def test_the_ca_file_must_be_a_ca() -> None:
    campus = _ca()
    assert j.judge_ca(_files(campus, None)).status == "OK"
    leaf = pki.Authority(campus.key, _client_cert(campus))
    assert "not a certificate authority" in j.judge_ca(_files(leaf, None)).detail
    unread = j.judge_ca(_files(None, None, ca_error="not a PEM certificate"))
    assert unread.status == "FAIL"
    assert "tls_ca_file" in unread.fix


@pytest.mark.parametrize(
    ("shake", "status", "words"),
    [
        (Handshake(version="TLSv1.3"), "OK", "Mosquitto accepts"),
        (Handshake(verify_code=20, verify_error="unable to get local issuer"), "FAIL", "wrong CA"),
        (Handshake(verify_code=62, verify_error="Hostname mismatch"), "FAIL", "names"),
        (Handshake(verify_code=10, verify_error="certificate has expired"), "FAIL", "not valid"),
        (Handshake(alert="TLSV1_ALERT_UNKNOWN_CA"), "FAIL", "not the CA Mosquitto trusts"),
        (Handshake(alert="SSLV3_ALERT_CERTIFICATE_EXPIRED"), "FAIL", "expired"),
        (Handshake(error="wrong version number"), "FAIL", "no TLS handshake"),
    ],
)
def test_the_servers_tls(shake: Handshake, status: str, words: str) -> None:
    campus = _ca()
    _key, server = pki.server_identity(campus, ("mqtt.plant",), now=NOW)
    finding = j.judge_server_tls(
        replace(shake, server_cert=server), _files(campus, None), "mqtt.plant", 8883, "edge"
    )
    assert finding.status == status
    assert words in finding.detail
    if words == "wrong CA":
        assert "tls_ca_file to the campus CA" in finding.fix


def test_a_server_certificate_for_another_host_is_named() -> None:
    campus = _ca()
    _key, server = pki.server_identity(campus, ("mqtt.plant",), now=NOW)
    finding = j.judge_server_tls(
        Handshake(server_cert=server), _files(campus, None), "10.0.0.9", 8883, "edge"
    )
    assert finding.status == "FAIL"
    assert "mqtt.plant" in finding.detail
    assert "[mqtt] host" in finding.fix


TLS = MqttSettings(
    tls_ca_file=Path("/s/ca.pem"), tls_cert_file=Path("/s/node.pem"), tls_key_file=Path("/k")
)


@pytest.mark.parametrize(
    ("mqtt", "cert_name", "status", "warned"),
    [
        (TLS, EDGE, "OK", False),
        (TLS, "line-2-pc", "FAIL", False),  # another node's certificate
        (MqttSettings(), None, "FAIL", False),  # no TLS and not asked to run without
        (MqttSettings(plaintext=True), None, "OK", True),
        (MqttSettings(tls_ca_file=Path("/s/ca.pem")), None, "FAIL", False),
    ],
)
def test_the_node_connects_as_itself(
    mqtt: MqttSettings, cert_name: str | None, status: str, warned: bool
) -> None:
    finding = j.judge_identity(mqtt, EDGE, "edge", cert_name, None)
    assert finding.status == status
    assert bool(finding.warnings) is warned
    if status == "FAIL":
        assert "sluicegate edge install --join" in finding.fix


@pytest.mark.parametrize(
    ("mqtt", "role", "login"),
    [
        (TLS, "edge", jn.Login(EDGE, False, 3600)),  # its own session, never a clean start
        (TLS.model_copy(update={"session_expiry_s": 60}), "pool", jn.Login(EDGE, False, 60)),
        (TLS, "broker", jn.Login(EDGE, False, 0)),  # a broker keeps no session
        (MqttSettings(plaintext=True), "edge", jn.Login(f"sg-doctor-{EDGE}-7", True, 0)),
    ],
)
def test_doctor_logs_in_without_wiping_the_nodes_session(
    mqtt: MqttSettings, role: str, login: jn.Login
) -> None:
    assert jn.login_for(mqtt, role, EDGE, "7") == login


def test_a_running_node_or_one_that_cannot_be_told_is_not_logged_in_as() -> None:
    assert jn.login_skip(Running(False, "no lock"), EDGE) is None
    running = jn.login_skip(Running(True, "pid 7 holds /s/x.lock"), EDGE)
    assert running is not None
    assert running.status == "SKIP"
    assert "is running" in running.detail
    unknown = jn.login_skip(Running(None, "no lock file"), EDGE)
    assert unknown is not None
    assert unknown.status == "SKIP"


def test_a_config_that_does_not_load_names_the_file_or_the_key() -> None:
    missing = j.judge_config("/etc/x.toml", "config file /etc/x.toml does not exist", "pool", "?")
    assert "/etc/sluicegate/pool.toml" in missing.fix
    invalid = j.judge_config("/e.toml", "invalid configuration in /e.toml: mqtt.port", "edge", "?")
    assert invalid.status == "FAIL"
    assert "sluicegate config show" in invalid.fix
    assert j.judge_config("/e.toml", None, "edge", "e1").lines() == [
        "OK config: /e.toml loads: edge e1"
    ]


def test_reachability_names_the_setting() -> None:
    assert j.judge_reachable(Connect("h", 1, None, 0.3)).status == "OK"
    down = j.judge_reachable(Connect("h", 1, "Connection refused"))
    assert down.status == "FAIL"
    assert "[mqtt] host and port" in down.fix


def test_models() -> None:
    assert jn.judge_models(Models(Path("/m"), "[edge] models_dir", ("defect-v1",))).status == "OK"
    bad = jn.judge_models(Models(Path("/m"), "[edge] models_dir", error="sha256 differs"))
    assert bad.status == "FAIL"
    assert "[edge] models_dir" in bad.fix


def test_the_role_comes_from_the_configs_sections(tmp_path: Path) -> None:
    cases = {
        "e": "[mqtt]\n[edge]\n[offload]\n",
        "p": "[pool]\n",
        "b": "[broker]\n",
        "x": "[mqtt]\n",
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
    assert [infer_role(tmp_path / n) for n in cases] == ["edge", "pool", "broker", None]
    assert infer_role(None) is None
    assert infer_role(tmp_path / "missing") is None


# -- a real, secured campus ----------------------------------------------------------------


@pytest.fixture(scope="module")
def local(
    tmp_path_factory: pytest.TempPathFactory, fresh_redis_db: Callable[[], str]
) -> Iterator[LocalCampus]:
    """A secured campus (CA, certificates, ACL, Mosquitto); only the broker runs, and only
    once a test asks for it."""
    lc = LocalCampus(
        tmp_path_factory.mktemp("doctor-campus"),
        mqtt_port=free_port(),
        redis_url=fresh_redis_db(),
        key_for=key,
        nodes=["broker-1"],
    )
    files = lc.write()
    (files.root / "mosquitto").mkdir()
    from sluicegate.app.localcampus import start_campus_mosquitto

    with running(start_campus_mosquitto(files, workdir=files.root / "mosquitto")):
        yield lc
        lc.stop()


@pytest.fixture(scope="module")
def campus(local: LocalCampus) -> Campus:
    return local.write()


def node_config(campus: Campus, folder: Path, node: str = EDGE, **sections: dict[str, Any]) -> Path:
    """``node``'s config from the campus, with its own state folder under ``folder`` and
    ``sections``' values put over it."""
    doc = tomllib.loads(campus.node_config(node).read_text())
    section = "offload" if "offload" in doc else "pool" if "pool" in doc else "broker"
    doc[section]["state_dir"] = str(folder / "state")
    for name, values in sections.items():
        doc.setdefault(name, {}).update(values)
    text = "".join(
        f"[{name}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in values.items()) + "\n"
        for name, values in doc.items()
    )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{node}.toml"
    path.write_text(text)
    return path


def show(report: Report) -> str:
    text = report.text()
    print(text)
    return text


@pytest.mark.integration
def test_a_healthy_node_passes_every_check(campus: Campus, tmp_path: Path) -> None:
    report = diagnose(node_config(campus, tmp_path), "edge")
    text = show(report)
    assert report.exit_code == 0, text
    assert [f.status for f in report.findings if f.what != "clock"] == ["OK"] * 10, text
    assert report.finding("clock").status == "SKIP"  # no enrollment.json, no --broker-url
    assert not (tmp_path / "state").exists()  # doctor made nothing of the node's
    trip = report.round_trip
    assert trip is not None
    assert report.connect is not None
    p50 = sorted(trip.rtts_ms)[len(trip.rtts_ms) // 2]
    print(f"nodelay Mosquitto: p50 {p50:.2f} ms, TCP connect {report.connect.best_ms:.2f} ms")
    assert report.finding("MQTT round trip") == jn.judge_round_trip(trip, report.connect.best_ms)
    for role, node in (("pool", "north-cpu-1"), ("broker", "broker-1")):
        other = diagnose(node_config(campus, tmp_path / role, node), role)  # type: ignore[arg-type]
        assert other.exit_code == 0, show(other)


@pytest.mark.integration
def test_a_wrong_ca_is_named_with_its_fix(campus: Campus, tmp_path: Path) -> None:
    other = tmp_path / "other-ca.pem"
    other.write_bytes(pki.cert_pem(pki.new_authority("elsewhere", now=time.time()).cert))
    report = diagnose(node_config(campus, tmp_path, mqtt={"tls_ca_file": str(other)}), "edge")
    text = show(report)
    assert report.exit_code == 1
    tls = report.finding("TLS to")
    assert tls.status == "FAIL", text
    assert "wrong CA" in tls.detail, text
    assert "set [mqtt] tls_ca_file to the campus CA" in tls.fix
    assert report.finding("node certificate").status == "FAIL"  # not that CA's either
    assert report.finding("MQTT round trip").status == "SKIP"


@pytest.mark.integration
def test_an_expired_certificate_is_named_with_its_fix(campus: Campus, tmp_path: Path) -> None:
    ca = pki.load_authority(campus.root)
    old = pki.issue(
        ca,
        key(EDGE).private.public_key(),
        EDGE,
        purpose="client",
        now=time.time() - 400 * 86400,
        days=30,
    )
    cert = tmp_path / "expired.pem"
    cert.write_bytes(pki.cert_pem(old))
    report = diagnose(node_config(campus, tmp_path, mqtt={"tls_cert_file": str(cert)}), "edge")
    text = show(report)
    assert report.exit_code == 1
    node = report.finding("node certificate")
    assert node.status == "FAIL", text
    assert "expired at" in node.detail, text
    assert "enroll the node again" in node.fix
    tls = report.finding("TLS to")  # and Mosquitto itself refuses it
    assert tls.status == "FAIL", text
    assert "refused this node's certificate" in tls.detail, text


@pytest.mark.integration
def test_an_unreachable_broker_is_named_with_its_fix(campus: Campus, tmp_path: Path) -> None:
    port = free_port()  # nobody listens there
    report = diagnose(node_config(campus, tmp_path, mqtt={"port": port}), "edge")
    text = show(report)
    assert report.exit_code == 1
    reach = report.finding("MQTT broker")
    assert reach.status == "FAIL", text
    assert f"127.0.0.1:{port}" in reach.what, text
    assert "Connection refused" in reach.detail
    assert "[mqtt] host and port" in reach.fix
    assert report.finding("TLS to").status == "SKIP"
    assert report.finding("MQTT round trip").status == "SKIP"


@pytest.mark.integration
@pytest.mark.parametrize(
    ("edge", "words"),
    [
        ({"zone": "campus/elsewhere"}, "its configuration says 'campus/elsewhere'"),
        ({"id": "line-9-pc"}, "does not list edge line-9-pc: the broker places none"),
    ],
)
def test_an_edge_the_policy_places_elsewhere_or_not_at_all_is_warned(
    campus: Campus, tmp_path: Path, edge: dict[str, str], words: str
) -> None:
    report = diagnose(node_config(campus, tmp_path, edge=edge), "edge")
    finding = report.finding("policy")
    assert finding.status == "OK", show(report)  # the policy is fine; the node's place is not
    (warning,) = finding.warnings
    assert words in warning.text
    assert "policy" in warning.fix


@pytest.mark.integration
def test_a_policy_from_an_unknown_signer_is_refused_by_its_code(
    campus: Campus, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    policy = load_policy(campus.policy_file)
    (state / ANCHOR_FILE).write_bytes(dump_anchor(TrustAnchor.of(policy)))  # pinned
    forged = tmp_path / "policy.toml"
    shutil.copyfile(campus.policy_file, forged)
    bundle = add_signature(None, policy, sign_policy(policy, key("intruder"), "officer"))
    forged.with_name("policy.toml.sig").write_bytes(dump_signatures(bundle))
    report = diagnose(node_config(campus, tmp_path, offload={"policy_file": str(forged)}), "edge")
    text = show(report)
    assert report.exit_code == 1
    finding = report.finding("policy")
    assert finding.status == "FAIL", text
    assert "[policy.unknown_signer]" in finding.detail, text
    assert "exactly as its officers signed it" in finding.fix
    assert sorted(p.name for p in state.iterdir()) == [ANCHOR_FILE]  # nothing written there


@pytest.mark.integration
@pytest.mark.parametrize("layout", ["a file", "a folder inside a file"])
def test_an_unwritable_state_folder_is_named_with_its_fix(
    campus: Campus, tmp_path: Path, layout: str
) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")  # root ignores modes, not this
    where = blocker if layout == "a file" else blocker / "state"
    config = node_config(campus, tmp_path, offload={"state_dir": str(where)})
    report = diagnose(config, "edge")
    text = show(report)
    assert report.exit_code == 1
    finding = report.finding("state dir")
    assert finding.status == "FAIL", text
    assert ("is a file" if layout == "a file" else f"{blocker} is a file") in finding.detail
    assert "set [offload] state_dir to a folder" in finding.fix


@pytest.fixture
def nagle_mosquitto(campus: Campus, tmp_path: Path) -> Iterator[int]:
    """A Mosquitto with the campus's secured listener but without ``set_tcp_nodelay``."""
    port = free_port()
    workdir = tmp_path / "nagle"
    workdir.mkdir()
    lines = [
        *secure_listener(port, "127.0.0.1", campus.listener_tls()),
        f"user {getpass.getuser()}",  # as root, Mosquitto would become user mosquitto
        "persistence false",
        f"persistence_location {workdir}/",
        "log_dest stderr",
        "log_type error",
    ]
    conf = workdir / "mosquitto.conf"
    conf.write_text("\n".join(lines) + "\n")
    with running(start_mosquitto_conf(conf, port=port, probe=campus.client_context())):
        yield port


@pytest.mark.integration
def test_a_mosquitto_without_nodelay_is_found_by_its_round_trip(
    campus: Campus, tmp_path: Path, nagle_mosquitto: int
) -> None:
    results = {}
    for name, config in (
        ("nodelay", node_config(campus, tmp_path / "a")),
        ("Nagle", node_config(campus, tmp_path / "b", mqtt={"port": nagle_mosquitto})),
    ):
        report = diagnose(config, "edge")
        show(report)
        trip, connect = report.round_trip, report.connect
        assert trip is not None
        assert trip.error is None
        assert connect is not None
        p50 = sorted(trip.rtts_ms)[len(trip.rtts_ms) // 2]
        print(f"{name} Mosquitto: p50 {p50:.2f} ms, TCP connect {connect.best_ms:.2f} ms")
        finding = report.finding("MQTT round trip")
        assert finding == jn.judge_round_trip(trip, connect.best_ms)
        results[name] = (finding, jn.nagle_suspected(p50, connect.best_ms))
    finding, suspected = results["Nagle"]
    assert suspected, "Nagle's delay did not show on the Mosquitto without set_tcp_nodelay"
    assert finding.status == "FAIL"
    assert finding.fix == jn.NODELAY_FIX
    assert (
        "set_tcp_nodelay true in mosquitto.conf (sluicegate mosquitto config writes it)"
        in (finding.lines()[0])
    )


@pytest.mark.integration
def test_a_running_node_is_not_logged_in_as(campus: Campus, tmp_path: Path) -> None:
    config = node_config(campus, tmp_path)
    with identity.node_lock(tmp_path / "state", EDGE):  # as the node's own process holds it
        report = diagnose(config, "edge")
    text = show(report)
    trip = report.finding("MQTT round trip")
    assert trip.status == "SKIP", text
    assert f"node {EDGE} is running" in trip.detail, text
    assert "pid" in trip.detail
    assert report.finding("TLS to").status == "OK"  # the handshake logs in as no one
    assert report.round_trip is None
    assert report.exit_code == 0


async def _session(campus: Campus, *, expect: int = 0, clean: bool = False) -> list[Message]:
    """Log in as the edge to its persistent session (as the agent does), subscribe to its
    jobs and return the first ``expect`` messages the session delivers; ``clean`` ends the
    session instead."""
    got: list[Message] = []
    transport = MqttTransport(
        campus.mqtt(EDGE),
        client_id=EDGE,
        clean_start=clean,
        session_expiry_s=0 if clean else 3600,
    )
    await transport.connect()
    try:
        if clean or not expect:
            if not clean:
                await transport.subscribe(topics.edge_submit(EDGE), got.append, manual_ack=True)
            return got
        arrived = asyncio.Event()

        def take(message: Message) -> None:
            got.append(message)
            transport.ack(message)
            arrived.set()

        await transport.subscribe(topics.edge_submit(EDGE), take, manual_ack=True)
        await asyncio.wait_for(arrived.wait(), 10.0)
        return got
    finally:
        await transport.close()


@pytest.mark.integration
def test_doctor_leaves_a_stopped_nodes_session_and_queued_jobs_as_they_were(
    campus: Campus, tmp_path: Path
) -> None:
    assert asyncio.run(_session(campus)) == []  # the edge's session, with its subscription
    app = TlsClient(campus, "app-line-1")
    try:
        assert not app.publish(topics.edge_submit(EDGE), b"queued job").is_failure
    finally:
        app.close()
    report = diagnose(node_config(campus, tmp_path), "edge")
    show(report)
    assert report.finding("MQTT round trip").status == "OK"
    try:
        got = asyncio.run(_session(campus, expect=1))  # the edge is back: its job waits
        assert [m.payload for m in got] == [b"queued job"]
    finally:
        asyncio.run(_session(campus, clean=True))


@pytest.mark.integration
def test_the_clock_against_a_running_broker(
    local: LocalCampus, campus: Campus, tmp_path: Path
) -> None:
    local.start()
    url = f"http://127.0.0.1:{local.http_port}"
    state = tmp_path / "state"
    state.mkdir()
    (state / "enrollment.json").write_text(f'{{"node": "{EDGE}", "broker_url": "{url}"}}')
    report = diagnose(node_config(campus, tmp_path), "edge")  # the URL enrollment recorded
    text = show(report)
    clock = report.finding("clock")
    assert clock.status == "OK", text
    assert url in clock.detail, text
    skewed = diagnose(node_config(campus, tmp_path), "edge", clock=lambda: time.time() + 30)
    clock = skewed.finding("clock")
    assert clock.status == "FAIL", show(skewed)
    assert "max_skew_s is 5 s" in clock.detail, show(skewed)
    assert "NTP" in clock.fix
    broker = diagnose(node_config(campus, tmp_path / "b", "broker-1"), "broker", broker_url=url)
    trip = broker.finding("MQTT round trip")  # its replica lease says it runs
    assert trip.status == "SKIP", show(broker)
    assert "replica lease" in trip.detail, show(broker)


# -- the commands ----------------------------------------------------------------------------


@pytest.mark.integration
def test_doctors_exit_status(campus: Campus, tmp_path: Path) -> None:
    runner = CliRunner()
    healthy = node_config(campus, tmp_path / "a")
    result = runner.invoke(app, ["doctor", "--config", str(healthy)])  # role from its sections
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"OK config: {healthy} loads: edge {EDGE}\n")
    broken = node_config(campus, tmp_path / "b", mqtt={"port": free_port()})
    result = runner.invoke(app, ["doctor", "--config", str(broken), "--role", "edge"])
    assert result.exit_code == 1
    assert "FAIL MQTT broker" in result.output
    assert " — fix: " in result.output
    assert runner.invoke(app, ["doctor", "--config", str(healthy), "--role", "app"]).exit_code == 2
    assert runner.invoke(app, ["doctor"]).exit_code == 2  # which role?
    bad_url = ["doctor", "--config", str(healthy), "--broker-url", "broker:8780"]
    assert runner.invoke(app, bad_url).exit_code == 2
    bad = tmp_path / "bad.toml"
    bad.write_text("[edge\n")
    result = runner.invoke(app, ["doctor", "--config", str(bad), "--role", "edge"])
    assert result.exit_code == 1
    assert result.output.startswith("FAIL config:")


@pytest.mark.integration
def test_mosquitto_config_serves_the_campus(tmp_path: Path) -> None:
    campus = write_campus(
        tmp_path / "campus", key, mqtt_port=free_port(), redis_url="redis://127.0.0.1:1/0"
    )
    tls = campus.listener_tls()
    conf = tmp_path / "mosquitto" / "mosquitto.conf"
    conf.parent.mkdir()
    args = ["mosquitto", "config", "--ca", str(tls.cafile), "--cert", str(tls.certfile)]
    args += ["--key", str(tls.keyfile), "--acl", str(tls.acl_file), "--port", str(campus.mqtt_port)]
    args += ["--bind", "127.0.0.1", "--persistence-dir", str(conf.parent), "--out", str(conf)]
    args += ["--user", getpass.getuser()]  # a plant's runs as user mosquitto, the default
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    text = conf.read_text()
    for line in (
        "require_certificate true",
        "use_identity_as_username true",
        "use_username_as_clientid true",
        "allow_anonymous false",
        f"acl_file {tls.acl_file}",
        "set_tcp_nodelay true",
        f"user {getpass.getuser()}",  # the folders it reads and writes must be this user's
        "log_dest stderr",  # the journal under systemd, not syslog alone
    ):
        assert f"{line}\n" in text
    with running(start_mosquitto_conf(conf, port=campus.mqtt_port, probe=campus.client_context())):
        TlsClient(campus, EDGE).close()  # a campus certificate logs in
        assert refused_login(campus, None)  # no certificate: no session
        report = diagnose(node_config(campus, tmp_path), "edge")
        assert report.finding("MQTT round trip").status == "OK", show(report)
    missing = CliRunner().invoke(app, [*args[:3], str(tmp_path / "none.pem"), *args[4:]])
    assert missing.exit_code == 2
