"""Pure tier: the systemd units, the sysusers entry and the config templates of each role.

Tables over the renderers, no fixtures. The units are also put before the real
``systemd-analyze`` (verify, and the offline security rating, printed and held to 2.5 at
most); those tests are skipped only where systemd-analyze is not installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from sluicegate import identity
from sluicegate.config import load_settings
from sluicegate.deploy import units
from sluicegate.deploy.configs import (
    MODELS,
    SECTIONS,
    NodeValues,
    fill,
    is_pristine,
    render_config,
    template_text,
    validate,
)
from sluicegate.deploy.installer import next_steps
from sluicegate.deploy.layout import ROLES, Role, node_paths
from sluicegate.deploy.units import Device, UnitSpec, parse_device, render_sysusers, render_unit
from sluicegate.errors import ConfigError

EXE = Path(sys.executable).with_name("sluicegate")  # a real executable, for verify
MAX_EXPOSURE = 2.5
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(
    ANALYZE is None, reason="systemd-analyze is not installed (scripts/bootstrap installs systemd)"
)

# What the brief of every unit demands, word for word.
HARDENING = [
    "User=sluicegate",
    "Group=sluicegate",
    "StateDirectoryMode=0700",
    "ConfigurationDirectory=sluicegate",
    "ProtectSystem=strict",
    "ProtectHome=yes",
    "PrivateTmp=yes",
    "NoNewPrivileges=yes",
    "CapabilityBoundingSet=",
    "AmbientCapabilities=",
    "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX",
    "SystemCallFilter=@system-service",
    "SystemCallArchitectures=native",
    "UMask=0077",
    "ProtectKernelTunables=yes",
    "ProtectKernelModules=yes",
    "ProtectControlGroups=yes",
    "ProtectClock=yes",
    "ProtectHostname=yes",
    "RestrictNamespaces=yes",
    "RestrictRealtime=yes",
    "RestrictSUIDSGID=yes",
    "LockPersonality=yes",
    "Restart=on-failure",
    "Type=simple",
]
# Device sets a unit is rendered with across the tables below.
DEVICE_SETS: list[tuple[str, ...]] = [(), ("/dev/video0",), ("/dev/nvidia*",)]


def unit(role: Role, devices: tuple[str, ...] = (), exe: Path = EXE) -> str:
    return render_unit(UnitSpec(role, exe, Path(f"/etc/sluicegate/{role}.toml"), devices))


def lines(text: str) -> list[str]:
    return text.splitlines()


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("devices", DEVICE_SETS)
def test_every_unit_carries_the_hardening(role: Role, devices: tuple[str, ...]) -> None:
    got = lines(unit(role, devices))
    missing = [want for want in HARDENING if want not in got]
    assert missing == []
    assert f"StateDirectory=sluicegate/{role}" in got
    assert not any(line.startswith("ProcSubset=") for line in got)  # psutil reads /proc/stat


@pytest.mark.parametrize(("role", "stop_s"), [("edge", "30s"), ("pool", "30s"), ("broker", "15s")])
def test_exec_start_and_stop_timeout(role: Role, stop_s: str) -> None:
    got = lines(unit(role))
    assert f"ExecStart={EXE} {role} run --config /etc/sluicegate/{role}.toml" in got
    assert f"TimeoutStopSec={stop_s}" in got


@pytest.mark.parametrize(
    ("devices", "present", "absent"),
    [
        ((), ["PrivateDevices=yes", "MemoryDenyWriteExecute=yes"], ["DevicePolicy=closed"]),
        (
            ("/dev/video0",),
            [
                "PrivateDevices=no",
                "DevicePolicy=closed",
                "DeviceAllow=/dev/video0 rw",
                "SupplementaryGroups=video",
                "MemoryDenyWriteExecute=yes",
            ],
            ["PrivateDevices=yes"],
        ),
        (
            ("/dev/nvidia*",),
            ["PrivateDevices=no", "DevicePolicy=closed", "DeviceAllow=char-nvidia* rw"],
            ["MemoryDenyWriteExecute=yes", "PrivateDevices=yes", "SupplementaryGroups=video"],
        ),
        (
            ("/dev/video0", "/dev/video1", "/dev/video0"),
            ["DeviceAllow=/dev/video0 rw", "DeviceAllow=/dev/video1 rw"],
            [],
        ),
        (
            ("/dev/dri/renderD128",),
            ["DeviceAllow=/dev/dri/renderD128 rw", "SupplementaryGroups=render video"],
            ["MemoryDenyWriteExecute=yes"],
        ),
    ],
)
def test_devices(devices: tuple[str, ...], present: list[str], absent: list[str]) -> None:
    got = lines(unit("pool", devices))
    assert [want for want in present if want not in got] == []
    assert [line for line in absent if line in got] == []
    assert len([line for line in got if line.startswith("DeviceAllow=")]) == len(set(devices))


@pytest.mark.parametrize(
    ("spec", "device"),
    [
        ("/dev/video0", Device("/dev/video0", ("video",), needs_wx=False)),
        ("/dev/video*", Device("char-video4linux", ("video",), needs_wx=False)),
        ("/dev/nvidia*", Device("char-nvidia*")),
        ("/dev/nvidia0", Device("/dev/nvidia0")),
        ("/dev/nvidia-uvm", Device("/dev/nvidia-uvm")),
        ("/dev/dri/*", Device("char-drm", ("render", "video"))),
        ("/dev/ttyUSB0", Device("/dev/ttyUSB0")),
        ("char-nvidia*", Device("char-nvidia*")),
        ("char-video4linux", Device("char-video4linux", ("video",), needs_wx=False)),
        ("block-sd", Device("block-sd")),
    ],
)
def test_parse_device(spec: str, device: Device) -> None:
    assert parse_device(spec) == device


@pytest.mark.parametrize(
    "spec", ["video0", "/dev/foo*", "/dev/../etc/shadow", "/dev/video 0", "char-", "/etc/passwd"]
)
def test_parse_device_refuses(spec: str) -> None:
    with pytest.raises(ConfigError, match="device"):
        parse_device(spec)


@pytest.mark.parametrize(
    ("exe", "word"),
    [
        (Path("/opt/sluicegate/bin/sluicegate"), "/opt/sluicegate/bin/sluicegate"),
        (Path("/opt/sluice gate/bin/sluicegate"), '"/opt/sluice gate/bin/sluicegate"'),
        (Path("/opt/100%/sluicegate"), "/opt/100%%/sluicegate"),
        (Path("/opt/$HOME/sluicegate"), "/opt/$$HOME/sluicegate"),
    ],
)
def test_exec_start_quoting(exe: Path, word: str) -> None:
    assert f"ExecStart={word} edge run" in unit("edge", exe=exe)


def test_a_node_whose_identity_is_in_use_is_not_restarted() -> None:
    assert units.EXIT_IN_USE == identity.EXIT_IN_USE
    assert f"RestartPreventExitStatus={identity.EXIT_IN_USE}" in lines(unit("edge"))


def test_relative_paths_are_refused() -> None:
    with pytest.raises(ConfigError, match="absolute"):
        render_unit(UnitSpec("edge", Path("sluicegate"), Path("/etc/sluicegate/edge.toml")))


def test_sysusers_entry_is_the_same_for_every_role() -> None:
    text = render_sysusers()
    assert 'u sluicegate - "Sluicegate machine-vision node" /var/lib/sluicegate' in lines(text)


# -- systemd-analyze, the real one ---------------------------------------------------------


def _exposure(output: str) -> float:
    found = re.search(r"Overall exposure level for \S+: ([0-9.]+)", output)
    assert found is not None, output
    return float(found.group(1))


@needs_analyze
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("devices", DEVICE_SETS)
def test_systemd_analyze_verify_and_security(
    role: Role, devices: tuple[str, ...], tmp_path: Path
) -> None:
    assert ANALYZE is not None
    path = tmp_path / f"sluicegate-{role}.service"
    path.write_text(unit(role, devices))
    verify = subprocess.run(
        [ANALYZE, "verify", str(path)], capture_output=True, text=True, check=False
    )
    assert verify.returncode == 0, verify.stderr
    assert verify.stderr == ""  # no warning either
    security = subprocess.run(
        [ANALYZE, "security", "--offline=yes", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert security.returncode == 0, security.stderr
    score = _exposure(security.stdout)
    shown = f" (devices: {', '.join(devices)})" if devices else ""
    print(f"systemd-analyze security --offline=yes: sluicegate-{role}.service{shown}: {score}")
    assert score <= MAX_EXPOSURE


@needs_analyze
def test_systemd_analyze_catches_a_missing_executable(tmp_path: Path) -> None:
    """verify is the check that the unit's ExecStart exists: prove it looks."""
    assert ANALYZE is not None
    path = tmp_path / "sluicegate-edge.service"
    path.write_text(unit("edge", exe=tmp_path / "no-such-sluicegate"))
    verify = subprocess.run(
        [ANALYZE, "verify", str(path)], capture_output=True, text=True, check=False
    )
    assert verify.returncode != 0
    assert "no-such-sluicegate" in verify.stderr


# -- config templates ----------------------------------------------------------------------

KEY = re.compile(r"(# )?([a-z_]+) = (.*)")


def template_keys(role: Role) -> dict[tuple[str, str], list[tuple[int, bool, str]]]:
    """(section, key) -> [(line number, commented out, value text)] in ``role``'s template."""
    found: dict[tuple[str, str], list[tuple[int, bool, str]]] = {}
    section = ""
    for number, line in enumerate(template_text(role).splitlines()):
        if line.startswith("["):
            section = line.strip("[]")
        m = KEY.fullmatch(line)
        if m:
            found.setdefault((section, m.group(2)), []).append(
                (number, bool(m.group(1)), m.group(3))
            )
    return found


@pytest.mark.parametrize("role", ROLES)
def test_template_parses_with_load_settings(role: Role, tmp_path: Path) -> None:
    path = tmp_path / f"{role}.toml"
    path.write_text(template_text(role))
    settings = load_settings(path)
    mqtt = settings.mqtt
    assert (mqtt.plaintext, mqtt.port) == (False, 8883)  # TLS on by default
    state = Path(f"/var/lib/sluicegate/{role}")
    assert (mqtt.tls_ca_file, mqtt.tls_cert_file, mqtt.tls_key_file) == (
        state / "ca.pem",
        state / "node.pem",
        state / "node.key",
    )
    node: Any = getattr(settings, role)
    assert node.key_file == state / "node.key"
    state_dir = settings.offload.state_dir if role == "edge" else node.state_dir
    assert state_dir == state


@pytest.mark.parametrize("role", ROLES)
def test_template_documents_every_key_once(role: Role) -> None:
    keys = template_keys(role)
    text = template_text(role).splitlines()
    for section in SECTIONS[role]:
        for field in MODELS[section].model_fields:
            where = keys.get((section, field), [])
            assert len(where) == 1, f"[{section}] {field} appears {len(where)} times"
            # Above the key, past the keys documented with it, is a comment about them.
            number = where[0][0] - 1
            while KEY.fullmatch(text[number]):
                number -= 1
            assert text[number].startswith("# "), f"[{section}] {field} has no comment"
    sections = {s for s, _ in keys}
    assert sections == set(SECTIONS[role])


@pytest.mark.parametrize("role", ROLES)
def test_template_commented_values_are_the_defaults(role: Role) -> None:
    """A key commented out shows the default from sluicegate/config.py (an example when
    the default is None)."""
    for (section, key), [(_, commented, raw)] in template_keys(role).items():
        if not commented:
            continue
        model: type[BaseModel] = MODELS[section]
        default = model.model_fields[key].default
        if default is None:
            continue
        value = tomllib.loads(f"v = {raw}")["v"]
        assert value == default, f"[{section}] {key}: template says {raw}, default {default!r}"


# -- filling a template --------------------------------------------------------------------

TEMPLATE = '[a]\n# doc\nx = 1\n# y = "old"\nz = true\n\n[b]\nx = 2\n'


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"a": {"x": 5}}, '[a]\n# doc\nx = 5\n# y = "old"\nz = true\n\n[b]\nx = 2\n'),
        ({"b": {"x": "s"}}, '[a]\n# doc\nx = 1\n# y = "old"\nz = true\n\n[b]\nx = "s"\n'),
        ({"a": {"y": Path("/p q")}}, '[a]\n# doc\nx = 1\ny = "/p q"\nz = true\n\n[b]\nx = 2\n'),
        ({"a": {"z": None}}, '[a]\n# doc\nx = 1\n# y = "old"\n# z = true\n\n[b]\nx = 2\n'),
        ({"a": {"y": None}}, TEMPLATE),
        ({"a": {"z": False}}, '[a]\n# doc\nx = 1\n# y = "old"\nz = false\n\n[b]\nx = 2\n'),
        ({"a": {"x": 'say "hi"'}}, TEMPLATE.replace("x = 1", 'x = "say \\"hi\\""')),
    ],
)
def test_fill(values: Any, expected: str) -> None:
    assert fill(TEMPLATE, values) == expected


@pytest.mark.parametrize(
    ("values", "message"),
    [({"a": {"w": 1}}, r"no line for \[a\] w"), ({"c": {"x": 1}}, r"no line for \[c\] x")],
)
def test_fill_refuses_a_key_the_template_lacks(values: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fill(TEMPLATE, values)


def test_fill_refuses_a_key_twice() -> None:
    with pytest.raises(ValueError, match="twice"):
        fill("[a]\nx = 1\n# x = 2\n", {"a": {"x": 3}})


# -- the rendered config -------------------------------------------------------------------

MODELS_DIR = Path("/opt/sluicegate/models")
LINE = NodeValues(id="line-3", zone="campus/fab/line-3", mqtt_host="mqtt.plant", mqtt_port=8884)


@pytest.mark.parametrize("role", ROLES)
def test_rendered_config_points_inside_its_root(role: Role, tmp_path: Path) -> None:
    values = LINE if role != "broker" else NodeValues(id="broker-2", mqtt_host="mqtt.plant")
    paths = node_paths(role, tmp_path)
    text = render_config(role, values, paths, MODELS_DIR)
    assert is_pristine(text)
    paths.config.parent.mkdir(parents=True)
    paths.config.write_text(text)
    settings = load_settings(paths.config)
    node: Any = getattr(settings, role)
    assert node.id == values.id
    assert node.key_file == paths.key_file == tmp_path / f"var/lib/sluicegate/{role}/node.key"
    assert node.models_dir == MODELS_DIR
    assert settings.mqtt.host == "mqtt.plant"
    assert settings.mqtt.port == (values.mqtt_port or 8883)
    assert settings.mqtt.tls_cert_file == paths.cert_file
    assert settings.mqtt.tls_ca_file == paths.ca_file
    assert not settings.mqtt.plaintext
    if role == "edge":
        assert settings.offload.state_dir == paths.state_dir
        assert settings.edge.zone == "campus/fab/line-3"
    else:
        assert node.state_dir == paths.state_dir
    if role == "broker":
        assert settings.broker.policy_file == tmp_path / "etc/sluicegate/policy.toml"


def test_plaintext_comments_tls_out(tmp_path: Path) -> None:
    values = NodeValues(id="e", zone="z", plaintext=True)
    text = render_config("edge", values, node_paths("edge", tmp_path), MODELS_DIR)
    data = tomllib.loads(text)
    assert data["mqtt"]["plaintext"] is True
    assert data["mqtt"]["port"] == 1883
    assert not {"tls_ca_file", "tls_cert_file", "tls_key_file"} & set(data["mqtt"])


@pytest.mark.parametrize(
    ("role", "values", "message"),
    [
        ("edge", NodeValues(zone="z"), "needs its id and zone"),
        ("pool", NodeValues(id="w"), "needs its id and zone"),
        ("broker", NodeValues(zone="z"), "no zone"),
        ("edge", NodeValues(id="line/3", zone="z"), "invalid edge id 'line/3'"),
        ("edge", NodeValues(id="e", zone="z", mqtt_port=70000), r"\[mqtt\] port"),
    ],
)
def test_bad_values_are_config_errors(
    role: Role, values: NodeValues, message: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=message):
        render_config(role, values, node_paths(role, tmp_path), MODELS_DIR)


@pytest.mark.parametrize(
    ("edit", "pristine"),
    [
        (lambda t: t, True),
        (lambda t: t.replace("# concurrency = 2", "concurrency = 4"), False),
        (lambda t: t + "\n", False),
        (lambda t: t.split("\n", 1)[1], False),  # checksum line gone
    ],
)
def test_is_pristine(edit: Any, pristine: bool, tmp_path: Path) -> None:
    text = render_config("edge", LINE, node_paths("edge", tmp_path), MODELS_DIR)
    assert is_pristine(edit(text)) is pristine


def test_validate_names_the_source() -> None:
    with pytest.raises(ConfigError, match=r"my\.toml"):
        validate("pool", "[pool]\nmax_batch = 0\n", "my.toml")


@pytest.mark.parametrize(
    ("root", "systemd", "upgraded", "expected"),
    [
        (
            Path("/srv/stage"),
            True,
            True,
            [
                "staged under /srv/stage; nothing was run. To try the node from there:",
                "  /x/sluicegate edge run --config /srv/stage/etc/sluicegate/edge.toml",
            ],
        ),
        (
            Path("/"),
            True,
            False,
            ["to start it now and at every boot: systemctl enable --now sluicegate-edge.service"],
        ),
        (
            Path("/"),
            True,
            True,
            [
                "to start it now and at every boot: systemctl enable --now sluicegate-edge.service",
                "if it already runs, restart it to apply the change: "
                "systemctl restart sluicegate-edge.service",
            ],
        ),
        (
            Path("/"),
            False,
            False,
            [
                "systemd is not running here: the unit takes effect at boot.",
                "to start it now and at every boot: systemctl enable --now sluicegate-edge.service",
            ],
        ),
    ],
)
def test_next_steps(root: Path, systemd: bool, upgraded: bool, expected: list[str]) -> None:
    paths = node_paths("edge", root)
    got = next_steps("edge", paths, Path("/x/sluicegate"), systemd=systemd, upgraded=upgraded)
    assert list(got) == expected
