"""``sluicegate.metering.report`` and ``prices``: each job billed once, for the attempt its
edge settled, whatever the retries; every other run waste; jobs not settled yet apart;
totals by every key; invoices whose arithmetic adds up, in CSV and JSON."""

from __future__ import annotations

import csv
import io
import json
from decimal import Decimal
from pathlib import Path

import pytest

from sluicegate.config import load_settings
from sluicegate.metering.prices import PriceError, invoices, parse_prices
from sluicegate.metering.render import as_csv, as_json, as_table
from sluicegate.metering.report import BY, Settlement, overall, settle, totals
from sluicegate.metering.verify import verify_export
from tests.meter_kit import MINUTE, T0, Ledgers, day, meter_policy

POLICY = meter_policy()
L1, L2 = "north-l1-pc", "north-l2-pc"
PRICES = """
currency = "EUR"
decimals = 2

[device_second]
default = "0.50"
pool = { north-dc = "1.25", edge = "0.10" }
class = { ascend-310 = 0.75 }

[job]
pool = { north-dc = "0.01" }
"""


def _settle(led: Ledgers, **period: int) -> Settlement:
    checked = verify_export(led.export(), POLICY)
    assert checked.ok, checked.problems
    return settle(checked.records, POLICY, **period)


def test_each_job_is_billed_once_for_the_attempt_its_edge_settled() -> None:
    s = _settle(day())
    billed = {b.attempt.job[1]: (b.attempt.node, b.attempt.attempt) for b in s.billed}
    assert billed == {
        "j-local-1": (L1, 0),
        "j-local-2": (L2, 0),
        "j-off-1": ("north-gpu-1", 1),
        "j-retry": ("north-gpu-2", 2),
        "j-fenced": ("south-npu-1", 2),
    }
    assert len(s.billed) == 5


def test_retries_are_billed_once_however_many() -> None:
    led = Ledgers()
    for attempt in range(1, 5):
        worker = "north-gpu-1" if attempt % 2 else "north-gpu-2"
        led.ran(worker, "j", line=L1, attempt=attempt, at_ms=T0 + attempt * 1000, device_ms=10)
    led.settled(L1, "j", at_ms=T0 + 5000, worker="north-gpu-2", attempt=4)
    s = _settle(led)
    (billed,) = s.billed
    assert billed.attempt.attempt == 4
    assert sorted(w.attempt.attempt for w in s.waste) == [1, 2, 3]
    assert overall(s).device_s == Decimal("0.010000")
    assert overall(s).waste_device_s == Decimal("0.030000")


def test_a_job_its_edge_ran_after_a_worker_was_lost_bills_the_edges_run() -> None:
    led = Ledgers()
    led.ran("north-gpu-1", "j", line=L1, attempt=1, at_ms=T0 + 1000, device_ms=30)
    led.ran(L1, "j", line=L1, at_ms=T0 + 4000, device_ms=50)
    s = _settle(led)
    (billed,) = s.billed
    assert (billed.attempt.node, billed.attempt.pool) == (L1, f"edge:{L1}")
    (waste,) = s.waste
    assert waste.attempt.node == "north-gpu-1"
    assert "its own run" in waste.reason


def test_waste_is_accounted_and_says_why() -> None:
    s = _settle(day())
    waste = {(w.attempt.job[1], w.attempt.node, w.attempt.attempt): w.reason for w in s.waste}
    assert set(waste) == {
        ("j-retry", "north-gpu-1", 1),
        ("j-fenced", "north-gpu-2", 1),
        ("j-expired", "north-gpu-1", 1),
    }
    assert "attempt 2 on north-gpu-2" in waste["j-retry", "north-gpu-1", 1]
    assert "nothing delivered" in waste["j-expired", "north-gpu-1", 1]
    assert s.undelivered == 1
    total = overall(s)
    assert (total.waste_attempts, total.waste_device_s) == (3, Decimal("0.070000"))


def test_unsettled_jobs_are_reported_apart() -> None:
    s = _settle(day())
    (open_job,) = s.unsettled
    assert open_job.job == (L2, "j-open")
    assert open_job.device_s == Decimal("0.011000")
    assert all(b.attempt.job[1] != "j-open" for b in s.billed)
    assert all(w.attempt.job[1] != "j-open" for w in s.waste)


def test_a_settlement_after_the_period_leaves_the_job_unsettled_in_it() -> None:
    s = _settle(day(), to_ms=T0 + 30_020)  # j-off-1 ran at +30_000, settled at +30_050
    assert (L1, "j-off-1") in {u.job for u in s.unsettled}
    later = _settle(day(), from_ms=T0 + 30_020)
    assert "j-off-1" in {b.attempt.job[1] for b in later.billed}
    assert "j-local-1" not in {b.attempt.job[1] for b in later.billed}


def test_consecutive_periods_bill_each_job_once() -> None:
    whole = _settle(day())
    cut = T0 + MINUTE + 920  # between j-retry's attempt 2 and its settlement
    first, second = _settle(day(), to_ms=cut), _settle(day(), from_ms=cut)
    assert len(first.billed) + len(second.billed) == len(whole.billed)
    assert overall(first).device_s + overall(second).device_s == overall(whole).device_s


def test_a_settlement_whose_attempt_is_not_in_the_export_is_noted_not_billed() -> None:
    led = Ledgers()
    led.settled(L1, "j-old", at_ms=T0 + 10, worker="north-gpu-1", attempt=1)
    s = _settle(led)
    assert not s.billed
    assert any("not in this export" in n for n in s.notes)


@pytest.mark.parametrize(
    ("by", "expected"),
    [
        ("line", {L1: (3, "0.066000"), L2: (2, "0.080000")}),
        ("owner", {"inspect": (3, "0.066000"), "ocr": (2, "0.080000")}),
        (
            "pool",
            {
                "edge:north-l1-pc": (1, "0.040000"),
                "edge:north-l2-pc": (1, "0.060000"),
                "north-dc": (2, "0.026000"),
                "south-dc": (1, "0.020000"),
            },
        ),
        ("model", {"defect-v1": (5, "0.146000")}),
        (
            "class",
            {
                "x86-cpu": (2, "0.100000"),
                "nvidia-a100": (2, "0.026000"),
                "ascend-310": (1, "0.020000"),
            },
        ),
        ("data-class", {"wafer-image": (5, "0.146000")}),
    ],
)
def test_totals_by_each_key(by: str, expected: dict[str, tuple[int, str]]) -> None:
    assert by in BY
    rows = totals(_settle(day()), by)  # type: ignore[arg-type]
    got = {r.key: (r.jobs, str(r.device_s)) for r in rows if r.jobs}
    assert got == expected


def test_totals_by_pool_carry_waste_and_unsettled_on_the_pool_that_ran_them() -> None:
    rows = {r.key: r for r in totals(_settle(day()), "pool")}
    assert rows["north-dc"].waste_attempts == 3
    assert rows["north-dc"].unsettled_jobs == 1
    assert rows["south-dc"].waste_attempts == 0


def test_the_invoice_arithmetic() -> None:
    table = parse_prices(PRICES, source="prices.toml")
    (inspect, ocr) = invoices(_settle(day()), table, "owner")
    assert (inspect.key, inspect.currency) == ("inspect", "EUR")
    lines = [(x.item, x.pool, x.quantity, x.unit_price, x.amount) for x in inspect.lines]
    assert lines == [
        (
            "device-seconds",
            "edge:north-l1-pc",
            Decimal("0.040000"),
            Decimal("0.10"),
            Decimal("0.00"),
        ),
        ("device-seconds", "north-dc", Decimal("0.026000"), Decimal("1.25"), Decimal("0.03")),
        ("jobs", "north-dc", Decimal(2), Decimal("0.01"), Decimal("0.02")),
    ]
    assert inspect.total == Decimal("0.05")
    # ocr: edge 0.06 s x 0.10 = 0.006 -> 0.01; south-dc by class 0.02 s x 0.75 = 0.015 -> 0.02
    assert [x.amount for x in ocr.lines] == [Decimal("0.01"), Decimal("0.02")]
    assert ocr.total == Decimal("0.03")
    for inv in (inspect, ocr):
        assert inv.total == sum(x.amount for x in inv.lines)


def test_a_billed_pool_without_a_price_is_an_error_naming_it() -> None:
    table = parse_prices('[device_second]\npool = { north-dc = "1" }\n', source="p.toml")
    with pytest.raises(PriceError, match="'edge:north-l1-pc'"):
        invoices(_settle(day()), table)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("currency = ", "not valid TOML"),
        ("[device_second]\ndefault = -1\n", "greater than or equal"),
        ("[device_second]\ndefalt = 1\n", "defalt"),
        ('currency = "EUR"\n', "no \\[device_second\\]"),
    ],
)
def test_a_bad_price_table_is_an_error_that_says_what_is_accepted(text: str, message: str) -> None:
    with pytest.raises(PriceError, match=message):
        parse_prices(text, source="p.toml")


def test_a_configs_meter_section_is_a_price_table() -> None:
    table = parse_prices('[mqtt]\nhost = "x"\n[meter.device_second]\ndefault = 2\n', source="c")
    assert table.device_second.default == Decimal(2)


def test_a_config_with_a_meter_section_still_loads_for_the_roles(tmp_path: Path) -> None:
    config = tmp_path / "broker.toml"
    config.write_text(
        '[mqtt]\nhost = "x"\n\n[meter]\ncurrency = "EUR"\n\n[meter.device_second]\n'
        "default = 0.5\nclass = { ascend-310 = 0.75 }\n"
    )
    settings = load_settings(config)
    assert settings.mqtt.host == "x"
    assert settings.meter == parse_prices(config.read_text(), source=str(config))
    assert settings.meter.device_second.price("south-dc", "ascend-310") == Decimal("0.75")


def test_the_invoice_as_csv_adds_up() -> None:
    s = _settle(day())
    text = as_csv(s, "line", invoices(s, parse_prices(PRICES, source="p"), "owner"))
    rows = list(csv.DictReader(io.StringIO(text)))
    assert list(rows[0]) == [
        "owner",
        "item",
        "pool",
        "device_class",
        "quantity",
        "unit_price",
        "amount",
        "currency",
    ]
    for owner in ("inspect", "ocr"):
        mine = [r for r in rows if r["owner"] == owner]
        lines, (total,) = mine[:-1], mine[-1:]
        assert total["item"] == "total"
        for r in lines:
            amount = (Decimal(r["quantity"]) * Decimal(r["unit_price"])).quantize(Decimal("0.01"))
            assert Decimal(r["amount"]) == amount
        assert Decimal(total["amount"]) == sum(Decimal(r["amount"]) for r in lines)


def test_the_report_as_json_holds_everything_as_decimal_strings() -> None:
    s = _settle(day())
    doc = json.loads(as_json(s, "pool", invoices(s, parse_prices(PRICES, source="p")), True))
    assert doc["verified"] is True
    assert doc["overall"]["device_s"] == "0.146000"
    assert doc["overall"]["jobs"] == 5
    assert len(doc["waste"]) == 3
    assert doc["unsettled"][0]["job_id"] == "j-open"
    assert [i["total"] for i in doc["invoices"]] == ["0.05", "0.03"]
    for inv in doc["invoices"]:
        assert Decimal(inv["total"]) == sum(Decimal(x["amount"]) for x in inv["lines"])


def test_the_totals_as_csv_and_table() -> None:
    s = _settle(day())
    rows = list(csv.DictReader(io.StringIO(as_csv(s, "line", None))))
    assert [r["line"] for r in rows] == [L1, L2, "total"]
    assert rows[-1]["jobs"] == "5"
    text = as_table(s, "line", None, "verified")
    assert "waste: 3 attempts, 0.070000 device-s, not billed" in text
    assert "unsettled: 1 job," in text
