"""``sluicegate policy acl``: the campus's Mosquitto ACL, written from a policy file. It
lives here, not in ``policies/``, because the ACL is built from Sluicegate's topics
(``sluicegate.acl``); the policy library knows nothing of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from policies import load_policy
from policies.errors import PolicyError
from sluicegate.acl import render_acl


def register(policy_app: typer.Typer) -> None:
    """Add the ``acl`` command to the ``policy`` group."""

    @policy_app.command()
    def acl(
        policy_file: Annotated[
            Path, typer.Argument(help="Policy file (TOML).", show_default=False)
        ],
        out: Annotated[Path | None, typer.Option(help="Write here instead of stdout.")] = None,
        observer: Annotated[
            list[str] | None,
            typer.Option(
                help="A monitoring identity (or the twin's recorder) that may read status, "
                "telemetry, the edges' job records, completions and the policy."
            ),
        ] = None,
    ) -> None:
        """Write the Mosquitto ACL of the campus: each node writes only its own topics,
        workers read only their zone's work topics, apps submit only to their edges."""
        try:
            text = render_acl(load_policy(policy_file), observers=observer or ())
        except PolicyError as exc:
            typer.echo(f"error [{exc.reason}]: {exc}", err=True)
            raise typer.Exit(1) from exc
        if out is None:
            typer.echo(text, nl=False)
        else:
            out.write_text(text, encoding="utf-8")
            typer.echo(f"wrote {out}")
