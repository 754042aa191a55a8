"""Real tier: the ``sluicegate`` command itself, the README's example, the demo, the client."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

import numpy as np
import paho.mqtt.client as paho
import pytest
import redis
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from sluicegate import AsyncClient, Client, topics
from sluicegate.app.localcampus import LocalCampus, start_campus_mosquitto
from sluicegate.app.servers import ServerProcess, free_port, running, start_mosquitto, start_redis
from sluicegate.config import MqttSettings
from sluicegate.errors import RequestTimeout
from sluicegate.vision.synth import generate
from tests.image_bytes import sample_jpeg
from tests.policies.policy_testkit import key
from tests.support import PlainClient, sluicegate_cmd, start_agent_process, wait_until

pytestmark = pytest.mark.integration
README = Path(__file__).resolve().parents[1] / "README.md"


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        sluicegate_cmd(*args), capture_output=True, text=True, timeout=timeout, check=False
    )


def _status_after(port: int, edge_id: str, action: object) -> dict[str, str]:
    """Run ``action()`` and return the next retained/live status document of ``edge_id``."""
    watcher = PlainClient(port)
    watcher.subscribe(topics.edge_status(edge_id))
    assert b'"online"' in watcher.next().payload  # the retained copy
    action()  # type: ignore[operator]
    doc: dict[str, str] = json.loads(watcher.next(timeout=20).payload)
    watcher.close()
    return doc


def test_edge_run_submit_and_clean_stop(mosquitto: ServerProcess, tmp_path: Path) -> None:
    edge_id = f"cli-{uuid.uuid4().hex[:6]}"
    agent = start_agent_process(mosquitto.port, edge_id, "--zone", "campus/cli/line-1")
    try:
        image = tmp_path / "pit.jpg"
        image.write_bytes(sample_jpeg(3, "pit")[0])
        port = str(mosquitto.port)
        ok = _run("submit", str(image), "--model", "defect-v1", "--edge", edge_id, "--port", port)
        assert ok.returncode == 0, ok.stderr
        doc = json.loads(ok.stdout)
        assert doc["status"] == "ok", doc
        assert doc["outputs"]["label"] == "pit"
        assert doc["ran_on"]["zone"] == "campus/cli/line-1"
        bad = _run("submit", str(image), "--model", "nope", "--edge", edge_id, "--port", port)
        assert bad.returncode == 1
        assert json.loads(bad.stdout)["code"] == "unknown_model"
        offline = _status_after(mosquitto.port, edge_id, lambda: agent.send_signal(signal.SIGTERM))
        assert offline["state"] == "offline"
        assert agent.wait(20) == 0
    finally:
        agent.kill()
        agent.wait()


def test_killed_agent_goes_offline_by_last_will(mosquitto: ServerProcess) -> None:
    edge_id = f"lwt-{uuid.uuid4().hex[:6]}"
    agent = start_agent_process(mosquitto.port, edge_id)
    try:
        status = _status_after(mosquitto.port, edge_id, agent.kill)
    finally:
        agent.kill()
        agent.wait()
    instance = {k: status.pop(k) for k in ("instance", "since", "host")}
    assert status == {
        "v": 1,
        "node": edge_id,
        "kind": "edge",
        "zone": "campus/line-1",
        "state": "offline",
    }
    assert instance["instance"]
    assert instance["since"]


def _readme_example() -> dict[str, list[str]]:
    block = re.search(
        r"<!-- readme-example:begin -->(.*?)<!-- readme-example:end -->", README.read_text(), re.S
    )
    assert block is not None
    commands = {}
    for line in block.group(1).splitlines():
        argv = shlex.split(line)
        if argv and not line.startswith("```"):
            commands[Path(argv[0]).name] = argv
    return commands


def test_readme_mosquitto_example_works(tmp_path: Path) -> None:
    """The README's example, run as written against the demo's secured campus (its edge of
    line 1, its app's certificate), with only the port added."""
    cmds = _readme_example()
    assert set(cmds) == {"mosquitto_sub", "sluicegate", "mosquitto_pub"}
    campus = LocalCampus(
        tmp_path / "campus",
        mqtt_port=free_port(),
        redis_url="redis://127.0.0.1:1/0",  # no broker: the job runs on its edge
        key_for=key,
        nodes=("line-1-pc",),
    )
    files = campus.write()
    for name in ("ca.pem", "app-line-1.pem", "app-line-1.key", "app-campus.pem", "app-campus.key"):
        shutil.copy(files.root / name, tmp_path / name)
    port = ["-p", str(files.mqtt_port)]
    with running(start_campus_mosquitto(files)):
        campus.start()
        # -d makes mosquitto_sub report its SUBACK, so the job is published only once it
        # listens; stdbuf makes it write each line as it happens, as it does on a terminal.
        sub = subprocess.Popen(
            ["stdbuf", "-oL", *cmds["mosquitto_sub"], *port, "-d", "-W", "30"],
            stdout=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        try:
            assert sub.stdout is not None
            while "received SUBACK" not in sub.stdout.readline():
                assert sub.poll() is None
            subprocess.run(sluicegate_cmd(*cmds["sluicegate"][1:]), cwd=tmp_path, check=True)
            subprocess.run([*cmds["mosquitto_pub"], *port], cwd=tmp_path, check=True, timeout=30)
            out, _ = sub.communicate(timeout=40)
        finally:
            sub.kill()
            campus.stop()
    line = next(ln for ln in out.splitlines() if ln.startswith("job-0001 "))
    doc = json.loads(line.removeprefix("job-0001 "))
    assert doc["status"] == "ok", doc
    assert doc["outputs"]["label"] == "scratch"
    assert doc["ran_on"] == {"kind": "edge", "node": "line-1-pc", "zone": "campus/fab-north/line-1"}


def test_sync_client_with_numpy_image_and_timeout(mosquitto: ServerProcess) -> None:
    edge_id = f"py-{uuid.uuid4().hex[:6]}"
    agent = start_agent_process(mosquitto.port, edge_id)
    try:
        img, truth = generate(np.random.default_rng(99), "stain")
        with Client(MqttSettings(port=mosquitto.port), edge=edge_id) as client:
            result = client.infer(
                img,
                model="defect-v1",
                deadline_ms=5000,
                priority=8,
                data_class="wafer",
                job_id="py-job-1",
            )
        assert result.raise_for_status().job_id == "py-job-1"
        assert result.outputs is not None
        assert result.outputs.label == truth
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(20)


async def test_async_client_times_out_when_no_agent_answers(mosquitto: ServerProcess) -> None:
    async with AsyncClient(MqttSettings(port=mosquitto.port), edge="nobody-home") as client:
        with pytest.raises(RequestTimeout, match=r"no result from edge 'nobody-home' within 0\.5s"):
            await client.infer(sample_jpeg()[0], model="defect-v1", timeout=0.5)


def test_demo_runs_end_to_end() -> None:
    # A light rate: on a loaded 2-core CI machine a heavier one lets every recent job expire.
    done = _run("demo", "--seconds", "4", "--rate", "12", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"done: (\d+) submitted, \1 answered", done.stdout), done.stdout
    assert " 0 unanswered" in done.stdout
    # The live view's last frame: each kind of job, and what the models found and read.
    for kind in ("wafers", "parts", "labels"):
        assert re.search(rf"{kind} +(surface-det|ocr-ppocrv4)", done.stdout), done.stdout
    assert re.search(r"SN ?[A-Z0-9]{4}-\d{5}", done.stdout), done.stdout  # a serial, read
    assert re.search(r"no defect|\d (scratch|pit|stain)", done.stdout), done.stdout


def test_cli_errors_are_one_clear_line(tmp_path: Path) -> None:
    missing = _run("edge", "run", "--config", str(tmp_path / "nope.toml"))
    assert missing.returncode == 2
    assert "does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr
    no_file = _run("submit", str(tmp_path / "nope.jpg"), "--model", "defect-v1")
    assert no_file.returncode == 2
    assert "cannot read" in no_file.stderr


def test_models_list_and_synth(tmp_path: Path) -> None:
    listed = _run("models", "list")
    assert listed.returncode == 0
    assert "defect-v1" in listed.stdout
    assert "verified" in listed.stdout
    made = _run("synth", str(tmp_path / "x.png"), "--label", "ok", "--seed", "3")
    assert made.returncode == 0
    assert (tmp_path / "x.png").read_bytes()[:4] == b"\x89PNG"
    wrong = _run("synth", str(tmp_path / "y.jpg"), "--label", "dent")
    assert wrong.returncode == 2
    assert "unknown label 'dent'" in wrong.stderr


def test_demo_on_the_users_servers_removes_what_it_made(tmp_path: Path) -> None:
    """``demo --open --port --redis-port``: afterwards the user's Mosquitto holds none of its
    retained messages or sessions, and the user's Redis none of its keys; what the user had
    there is untouched."""
    with running(start_mosquitto()) as mqtt, running(start_redis()) as store:
        mine = redis.Redis(port=store.port, db=0)
        mine.set("users-own-key", "kept")
        plain = PlainClient(mqtt.port)
        try:
            plain.client.publish("users/own", b"kept", qos=1, retain=True).wait_for_publish(10)
        finally:
            plain.close()
        done = subprocess.run(
            sluicegate_cmd(
                "demo",
                "--open",
                "--port",
                str(mqtt.port),
                "--redis-port",
                str(store.port),
                "--seconds",
                "3",
                "--rate",
                "3",
            ),
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert mine.get("users-own-key") == b"kept"
        for db in range(1, 16):
            assert redis.Redis(port=store.port, db=db).dbsize() == 0, db
        watcher = PlainClient(mqtt.port)
        try:
            watcher.subscribe(f"{topics.ROOT}/#")
            watcher.subscribe("users/own")  # its retained copy comes after the first's
            seen = []
            while (got := watcher.inbox.get(timeout=10)).topic != "users/own":
                seen.append(got.topic)
            assert seen == []
        finally:
            watcher.close()
        for node in ("edge-line-1-pc", "edge-line-2-pc", "pool-north-cpu-1"):
            assert not _session_present(mqtt.port, f"sg-{node}"), node


def _session_present(port: int, client_id: str) -> bool:
    flags: list[bool] = []
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv5)
    client.on_connect = lambda _c, _u, f, _rc, _p: flags.append(f.session_present)
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = 0  # looking must not leave one behind
    client.connect("127.0.0.1", port, clean_start=False, properties=props)
    client.loop_start()
    try:
        wait_until(lambda: flags, timeout=10)
    finally:
        client.disconnect()
        client.loop_stop()
    return flags[0]
