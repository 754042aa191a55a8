"""Real tier: an edge agent's and a pool worker's ``/metrics`` scraped over HTTP while they
serve, against what the apps really received. An edge in this process on the plain test
Mosquitto (no broker: every job runs here), and a campus of processes (a broker, a line PC
and a worker, the :class:`LocalCampus` the demo runs) where a volley is partly offloaded.
Counts are compared exactly; no time is asserted.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import socket
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from policies import SigningKey
from sluicegate import AsyncClient, topics
from sluicegate.app.campus import APP_OF_LINE, APPS
from sluicegate.app.localcampus import LocalCampus
from sluicegate.app.servers import ServerProcess, free_port
from sluicegate.config import Settings, load_settings
from sluicegate.vision.runtime import ModelRegistry, default_models_dir
from tests.image_bytes import sample_jpeg
from tests.metrics_kit import Samples, scrape, total
from tests.pool_kit import SPARE_EDGES, WORKER, WORKER_ZONE, WorkSpec, write_policy_file
from tests.support import AgentThread, PlainClient, installed_policy, local_campus, wait_until
from tests.test_pool_integration import WorkerThread, publish_work

pytestmark = pytest.mark.integration

JPEG, _ = sample_jpeg(7)


@pytest.fixture(scope="module")
def registry() -> ModelRegistry:
    return ModelRegistry.from_dir(default_models_dir())


def edge_settings(mosquitto: ServerProcess, **edge: Any) -> Settings:
    return load_settings(
        mqtt={"port": mosquitto.port, "plaintext": True},
        offload={"policy_file": installed_policy()},
        edge={"id": f"edge-{uuid.uuid4().hex[:8]}", "zone": "campus/test/line-1", **edge},
    )


@pytest.fixture(scope="module")
def edge(mosquitto: ServerProcess, registry: ModelRegistry) -> Iterator[AgentThread]:
    settings = edge_settings(mosquitto, metrics_port=free_port())  # host: the default
    watcher = PlainClient(mosquitto.port)
    agent = AgentThread(settings, registry)
    agent.start(watcher)
    watcher.close()
    yield agent
    agent.stop()


def url_of(agent: AgentThread) -> str:
    return f"http://127.0.0.1:{agent.settings.edge.metrics_port}/metrics"


def submit(mosquitto: ServerProcess, agent: AgentThread, n: int, **props: str) -> list[Any]:
    """``n`` jobs from a plain MQTT v5 client; their result documents, as it received them."""
    client = PlainClient(mosquitto.port)
    reply_to = f"tests/{uuid.uuid4().hex[:8]}/results"
    client.subscribe(reply_to)
    user = [(topics.PROP_MODEL, "defect-v1"), *((k, v) for k, v in props.items())]
    try:
        for _ in range(n):
            corr = uuid.uuid4().bytes  # a job id of its own (derived from it and the image)
            client.submit(
                agent.settings.edge.id, JPEG, response_topic=reply_to, correlation=corr, user=user
            )
        return [json.loads(client.next().payload) for _ in range(n)]
    finally:
        client.close()


def test_an_edges_counters_are_the_jobs_its_app_received(
    mosquitto: ServerProcess, edge: AgentThread
) -> None:
    before = scrape(url_of(edge))
    results = submit(mosquitto, edge, 6, **{topics.PROP_DEADLINE_MS: "30000"})
    after = scrape(url_of(edge))

    def grew(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert Counter(r["status"] for r in results) == {"ok": 6}
    assert grew("sluicegate_edge_results_total", status="ok") == 6
    assert grew("sluicegate_edge_jobs_run_total", ran_on="edge") == 6  # no broker: all here
    assert grew("sluicegate_edge_jobs_run_total", ran_on="pool") == 0
    assert grew("sluicegate_edge_stayed_local_total") == 6
    assert grew("sluicegate_edge_deadline_total") == 6  # every one had a deadline
    assert grew("sluicegate_edge_job_seconds_count", ran_on="edge", part="total") == 6
    assert grew("sluicegate_edge_model_completed_total", model="defect-v1") == 6
    assert grew("sluicegate_edge_events_total", event="accepted") == 6
    assert total(after, "sluicegate_edge_policy_version") >= 1  # it holds the installed one


def test_a_job_with_an_impossible_deadline_counts_missed(
    mosquitto: ServerProcess, edge: AgentThread
) -> None:
    before = scrape(url_of(edge))
    [result] = submit(mosquitto, edge, 1, **{topics.PROP_DEADLINE_MS: "0.001"})
    after = scrape(url_of(edge))
    assert result["status"] == "expired"
    missed = {"outcome": "missed"}
    met = {"outcome": "met"}
    name = "sluicegate_edge_deadline_total"
    assert total(after, name, **missed) - total(before, name, **missed) == 1
    assert total(after, name, **met) == total(before, name, **met)


def test_metrics_listen_on_localhost_by_default(edge: AgentThread) -> None:
    port = edge.settings.edge.metrics_port
    listening = [
        c.laddr
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
    ]
    assert [a.ip for a in listening] == ["127.0.0.1"]


def test_a_taken_metrics_port_leaves_the_edge_serving(
    mosquitto: ServerProcess, registry: ModelRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = edge_settings(mosquitto, metrics_port=port)
        watcher = PlainClient(mosquitto.port)
        agent = AgentThread(settings, registry)
        with caplog.at_level(logging.ERROR, logger="sluicegate.node_metrics"):
            agent.start(watcher)
        watcher.close()
        try:
            [result] = submit(mosquitto, agent, 1)
        finally:
            agent.stop()
    assert result["status"] == "ok"
    [error] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert f"127.0.0.1:{port}" in error
    assert "[edge] metrics_host/metrics_port" in error


def test_a_taken_metrics_port_leaves_the_worker_serving(
    mosquitto: ServerProcess, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key_file = tmp_path / "worker.key"
    key_file.write_bytes(SigningKey.generate().to_pem())
    edge = SPARE_EDGES[-1]
    client = PlainClient(mosquitto.port)
    client.subscribe(topics.edge_returns(edge, WORKER))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = load_settings(
            mqtt={"port": mosquitto.port, "plaintext": True},
            pool={
                "id": WORKER,
                "zone": WORKER_ZONE,
                "key_file": key_file,
                "policy_file": write_policy_file(tmp_path),
                "state_dir": tmp_path / "state",
                "metrics_port": port,
            },
        )
        worker = WorkerThread(settings)
        with caplog.at_level(logging.ERROR, logger="sluicegate.node_metrics"):
            worker.start(client)
        try:
            publish_work(client, WorkSpec(edge=edge).message())
            got = client.next()
            while got.topic != topics.edge_returns(edge, WORKER):  # past the status
                got = client.next()
        finally:
            worker.stop()
            client.close()
    assert json.loads(got.payload)["status"] == "ok"
    [error] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert f"127.0.0.1:{port}" in error
    assert "[pool] metrics_host/metrics_port" in error


# -- a campus: the edge offloads part of a volley to the worker ---------------------------------


@pytest.fixture(scope="module")
def campus(
    tmp_path_factory: pytest.TempPathFactory, fresh_redis_db: Callable[[], str]
) -> Iterator[LocalCampus]:
    with local_campus(
        tmp_path_factory.mktemp("metrics-campus"),
        fresh_redis_db(),
        nodes=("broker-1", "line-1-pc", "north-cpu-1"),
        # An offloaded job waits for its worker's return however loaded this machine is:
        # none is offered again or run here meanwhile, so each ran exactly once.
        node_env={"line-1-pc": {"SLUICEGATE_OFFLOAD__RESULT_TIMEOUT_S": "120"}},
    ) as lc:
        yield lc


def counted(url: str, jobs: int) -> Samples | None:
    """The edge's metrics once it has counted ``jobs`` ok results (None before)."""
    found = scrape(url)
    return found if total(found, "sluicegate_edge_jobs_run_total") >= jobs else None


async def volley(campus: LocalCampus, edge: str, n: int) -> list[Any]:
    """``n`` wafer images at once from the line's own app (a one-slot line PC asks the
    broker once more than ``queue_bound`` wait)."""
    app = APP_OF_LINE[edge]
    reply_to = f"{APPS[app][1]}/metrics-{uuid.uuid4().hex[:6]}"
    async with AsyncClient(campus.write().mqtt(app), edge=edge, response_topic=reply_to) as c:
        jobs = [
            c.infer(JPEG, model="defect-v1", deadline_ms=120_000, data_class="wafer-image")
            for _ in range(n)
        ]
        return list(await asyncio.gather(*jobs))


@pytest.mark.slow
def test_edge_and_worker_metrics_add_up_to_what_the_app_received(campus: LocalCampus) -> None:
    urls = campus.metrics_urls()
    assert set(urls) == {"line-1-pc", "north-cpu-1"}
    broker = f"http://127.0.0.1:{campus.http_port}/metrics"
    # The broker places work once the worker's telemetry is in.
    wait_until(lambda: total(scrape(broker), "sluicegate_workers", state="healthy"), timeout=30)
    sent = 0
    ran: Counter[str] = Counter()
    # Volleys, a scrape after each, until one was partly offloaded: the counters follow the
    # nodes throughout.
    for volleys in range(1, 7):
        if volleys > 2 and ran["pool"]:
            break
        n = 16
        results = asyncio.run(volley(campus, "line-1-pc", n))
        sent += n
        assert {r.status for r in results} == {"ok"}, [(r.status, r.code) for r in results]
        assert {r.ran_on.node for r in results} <= {"line-1-pc", "north-cpu-1"}
        ran.update(r.ran_on.kind for r in results)
        e, w = {"edge": "line-1-pc"}, {"worker": "north-cpu-1"}
        # A worker's result may reach the app while the edge commits it (forwarded); the
        # edge counts it once committed, a moment later.
        edge = wait_until(functools.partial(counted, urls["line-1-pc"], sent), timeout=15)
        worker = scrape(urls["north-cpu-1"])
        here = total(edge, "sluicegate_edge_jobs_run_total", **e, ran_on="edge")
        there = total(edge, "sluicegate_edge_jobs_run_total", **e, ran_on="pool")
        assert (here, there) == (ran["edge"], ran["pool"])
        assert here + there == sent
        assert total(edge, "sluicegate_edge_results_total", **e, status="ok") == sent
        assert total(edge, "sluicegate_edge_deadline_total", **e) == sent
        assert total(edge, "sluicegate_edge_stayed_local_total", **e) == here
        assert total(edge, "sluicegate_edge_job_seconds_count", **e, part="transfer") == there
        assert total(worker, "sluicegate_worker_jobs_total", **w, status="ok") == there
        assert total(worker, "sluicegate_worker_jobs_total", **w) == there  # all it returned
        assert total(worker, "sluicegate_worker_job_seconds_count", **w) == there
        assert total(worker, "sluicegate_worker_refused_total", **w) == 0
        assert total(edge, "sluicegate_edge_offloaded_total", **e) == there
    why = {
        dict(ls)["code"]: v for (n, ls), v in edge.items() if n.startswith("sluicegate_edge_stayed")
    }
    assert ran["pool"] > 0, f"a one-slot line PC under volleys of 16 must offload some: {why}"
    assert ran["edge"] > 0
    info = [labels for (name, labels) in worker if name == "sluicegate_worker_info"]
    assert dict(info[0])["pool"]
    assert dict(info[0])["device"] == "x86-cpu-dc"
