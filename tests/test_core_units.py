"""Pure tier: topics, configuration, wire models and the service-time model."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.load import ServiceTimes
from sluicegate import topics, wire
from sluicegate.config import load_settings
from sluicegate.errors import ConfigError


@pytest.mark.parametrize(
    ("topic_filter", "topic", "expected"),
    [
        ("a/b/c", "a/b/c", True),
        ("a/+/c", "a/x/c", True),
        ("a/+/c", "a/x/y/c", False),
        ("a/#", "a/x/y/c", True),
        ("a/#", "a", True),  # MQTT: "#" also matches the parent level
        ("sluicegate/v1/edge/+/telemetry", topics.edge_telemetry("e1"), True),
        ("sluicegate/v1/edge/+/telemetry", topics.edge_status("e1"), False),
        ("a/b", "a/b/c", False),
    ],
)
def test_topic_filter_matching(topic_filter: str, topic: str, expected: bool) -> None:
    assert topics.matches(topic_filter, topic) is expected


@pytest.mark.parametrize("bad", ["", "a/b", "a+b", "#", "x" * 65, "-lead"])
def test_ids_that_would_break_topics_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid edge id"):
        topics.check_id("edge id", bad)


def test_topics_are_versioned_and_scoped() -> None:
    assert topics.edge_submit("line-3") == "sluicegate/v1/edge/line-3/jobs"
    work = topics.pool_work("campus/fab-north/dc", "gpu-1", "line-3")
    assert work == "sluicegate/v1/pool/campus/fab-north/dc/gpu-1/work/line-3"


@pytest.mark.parametrize(
    ("topic", "filter_of_all", "sender"),
    [
        (topics.placement_request("line-3"), topics.placement_requests_all(), "line-3"),
        (topics.placement_release("line-3"), topics.placement_releases_all(), "line-3"),
        (topics.completion("gpu-1"), topics.completions_all(), "gpu-1"),
        (topics.edge_returns("line-3", "gpu-1"), topics.edge_returns_all("line-3"), "gpu-1"),
        (
            topics.pool_work("campus/fab-north/dc", "gpu-1", "line-3"),
            topics.pool_work_all("campus/fab-north/dc", "gpu-1"),
            "line-3",
        ),
    ],
)
def test_a_message_sent_on_its_own_behalf_names_its_sender_last(
    topic: str, filter_of_all: str, sender: str
) -> None:
    assert topics.sender(topic) == sender
    assert topics.matches(filter_of_all, topic)


def test_replicas_share_the_filter_of_every_edges_requests() -> None:
    shared = topics.placement_requests_shared("brokers")
    assert shared == f"$share/brokers/{topics.placement_requests_all()}"


def test_another_senders_topic_does_not_match_an_edges_filter() -> None:
    assert not topics.matches(
        topics.edge_returns_all("line-3"), topics.edge_returns("line-4", "gpu-1")
    )
    assert not topics.matches(
        topics.pool_work_all("campus/fab-north/dc", "gpu-1"),
        topics.pool_work("campus/fab-north/dc", "gpu-2", "line-3"),
    )


@pytest.mark.parametrize(
    ("topic", "node"),
    [
        (topics.edge_status("line-3"), "line-3"),
        (topics.edge_telemetry("line-3"), "line-3"),
        (topics.worker_telemetry("gpu-1"), "gpu-1"),
        (topics.worker_capabilities("gpu-1"), "gpu-1"),
        (topics.broker_status("broker-1"), "broker-1"),
        ("sluicegate/v1", ""),
    ],
)
def test_node_of_reads_the_node_level_of_a_per_node_topic(topic: str, node: str) -> None:
    assert topics.node_of(topic) == node


def test_config_file_then_env_then_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "edge.toml"
    cfg.write_text('[mqtt]\nhost = "broker.plant"\nport = 1884\n[edge]\nid = "line-7"\n')
    monkeypatch.setenv("SLUICEGATE_MQTT__PORT", "1999")
    settings = load_settings(cfg, edge={"zone": "campus/x"})
    assert settings.mqtt.host == "broker.plant"  # from the file
    assert settings.mqtt.port == 1999  # env beats the file
    assert settings.edge.id == "line-7"
    assert settings.edge.zone == "campus/x"
    assert settings.edge.max_payload_bytes == 8 * 1024 * 1024  # default


def test_config_error_names_file_and_key(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[edge]\nconcurrency = 0\n")
    with pytest.raises(ConfigError, match=r"bad\.toml.*edge\.concurrency.*greater than or equal"):
        load_settings(cfg)


def test_config_unknown_key_and_bad_toml(tmp_path: Path) -> None:
    cfg = tmp_path / "typo.toml"
    cfg.write_text("[edge]\nconcurency = 2\n")
    with pytest.raises(ConfigError, match=r"edge\.concurency"):
        load_settings(cfg)
    cfg.write_text("[edge\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(cfg)
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "missing.toml")


def test_env_override_with_bad_value_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICEGATE_EDGE__QUEUE_SIZE", "many")
    with pytest.raises(ConfigError, match="SLUICEGATE_EDGE__QUEUE_SIZE"):
        load_settings()


@pytest.mark.parametrize(("value", "named"), [("-1", "greater than or equal"), ("50", "less")])
def test_broker_read_gap_out_of_bounds_is_named(
    monkeypatch: pytest.MonkeyPatch, value: str, named: str
) -> None:
    """A read gap is a few milliseconds: a negative one or one that would hold placements
    for tens of milliseconds is refused, naming the variable."""
    monkeypatch.setenv("SLUICEGATE_BROKER__READ_GAP_MS", value)
    with pytest.raises(
        ConfigError, match=rf"broker\.read_gap_ms.*{named}.*SLUICEGATE_BROKER__READ_GAP_MS"
    ):
        load_settings()
    monkeypatch.setenv("SLUICEGATE_BROKER__READ_GAP_MS", "0")
    assert load_settings().broker.read_gap_ms == 0.0  # off: every readable socket read


def test_result_round_trips_and_raise_for_status() -> None:
    result = wire.JobResult(
        job_id="j1",
        status="rejected",
        code="unknown_model",
        reason="unknown model 'x'; known: defect-v1",
        ran_on=wire.RanOn(kind="edge", node="e1", zone="campus/a"),
    )
    again = wire.JobResult.model_validate_json(wire.dump(result))
    assert again == result
    with pytest.raises(wire.JobFailed, match="unknown model"):
        again.raise_for_status()


def test_service_times_moving_average() -> None:
    st = ServiceTimes(alpha=0.5)
    assert st.estimate("m") is None
    st.observe("m", 0.010)
    st.observe("m", 0.020)
    assert st.estimate("m") == pytest.approx(0.015)
    assert st.snapshot()["m"].completed == 2
    with pytest.raises(ValueError, match="alpha"):
        ServiceTimes(alpha=0.0)
