"""Benchmark: what open dashboards cost the broker. Placements granted per second through
one broker process with five consoles open (each a live stream of snapshots, as a browser
holds it) against none, rounds alternating in one run.

Processes and driver as in ``bench/broker_throughput.py`` (a Mosquitto and a Redis for the
run, one ``sluicegate broker run`` replica over ``--workers`` played pool workers, a paho
driver keeping ``--window`` requests outstanding as edge ``line-1-pc``). In both arms the
edges' job records arrive as in production (``--records`` a second on the edge trace topic,
so the console's window is full); only the open dashboards differ. Target: at most 5 %
fewer grants per second with five dashboards open (refusals are counted apart, by code).

    .venv/bin/python bench/console_cost.py                  # about 70 s on 2 cores
    .venv/bin/python bench/console_cost.py --rounds 5 --dashboards 5
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import stats  # noqa: E402
from bench.broker_throughput import EDGE, ZONE, Driver, fleet_publisher  # noqa: E402
from policies import SigningKey  # noqa: E402
from sluicegate import topics, wire  # noqa: E402
from sluicegate.app.campus import write_campus  # noqa: E402
from sluicegate.app.servers import free_port, running, start_mosquitto, start_redis  # noqa: E402

TARGET = {"max_drop": 0.05}


def records_publisher(port: int, per_s: int, stop: threading.Event) -> None:
    """The edges' job records, ``per_s`` a second in one trace document per edge."""
    client = paho.Client(CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
    client.connect("127.0.0.1", port)
    client.loop_start()
    n = 0
    while not stop.is_set():
        now = time.time()
        for edge, worker in (("line-1-pc", "w0001"), ("line-2-pc", None)):
            records = []
            for i in range(per_s // 2):
                n += 1
                offloaded = worker is not None and i % 2 == 0
                records.append(
                    wire.TraceJob(
                        received_at=now - 0.05,
                        job_id=f"r{n}",
                        model="defect-v1",
                        data_class="wafer-image",
                        priority=5,
                        deadline_ms=200.0,
                        bytes=80_000,
                        status="ok",
                        ran_on=worker if offloaded else edge,
                        offloaded=offloaded,
                        worker=worker if offloaded else None,
                        latency_ms=40.0 + i % 50,
                        queue_ms=5.0,
                        service_ms=20.0,
                        code=None if offloaded else "no_faster_worker",
                    )
                )
            trace = wire.EdgeTrace(node=edge, records=records)
            client.publish(topics.edge_trace(edge), wire.dump(trace), qos=0)
        stop.wait(1.0)
    client.disconnect()
    client.loop_stop()


class Dashboard(threading.Thread):
    """One open console: the live stream, read and parsed as the page does."""

    def __init__(self, port: int, token: str) -> None:
        super().__init__(daemon=True)
        self.port, self.token = port, token
        self.snapshots = 0
        self.bytes = 0
        self.build_ms: list[float] = []  # the broker's time to build each snapshot
        self.closed = threading.Event()

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request(
            "GET", "/console/api/events", headers={"Authorization": f"Bearer {self.token}"}
        )
        stream = conn.getresponse()
        assert stream.status == 200, stream.status
        while not self.closed.is_set():
            line = stream.readline()
            if not line:
                break
            if line.startswith(b"data: "):
                self.build_ms.append(float(json.loads(line[6:])["build_ms"]))
                self.snapshots += 1
                self.bytes += len(line)
        conn.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=8.0, help="length of a round")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of each arm, alternating")
    ap.add_argument("--window", type=int, default=64, help="requests outstanding")
    ap.add_argument("--workers", type=int, default=50)
    ap.add_argument("--dashboards", type=int, default=5)
    ap.add_argument("--records", type=int, default=500, help="edge job records a second")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of uncounted requests")
    args = ap.parse_args()
    workers = [f"w{i:04d}" for i in range(args.workers)]
    with (
        running(start_mosquitto()) as mqtt,
        running(start_redis()) as redis,
        tempfile.TemporaryDirectory(prefix="sg-bench-") as tmp,
    ):
        http_port = free_port()
        campus = write_campus(
            Path(tmp),
            lambda _n: SigningKey.generate(),
            mqtt_port=mqtt.port,
            redis_url=f"redis://127.0.0.1:{redis.port}/0",
            workers=dict.fromkeys(workers, (ZONE, "x86-cpu")),
            http_port=http_port,
            secure=False,
        )
        cmd = [sys.executable, "-m", "sluicegate.app.cli", "broker", "run"]
        broker = subprocess.Popen(
            [*cmd, "--log-level", "warning", "--config", str(campus.node_config("broker-1"))]
        )
        stop = threading.Event()
        feeders = [
            threading.Thread(
                target=fleet_publisher, args=(mqtt.port, workers, stop, campus.seal_keys)
            ),
            threading.Thread(target=records_publisher, args=(mqtt.port, args.records, stop)),
        ]
        for f in feeders:
            f.start()
        driver = Driver(mqtt.port)
        driver.wait_online(topics.broker_status("broker-1"))
        token = campus.console_token("viewer")
        arms: dict[str, list[float]] = {"none": [], "dashboards": []}
        cpu: dict[str, list[float]] = {"none": [], "dashboards": []}
        pushed: list[float] = []
        built: list[float] = []  # ms the broker took per snapshot
        snapshot_bytes: list[float] = []
        grants = dict.fromkeys(arms, 0)
        snapshots = 0
        try:
            requests = topics.placement_request(EDGE)
            driver.round(requests, args.warmup, args.window)  # the console's window fills
            for _ in range(args.rounds):
                for arm in ("none", "dashboards"):
                    boards: list[Dashboard] = []
                    if arm == "dashboards":
                        boards = [Dashboard(http_port, token) for _ in range(args.dashboards)]
                        for b in boards:
                            b.start()
                        deadline = time.monotonic() + 10
                        while min(b.snapshots for b in boards) < 1:
                            assert time.monotonic() < deadline, "no snapshot reached a dashboard"
                            time.sleep(0.05)  # until every dashboard has its first snapshot
                    got = [b.snapshots for b in boards]
                    counted = driver.round(
                        requests, args.seconds, args.window, count=True, serving=broker.pid
                    )
                    arms[arm].append(counted.grants_per_s)
                    cpu[arm].append(counted.cpu_us_per_reply)
                    grants[arm] += counted.grants
                    if boards:
                        pushed.append(
                            sum(b.snapshots - g for b, g in zip(boards, got, strict=True))
                            / len(boards)
                            / args.seconds
                        )
                        built += [ms for b in boards[:1] for ms in b.build_ms[1:]]
                        snapshot_bytes.append(boards[0].bytes / max(boards[0].snapshots, 1))
                        snapshots += sum(b.snapshots for b in boards)
                        for b in boards:
                            b.closed.set()
        finally:
            stop.set()
            for f in feeders:
                f.join()
            broker.terminate()
            broker.wait(30)
    report(
        args, arms, cpu, pushed, driver, built, snapshot_bytes, grants | {"snapshots": snapshots}
    )


def report(
    args: argparse.Namespace,
    arms: dict[str, list[float]],
    cpu: dict[str, list[float]],
    pushed: list[float],
    driver: Driver,
    built: list[float],
    snapshot_bytes: list[float],
    counts: dict[str, int],
) -> None:
    none, boards = stats.median(arms["none"]), stats.median(arms["dashboards"])
    drop = 1.0 - stats.ratio(boards, none)
    print(
        f"console cost: {args.workers} workers, {args.records} job records/s, window "
        f"{args.window}, {args.rounds} rounds of {args.seconds:g} s per arm, alternating, "
        f"nproc {os.cpu_count()}; replies {driver.statuses}, refusals {driver.codes}"
    )
    print(
        f"  grants/s, no dashboard         {none:8.0f}   rounds {[round(x) for x in arms['none']]}"
    )
    print(
        f"  grants/s, {args.dashboards} dashboards open     {boards:8.0f}   rounds "
        f"{[round(x) for x in arms['dashboards']]}"
    )
    print(
        f"  broker CPU per reply           {stats.median(cpu['none']):5.0f} / "
        f"{stats.median(cpu['dashboards']):5.0f} µs"
    )
    per_s = stats.median(pushed)
    print(f"  snapshots per dashboard per s  {per_s:8.2f}")
    print(
        f"  snapshot build + encode        {stats.median(built):8.2f} ms p50, "
        f"{stats.percentile(built, 99):.2f} ms p99, "
        f"{stats.median(snapshot_bytes) / 1024:.0f} KiB each"
    )
    print(
        f"  drop                           {100 * drop:7.1f} %   "
        f"target <= {100 * TARGET['max_drop']:.0f} %"
    )
    result = {
        "bench": "console_cost",
        "subject": {"grants_per_s": boards, "rounds": arms["dashboards"]},
        "baseline": {"grants_per_s": none, "rounds": arms["none"]},
        "refusals_by_code": driver.codes,
        "ratio": {"dashboards_over_none": stats.ratio(boards, none)},
        "cpu_us_per_reply": {k: stats.median(v) for k, v in cpu.items()},
        "snapshots_per_s": per_s,
        "snapshot_build_ms_p50": stats.median(built),
        "target": TARGET,
        "met": stats.met({"max_drop": drop}, TARGET, most=TARGET),
        "measured": stats.require(
            {
                "grants, no dashboard": counts["none"],
                "grants, dashboards open": counts["dashboards"],
                "dashboard snapshots": counts["snapshots"],
            }
        ),
        "params": vars(args),
        "machine": stats.machine("redis"),
    }
    print(stats.result_line(result))


if __name__ == "__main__":
    main()
