"""The usage records of a benchmark run, checked against what its vision app received.

After a run, the broker's export (``GET /v1/usage/export``) is fetched until every job the
app got a result for that ran somewhere is billed (or ``wait_s`` passes: the shipping is at
least once, and a record sent to a broker that was down comes with the next resend), then
verified offline against the campus policy (``sluicegate.metering.verify``) and settled
(``sluicegate.metering.report``). The figures: records, problems, jobs billed against jobs
that ran, jobs billed twice (must be 0), billed on another node than the one that answered
(must be 0), waste (attempts that ran and were not delivered) and the billed device time
against the device time the delivered results report (``timings_ms.device_ms``).
Used by ``bench/chaos.py``; the app's ledger is ``tests.faults.ledger.Ledger``.
"""

from __future__ import annotations

import time
from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import Any

from policies import load_policy
from sluicegate.app.broker_http import get
from sluicegate.metering.report import settle
from sluicegate.metering.verify import Verification, verify_export


def _export(url: str, token: str | None) -> bytes:
    status, body = get(url, token, timeout=30.0)
    if status != 200:
        raise SystemExit(f"usage export: HTTP {status}: {body[:200]!r}")
    return body


def delivered(jobs: dict[str, Any], prefix: str) -> dict[str, dict[str, Any]]:
    """The first result of each job of this run that ran somewhere (device time > 0)."""
    out: dict[str, dict[str, Any]] = {}
    for job in jobs.values():
        if not job.job_id.startswith(prefix + "-") or not job.deliveries:
            continue
        doc = job.deliveries[0][1]
        if (doc.get("timings_ms") or {}).get("device_ms", 0) > 0:
            out[job.job_id] = doc
    return out


def check(
    *,
    broker_url: str,
    token: str | None,
    policy_file: Path,
    jobs: dict[str, Any],
    prefix: str,
    wait_s: float = 90.0,
) -> dict[str, Any]:
    policy = load_policy(policy_file)
    expected = delivered(jobs, prefix)
    deadline = time.monotonic() + wait_s
    waited = 0.0
    start = time.monotonic()
    while True:
        data = _export(f"{broker_url}/v1/usage/export?from=0&to={int(time.time()) + 60}", token)
        verification = verify_export(data, policy)
        settlement = settle(verification.records, policy)
        billed = Counter(b.attempt.job[1] for b in settlement.billed)
        if set(expected) <= set(billed) or time.monotonic() >= deadline:
            waited = time.monotonic() - start
            break
        time.sleep(1.0)  # the next look at the broker's records
    return _figures(verification, settlement, expected, prefix, waited, len(data))


def _figures(
    verification: Verification,
    settlement: Any,
    expected: dict[str, dict[str, Any]],
    prefix: str,
    waited: float,
    size: int,
) -> dict[str, Any]:
    mine = [b for b in settlement.billed if b.attempt.job[1].startswith(prefix + "-")]
    billed = Counter(b.attempt.job[1] for b in mine)
    waste = [w for w in settlement.waste if w.attempt.job[1].startswith(prefix + "-")]
    unsettled = [u for u in settlement.unsettled if u.job[1].startswith(prefix + "-")]
    elsewhere = sum(
        1
        for b in mine
        if b.attempt.job[1] in expected
        and expected[b.attempt.job[1]]["ran_on"]["node"] != b.attempt.node
    )
    billed_s = sum((b.attempt.device_s for b in mine), Decimal(0))
    results_s = Decimal(
        str(sum(doc["timings_ms"]["device_ms"] for doc in expected.values()) / 1000.0)
    )
    ratio = float(billed_s / results_s) if results_s else float("nan")
    return {
        "export_bytes": size,
        "records": len(verification.records),
        "verified": verification.ok,
        "problems": [str(p) for p in verification.problems[:10]],
        "jobs_ran": len(expected),
        "jobs_billed": len(billed),
        "jobs_billed_twice": sum(1 for n in billed.values() if n > 1),
        "ran_not_billed": len(set(expected) - set(billed)),
        "billed_not_delivered": len(set(billed) - set(expected)),
        "billed_on_other_node": elsewhere,
        "waste_attempts": len(waste),
        "waste_device_s": float(sum((w.attempt.device_s for w in waste), Decimal(0))),
        "unsettled_jobs": len(unsettled),
        "billed_device_s": float(billed_s),
        "results_device_s": float(results_s),
        "billed_over_results": ratio,
        "waited_s": round(waited, 1),
    }
