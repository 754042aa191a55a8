"""The ``sluicegate`` command: one entry point, a subcommand per role and tool.

Commands parse flags into settings and call the roles' ``serve``/library functions; they
hold no logic of their own. Heavy imports (OpenCV, ONNX Runtime, paho) happen inside the
commands so ``sluicegate --help`` stays instant. Errors of our own become one clear line
on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from policies.cli import app as policy_app
from sluicegate.app.acl_cli import register as register_acl
from sluicegate.app.console_cli import console_app
from sluicegate.app.models_cli import ModelsDirOpt, models_app
from sluicegate.app.seal_key_cli import register as register_seal_keys
from sluicegate.app.twin_cli import register as register_twin_demo
from sluicegate.deploy.cli import register as register_deploy
from sluicegate.doctor.cli import register as register_doctor
from sluicegate.enroll.cli import ca_app, enroll_app
from sluicegate.errors import EXPECTED
from sluicegate.metering.cli import meter_app
from sluicegate.twin.cli import twin_app

T = TypeVar("T")

app = typer.Typer(
    name="sluicegate",
    help="Edge-to-center broker for industrial machine-vision jobs over MQTT v5.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Help is plain text: "[meter]" or "[line]" in a help string is a word, not markup.
    rich_markup_mode=None,
)
edge_app = typer.Typer(help="The edge agent that runs on a line PC.", no_args_is_help=True)
pool_app = typer.Typer(help="A center pool worker on a GPU/NPU/CPU server.", no_args_is_help=True)
app.add_typer(edge_app, name="edge")
broker_app = typer.Typer(help="The campus broker: fleet state and placement.", no_args_is_help=True)
app.add_typer(pool_app, name="pool")
register_seal_keys(pool_app)  # pool seal-key new|list
app.add_typer(broker_app, name="broker")
app.add_typer(models_app, name="models")  # list, add, bench (sluicegate/app/models_cli.py)
register_acl(policy_app)
app.add_typer(policy_app, name="policy", help="Signed compliance policies.")
app.add_typer(ca_app, name="ca")
app.add_typer(enroll_app, name="enroll")
register_twin_demo(twin_app)
app.add_typer(twin_app, name="twin")
app.add_typer(console_app, name="console")
app.add_typer(meter_app, name="meter")

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="TOML settings file.", exists=False)
]
HostOpt = Annotated[str | None, typer.Option(help="MQTT broker host (overrides config).")]
PortOpt = Annotated[int | None, typer.Option(help="MQTT broker port (overrides config).")]
LogOpt = Annotated[str, typer.Option("--log-level", help="debug, info, warning or error.")]


def _fail(message: str, code: int = 2) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _failed(exc: Exception) -> None:
    """A role that stopped on our own error; another process serving its identity exits
    with its own status, which the systemd units do not restart on."""
    from sluicegate.errors import IdentityInUse
    from sluicegate.identity import EXIT_IN_USE

    _fail(str(exc), EXIT_IN_USE if isinstance(exc, IdentityInUse) else 2)


def _logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def run_until_signal(main: Callable[[asyncio.Event], Coroutine[Any, Any, T]]) -> T:
    """Run ``main(stop)`` on a fresh loop; SIGINT/SIGTERM set ``stop`` for a clean exit.

    What is loaded by now (the libraries, ~90,000 objects) lives as long as the process, so
    it is moved out of the cyclic collector's reach first: otherwise every full collection
    walks all of it, a pause of ~60 ms on a 2-core VM, longer than a placement's 50 ms
    timeout, at moments no one chooses. The loop is uvloop's (libuv): its own turns cost a
    node less CPU per message than asyncio's pure-Python loop."""
    import uvloop

    gc.collect()
    gc.freeze()

    async def runner() -> T:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await main(stop)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as run:
        return run.run(runner())


def _settings(
    config: Path | None, host: str | None, port: int | None, **sections: dict[str, Any]
) -> Any:
    """Settings from ``config``, the environment, then the flags given (None: not given)."""
    from sluicegate.config import load_settings

    return load_settings(config, mqtt={"host": host, "port": port}, **sections)


@edge_app.command("run")
def edge_run(
    config: ConfigOpt = None,
    host: HostOpt = None,
    port: PortOpt = None,
    edge_id: Annotated[str | None, typer.Option("--id", help="Edge id (topic level).")] = None,
    zone: Annotated[str | None, typer.Option(help="Zone this line PC is in.")] = None,
    models_dir: ModelsDirOpt = None,
    log_level: LogOpt = "info",
) -> None:
    """Run the edge agent until Ctrl-C / SIGTERM."""
    _logging(log_level)
    try:
        from edge_agent.service import serve

        edge = {"id": edge_id, "zone": zone, "models_dir": models_dir}
        settings = _settings(config, host, port, edge=edge)
        run_until_signal(lambda stop: serve(settings, stop))
    except EXPECTED as exc:
        _failed(exc)


@pool_app.command("run")
def pool_run(
    config: ConfigOpt = None,
    host: HostOpt = None,
    port: PortOpt = None,
    worker_id: Annotated[str | None, typer.Option("--id", help="Worker id (topic level).")] = None,
    zone: Annotated[str | None, typer.Option(help="Zone this worker is in.")] = None,
    device_class: Annotated[
        str | None, typer.Option(help="Declared device class, e.g. nvidia-a100, x86-cpu.")
    ] = None,
    models_dir: ModelsDirOpt = None,
    log_level: LogOpt = "info",
) -> None:
    """Run a center pool worker until Ctrl-C / SIGTERM."""
    _logging(log_level)
    try:
        from center_pool.service import serve

        pool: dict[str, Any] = {"id": worker_id, "zone": zone, "device_class": device_class}
        pool["models_dir"] = models_dir
        settings = _settings(config, host, port, pool=pool)
        run_until_signal(lambda stop: serve(settings, stop))
    except EXPECTED as exc:
        _failed(exc)


@broker_app.command("run")
def broker_run(
    config: ConfigOpt = None,
    host: HostOpt = None,
    port: PortOpt = None,
    broker_id: Annotated[str | None, typer.Option("--id", help="Broker replica id.")] = None,
    redis_url: Annotated[str | None, typer.Option(help="Redis URL (overrides config).")] = None,
    http_port: Annotated[int | None, typer.Option(help="HTTP API port; 0 picks one.")] = None,
    log_level: LogOpt = "info",
) -> None:
    """Run a campus broker replica until Ctrl-C / SIGTERM."""
    _logging(log_level)
    try:
        from broker.run import serve

        cfg = {"id": broker_id, "redis_url": redis_url, "http_port": http_port}
        settings = _settings(config, host, port, broker=cfg)
        run_until_signal(lambda stop: serve(settings, stop))
    except EXPECTED as exc:
        _failed(exc)


@app.command()
def submit(
    image: Annotated[Path, typer.Argument(help="A JPEG or PNG file.")],
    model: Annotated[str, typer.Option(help="Model name, e.g. defect-v1.")],
    edge: Annotated[str, typer.Option(help="Edge agent id to submit to.")] = "edge-1",
    config: ConfigOpt = None,
    host: HostOpt = None,
    port: PortOpt = None,
    deadline_ms: Annotated[float | None, typer.Option(help="Deadline from receipt.")] = None,
    priority: Annotated[int | None, typer.Option(help="0 (lowest) to 9 (highest).")] = None,
    data_class: Annotated[str | None, typer.Option(help="Data class of the image.")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the result.")] = 30.0,
) -> None:
    """Submit one image and print its result as JSON (exit 1 unless status is ok)."""
    try:
        data = image.read_bytes()
    except OSError as exc:
        _fail(f"cannot read {image}: {exc.strerror}")
        return
    try:
        from sluicegate.client import AsyncClient

        settings = _settings(config, host, port)

        async def go() -> str:
            async with AsyncClient(settings.mqtt, edge=edge) as client:
                result = await client.infer(
                    data,
                    model=model,
                    deadline_ms=deadline_ms,
                    priority=priority,
                    data_class=data_class,
                    timeout=timeout,
                )
                return result.model_dump_json(indent=2, exclude_none=True)

        out = asyncio.run(go())
    except EXPECTED as exc:
        _fail(str(exc))
        return
    typer.echo(out)
    if '"status": "ok"' not in out:
        raise typer.Exit(1)


@app.command()
def synth(
    out: Annotated[Path, typer.Argument(help="Where to write the image (.jpg or .png).")],
    label: Annotated[
        str | None, typer.Option(help="ok, scratch, pit or stain (random if omitted).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
) -> None:
    """Write one synthetic 640x480 inspection image, as the demo generates them."""
    import numpy as np

    from sluicegate.vision.synth import LABELS, encode_jpeg, encode_png, generate

    if label is not None and label not in LABELS:
        _fail(f"unknown label {label!r}; choose one of {', '.join(LABELS)}")
    img, truth = generate(np.random.default_rng(seed), label)
    data = encode_png(img) if out.suffix.lower() == ".png" else encode_jpeg(img)
    out.write_bytes(data)
    typer.echo(f"{out}: {truth}, {len(data)} bytes")


@app.command()
def demo(
    rate: Annotated[float, typer.Option(help="Images per second per line (burst: 10x).")] = 10.0,
    seconds: Annotated[float, typer.Option(help="Stop after this long (0: until Ctrl-C).")] = 0.0,
    port: Annotated[int | None, typer.Option(help="Use a Mosquitto already on this port.")] = None,
    redis_port: Annotated[
        int | None, typer.Option(help="Use a Redis already on this port.")
    ] = None,
    open_mode: Annotated[
        bool,
        typer.Option(
            "--open", help="No TLS, certificates or ACL: for debugging only (needed with --port)."
        ),
    ] = False,
) -> None:
    """Full local demo: Mosquitto, Redis, a broker, two edges, two workers, a burst, live.
    Secured as a plant runs it (TLS, a certificate per node and app, the generated ACL)."""
    from sluicegate.app.demo import run_demo

    try:
        code = run_demo(
            rate=rate, seconds=seconds, port=port, redis_port=redis_port, open_mode=open_mode
        )
    except EXPECTED as exc:
        _fail(str(exc))
        return
    raise typer.Exit(code)


@app.command()
def bundle(
    out: Annotated[Path, typer.Option(help="The archive to write, e.g. sluicegate.tar.gz.")],
    python: Annotated[str | None, typer.Option(help="Target Python (default: this one).")] = None,
    platform: Annotated[
        str | None, typer.Option(help="Target manylinux tag (default: this machine's).")
    ] = None,
    models_dir: Annotated[Path | None, typer.Option(help="Folder of models.")] = None,
) -> None:
    """Build an offline install bundle for line PCs with no package registry."""
    from sluicegate.bundle import build_bundle, target
    from sluicegate.vision.runtime import default_models_dir

    try:
        report = build_bundle(
            out,
            target(python, platform),
            models_dir=models_dir or default_models_dir(),
            say=typer.echo,
        )
    except EXPECTED as exc:
        _fail(str(exc))
        return
    typer.echo("\n".join([*report.notes, report.summary()]))


# <role> install / uninstall, config show and --version (sluicegate/deploy/cli.py)
register_deploy(app, {"edge": edge_app, "pool": pool_app, "broker": broker_app})
register_doctor(app)  # doctor, mosquitto config (sluicegate/doctor/cli.py)


def main() -> None:
    """Console-script entry point."""
    app(prog_name="sluicegate")


if __name__ == "__main__":
    main()
