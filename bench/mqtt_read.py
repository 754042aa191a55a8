"""The cost of taking in one small MQTT message: the transport's read path against bare paho.

A campus broker takes in every edge's telemetry (QoS 0, about 700 bytes, 1 Hz per edge), so
what one received message costs the process before any of our code looks at it bounds how
many edges one broker serves. This bench measures that floor: a subscriber process takes
in N telemetry messages from a real Mosquitto, published at a steady rate by a raw-socket
publisher (this process: a few µs a message, no paho), and reports the CPU it spent per
message (user + system, from its first message to its last) and what it received.

Three subscribers, alternated round by round (A, B, C, A, B, C ...), each in its own process:

- ``paho``: a bare paho-mqtt client in ``loop_forever`` with a callback that only counts:
  what paho alone costs, the baseline.
- ``transport``: :class:`sluicegate.mqtt.MqttTransport` on an asyncio loop, subscribed the
  way the broker takes telemetry (the shared subscription), a handler that only counts.
- ``gapped``: the same with the broker's read gap (``[broker] read_gap_ms``, default 2 ms):
  after a read that drained the socket the loop stops watching it that long, so messages
  are read many to a wake-up.

``--tls``: the subscribers read over TLS 1.3 (a listener of the same Mosquitto, its
certificate from a campus CA made for the run), as a campus broker does; the publisher
stays on the plain listener. ``--base DIR``: more arms, ``transport@base`` (and those
``--base-arms`` names), run from another checkout (``git worktree add /tmp/base <commit>``),
to A/B a change.

    .venv/bin/python bench/mqtt_read.py [--messages 20000] [--rate 5000] [--rounds 3]
    .venv/bin/python bench/mqtt_read.py --tls --base /tmp/base

Prints a table and a last ``RESULT {...}`` line (``../shared/BENCHMARKS.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# A ``transport@base`` subscriber imports sluicegate from the other checkout (``--code``).
sys.path.insert(
    0,
    sys.argv[sys.argv.index("--code") + 1]
    if "--code" in sys.argv
    else str(Path(__file__).resolve().parents[1]),
)

from bench import stats
from sluicegate import pki, topics
from sluicegate.app.servers import free_port, running, start_mosquitto

EDGES = 5000
TARGET_US = 50.0  # issue 19: broker CPU per telemetry message, all of it, not only this
MODES = ("paho", "transport", "gapped")


# -- the publisher: MQTT v5 packets built by hand, written to a socket -----------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _packet(header: int, body: bytes) -> bytes:
    return bytes([header]) + _varint(len(body)) + body


def _string(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("!H", len(raw)) + raw


def connect_packet(client_id: str) -> bytes:
    # protocol name, level 5, clean start, keepalive 60 s, no properties; the client id.
    return _packet(
        0x10,
        _string("MQTT") + bytes([5, 0x02]) + struct.pack("!H", 60) + b"\x00" + _string(client_id),
    )


def publish_packet(topic: str, payload: bytes) -> bytes:
    return _packet(0x30, _string(topic) + b"\x00" + payload)  # QoS 0, no properties


def telemetry(edge_id: str) -> bytes:
    """An edge's telemetry, the shape the fleet simulator sends."""
    import random

    from bench.fleet_sim import EdgeState, edge_template

    state = EdgeState(
        topics.edge_telemetry(edge_id),
        edge_template(edge_id, "plant/a", 1),
        cpu=30.0,
        rss=400.0,
        svc=8.0,
    )
    return state.payload(random.Random(edge_id), time.time())


def publish(port: int, count: int, rate: float) -> None:
    """Publish ``count`` telemetry messages at ``rate`` a second, from a raw socket."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(connect_packet(f"bench-read-pub-{os.getpid()}"))
    if sock.recv(64)[:1] != b"\x20":
        raise SystemExit("the publisher got no CONNACK")
    packets = [
        publish_packet(topics.edge_telemetry(f"edge-{k:05d}"), telemetry(f"edge-{k:05d}"))
        for k in range(EDGES)
    ]
    start, sent = time.perf_counter(), 0
    while sent < count:
        due = min(count, int((time.perf_counter() - start) * rate) + 1)
        if due > sent:
            sock.sendall(b"".join(packets[k % EDGES] for k in range(sent, due)))
            sent = due
        else:
            time.sleep(0.0005)
    sock.close()


# -- the subscribers (each in a process of its own) ------------------------------------------


def _report(received: int, cpu_s: float, wall_s: float) -> None:
    print(json.dumps({"received": received, "cpu_s": cpu_s, "wall_s": wall_s}), flush=True)


def sub_paho(port: int, count: int, idle_s: float, ca: str) -> None:
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    client = paho.Client(CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
    seen = {"n": 0, "cpu": 0.0, "wall": 0.0, "last": time.monotonic()}

    def on_message(_c: Any, _u: Any, _m: Any) -> None:
        if seen["n"] == 0:
            seen["cpu"], seen["wall"] = time.process_time(), time.perf_counter()
        seen["n"] += 1
        seen["last"] = time.monotonic()
        if seen["n"] >= count:
            client.disconnect()

    def on_subscribe(*_a: Any) -> None:
        print("ready", flush=True)

    client.on_message = on_message
    client.on_subscribe = on_subscribe
    if ca:
        client.tls_set(ca_certs=ca)
    client.connect("127.0.0.1", port)
    client.subscribe(topics.edge_telemetry_shared(), qos=0)
    while client.loop(timeout=0.05) == 0:
        if seen["n"] and time.monotonic() - seen["last"] > idle_s:
            break  # the rest was lost: report what came
    _report(int(seen["n"]), time.process_time() - seen["cpu"], time.perf_counter() - seen["wall"])


async def sub_transport(port: int, count: int, idle_s: float, ca: str, *, gapped: bool) -> None:
    from sluicegate.config import BrokerSettings, MqttSettings
    from sluicegate.mqtt import MqttTransport
    from sluicegate.transport import Message

    done = asyncio.Event()
    seen = {"n": 0, "cpu": 0.0, "wall": 0.0, "last": time.monotonic()}

    def handler(_msg: Message) -> None:
        if seen["n"] == 0:
            seen["cpu"], seen["wall"] = time.process_time(), time.perf_counter()
        seen["n"] += 1
        seen["last"] = time.monotonic()
        if seen["n"] >= count:
            done.set()

    settings = MqttSettings(host="127.0.0.1", port=port, tls_ca_file=Path(ca) if ca else None)
    client_id = f"bench-read-{os.getpid()}"
    if gapped:
        gap_s = BrokerSettings().read_gap_ms / 1000.0
        transport = MqttTransport(settings, client_id=client_id, read_gap_s=gap_s)
    else:  # as a checkout from before the read gap builds it too
        transport = MqttTransport(settings, client_id=client_id)
    await transport.connect()
    await transport.subscribe(topics.edge_telemetry_shared(), handler, qos=0)
    print("ready", flush=True)
    while not done.is_set():
        with_timeout = asyncio.wait_for(done.wait(), 0.05)
        try:
            await with_timeout
        except TimeoutError:
            if seen["n"] and time.monotonic() - seen["last"] > idle_s:
                break
    cpu, wall = time.process_time() - seen["cpu"], time.perf_counter() - seen["wall"]
    await transport.close()
    _report(int(seen["n"]), cpu, wall)


# -- the run ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rig:
    """The Mosquitto of the run: where the publisher writes, where subscribers read (over
    TLS when ``ca``, our CA file, is set), and the other checkout of ``@base`` arms."""

    pub_port: int
    sub_port: int
    ca: str
    base: str


def tls_listener(folder: Path, port: int) -> tuple[str, ...]:
    """Mosquitto's lines for a TLS 1.3 listener on ``port``, its certificate from a campus
    CA made here (``folder/ca.pem``); no client certificate asked for."""
    now = time.time()
    ca = pki.new_authority("bench", now=now)
    key, cert = pki.server_identity(ca, ["127.0.0.1"], now=now)
    (folder / "ca.pem").write_bytes(pki.cert_pem(ca.cert))
    (folder / "server.pem").write_bytes(pki.cert_pem(cert))
    pki.write_private(folder / "server.key", pki.key_pem(key))
    return (
        f"listener {port} 127.0.0.1",
        f"cafile {folder / 'ca.pem'}",
        f"certfile {folder / 'server.pem'}",
        f"keyfile {folder / 'server.key'}",
        "tls_version tlsv1.3",
    )


def one_round(mode: str, rig: Rig, count: int, rate: float) -> dict[str, float]:
    name = mode.removesuffix("@base")
    argv = [sys.executable, __file__, "--subscriber", name, "--port", str(rig.sub_port)]
    argv += ["--messages", str(count), "--ca", rig.ca]
    if name != mode:
        argv += ["--code", rig.base]
    sub = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert sub.stdout is not None
    if sub.stdout.readline().strip() != "ready":
        raise SystemExit(f"the {mode} subscriber did not start")
    publish(rig.pub_port, count, rate)
    line = sub.stdout.readline()
    sub.wait(30)
    got = json.loads(line)
    n = max(1, got["received"])
    return {
        "us_per_msg": got["cpu_s"] / n * 1e6,
        "received": got["received"],
        "msgs_per_s": n / max(got["wall_s"], 1e-9),
        "cpu_share": got["cpu_s"] / max(got["wall_s"], 1e-9),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--rate", type=float, default=5_000.0, help="messages a second")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tls", action="store_true", help="the subscribers read over TLS 1.3")
    ap.add_argument("--base", default="", help="another checkout: a transport@base arm")
    ap.add_argument(
        "--base-arms",
        default="transport",
        help="the arms run from --base too, e.g. transport,gapped",
    )
    ap.add_argument("--subscriber", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--ca", default="", help=argparse.SUPPRESS)
    ap.add_argument("--code", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.subscriber:
        if args.subscriber == "paho":
            sub_paho(args.port, args.messages, idle_s=2.0, ca=args.ca)
        else:
            gapped = args.subscriber == "gapped"
            read = sub_transport(args.port, args.messages, idle_s=2.0, ca=args.ca, gapped=gapped)
            asyncio.run(read)
        return
    at_base = [f"{m}@base" for m in args.base_arms.split(",") if m] if args.base else []
    modes = (*MODES, *at_base)
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="sg-mqtt-read-") as tmp:
        tls_port = free_port()
        extra = tls_listener(Path(tmp), tls_port) if args.tls else ()
        with running(start_mosquitto(extra_config=extra)) as mosq:
            ca = str(Path(tmp) / "ca.pem") if args.tls else ""
            rig = Rig(mosq.port, tls_port if args.tls else mosq.port, ca, args.base)
            one_round("transport", rig, 2_000, args.rate)  # warm-up
            for _ in range(args.rounds):
                for mode in modes:
                    runs[mode].append(one_round(mode, rig, args.messages, args.rate))
    summary = {}
    over = "over TLS 1.3" if args.tls else "over plain TCP"
    print(
        f"{args.messages} telemetry messages at {args.rate:.0f}/s {over}, {args.rounds} rounds each"
    )
    head = f"{'subscriber':<12}{'µs CPU/msg p50':>16}{'min':>8}{'max':>8}"
    print(head + f"{'received':>10}{'CPU share':>11}")
    for mode in modes:
        us = [r["us_per_msg"] for r in runs[mode]]
        got = min(int(r["received"]) for r in runs[mode])
        share = stats.median(r["cpu_share"] for r in runs[mode])
        summary[mode] = {
            "us_per_msg_p50": round(stats.median(us), 1),
            "us_min": round(min(us), 1),
            "us_max": round(max(us), 1),
            "received_min": got,
            "cpu_share": round(share, 3),
        }
        print(
            f"{mode:<12}{stats.median(us):>16.1f}{min(us):>8.1f}{max(us):>8.1f}"
            f"{got:>10}{share:>11.2f}"
        )
    p50 = {mode: summary[mode]["us_per_msg_p50"] for mode in modes}
    ratios = {
        "transport_over_paho": round(p50["transport"] / p50["paho"], 2),
        "gapped_over_paho": round(p50["gapped"] / p50["paho"], 2),
        "gapped_over_transport": round(p50["gapped"] / p50["transport"], 2),
    }
    for arm in at_base:
        mode = arm.removesuffix("@base")
        ratios[f"{mode}_over_base"] = round(p50[mode] / p50[arm], 2)
    print(", ".join(f"{k.replace('_over_', ' / ')}: {v:.2f}x" for k, v in ratios.items()))
    result = {
        "bench": "mqtt_read",
        "subject": summary["gapped"],
        "baseline": summary["paho"],
        "arms": summary,
        "ratio": ratios,
        "target": {"us_per_msg_all_work": TARGET_US},
        "met": p50["gapped"] < TARGET_US,
        "messages": args.messages,
        "rate": args.rate,
        "rounds": args.rounds,
        "tls": args.tls,
        "base": args.base,
        "measured": stats.require(
            {f"messages received by {mode}": summary[mode]["received_min"] for mode in modes}
        ),
        "machine": stats.machine("redis"),
    }
    print(stats.result_line(result))


if __name__ == "__main__":
    main()
