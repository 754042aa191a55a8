"""``sluicegate meter``: usage exports fetched, verified and reported, thin shells over
``sluicegate.metering`` (verify, report, prices, render, plot, fetch).

The shell reads and writes the files it is told to and nothing else; the checks and the
arithmetic are the library's. Exit status: 0 done (``verify``: the export is intact); 1 the
export does not verify (``report`` refuses it without ``--unverified``); 2 the command could
not do its work (a file it cannot read, a bad option, a broker that cannot be reached).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

if TYPE_CHECKING:
    from policies.model import Policy
    from sluicegate.metering.report import By
    from sluicegate.metering.verify import Verification

meter_app = typer.Typer(
    help="Usage metering: fetch an export, verify it, report and invoice.", no_args_is_help=True
)
SHOWN = 10  # problems 'report' names before it counts the rest

FileArg = Annotated[Path, typer.Argument(help="A usage export (sluicegate meter export).")]
PolicyOpt = Annotated[
    Path, typer.Option("--policy", "-p", help="The policy whose keys the export is checked with.")
]
FromOpt = Annotated[
    str | None, typer.Option("--from", help="Start, inclusive: unix seconds or ISO 8601.")
]
ToOpt = Annotated[
    str | None, typer.Option("--to", help="End, exclusive: unix seconds or ISO 8601.")
]


def _fail(message: str, code: int = 2) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def parse_time(text: str, name: str) -> float:
    """Unix seconds, an ISO 8601 date-time with a zone, or a date (midnight UTC)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        if len(text) == 10:
            return dt.datetime.combine(dt.date.fromisoformat(text), dt.time(), dt.UTC).timestamp()
        moment = dt.datetime.fromisoformat(text)
    except ValueError:
        _fail(f"{name} {text!r}: expected unix seconds or ISO 8601, e.g. 2026-11-01T00:00:00Z")
    if moment.tzinfo is None:
        _fail(f"{name} {text!r}: add a time zone, e.g. {text}Z")
    return moment.timestamp()


def _ms(text: str | None, name: str) -> int | None:
    return None if text is None else round(parse_time(text, name) * 1000)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        _fail(f"cannot read {path}: {exc.strerror}")


def _policy(path: Path) -> Policy:
    from policies.errors import PolicyError
    from policies.loader import load_policy

    try:
        return load_policy(path)
    except PolicyError as exc:
        _fail(f"policy {path}: {exc}")


def _by(value: str) -> By:
    from sluicegate.metering.report import BY

    for by in BY:
        if value == by:
            return by
    raise typer.BadParameter(f"{value!r}: give one of {', '.join(BY)}", param_hint="--by")


def _checked(file: Path, policy_file: Path) -> tuple[Policy, Verification]:
    from sluicegate.metering.verify import verify_export

    policy = _policy(policy_file)
    return policy, verify_export(_read(file), policy)


@meter_app.command()
def verify(file: FileArg, policy: PolicyOpt) -> None:
    """Check an export against the policy's keys; exit 1 naming every problem.

    Every node signature and broker receipt, each node's numbering and chain, and the
    manifest's signature, sha256 and heads."""
    _, checked = _checked(file, policy)
    for problem in checked.problems:
        typer.echo(f"{file}:{problem}")
    typer.echo(checked.summary())
    if checked.manifest is not None and checked.ok:
        from sluicegate.metering.render import iso

        m = checked.manifest
        typer.echo(
            f"period {iso(m.from_ms)} to {iso(m.to_ms)}, exported {iso(m.exported_ms)}; "
            f"checked with the keys of {policy}"
        )
    if not checked.ok:
        raise typer.Exit(1)


@meter_app.command()
def report(
    file: FileArg,
    policy: PolicyOpt,
    from_: FromOpt = None,
    to: ToOpt = None,
    by: Annotated[
        str | None,
        typer.Option(help="Totals by line, owner, pool, model, class or data-class [line]."),
    ] = None,
    prices: Annotated[
        Path | None,
        typer.Option(help="A price table (TOML, or a config's [meter]): invoices by owner."),
    ] = None,
    fmt: Annotated[str, typer.Option("--format", help="table, csv or json.")] = "table",
    out: Annotated[Path | None, typer.Option(help="Write here instead of stdout.")] = None,
    plot: Annotated[
        Path | None, typer.Option(help="Also draw device-seconds per minute to this PNG.")
    ] = None,
    unverified: Annotated[
        bool, typer.Option(help="Report from an export that does not verify, saying so.")
    ] = False,
) -> None:
    """Totals of billed work, waste and unsettled jobs; with --prices, the invoices.

    Refuses an export that does not verify, unless --unverified."""
    from sluicegate.errors import SluicegateError
    from sluicegate.files import write_atomic
    from sluicegate.metering import render
    from sluicegate.metering.report import settle

    if fmt not in ("table", "csv", "json"):
        raise typer.BadParameter(f"{fmt!r}: give table, csv or json", param_hint="--format")
    totals_by = _by(by or "line")
    from_ms, to_ms = _ms(from_, "--from"), _ms(to, "--to")
    if from_ms is not None and to_ms is not None and from_ms >= to_ms:
        _fail(f"--from {from_} is not before --to {to}")
    loaded, checked = _checked(file, policy)
    if not checked.ok:
        listed = "; ".join(str(p) for p in checked.problems[:SHOWN])
        more = len(checked.problems) - SHOWN
        listed += f"; and {more} more" if more > 0 else ""
        if not unverified:
            _fail(
                f"{file} does not verify, so no report is made from it: {listed}. See "
                f"'sluicegate meter verify {file} --policy {policy}'; --unverified reports "
                "from it anyway",
                1,
            )
        typer.secho(
            f"warning: {file} does not verify ({checked.summary()}): {listed}",
            fg=typer.colors.YELLOW,
            err=True,
        )
    settlement = settle(checked.records, loaded, from_ms=from_ms, to_ms=to_ms)
    try:
        invoices = None
        if prices is not None:
            from sluicegate.metering.prices import invoices as make_invoices
            from sluicegate.metering.prices import load_prices

            invoices = make_invoices(settlement, load_prices(prices), _by(by or "owner"))
        if fmt == "json":
            text = render.as_json(settlement, totals_by, invoices, checked.ok)
        elif fmt == "csv":
            text = render.as_csv(settlement, totals_by, invoices)
        else:
            said = f"verified: {len(checked.records)} records" if checked.ok else "NOT VERIFIED"
            text = render.as_table(settlement, totals_by, invoices, said)
        if plot is not None:  # first: a plot that cannot be drawn leaves no report half made
            from sluicegate.metering.plot import write_plot

            write_plot(settlement, totals_by, plot)
        if out is not None:
            write_atomic(out, text.encode("utf-8"))
        else:
            typer.echo(text, nl=False)
    except SluicegateError as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"cannot write {exc.filename}: {exc.strerror}")
    for path in (out, plot):
        if path is not None:
            typer.echo(f"wrote {path}", err=True)


@meter_app.command()
def export(
    broker: Annotated[str, typer.Option(help="The broker's HTTP API, e.g. http://broker:8780.")],
    token_file: Annotated[Path, typer.Option(help="A file holding a viewer's console token.")],
    from_: Annotated[str, typer.Option("--from", help="Start: unix seconds or ISO 8601.")],
    to: Annotated[str, typer.Option("--to", help="End: unix seconds or ISO 8601.")],
    out: Annotated[Path, typer.Option(help="The export to write (JSON lines).")],
    policy: Annotated[
        Path | None, typer.Option("--policy", "-p", help="Verify it with this policy too.")
    ] = None,
    peer: Annotated[
        str, typer.Option(help="The settlement export with this sister campus instead.")
    ] = "",
) -> None:
    """Fetch the signed export of the usage records of a period from a broker replica
    (with --peer, the records of the jobs between this campus and that sister campus)."""
    from sluicegate.errors import SluicegateError
    from sluicegate.files import write_atomic
    from sluicegate.metering.fetch import fetch_export

    start, end = parse_time(from_, "--from"), parse_time(to, "--to")
    if start > end:
        _fail(f"--from {from_} is after --to {to}")
    token = _read(token_file).decode(errors="replace").strip()
    try:
        body = fetch_export(broker, token or None, start, end, peer=peer)
        write_atomic(out, body)
    except SluicegateError as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"cannot write {out}: {exc.strerror}")
    records = max(0, body.count(b"\n") - 1)
    typer.echo(f"wrote {out}: {records} records, {len(body)} bytes, from {broker}")
    if policy is not None and peer:
        peer_report(out, policy, peer)
    elif policy is not None:
        verify(out, policy)
    elif peer:
        typer.echo(f"check it: sluicegate meter peer-report {out} --policy <policy> --peer {peer}")
    else:
        typer.echo(f"check it: sluicegate meter verify {out} --policy <policy file>")


@meter_app.command("peer-report")
def peer_report(
    file: FileArg,
    policy: PolicyOpt,
    peer: Annotated[str, typer.Option(help="The sister campus the export settles with.")],
    fmt: Annotated[str, typer.Option("--format", help="table or json.")] = "table",
) -> None:
    """Check a settlement export with a sister campus, then what this campus owes it and is
    owed by it, job by job; exit 1 naming every problem when it does not verify.

    Our records by their nodes' keys and our broker's receipt; theirs by the receipt of a
    broker our [peers] entry pins. Each job billed once: the attempt its edge settled."""
    from sluicegate.metering.peering import settle_peer, verify_peer_export
    from sluicegate.metering.render import peer_json, peer_table

    if fmt not in ("table", "json"):
        raise typer.BadParameter(f"{fmt!r}: give table or json", param_hint="--format")
    loaded = _policy(policy)
    if peer not in loaded.peers:
        _fail(f"policy {policy} names no sister campus {peer!r}")
    checked = verify_peer_export(_read(file), loaded, peer)
    for problem in checked.verification.problems:
        typer.echo(f"{file}:{problem}", err=True)
    if not checked.ok:
        typer.echo(checked.verification.summary(), err=True)
        raise typer.Exit(1)
    settlement = settle_peer(checked, loaded, peer)
    typer.echo(peer_json(settlement) if fmt == "json" else peer_table(settlement), nl=False)
