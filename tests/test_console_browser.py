"""Browser tier: the console in headless Chromium (Debian's, driven by Playwright) against a
real local campus (broker, two line PCs, two pool workers as processes on real Mosquitto
and Redis, secured: TLS, certificates, the generated ACL).

A viewer logs in and sees the campus; counts change as jobs run; a burst shows offloaded
jobs on the pool the policy allows; a job lookup from a chart point shows its explanation;
an operator drains a worker from the page and the campus proves it gets no placement
(its own /metrics count stays); a viewer cannot act and an anonymous caller is refused; the
broker's shadow candidate shows its agreement with production, as ``/shadow`` counts it.
Screenshots go to ``$SLUICEGATE_SCREENSHOTS`` when set (``docs/img`` holds the ones in the
docs), else to the test's own folder.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sluicegate.app.campus import BROKER
from sluicegate.app.localcampus import LocalCampus
from sluicegate.app.traffic import Tally, stream
from tests.support import local_campus
from tests.test_node_metrics_integration import scrape, total

playwright = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium (scripts/bootstrap installs it)"),
]
TIMEOUT_MS = 30_000
# The broker's shadow candidate (it never acts): off-site links free, the campus one slow.
CLOUD_FIRST = "link_latency_ms = [0.2, 500.0, 0.0]\nlink_mb_per_s = [1000.0, 1.0, 1000000.0]\n"


@pytest.fixture(scope="module")
def campus(
    tmp_path_factory: pytest.TempPathFactory, fresh_redis_db: Callable[[], str]
) -> Iterator[LocalCampus]:
    root = tmp_path_factory.mktemp("console-campus")
    candidate = root / "shadow-placement.toml"
    candidate.write_text(CLOUD_FIRST)
    shadow = {BROKER: {"SLUICEGATE_BROKER__SHADOW_PLACEMENT_FILE": str(candidate)}}
    with local_campus(root, fresh_redis_db(), node_env=shadow) as lc:
        yield lc


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = os.environ.get("SLUICEGATE_SCREENSHOTS")
    folder = Path(where) if where else tmp_path_factory.mktemp("screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _base(campus: LocalCampus) -> str:
    return f"http://127.0.0.1:{campus.http_port}"


def _login(browser: object, campus: LocalCampus, role: str) -> object:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})  # type: ignore[attr-defined]
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(f"{_base(campus)}/console")
    assert page.url.endswith("/console/login")  # nothing is shown before a login
    page.fill("[data-testid=login-password]", campus.write().console_token(role))
    page.click("[data-testid=login-submit]")
    page.wait_for_url(re.compile(r".*/console$"))
    page.wait_for_selector("[data-testid=live]:has-text('live')")
    return page


def _number(page: object, testid: str) -> int:
    text = page.text_content(f"[data-testid={testid}]")  # type: ignore[attr-defined]
    return int(text or "0")


def _traffic(
    campus: LocalCampus, seconds: float, burst_for: float
) -> tuple[Tally, threading.Thread]:
    tally = Tally()

    def run() -> None:
        asyncio.run(
            stream(
                campus.write(),
                5.0,
                seconds,
                asyncio.Event(),
                tally,
                burst_at=1.0,
                burst_for=burst_for,
                label_every=0,
            )
        )

    thread = threading.Thread(target=run, name="traffic", daemon=True)
    thread.start()
    return tally, thread


def test_anonymous_callers_are_refused_and_a_viewer_cannot_act(
    campus: LocalCampus, browser: object, shots: Path
) -> None:
    anonymous = browser.new_context()  # type: ignore[attr-defined]
    assert anonymous.request.get(f"{_base(campus)}/console/api/snapshot").status == 401
    assert anonymous.request.get(f"{_base(campus)}/fleet").status == 401
    page = anonymous.new_page()
    page.goto(f"{_base(campus)}/console")
    assert page.url.endswith("/console/login")
    page.screenshot(path=str(shots / "console-login.png"))
    anonymous.close()

    page = _login(browser, campus, "viewer")
    page.wait_for_selector("[data-testid=worker-north-cpu-1]")
    assert page.text_content("[data-testid=who]") == "viewer (viewer)"
    assert page.locator("button.act").count() == 0  # no action offered to a viewer
    status = page.evaluate(
        """async () => (await fetch('/console/api/actions', {method: 'POST',
            headers: {'Content-Type': 'application/json'},
            body: JSON.stringify({action: 'drain', target: 'north-cpu-1'})})).status"""
    )
    assert status == 403
    assert "policy" in (page.text_content("[data-testid=policy]") or "").lower()
    page.context.close()


def test_the_dashboard_follows_a_burst_explains_a_job_and_drains_a_worker(
    campus: LocalCampus, browser: object, shots: Path
) -> None:
    page = _login(browser, campus, "operator")
    page.wait_for_selector("[data-testid=worker-north-cpu-1]")
    page.wait_for_selector("[data-testid=edge-line-1-pc]")
    before = (
        _number(page, "line-jobs-line-1-pc")
        if page.locator("[data-testid=line-jobs-line-1-pc]").count()
        else 0
    )

    tally, thread = _traffic(campus, seconds=9.0, burst_for=6.0)
    # Counts change while the jobs run, pushed to the page without a reload.
    page.wait_for_function(
        f"() => Number(document.querySelector('[data-testid=line-jobs-line-1-pc]')"
        f"?.textContent || 0) > {before}"
    )
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert tally.answered == sum(tally.submitted.values())
    assert tally.kinds["pool"] > 0
    # The burst's offloaded jobs show on line 1, on workers of the pools the policy allows.
    page.wait_for_function(
        "() => Number(document.querySelector('[data-testid=line-offloaded-line-1-pc]')"
        "?.textContent || 0) > 0"
    )
    offloaded_to = page.text_content("[data-testid=line-to-line-1-pc]") or ""
    assert re.search(r"(north|cloud)-cpu-1 \d+", offloaded_to), offloaded_to
    if "north-cpu-1" in offloaded_to:
        by_worker = page.text_content("[data-testid=pool-by-worker-campus-fab-north-dc]") or ""
        assert "north-cpu-1" in by_worker
        # The worker failed none of what it ran or refused: the failed column says 0.
        failed = "[data-testid^=pool-failed-campus-fab-north-dc-]"
        cells = page.locator(failed)
        assert [cells.nth(i).text_content() for i in range(cells.count())] == ["0"] * max(
            1, cells.count()
        )
    assert page.locator("td.forbidden").count() == 0  # no wafer image left the campus
    wafer_cells = page.locator("[data-testid^=cell-wafer-image-]")
    zones = [wafer_cells.nth(i).get_attribute("data-testid") for i in range(wafer_cells.count())]
    assert zones
    assert all("offsite" not in (z or "") for z in zones)
    page.screenshot(path=str(shots / "console-campus.png"), full_page=True)

    # A chart point is a job: its link opens the job's explanation. (The page redraws every
    # second and dots overlap, so the link is followed by a click dispatched on it.)
    job_id, href = page.evaluate(
        """() => { const a = document.querySelector(
            "[data-testid='line-line-1-pc'] svg a circle[fill='#3a7bd5']").parentElement;
          return [a.dataset.job, a.getAttribute('href')]; }"""
    )
    assert href == f"#job={job_id}"
    page.evaluate(
        "id => document.querySelector(`a[data-job='${id}']`)"
        ".dispatchEvent(new MouseEvent('click', {bubbles: true, cancelable: true}))",
        job_id,
    )
    page.wait_for_selector("[data-testid=job-path]")
    assert page.text_content("[data-testid=job-title]") == job_id
    page.wait_for_selector("[data-testid=job-candidates]")
    assert "placed on" in (page.text_content("[data-testid=job-path]") or "")
    page.locator("#job").screenshot(path=str(shots / "console-job.png"))

    # Drain north-cpu-1 from the page: the campus places nothing more there.
    url = campus.metrics_urls()["north-cpu-1"]
    page.once("dialog", lambda d: d.accept("maintenance window"))
    page.click("[data-testid=drain-north-cpu-1]")
    page.wait_for_selector("[data-testid=worker-state-north-cpu-1]:has-text('drain')")
    page.wait_for_selector("[data-testid=worker-state-north-cpu-1]:has-text('drained')")
    ran_before = total(scrape(url), "sluicegate_worker_jobs_total")
    tally, thread = _traffic(campus, seconds=5.0, burst_for=4.0)
    thread.join(timeout=120)
    assert tally.answered == sum(tally.submitted.values())  # nothing lost while drained
    assert "north-cpu-1" not in tally.where
    assert total(scrape(url), "sluicegate_worker_jobs_total") == ran_before
    page.screenshot(path=str(shots / "console-drained.png"))
    page.click("[data-testid=uncordon-north-cpu-1]")
    page.wait_for_selector("[data-testid=worker-state-north-cpu-1]:has-text('online')")
    for name in ("console-campus.png", "console-job.png", "console-drained.png"):
        assert (shots / name).stat().st_size > 10_000
    page.context.close()


def test_the_shadow_candidates_panel_shows_its_agreement_with_production(
    campus: LocalCampus, browser: object, shots: Path
) -> None:
    page = _login(browser, campus, "viewer")
    page.wait_for_selector("[data-testid=shadow-candidate]")  # the panel is shown
    assert "shadow-placement.toml" in (page.text_content("[data-testid=shadow-candidate]") or "")
    tally, thread = _traffic(campus, seconds=5.0, burst_for=4.0)
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert tally.answered == sum(tally.submitted.values())
    served = page.evaluate("async () => (await fetch('/shadow')).json()")
    assert served["decisions"] > 0
    agreement = f"{100 * served['agreement']:.1f} %"
    # Every request was answered, so the counts hold still: the page shows what /shadow does.
    page.wait_for_function(
        """([n, agreement]) => {
          const text = (id) => document.querySelector(`[data-testid=${id}]`)?.textContent;
          return text("shadow-decisions") === String(n) && text("shadow-agreement") === agreement;
        }""",
        arg=[served["decisions"], agreement],
    )
    for outcome, jobs in served["outcomes"].items():
        assert _number(page, f"shadow-outcome-{outcome}") == jobs, outcome
    # The candidate decides under the policy in force, so it can place nothing it forbids.
    assert served["forbidden"] == []
    assert _number(page, "shadow-forbidden-count") == 0
    assert page.get_attribute("[data-testid=shadow-forbidden-count]", "class") == "badge ok"
    page.locator("#shadow").screenshot(path=str(shots / "console-shadow.png"))
    page.context.close()
