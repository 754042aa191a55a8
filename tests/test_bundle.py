"""The offline install bundle: the pure choices (target tags, glibc, dev tools, manifest),
the model check, ``install.sh``'s own checks on a small hand-made bundle, and, slow, the
real thing: build it with pip, install it offline into a fresh virtualenv, and have the
installed ``sluicegate`` serve a job from a real Mosquitto."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluicegate import topics
from sluicegate.app.servers import ServerProcess
from sluicegate.bundle.contents import (
    DEV_TOOLS,
    canonical,
    dev_tools_in,
    distribution,
    glibc_needed,
    install_script,
    manifest,
    missing_requirement,
    target,
    verified_models,
)
from sluicegate.errors import BundleError, ModelIntegrityError
from sluicegate.vision.runtime import default_models_dir
from tests.support import PlainClient, sluicegate_cmd

ROOT = Path(__file__).resolve().parents[1]
PY = f"{sys.version_info.major}.{sys.version_info.minor}"
CP311 = "cp311-cp311"


@pytest.mark.parametrize(
    ("platform", "has", "lacks"),
    [
        (
            "manylinux_2_28_x86_64",
            ["manylinux_2_28_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"],
            ["manylinux_2_29_x86_64", "manylinux_2_28_aarch64"],
        ),
        (
            "manylinux2014_aarch64",
            ["manylinux_2_17_aarch64", "manylinux2014_aarch64", "manylinux_2_5_aarch64"],
            ["manylinux_2_18_aarch64"],
        ),
    ],
)
def test_a_target_accepts_every_older_manylinux(
    platform: str, has: list[str], lacks: list[str]
) -> None:
    tags = target("3.11", platform).platform_tags()
    assert set(has) <= set(tags)
    assert not set(lacks) & set(tags)
    assert tags[0] == target("3.11", platform).platform


@pytest.mark.parametrize(
    ("python", "platform", "message"),
    [
        ("311", "manylinux_2_28_x86_64", "unknown Python version '311'; give major.minor"),
        ("3.11", "win_amd64", "unknown platform 'win_amd64'; .* manylinux_2_28_x86_64"),
        ("3.11", "linux_x86_64", "unknown platform 'linux_x86_64'"),
    ],
)
def test_a_bad_target_is_refused(python: str, platform: str, message: str) -> None:
    with pytest.raises(BundleError, match=message):
        target(python, platform)


def test_the_default_target_is_this_interpreter_on_this_machine() -> None:
    here = target()
    assert here.python == PY
    assert here.abi == f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert here.glibc >= (2, 17)


@pytest.mark.parametrize(
    ("wheels", "need"),
    [
        (["rich-15.0.0-py3-none-any.whl"], None),
        ([f"numpy-2.4.6-{CP311}-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"], (2, 27)),
        (
            [
                f"cffi-2.1.1-{CP311}-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
                "cryptography-50.0.2-cp311-abi3-manylinux_2_34_x86_64.whl",
                "psutil-7.2.2-cp36-abi3-manylinux2010_x86_64.manylinux_2_12_x86_64.whl",
            ],
            (2, 34),
        ),
    ],
)
def test_glibc_needed_is_the_newest_wheels_oldest_tag(
    wheels: list[str], need: tuple[int, int] | None
) -> None:
    assert glibc_needed(wheels) == need


def test_dev_tools_are_named_by_distribution() -> None:
    wheels = [
        "pytest_asyncio-1.5.0-py3-none-any.whl",
        "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
        "onnxruntime-1.32.0-cp311-cp311-manylinux_2_28_x86_64.whl",
        "typing_extensions-4.16.0-py3-none-any.whl",
    ]
    assert dev_tools_in(wheels) == wheels[:2]
    assert distribution(wheels[3]) == canonical("Typing.Extensions") == "typing-extensions"


def test_pips_no_matching_distribution_names_the_requirement() -> None:
    output = (
        "ERROR: Could not find a version that satisfies the requirement onnxruntime>=1.19 "
        "(from sluicegate) (from versions: 1.15.0, 1.16.3)\n"
        "ERROR: No matching distribution found for onnxruntime>=1.19 (from sluicegate)\n"
    )
    assert missing_requirement(output) == "onnxruntime>=1.19"
    assert missing_requirement("ERROR: something else\n") is None


def _models_copy(tmp_path: Path) -> Path:
    folder = tmp_path / "models"
    folder.mkdir()
    for name in ("defect-v1.json", "defect-v1.onnx"):
        shutil.copy(default_models_dir() / name, folder / name)
    return folder


def test_models_are_bundled_as_their_manifests_hash_them(tmp_path: Path) -> None:
    folder = _models_copy(tmp_path)
    files = verified_models(folder)
    assert sorted(files) == ["defect-v1.json", "defect-v1.onnx"]
    assert files["defect-v1.onnx"] == (folder / "defect-v1.onnx").read_bytes()


def test_a_tampered_model_is_refused(tmp_path: Path) -> None:
    folder = _models_copy(tmp_path)
    model = folder / "defect-v1.onnx"
    blob = bytearray(model.read_bytes())
    blob[-1] ^= 1
    model.write_bytes(bytes(blob))
    actual = hashlib.sha256(blob).hexdigest()
    with pytest.raises(ModelIntegrityError, match=f"defect-v1.onnx does not match .*{actual}"):
        verified_models(folder)
    with pytest.raises(ModelIntegrityError, match="no model manifests"):
        verified_models(tmp_path / "elsewhere")


def _small_bundle(root: Path, python: str = PY) -> Path:
    """A bundle folder by the real manifest and script, with stand-in wheels."""
    (root / "wheels").mkdir(parents=True)
    (root / "wheels" / "paho_mqtt-2.2.0-py3-none-any.whl").write_bytes(b"not really a wheel")
    (root / "wheels" / "rare-1.0-cp311-abi3-manylinux_2_17_x86_64.whl").write_bytes(b"nor this")
    aim = target(python, "manylinux_2_28_x86_64")
    (root / "install.sh").write_text(install_script(aim, "0.1"))
    doc = manifest(root, aim, version="0.1", commit="abc", dirty=False, created="now")
    (root / "MANIFEST.json").write_text(json.dumps(doc))
    return root


def test_the_manifest_lists_every_file_with_its_sha256_and_size(tmp_path: Path) -> None:
    root = _small_bundle(tmp_path / "b")
    doc = json.loads((root / "MANIFEST.json").read_text())
    assert [f["path"] for f in doc["files"]] == [
        "install.sh",
        "wheels/paho_mqtt-2.2.0-py3-none-any.whl",
        "wheels/rare-1.0-cp311-abi3-manylinux_2_17_x86_64.whl",
    ]
    paho = doc["files"][1]
    assert paho["sha256"] == hashlib.sha256(b"not really a wheel").hexdigest()
    assert paho["size"] == len(b"not really a wheel")
    assert doc["platform"] == "manylinux_2_28_x86_64"
    assert doc["requires_glibc"] == "2.17"
    assert (doc["python"], doc["version"], doc["commit"]) == (PY, "0.1", "abc")


def _install(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(root / "install.sh"), "--python", sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_install_sh_verifies_the_bundle_before_anything(tmp_path: Path) -> None:
    root = _small_bundle(tmp_path / "b")
    ok = _install(root, "--verify-only")
    assert ok.returncode == 0, ok.stderr
    assert "verified 3 files against MANIFEST.json" in ok.stdout
    (root / "wheels" / "paho_mqtt-2.2.0-py3-none-any.whl").write_bytes(b"swapped")
    (root / "wheels" / "extra-1.0-py3-none-any.whl").write_bytes(b"slipped in")
    bad = _install(root, "--prefix", str(tmp_path / "opt"))
    assert bad.returncode == 1
    assert "wheels/paho_mqtt-2.2.0-py3-none-any.whl: sha256 " in bad.stderr
    assert "wheels/extra-1.0-py3-none-any.whl: not in MANIFEST.json" in bad.stderr
    assert "nothing was installed" in bad.stderr
    assert not (tmp_path / "opt").exists()


def test_install_sh_refuses_another_python(tmp_path: Path) -> None:
    done = _install(_small_bundle(tmp_path / "b", python="3.99"), "--verify-only")
    assert done.returncode == 1
    assert f"this bundle is for Python 3.99; {sys.executable} is Python {PY}" in done.stderr


def test_the_command_refuses_a_tampered_model_and_a_bad_target(tmp_path: Path) -> None:
    folder = _models_copy(tmp_path)
    with (folder / "defect-v1.onnx").open("ab") as f:
        f.write(b"\0")
    out = tmp_path / "b.tar.gz"
    for args, message in [
        (["--models-dir", str(folder)], "defect-v1.onnx does not match its manifest"),
        (["--platform", "win_amd64"], "unknown platform 'win_amd64'"),
    ]:
        done = subprocess.run(
            sluicegate_cmd("bundle", "--out", str(out), *args),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 2
        assert message in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    assert list(tmp_path.glob("*b.tar.gz*")) == []


# --- the real bundle: pip, an offline install, a job served --------------------------


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """One bundle for this machine, built once for the module (it downloads ~120 MB)."""
    out = tmp_path_factory.mktemp("bundle") / "sluicegate-bundle.tar.gz"
    started = time.monotonic()
    done = subprocess.run(
        sluicegate_cmd("bundle", "--out", str(out)),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    print(f"bundle built in {time.monotonic() - started:.1f} s: {done.stdout}")
    yield out, done.stdout
    out.unlink()


def _clean_env() -> dict[str, str]:
    """The environment of a line PC: no project settings, no Python or pip paths of this
    checkout, and an index that would fail if anything asked it."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLUICEGATE_", "PYTHON", "PIP_", "VIRTUAL_ENV"))
    }
    return env | {"PIP_INDEX_URL": "http://127.0.0.1:9/simple"}


def _start_edge(
    venv: Path, port: int, edge_id: str, zone: str, env: dict[str, str], cwd: Path
) -> subprocess.Popen[bytes]:
    """The installed ``sluicegate edge run``; returns once its status says online."""
    watcher = PlainClient(port)
    try:
        watcher.subscribe(topics.edge_status(edge_id))
        cmd = [str(venv / "bin" / "sluicegate"), "edge", "run", "--port", str(port)]
        proc = subprocess.Popen([*cmd, "--id", edge_id, "--zone", zone], env=env, cwd=cwd)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                got = watcher.next(timeout=1.0)
            except queue.Empty:
                assert proc.poll() is None, f"edge exited with {proc.returncode}"
                continue
            if b'"online"' in got.payload:
                return proc
        proc.kill()
        raise AssertionError("the installed edge agent was not online within 60 s")
    finally:
        watcher.close()


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_bundle_installs_offline_and_serves_a_job(
    bundle: tuple[Path, str], mosquitto: ServerProcess, tmp_path: Path
) -> None:
    archive, report = bundle
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path, filter="data")
    root = tmp_path / "sluicegate-bundle"
    doc = json.loads((root / "MANIFEST.json").read_text())
    assert (doc["python"], doc["version"]) == (PY, "0.1.0")
    assert {"models/defect-v1.json", "models/defect-v1.onnx"} <= {f["path"] for f in doc["files"]}
    templates = sorted((ROOT / "sluicegate" / "deploy" / "templates").glob("*.toml"))
    for role in ("edge", "pool", "broker"):
        if (ROOT / "sluicegate" / "deploy" / "templates" / f"{role}.toml").exists():
            assert (root / "config" / f"{role}.toml").is_file()
        else:
            assert f"no example config sluicegate/deploy/templates/{role}.toml" in report

    env = _clean_env()
    prefix = tmp_path / "opt"
    started = time.monotonic()
    installed = subprocess.run(
        ["bash", str(root / "install.sh"), "--prefix", str(prefix), "--python", sys.executable],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    print(f"installed in {time.monotonic() - started:.1f} s")
    assert f"{prefix}/venv/bin/sluicegate edge run" in installed.stdout
    venv = prefix / "venv"
    listed = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    names = {canonical(p["name"]) for p in json.loads(listed.stdout)}
    assert "sluicegate" in names
    assert {"onnxruntime", "opencv-python-headless", "paho-mqtt"} <= names
    assert names & DEV_TOOLS == set()
    assert sorted(p.name for p in (prefix / "config").glob("*.toml")) == [p.name for p in templates]

    edge_id, zone = f"bundle-{uuid.uuid4().hex[:6]}", "campus/bundle/line-1"
    # The test Mosquitto has no TLS, and there is no broker to offload to (nor a policy,
    # which offloading needs): a line PC that only runs its jobs itself.
    env |= {"SLUICEGATE_MQTT__PLAINTEXT": "true", "SLUICEGATE_OFFLOAD__ENABLED": "false"}

    def sluicegate(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [str(venv / "bin" / "sluicegate"), *args]
        return subprocess.run(
            cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
        )

    agent = _start_edge(venv, mosquitto.port, edge_id, zone, env, tmp_path)
    try:
        assert sluicegate("synth", "scratch.jpg", "--label", "scratch").returncode == 0
        port = str(mosquitto.port)
        result = sluicegate(
            "submit", "scratch.jpg", "--model", "defect-v1", "--edge", edge_id, "--port", port
        )
        assert result.returncode == 0, result.stdout + result.stderr
        answer = json.loads(result.stdout)
        assert answer["status"] == "ok"
        assert answer["outputs"]["label"] == "scratch"
        assert answer["ran_on"] == {"kind": "edge", "node": edge_id, "zone": zone}
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(20) == 0
    finally:
        agent.kill()
        agent.wait()


@pytest.mark.integration
@pytest.mark.slow
def test_a_platform_without_wheels_names_the_missing_package(tmp_path: Path) -> None:
    out = tmp_path / "riscv.tar.gz"
    done = subprocess.run(
        sluicegate_cmd("bundle", "--out", str(out), "--platform", "manylinux_2_17_riscv64"),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    missing = re.match(r"error: no wheel of ([A-Za-z0-9_.-]+)", line)
    assert missing is not None, line
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert missing[1] in {re.split(r"[<>=!~ ]", d)[0] for d in declared}
    assert f"for Python {PY} on manylinux_2_17_riscv64" in line
    assert not out.exists()
