"""``sluicegate doctor``, ``sluicegate mosquitto config`` and ``sluicegate mosquitto bridge``:
thin shells over :func:`sluicegate.doctor.run.diagnose`,
:func:`sluicegate.mosquitto.plant_config` and :func:`sluicegate.mosquitto.bridge_lines`.

Doctor exits 0 when every check passed (warnings included), 1 when one failed and 2 on a
usage error of ours, and prints one line per check. The Mosquitto configuration is the one
doctor's Nagle check asks for. Heavy imports happen inside the commands.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sluicegate.deploy.layout import ROLES, check_role, node_paths
from sluicegate.errors import ConfigError

mosquitto_app = typer.Typer(help="The campus's Mosquitto.", no_args_is_help=True)


def _usage(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def doctor(
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            "-c",
            help="The node's TOML settings (default: /etc/sluicegate/<role>.toml if there).",
        ),
    ] = None,
    role: Annotated[
        str | None, typer.Option(help="edge, pool or broker (default: from the config file).")
    ] = None,
    broker_url: Annotated[
        str | None,
        typer.Option(
            help="A broker replica's HTTP API, for the clock check (default: the broker_url "
            "of the node's enrollment.json)."
        ),
    ] = None,
) -> None:
    """Check that this node can serve, one line per check; exit 1 if one fails.

    Config, identity, MQTT, TLS, clock, policy, models, state folder, Mosquitto's round trip.
    """
    import logging

    from sluicegate.doctor.run import diagnose, infer_role

    logging.basicConfig(level=logging.ERROR)  # the checks say what went wrong themselves
    if role is None:
        found = infer_role(config)
        if found is None:
            if config is not None and not config.is_file():
                _usage(f"config file {config} does not exist")
            where = f"{config}'s sections" if config is not None else "no --config"
            _usage(f"cannot tell the role from {where}; pass --role {'|'.join(ROLES)}")
            return
        chosen = found
    else:
        try:
            chosen = check_role(role)
        except ConfigError as exc:
            _usage(str(exc))
            return
    if broker_url is not None and not broker_url.startswith(("http://", "https://")):
        _usage(f"--broker-url {broker_url!r} is not an http:// or https:// URL")
    if config is None:
        installed = node_paths(chosen, Path("/")).config
        config = installed if installed.is_file() else None
    report = diagnose(config, chosen, broker_url=broker_url)
    typer.echo(report.text(), nl=False)
    raise typer.Exit(report.exit_code)


@mosquitto_app.command("config")
def mosquitto_config(
    ca: Annotated[Path, typer.Option("--ca", help="The campus CA certificate (ca.pem).")],
    cert: Annotated[Path, typer.Option("--cert", help="Mosquitto's server certificate.")],
    key: Annotated[Path, typer.Option("--key", help="Its private key (readable by Mosquitto).")],
    acl: Annotated[Path, typer.Option("--acl", help="The ACL of 'sluicegate policy acl'.")],
    port: Annotated[int, typer.Option(min=1, max=65535, help="The TLS listener's port.")] = 8883,
    bind: Annotated[str, typer.Option(help="The address it listens on.")] = "0.0.0.0",
    persistence_dir: Annotated[
        Path, typer.Option(help="Where Mosquitto keeps sessions and retained messages.")
    ] = Path("/var/lib/mosquitto"),
    user: Annotated[
        str, typer.Option(help="The user Mosquitto runs as once started (as root).")
    ] = "mosquitto",
    out: Annotated[Path | None, typer.Option(help="Write here instead of stdout.")] = None,
) -> None:
    """Print the mosquitto.conf a campus needs: TLS with client certificates required, each
    identity its username and client id, no anonymous clients, the ACL, set_tcp_nodelay,
    the user it runs as, logs to stderr (the journal)."""
    from sluicegate.mosquitto import ListenerTls, plant_config

    for flag, path in (("--ca", ca), ("--cert", cert), ("--key", key), ("--acl", acl)):
        if not path.is_file():
            _usage(f"{flag} {path} is not a file")
    tls = ListenerTls(ca.resolve(), cert.resolve(), key.resolve(), acl.resolve())
    text = plant_config(
        tls, port=port, bind=bind, persistence_dir=persistence_dir.resolve(), user=user
    )
    if out is None:
        typer.echo(text, nl=False)
        return
    out.write_text(text, encoding="utf-8")
    typer.echo(f"wrote {out}")


@mosquitto_app.command("bridge")
def mosquitto_bridge(
    policy: Annotated[Path, typer.Option(help="This campus's policy, which lists the peer.")],
    peer: Annotated[str, typer.Option(help="The sister campus, as [peers] names it.")],
    address: Annotated[str, typer.Option(help="Its Mosquitto, host:port.")],
    peer_ca: Annotated[Path, typer.Option(help="The sister campus's CA certificate.")],
    cert: Annotated[Path, typer.Option(help="Our bridge's certificate, from the peer's CA.")],
    key: Annotated[Path, typer.Option(help="Its private key (readable by Mosquitto).")],
    mqtt5: Annotated[
        bool, typer.Option(help="Bridge with MQTT v5 (both Mosquittos 2.0.14 or later).")
    ] = False,
    pull: Annotated[
        bool,
        typer.Option(
            "--pull/--both-ways",
            help="Only what the peer says to us comes in; the peer runs the mirror bridge.",
        ),
    ] = True,
    out: Annotated[Path | None, typer.Option(help="Write here instead of stdout.")] = None,
) -> None:
    """Print the bridge from this campus's Mosquitto to a sister campus's, to append to
    mosquitto.conf: TLS 1.3 with the peer's CA, the certificate it issued to our bridge
    ('ca issue --role bridge --node peer.<our campus>' on its side), and only the
    inter-campus trees of the pair. By default it pulls what the peer says to this campus,
    and each side runs one: every message then crosses on a connection its sender's
    Mosquitto accepted, with set_tcp_nodelay (Mosquitto 2.0.11 leaves Nagle on for a
    bridge's own connection: up to 40 ms a message). --both-ways carries both trees on one
    bridge, which only one side runs."""
    from policies.errors import PolicyError
    from policies.loader import load_policy
    from sluicegate.mosquitto import BridgeTls, bridge_lines

    for flag, path in (("--peer-ca", peer_ca), ("--cert", cert), ("--key", key)):
        if not path.is_file():
            _usage(f"{flag} {path} is not a file")
    try:
        campus = load_policy(policy)
    except PolicyError as exc:
        _usage(f"--policy {policy}: {exc}")
        return
    if peer not in campus.peers:
        listed = ", ".join(sorted(campus.peers)) or "none"
        _usage(f"--peer {peer!r}: policy v{campus.version} does not list it ([peers]: {listed})")
    tls = BridgeTls(peer_ca.resolve(), cert.resolve(), key.resolve())
    protocol = "mqttv50" if mqtt5 else "mqttv311"
    lines = [
        f"# The bridge from {campus.campus} to sister campus {peer}, written by "
        "'sluicegate mosquitto bridge'.",
        *bridge_lines(campus.campus, peer, address, tls, protocol=protocol, pull=pull),
    ]
    text = "\n".join(lines) + "\n"
    if out is None:
        typer.echo(text, nl=False)
        return
    out.write_text(text, encoding="utf-8")
    typer.echo(f"wrote {out}")


def register(app: typer.Typer) -> None:
    """Add ``doctor`` and ``mosquitto config|bridge`` to ``app``."""
    app.command()(doctor)
    app.add_typer(mosquitto_app, name="mosquitto")
