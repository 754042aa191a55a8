"""The commands that install a node and show how it is configured.

``sluicegate <role> install`` / ``uninstall`` for each role, ``sluicegate config show`` and
``sluicegate --version``, added to the main command by :func:`register`. They parse flags
and call :mod:`sluicegate.deploy.installer` and :mod:`sluicegate.config_show`, holding no
logic of their own; our errors become one line on stderr and exit status 2.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from sluicegate.deploy.layout import Role
from sluicegate.errors import EnrollmentRefused, SluicegateError

if TYPE_CHECKING:
    from sluicegate.deploy.configs import NodeValues

RootOpt = Annotated[
    Path,
    typer.Option(help="Install under this folder instead of / (nothing is run then)."),
]
IdOpt = Annotated[str | None, typer.Option("--id", help="The node's id (a topic level).")]
ZoneOpt = Annotated[str | None, typer.Option(help="The zone the node is in.")]
MqttHostOpt = Annotated[
    str | None, typer.Option(help="The plant's MQTT broker host (default: 127.0.0.1).")
]
MqttPortOpt = Annotated[
    int | None, typer.Option(help="Its port (default: 8883, or 1883 with --plaintext).")
]
ModelsOpt = Annotated[
    Path | None,
    typer.Option(help="Folder of ONNX models (default: the models that ship with Sluicegate)."),
]
ExecOpt = Annotated[
    Path | None,
    typer.Option(
        "--exec", help="The sluicegate the unit runs (default: the one beside this Python)."
    ),
]
DeviceOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--device",
        help="A device the service may open, e.g. /dev/video0, /dev/nvidia* (repeatable).",
    ),
]
PlaintextOpt = Annotated[
    bool,
    typer.Option("--plaintext", help="MQTT without TLS: for debugging on a trusted machine only."),
]
JoinOpt = Annotated[
    str | None,
    typer.Option(
        "--join",
        help="A join token ('sluicegate enroll token'): make this node's key here, get its "
        "certificate and the campus CA, pin the policy; id, zone and MQTT come from it.",
    ),
]
PurgeOpt = Annotated[
    bool, typer.Option(help="Also delete the state folder: the outbox and the node's key.")
]


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _root(root: Path) -> Path:
    return Path(os.path.abspath(root))


def _install(
    role: Role,
    root: Path,
    values: NodeValues,
    exec_path: Path | None,
    devices: list[str] | None,
    join: str | None = None,
) -> None:
    from sluicegate.deploy.installer import install

    try:
        if join is not None:
            values = _enroll(role, _root(root), values, join)
        report = install(role, _root(root), values, executable=exec_path, devices=devices or ())
    except SluicegateError as exc:  # an EnrollmentRefused's text carries its code
        _fail(str(exc))
        return
    for line in report.lines():
        typer.echo(line)


def _enroll(role: Role, root: Path, values: NodeValues, token: str) -> NodeValues:
    """Enroll the node into its state folder; the values its config gets from the token."""
    import dataclasses
    import time

    from sluicegate.deploy.installer import prepare_state_dir
    from sluicegate.enroll.client import enroll
    from sluicegate.enroll.token import parse_token

    claims, _secret = parse_token(token)  # checked before the token is spent
    for given, name, what in (
        (values.id, claims.node, "--id"),
        (values.zone, claims.zone, "--zone"),
    ):
        if role == "broker" and what == "--zone":
            continue
        if given is not None and given != name:
            raise EnrollmentRefused(
                "join.wrong_scope",
                f"{what} {given!r} disagrees with the join token's {name!r}: the token is for "
                f"{claims.role} {claims.node} in {claims.zone}; use the token made for this "
                f"node, or leave {what} out (it comes from the token)",
            )
    state = prepare_state_dir(role, root)
    done = enroll(token, state, role=role, now=time.time())
    how = "enrolled" if done.fresh else "already enrolled"
    typer.echo(f"{how} as {role} {done.node} in {done.zone}; its key {done.key}")
    return dataclasses.replace(
        values,
        id=done.node,
        zone=None if role == "broker" else done.zone,
        mqtt_host=values.mqtt_host or done.mqtt_host,
        mqtt_port=values.mqtt_port or done.mqtt_port,
        plaintext=False,
    )


def _install_command(role: Role) -> Callable[..., None]:
    def install_node(
        root: RootOpt = Path("/"),
        node_id: IdOpt = None,
        zone: ZoneOpt = None,
        mqtt_host: MqttHostOpt = None,
        mqtt_port: MqttPortOpt = None,
        models_dir: ModelsOpt = None,
        exec_path: ExecOpt = None,
        device: DeviceOpt = None,
        plaintext: PlaintextOpt = False,
        join: JoinOpt = None,
    ) -> None:
        from sluicegate.deploy.configs import NodeValues

        values = NodeValues(node_id, zone, mqtt_host, mqtt_port, models_dir, plaintext)
        _install(role, root, values, exec_path, device, join)

    def install_broker(
        root: RootOpt = Path("/"),
        node_id: IdOpt = None,
        mqtt_host: MqttHostOpt = None,
        mqtt_port: MqttPortOpt = None,
        models_dir: ModelsOpt = None,
        exec_path: ExecOpt = None,
        device: DeviceOpt = None,
        plaintext: PlaintextOpt = False,
        join: JoinOpt = None,
    ) -> None:
        from sluicegate.deploy.configs import NodeValues

        values = NodeValues(node_id, None, mqtt_host, mqtt_port, models_dir, plaintext)
        _install(role, root, values, exec_path, device, join)

    command = install_broker if role == "broker" else install_node  # a broker has no zone
    command.__doc__ = (
        f"Install the {role} as a hardened systemd service: its config in /etc/sluicegate, "
        f"its unit, its system user and its state folder /var/lib/sluicegate/{role}. "
        "Safe to run again (an upgrade); it never starts the service."
    )
    return command


def _uninstall_command(role: Role) -> Callable[..., None]:
    def uninstall_node(root: RootOpt = Path("/"), purge: PurgeOpt = False) -> None:
        from sluicegate.deploy.installer import uninstall

        try:
            report = uninstall(role, _root(root), purge=purge)
        except SluicegateError as exc:
            _fail(str(exc))
            return
        for line in report.lines():
            typer.echo(line)

    uninstall_node.__doc__ = (
        f"Remove the {role}'s service, config and system user entry; its state folder "
        "(the outbox) stays unless --purge."
    )
    return uninstall_node


def config_show(
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="TOML settings file.")
    ] = None,
    role: Annotated[str, typer.Option(help="edge, pool, broker or all.")] = "all",
) -> None:
    """Print the settings in effect, each with where it came from (default, the file, or
    an environment variable); secrets masked."""
    from sluicegate.config_show import effective, render

    try:
        text = render(effective(config, role), config)
    except SluicegateError as exc:
        _fail(str(exc))
        return
    typer.echo(text, nl=False)


def _print_version(value: bool) -> None:
    if not value:
        return
    from importlib import metadata

    try:
        version = metadata.version("sluicegate")
    except metadata.PackageNotFoundError:
        from sluicegate import __version__ as version
    typer.echo(f"sluicegate {version}")
    raise typer.Exit()


def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version."
        ),
    ] = False,
) -> None:
    pass


def register(app: typer.Typer, roles: dict[Role, typer.Typer]) -> None:
    """Add ``install``/``uninstall`` to each role's command group, ``config show`` and
    ``--version`` to ``app``."""
    for role, group in roles.items():
        group.command("install")(_install_command(role))
        group.command("uninstall")(_uninstall_command(role))
    config_app = typer.Typer(help="A node's configuration.", no_args_is_help=True)
    config_app.command("show")(config_show)
    app.add_typer(config_app, name="config")
    app.callback()(_options)
