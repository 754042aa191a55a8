"""The code's shape that STYLE.md promises: one package owns paho, and the decision cores
import no I/O library (asyncio, paho, redis, aiohttp), so the twin and the tables test
the very code production runs. Read from the sources, imports inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sluicegate", "broker", "edge_agent", "center_pool", "policies")
IO_LIBRARIES = {"asyncio", "paho", "redis", "aiohttp"}
PURE = [
    "broker/decision.py",
    "broker/demand.py",
    "broker/explain.py",
    "broker/identity.py",
    "broker/fleet.py",
    "broker/forecast.py",
    "broker/index.py",
    "broker/mlfq.py",
    "broker/placement.py",
    "broker/scoring.py",
    "broker/service_model.py",
    "broker/state.py",
    "broker/view.py",
    "edge_agent/admission.py",
    "edge_agent/ledger.py",
    "edge_agent/load.py",
    "center_pool/batching.py",
    "policies/evaluate.py",
    "policies/subhealth.py",
    "policies/tokens.py",
    "sluicegate/mqtt/wire.py",
]


def imported_roots(path: Path) -> set[str]:
    """The top-level names of every module ``path`` imports."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_only_the_mqtt_package_imports_paho() -> None:
    importers = sorted(
        str(path.relative_to(ROOT))
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if "paho" in imported_roots(path)
    )
    assert importers, "no module imports paho: is the scan looking in the right place?"
    outside = [name for name in importers if not name.startswith("sluicegate/mqtt/")]
    assert outside == [], f"paho imported outside sluicegate/mqtt/: {outside}"


@pytest.mark.parametrize("module", PURE)
def test_a_decision_core_imports_no_io_library(module: str) -> None:
    found = imported_roots(ROOT / module) & IO_LIBRARIES
    assert found == set(), f"{module} imports {sorted(found)}"


def test_the_scan_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("def f():\n    import redis.asyncio\n    from paho.mqtt import client\n")
    assert imported_roots(source) == {"redis", "paho"}
