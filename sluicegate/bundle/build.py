"""Building the offline install bundle: pip builds the project's wheel from the source tree
and downloads a wheel of every runtime dependency for the target, then the models, example
configs, ``install.sh`` and ``MANIFEST.json`` join them in one ``.tar.gz``.

This is the only part of the bundle that runs pip, git or touches the archive; what goes in
and the checks on it are :mod:`sluicegate.bundle.contents`'. pip runs under this
interpreter with the machine's own pip configuration (its index, its cache), so a second
build reuses what the first downloaded. The archive is written beside ``out`` and renamed
into place, so a failed build never leaves a partial bundle behind.
"""

from __future__ import annotations

import datetime
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sluicegate.bundle.contents import (
    Target,
    dev_tools_in,
    install_script,
    manifest,
    missing_requirement,
    sha256_file,
    verified_models,
)
from sluicegate.errors import BundleError

SOURCE = Path(__file__).resolve().parents[2]  # the checkout the project's wheel is built from
TEMPLATES = ("edge", "pool", "broker")  # sluicegate/deploy/templates/<role>.toml


@dataclass(frozen=True)
class BundleReport:
    path: Path
    size: int
    sha256: str
    target: Target
    wheels: int
    requires_glibc: str | None
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"wrote {self.path} ({self.size / 2**20:.1f} MiB, {self.wheels} wheels, "
            f"Python {self.target.python}, {self.target.platform}, needs glibc "
            f"{self.requires_glibc or '(any)'})\nsha256 {self.sha256}  {self.path.name}"
        )


def build_bundle(
    out: Path,
    target: Target,
    *,
    models_dir: Path,
    source: Path = SOURCE,
    say: Callable[[str], None] = lambda _line: None,
) -> BundleReport:
    """Build the bundle for ``target`` into ``out`` (a ``.tar.gz``)."""
    if not out.name.endswith(".tar.gz"):
        raise BundleError(f"--out {out} must name a .tar.gz file")
    if not (source / "pyproject.toml").is_file():
        raise BundleError(f"{source} is not a Sluicegate source tree (no pyproject.toml)")
    models = verified_models(models_dir)  # before anything slow: a bad model fails at once
    top = out.name.removesuffix(".tar.gz")
    with tempfile.TemporaryDirectory(prefix="sluicegate-bundle-") as tmp:
        root = Path(tmp) / top
        wheels = root / "wheels"
        wheels.mkdir(parents=True)
        say(f"building the sluicegate wheel from {source}")
        own = _own_wheel(source, Path(tmp) / "own")
        say(f"downloading runtime dependencies for Python {target.python}, {target.platform}")
        _download(own, wheels, target)
        names = sorted(p.name for p in wheels.glob("*.whl"))
        if found := dev_tools_in(names):
            raise BundleError(f"dev tools among the runtime wheels: {', '.join(found)}")
        for name, blob in models.items():
            (root / "models").mkdir(exist_ok=True)
            (root / "models" / name).write_bytes(blob)
        notes = _templates(source, root / "config")
        version = own.name.split("-")[1]
        script = root / "install.sh"
        script.write_text(install_script(target, version))
        script.chmod(0o755)
        commit, dirty = _git(source)
        created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        doc = manifest(root, target, version=version, commit=commit, dirty=dirty, created=created)
        (root / "MANIFEST.json").write_text(json.dumps(doc, indent=2) + "\n")
        _archive(root, out)
    return BundleReport(
        out, out.stat().st_size, sha256_file(out), target, len(names), doc["requires_glibc"], notes
    )


def _pip(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pip", *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise BundleError(f"cannot run pip ({' '.join(cmd[:3])}): {exc.strerror}") from exc


def _last_error(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    return (errors or lines or ["(no output)"])[-1].removeprefix("ERROR: ")


def _own_wheel(source: Path, into: Path) -> Path:
    done = _pip("wheel", "--no-deps", "--quiet", "--wheel-dir", str(into), str(source))
    built = sorted(into.glob("sluicegate-*.whl"))
    if done.returncode != 0 or len(built) != 1:
        raise BundleError(f"pip could not build the sluicegate wheel: {_last_error(done.stderr)}")
    return built[0]


def _download(own: Path, wheels: Path, target: Target) -> None:
    """The project's wheel, pip (install.sh runs the bundled one) and every runtime
    dependency, as binary wheels for ``target`` only."""
    args = ["download", "--quiet", "--only-binary=:all:", "--dest", str(wheels)]
    args += ["--python-version", target.python, "--implementation", "cp", "--abi", target.abi]
    for tag in target.platform_tags():
        args += ["--platform", tag]
    done = _pip(*args, str(own), "pip")
    if done.returncode == 0:
        return
    missing = missing_requirement(done.stderr)
    if missing is not None:
        raise BundleError(
            f"no wheel of {missing} for Python {target.python} on {target.platform} "
            "(or an older manylinux); pick another --platform or --python"
        )
    raise BundleError(f"pip could not download the runtime wheels: {_last_error(done.stderr)}")


def _templates(source: Path, into: Path) -> list[str]:
    """Copy the example configs that exist; a note for each one that does not."""
    notes = []
    for role in TEMPLATES:
        path = source / "sluicegate" / "deploy" / "templates" / f"{role}.toml"
        if path.is_file():
            into.mkdir(exist_ok=True)
            shutil.copyfile(path, into / path.name)
        else:
            notes.append(f"note: no example config {path.relative_to(source)}; not bundled")
    return notes


def _git(source: Path) -> tuple[str | None, bool | None]:
    """The checkout's commit and whether it has uncommitted changes (None: not a git tree)."""
    try:
        head = subprocess.run(
            ["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True
        )
        status = subprocess.run(
            ["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        )
    except OSError:
        return None, None
    if head.returncode != 0:
        return None, None
    return head.stdout.strip(), bool(status.stdout.strip()) if status.returncode == 0 else None


def _archive(root: Path, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    try:
        # Level 1: the wheels are zip-compressed already, harder gzip gains ~nothing.
        with tarfile.open(partial, "w:gz", compresslevel=1) as tar:
            tar.add(root, arcname=root.name, filter=_as_root)
        partial.replace(out)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise BundleError(f"cannot write {out}: {exc.strerror}") from exc


def _as_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info
