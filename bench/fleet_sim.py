"""A simulated fleet for the fleet benchmarks: the telemetry of N edge agents and M pool
workers (capabilities, telemetry, completions), all from one process over one MQTT
connection, as ``bench-fleet-<k>`` (a bench identity whose ACL block lets it write those
nodes' telemetry, capabilities, status and completion topics; ``bench/fleet_rig.py``).

What goes out is what the product's nodes publish, built once per node as a JSON template
(checked against ``sluicegate.wire.EdgeTelemetry`` / ``WorkerTelemetry`` before the first
send) with the changing fields filled in at each send: the timestamp, and load figures
drifting a little per node (queue, in flight, CPU, memory, service time, counters), as
``edge_agent/reporting.py`` and ``center_pool/reporting.py`` shape them. Edges and workers
send at 1 Hz each, spread evenly over the second (the k-th of K nodes at k/K s, sent at a
millisecond's grain), not in bursts. A worker publishes its retained capabilities (with
the sealing key the policy lists for it) and online status once, its telemetry
(``in_flight``: the jobs it holds now) every second, and a ``Completion`` (QoS 1, as
``center_pool/replies.py``) for each job the driver says was placed on it, after
``service_ms`` ± ``jitter_ms``.

It reads no clock but its own and decides nothing; paho is driven from this process's one
loop (no network thread: a publish is written at once) and keeps the connection, the
retained and QoS 1 messages; the QoS 0 telemetry is framed here and written to paho's
socket between paho's own writes, a message costing a filled template and a write
rather than a paho publish. Run by the fleet rig, not by hand:

    .venv/bin/python bench/fleet_sim.py SPEC.json    # commands on stdin, replies on stdout

Commands, one a line: ``edges K [RATE]`` (send the first K edges' telemetry, RATE
messages a second in all, K by default; 0: none),
``done WORKER JOB ATTEMPT EDGE`` (complete a placed job), ``stats`` (reply a JSON line
of counters), ``log PATH`` (write each completion's monotonic send time to PATH as JSON),
``quit``.
"""

from __future__ import annotations

import heapq
import json
import os
import random
import select
import socket
import ssl
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sluicegate import topics, wire
from sluicegate.wire_pool import (
    Completion,
    ModelCapability,
    WorkerCapabilities,
    WorkerTelemetry,
)

MODEL = "defect-v1"
MISC_S = 1.0  # paho's keepalive bookkeeping
MAX_WAIT_S = 0.005  # the loop's longest sleep (a command on stdin wakes it anyway)
# Sends due are sent together at most this often (5 messages a wake-up at 5,000/s, not
# one): the spread over the second at a millisecond's grain, the simulator's CPU a fraction.
SEND_TICK_S = 0.001


def publish_body_head(topic: str) -> bytes:
    """What a QoS 0 MQTT v5 PUBLISH to ``topic`` holds before its payload: the topic and an
    empty property list."""
    name = topic.encode()
    return len(name).to_bytes(2, "big") + name + b"\x00"


def _publish_header(body_len: int) -> bytes:
    """A QoS 0 PUBLISH's fixed header: the type byte and the remaining length."""
    out = bytearray([0x30])
    while True:
        byte, body_len = body_len & 0x7F, body_len >> 7
        out.append(byte | (0x80 if body_len else 0))
        if not body_len:
            return bytes(out)


def _template(doc: dict[str, Any], fields: dict[str, str]) -> str:
    """``doc`` as compact JSON with each field named in ``fields`` (a sentinel string value
    in ``doc``) replaced by its %-format (``%(ts).3f``)."""
    text = json.dumps(doc, separators=(",", ":")).replace("%", "%%")
    for sentinel, fmt in fields.items():
        text = text.replace(f'"{sentinel}"', fmt)
    return text


EDGE_FIELDS = {
    "@ts": "%(ts).3f",
    "@q": "%(q)d",
    "@f": "%(f)d",
    "@svc": "%(svc).3f",
    "@done": "%(done)d",
    "@cpu": "%(cpu).1f",
    "@rss": "%(rss).1f",
    "@mem": "%(mem).2f",
    "@off": "%(off)d",
}


def edge_template(edge_id: str, zone: str, policy_version: int) -> str:
    """An edge agent's telemetry (``edge_agent.reporting.telemetry``'s shape)."""
    doc = {
        "v": 1,
        "node": edge_id,
        "zone": zone,
        "ts": "@ts",
        "queue_depth": "@q",
        "queue_capacity": 64,
        "in_flight": "@f",
        "concurrency": 1,
        "models": {MODEL: {"service_ms": "@svc", "completed": "@done"}},
        "cpu_percent": "@cpu",
        "memory_rss_mb": "@rss",
        "memory_percent": "@mem",
        "results": {"ok": "@done"},
        "dropped_no_response_topic": 0,
        "offloaded": "@off",
        "finished": {"edge": "@done", "pool": "@off"},
        "offload_pending": 0,
        "events": {"accepted": "@done", "duplicates": 0, "redelivered": 0, "replayed": 0},
        "policy_version": policy_version,
        "policy_refused": {},
        "prediction": {"n": 200, "p50_ms": 1.8, "p90_ms": 4.2, "bias_ms": 0.3},
    }
    return _template(doc, EDGE_FIELDS)


WORKER_FIELDS = {
    "@ts": "%(ts).3f",
    "@util": "%(util).4f",
    "@mem": "%(mem).1f",
    "@f": "%(f)d",
    "@backlog": "%(backlog).3f",
    "@svc": "%(svc).3f",
    "@done": "%(done)d",
}


def worker_template(worker_id: str, zone: str, device_class: str, capacity: int) -> str:
    """A pool worker's telemetry (``center_pool.reporting.telemetry``'s shape)."""
    doc = {
        "v": 1,
        "node": worker_id,
        "zone": zone,
        "ts": "@ts",
        "device_class": device_class,
        "utilisation": "@util",
        "memory_used_mb": "@mem",
        "memory_total_mb": 64000.0,
        "memory_bandwidth": 0.2,
        "temperature_c": 55.0,
        "queue_depth": 0,
        "in_flight": "@f",
        "capacity": capacity,
        "backlog_ms": "@backlog",
        "models": {MODEL: {"service_ms": "@svc", "completed": "@done"}},
        "results": {"ok": "@done"},
        "refused": {},
    }
    return _template(doc, WORKER_FIELDS)


@dataclass
class EdgeState:
    topic: str
    template: str
    cpu: float
    rss: float
    svc: float
    done: int = 0
    off: int = 0
    head: bytes = field(init=False)

    def __post_init__(self) -> None:
        self.head = publish_body_head(self.topic)

    def payload(self, rng: random.Random, now: float) -> bytes:
        self.cpu = min(95.0, max(5.0, self.cpu + rng.uniform(-2.0, 2.0)))
        self.rss = min(900.0, max(200.0, self.rss + rng.uniform(-0.5, 0.5)))
        self.svc = min(40.0, max(2.0, self.svc + rng.uniform(-0.2, 0.2)))
        q = rng.randint(0, 3)
        self.done += rng.randint(0, 3)
        self.off += rng.random() < 0.1
        values = {"ts": now, "q": q, "f": 1 if q else rng.randint(0, 1), "svc": self.svc}
        values |= {"done": self.done, "cpu": self.cpu, "rss": self.rss, "off": self.off}
        values["mem"] = self.rss / 160.0
        return (self.template % values).encode()


@dataclass
class WorkerState:
    worker_id: str
    topic: str
    template: str
    svc: float
    held: set[str] = field(default_factory=set)
    done: int = 0
    head: bytes = field(init=False)

    def __post_init__(self) -> None:
        self.head = publish_body_head(self.topic)

    def payload(self, rng: random.Random, now: float) -> bytes:
        self.svc = min(30.0, max(10.0, self.svc + rng.uniform(-0.2, 0.2)))
        held = len(self.held)
        values = {"ts": now, "util": min(1.0, 0.1 + 0.05 * held), "mem": 4000.0 + 10 * held}
        values |= {"f": held, "backlog": held * self.svc, "svc": self.svc, "done": self.done}
        return (self.template % values).encode()


class Cycle:
    """Send K nodes' documents, ``rate`` a second in all (K/s: each node once a second),
    evenly: node after node, round and round."""

    def __init__(self) -> None:
        self.active = 0
        self.rate = 0.0
        self.cursor = 0
        self.t0 = 0.0
        self.due_sent = 0

    def set(self, active: int, now: float, rate: float | None = None) -> None:
        self.active, self.t0, self.due_sent = active, now, 0
        self.rate = float(active if rate is None else rate) if active else 0.0
        self.cursor %= max(active, 1)

    def due(self, now: float) -> int:
        """How many sends are due now (at most one second's worth: a stall is not repaid)."""
        if not self.rate:
            return 0
        want = int((now - self.t0) * self.rate)
        behind = want - self.due_sent
        if behind > self.rate:
            self.due_sent = want - int(self.rate)
            behind = int(self.rate)
        return max(0, behind)

    def next_at(self) -> float:
        return self.t0 + (self.due_sent + 1) / self.rate if self.rate else float("inf")

    def take(self) -> int:
        i = self.cursor
        self.cursor = (self.cursor + 1) % self.active
        self.due_sent += 1
        return i


class Simulator:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.rng = random.Random(spec.get("seed", 1))
        version = int(spec.get("policy_version", 1))
        self.edges = [
            EdgeState(
                topics.edge_telemetry(e),
                edge_template(e, zone, version),
                self.rng.uniform(20, 60),
                self.rng.uniform(300, 500),
                self.rng.uniform(3, 12),
            )
            for e, zone in spec["edges"]
        ]
        capacity = int(spec.get("capacity", 1000))
        self.workers = {
            w: WorkerState(
                w,
                topics.worker_telemetry(w),
                worker_template(w, zone, spec.get("device_class", "x86-cpu"), capacity),
                20.0,
            )
            for w, zone, _key in spec["workers"]
        }
        self.worker_list = list(self.workers.values())
        self.spec = spec
        self.service_s = float(spec.get("service_ms", 20.0)) / 1000.0
        self.jitter_s = float(spec.get("jitter_ms", 5.0)) / 1000.0
        self.edge_cycle, self.worker_cycle = Cycle(), Cycle()
        # (at, worker, job, attempt, edge, service ms)
        self.due: list[tuple[float, str, str, int, str, float]] = []
        self.completion_log: dict[str, float] = {}
        self.counts = {"telemetry": 0, "worker_telemetry": 0, "completions": 0, "late_ms_max": 0.0}
        self.running = True
        self._check_templates()

    def _check_templates(self) -> None:
        now = time.time()
        if self.edges:
            wire.EdgeTelemetry.model_validate_json(self.edges[0].payload(self.rng, now))
        if self.worker_list:
            WorkerTelemetry.model_validate_json(self.worker_list[0].payload(self.rng, now))

    # -- MQTT ----------------------------------------------------------------------------------

    def connect(self) -> None:
        m = self.spec["mqtt"]
        self.client = paho.Client(
            CallbackAPIVersion.VERSION2, client_id=m["identity"], protocol=paho.MQTTv5
        )
        context = ssl.create_default_context(cafile=m["ca"])
        context.load_cert_chain(m["cert"], m["key"])
        self.client.tls_set_context(context)
        self.client.on_socket_open = lambda _c, _u, s: s.setsockopt(  # type: ignore[attr-defined]
            socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
        )
        connected: list[bool] = []
        self.client.on_connect = lambda _c, _u, _f, rc, _p: connected.append(not rc.is_failure)
        self.client.connect("127.0.0.1", m["port"], keepalive=30)
        deadline = time.monotonic() + 10
        while not connected and time.monotonic() < deadline:
            self.client.loop(0.05)
        if not connected or not connected[0]:
            raise SystemExit(f"fleet_sim: no CONNACK as {m['identity']} on port {m['port']}")
        for w, zone, seal_key in self.spec["workers"]:
            caps = WorkerCapabilities(
                worker_id=w,
                zone=zone,
                device_class=self.spec.get("device_class", "x86-cpu"),
                providers=["CPUExecutionProvider"],
                memory_total_mb=64000,
                models={MODEL: ModelCapability(version="1.0.0")},
                max_batch=8,
                concurrency=4,
                seal_key=seal_key,
            )
            self.client.publish(topics.worker_capabilities(w), wire.dump(caps), qos=1, retain=True)
            status = wire.NodeStatus(node=w, kind="pool", zone=zone, state="online")
            self.client.publish(topics.worker_status(w), wire.dump(status), qos=1, retain=True)
        self.worker_cycle.set(len(self.worker_list), time.monotonic())

    # -- commands ------------------------------------------------------------------------------

    def command(self, line: str, now: float) -> None:
        parts = line.split()
        if not parts:
            return
        if parts[0] == "done":
            worker, job, attempt, edge = parts[1], parts[2], int(parts[3]), parts[4]
            self.workers[worker].held.add(job)
            service = max(0.001, self.rng.uniform(-1.0, 1.0) * self.jitter_s + self.service_s)
            heapq.heappush(self.due, (now + service, worker, job, attempt, edge, service * 1e3))
        elif parts[0] == "edges":
            rate = float(parts[2]) if len(parts) > 2 else None
            self.edge_cycle.set(min(int(parts[1]), len(self.edges)), now, rate)
        elif parts[0] == "stats":
            out = dict(self.counts, held=sum(len(w.held) for w in self.worker_list))
            print(json.dumps(out), flush=True)
        elif parts[0] == "log":
            with open(parts[1], "w") as f:
                json.dump(self.completion_log, f)
            print(json.dumps({"log": len(self.completion_log)}), flush=True)
        elif parts[0] == "quit":
            self.running = False

    # -- sending -------------------------------------------------------------------------------

    def send_due(self, now: float) -> None:
        wall = time.time()
        packets: list[bytes] = []
        for _ in range(self.edge_cycle.due(now)):
            edge = self.edges[self.edge_cycle.take()]
            packets.append(edge.head + edge.payload(self.rng, wall))
            self.counts["telemetry"] += 1
        for _ in range(self.worker_cycle.due(now)):
            w = self.worker_list[self.worker_cycle.take()]
            packets.append(w.head + w.payload(self.rng, wall))
            self.counts["worker_telemetry"] += 1
        if packets:
            self._send_raw(packets)
        while self.due and self.due[0][0] <= now:
            at, worker, job, attempt, edge_id, service_ms = heapq.heappop(self.due)
            state = self.workers[worker]
            state.held.discard(job)
            state.done += 1
            done = Completion(
                job_id=job,
                worker_id=worker,
                status="ok",
                model=MODEL,
                service_ms=round(service_ms, 3),
                queue_ms=0.0,
                batch_size=1,
                ts=wall,
                attempt=attempt,
                edge_id=edge_id,
            )
            # Logged before the write: the broker may free the slot and grant it again
            # before this process runs its next line, and the replica check's count of
            # jobs held at once must not see the new grant before this completion.
            sent = time.monotonic()
            self.client.publish(topics.completion(worker), wire.dump(done), qos=1)
            self.completion_log[job] = sent
            self.counts["completions"] += 1
            self.counts["late_ms_max"] = max(self.counts["late_ms_max"], (sent - at) * 1000.0)

    def _send_raw(self, packets: list[bytes]) -> None:
        """Write QoS 0 PUBLISH packets (their fixed header finished here) straight to the
        socket, whole, once paho has written what it queued: a telemetry message costs this
        process a template filled and its share of one write, not a paho publish (the
        figures of the fleet's processes are the point of the bench)."""
        while self.client.want_write():  # paho's packets first, never cut into
            self.client.loop_write()
            if (sock := self.client.socket()) is None:
                raise SystemExit("fleet_sim: lost the MQTT connection")
            if self.client.want_write():
                select.select([], [sock], [], 1.0)
        sock = self.client.socket()
        if sock is None:
            raise SystemExit("fleet_sim: lost the MQTT connection")
        data = memoryview(b"".join(_publish_header(len(p)) + p for p in packets))
        while data:
            try:
                data = data[sock.send(data) :]  # type: ignore[arg-type]
            except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                select.select([], [sock], [], 1.0)

    def next_at(self) -> float:
        nxt = min(self.edge_cycle.next_at(), self.worker_cycle.next_at())
        return min(nxt, self.due[0][0]) if self.due else nxt

    def run(self) -> None:
        stdin = sys.stdin.fileno()
        os.set_blocking(stdin, False)
        pending = b""
        misc = time.monotonic()
        while self.running:
            sock = self.client.socket()
            if sock is None:
                raise SystemExit("fleet_sim: lost the MQTT connection")
            now = time.monotonic()
            wait = min(MAX_WAIT_S, max(SEND_TICK_S, self.next_at() - now))
            if isinstance(sock, ssl.SSLSocket) and sock.pending():
                wait = 0.0
            writers = [sock] if self.client.want_write() else []
            readable, writable, _ = select.select([sock, stdin], writers, [], wait)
            if sock in readable or (isinstance(sock, ssl.SSLSocket) and sock.pending()):
                self.client.loop_read()
            if writable:
                self.client.loop_write()
            now = time.monotonic()
            if stdin in readable:
                chunk = os.read(stdin, 1 << 16)
                if not chunk:
                    break  # the rig went away
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self.command(line.decode(), now)
            self.send_due(now)
            if now - misc >= MISC_S:
                misc = now
                self.client.loop_misc()
        self.client.disconnect()


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    sim = Simulator(spec)
    sim.connect()
    print(json.dumps({"ready": True, "edges": len(sim.edges), "workers": len(sim.workers)}))
    sys.stdout.flush()
    sim.run()


if __name__ == "__main__":
    main()
