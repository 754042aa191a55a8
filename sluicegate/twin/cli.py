"""``sluicegate twin``: the digital twin's commands, thin shells over ``sluicegate.twin``.

Heavy imports (paho, the broker's core) happen inside the commands; an error of ours is one
line on stderr and exit status 2.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import Annotated

import typer

twin_app = typer.Typer(
    help="The digital twin: record a campus, replay changes, gate rollouts.", no_args_is_help=True
)


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


async def _say_when(ready: asyncio.Event, seconds: float | None) -> None:
    await ready.wait()
    until = f"for {seconds:g} s" if seconds is not None else "until Ctrl-C"
    typer.echo(f"recording {until} …", err=True)


@twin_app.command("record")
def record(
    config: Annotated[
        Path, typer.Option("--config", "-c", help="TOML settings: the observer's mqtt section.")
    ],
    out: Annotated[Path, typer.Option(help="The trace to write, e.g. trace.jsonl.gz.")],
    seconds: Annotated[
        float | None, typer.Option(help="Record this long (default: until Ctrl-C / SIGTERM).")
    ] = None,
    interval: Annotated[
        float | None,
        typer.Option(help="The nodes' telemetry interval, s (default: measured)."),
    ] = None,
    policy: Annotated[
        Path | None,
        typer.Option(help="The policy file to record if none arrives on the policy topic."),
    ] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "warning",
) -> None:
    """Record a running campus as a trace, listening as an observer.

    Each job's arrival and outcome, the nodes' telemetry and status, the policy and the
    fleet, until --seconds are up or Ctrl-C."""
    from sluicegate.config import load_settings
    from sluicegate.errors import EXPECTED
    from sluicegate.twin.record import Recorded
    from sluicegate.twin.record import record as run_recorder

    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for name, value in (("--seconds", seconds), ("--interval", interval)):
        if value is not None and not value > 0:
            _fail(f"{name} {value:g}: expected a number of seconds > 0")

    async def main() -> Recorded:
        stop, ready = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        policy_text = policy.read_text() if policy is not None else None
        recording = run_recorder(
            load_settings(config).mqtt,
            out,
            stop,
            seconds=seconds,
            telemetry_interval_s=interval,
            policy_text=policy_text,
            ready=ready,
        )
        told = asyncio.ensure_future(_say_when(ready, seconds))
        try:
            return await recording
        finally:
            told.cancel()

    try:
        recorded = asyncio.run(main())
    except EXPECTED as exc:
        _fail(str(exc))
        return
    except OSError as exc:  # the policy file
        _fail(f"{exc.filename}: {exc.strerror}")
        return
    typer.echo(recorded.summary())
