"""Benchmark: the edge agent against what a user would write instead, serving the same job
(the same JPEG, the same model code, 2 compute threads each), each a process of its own,
all started once and measured in interleaved rounds (issue 35, part 3). The arms:

* ``bare``: a paho MQTT v5 worker: request topic in, result JSON to the Response Topic
  with the Correlation Data; no durability;
* ``durable``: that worker with the agent's durability: the job committed to SQLite (WAL,
  ``synchronous = FULL``) before its PUBACK, the result committed before it is published;
* ``aiohttp``: a hand-written HTTP server, the image POSTed, the JSON in the reply;
* ``agent-tls``: ``sluicegate edge run`` as shipped (durable outbox, metering ledger on,
  no offload as no broker is online) on a Mosquitto with a TLS 1.3 listener that requires
  client certificates from the campus CA (``sluicegate.pki``), the agent and this driver
  each logging in with its own; the agent's usage records are acknowledged as a broker
  replica would (the driver plays its intake as ``broker-1``), or the agent would resend
  its whole backlog every 30 s;
* ``agent-open``: the same agent with TLS off, on the plain Mosquitto with bare and durable.
* ``agent-tls@base`` (with ``--against TREE``): the agent of another checkout (an earlier
  commit's worktree), as shipped, beside agent-tls on the same TLS Mosquitto and in the same
  rounds: an A/B of two versions of the agent, each round's pair seconds apart, which a
  machine whose speed drifts between runs leaves alone.

bare and durable run over plain TCP, as a user's 60-line worker would; agent-tls is compared
with them (the targets), agent-open shows what TLS adds. Load: this driver, closed-loop with
``--inflight`` requests outstanding (a lane each). Each round, for each model, for each arm
in turn: ``--warmup`` jobs discarded, then ``--jobs`` counted: latency (request sent to
answer in the lane's hands), jobs/s, and the CPU of the serving process and its children
per job (``/proc``), with its Mosquitto's beside it. Prints a table per model, then the
``RESULT {...}`` line (BENCHMARKS.md). The user's programs and the driver's clients are in
``bench/peers_workers.py``; every child is stopped when the run ends, however it ends.

    .venv/bin/python bench/peers.py                  # defaults: about 3 minutes on 2 cores
    .venv/bin/python bench/peers.py --smoke          # CI: 1 round, 30 jobs, defect-v1
    .venv/bin/python bench/peers.py --models defect-v1 --rounds 5 --jobs 1000
    git worktree add /tmp/base HEAD~1 && cp models/*.onnx /tmp/base/models/
    .venv/bin/python bench/peers.py --models defect-v1 --rounds 4 --jobs 600 --against /tmp/base
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import stats  # noqa: E402
from bench.edge_path import make_image  # noqa: E402
from bench.peers_workers import BenchError, HttpArm, MqttArm, UsageAcker, request_topic  # noqa: E402
from policies import SigningKey  # noqa: E402
from sluicegate import topics  # noqa: E402
from sluicegate.app.campus import APPS, BROKER, LINES, Campus, write_campus  # noqa: E402
from sluicegate.app.localcampus import start_campus_mosquitto  # noqa: E402
from sluicegate.app.servers import free_port, running, start_mosquitto  # noqa: E402
from sluicegate.threads import EDGE_COMPUTE  # noqa: E402

Arm = MqttArm | HttpArm
ARMS = ("bare", "durable", "aiohttp", "agent-tls", "agent-open")
AGAINST = "agent-tls@base"  # the arm of --against: another checkout's agent, TLS as shipped
AGENTS = {
    "agent-tls": ("line-2-pc", "app-line-2"),
    "agent-open": ("line-1-pc", "app-line-1"),
    AGAINST: ("line-1-pc", "app-line-1"),  # on the TLS Mosquitto, with a state dir of its own
}
TARGET = {
    "agent-tls/bare": {"jobs_per_s": 0.85, "cpu_per_job": 1.3, "p50": 1.2, "p99": 1.3},
    "agent-tls/durable": {"jobs_per_s": 0.95, "cpu_per_job": 1.15},
}
CEILINGS = ("cpu_per_job", "p50", "p99")
PAIRS = (*TARGET, "agent-open/bare", "agent-tls/agent-open", "agent-tls/aiohttp")
WORKERS = ROOT / "bench" / "peers_workers.py"
# The agent's CPU by thread: the event loop (MQTT, TLS, the job table, telemetry, the SQLite
# commits, the usage ledger's signatures), the model threads, the rest.
THREAD_GROUPS = {"main": "event loop", EDGE_COMPUTE: "model threads"}


@dataclass
class Serving:
    """One arm: its serving process, how to reach it, the Mosquitto it goes through."""

    name: str
    proc: subprocess.Popen[bytes]
    arm: Arm
    log: Path
    broker_pid: int | None = None
    acker: UsageAcker | None = None  # an agent's: its usage records acknowledged
    node: str = ""  # an agent's edge id

    @property
    def acked(self) -> int:
        """The agent's usage records acknowledged so far."""
        return self.acker.acked[self.node] if self.acker is not None else 0

    def alive(self) -> None:
        if self.proc.poll() is not None:
            tail = self.log.read_text(errors="replace")[-2000:]
            raise BenchError(f"{self.name} exited with {self.proc.returncode}:\n{tail}")


@dataclass
class Tally:
    """One arm's counted figures for one model, over the rounds."""

    latencies_ms: list[float] = field(default_factory=list)
    jobs_per_s: list[float] = field(default_factory=list)
    jobs: int = 0
    cpu_s: float = 0.0
    broker_cpu_s: float = 0.0
    thread_cpu_s: dict[str, float] = field(default_factory=dict)  # by OS thread name

    def figures(self) -> dict[str, Any]:
        fig: dict[str, Any] = stats.summary(self.latencies_ms)
        fig["jobs_per_s"] = stats.median(self.jobs_per_s)
        fig["jobs_per_s_rounds"] = [round(x, 1) for x in self.jobs_per_s]
        fig["cpu_ms_per_job"] = 1000.0 * stats.ratio(self.cpu_s, self.jobs)
        fig["broker_cpu_ms_per_job"] = 1000.0 * stats.ratio(self.broker_cpu_s, self.jobs)
        fig["cpu_ms_per_job_by_thread"] = {
            name: round(1000.0 * stats.ratio(sec, self.jobs), 3)
            for name, sec in sorted(self.thread_cpu_s.items())
        }
        return fig


def spawn(
    argv: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (an agent drains and exits), SIGKILL after 20 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def agent_config(
    campus: Campus, node: str, port: int, secure: bool, threads: int, arm: str
) -> Path:
    """The agent's settings as an install writes them (shipped defaults otherwise): its own
    certificate, or ``plaintext``; its key (metering signs with it); a free /metrics port;
    a state dir of the arm's own."""
    mqtt = f"[mqtt]\nport = {port}\n"
    if secure:
        mqtt += (
            f'tls_ca_file = "{campus.ca_file}"\ntls_cert_file = "{campus.cert_file(node)}"\n'
            f'tls_key_file = "{campus.key_files[node]}"\n'
        )
    else:
        mqtt += "plaintext = true\n"
    path = campus.root / f"bench-{node}-{arm}.toml"
    path.write_text(
        mqtt + f'\n[edge]\nid = "{node}"\nzone = "{LINES[node]}"\nconcurrency = {threads}\n'
        f'key_file = "{campus.key_files[node]}"\nmetrics_port = 0\n'
        f'\n[offload]\nstate_dir = "{campus.root / "state" / arm}"\n'
        f'policy_file = "{campus.policy_file}"\n'
    )
    return path


@contextlib.contextmanager
def rig(
    tmp: Path, image: bytes, threads: int, against: Path | None = None
) -> Iterator[dict[str, Serving]]:
    """Both Mosquittos, the five serving processes (six with ``against``: that checkout's
    agent) and the driver's clients; every one of them stopped when the block ends,
    however it ends."""
    with contextlib.ExitStack() as stack:
        plain = stack.enter_context(running(start_mosquitto()))
        campus = write_campus(
            tmp / "campus",
            lambda _name: SigningKey.generate(),
            mqtt_port=free_port(),
            redis_url="redis://127.0.0.1:1/0",  # no broker or worker runs: never dialled
        )
        (tmp / "mosquitto-tls").mkdir()
        secure = stack.enter_context(
            running(start_campus_mosquitto(campus, workdir=tmp / "mosquitto-tls"))
        )
        py, out = sys.executable, {}
        for kind in ("bare", "durable"):
            argv = [py, str(WORKERS), kind, str(plain.port), "--threads", str(threads)]
            proc = spawn([*argv, "--db", str(tmp / f"{kind}.db")], tmp / f"{kind}.log")
            stack.callback(stop, proc)
            arm = stack.enter_context(contextlib.closing(MqttArm(plain.port, image)))
            arm.route(request_topic(kind), f"bench/peers/{kind}/results")
            out[kind] = Serving(kind, proc, arm, tmp / f"{kind}.log", plain.pid)
        http_port = free_port()
        argv = [py, str(WORKERS), "aiohttp", str(http_port), "--threads", str(threads)]
        proc = spawn(argv, tmp / "aiohttp.log")
        stack.callback(stop, proc)
        out["aiohttp"] = Serving("aiohttp", proc, HttpArm(http_port, image), tmp / "aiohttp.log")
        ackers: dict[int, UsageAcker] = {}  # by Mosquitto port
        for name, (node, app) in AGENTS.items():
            if name == AGAINST and against is None:
                continue
            server = plain if name == "agent-open" else secure
            tls = campus.client_context(app) if server is secure else None
            config = agent_config(campus, node, server.port, server is secure, threads, name)
            log = tmp / f"{name}.log"
            argv = [py, "-m", "sluicegate.app.cli", "edge", "run", "--config", str(config)]
            env, tree = dict(os.environ), ROOT
            if name == AGAINST:
                assert against is not None
                tree = against  # ``-m`` finds the package in the working directory first
                env["PYTHONPATH"] = str(against)
            proc = spawn([*argv, "--log-level", "warning"], log, env=env, cwd=tree)
            stack.callback(stop, proc)
            if server.port not in ackers:
                broker_tls = campus.client_context(BROKER) if tls is not None else None
                ackers[server.port] = stack.enter_context(
                    contextlib.closing(UsageAcker(server.port, broker_tls))
                )
            ackers[server.port].add(node)
            arm = stack.enter_context(contextlib.closing(MqttArm(server.port, image, tls, node)))
            arm.route(topics.edge_submit(node), f"{APPS[app][1]}/bench")
            out[name] = Serving(name, proc, arm, log, server.pid, ackers[server.port], node)
        for serving in out.values():
            until_serving(serving)
        yield out


def until_serving(serving: Serving, timeout: float = 90.0) -> None:
    """Probe until a job is answered ok (a request sent before it subscribed is lost)."""
    deadline = time.monotonic() + timeout
    for n in count():
        serving.alive()
        with contextlib.suppress(TimeoutError, OSError, http.client.HTTPException, BenchError):
            with serving.arm.lane() as call:
                call(f"probe-{n}", "defect-v1", 2.0)
            return
        if time.monotonic() > deadline:
            raise BenchError(f"{serving.name} answered no job within {timeout:.0f} s")
        time.sleep(0.2)  # then probe again


def closed_loop(
    arm: Arm, model: str, tag: str, jobs: int, inflight: int
) -> tuple[list[float], float]:
    """``jobs`` requests, ``inflight`` lanes each sending its next as soon as its last is
    answered; the latencies (ms) and the wall time (s)."""
    numbers = count()
    latencies: list[float] = []

    def lane(_k: int) -> None:
        with arm.lane() as call:
            while (i := next(numbers)) < jobs:
                latencies.append(call(f"{tag}-{i}", model, 30.0))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(inflight) as pool:
        list(pool.map(lane, range(inflight)))
    return latencies, time.perf_counter() - t0


def measure(serving: Serving, model: str, tag: str, args: argparse.Namespace, tally: Tally) -> None:
    """One round of one arm: warm up (discarded), then count."""
    try:
        closed_loop(serving.arm, model, f"{tag}-warm", args.warmup, args.inflight)
        cpu0 = stats.cpu_tree_s(serving.proc.pid)
        threads0 = stats.cpu_by_thread_s(serving.proc.pid)
        broker0 = stats.cpu_s(serving.broker_pid) if serving.broker_pid else 0.0
        lat, wall = closed_loop(serving.arm, model, tag, args.jobs, args.inflight)
    except (TimeoutError, OSError, http.client.HTTPException) as exc:
        serving.alive()  # a process that died says so, with its log
        raise BenchError(f"{serving.name}, {model}: {type(exc).__name__} {exc}") from exc
    tally.cpu_s += stats.cpu_tree_s(serving.proc.pid) - cpu0
    for name, sec in stats.cpu_by_thread_s(serving.proc.pid).items():
        group = name if name in THREAD_GROUPS else "other"
        used = sec - threads0.get(name, 0.0)
        tally.thread_cpu_s[group] = tally.thread_cpu_s.get(group, 0.0) + used
    if serving.broker_pid:
        tally.broker_cpu_s += stats.cpu_s(serving.broker_pid) - broker0
    serving.alive()
    tally.latencies_ms += lat
    tally.jobs += len(lat)
    tally.jobs_per_s.append(len(lat) / wall)


def pairs_of(arms: list[str]) -> tuple[str, ...]:
    """The ratios printed: the targets', and the A/B's with ``--against``."""
    return (*PAIRS, f"agent-tls/{AGAINST}") if AGAINST in arms else PAIRS


def ratios(fig: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for pair in pairs_of(list(fig)):
        a, b = (fig[name] for name in pair.split("/"))
        out[pair] = {
            "jobs_per_s": stats.ratio(a["jobs_per_s"], b["jobs_per_s"]),
            "cpu_per_job": stats.ratio(a["cpu_ms_per_job"], b["cpu_ms_per_job"]),
            "p50": stats.ratio(a["p50_ms"], b["p50_ms"]),
            "p99": stats.ratio(a["p99_ms"], b["p99_ms"]),
            # Each round's own pair, measured seconds apart: what a noisy hour leaves alone.
            "jobs_per_s_rounds": [
                round(stats.ratio(x, y), 3)
                for x, y in zip(a["jobs_per_s_rounds"], b["jobs_per_s_rounds"], strict=True)
            ],
        }
    return out


def print_model(
    model: str, fig: dict[str, dict[str, Any]], ratio: dict[str, dict[str, Any]]
) -> None:
    print(f"{model}")
    print(
        f"  {'arm':15}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'max ms':>9}{'jobs/s':>9}"
        f"{'CPU ms/job':>12}{'mosq ms/job':>13}   jobs/s by round"
    )
    for arm in fig:
        f = fig[arm]
        rounds = " ".join(f"{x:.0f}" for x in f["jobs_per_s_rounds"])
        print(
            f"  {arm:15}{f['p50_ms']:9.2f}{f['p90_ms']:9.2f}{f['p99_ms']:9.2f}{f['max_ms']:9.2f}"
            f"{f['jobs_per_s']:9.0f}{f['cpu_ms_per_job']:12.2f}{f['broker_cpu_ms_per_job']:13.2f}"
            f"   {rounds}"
        )
    for arm in (a for a in AGENTS if a in fig):
        split = fig[arm]["cpu_ms_per_job_by_thread"]
        groups = [*THREAD_GROUPS.items(), ("other", "other")]
        cells = [f"{label} {split.get(name, 0.0):.2f}" for name, label in groups]
        print(f"  {arm} CPU ms/job by thread: " + ", ".join(cells))
    for pair in pairs_of(list(fig)):
        r, goal = ratio[pair], TARGET.get(pair, {})
        cells = []
        for key in ("jobs_per_s", "cpu_per_job", "p50", "p99"):
            if key in goal:
                sign = "<=" if key in CEILINGS else ">="
                ok = stats.met({key: r[key]}, {key: goal[key]}, most=CEILINGS)
                cells.append(
                    f"{key} {r[key]:.2f} ({sign} {goal[key]:.2f} {'met' if ok else 'NOT met'})"
                )
            else:
                cells.append(f"{key} {r[key]:.2f}")
        by_round = " ".join(f"{x:.2f}" for x in r["jobs_per_s_rounds"])
        print(f"  {pair:25}" + "  ".join(cells) + f"  (jobs/s by round {by_round})")


def report(
    args: argparse.Namespace,
    image: bytes,
    tallies: dict[str, dict[str, Tally]],
    info: dict[str, Any],
) -> None:
    claims = {
        f"{m} {arm} jobs": t.jobs for m, by_arm in tallies.items() for arm, t in by_arm.items()
    }
    claims |= {f"{name} usage records acked": n for name, n in info["usage_acked"].items()}
    stats.require(claims)  # a baseline that never ran, or an agent that metered nothing
    figs = {m: {arm: t.figures() for arm, t in by_arm.items()} for m, by_arm in tallies.items()}
    ratio = {model: ratios(fig) for model, fig in figs.items()}
    met_by = {
        model: all(stats.met(r[pair], goal, most=CEILINGS) for pair, goal in TARGET.items())
        for model, r in ratio.items()
    }
    print(
        f"peers: the edge agent against a user's own worker, {len(image) / 1024:.0f} KB 640x480 "
        f"JPEG, closed loop with {args.inflight} in flight, {args.rounds} round(s) x {args.jobs} "
        f"counted jobs per arm ({args.warmup} warm-up discarded each), {args.threads} compute "
        f"threads each, nproc {os.cpu_count()}, {info['elapsed_s']:.0f} s"
    )
    metered = ", ".join(f"{name} {n}" for name, n in info["usage_acked"].items())
    print(
        f"  bare, durable, agent-open: plain TCP; agent-tls: {info['tls']}, client certificates; "
        f"CPU = the serving process and its children; mosq = its Mosquitto's; usage records "
        f"metered and acked: {metered}"
    )
    if info.get("against"):
        print(f"  {AGAINST}: the agent of {info['against']}, TLS as shipped")
    for model, fig in figs.items():
        print_model(model, fig, ratio[model])
    result = {
        "bench": "peers",
        "subject": {m: fig["agent-tls"] for m, fig in figs.items()},
        "baseline": {
            m: {a: f for a, f in fig.items() if a != "agent-tls"} for m, fig in figs.items()
        },
        "ratio": ratio,
        "target": TARGET,
        "met": all(met_by.values()),
        "met_by_model": met_by,
        "measured": claims,
        "params": {
            "models": list(tallies),
            "rounds": args.rounds,
            "jobs": args.jobs,
            "warmup": args.warmup,
            "inflight": args.inflight,
            "threads": args.threads,
            "payload_bytes": len(image),
            "elapsed_s": round(info["elapsed_s"], 1),
        },
        "tls": info["tls"],
        "machine": stats.machine("aiohttp"),
    }
    print(stats.result_line(result))


def order_of(arms: list[str], round_no: int) -> list[str]:
    """The arms in the order a round runs them: with ``--against``, the two agents of the
    A/B take turns at going first, since the arm run second tends to run slower."""
    order = list(arms)
    if AGAINST in order and round_no % 2:
        i, j = order.index("agent-tls"), order.index(AGAINST)
        order[i], order[j] = order[j], order[i]
    return order


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="defect-v1,surface-det", help="comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every arm")
    ap.add_argument("--jobs", type=int, default=1000, help="counted jobs per round per arm")
    ap.add_argument("--warmup", type=int, default=100, help="discarded jobs per round per arm")
    ap.add_argument("--inflight", type=int, default=4, help="requests outstanding (lanes)")
    ap.add_argument("--threads", type=int, default=2, help="compute threads of every arm")
    ap.add_argument("--payload-kb", type=int, default=80)
    ap.add_argument("--smoke", action="store_true", help="CI: 1 round, 30 jobs, defect-v1")
    ap.add_argument(
        "--against",
        type=Path,
        default=None,
        help=f"another checkout (a worktree of an earlier commit): its agent runs as {AGAINST}",
    )
    args = ap.parse_args()
    if args.against is not None and not (args.against / "sluicegate" / "app" / "cli.py").exists():
        raise SystemExit(f"--against {args.against}: not a checkout of this project")
    if args.smoke:
        args.models, args.rounds, args.jobs, args.warmup = "defect-v1", 1, 30, 5
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if args.rounds < 1 or args.jobs < 1 or args.inflight < 1 or not models:
        raise SystemExit("--rounds, --jobs and --inflight must be at least 1; --models not empty")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop every child
    image = make_image(args.payload_kb)
    arms_run = list(ARMS)
    if args.against is not None:  # right after agent-tls: the pair runs seconds apart
        arms_run.insert(arms_run.index("agent-tls") + 1, AGAINST)
    tallies = {m: {arm: Tally() for arm in arms_run} for m in models}
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="sg-bench-peers-") as tmp,
        rig(Path(tmp), image, args.threads, args.against) as arms,
    ):
        subject = arms["agent-tls"]
        assert isinstance(subject.arm, MqttArm)
        tls = subject.arm.tls_session()
        for r in range(args.rounds):
            for model in models:
                for name in order_of(arms_run, r):
                    measure(arms[name], model, f"{model}-r{r}", args, tallies[model][name])
        acked = {name: s.acked for name, s in arms.items() if s.acker is not None}
    info = {
        "elapsed_s": time.monotonic() - started,
        "tls": tls,
        "usage_acked": acked,
        "against": str(args.against) if args.against is not None else None,
    }
    report(args, image, tallies, info)


if __name__ == "__main__":
    main()
