"""``sluicegate console user|token``: the people and tools that may use the broker's console,
written to its users file (``[console] users_file``). Passwords are stored as scrypt hashes
and tokens as their SHA-256; a token is printed once, when it is made. The broker reads
the file at start.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from broker.console.auth import ROLES, Role, add_entry, hash_password, new_token, token_digest

console_app = typer.Typer(
    help="Who may use the broker's console (viewers and operators).", no_args_is_help=True
)
MIN_PASSWORD = 12


def _role(value: str) -> Role:
    for role in ROLES:
        if value == role:
            return role
    raise typer.BadParameter(f"{value!r}: a role is viewer or operator")


@console_app.command()
def user(
    file: Annotated[Path, typer.Option(help="The console's users file (TOML).")],
    name: Annotated[str, typer.Option(help="Who logs in.")],
    role: Annotated[str, typer.Option(help="viewer or operator.")] = "viewer",
    password_stdin: Annotated[
        bool, typer.Option(help="Read the password from standard input, not a prompt.")
    ] = False,
) -> None:
    """Add a person (or change their password or role): they log in on /console/login."""
    chosen = _role(role)
    if password_stdin:
        password = sys.stdin.readline().rstrip("\n")
    else:
        password = typer.prompt("password", hide_input=True, confirmation_prompt=True)
    if len(password) < MIN_PASSWORD:
        typer.echo(f"error: a password needs at least {MIN_PASSWORD} characters", err=True)
        raise typer.Exit(2)
    add_entry(file, "user", name, chosen, hash_password(password))
    typer.echo(f"{name} ({chosen}) written to {file}; restart the broker to take it in")


@console_app.command()
def token(
    file: Annotated[Path, typer.Option(help="The console's users file (TOML).")],
    name: Annotated[str, typer.Option(help="What uses it (a script, Grafana, CI).")],
    role: Annotated[str, typer.Option(help="viewer or operator.")] = "viewer",
) -> None:
    """Make a bearer token (Authorization: Bearer <token>) and print it once."""
    chosen = _role(role)
    made = new_token()
    add_entry(file, "token", name, chosen, token_digest(made))
    typer.echo(made)
    typer.echo(f"token {name!r} ({chosen}) written to {file}; restart the broker", err=True)
