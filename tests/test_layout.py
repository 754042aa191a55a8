"""The code's shape that docs/architecture.md promises: one package owns paho, the decision cores
import no I/O library (asyncio, paho, redis, aiohttp), not even through the project's
modules they import, so the twin and the tables test the very code production runs, and
``policies/`` stands on its own. Read from the sources, imports inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sluicegate", "broker", "edge_agent", "center_pool", "policies")
IO_LIBRARIES = {"asyncio", "paho", "redis", "aiohttp"}
PURE = [
    "edge_agent/admission.py",
    "edge_agent/events.py",
    "edge_agent/job_figures.py",
    "edge_agent/jobs.py",
    "edge_agent/lifecycle.py",
    "edge_agent/load.py",
    "edge_agent/returns.py",
    "edge_agent/rules.py",
    "edge_agent/sequencer.py",
    "edge_agent/tally.py",
    "edge_agent/trace_log.py",
    "center_pool/batching.py",
    "center_pool/intake.py",
    "center_pool/job_figures.py",
    "policies/evaluate.py",
    "policies/subhealth.py",
    "policies/tokens.py",
    "sluicegate/app/missed.py",
    "sluicegate/buckets.py",
    "sluicegate/metering/plot.py",
    "sluicegate/metering/prices.py",
    "sluicegate/metering/record.py",
    "sluicegate/metering/render.py",
    "sluicegate/metering/report.py",
    "sluicegate/metering/verify.py",
    "sluicegate/metering/wire.py",
    "sluicegate/mqtt/wire.py",
    "sluicegate/vision/anomaly.py",
    "sluicegate/vision/author.py",
    "sluicegate/vision/detection.py",
    "sluicegate/vision/geometry.py",
    "sluicegate/vision/metrics.py",
    "sluicegate/vision/ocr.py",
    "sluicegate/twin/capture.py",
    "sluicegate/twin/carrier.py",
    "sluicegate/twin/draws.py",
    "sluicegate/twin/nodes.py",
    "sluicegate/twin/report.py",
    "sluicegate/twin/sim.py",
    "sluicegate/twin/strategies.py",
]


def _runs(tree: ast.AST) -> list[ast.AST]:
    """The nodes of ``tree`` that may run: not what sits under ``if TYPE_CHECKING:`` or in
    a module's lazy ``__getattr__`` (run only when someone asks for that attribute)."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            continue
        out.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return out


# Every module of the broker's core, by where it lives: a new one is pure or moves out.
PURE += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "broker" / "core").glob("*.py"))


def imported(path: Path) -> set[str]:
    """The dotted names of every module ``path`` imports (``from a.b import c``: both
    ``a.b`` and ``a.b.c``, as ``c`` may be a module)."""
    names = set()
    for node in _runs(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def imported_roots(path: Path) -> set[str]:
    """The top-level names of every module ``path`` imports."""
    return {name.split(".")[0] for name in imported(path)}


def source_of(name: str) -> Path | None:
    """The file of project module ``name``, or None (a library, or a name in a module)."""
    base = ROOT / Path(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if name.split(".")[0] in PACKAGES and candidate.is_file():
            return candidate
    return None


def reached(path: Path) -> dict[Path, Path]:
    """Every project module ``path`` imports, directly or through others, each with the
    module that imported it."""
    seen: dict[Path, Path] = {}
    todo = [path]
    while todo:
        here = todo.pop()
        for name in imported(here):
            parts = name.split(".")
            for i in range(1, len(parts) + 1):  # a package's __init__ runs on the way
                found = source_of(".".join(parts[:i]))
                if found is not None and found not in seen and found != path:
                    seen[found] = here
                    todo.append(found)
    return seen


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
    start = ROOT / module
    found = imported_roots(start) & IO_LIBRARIES
    assert found == set(), f"{module} imports {sorted(found)}"
    for other, via in reached(start).items():
        found = imported_roots(other) & IO_LIBRARIES
        name, through = other.relative_to(ROOT), via.relative_to(ROOT)
        assert found == set(), f"{module} reaches {name} (via {through}), which imports {found}"


def test_policies_import_nothing_of_the_rest() -> None:
    """``policies/`` is the library a compliance officer's tools use on their own."""
    leaks = sorted(
        f"{path.relative_to(ROOT)} imports {root}"
        for path in (ROOT / "policies").rglob("*.py")
        for root in imported_roots(path) & (set(PACKAGES) - {"policies"})
    )
    assert leaks == []


def test_the_scan_follows_imports_through_the_project() -> None:
    assert ROOT / "edge_agent" / "rules.py" in reached(ROOT / "edge_agent" / "lifecycle.py")
    assert ROOT / "sluicegate" / "wire.py" in reached(ROOT / "edge_agent" / "rules.py")
    shell = reached(ROOT / "edge_agent" / "dispatch.py")
    assert ROOT / "edge_agent" / "answers.py" in shell


def test_the_scan_skips_what_only_a_type_checker_runs(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import asyncio\n"
        "def __getattr__(name):\n    import redis\n"
    )
    assert imported_roots(source) == {"typing"}


def test_the_scan_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("def f():\n    import redis.asyncio\n    from paho.mqtt import client\n")
    assert imported_roots(source) == {"redis", "paho"}


# Two floors in sluicegate/. The kernel every role imports (topics, wire, mqtt, config,
# metering, vision, enroll, ...) stands below the roles and never imports one; the floor
# above the roles puts them together (the command, the demo, the twin, doctor, the
# installer and its bundle) and nothing below it imports it. A new sluicegate package is
# kernel unless listed here: the first import of a role from it fails the test below.
ROLES = ("broker", "edge_agent", "center_pool")
UPPER_FLOOR = (
    "sluicegate.app",
    "sluicegate.bundle",
    "sluicegate.deploy",
    "sluicegate.doctor",
    "sluicegate.twin",
)


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _modules(package: str) -> dict[str, Path]:
    return {
        ".".join(path.relative_to(ROOT).with_suffix("").parts): path
        for path in (ROOT / package).rglob("*.py")
    }


def _leaks(modules: dict[str, Path], into: tuple[str, ...]) -> list[str]:
    """Each import by one of ``modules`` of a module within ``into``."""
    return sorted(
        f"{name} imports {other}"
        for name, path in modules.items()
        for other in imported(path)
        if _within(other, into)
    )


def test_nothing_below_the_upper_floor_imports_it() -> None:
    below = {
        name: path
        for package in PACKAGES
        for name, path in _modules(package).items()
        if not _within(name, UPPER_FLOOR)
    }
    assert len(below) > 150
    assert _leaks(below, UPPER_FLOOR) == []


def test_the_kernel_imports_no_role() -> None:
    kernel = {n: p for n, p in _modules("sluicegate").items() if not _within(n, UPPER_FLOOR)}
    assert "sluicegate.topics" in kernel
    assert "sluicegate.mqtt.bridge" in kernel
    assert _leaks(kernel, ROLES) == []


def test_the_upper_floor_is_real_and_its_root_imported_by_none() -> None:
    """The list names real packages; ``sluicegate.app``, the composition root, is imported
    by no other module at all, the rest of the upper floor included."""
    for package in UPPER_FLOOR:
        assert (ROOT / Path(*package.split(".")) / "__init__.py").is_file(), package
    root = ("sluicegate.app",)
    rest = {
        name: path
        for package in PACKAGES
        for name, path in _modules(package).items()
        if not _within(name, root)
    }
    assert _leaks(rest, root) == []


def _module_graph() -> dict[str, set[str]]:
    """Each project module's name and the project modules it imports (at any depth of its
    code, a function's body included), less its own ancestor packages: a submodule's
    ``from pkg import sibling`` runs pkg's ``__init__``, which is loading already."""
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path

    def module_of(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in _runs(ast.parse(path.read_text(), filename=str(path))):
            wanted: list[str] = []
            if isinstance(node, ast.Import):
                wanted = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{alias.name}" for alias in node.names]
                wanted = [s for s in subs if s in modules]
                if len(wanted) < len(subs):  # a name defined in node.module itself
                    wanted.append(node.module)
            for target in filter(None, map(module_of, wanted)):
                if target != name and not name.startswith(target + "."):
                    found.add(target)
        graph[name] = found
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in order:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], order[nxt])
        if low[node] == order[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return groups


def test_no_two_modules_import_each_other_even_inside_a_function() -> None:
    graph = _module_graph()
    assert len(graph) > 200  # the scan saw the project
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_loop_through_three_modules() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
