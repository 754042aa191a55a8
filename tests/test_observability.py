"""observability/: the alert rules pass ``promtool check rules`` and their unit tests
(``promtool test rules``), and every metric name the rules, the Grafana dashboard and
docs/observability.md use is one that a real local campus exposes with jobs flowing: the
broker's, the edges' and the workers' ``/metrics`` scraped after a burst.

A name is an identifier matching ``sluicegate_[a-z0-9_]+``; a histogram's ``_bucket``,
``_sum`` and ``_count`` series count as its name, and ``up`` is Prometheus's own.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sluicegate.app.localcampus import LocalCampus
from sluicegate.app.traffic import Tally, stream
from tests.metrics_kit import exposition
from tests.support import local_campus

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS = ROOT / "observability" / "prometheus"
DASHBOARD = ROOT / "observability" / "grafana" / "sluicegate.json"
DOC = ROOT / "docs" / "observability.md"
NAME = re.compile(r"\bsluicegate_[a-z0-9_]+")
HISTOGRAM_SERIES = re.compile(r"_(bucket|sum|count)$")
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is not installed (Debian/Ubuntu: apt-get install prometheus; "
    "scripts/bootstrap installs it)",
)


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=60
    )


@needs_promtool
def test_the_alert_rules_are_valid() -> None:
    done = promtool("check", "rules", "alerts.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 7 rules found" in done.stdout


@needs_promtool
def test_each_alert_fires_and_stays_quiet_as_its_unit_tests_say() -> None:
    done = promtool("test", "rules", "alerts_test.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    tests = (PROMETHEUS / "alerts_test.yml").read_text()
    rules = (PROMETHEUS / "alerts.yml").read_text()
    # Every alert has a test that expects it to fire and one that expects it quiet.
    for alert in re.findall(r"^\s+- alert: (\w+)$", rules, re.MULTILINE):
        quiet = rf"alertname: {alert}\n\s+exp_alerts: \[\]"
        firing = rf"alertname: {alert}\n\s+exp_alerts:\n\s+- exp_labels:"
        assert re.search(quiet, tests), f"no test shows {alert} quiet"
        assert re.search(firing, tests), f"no test shows {alert} firing"


def used_names() -> dict[str, set[str]]:
    """Metric names used by each artefact: the rules file, the dashboard's queries (and its
    variables), and the docs."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queries += [v.get("query", "") for v in dashboard["templating"]["list"]]
    return {
        "alerts.yml": _names(" ".join(_exprs((PROMETHEUS / "alerts.yml").read_text()))),
        "sluicegate.json": _names(" ".join(queries)),
        "observability.md": _names(DOC.read_text()),
    }


def _exprs(rules: str) -> list[str]:
    """The ``expr:`` of each rule, one line or a block (no YAML library needed)."""
    out = []
    for m in re.finditer(r"^(\s+)expr: (\|?)(.*)$", rules, re.MULTILINE):
        if m[2] != "|":
            out.append(m[3])
            continue
        block = []
        for line in rules[m.end() + 1 :].splitlines():
            if line.strip() and len(line) - len(line.lstrip()) <= len(m[1]):
                break
            block.append(line)
        out.append("\n".join(block))
    return out


def _names(text: str) -> set[str]:
    return {HISTOGRAM_SERIES.sub("", n) for n in NAME.findall(text)}


def test_the_artefacts_name_metrics_at_all() -> None:
    used = used_names()
    assert len(used["alerts.yml"]) == 6
    assert len(used["sluicegate.json"]) >= 25
    assert "sluicegate_edge_job_seconds" in used["sluicegate.json"]  # histograms stripped


def exposed_names(text: str) -> set[str]:
    """Names in an exposition: its ``# TYPE`` families and its samples' names."""
    names = set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))
    names |= set(re.findall(r"^([a-z_:][a-z0-9_:]*)[{ ]", text, re.MULTILINE))
    return {HISTOGRAM_SERIES.sub("", n) for n in names if n.startswith("sluicegate_")}


@pytest.fixture(scope="module")
def campus(
    tmp_path_factory: pytest.TempPathFactory, fresh_redis_db: Callable[[], str]
) -> Iterator[LocalCampus]:
    with local_campus(tmp_path_factory.mktemp("observed-campus"), fresh_redis_db()) as lc:
        yield lc


@pytest.mark.integration
@pytest.mark.slow
def test_every_name_used_is_exposed_by_a_campus_with_jobs_flowing(campus: LocalCampus) -> None:
    tally = Tally()
    asyncio.run(
        stream(campus.write(), 10.0, 6.0, asyncio.Event(), tally, burst_at=1.0, burst_for=4.0)
    )
    assert tally.kinds["edge"] > 0
    assert tally.kinds["pool"] > 0  # the burst was offloaded: pool metrics have samples
    urls = {"broker-1": f"http://127.0.0.1:{campus.http_port}/metrics", **campus.metrics_urls()}
    exposed: set[str] = set()
    for node, url in urls.items():
        names = exposed_names(exposition(url))
        assert names, f"{node} exposes no sluicegate_ metric at {url}"
        exposed |= names
    missing = {what: sorted(names - exposed) for what, names in used_names().items()}
    assert missing == {what: [] for what in missing}, f"used but not exposed: {missing}"
