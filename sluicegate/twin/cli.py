"""``sluicegate twin``: the digital twin's commands, thin shells over ``sluicegate.twin``.

Heavy imports (paho, the broker's core) happen inside the commands; an error of ours is one
line on stderr and exit status 2.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from sluicegate.twin.nodes import Change

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


TraceOption = Annotated[Path, typer.Option("--trace", "-t", help="A trace (twin record).")]
PolicyOption = Annotated[
    Path | None, typer.Option(help="A candidate policy (TOML) to replay under.")
]
ParamsOption = Annotated[Path | None, typer.Option(help="Candidate placement parameters (TOML).")]
FleetOption = Annotated[
    Path | None,
    typer.Option(help="A fleet change (TOML: remove = [...], [degrade], [[add]])."),
]
BurstOption = Annotated[int, typer.Option(help="Each arrival this many times (2, 5, 10).")]
FailOption = Annotated[
    list[str] | None, typer.Option(help="A worker lost at a moment: worker@seconds.")
]
PeerOption = Annotated[
    list[Path] | None,
    typer.Option(help="A sister campus to rehearse with (TOML: its policy, workers, link)."),
]
CutOption = Annotated[
    list[str] | None,
    typer.Option(help="The link to a sister campus cut: campus@seconds+seconds."),
]
SeedOption = Annotated[int, typer.Option(help="The seed of the times drawn.")]


def _change(
    policy: Path | None,
    params: Path | None,
    fleet: Path | None,
    burst: int,
    fail: list[str] | None,
    strategy: str,
    peer: list[Path] | None = None,
    cut: list[str] | None = None,
) -> Change:
    from sluicegate.twin.rehearse import build_change

    return build_change(
        policy=policy,
        params=params,
        fleet=fleet,
        burst=burst,
        fail=fail or [],
        strategy=strategy,
        peers=peer,
        cuts=cut,
    )


@twin_app.command("run")
def run(
    trace: TraceOption,
    policy: PolicyOption = None,
    params: ParamsOption = None,
    fleet: FleetOption = None,
    burst: BurstOption = 1,
    fail: FailOption = None,
    peer: PeerOption = None,
    cut: CutOption = None,
    strategy: Annotated[
        str, typer.Option(help="ours, edge-only, round-robin or least-loaded.")
    ] = "ours",
    strategies: Annotated[
        bool, typer.Option(help="Also compare every placement strategy on the trace.")
    ] = False,
    seed: SeedOption = 0,
    out: Annotated[
        Path | None, typer.Option(help="Write report.json and the PNG plots here.")
    ] = None,
) -> None:
    """Replay a trace as recorded and under a change, through the production decision
    code, and print them side by side."""
    from sluicegate.errors import EXPECTED
    from sluicegate.twin.rehearse import rehearse, write_report

    try:
        change = _change(policy, params, fleet, burst, fail, strategy, peer, cut)
        rehearsal = rehearse(trace, change, seed=seed, strategies=strategies)
        typer.echo(rehearsal.text)
        if out is not None:
            for path in write_report(rehearsal, out):
                typer.echo(f"wrote {path}")
    except EXPECTED as exc:
        _fail(str(exc))


@twin_app.command("verdict")
def verdict(
    trace: TraceOption,
    key: Annotated[Path, typer.Option(help="The twin's signing key (policy keygen).")],
    key_id: Annotated[str, typer.Option(help="Its id in the policy's [rollout] twin_keys.")],
    out: Annotated[Path, typer.Option(help="Where to write the signed verdict.")],
    policy: PolicyOption = None,
    params: ParamsOption = None,
    fleet: FleetOption = None,
    burst: BurstOption = 1,
    fail: FailOption = None,
    peer: PeerOption = None,
    cut: CutOption = None,
    seed: SeedOption = 0,
) -> None:
    """Rehearse a candidate policy or placement parameters on a trace, judge it against
    the thresholds of the policy in force and against the policy in force replayed on the
    same trace under the same conditions, and sign the verdict. Exit status 1 when the
    candidate failed (the verdict, written anyway, says why and what the change moved)."""
    import time

    from policies.keys import load_signing_key
    from sluicegate.errors import EXPECTED
    from sluicegate.twin import judge
    from sluicegate.twin.rehearse import rehearse
    from sluicegate.twin.trace import policy_of

    if (policy is None) == (params is None):
        _fail("give the candidate: --policy FILE or --params FILE (one of them)")
    try:
        change = _change(policy, params, fleet, burst, fail, "ours", peer, cut)
        rehearsal = rehearse(trace, change, seed=seed)
        recorded = rehearsal.trace
        signed = judge.verdict_for(
            judge.candidate_of(change.policy, change.params),
            judge.figures_of(
                rehearsal.judged.candidate,
                recorded,
                rehearsal.judged.baseline,
                rehearsal.judged.moves,
            ),
            judge.thresholds_of(policy_of(recorded.header)),
            trace_sha256=rehearsal.trace_digest,
            key=load_signing_key(key),
            key_id=key_id,
            issued_at=time.time(),
            conditions=judge.conditions_of(change),
            burst=float(change.burst),
        )
        judge.write_verdict(out, signed)
    except EXPECTED as exc:
        _fail(str(exc))
        return
    body = signed.body
    what = f"{body.candidate.kind} {body.candidate.digest[:16]}…"
    if body.passed:
        typer.echo(f"{what}: passed; verdict written to {out}")
        return
    typer.echo(f"{what}: FAILED; verdict written to {out}")
    for reason in body.reasons:
        typer.echo(f"  - {reason}")
    raise typer.Exit(1)


@twin_app.command("from-audit")
def from_audit(
    config: Annotated[
        Path,
        typer.Option(
            "--config", "-c", help="The broker's TOML settings: its id, redis_url, policy_file."
        ),
    ],
    out: Annotated[Path, typer.Option(help="Where to write the trace (.jsonl.gz).")],
) -> None:
    """Derive a trace from the broker's signed audit log (every placement decision, with
    what the job was) and the nodes' latest documents in its store, where no recording
    ran. The chain is verified against the broker's key in the policy first. The trace
    holds the offered jobs only: an edge's own runs never reach the broker."""
    import redis

    from broker import keys
    from broker.core.params import PlacementParams
    from broker.params_file import read_placement_file
    from policies.audit import decode_record, verify_chain
    from policies.loader import load_policy
    from policies.redis_stores import RedisStreamAuditStore, audit_stream_key
    from sluicegate.config import load_settings
    from sluicegate.errors import EXPECTED
    from sluicegate.redis_url import sync_client
    from sluicegate.twin import trace as tr
    from sluicegate.twin.audit import trace_from_audit
    from sluicegate.twin.capture import edge_spec, worker_spec
    from sluicegate.wire import EdgeTelemetry
    from sluicegate.wire_pool import WorkerCapabilities, WorkerTelemetry

    caught: tuple[type[Exception], ...] = (*EXPECTED, redis.RedisError, OSError, ValueError)
    try:
        cfg = load_settings(config).broker
        if cfg.policy_file is None:
            _fail(f"{config}: [broker] policy_file is not set: the policy says whose log it is")
            return
        policy = load_policy(cfg.policy_file)
        signer = policy.broker_key(cfg.id)
        if signer is None:
            _fail(f"policy v{policy.version} lists no key for broker {cfg.id!r}")
            return
        client = sync_client(cfg.redis_url)
        entries = list(RedisStreamAuditStore(client, audit_stream_key(cfg.id)).entries())
        chain = verify_chain(entries, {signer})
        docs = {}
        nodes = [*(w for p in policy.pools for w in p.workers), *(e.edge_id for e in policy.edges)]
        for node in nodes:
            found = client.hgetall(keys.node(node))
            docs[node] = {k.decode() if isinstance(k, bytes) else k: v for k, v in found.items()}
        workers = [
            worker_spec(
                WorkerCapabilities.model_validate_json(d["capabilities"]),
                WorkerTelemetry.model_validate_json(d["telemetry"]),
            )
            for d in docs.values()
            if "capabilities" in d and "telemetry" in d
        ]
        edges = [
            edge_spec(EdgeTelemetry.model_validate_json(d["telemetry"]))
            for node, d in docs.items()
            if "telemetry" in d and "capabilities" not in d
        ]
        trace = trace_from_audit(
            [decode_record(e) for e in entries],
            policy=cfg.policy_file.read_text(),
            edges=edges,
            workers=workers,
            telemetry_interval_s=cfg.telemetry_interval_s,
            params=(
                read_placement_file(cfg.placement_file)
                if cfg.placement_file is not None
                else PlacementParams.from_settings(cfg)
            ).describe(),
        )
        tr.write(out, trace)
    except caught as exc:
        _fail(str(exc))
        return
    typer.echo(
        f"{len(trace.jobs)} offered jobs from {chain.count} verified audit records "
        f"({len(edges)} edges, {len(workers)} workers) -> {out}"
    )


@twin_app.command("train")
def train_policy(
    trace: Annotated[
        list[Path], typer.Option(help="A trace to train on (repeat: several); each is perturbed.")
    ],
    out: Annotated[Path, typer.Option(help="The policy file to write (its .sha256 beside it).")],
    rounds: Annotated[int, typer.Option(help="Cross-entropy rounds.")] = 6,
    population: Annotated[int, typer.Option(help="Policies tried each round.")] = 12,
    seed: SeedOption = 0,
    version: Annotated[str, typer.Option(help="The version the policy file names.")] = "1",
    seeds: Annotated[
        int, typer.Option(help="Replay each scenario with this many seeds (0, 1, ...).")
    ] = 1,
    worst: Annotated[
        float,
        typer.Option(
            help="Weight of the worst trace's mean attainment loss against the heuristic "
            "(0: the mean over every scenario alone)."
        ),
    ] = 0.0,
) -> None:
    """Train a placement policy in the twin on traces and their perturbations (bursts of
    2x to 6x, a slow or lost worker, a slow link), each replayed with ``--seeds`` seeds,
    against the heuristic's figures on the same scenarios; write it with its sha256
    manifest."""
    from dataclasses import replace

    from broker.core.learned import save
    from sluicegate.errors import EXPECTED
    from sluicegate.twin.trace import read
    from sluicegate.twin.train import Weights, perturbations, train

    if rounds < 1 or population < 2 or seeds < 1 or worst < 0:
        _fail("--rounds and --seeds are at least 1, --population at least 2, --worst at least 0")
    try:
        scenarios = [
            replace(s, name=f"{s.name} seed {k}" if k else s.name, seed=k, group=path.name)
            for path in trace
            for s in perturbations(read(path)[0], path.name)
            for k in range(seeds)
        ]

        def say(r: int, reward: float, _policy: object) -> None:
            typer.echo(f"round {r + 1}/{rounds}: best reward {reward:+.4f}", err=True)

        policy, reward = train(
            scenarios,
            rounds=rounds,
            population=population,
            elite=max(2, population // 4),
            seed=seed,
            weights=Weights(worst=worst),
            version=version,
            progress=say,
        )
        digest = save(policy, out)
    except EXPECTED as exc:
        _fail(str(exc))
    typer.echo(
        f"{out}: reward {reward:+.4f} over {len(scenarios)} scenarios against the heuristic, "
        f"sha256 {digest}"
    )
