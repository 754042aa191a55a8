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
from sluicegate.app.seal_key_cli import register as register_seal_keys
from sluicegate.app.twin_cli import register as register_twin_demo
from sluicegate.deploy.cli import register as register_deploy
from sluicegate.doctor.cli import register as register_doctor
from sluicegate.enroll.cli import ca_app, enroll_app
from sluicegate.errors import EXPECTED, ConfigError
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
models_app = typer.Typer(help="The ONNX models shipped in models/.", no_args_is_help=True)
pool_app = typer.Typer(help="A center pool worker on a GPU/NPU/CPU server.", no_args_is_help=True)
app.add_typer(edge_app, name="edge")
broker_app = typer.Typer(help="The campus broker: fleet state and placement.", no_args_is_help=True)
app.add_typer(pool_app, name="pool")
register_seal_keys(pool_app)  # pool seal-key new|list
app.add_typer(broker_app, name="broker")
app.add_typer(models_app, name="models")
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
ModelsDirOpt = Annotated[Path | None, typer.Option(help="Folder of models (overrides config).")]


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
    timeout, at moments no one chooses."""
    gc.collect()
    gc.freeze()

    async def runner() -> T:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await main(stop)

    return asyncio.run(runner())


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


@models_app.command("list")
def models_list(
    models_dir: Annotated[Path | None, typer.Option(help="Folder of models.")] = None,
) -> None:
    """Load and verify every model (sha256 against its manifest) and list them."""
    from sluicegate.vision.runtime import ModelRegistry, default_models_dir

    try:
        registry = ModelRegistry.from_dir(models_dir or default_models_dir())
    except EXPECTED as exc:
        _fail(str(exc))
        return
    from sluicegate.vision.openvino_session import backend_of

    for name in registry.names():
        model = registry.get(name)
        m = model.manifest
        post = m.postprocess
        layout = getattr(post, "layout", None)
        kind = f"{post.kind} ({layout})" if layout else post.kind
        typer.echo(
            f"{m.name} v{m.version}  {kind}  input {m.input.shape} "
            f"{m.input.color_order}  labels {', '.join(m.labels)}  sha256 {m.sha256[:16]}…  "
            f"{backend_of(model.session.get_providers()[0])}  verified"
        )


def _triple(text: str | None, flag: str) -> tuple[float, float, float] | None:
    """Three numbers given as ``a,b,c``; a ConfigError naming ``flag`` otherwise."""
    if text is None:
        return None
    try:
        a, b, c = (float(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(
            f"{flag} {text!r}: give three numbers, one per channel: 0.5,0.5,0.5"
        ) from None
    return a, b, c


@models_app.command("add")
def models_add(
    model: Annotated[Path, typer.Argument(help="The .onnx file to serve.")],
    kind: Annotated[
        str, typer.Option(help="classification, yolov8 (v8/v11), yolov5, yolox, nms or anomaly.")
    ],
    name: Annotated[str | None, typer.Option(help="Model name (default: the file's).")] = None,
    version: Annotated[str, typer.Option(help="Its version.")] = "1.0.0",
    labels: Annotated[
        Path | None,
        typer.Option(help="One label per line (default: the names in the export's metadata)."),
    ] = None,
    size: Annotated[
        str | None, typer.Option(help="WIDTHxHEIGHT, for a graph whose input size is open.")
    ] = None,
    bgr: Annotated[
        bool | None,
        typer.Option(
            "--bgr/--rgb",
            help="The colour order the model takes (default RGB, or the replaced manifest's); "
            "the default mean and std follow it.",
        ),
    ] = None,
    scale: Annotated[
        float | None,
        typer.Option(help="Pixel scale before mean and std: 1 for raw 0-255 (default 1/255)."),
    ] = None,
    mean: Annotated[
        str | None, typer.Option(help="Per-channel mean, in the input's order: 0.5,0.5,0.5.")
    ] = None,
    std: Annotated[
        str | None, typer.Option(help="Per-channel std, in the input's order: 0.5,0.5,0.5.")
    ] = None,
    score_threshold: Annotated[
        float | None, typer.Option(help="A detector's lowest score reported (default 0.25).")
    ] = None,
    sample: Annotated[
        Path | None, typer.Option(help="An image to run it on once (default: a synthetic one).")
    ] = None,
    models_dir: ModelsDirOpt = None,
    replace: Annotated[
        bool,
        typer.Option(
            help="Serve it in place of a model of that name, keeping what its manifest was "
            "given (preprocessing, colour order, score threshold) unless given again."
        ),
    ] = False,
) -> None:
    """Check a model you bring, write its manifest (with its sha256), run it once, and
    install it in the models folder."""
    from sluicegate.vision.adding import add_model, read_labels
    from sluicegate.vision.author import KINDS, Authoring
    from sluicegate.vision.runtime import default_models_dir

    if kind not in KINDS:
        _fail(f"--kind {kind!r}: expected one of {', '.join(KINDS)}")
    try:
        wanted = _size(size)
        how = Authoring(
            name=name or model.stem.lower(),
            version=version,
            file="",
            sha256="",
            kind=kind,  # type: ignore[arg-type]
            labels=read_labels(labels) if labels is not None else (),
            size=wanted,
            color_order=None if bgr is None else "BGR" if bgr else "RGB",
            scale=scale,
            mean=_triple(mean, "--mean"),
            std=_triple(std, "--std"),
            score_threshold=score_threshold,
        )
        image = sample.read_bytes() if sample is not None else None
        added = add_model(
            model, models_dir or default_models_dir(), how, sample=image, replace_existing=replace
        )
    except FAILURES as exc:
        _fail(_said(exc))
        return
    m, out = added.manifest, added.outputs
    if kind == "classification":
        found = f"label {out.label}"
    elif kind == "anomaly":
        found = f"label {out.label}, {len(out.regions)} region(s)"
    else:
        found = f"{len(out.detections)} detection(s)"
    typer.echo(
        f"added {m.name} v{m.version} ({kind}, input {m.input.width}x{m.input.height}, "
        f"{len(m.labels)} labels, sha256 {m.sha256[:16]}…) as {added.manifest_path}; "
        f"sample image: {found} in {added.run_ms:.1f} ms"
    )
    if added.kept:
        typer.echo(f"kept from the manifest it replaced: {', '.join(added.kept)}")


@models_app.command("bench")
def models_bench(
    models_dir: ModelsDirOpt = None,
    providers: Annotated[
        str | None,
        typer.Option(
            help="Backends to time, comma-separated (default: CPUExecutionProvider, and "
            "OpenVINO/CPU where the openvino extra is installed)."
        ),
    ] = None,
    batch: Annotated[int, typer.Option(help="The largest batch to time.")] = 8,
    runs: Annotated[int, typer.Option(help="Timed runs of one image per model.")] = 30,
    out: Annotated[
        Path | None, typer.Option(help="Where the priors go (default: in the models folder).")
    ] = None,
) -> None:
    """Time every model on every backend this node has (one image, and one largest batch)
    and store the figures as the node's service-time priors."""
    from sluicegate.vision.openvino_session import OPENVINO, openvino_devices
    from sluicegate.vision.priors import PRIORS_FILE, measure, write_priors
    from sluicegate.vision.runtime import ModelRegistry, default_models_dir

    folder = models_dir or default_models_dir()
    chosen = (
        [p.strip() for p in providers.split(",") if p.strip()]
        if providers
        else ["CPUExecutionProvider"] + ([OPENVINO + "CPU"] if "CPU" in openvino_devices() else [])
    )
    found = []
    try:
        for provider in chosen:
            registry = ModelRegistry.from_dir(folder, providers=[provider])
            found += measure(registry, batch=batch, runs=runs)
        target = out or folder / PRIORS_FILE
        write_priors(target, found)
    except FAILURES as exc:
        _fail(_said(exc))
        return
    typer.echo(f"{'model':<16} {'backend':<34} {'image ms':>9} {'batch':>6} {'batch ms':>9}")
    for p in found:
        typer.echo(
            f"{p.model:<16} {p.backend:<34} {p.image_ms:9.2f} {p.batch:6d} {p.batch_ms:9.2f}"
        )
    typer.echo(f"priors written to {target}")


FAILURES: tuple[type[Exception], ...] = (*EXPECTED, OSError)  # what a models command reports


def _said(exc: BaseException) -> str:
    """An error raised on purpose, or one of the file system's, in words."""
    if isinstance(exc, OSError) and not isinstance(exc, EXPECTED):
        return f"{exc.filename}: {exc.strerror}"
    return str(exc)


def _size(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    width, sep, height = text.lower().partition("x")
    if not (sep and width.isdigit() and height.isdigit() and int(width) > 0 and int(height) > 0):
        raise ConfigError(f"--size {text!r}: expected WIDTHxHEIGHT, e.g. 640x640")
    return int(width), int(height)


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
