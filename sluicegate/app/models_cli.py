"""``sluicegate models ...``: the models a node serves. ``list`` loads and verifies each
(sha256 against its manifest); ``add`` checks a model someone brings, writes its manifest and
installs it (:mod:`sluicegate.vision.adding`); ``bench`` times every model on every backend
the node has and stores the figures as its service-time priors. Thin: flags in, library
calls, one clear line on error (exit 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sluicegate.errors import EXPECTED, ConfigError

models_app = typer.Typer(help="The ONNX models shipped in models/.", no_args_is_help=True)

ModelsDirOpt = Annotated[Path | None, typer.Option(help="Folder of models (overrides config).")]


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


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
