"""The ``sluicegate policy`` commands, through typer's CliRunner on ``policies.cli.app``."""

from __future__ import annotations

import json
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec as ec_private
from policy_testkit import EXAMPLE, NOW, base_doc, key, to_toml
from typer.testing import CliRunner

from policies.audit import AuditWriter
from policies.audit_file import FileAuditStore
from policies.cli import app
from policies.keys import load_signing_key
from policies.schema import json_schema_text

runner = CliRunner()
AT = "2026-05-28T00:00:00Z"


def run(*args: str | Path) -> tuple[int, str]:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


def _officers(tmp_path: Path) -> dict[str, str]:
    publics = {}
    for name in ("alice", "bob", "carol"):
        code, out = run("keygen", name, "--out-dir", tmp_path)
        assert code == 0, out
        publics[name] = out.splitlines()[-1].split(" = ")[1].strip('"')
    return publics


def _policy(tmp_path: Path, publics: dict[str, str], version: int = 1) -> Path:
    doc = base_doc(version=version)
    doc["policy_signers"]["keys"] = publics
    path = tmp_path / "policy.toml"
    path.write_text(to_toml(doc))
    return path


def test_keygen_writes_a_private_key_file_and_never_overwrites(tmp_path: Path) -> None:
    code, out = run("keygen", "officer-x", "--out-dir", tmp_path)
    assert code == 0
    key_file = tmp_path / "officer-x.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    public = (tmp_path / "officer-x.pub").read_text().strip()
    assert out.splitlines()[-1] == f'officer-x = "{public}"'
    assert load_signing_key(key_file).public_text == public
    code, out = run("keygen", "officer-x", "--out-dir", tmp_path)
    assert code == 1
    assert "refusing to overwrite" in out


def test_keygen_creates_a_missing_out_dir_private(tmp_path: Path) -> None:
    keys = tmp_path / "new" / "keys"
    code, out = run("keygen", "officer-y", "--out-dir", keys)
    assert code == 0, out
    for folder in (tmp_path / "new", keys):
        assert folder.stat().st_mode & 0o777 == 0o700
    assert (keys / "officer-y.key").stat().st_mode & 0o777 == 0o600
    public = (keys / "officer-y.pub").read_text().strip()
    assert load_signing_key(keys / "officer-y.key").public_text == public
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, out = run("keygen", "officer-z", "--out-dir", blocker / "keys")
    assert code == 1
    assert out == (
        f"error [key.invalid]: cannot create the key directory {blocker / 'keys'}: "
        f"{blocker}: File exists\n"
    )


def test_sign_verify_anchor_and_rollback(tmp_path: Path) -> None:
    publics = _officers(tmp_path)
    policy = _policy(tmp_path, publics)
    code, out = run("sign", policy, "--key", tmp_path / "alice.key")
    assert code == 0
    assert "1 of 2 required signer keys" in out
    assert "as 'alice'" in out
    code, out = run("verify", policy, "--now", AT)
    assert code == 1
    assert "error [policy.threshold_not_met]" in out
    code, out = run("sign", policy, "--key", tmp_path / "bob.key")
    assert code == 0
    assert "2 of 2" in out
    anchor = tmp_path / "anchor.json"
    code, out = run("verify", policy, "--anchor", anchor, "--update-anchor", "--now", AT)
    assert code == 0, out
    assert "first install" in out
    assert "OK 'acme' v1" in out
    assert json.loads(anchor.read_text())["version"] == 1
    # Version 2, then an attempt to go back to version 1.
    v1_text, v1_sig = policy.read_text(), Path(f"{policy}.sig").read_text()
    _policy(tmp_path, publics, version=2)
    for name in ("alice", "carol"):
        assert run("sign", policy, "--key", tmp_path / f"{name}.key")[0] == 0
    code, out = run("verify", policy, "--anchor", anchor, "--update-anchor", "--now", AT)
    assert code == 0
    assert "anchor updated" in out
    policy.write_text(v1_text)
    Path(f"{policy}.sig").write_text(v1_sig)
    code, out = run("verify", policy, "--anchor", anchor, "--now", AT)
    assert code == 1
    assert "error [policy.rollback]" in out
    code, out = run("verify", policy, "--now", "2031-01-01T00:00:00+00:00")
    assert code == 1
    assert "error [policy.expired]" in out


def test_bad_key_files(tmp_path: Path) -> None:
    policy = _policy(tmp_path, _officers(tmp_path))
    garbage = tmp_path / "garbage.key"
    garbage.write_bytes(b"not a key")
    ec = tmp_path / "ec.key"
    ec.write_bytes(
        ec_private.generate_private_key(ec_private.SECP256R1()).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    for path, expect in [
        (garbage, "not an unencrypted PKCS#8 PEM private key"),
        (ec, "expected an Ed25519 key"),
        (tmp_path / "missing.key", "cannot read key file"),
    ]:
        code, out = run("sign", policy, "--key", path)
        assert code == 1
        assert "error [key.invalid]" in out
        assert expect in out


def test_sign_with_a_key_outside_the_policy_and_an_explicit_id(tmp_path: Path) -> None:
    publics = _officers(tmp_path)
    policy = _policy(tmp_path, publics)
    run("keygen", "dave", "--out-dir", tmp_path)
    sig = tmp_path / "other.sig"
    code, out = run("sign", policy, "--key", tmp_path / "dave.key", "--signatures", sig)
    assert code == 0
    assert "not a signer of this policy" in out
    code, out = run(
        "sign", policy, "--key", tmp_path / "bob.key", "--key-id", "b2", "--signatures", sig
    )
    assert code == 0
    assert "as 'b2'" in out
    assert "1 of 2" in out


def test_verify_the_shipped_example(tmp_path: Path) -> None:
    code, out = run("verify", EXAMPLE, "--now", AT)
    assert code == 0
    assert "OK 'acme-semi' v1" in out
    assert run("verify", EXAMPLE)[0] == 0  # the wall clock: the example expires in 2030
    copy = tmp_path / "campus.toml"
    copy.write_text(EXAMPLE.read_text().replace("max_ttl_s = 60", "max_ttl_s = 90"))
    shutil.copy(f"{EXAMPLE}.sig", f"{copy}.sig")
    code, out = run("verify", copy, "--now", AT)
    assert code == 1
    assert "error [policy.digest_mismatch]" in out


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (("--now", "yesterday"), "not a date-time"),
        (("--now", "2026-01-01T00:00:00"), "add a time zone"),
        (("--update-anchor",), "--update-anchor needs --anchor"),
    ],
)
def test_verify_option_errors(args: tuple[str, ...], expect: str) -> None:
    code, out = run("verify", EXAMPLE, *args)
    assert code == 1
    assert expect in out


def test_check_reports_file_line_key_and_exit_status(tmp_path: Path) -> None:
    code, out = run("check", EXAMPLE)
    assert code == 0
    assert "0 error(s), 12 warning(s)" in out
    lines = EXAMPLE.read_text().splitlines()
    keys_line = next(i for i, x in enumerate(lines) if x.startswith("keys = { officer-alice")) + 1
    zone_line = lines.index('zone = "campus/fab-south/dc"') + 1
    assert f"{EXAMPLE}:{keys_line}: warning[test-key] policy_signers.keys.officer-alice:" in out
    assert run("check", EXAMPLE, "--strict")[0] == 1
    bad = tmp_path / "bad.toml"
    bad.write_text(EXAMPLE.read_text().replace('zone = "campus/fab-south/dc"', 'zone = "x/y"'))
    code, out = run("check", bad)
    assert code == 1
    assert "error[unknown-zone] pools.south-dc-npu.zone" in out
    assert f"{bad}:{zone_line}:" in out
    broken = tmp_path / "broken.toml"
    broken.write_text("version = [")
    code, out = run("check", broken)
    assert code == 1
    assert f"error [policy.parse]: {broken}:1: not valid TOML" in out


def test_explain_exit_status_and_worker_targets() -> None:
    code, out = run("explain", EXAMPLE, "ocr-crop", "campus/fab-north/line-1", "cloud-gpu-1")
    assert code == 0
    assert "(worker 'cloud-gpu-1' sits in zone 'offsite/cloud-east')" in out
    assert "Answer: ALLOWED" in out
    code, out = run("explain", EXAMPLE, "wafer-image", "campus/fab-north/line-1", "cloud-gpu-1")
    assert code == 1
    assert "Answer: DENIED" in out
    code, out = run(
        "explain", EXAMPLE, "wafer-image", "campus/fab-north/line-1", "campus/fab-south/dc"
    )
    assert code == 0
    assert "sits in zone" not in out
    code, out = run("explain", EXAMPLE, "wafer-image", "campus/fab-north/line-1", "mars")
    assert code == 1
    assert "Zone 'mars' is not declared" in out


def test_audit_verify_file(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    writer = AuditWriter(FileAuditStore(log), key("broker-1"))
    for i in range(3):
        writer.append("decision", {"job": f"j{i}"}, now=NOW)
    code, out = run("audit-verify", "--file", log, "--policy", EXAMPLE)
    assert code == 0
    assert out.startswith("OK 3 records")
    head = out.split("head ")[1].split(",")[0]
    code, out = run("audit-verify", "--file", log, "--key", key("broker-1").public_text)
    assert code == 0
    code, out = run("audit-verify", "--file", log, "--policy", EXAMPLE, "--expected-head", head)
    assert code == 0
    lines = log.read_bytes().splitlines()
    log.write_bytes(b"\n".join([lines[0], lines[2]]) + b"\n")
    code, out = run("audit-verify", "--file", log, "--policy", EXAMPLE)
    assert code == 1
    assert "error [audit.chain_broken]: record 1: has seq 2, expected 1" in out


def test_audit_verify_trusts_every_node_the_policy_lists(tmp_path: Path) -> None:
    # A pool worker's own audit log verifies against the policy that lists its key, as a
    # broker's and an edge's do; a key the policy does not list still does not.
    for signer in ("north-gpu-1", "cloud-gpu-1", "north-l1-pc", "broker-1"):
        log = tmp_path / f"{signer}.log"
        writer = AuditWriter(FileAuditStore(log), key(signer))
        for i in range(2):
            writer.append("decision", {"job": f"j{i}"}, now=NOW)
        code, out = run("audit-verify", "--file", log, "--policy", EXAMPLE)
        assert (code, out.split(" records")[0]) == (0, "OK 2"), (signer, out)
    stranger = tmp_path / "stranger.log"
    AuditWriter(FileAuditStore(stranger), key("north-gpu-9")).append("x", {}, now=NOW)
    code, out = run("audit-verify", "--file", stranger, "--policy", EXAMPLE)
    assert code == 1
    assert "audit.untrusted_signer" in out


def test_audit_verify_with_another_nodes_key_names_both_keys(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    AuditWriter(FileAuditStore(log), key("broker-1")).append("decision", {"job": "j0"}, now=NOW)
    signer, other = key("broker-1").fingerprint.hex(), key("north-l1-pc").fingerprint.hex()
    code, out = run("audit-verify", "--file", log, "--key", key("north-l1-pc").public_text)
    assert code == 1
    assert out == (
        f"error [audit.untrusted_signer]: record 0: (seq 0) signed by key {signer}, which is "
        f"not trusted; trusted: {other}\n"
    )


_GONE = "a record was deleted or records were reordered"


def _edited(lines: list[bytes]) -> list[bytes]:
    doc = json.loads(lines[1])
    doc["data"]["job"] = "j9"
    return [lines[0], json.dumps(doc).encode(), lines[2]]


@pytest.mark.parametrize(
    ("tamper", "expect"),
    [
        (lambda lines: [lines[0], lines[2]], f"record 1: has seq 2, expected 1: {_GONE}"),
        (lambda lines: [lines[0], lines[2], lines[1]], f"record 1: has seq 2, expected 1: {_GONE}"),
        (_edited, "record 1: (seq 1) signature does not verify: the record was edited"),
    ],
    ids=["removed", "reordered", "altered"],
)
def test_audit_verify_a_tampered_log_is_a_broken_chain(
    tmp_path: Path, tamper: Callable[[list[bytes]], list[bytes]], expect: str
) -> None:
    log = tmp_path / "audit.log"
    writer = AuditWriter(FileAuditStore(log), key("broker-1"))
    for i in range(3):
        writer.append("decision", {"job": f"j{i}"}, now=NOW)
    log.write_bytes(b"".join(line + b"\n" for line in tamper(log.read_bytes().splitlines())))
    code, out = run("audit-verify", "--file", log, "--policy", EXAMPLE)
    assert code == 1
    assert out == f"error [audit.chain_broken]: {expect}\n"


def test_audit_verify_a_log_file_it_cannot_read_exits_2(tmp_path: Path) -> None:
    for path, why in [
        (tmp_path / "missing.log", "No such file or directory"),
        (tmp_path, "Is a directory"),
    ]:
        code, out = run("audit-verify", "--file", path, "--policy", EXAMPLE)
        assert code == 2
        assert out == f"error [audit.log_unreadable]: {path}: cannot read: {why}\n"


def test_audit_verify_an_empty_log_file_is_ok_unless_a_head_is_expected(tmp_path: Path) -> None:
    # An empty file is a log with no records yet (a node that has decided nothing so far), so
    # its chain holds. As for any cut-off log, only a head hash kept elsewhere shows the loss.
    log = tmp_path / "audit.log"
    log.write_bytes(b"")
    code, out = run("audit-verify", "--file", log, "--policy", EXAMPLE)
    assert code == 0
    assert out == f"OK 0 records, head {'0' * 64}, signers: none\n"
    elsewhere = AuditWriter(FileAuditStore(tmp_path / "other.log"), key("broker-1"))
    head = elsewhere.append("decision", {"job": "j0"}, now=NOW).hash.hex()
    code, out = run("audit-verify", "--file", log, "--policy", EXAMPLE, "--expected-head", head)
    assert code == 1
    assert "error [audit.chain_broken]: record 0: the log ends at head 0000" in out
    assert "records were cut off the end" in out


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (("--file", "x.log"), "give --policy or at least one --key"),
        (("--key", "ed25519:xx"), "bad public key"),
        (("--policy", str(EXAMPLE)), "give --file PATH, or --redis-url URL with --stream KEY"),
        (("--policy", str(EXAMPLE), "--expected-head", "zz"), "expected 64 hex digits"),
    ],
)
def test_audit_verify_usage_errors(args: tuple[str, ...], expect: str) -> None:
    code, out = run("audit-verify", *args)
    assert code == 1
    assert expect in out


def test_audit_verify_redis_unreachable() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"redis://127.0.0.1:{port}/0"
    code, out = run("audit-verify", "--redis-url", url, "--stream", "s", "--policy", EXAMPLE)
    assert code == 1
    assert "error [store.unavailable]" in out
    assert url in out


def test_schema_command_prints_the_published_schema() -> None:
    code, out = run("schema")
    assert code == 0
    assert out == json_schema_text()
