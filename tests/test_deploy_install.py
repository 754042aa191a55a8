"""The installer and its commands, into a temporary ``--root``; and an installed edge that
runs, keeps its outbox across uninstall and reinstall, and loses it only to ``--purge``.

Idempotence and the edited-config rule are checked on the files themselves (contents,
modes, mtimes). The end-to-end test runs the real ``sluicegate`` command against the real
Mosquitto fixture, under the seccomp filter systemd applies for the unit's
MemoryDenyWriteExecute=yes, and waits on the node's retained status, never on a clock.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import queue
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from sluicegate import Client, topics
from sluicegate.app.servers import ServerProcess
from sluicegate.config import MqttSettings
from sluicegate.config_show import MASK, effective, render
from sluicegate.deploy.configs import NodeValues
from sluicegate.deploy.installer import install, prepare_state_dir, uninstall
from sluicegate.deploy.layout import ROLES, Role, node_paths
from sluicegate.enroll.authority import Authority, init_folder
from sluicegate.enroll.token import claims_for, make_token
from sluicegate.errors import ConfigError
from tests.image_bytes import sample_jpeg
from tests.support import PlainClient, sluicegate_cmd

EXE = Path(sys.executable).with_name("sluicegate")
ANALYZE = shutil.which("systemd-analyze")


def values(role: Role, **extra: object) -> NodeValues:
    zone = None if role == "broker" else "campus/fab/line-3"
    return NodeValues(id=f"{role}-7", zone=zone, **extra)  # type: ignore[arg-type]


def snapshot(root: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file and folder under ``root``: (mode, mtime in ns, content)."""
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.stat()
        data = path.read_bytes() if path.is_file() else b""
        out[str(path.relative_to(root))] = (st.st_mode, st.st_mtime_ns, data)
    return out


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        sluicegate_cmd(*args), capture_output=True, text=True, timeout=60, check=False, env=env
    )


# -- the installer -------------------------------------------------------------------------


@pytest.mark.parametrize("role", ROLES)
def test_install_writes_each_file_and_a_second_run_changes_nothing(
    role: Role, tmp_path: Path
) -> None:
    first = install(role, tmp_path, values(role), executable=EXE)
    paths = first.paths
    assert {c.path: c.action for c in first.changes} == {
        paths.state_dir: "created",
        paths.sysusers: "created",
        paths.config: "created",
        paths.unit: "created",
    }
    assert first.ran == ()  # nothing is run outside /
    assert paths.state_dir.stat().st_mode & 0o777 == 0o700
    assert paths.config.stat().st_mode & 0o777 == 0o640
    assert paths.unit.stat().st_mode & 0o777 == 0o644
    assert f"--config {paths.config}" in paths.unit.read_text()
    before = snapshot(tmp_path)

    second = install(role, tmp_path, values(role), executable=EXE)
    assert {c.action for c in second.changes} == {"unchanged"}
    assert [line.split()[0] for line in second.lines()[:4]] == ["unchanged"] * 4
    assert snapshot(tmp_path) == before  # contents, modes and mtimes


def test_an_edited_config_is_kept_and_the_new_one_written_beside_it(tmp_path: Path) -> None:
    paths = install("edge", tmp_path, values("edge"), executable=EXE).paths
    edited = paths.config.read_text().replace("# concurrency = 2", "concurrency = 4")
    paths.config.write_text(edited)

    report = install("edge", tmp_path, values("edge", mqtt_host="mqtt.plant"), executable=EXE)
    assert report.action(paths.config) == "kept"
    assert report.action(paths.config_new) == "created"
    assert any("edited since it was installed" in line for line in report.lines())
    assert paths.config.read_text() == edited
    assert 'host = "mqtt.plant"' in paths.config_new.read_text()
    before = snapshot(tmp_path)

    again = install("edge", tmp_path, values("edge", mqtt_host="mqtt.plant"), executable=EXE)
    assert (again.action(paths.config), again.action(paths.config_new)) == ("kept", "unchanged")
    assert snapshot(tmp_path) == before


def test_an_upgrade_rewrites_unit_and_unedited_config_and_keeps_the_state(tmp_path: Path) -> None:
    paths = install("edge", tmp_path, values("edge"), executable=EXE).paths
    outbox = paths.state_dir / "edge-edge-7.outbox.db"
    outbox.write_bytes(b"jobs")
    newer = tmp_path / "opt/sluicegate-2/bin/sluicegate"
    newer.parent.mkdir(parents=True)
    shutil.copy(EXE, newer)

    report = install("edge", tmp_path, values("edge", mqtt_host="mqtt.plant"), executable=newer)
    assert report.action(paths.unit) == "updated"
    assert report.action(paths.config) == "updated"  # not edited: the new template wins
    assert report.action(paths.state_dir) == "unchanged"
    assert f"ExecStart={newer} edge run" in paths.unit.read_text()
    assert 'host = "mqtt.plant"' in paths.config.read_text()
    assert outbox.read_bytes() == b"jobs"


def test_uninstall_keeps_the_state_unless_purged(tmp_path: Path) -> None:
    paths = install("edge", tmp_path, values("edge"), executable=EXE).paths
    install("pool", tmp_path, values("pool"), executable=EXE)
    (paths.state_dir / "edge-edge-7.outbox.db").write_bytes(b"jobs")

    report = uninstall("edge", tmp_path)
    assert report.action(paths.unit) == "removed"
    assert report.action(paths.config) == "removed"
    assert report.action(paths.sysusers) == "kept"  # the pool still runs as the user
    assert report.action(paths.state_dir) == "kept"
    assert (paths.state_dir / "edge-edge-7.outbox.db").read_bytes() == b"jobs"
    assert not paths.unit.exists()
    assert not paths.config.exists()

    pool = uninstall("pool", tmp_path, purge=True)
    assert pool.action(paths.sysusers) == "removed"
    assert not pool.paths.state_dir.exists()
    assert paths.state_dir.exists()  # purging the pool leaves the edge's alone
    assert uninstall("edge", tmp_path, purge=True).action(paths.state_dir) == "removed"
    assert not (tmp_path / "var/lib/sluicegate").exists()
    assert not (tmp_path / "etc/sluicegate").exists()


def test_enrollment_prepares_the_state_dir_first(tmp_path: Path) -> None:
    """Enrollment's order: the state dir, the identity files in it, then install."""
    state = prepare_state_dir("edge", tmp_path)
    assert state == node_paths("edge", tmp_path).state_dir
    assert state.stat().st_mode & 0o777 == 0o700
    for name in ("node.key", "node.pem", "ca.pem"):
        (state / name).write_text(name)
    report = install("edge", tmp_path, values("edge"), executable=EXE)
    assert report.action(state) == "unchanged"
    assert sorted(p.name for p in state.iterdir()) == ["ca.pem", "node.key", "node.pem"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"executable": Path("/nonexistent/sluicegate")}, "no sluicegate executable"),
        ({"devices": ["/dev/foo*"]}, "no wildcard"),
    ],
)
def test_install_errors(kwargs: dict[str, object], message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        install("edge", tmp_path, values("edge"), **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "etc").exists()  # refused before writing anything


def test_install_refuses_an_unknown_role(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown role 'camera'; known: edge, pool, broker"):
        install("camera", tmp_path, NodeValues(), executable=EXE)  # type: ignore[arg-type]


@pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("role", ROLES)
def test_installed_unit_passes_systemd_analyze_verify(role: Role, tmp_path: Path) -> None:
    assert ANALYZE is not None
    devices = ["/dev/nvidia*"] if role == "pool" else ["/dev/video0"] if role == "edge" else []
    unit = install(role, tmp_path, values(role), executable=EXE, devices=devices).paths.unit
    # The unit file itself, not --root=: that also resolves ExecStart inside the root.
    verify = subprocess.run([ANALYZE, "verify", str(unit)], capture_output=True, text=True)
    assert (verify.returncode, verify.stderr) == (0, "")


# -- the commands --------------------------------------------------------------------------


def test_cli_install_uninstall_and_one_line_errors(tmp_path: Path) -> None:
    root = str(tmp_path)
    args = ["--root", root, "--id", "line-9", "--zone", "campus/l9", "--exec", str(EXE)]
    done = cli("edge", "install", *args, "--device", "/dev/video0", "--device", "/dev/video1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"created   {tmp_path}/var/lib/sluicegate/edge"
    assert f"{EXE} edge run --config {tmp_path}/etc/sluicegate/edge.toml" in done.stdout
    unit = (tmp_path / "etc/systemd/system/sluicegate-edge.service").read_text()
    assert "DeviceAllow=/dev/video0 rw\nDeviceAllow=/dev/video1 rw" in unit
    again = cli("edge", "install", *args, "--device", "/dev/video0", "--device", "/dev/video1")
    assert [ln.split()[0] for ln in again.stdout.splitlines()[:4]] == ["unchanged"] * 4
    bad = cli("edge", "install", "--root", root, "--id", "x", "--exec", str(EXE))
    assert bad.returncode == 2
    assert bad.stderr.splitlines() == ["error: an edge needs its id and zone: give --id and --zone"]
    broker = cli("broker", "install", "--root", root, "--exec", str(EXE), "--mqtt-port", "0")
    assert broker.returncode == 2
    assert broker.stderr.startswith("error: invalid configuration for the broker config")
    gone = cli("edge", "uninstall", "--root", root)
    assert gone.returncode == 0, gone.stderr
    assert f"kept      {tmp_path}/var/lib/sluicegate/edge" in gone.stdout
    purged = cli("edge", "uninstall", "--root", root, "--purge")
    assert f"removed   {tmp_path}/var/lib/sluicegate/edge" in purged.stdout


@pytest.mark.parametrize(
    ("flag", "given"), [("--id", "line-8-pc"), ("--zone", "campus/fab-north/line-8")]
)
def test_a_join_token_for_another_node_is_refused_by_code_before_it_is_spent(
    flag: str, given: str, tmp_path: Path
) -> None:
    ca_dir = tmp_path / "ca"
    init_folder(ca_dir, "fab-north", now=time.time())
    authority = Authority(ca_dir)
    claims = claims_for(
        node="line-9-pc",
        role="edge",
        zone="campus/fab-north/line-9",
        ttl_s=600,
        now=time.time(),
        url="http://127.0.0.1:9/v1/enroll",  # nothing listens: the token must not be sent
        mqtt="127.0.0.1:8883",
        ca=authority.ca_fingerprint,
        anchor="sha256:" + "00" * 32,
    )
    token = make_token(authority.token_key, claims)
    root = tmp_path / "pc"
    done = cli("edge", "install", "--join", token, "--root", str(root), flag, given)
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: enrollment refused [join.wrong_scope]: ")
    assert f"{flag} {given!r} disagrees with the join token's" in line
    assert not (root / "var/lib/sluicegate/edge/node.key").exists()  # nothing made, nothing sent


@pytest.mark.parametrize("command", [("enroll", "app"), ("edge", "install"), ("pool", "install")])
def test_every_enrollment_command_names_the_refusals_code_once(
    command: tuple[str, str], tmp_path: Path
) -> None:
    where = (
        ["--out-dir", str(tmp_path / "tls")]
        if command[0] == "enroll"
        else ["--root", str(tmp_path)]
    )
    done = cli(*command, "--join", "sgjoin1.not-a-token", *where)
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: enrollment refused [join.malformed]: the join token is damaged")
    assert line.count("enrollment refused") == 1


def test_version() -> None:
    from importlib.metadata import version

    done = cli("--version")
    assert (done.returncode, done.stdout) == (0, f"sluicegate {version('sluicegate')}\n")


def test_config_show_names_each_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = install("edge", tmp_path, values("edge"), executable=EXE).paths.config
    monkeypatch.setenv("SLUICEGATE_MQTT__PORT", "1999")
    monkeypatch.setenv("SLUICEGATE_MQTT__PASSWORD", "hunter2")
    monkeypatch.setenv("SLUICEGATE_POOL__REDIS_URL", "redis://:s3cret@redis.plant:6379/0")
    entries = {(e.section, e.key): e for e in effective(config, "all")}
    assert (entries["mqtt", "port"].value, entries["mqtt", "port"].source) == (
        1999,
        "env SLUICEGATE_MQTT__PORT",
    )
    assert (entries["edge", "id"].value, entries["edge", "id"].source) == ("edge-7", str(config))
    assert (entries["edge", "concurrency"].value, entries["edge", "concurrency"].source) == (
        2,
        "default",
    )
    assert entries["mqtt", "password"].value == MASK
    assert entries["pool", "redis_url"].value == f"redis://:{MASK}@redis.plant:6379/0"

    shown = cli("config", "show", "--config", str(config), "--role", "edge")
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert "hunter2" not in out
    assert "s3cret" not in out
    assert "[pool]" not in out  # --role edge: mqtt, edge, offload
    line = {ln.split(" = ")[0]: ln for ln in out.splitlines() if " = " in ln}
    assert line["port"].split("#")[1].strip() == "env SLUICEGATE_MQTT__PORT"
    assert line["id"].split("#")[1].strip() == str(config)
    assert line["concurrency"].split("#")[1].strip() == "default"
    assert out == render(effective(config, "edge"), config)
    bad = cli("config", "show", "--role", "camera")
    assert bad.stderr == "error: unknown role 'camera'; known: edge, pool, broker, all\n"


# -- an installed edge, end to end ---------------------------------------------------------

# Installs the filter systemd (252) sets up for MemoryDenyWriteExecute=yes on x86-64, checks
# that it bites, then execs the command: mmap with PROT_WRITE|PROT_EXEC, mprotect and
# pkey_mprotect with PROT_EXEC and shmat with SHM_EXEC all fail with EPERM.
MDWE = r"""
import ctypes, mmap, os, struct, sys
ALLOW, DENY, LD, JEQ, AND, RET = 0x7FFF0000, 0x00050001, 0x20, 0x15, 0x54, 0x06
prog = [
    (LD, 0, 0, 4), (JEQ, 1, 0, 0xC000003E), (RET, 0, 0, ALLOW), (LD, 0, 0, 0),
    (JEQ, 4, 0, 9), (JEQ, 8, 0, 10), (JEQ, 7, 0, 329), (JEQ, 11, 0, 30), (RET, 0, 0, ALLOW),
    (LD, 0, 0, 32), (AND, 0, 0, 6), (JEQ, 0, 1, 6), (RET, 0, 0, DENY), (RET, 0, 0, ALLOW),
    (LD, 0, 0, 32), (AND, 0, 0, 4), (JEQ, 0, 1, 4), (RET, 0, 0, DENY), (RET, 0, 0, ALLOW),
    (LD, 0, 0, 32), (AND, 0, 0, 0x8000), (JEQ, 0, 1, 0x8000), (RET, 0, 0, DENY),
    (RET, 0, 0, ALLOW),
]
code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in prog))
class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
fprog = Prog(len(prog), ctypes.addressof(code))
assert libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0  # PR_SET_SECCOMP, filter
try:
    mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    sys.exit("MemoryDenyWriteExecute filter did not refuse a W+X mapping")
except PermissionError:
    pass
os.execv(sys.argv[1], sys.argv[1:])
"""


def under_mdwe(argv: list[str]) -> list[str]:
    if platform.machine() != "x86_64":
        return argv  # the filter above is x86-64's; elsewhere the node runs without it
    return [sys.executable, "-c", MDWE, *argv]


def start_node(mosquitto: ServerProcess, edge_id: str, config: Path) -> subprocess.Popen[bytes]:
    """``sluicegate edge run --config`` as the unit runs it; returns once it is online."""
    watcher = PlainClient(mosquitto.port)
    try:
        watcher.subscribe(topics.edge_status(edge_id))
        # No broker and no pinned policy here (enrollment brings one): offload stays off.
        env = {**os.environ, "SLUICEGATE_OFFLOAD__ENABLED": "false"}
        argv = under_mdwe([str(EXE), "edge", "run", "--config", str(config)])
        proc = subprocess.Popen(argv, env=env)
        while True:
            try:
                got = watcher.next(timeout=1.0)
            except queue.Empty:
                if proc.poll() is not None:
                    raise RuntimeError(f"edge exited with {proc.returncode}") from None
                continue
            if b'"online"' in got.payload:  # a retained copy would say offline
                return proc
    finally:
        watcher.close()


def stop_node(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


def state_files(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir() if p.is_file()
    }


@pytest.mark.integration
@pytest.mark.slow
def test_installed_edge_keeps_its_outbox_across_uninstall_and_reinstall(
    mosquitto: ServerProcess, tmp_path: Path
) -> None:
    edge_id = f"svc-{uuid.uuid4().hex[:6]}"
    root = str(tmp_path)
    install_args = ["edge", "install", "--root", root, "--id", edge_id, "--zone", "campus/svc"]
    install_args += ["--mqtt-host", mosquitto.host, "--mqtt-port", str(mosquitto.port)]
    install_args += ["--plaintext", "--exec", str(EXE)]
    done = cli(*install_args)
    assert done.returncode == 0, done.stderr
    paths = node_paths("edge", tmp_path)
    outbox = paths.state_dir / f"edge-{edge_id}.outbox.db"
    image = sample_jpeg(5, "scratch")[0]
    mqtt = MqttSettings(host=mosquitto.host, port=mosquitto.port)

    node = start_node(mosquitto, edge_id, paths.config)
    try:
        with Client(mqtt, edge=edge_id) as client:
            first = client.infer(image, model="defect-v1", job_id="svc-job-1", timeout=30)
    finally:
        stop_node(node)
    assert first.status == "ok"
    assert first.outputs is not None
    assert first.outputs.label == "scratch"
    assert outbox.is_file()
    kept = state_files(paths.state_dir)

    gone = cli("edge", "uninstall", "--root", root)
    assert gone.returncode == 0, gone.stderr
    assert not paths.config.exists()
    assert not paths.unit.exists()
    assert state_files(paths.state_dir) == kept

    again = cli(*install_args)
    assert again.returncode == 0, again.stderr
    assert f"unchanged {paths.state_dir}" in again.stdout
    assert state_files(paths.state_dir) == kept

    node = start_node(mosquitto, edge_id, paths.config)
    try:
        with Client(mqtt, edge=edge_id) as client:
            repeat = client.infer(image, model="defect-v1", job_id="svc-job-1", timeout=30)
    finally:
        stop_node(node)
    # The stored result, sent again: not a second run (its timings would differ).
    assert json.loads(repeat.model_dump_json()) == json.loads(first.model_dump_json())

    purged = cli("edge", "uninstall", "--root", root, "--purge")
    assert purged.returncode == 0, purged.stderr
    assert not (tmp_path / "var/lib/sluicegate").exists()
