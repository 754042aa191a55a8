"""``sluicegate meter verify|report|export`` as a person runs them: exit status, what they
print, the files they write (a report, an invoice, a PNG plot), a tampered export refused,
and an export fetched over real HTTP from a stand-in for the broker's endpoint."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from sluicegate.app.cli import app
from sluicegate.metering.cli import parse_time
from tests.meter_kit import T0, day, write_policy

PRICES = """
currency = "EUR"
[device_second]
default = "0.50"
pool = { north-dc = "1.25", edge = "0.10" }
[job]
pool = { north-dc = "0.01" }
"""


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    export = tmp_path / "usage.jsonl"
    export.write_bytes(day().export())
    prices = tmp_path / "prices.toml"
    prices.write_text(PRICES)
    return {"export": export, "policy": write_policy(tmp_path), "prices": prices}


def _run(*args: str | Path) -> Result:
    return CliRunner().invoke(app, ["meter", *(str(a) for a in args)])


def _tamper(export: Path) -> None:
    lines = export.read_bytes().split(b"\n")
    lines[2] = lines[2].replace(b'"device_us":', b'"device_us":9')
    del lines[5]
    export.write_bytes(b"\n".join(lines))


def test_verify_an_intact_export(files: dict[str, Path]) -> None:
    done = _run("verify", files["export"], "--policy", files["policy"])
    assert done.exit_code == 0, done.output
    assert "OK 13 records from 5 nodes, exported by 'broker-1'" in done.output
    assert "period 2026-11-30T00:53:20.000Z to 2026-11-30T01:53:20.000Z" in done.output


def test_verify_names_every_problem_and_exits_1(files: dict[str, Path]) -> None:
    _tamper(files["export"])
    done = _run("verify", files["export"], "--policy", files["policy"])
    assert done.exit_code == 1
    out = done.output
    assert f"{files['export']}:line 3 (north-gpu-1 #3): altered:" in out
    assert "removed" in out
    assert "manifest" in out
    assert "NOT VERIFIED" in out


@pytest.mark.parametrize("which", ["export", "policy"])
def test_verify_exits_2_when_it_cannot_check(files: dict[str, Path], which: str) -> None:
    files[which] = files[which].with_name("missing")
    done = _run("verify", files["export"], "--policy", files["policy"])
    assert done.exit_code == 2
    assert "error:" in done.output


def test_report_refuses_an_export_that_does_not_verify(files: dict[str, Path]) -> None:
    _tamper(files["export"])
    done = _run("report", files["export"], "--policy", files["policy"])
    assert done.exit_code == 1
    assert "does not verify, so no report is made from it" in done.output
    assert "altered" in done.output
    assert "--unverified" in done.output


def test_report_unverified_says_so(files: dict[str, Path]) -> None:
    _tamper(files["export"])
    done = _run("report", files["export"], "--policy", files["policy"], "--unverified")
    assert done.exit_code == 0, done.output
    assert "warning:" in done.output
    assert "(NOT VERIFIED)" in done.output


def test_report_table(files: dict[str, Path]) -> None:
    done = _run("report", files["export"], "--policy", files["policy"], "--by", "owner")
    assert done.exit_code == 0, done.output
    assert "by owner (verified: 13 records)" in done.output
    assert "inspect" in done.output
    assert "waste: 3 attempts" in done.output
    assert "j-open (north-l2-pc)" in done.output


def test_report_json_invoice_to_a_file(files: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "invoice.json"
    done = _run(
        "report",
        files["export"],
        "--policy",
        files["policy"],
        "--prices",
        files["prices"],
        "--format",
        "json",
        "--out",
        out,
    )
    assert done.exit_code == 0, done.output
    doc = json.loads(out.read_text())
    assert [(i["by"], i["key"], i["total"]) for i in doc["invoices"]] == [
        ("owner", "inspect", "0.05"),
        ("owner", "ocr", "0.02"),
    ]
    assert doc["by"] == "line"


def test_report_csv_by_pool_over_a_period(files: dict[str, Path]) -> None:
    start = T0 / 1000 + 60
    done = _run(
        "report",
        files["export"],
        "--policy",
        files["policy"],
        "--by",
        "pool",
        "--format",
        "csv",
        "--from",
        str(start),
        "--to",
        "2026-11-30T01:53:20Z",
    )
    assert done.exit_code == 0, done.output
    rows = [line.split(",") for line in done.output.strip().splitlines()]
    assert rows[0][0] == "pool"
    assert {r[0] for r in rows[1:]} == {"north-dc", "south-dc", "total"}
    total = rows[-1]
    assert Decimal(total[1]) == Decimal("0.034000")  # j-retry 0.014 + j-fenced 0.020


def test_report_invoice_csv_by_line(files: dict[str, Path]) -> None:
    done = _run(
        "report",
        files["export"],
        "--policy",
        files["policy"],
        "--prices",
        files["prices"],
        "--by",
        "line",
        "--format",
        "csv",
    )
    assert done.exit_code == 0, done.output
    assert done.output.splitlines()[0].startswith("line,item,pool")
    assert "north-l1-pc,total,,,,,0.05,EUR" in done.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--by", "shift"], "give one of line, owner, pool"),
        (["--format", "xml"], "give table, csv or json"),
        (["--from", "2026-11-30T01:00:00"], "add a time zone"),
        (["--from", "yesterday"], "expected unix seconds or ISO 8601"),
        (["--from", "2026-12-01", "--to", "2026-11-01"], "is not before --to"),
    ],
)
def test_report_bad_options_exit_2(files: dict[str, Path], args: list[str], message: str) -> None:
    done = _run("report", files["export"], "--policy", files["policy"], *args)
    assert done.exit_code == 2
    assert message in done.output


def test_report_a_price_missing_exits_2(files: dict[str, Path]) -> None:
    files["prices"].write_text('[device_second]\npool = { north-dc = "1" }\n')
    done = _run("report", files["export"], "--policy", files["policy"], "--prices", files["prices"])
    assert done.exit_code == 2
    assert "no device-second price for pool 'edge:north-l1-pc'" in done.output


def test_times_are_unix_seconds_iso_or_a_date() -> None:
    assert parse_time("1796000000", "--from") == 1_796_000_000
    assert parse_time("2026-11-30T00:53:20Z", "--from") == 1_796_000_000
    assert parse_time("2026-11-30T01:53:20+01:00", "--from") == 1_796_000_000
    assert parse_time("2026-11-30", "--from") == 1_796_000_000 - 3200


def test_report_plots_use_to_a_png(files: dict[str, Path], tmp_path: Path) -> None:
    import matplotlib.image

    png = tmp_path / "use.png"
    done = _run(
        "report", files["export"], "--policy", files["policy"], "--plot", png, "--by", "pool"
    )
    assert done.exit_code == 0, done.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = matplotlib.image.imread(png).shape[:2]
    assert (width, height) == (1000, 450)


def test_a_plot_without_matplotlib_says_how_to_get_it(
    files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    done = _run(
        "report", files["export"], "--policy", files["policy"], "--plot", tmp_path / "use.png"
    )
    assert done.exit_code == 2
    assert "pip install 'sluicegate[twin]'" in done.output
    assert "device-s" not in done.output  # no report half made


class _Broker(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        if self.headers.get("Authorization") != "Bearer viewer-token":
            self.send_response(401)
            self.end_headers()
            self.wfile.write(b'{"error": "log in"}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def broker() -> Iterator[str]:
    _Broker.body = day().export()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Broker)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_export_fetches_writes_and_verifies(
    files: dict[str, Path], tmp_path: Path, broker: str
) -> None:
    token = tmp_path / "viewer.token"
    token.write_text("viewer-token\n")
    out = tmp_path / "fetched.jsonl"
    done = _run(
        "export",
        "--broker",
        broker,
        "--token-file",
        token,
        "--from",
        "2026-11-30T00:53:20Z",
        "--to",
        "1796003600",
        "--out",
        out,
        "--policy",
        files["policy"],
    )
    assert done.exit_code == 0, done.output
    assert "13 records" in done.output
    assert "OK 13 records" in done.output
    assert out.read_bytes() == _Broker.body


def test_export_refused_exits_2_with_a_hint(tmp_path: Path, broker: str) -> None:
    token = tmp_path / "viewer.token"
    token.write_text("wrong")
    done = _run(
        "export",
        "--broker",
        broker,
        "--token-file",
        token,
        "--from",
        "0",
        "--to",
        "1",
        "--out",
        tmp_path / "x.jsonl",
    )
    assert done.exit_code == 2
    assert "HTTP 401 (give a viewer's console token)" in done.output
    assert not (tmp_path / "x.jsonl").exists()
