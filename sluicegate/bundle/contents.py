"""What an offline install bundle holds and the checks that decide it, without running pip.

The target (Python minor version and manylinux platform) and the tags pip is told to
accept for it, the models with each file's sha256 checked against its manifest, the
``MANIFEST.json`` that lists every file with its sha256 and size, the oldest glibc the
chosen wheels run on, the dev tools that must never be in it, and the ``install.sh``
rendered for the target. Reading the files it is given is the only I/O here; building,
downloading and archiving are :mod:`sluicegate.bundle.build`'s.
"""

from __future__ import annotations

import hashlib
import os
import platform as platform_module
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluicegate.errors import BundleError, ModelIntegrityError
from sluicegate.vision.manifest import load_manifest, verified_file

# Never in a bundle: the [project.optional-dependencies] dev and models tools.
DEV_TOOLS = frozenset(
    {
        "pytest",
        "pytest-asyncio",
        "pytest-timeout",
        "pytest-cov",
        "coverage",
        "hypothesis",
        "mypy",
        "ruff",
        "types-psutil",
        "onnx",
        "torch",
    }
)
FORMAT = 1  # MANIFEST.json's layout version
INSTALL_SCRIPT = Path(__file__).with_name("install.sh")
_LEGACY = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
_TAG = re.compile(r"^(?:manylinux_(\d+)_(\d+)|(manylinux1|manylinux2010|manylinux2014))_(\w+)$")
_PYTHON = re.compile(r"^3\.(\d{1,2})$")


@dataclass(frozen=True)
class Target:
    """The Python and platform the bundle's wheels are chosen for."""

    python: str  # "3.11"
    glibc: tuple[int, int]  # the newest glibc pip may pick wheels for
    arch: str  # "x86_64"

    @property
    def abi(self) -> str:
        return "cp" + self.python.replace(".", "")

    @property
    def platform(self) -> str:
        return f"manylinux_{self.glibc[0]}_{self.glibc[1]}_{self.arch}"

    def platform_tags(self) -> list[str]:
        """Every manylinux tag a wheel may carry to run here, newest first. pip expands
        only the legacy ``manylinux2014``-style tags by itself, so it is given all of them."""
        major, newest = self.glibc
        tags = []
        for minor in range(newest, 4, -1):
            tags.append(f"manylinux_{major}_{minor}_{self.arch}")
            tags += [f"{old}_{self.arch}" for old, v in _LEGACY.items() if v == (major, minor)]
        return tags


def parse_tag(tag: str) -> tuple[tuple[int, int], str] | None:
    """``manylinux_2_28_x86_64`` or ``manylinux2014_x86_64`` as ((2, 28), 'x86_64'), else None."""
    m = _TAG.match(tag)
    if m is None:
        return None
    glibc = _LEGACY[m[3]] if m[3] else (int(m[1]), int(m[2]))
    return glibc, m[4]


def this_platform() -> str:
    """This machine's manylinux tag, from its C library and architecture."""
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        libc = ""
    m = re.fullmatch(r"glibc (\d+)\.(\d+).*", libc)
    if m is None:
        raise BundleError(
            f"cannot tell this machine's platform (C library {libc or 'unknown'!r}, not glibc); "
            "pass --platform, e.g. manylinux_2_28_x86_64"
        )
    return f"manylinux_{m[1]}_{m[2]}_{platform_module.machine()}"


def target(python: str | None = None, platform: str | None = None) -> Target:
    """The target named by ``--python`` and ``--platform``; None means this interpreter's and
    this machine's."""
    if python is None:
        python = f"{sys.version_info.major}.{sys.version_info.minor}"
    if _PYTHON.match(python) is None:
        raise BundleError(f"unknown Python version {python!r}; give major.minor, e.g. 3.11")
    tag = platform or this_platform()
    parsed = parse_tag(tag)
    if parsed is None:
        raise BundleError(
            f"unknown platform {tag!r}; line PCs take manylinux wheels: give a tag such as "
            "manylinux_2_28_x86_64 or manylinux2014_x86_64"
        )
    return Target(python, parsed[0], parsed[1])


def canonical(name: str) -> str:
    """A project name as PEP 503 normalises it: ``Typing_Extensions`` is ``typing-extensions``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def distribution(wheel: str) -> str:
    """A wheel file's distribution name, normalised: ``typing-extensions``."""
    return canonical(wheel.split("-", 1)[0])


def dev_tools_in(wheels: Iterable[str]) -> list[str]:
    """The wheels that are dev tools (:data:`DEV_TOOLS`), by file name."""
    return sorted(w for w in wheels if distribution(w) in DEV_TOOLS)


def glibc_needed(wheels: Iterable[str]) -> tuple[int, int] | None:
    """The oldest glibc all ``wheels`` run on (None: none is tied to glibc). A wheel runs
    where any of its tags does, so it needs the oldest glibc among its own tags."""
    need: tuple[int, int] | None = None
    for wheel in wheels:
        platforms = wheel.removesuffix(".whl").split("-")[-1].split(".")
        versions = [p[0] for p in map(parse_tag, platforms) if p is not None]
        if versions:
            need = max(need or (0, 0), min(versions))
    return need


def missing_requirement(pip_output: str) -> str | None:
    """The requirement pip could find no wheel for, from its error output."""
    m = re.search(r"No matching distribution found for (\S+)", pip_output)
    return m[1] if m else None


def verified_models(models_dir: Path) -> dict[str, bytes]:
    """Every manifest in ``models_dir`` and the model files it names, by file name, once
    each model file's sha256 is its manifest's: the bytes checked are the bytes bundled."""
    manifests = sorted(models_dir.glob("*.json")) if models_dir.is_dir() else []
    if not manifests:
        raise ModelIntegrityError(
            f"no model manifests (*.json) in {models_dir}; pass --models-dir DIR, the folder "
            "that holds the manifests and their .onnx files"
        )
    files: dict[str, bytes] = {}
    for manifest_path in manifests:
        manifest = load_manifest(manifest_path)
        files[manifest_path.name] = manifest_path.read_bytes()
        for name, sha256 in manifest.files:
            files[name] = verified_file(models_dir, manifest_path, name, sha256)
    return files


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def manifest(
    root: Path,
    target: Target,
    *,
    version: str,
    commit: str | None,
    dirty: bool | None,
    created: str,
) -> dict[str, Any]:
    """``MANIFEST.json`` for the bundle folder ``root``: every file in it with its sha256
    and size, the target, and the oldest glibc its wheels need."""
    paths = sorted(p for p in root.rglob("*") if p.is_file() and p.name != "MANIFEST.json")
    files = [
        {"path": p.relative_to(root).as_posix(), "sha256": sha256_file(p), "size": p.stat().st_size}
        for p in paths
    ]
    need = glibc_needed(p.name for p in paths if p.parent.name == "wheels")
    return {
        "format": FORMAT,
        "project": "sluicegate",
        "version": version,
        "commit": commit,
        "commit_dirty": dirty,
        "created": created,
        "python": target.python,
        "abi": target.abi,
        "platform": target.platform,
        "arch": target.arch,
        "requires_glibc": f"{need[0]}.{need[1]}" if need else None,
        "files": files,
    }


def install_script(target: Target, version: str) -> str:
    """``install.sh`` for ``target``."""
    text = INSTALL_SCRIPT.read_text()
    return text.replace("@PYTHON_VERSION@", target.python).replace("@VERSION@", version)
