"""What the edge counts as work ahead of a new job, for the completion it predicts: jobs
queued, starting, running or admitted to run here surely; one admitted while its placement
is asked for only at the share of offers the broker declined lately (it leaves unless
declined); one whose placement came, not at all."""

from __future__ import annotations

import pytest

from edge_agent.events import Life
from edge_agent.jobs import ASKED, NOT, SURE, ahead_kind
from edge_agent.rules import Declined, Placement

PLACED = Placement("w", "z", "t", "token", b"\0" * 32)


@pytest.mark.parametrize(
    ("life", "kind"),
    [
        (Life("j", None, "queued"), SURE),
        (Life("j", None, "running"), SURE),
        (Life("j", None, "admitting"), SURE),  # to run here once accepted
        (Life("j", None, "admitting", asking=1), ASKED),  # its answer still to come
        (Life("j", None, "admitting", asking=1, ahead=Declined("no_worker", "x")), SURE),
        (Life("j", None, "admitting", asking=1, ahead=PLACED), NOT),  # on its way out
        (Life("j", None, "offering", asking=1), NOT),
        (Life("j", None, "offloaded", attempt=1), NOT),
    ],
)
def test_each_phase_counts_as_it_should(life: Life, kind: int) -> None:
    assert ahead_kind(life) == kind
