"""A burst on a line of campus north that north's own pool cannot take runs on campus south's
pool, across the bridge, inside the agreement (issue 39, part 4), end to end as two plants
run it: two CAs, two secured Mosquittos bridged through a delaying link, two Redis
databases, each campus's broker, north's line PC and south's pool worker as processes
(``tests/two_campus_kit.py``). North's broker asks south's, relays south's signed placement;
north's edge checks it against south's keys in its own policy, sends the image across and
takes the result back; a class the agreement does not list stays on north's line PC."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sluicegate import wire
from sluicegate.app.localcampus import LocalCampus
from sluicegate.client import AsyncClient
from tests.image_bytes import sample_jpeg
from tests.peer_kit import cli
from tests.two_campus_kit import NORTH, SOUTH, SOUTH_DC, TwoCampuses, two_campuses

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LINE, APP, RESULTS = "line-1-pc", "app-line-1", "app/line-1/results"
JPEG, _TRUTH = sample_jpeg(5)


@pytest.fixture(scope="module")
def rig(
    tmp_path_factory: pytest.TempPathFactory, fresh_redis_db: Callable[[], str]
) -> Iterator[TwoCampuses]:
    with two_campuses(
        tmp_path_factory.mktemp("two-campuses"),
        fresh_redis_db,
        north_nodes=("broker-1", LINE),  # no worker of north's own runs
        south_nodes=("broker-1", "north-cpu-1"),  # south's one worker, in its data centre
        delay_s=0.005,
        # The edge waits for an answer from across the link (the default suits a campus).
        north_env={LINE: {"SLUICEGATE_OFFLOAD__PLACEMENT_TIMEOUT_MS": "500"}},
    ) as made:
        yield made


async def burst(rig: TwoCampuses, classes: list[str], deadline_ms: float) -> list[wire.JobResult]:
    north = rig.north.campus
    assert north is not None
    async with AsyncClient(
        north.mqtt(APP), edge=LINE, response_topic=RESULTS, default_timeout=60
    ) as app:
        return list(
            await asyncio.gather(
                *(
                    app.infer(JPEG, model="defect-v1", data_class=c, deadline_ms=deadline_ms)
                    for c in classes
                )
            )
        )


def test_a_burst_north_cannot_take_runs_on_south_and_what_may_not_leave_stays(
    rig: TwoCampuses,
) -> None:
    offered = rig.wait_offered()
    assert offered["link"]["rtt_s"] >= 0.010  # the relay's 5 ms each way, measured
    classes = ["ocr-crop"] * 24 + ["wafer-image"] * 4
    results = asyncio.run(burst(rig, classes, deadline_ms=1500))
    assert [r.status for r in results] == ["ok"] * len(classes), [
        (r.status, r.code, r.reason) for r in results if r.status != "ok"
    ]
    crossed = [r for r, c in zip(results, classes, strict=True) if r.ran_on.zone == SOUTH_DC]
    assert crossed, [r.offload for r in results]  # some of the burst ran on south's pool
    assert all(r.offload is not None and r.offload.placed for r in crossed)
    # The result is south's worker's own document, forwarded to the app unchanged.
    assert {r.ran_on.node for r in crossed} == {"north-cpu-1"}
    wafers = [r for r, c in zip(results, classes, strict=True) if c == "wafer-image"]
    assert all(r.ran_on.kind == "edge" for r in wafers)  # the agreement lists no wafer
    shown = rig.peers_seen(rig.south)
    assert shown["peers"][0]["standing"] == "in_force"


def settlement(rig: TwoCampuses, side: LocalCampus, peer: str, folder: Path) -> dict[str, Any]:
    """``side``'s settlement export with ``peer``, fetched as an operator does (``meter
    export --peer``), checked and settled offline (``meter peer-report``)."""
    written = side.campus
    assert written is not None
    token = folder / f"{peer}.token"
    token.write_text(written.console_token("viewer"))
    out = folder / f"settle-{peer}.jsonl"
    broker = f"http://127.0.0.1:{side.http_port}"
    now = time.time()
    cli("meter", "export", "--broker", broker, "--token-file", token, "--from", now - 3600,
        "--to", now + 60, "--out", out, "--peer", peer)  # fmt: skip
    report = cli("meter", "peer-report", out, "--policy", written.policy_file, "--peer", peer,
                 "--format", "json")  # fmt: skip
    return dict(json.loads(report))


def test_both_campuses_settle_the_jobs_between_them_alike(rig: TwoCampuses, tmp_path: Path) -> None:
    """South's worker's records of north's jobs, countersigned by south's broker, reach
    north; north's edge's settlements reach south; each side's export verifies offline
    against its own policy, and what north owes is what south is owed, job for job."""
    rig.wait_offered()
    results = asyncio.run(burst(rig, ["ocr-crop"] * 12, deadline_ms=1500))
    crossed = {r.job_id for r in results if r.ran_on.zone == SOUTH_DC}
    assert crossed
    deadline = time.monotonic() + 60
    while True:  # the nodes ship their records every few seconds; the brokers pass them on
        owes = settlement(rig, rig.north, SOUTH, tmp_path)
        owed = settlement(rig, rig.south, NORTH, tmp_path)
        billed = {i["job_id"] for i in owes["owed_by_us"]["items"]}
        if crossed <= billed and owes["owed_by_us"] == owed["owed_to_us"]:
            break
        assert time.monotonic() < deadline, (crossed - billed, owes, owed)
        time.sleep(0.5)
    assert owes["owed_by_us"]["device_s"] == owed["owed_to_us"]["device_s"]
    assert float(owes["owed_by_us"]["device_s"]) > 0
    assert owes["currency"] == owed["currency"] == "EUR"
    assert owes["owed_to_us"]["jobs"] == owed["owed_by_us"]["jobs"] == 0  # south sent nothing


def test_the_console_shows_the_sister_campus_and_the_jobs_between_them(
    rig: TwoCampuses, tmp_path: Path
) -> None:
    """North's console, in headless Chromium: south in force, its offer, the link, the jobs
    north sent it; south's console: the jobs it took from north."""
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium (scripts/bootstrap installs it)")
    rig.wait_offered()
    results = asyncio.run(burst(rig, ["ocr-crop"] * 12, deadline_ms=1500))
    assert any(r.ran_on.zone == SOUTH_DC for r in results)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            for side, peer, column in ((rig.north, SOUTH, "sent"), (rig.south, NORTH, "received")):
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.set_default_timeout(30_000)
                written = side.campus
                assert written is not None
                page.goto(f"http://127.0.0.1:{side.http_port}/console")
                page.fill("[data-testid=login-password]", written.console_token("viewer"))
                page.click("[data-testid=login-submit]")
                page.wait_for_selector("[data-testid=live]:has-text('live')")
                row = page.wait_for_selector(f"[data-testid=peer-{peer}]")
                assert row is not None
                standing = page.text_content(f"[data-testid=peer-standing-{peer}]")
                assert standing == "in_force"
                page.wait_for_selector(f"[data-testid=peer-{column}-{peer}]:has-text('placed')")
                shown = page.text_content(f"[data-testid=peer-{column}-{peer}]") or ""
                assert int(shown.split("placed", 1)[1].split(",")[0]) > 0, shown
                page.screenshot(path=str(tmp_path / f"console-{peer}.png"), full_page=True)
        finally:
            browser.close()
