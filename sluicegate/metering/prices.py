"""The price table and the invoices made with it: what a device-second (and, optionally, a
job billed) costs on each pool or device class, and for each owner (or other key) the lines,
quantities, unit prices, amounts and total of a period's billed work.

A table is TOML, its own file or the ``[meter]`` section of a Sluicegate config::

    currency = "EUR"
    decimals = 2                # each line's amount rounded half-up to this many places

    [device_second]             # the price of one second on the device
    default = "0.0004"
    pool = { north-dc = "0.0012", edge = "0.0001" }
    class = { ascend-310 = "0.0009" }

    [job]                       # optional: a price per job billed
    default = "0.0002"

A price is looked up by the attempt's pool (an edge's own run: ``edge:<edge id>``, then
``edge``), then its device class, then ``default``. Every billed attempt needs a
device-second price (the error names the pool and class without one); where no job price
applies there is no job line. Money is ``decimal.Decimal`` throughout: quantities are
exact (microseconds), a line's amount is rounded once, the total is the sum of the lines.
Pure apart from :func:`load_prices`, which reads the file.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sluicegate.errors import SluicegateError
from sluicegate.metering.report import Attempt, By, Settlement

Price = Annotated[Decimal, Field(ge=0, allow_inf_nan=False)]


class PriceError(SluicegateError):
    """A price table cannot be read, or has no price for work that was billed."""


class Rates(BaseModel):
    """Prices of one unit: by pool, by device class, and a default."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    default: Price | None = None
    pool: dict[str, Price] = Field(default_factory=dict)
    device_class: dict[str, Price] = Field(default_factory=dict, alias="class")

    @property
    def empty(self) -> bool:
        return self.default is None and not self.pool and not self.device_class

    def price(self, pool: str, device_class: str) -> Decimal | None:
        if pool in self.pool:
            return self.pool[pool]
        if pool.startswith("edge:") and "edge" in self.pool:
            return self.pool["edge"]
        if device_class in self.device_class:
            return self.device_class[device_class]
        return self.default


class PriceTable(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    currency: str = Field("", max_length=16)
    decimals: int = Field(2, ge=0, le=8)
    device_second: Rates = Rates()
    job: Rates = Rates()

    @property
    def empty(self) -> bool:
        return self.device_second.empty and self.job.empty


def parse_prices(text: str, *, source: str) -> PriceTable:
    """A price table from TOML: its tables at the top, or under ``[meter]``."""
    try:
        doc: dict[str, Any] = tomllib.loads(text, parse_float=Decimal)
    except tomllib.TOMLDecodeError as exc:
        raise PriceError(f"{source}: not valid TOML: {exc}") from exc
    if isinstance(doc.get("meter"), dict):
        doc = doc["meter"]
    try:
        table = PriceTable.model_validate(doc)
    except ValidationError as exc:
        e = exc.errors()[0]
        where = ".".join(str(p) for p in e["loc"])
        raise PriceError(
            f"{source}: {where}: {e['msg']} (a price table has currency, decimals, "
            "[device_second] and [job], each with default, pool and class prices)"
        ) from exc
    if table.device_second.empty:
        raise PriceError(f"{source}: no [device_second] prices: an invoice needs them")
    return table


def load_prices(path: Path) -> PriceTable:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PriceError(f"cannot read the price table {path}: {exc}") from exc
    return parse_prices(text, source=str(path))


Item = Literal["device-seconds", "jobs"]


@dataclass(frozen=True, slots=True)
class InvoiceLine:
    item: Item
    pool: str
    device_class: str
    quantity: Decimal
    unit_price: Decimal
    amount: Decimal


@dataclass(frozen=True, slots=True)
class Invoice:
    by: By
    key: str
    currency: str
    lines: tuple[InvoiceLine, ...]
    total: Decimal


def invoices(settlement: Settlement, table: PriceTable, by: By = "owner") -> list[Invoice]:
    """One invoice per value of ``by`` for the work billed in ``settlement``."""
    step = Decimal(1).scaleb(-table.decimals)
    grouped: dict[str, dict[tuple[str, str], list[Attempt]]] = {}
    for billed in settlement.billed:
        a = billed.attempt
        grouped.setdefault(a.key(by), {}).setdefault((a.pool, a.device_class), []).append(a)
    out = []
    for key, groups in sorted(grouped.items()):
        lines: list[InvoiceLine] = []
        for (pool, device_class), attempts in sorted(groups.items()):
            unit = table.device_second.price(pool, device_class)
            if unit is None:
                raise PriceError(
                    f"no device-second price for pool {pool!r} (device class "
                    f"{device_class or NO_CLASS!r}): add it under [device_second] pool or "
                    "class, or a default"
                )
            seconds = sum((a.device_s for a in attempts), Decimal(0))
            lines.append(_line("device-seconds", pool, device_class, seconds, unit, step))
            per_job = table.job.price(pool, device_class)
            if per_job is not None:
                jobs = Decimal(len(attempts))
                lines.append(_line("jobs", pool, device_class, jobs, per_job, step))
        total = sum((line.amount for line in lines), Decimal(0))
        out.append(Invoice(by, key, table.currency, tuple(lines), total.quantize(step)))
    return out


NO_CLASS = "(none)"


def _line(
    item: Item, pool: str, device_class: str, quantity: Decimal, unit: Decimal, step: Decimal
) -> InvoiceLine:
    amount = (quantity * unit).quantize(step, rounding=ROUND_HALF_UP)
    return InvoiceLine(item, pool, device_class, quantity, unit, amount)
