"""Installs and removes one role as a systemd service: the shell around the pure renderers.

It writes the config, the unit, the sysusers entry and the state directory under ``root``
(``/`` for the real system), each only when its content differs, so running it again with
the same inputs changes nothing and says so. It never overwrites a config an operator
edited (the new one goes beside it as ``<role>.toml.new``), never removes a state
directory (the outbox) unless asked to purge, and never enables or starts a service.
Outside ``/`` it runs no command at all; at ``/`` it creates the system user with
systemd-sysusers and, where systemd runs, reloads it (and uninstall stops the service).
Enrollment calls :func:`prepare_state_dir` first to put the node's key and certificates in
place, then :func:`install`.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sluicegate.deploy.configs import NodeValues, is_pristine, render_config
from sluicegate.deploy.layout import (
    ROLES,
    USER,
    NodePaths,
    Role,
    check_role,
    node_paths,
    state_dir,
    unit_name,
)
from sluicegate.deploy.units import UnitSpec, render_sysusers, render_unit
from sluicegate.errors import ConfigError, SluicegateError
from sluicegate.files import write_atomic

__all__ = [
    "FileChange",
    "InstallReport",
    "NodeValues",
    "default_executable",
    "install",
    "next_steps",
    "prepare_state_dir",
    "uninstall",
]

Action = Literal["created", "updated", "unchanged", "kept", "removed", "absent"]
SYSTEM_ROOT = Path("/")
# What ProtectHome=yes hides from the service: a program or models folder there won't run.
HIDDEN = (Path("/home"), Path("/root"), Path("/run/user"))


@dataclass(frozen=True)
class FileChange:
    path: Path
    action: Action
    note: str = ""


@dataclass(frozen=True)
class InstallReport:
    """What an install or uninstall did, file by file, and what it leaves to the operator."""

    role: Role
    paths: NodePaths
    changes: tuple[FileChange, ...]
    ran: tuple[tuple[str, ...], ...] = ()  # commands it ran, in order
    next_steps: tuple[str, ...] = ()  # lines for the operator

    def action(self, path: Path) -> Action:
        """What happened to ``path`` (KeyError if the report does not mention it)."""
        for change in self.changes:
            if change.path == path:
                return change.action
        raise KeyError(path)

    def lines(self) -> list[str]:
        out = [
            f"{c.action:<9} {c.path}" + (f"  ({c.note})" if c.note else "") for c in self.changes
        ]
        out += [f"ran       {' '.join(argv)}" for argv in self.ran]
        return out + list(self.next_steps)


def default_executable() -> Path:
    """The ``sluicegate`` console script beside the interpreter running this."""
    return Path(sys.executable).with_name("sluicegate")


def prepare_state_dir(role: Role, root: Path) -> Path:
    """Create ``role``'s state directory under ``root`` (mode 0700; its parents 0755) if it
    is missing, and return it. Files put there before the first start (the node key, its
    certificate, the CA) may be owned by root: systemd hands the whole directory to the
    service's user when it starts the unit (StateDirectory=)."""
    path = state_dir(check_role(role), root)
    _ensure_dir(path)
    return path


def install(
    role: Role,
    root: Path,
    values: NodeValues,
    *,
    executable: Path | None = None,
    devices: Sequence[str] = (),
) -> InstallReport:
    """Install ``role`` under ``root`` (``/`` for the real system): its state directory,
    sysusers entry, config (from ``values``) and unit.

    ``executable`` is the ``sluicegate`` the unit runs (default :func:`default_executable`);
    ``devices`` are the device nodes it may open (``/dev/video0``, ``/dev/nvidia*``, …).
    Raises ConfigError for a bad value and SluicegateError when a file cannot be written.
    """
    role = check_role(role)
    paths = node_paths(role, root)
    exe = _executable(executable)
    models = _models_dir(values.models_dir)
    if root == SYSTEM_ROOT:
        _check_visible(exe, models)
    config_text = render_config(role, values, paths, models)
    unit_text = render_unit(UnitSpec(role, exe, paths.config, tuple(devices)))

    existed = paths.state_dir.is_dir()
    prepare_state_dir(role, root)
    changes = [FileChange(paths.state_dir, "unchanged" if existed else "created")]
    ran: list[tuple[str, ...]] = []
    changes.append(FileChange(paths.sysusers, _write(paths.sysusers, render_sysusers(), 0o644)))
    if root == SYSTEM_ROOT and not _user_exists():
        ran.append(_run("systemd-sysusers", str(paths.sysusers)))
    changes += _place_config(paths, config_text, group=root == SYSTEM_ROOT)
    unit_action = _write(paths.unit, unit_text, 0o644)
    changes.append(FileChange(paths.unit, unit_action))
    systemd = root == SYSTEM_ROOT and _systemd_running()
    if systemd and unit_action != "unchanged":
        ran.append(_run("systemctl", "daemon-reload"))
    upgraded = any(c.action == "updated" for c in changes)
    steps = next_steps(role, paths, exe, systemd=systemd, upgraded=upgraded)
    return InstallReport(role, paths, tuple(changes), tuple(ran), steps)


def uninstall(role: Role, root: Path, purge: bool = False) -> InstallReport:
    """Remove ``role``'s unit and config from ``root``, and the sysusers entry when no other
    role is installed there. The state directory (the outbox, the node key) stays unless
    ``purge``. At ``/`` with systemd running, the service is stopped and disabled first."""
    role = check_role(role)
    paths = node_paths(role, root)
    systemd = root == SYSTEM_ROOT and _systemd_running()
    ran: list[tuple[str, ...]] = []
    if systemd and paths.unit.exists():
        ran.append(_run("systemctl", "disable", "--now", unit_name(role)))
    changes = [FileChange(p, _remove(p)) for p in (paths.unit, paths.config, paths.config_new)]
    others = [r for r in ROLES if r != role and node_paths(r, root).unit.exists()]
    if others:
        note = f"still used by {', '.join(others)}"
        changes.append(FileChange(paths.sysusers, "kept", note))
    else:
        changes.append(FileChange(paths.sysusers, _remove(paths.sysusers)))
    if purge:
        changes.append(FileChange(paths.state_dir, _remove_tree(paths.state_dir)))
    elif paths.state_dir.exists():
        note = "the outbox and the node's key stay; uninstall --purge removes them"
        changes.append(FileChange(paths.state_dir, "kept", note))
    if systemd:
        ran.append(_run("systemctl", "daemon-reload"))
    return InstallReport(role, paths, tuple(changes), tuple(ran))


def next_steps(
    role: Role, paths: NodePaths, exe: Path, *, systemd: bool, upgraded: bool
) -> tuple[str, ...]:
    """What the operator does next (it is never done for them); ``upgraded``: the unit or
    the config changed."""
    unit = unit_name(role)
    if paths.root != SYSTEM_ROOT:
        return (
            f"staged under {paths.root}; nothing was run. To try the node from there:",
            f"  {exe} {role} run --config {paths.config}",
        )
    steps = [] if systemd else ["systemd is not running here: the unit takes effect at boot."]
    steps.append(f"to start it now and at every boot: systemctl enable --now {unit}")
    if upgraded:
        steps.append(
            f"if it already runs, restart it to apply the change: systemctl restart {unit}"
        )
    return tuple(steps)


def _executable(given: Path | None) -> Path:
    exe = Path(os.path.abspath(given or default_executable()))  # symlinks kept: a venv's
    if not (exe.is_file() and os.access(exe, os.X_OK)):
        how = "" if given else " (looked beside the running interpreter)"
        raise ConfigError(f"no sluicegate executable at {exe}{how}; pass --exec PATH")
    return exe


def _models_dir(given: Path | None) -> Path:
    if given is None:
        from sluicegate.vision.runtime import default_models_dir

        given = default_models_dir()
    models = Path(os.path.abspath(given))
    if not models.is_dir():
        raise ConfigError(f"models folder {models} does not exist; pass --models-dir DIR")
    return models


def _interpreter(exe: Path) -> Path | None:
    """The interpreter a script's ``#!`` line names, if it has one."""
    try:
        with exe.open("rb") as fh:
            first = fh.readline(512)
    except OSError:
        return None
    if not first.startswith(b"#!") or not first[2:].split():
        return None
    return Path(os.fsdecode(first[2:].split()[0]))


def _check_visible(exe: Path, models: Path) -> None:
    """Refuse a program or models folder the unit's ProtectHome=yes would hide."""
    used = [exe, exe.resolve(), models.resolve()]
    interpreter = _interpreter(exe)
    if interpreter is not None:
        used += [interpreter, interpreter.resolve()]
    for path in used:
        for hidden in HIDDEN:
            if path.is_relative_to(hidden):
                raise ConfigError(
                    f"{path} is under {hidden}, which the service cannot see (ProtectHome=yes); "
                    "install Sluicegate elsewhere, e.g. python3 -m venv /opt/sluicegate, and "
                    "run that one's sluicegate (or pass --exec and --models-dir)"
                )


def _systemd_running() -> bool:
    return Path("/run/systemd/system").is_dir()


def _user_exists() -> bool:
    try:
        pwd.getpwnam(USER)
    except KeyError:
        return False
    return True


def _run(*argv: str) -> tuple[str, ...]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise SluicegateError(f"cannot run {argv[0]}: {exc.strerror}") from exc
    if done.returncode != 0:
        why = done.stderr.strip() or f"exit status {done.returncode}"
        raise SluicegateError(f"{' '.join(argv)} failed: {why}")
    return argv


def _failed(path: Path, exc: OSError) -> SluicegateError:
    return SluicegateError(
        f"cannot change {path}: {exc.strerror}; run as root, or stage the files under "
        "another folder with --root DIR"
    )


def _ensure_dir(path: Path) -> None:
    try:
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        if not path.is_dir():
            path.mkdir(mode=0o700)
        if path.stat().st_mode & 0o777 != 0o700:
            path.chmod(0o700)
    except OSError as exc:
        raise _failed(path, exc) from exc


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise SluicegateError(f"cannot read {path}: {exc}") from exc


def _write(path: Path, text: str, mode: int) -> Action:
    """Make ``path`` hold ``text`` with ``mode``, touching it only if it differs."""
    current = _read(path)
    try:
        if current == text:
            if path.stat().st_mode & 0o777 == mode:
                return "unchanged"
            path.chmod(mode)
            return "updated"
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        write_atomic(path, text.encode(), mode=mode)  # readers see old or new, never half
    except OSError as exc:
        raise _failed(path, exc) from exc
    return "created" if current is None else "updated"


def _give_group(path: Path) -> None:
    """Let the service's group read ``path`` (the config is root:sluicegate 0640)."""
    if os.geteuid() != 0:
        return
    try:
        gid = grp.getgrnam(USER).gr_gid
    except KeyError:
        return  # no such group yet (systemd-sysusers did not run): root-only until then
    try:
        if path.stat().st_gid != gid:
            os.chown(path, -1, gid)
    except OSError as exc:
        raise _failed(path, exc) from exc


def _place_config(paths: NodePaths, text: str, *, group: bool) -> list[FileChange]:
    current = _read(paths.config)
    if current is None or current == text or is_pristine(current):
        changes = [FileChange(paths.config, _write(paths.config, text, 0o640))]
    else:
        action = _write(paths.config_new, text, 0o640)
        note = f"edited since it was installed; the new config is {paths.config_new.name}"
        changes = [FileChange(paths.config, "kept", note), FileChange(paths.config_new, action)]
    if group:
        for change in changes:
            _give_group(change.path)
    return changes


def _remove(path: Path) -> Action:
    try:
        path.unlink()
    except FileNotFoundError:
        return "absent"
    except OSError as exc:
        raise _failed(path, exc) from exc
    _remove_empty(path.parent)
    return "removed"


def _remove_tree(path: Path) -> Action:
    if not path.exists():
        return "absent"
    try:
        shutil.rmtree(path)
    except OSError as exc:
        raise _failed(path, exc) from exc
    _remove_empty(path.parent)
    return "removed"


def _remove_empty(folder: Path) -> None:
    """Remove ``folder`` if it is our own and now empty (``/etc/sluicegate``, ``/var/lib/
    sluicegate``); a folder others share is never removed."""
    if folder.name == USER:
        # Not empty: something else lives there (a policy file, another role).
        with contextlib.suppress(OSError):
            folder.rmdir()
