"""Real tier: ``docs/deployment.md``'s "A campus from nothing", followed as written, up to a
job an enrolled app submits and its edge serves.

The commands are read from the page's ``sh`` blocks, in order, and run with the installed
``sluicegate``; what the page tells an operator to do in words (edit ``broker.toml``, start
a service, make the app's token) is done here, each time after checking that the page
still says it. Where the page speaks of a real plant, the run maps it onto this machine,
one rule each (:meth:`Plant.localize`): ``sudo`` is dropped, ``/etc`` and ``/var/lib`` live
under a temporary root (``--root`` for the installers), ``~`` is a temporary home, the
plant's host names are this machine and its ports free ones, a ``…`` placeholder is the
key or token the page's previous command printed, and ``systemctl`` starts, reloads and
restarts the processes themselves. A command the rules do not know fails the test: a page
that changes is run as it now reads, or the test says which line it cannot follow.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import pytest

from sluicegate import Client
from sluicegate.app.servers import free_port
from sluicegate.config import MqttSettings
from tests.image_bytes import sample_jpeg
from tests.support import sluicegate_cmd, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DOC = Path(__file__).resolve().parents[1] / "docs" / "deployment.md"
SECTION = ("## A campus from nothing", "## Metrics of edges and workers")
HOSTS = {
    "mqtt.fab-north.example": "localhost",  # the name in Mosquitto's certificate
    "broker.fab-north.example": "127.0.0.1",
    "10.0.0.5": "127.0.0.1",
}
KEY = re.compile(r"ed25519:[A-Za-z0-9_-]{43}")
TOKEN = re.compile(r"sgjoin1\.[A-Za-z0-9_.=-]+")


def section() -> str:
    text = DOC.read_text()
    start, end = text.index(SECTION[0]), text.index(SECTION[1])
    return text[start:end]


def blocks() -> list[list[str]]:
    """Each ``sh`` block of the section: its commands, continuation lines joined, comments
    dropped, ``a && b`` as two."""
    found = []
    for body in re.findall(r"```sh\n(.*?)```", section(), re.S):
        joined = body.replace("\\\n", " ")
        commands = []
        for line in joined.splitlines():
            line = line.split("  #")[0].strip()
            commands += [part.strip() for part in line.split(" && ") if part.strip()]
        found.append(commands)
    return found


def says(*phrases: str) -> None:
    """The page still tells the operator this (what the test then does for them)."""
    flat = " ".join(section().split())
    for phrase in phrases:
        assert phrase in flat, f"docs/deployment.md no longer says {phrase!r}"


class Plant:
    """The campus of the page on this machine: its files under ``root``, its processes."""

    def __init__(self, tmp: Path, redis_url: str) -> None:
        self.root = tmp / "root"
        self.home = tmp / "home"
        self.cwd = tmp / "officer"
        for folder in (self.root, self.home, self.cwd):
            folder.mkdir()
        self.mqtt_port, self.http_port = free_port(), free_port()
        self.redis_url = redis_url
        self.printed: list[str] = []  # every line the commands printed, in order
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}

    # -- the page's words on this machine ------------------------------------------------

    def localize(self, command: str) -> list[str] | None:
        """``command`` as run here (None: done here by other means, e.g. ``systemctl``)."""
        text = command.removeprefix("sudo ")
        for name, here in HOSTS.items():
            text = text.replace(name, here)
        text = text.replace(":8883", f":{self.mqtt_port}").replace(":8780", f":{self.http_port}")
        text = re.sub(r"(?<![\w.])/(etc|var/lib)/", rf"{self.root}/\1/", text)
        text = text.replace("~/", f"{self.home}/")
        argv = shlex.split(text)
        if argv[0] == "systemctl":
            self.systemctl(argv[1:])
            return None
        if argv[0] == "chown":
            return None  # the files are this user's already
        if argv[0] == "install":
            Path(argv[-1]).parent.mkdir(parents=True, exist_ok=True)
            return argv
        assert argv[0] == "sluicegate", f"the test does not know how to run {command!r}"
        argv = [*sluicegate_cmd(), *argv[1:]]
        if "ed25519:…" in argv:
            argv[argv.index("ed25519:…")] = self.key_of(self.node_in(argv))
        if "sgjoin1.…" in argv:
            argv[argv.index("sgjoin1.…")] = self.last(TOKEN)
        if argv[1:3] == ["mosquitto", "config"]:
            persist = self.root / "var/lib/mosquitto"
            persist.mkdir(parents=True, exist_ok=True)
            argv += ["--port", str(self.mqtt_port), "--bind", "127.0.0.1"]
            argv += ["--persistence-dir", str(persist), "--user", getpass.getuser()]
        if "install" in argv and "--root" not in argv:
            argv += ["--root", str(self.root)]
        return argv

    @staticmethod
    def node_in(argv: list[str]) -> str:
        for flag in ("--broker", "--edge", "--worker", "--node"):
            if flag in argv:
                return argv[argv.index(flag) + 1]
        raise AssertionError(f"no node named in {argv}")

    def key_of(self, node: str) -> str:
        """The key the latest output line naming ``node`` printed."""
        for line in reversed(self.printed):
            if re.search(rf"(?<![\w-]){re.escape(node)}(?![\w-])", line) and KEY.search(line):
                return KEY.findall(line)[-1]
        raise AssertionError(f"no command printed the key of {node}")

    def last(self, pattern: re.Pattern[str]) -> str:
        for line in reversed(self.printed):
            if found := pattern.search(line):
                return found.group(0)
        raise AssertionError(f"no command printed {pattern.pattern}")

    def run(self, command: str) -> str:
        argv = self.localize(command)
        if argv is None:
            return ""
        done = subprocess.run(argv, cwd=self.cwd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
        self.printed += (done.stdout + done.stderr).splitlines()
        return done.stdout

    # -- systemctl, for the services the page names --------------------------------------

    def systemctl(self, args: list[str]) -> None:
        verb, unit = args[0], args[-1]
        if verb == "reload":
            assert unit == "mosquitto", args
            self.procs["mosquitto"].send_signal(signal.SIGHUP)  # rereads its ACL
            return
        assert verb in ("restart", "enable"), args
        name = unit.removeprefix("sluicegate-")
        self.stop(name)
        self.start(name)

    def start(self, name: str) -> None:
        env = dict(os.environ)
        if name == "mosquitto":
            argv = ["mosquitto", "-c", str(self.root / "etc/mosquitto/mosquitto.conf")]
            ready = ""  # it logs nothing at start: its port answers
        else:
            config = self.root / f"etc/sluicegate/{name}.toml"
            argv = sluicegate_cmd(name, "run", "--config", str(config), "--log-level", "info")
            ready = "serving placements" if name == "broker" else "serving"
            # The machine's own Redis and ports are not this campus's.
            env |= {
                "SLUICEGATE_MQTT__PORT": str(self.mqtt_port),
                "SLUICEGATE_BROKER__REDIS_URL": self.redis_url,
                "SLUICEGATE_BROKER__HTTP_PORT": str(self.http_port),
            }
        log = self.logs.setdefault(name, self.cwd / f"{name}.log")
        out: IO[bytes] = log.open("ab")
        offset = log.stat().st_size
        self.procs[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        out.close()
        wait_until(lambda: self._up(name, offset, ready), timeout=60)

    def _up(self, name: str, offset: int, text: str) -> bool:
        proc = self.procs[name]
        assert proc.poll() is None, f"{name} exited:\n{self.logs[name].read_text()[-3000:]}"
        if not text:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.mqtt_port), timeout=1),
            ):
                return True
            return False
        return text in self.logs[name].read_bytes()[offset:].decode(errors="replace")

    def stop(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def close(self) -> None:
        for name in list(self.procs)[::-1]:
            self.stop(name)


@pytest.fixture
def plant(tmp_path: Path, fresh_redis_db: Callable[[], str]) -> Iterator[Plant]:
    if shutil.which("mosquitto") is None:
        pytest.skip("mosquitto is not installed")
    campus = Plant(tmp_path, fresh_redis_db())
    try:
        yield campus
    finally:
        campus.close()


def first_policy(officer_line: str) -> str:
    """What the officers write before anything enrolls: the campus, its zone, a class."""
    name, _, key = officer_line.partition(" = ")
    return (
        'format = "sluicegate-policy/1"\ncampus = "acme-semi"\nversion = 1\n'
        "expires = 2030-01-01T00:00:00Z\n\n"
        f"[policy_signers]\nthreshold = 1\nkeys = {{ {name} = {key} }}\n\n"
        '[zones]\n"campus/fab-north/line-3" = "Fab North, inspection line 3"\n\n'
        '[classes.wafer-image]\ndescription = "Raw wafer images"\nallow = ["campus/**"]\n'
    )


def test_a_campus_from_nothing_as_the_page_says_serves_an_apps_job(plant: Plant) -> None:
    keygen, check_sign, campus_host, broker, edge_token, edge_install, listing, app_entry = (
        blocks()[:8]
    )
    publish = blocks()[8]
    says("policy add-node", "Changing the policy")
    assert any("policy sign" in c for c in check_sign)
    assert "sudo systemctl reload" in publish[3]

    # 1. The officer's key, the first policy, checked and signed.
    officer_line = plant.run(keygen[0]).strip().splitlines()[-1]
    (plant.cwd / "campus.toml").write_text(first_policy(officer_line))
    for command in check_sign:
        plant.run(command)

    # 2. The CA, Mosquitto's certificate, ACL and configuration; Mosquitto (re)started.
    for command in campus_host:
        plant.run(command)
    assert "mosquitto" in plant.procs

    # 3. The first broker replica, its settings as the page says, its service started.
    for command in broker:
        plant.run(command)
    says('set `ca_dir = "/var/lib/sluicegate/broker/ca"` and `http_host`')
    config = plant.root / "etc/sluicegate/broker.toml"
    text = config.read_text()
    ca_dir = plant.root / "var/lib/sluicegate/broker/ca"
    text = text.replace('# ca_dir = "/var/lib/sluicegate/broker/ca"', f'ca_dir = "{ca_dir}"')
    config.write_text(text.replace('# http_host = "127.0.0.1"', 'http_host = "127.0.0.1"'))
    says("then `sudo systemctl enable --now sluicegate-broker`")
    plant.run("sudo systemctl enable --now sluicegate-broker")

    # 4. The line PC: its token, its install, the officers list it, the policy published.
    plant.run(edge_token[0])
    plant.run(edge_install[0])
    for command in listing:
        plant.run(command)
    for command in publish:
        plant.run(command)
    says("start the PC's service: `sudo systemctl enable --now sluicegate-edge`")
    plant.run("sudo systemctl enable --now sluicegate-edge")

    # 6. The app: its token (--role app, its line's zone), enrolled, listed, published.
    says("makes a token with `--role app` (its zone: the line it serves)")
    app_token = edge_token[0].replace(
        "--node line-3-pc --role edge", "--node line-3-inspect --role app"
    )
    assert app_token != edge_token[0]
    plant.run(app_token)
    says("`sluicegate enroll app --join sgjoin1.… --out-dir ~/app-tls`")
    plant.run("sluicegate enroll app --join sgjoin1.… --out-dir ~/app-tls")
    for command in app_entry:
        plant.run(command)
    for command in publish:
        plant.run(command)

    # The app submits to its line's edge, as itself over TLS, and its job is served.
    tls = plant.home / "app-tls"
    mqtt = MqttSettings(
        host="localhost",
        port=plant.mqtt_port,
        tls_ca_file=tls / "ca.pem",
        tls_cert_file=tls / "node.pem",
        tls_key_file=tls / "node.key",
    )
    image, _ = sample_jpeg(7, "scratch")

    with Client(mqtt, edge="line-3-pc", default_timeout=20) as client:
        result = client.infer(image, model="defect-v1", data_class="wafer-image")
    assert result.status == "ok", (result.code, result.reason)
    assert result.ran_on.node == "line-3-pc"

    # 7. Every node checked.
    says("`sudo sluicegate doctor --config /etc/sluicegate/edge.toml` on each machine")
    report = plant.run("sudo sluicegate doctor --config /etc/sluicegate/edge.toml")
    assert "line-3-pc" in report
