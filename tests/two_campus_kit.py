"""The two-campus rig of the peering tests: ``sluicegate.app.pair`` with the published test
keys (each campus's own: both name a broker-1), Redis databases from the session's server."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from policies import SigningKey
from sluicegate.app.pair import NORTH, SOUTH, SOUTH_DC, Pair, local_pair
from tests.policies.policy_testkit import key

TwoCampuses = Pair
__all__ = ["NORTH", "SOUTH", "SOUTH_DC", "TwoCampuses", "two_campuses"]


def test_key(campus: str, name: str) -> SigningKey:
    return key(f"{campus}/{name}")


@contextmanager
def two_campuses(
    root: Path,
    redis_url: Callable[[], str],
    *,
    north_nodes: Collection[str],
    south_nodes: Collection[str],
    **options: Any,
) -> Iterator[Pair]:
    with local_pair(
        root, redis_url, test_key, north_nodes=north_nodes, south_nodes=south_nodes, **options
    ) as pair:
        yield pair
