"""The local campus's arguments, checked before anything is written or started: a standby
node must be a pool worker (a scaler starts it later), a node must be one the campus has."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluicegate.app.localcampus import LocalCampus
from sluicegate.errors import SluicegateError


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"standby": ["line-1-pc"]}, "standby nodes must be pool workers"),
        ({"standby": ["broker-1"]}, "standby nodes must be pool workers"),
        ({"nodes": ["line-9-pc"]}, "unknown nodes"),
    ],
)
def test_a_campus_refuses_nodes_it_cannot_run_as_asked(
    tmp_path: Path, kw: dict[str, list[str]], words: str
) -> None:
    with pytest.raises(SluicegateError, match=words):
        LocalCampus(tmp_path, mqtt_port=1, redis_url="redis://127.0.0.1:1/0", **kw)  # type: ignore[arg-type]
    assert not any(tmp_path.iterdir())  # nothing written


def test_standby_workers_are_listed_with_their_ports_but_left_to_a_scaler(tmp_path: Path) -> None:
    campus = LocalCampus(
        tmp_path, mqtt_port=1, redis_url="redis://127.0.0.1:1/0", standby=["cloud-cpu-1"]
    )
    assert campus.standby == {"cloud-cpu-1"}
    assert "cloud-cpu-1" in campus.nodes
    assert "cloud-cpu-1" in campus.metrics_urls()
