"""Version-exact placement, as tables: a request that names the sha256 of the model the edge
runs goes only to a worker that reports exactly that file; one that names none takes any
version; the refusal names the version asked for and the ones the fleet holds. Each
decision is checked against the brute-force reference."""

from __future__ import annotations

from typing import Any

from broker.core.state import Capabilities, model_key
from tests.test_broker_core_kit import CLOUD, NDC, SDC, campus_policy, caps, fleet_with
from tests.test_broker_core_kit import request as make_request
from tests.test_broker_core_placement import both, placed, refused

POLICY = campus_policy()
OLD = "0a" * 32
NEW = "1b" * 32


def fleet() -> Any:
    """gpu-1 holds the old file and is idle, npu-1 the new one and is busy, cloud-1 does not
    say which it holds."""
    npu = caps("npu-1", SDC, device_class="ascend-910b", shas={"defect-v1": NEW})
    return fleet_with(
        POLICY,
        [
            (caps("gpu-1", NDC, shas={"defect-v1": OLD}), {"queue_depth": 0}),
            (npu, {"queue_depth": 6}),
            (caps("cloud-1", CLOUD), {"queue_depth": 9}),
        ],
    )


def request(**kw: Any) -> Any:
    return make_request(data_class="ocr-crop", **kw)  # a class every zone here may take


def test_a_request_for_the_new_file_goes_where_it_is_even_when_the_old_one_is_idler() -> None:
    decision = placed(both(fleet(), request(model_sha256=NEW)))
    assert decision.worker_id == "npu-1"
    assert [c.worker_id for c in decision.candidates.ranked] == ["npu-1"]


def test_a_request_for_the_old_file_goes_only_to_the_old_one() -> None:
    assert placed(both(fleet(), request(model_sha256=OLD))).worker_id == "gpu-1"


def test_a_request_without_a_sha256_takes_any_version() -> None:
    decision = placed(both(fleet(), request()))
    assert decision.worker_id == "gpu-1"  # the idlest of all three
    assert len(decision.candidates.ranked) == 3


def test_a_version_nobody_holds_is_refused_naming_it_and_the_versions_there_are() -> None:
    decision = refused(both(fleet(), request(model_sha256="2c" * 32)))
    assert decision.code == "no_worker"
    assert decision.reason.startswith(
        "no online worker has model 'defect-v1' at the edge's version (sha256 2c2c2c2c2c2c…); "
        "workers hold other versions of it (sha256 "
    )
    assert "0a0a0a0a0a0a" in decision.reason
    assert "1b1b1b1b1b1b" in decision.reason


def test_a_worker_is_found_under_its_model_s_name_and_its_exact_file() -> None:
    found = Capabilities.from_wire(caps("w", NDC, models=("a", "b"), shas={"a": OLD}))
    assert found.models == ("a", f"a@{OLD}", "b")
    assert found.names == ("a", "b")
    assert model_key("a", None) == "a"
    assert model_key("a", OLD) == f"a@{OLD}"
