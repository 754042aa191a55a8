"""The hardened systemd unit of each role and the sysusers.d entry, rendered as text.

Pure: a :class:`UnitSpec` in, the unit file's text out; no file is read or written here
(the installer does that). Every hardening option is chosen so that
``systemd-analyze security --offline=yes`` rates the unit at most 2.5 while Python, ONNX
Runtime, OpenCV, psutil, SQLite and paho still work inside it; the reason for each option
that could break them is beside it. Devices are the one thing a unit may be given: each
configured device becomes a ``DeviceAllow=`` line under ``DevicePolicy=closed``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from sluicegate.deploy.layout import STATE_ROOT, USER, Role, unit_name
from sluicegate.errors import ConfigError

DESCRIPTION: dict[Role, str] = {
    "edge": "Sluicegate edge agent",
    "pool": "Sluicegate center-pool worker",
    "broker": "Sluicegate campus broker",
}

# How long systemd waits after SIGTERM before it kills. An edge answers what it has queued
# for up to 10 s (EdgeAgent.run's drain_timeout), then flushes its answers for 2 s and
# publishes offline; a pool worker drains its batches for up to 10 s. A kill after this
# loses no job (the outbox replays it at the next start), it only delays those answers.
STOP_TIMEOUT_S: dict[Role, int] = {"edge": 30, "pool": 30, "broker": 15}
# The exit status of a node that found another process serving its identity
# (sluicegate.identity.EXIT_IN_USE, not imported: that module brings asyncio). Starting it
# again would only fence one of the two again, so systemd does not.
EXIT_IN_USE = 3


@dataclass(frozen=True)
class Device:
    """One device a unit may open: its ``DeviceAllow=`` specifier and what goes with it."""

    allow: str  # a /dev path, or char-<group>/block-<group> as /proc/devices names it
    groups: tuple[str, ...] = ()  # groups that own such device nodes (udev's defaults)
    # Its user-space driver is not known to run under MemoryDenyWriteExecute=yes: GPU
    # stacks (CUDA, OpenCL, Vulkan) compile kernels at run time, and no GPU was at hand to
    # check them when this was written. A camera (V4L2) is only ioctl and mmap'd buffers.
    needs_wx: bool = True


@dataclass(frozen=True)
class _Family:
    path: re.Pattern[str]
    group: str  # what a glob over the family's paths becomes
    groups: tuple[str, ...]
    needs_wx: bool


# DeviceAllow= takes no wildcard in a path (only in char-/block- group names), so a glob
# the operator writes for a device family becomes the family's group in /proc/devices:
# char-nvidia* covers the groups NVIDIA's driver registers (nvidia or nvidia-frontend,
# nvidia-uvm, nvidia-caps).
_FAMILIES = (
    _Family(re.compile(r"/dev/video[0-9*]*"), "char-video4linux", ("video",), False),
    _Family(re.compile(r"/dev/nvidia.*"), "char-nvidia*", (), True),
    _Family(re.compile(r"/dev/dri/.*"), "char-drm", ("render", "video"), True),
)
_PATH = re.compile(r"/dev/[A-Za-z0-9._+*?/-]+")
_GROUP = re.compile(r"(char|block)-[A-Za-z0-9._+*?-]+")


def parse_device(spec: str) -> Device:
    """What ``--device spec`` allows: an exact ``/dev`` path, a known family's glob
    (``/dev/nvidia*``, ``/dev/video*``, ``/dev/dri/*``), or ``char-<group>``."""
    if _GROUP.fullmatch(spec):
        camera = spec == "char-video4linux"
        return Device(spec, ("video",) if camera else (), needs_wx=not camera)
    if not _PATH.fullmatch(spec) or ".." in spec.split("/"):
        raise ConfigError(
            f"device {spec!r} cannot be allowed: use a device node path such as /dev/video0, "
            "a family glob (/dev/nvidia*, /dev/video*, /dev/dri/*), or a device group from "
            "/proc/devices as char-<name> (wildcards allowed there, e.g. char-nvidia*)"
        )
    family = next((f for f in _FAMILIES if f.path.fullmatch(spec)), None)
    if "*" in spec or "?" in spec:
        if family is None:
            raise ConfigError(
                f"device {spec!r}: systemd allows no wildcard in a device path; name the "
                "device group from /proc/devices instead, e.g. char-nvidia* or char-drm"
            )
        return Device(family.group, family.groups, family.needs_wx)
    if family is None:
        return Device(spec)
    return Device(spec, family.groups, family.needs_wx)


@dataclass(frozen=True)
class UnitSpec:
    """What one role's unit is rendered from."""

    role: Role
    executable: Path  # the ``sluicegate`` console script
    config: Path  # the config file ExecStart passes with --config
    devices: tuple[str, ...] = ()  # --device specs, see parse_device


def _exec_arg(text: str) -> str:
    """``text`` as one ExecStart= word: % and $ escaped, quoted when it has to be."""
    if any(ord(c) < 0x20 or c == "\x7f" for c in text):
        raise ConfigError(f"path {text!r} contains a control character; choose another")
    escaped = text.replace("%", "%%").replace("$", "$$")
    if re.fullmatch(r"[A-Za-z0-9_@%+=:,./$-]+", escaped):
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def render_unit(spec: UnitSpec) -> str:
    """The text of ``sluicegate-<role>.service`` for ``spec``."""
    for path in (spec.executable, spec.config):
        if not path.is_absolute():
            raise ConfigError(f"{path} must be an absolute path: systemd runs it from /")
    devices = [parse_device(d) for d in spec.devices]
    role = spec.role
    command = [str(spec.executable), role, "run", "--config", str(spec.config)]
    lines = [
        f"# Written by `sluicegate {role} install`; the next install (an upgrade) rewrites",
        f"# it. Put local changes in a drop-in: systemctl edit {unit_name(role)}",
        "",
        "[Unit]",
        f"Description={DESCRIPTION[role]}",
        "Wants=network-online.target",
        "After=network-online.target",
        "",
        "[Service]",
        "Type=simple",
        "ExecStart=" + " ".join(_exec_arg(word) for word in command),
        "Restart=on-failure",
        "RestartSec=5s",
        f"RestartPreventExitStatus={EXIT_IN_USE}",
        f"TimeoutStopSec={STOP_TIMEOUT_S[role]}s",
        # A static system user (sysusers.d), not DynamicUser=: enrollment writes the node's
        # key and certificate into the state directory before the first start and needs an
        # owner that exists then; the config (it may hold the MQTT password) is
        # root:sluicegate 0640, a group that exists before the service runs; and the
        # owner of the outbox stays the same across restarts, upgrades and restores.
        f"User={USER}",
        f"Group={USER}",
    ]
    groups = _unique([g for d in devices for g in d.groups])
    if groups:
        lines.append("SupplementaryGroups=" + " ".join(groups))
    lines += [
        # The outbox, node key, TLS certificate, CA and pinned policy: the service's own.
        f"StateDirectory={STATE_ROOT.name}/{role}",
        "StateDirectoryMode=0700",
        "ConfigurationDirectory=sluicegate",
        "UMask=0077",
        "NoNewPrivileges=yes",
        "CapabilityBoundingSet=",
        "AmbientCapabilities=",
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "PrivateTmp=yes",
    ]
    if devices:
        lines += ["PrivateDevices=no", "DevicePolicy=closed"]
        lines += [f"DeviceAllow={a} rw" for a in _unique([d.allow for d in devices])]
    else:
        lines.append("PrivateDevices=yes")
    lines += [
        # Only root and the service's user and group are mapped; the supplementary groups'
        # device access still holds (the kernel checks the real group ids).
        "PrivateUsers=yes",
        "PrivateIPC=yes",
        # Other processes hidden; /proc/stat and /proc/meminfo stay (psutil reads them),
        # hence no ProcSubset=pid.
        "ProtectProc=invisible",
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX",
        "RestrictNamespaces=yes",
        "RestrictRealtime=yes",
        "RestrictSUIDSGID=yes",
        "LockPersonality=yes",
    ]
    if not any(d.needs_wx for d in devices):
        # Checked under systemd's own filter (and the kernel's PR_SET_MDWE, which newer
        # systemd uses): cryptography, ONNX Runtime's CPU provider, OpenCV, SQLite,
        # psutil and ctypes callbacks (libffi's static trampolines) all work; cffi's
        # ffi.callback() would not, and nothing here uses it. tests/test_deploy_install.py
        # runs the edge under that filter.
        lines.append("MemoryDenyWriteExecute=yes")
    lines += [
        "RemoveIPC=yes",
        "KeyringMode=private",
        "SystemCallArchitectures=native",
        "SystemCallFilter=@system-service",
        "SystemCallFilter=~@privileged",
        # A refused call fails with EPERM (the library sees an error it can handle)
        # instead of killing the process.
        "SystemCallErrorNumber=EPERM",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ]
    return "\n".join(lines)


def render_sysusers() -> str:
    """The sysusers.d entry of the ``sluicegate`` user and group (the same for every role)."""
    return (
        "# Written by `sluicegate <role> install`: the system user every Sluicegate role runs\n"
        "# as. systemd-sysusers creates it at boot, or at once with:\n"
        f"#   systemd-sysusers /usr/lib/sysusers.d/{USER}.conf\n"
        f'u {USER} - "Sluicegate machine-vision node" /{STATE_ROOT}\n'
    )
