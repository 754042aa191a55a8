"""``sluicegate twin synth``: a trace of the demo campus without running it. It lives in the
composition root, beside the demo, since it writes the demo campus's policy and nodes
(``sluicegate.app.twin_demo``); the other ``twin`` commands are ``sluicegate.twin.cli``'s."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(twin_app: typer.Typer) -> None:
    @twin_app.command("synth")
    def synth(
        out: Annotated[Path, typer.Option(help="The trace to write.")],
        seconds: Annotated[float, typer.Option(help="Length of the trace.")] = 600.0,
        rate: Annotated[float, typer.Option(help="Images/s per line outside bursts.")] = 10.0,
        burst_every: Annotated[
            float, typer.Option(help="Line 1 bursts to 10x this often, s (0: never).")
        ] = 60.0,
        burst_for: Annotated[float, typer.Option(help="How long each burst lasts, s.")] = 10.0,
        seed: Annotated[int, typer.Option(help="The traffic's random seed.")] = 2026,
        sister: Annotated[
            Path | None,
            typer.Option(
                help="Also write here a candidate policy agreeing with a sister campus "
                "(north/policy.toml) and its --peer file (south-site.toml)."
            ),
        ] = None,
        sister_jobs_per_s: Annotated[
            float, typer.Option(help="The agreement's limit, both halves, jobs/s.")
        ] = 500.0,
    ) -> None:
        """Write a trace of the demo campus's traffic without running it (arrivals only; the
        nodes' measured figures give every time). For rehearsals at sizes nobody records."""
        from sluicegate.app.twin_demo import demo_trace, write_sister
        from sluicegate.twin.trace import write

        if (
            not seconds > 0
            or not rate > 0
            or burst_every < 0
            or not burst_for > 0
            or not sister_jobs_per_s > 0
        ):
            typer.secho(
                "error: --seconds, --rate, --burst-for and --sister-jobs-per-s are > 0, "
                "--burst-every >= 0",
                fg=typer.colors.RED,
                err=True,
            )
            raise typer.Exit(2)
        bursts: tuple[tuple[float, float], ...] = ()
        if burst_every > 0:
            n = int(seconds // burst_every)
            bursts = tuple((k * burst_every + burst_every / 3, burst_for) for k in range(n))
        trace = demo_trace(seconds, rate=rate, bursts=bursts, seed=seed)
        digest = write(out, trace)
        typer.echo(f"{out}: {len(trace.jobs)} jobs over {seconds:g} s, sha256 {digest}")
        if sister is not None:
            policy, peer = write_sister(sister, max_jobs_per_s=sister_jobs_per_s)
            typer.echo(f"{policy}: the demo campus's policy agreeing with south-site")
            typer.echo(f"{peer}: south-site for --peer (its policy, two workers lent, 10 ms)")
