"""Pure tier: who is speaking, as the broker decides it (``broker.core.identity``).

The sender comes from the topic; these tables check it against the policy: an edge's origin
zone is its policy entry's, a worker is placed on only as the policy lists it, and a
completion or release names the node whose topic carried it.
"""

from __future__ import annotations

import pytest

from broker.core.identity import IdentityRefusal, edge_origin, same_sender, worker_standing
from tests.test_broker_core_kit import CLOUD, N1, NDC, SDC, campus_policy

POLICY = campus_policy({NDC: ["gpu-1"], SDC: ["npu-1"], CLOUD: ["cloud-1"]})
EDGE = "north-l1-pc"  # the testkit's one edge, in N1


@pytest.mark.parametrize(
    ("sender", "claimed", "expected"),
    [
        (EDGE, EDGE, N1),
        (EDGE, "south-l1-pc", "edge.id_mismatch"),
        ("ghost-pc", "ghost-pc", "edge.not_in_policy"),
        ("ghost-pc", EDGE, "edge.id_mismatch"),  # naming a listed edge does not help
    ],
)
def test_an_edges_origin_is_its_policy_entrys_zone(
    sender: str, claimed: str, expected: str
) -> None:
    got = edge_origin(POLICY, sender, claimed)
    assert (got.code if isinstance(got, IdentityRefusal) else got) == expected


def test_an_edge_refusal_names_who_sent_and_who_was_named() -> None:
    mismatch = edge_origin(POLICY, EDGE, "south-l1-pc")
    assert isinstance(mismatch, IdentityRefusal)
    assert "'south-l1-pc'" in mismatch.reason
    assert f"{EDGE!r}" in mismatch.reason
    unlisted = edge_origin(POLICY, "ghost-pc", "ghost-pc")
    assert isinstance(unlisted, IdentityRefusal)
    assert f"v{POLICY.version}" in unlisted.reason
    assert "add-node" in unlisted.reason


@pytest.mark.parametrize(
    ("sender", "claimed", "zone", "code"),
    [
        ("gpu-1", "gpu-1", NDC, None),
        ("cloud-1", "cloud-1", CLOUD, None),
        ("gpu-1", "npu-1", SDC, "worker.id_mismatch"),  # another worker's document
        ("ghost", "ghost", NDC, "worker.not_in_policy"),
        ("gpu-1", "gpu-1", SDC, "worker.zone_mismatch"),  # a zone it is not in
        ("gpu-1", "gpu-1", CLOUD, "worker.zone_mismatch"),
    ],
)
def test_a_worker_is_placed_on_only_as_the_policy_lists_it(
    sender: str, claimed: str, zone: str, code: str | None
) -> None:
    refusal = worker_standing(POLICY, sender, claimed, zone)
    assert (refusal.code if refusal is not None else None) == code


def test_a_zone_mismatch_names_both_zones_and_the_pool() -> None:
    refusal = worker_standing(POLICY, "gpu-1", "gpu-1", SDC)
    assert refusal is not None
    assert repr(SDC) in refusal.reason
    assert repr(NDC) in refusal.reason
    assert "[pool] zone" in refusal.reason


@pytest.mark.parametrize(
    ("kind", "sender", "claimed", "code"),
    [
        ("completion", "gpu-1", "gpu-1", None),
        ("completion", "gpu-1", None, None),  # nothing named: the topic's
        ("completion", "gpu-1", "npu-1", "completion.id_mismatch"),
        ("release", EDGE, EDGE, None),
        ("release", EDGE, "south-l1-pc", "release.id_mismatch"),
    ],
)
def test_a_node_reports_only_its_own(
    kind: str, sender: str, claimed: str | None, code: str | None
) -> None:
    refusal = same_sender(kind, sender, claimed)
    assert (refusal.code if refusal is not None else None) == code
