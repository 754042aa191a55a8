"""``sluicegate pool seal-key new|list``: a worker's sealing keys, for its operator.

``new`` makes a key in the worker's state folder (``center_pool.seal_keys``) and prints its
``x25519:`` text, which the compliance officer lists under the worker's ``encryption_keys``;
the running worker switches to it once a policy listing it arrives. ``list`` shows every
key held, which one is current and which the worker's verified policy lists. Neither
talks to the network; the private keys never leave the folder.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from sluicegate.errors import EXPECTED

seal_key_app = typer.Typer(
    help="The keys edges seal this worker's images to (HPKE, X25519).", no_args_is_help=True
)
ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="TOML settings file.")]
StateOpt = Annotated[
    Path | None, typer.Option("--state-dir", help="The worker's state folder (overrides config).")
]


def register(pool_app: typer.Typer) -> None:
    pool_app.add_typer(seal_key_app, name="seal-key")


def _pool(config: Path | None, state_dir: Path | None) -> tuple[str, Path, Path | None]:
    from sluicegate.config import load_settings

    pool = load_settings(config, pool={"state_dir": state_dir}).pool
    if pool.state_dir is None:
        raise typer.BadParameter(
            "the worker has no state folder: set [pool] state_dir or pass --state-dir"
        )
    return pool.id, pool.state_dir, pool.policy_file


@seal_key_app.command("new")
def seal_key_new(config: ConfigOpt = None, state_dir: StateOpt = None) -> None:
    """Make a sealing key; print the text to list in the policy."""
    from center_pool.seal_keys import KeyFolder, folder_of

    worker, state, _ = _pool(config, state_dir)
    made = KeyFolder(folder_of(state)).create(time.time())
    typer.echo(made.key.public_text)
    typer.echo(
        f"made sealing key {made.key_id.hex()} for worker {worker}; list it in the policy as\n"
        f'  [pools.<pool>.encryption_keys]\n  {worker} = [..., "{made.key.public_text}"]',
        err=True,
    )


@seal_key_app.command("list")
def seal_key_list(config: ConfigOpt = None, state_dir: StateOpt = None) -> None:
    """The keys held: id, made, current, listed in the worker's verified policy, text."""
    from center_pool.seal_keys import KeyFolder, folder_of, plan
    from sluicegate.policy_feed import PolicyFeed

    worker, state, policy_file = _pool(config, state_dir)
    try:
        feed = PolicyFeed(node=worker, policy_file=policy_file, state_dir=state)
        feed.load()
    except EXPECTED as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
    policy = feed.current
    entry = policy.worker(worker) if policy is not None else None
    listed = set(entry.seal_keys) if entry is not None else set()
    held = KeyFolder(folder_of(state)).load()
    current = plan(held, listed, now=time.time(), max_ttl_s=0).current
    where = f"policy v{policy.version}" if policy is not None else "no verified policy"
    typer.echo(f"worker {worker}, {len(held)} key(s), against {where}")
    for h in sorted(held, key=lambda h: h.made_at, reverse=True):
        made = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(h.made_at))
        flags = ["current" if h.key_id == current else "", "listed" if h.key_id in listed else ""]
        if h.retired_at is not None:
            flags.append("retired")
        shown = ",".join(f for f in flags if f) or "-"
        typer.echo(f"{h.key_id.hex()}  {made}  {shown:<16} {h.key.public_text}")
