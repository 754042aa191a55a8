"""Pure-core tier: the edge's lifecycle table, without an event loop, a transport or a disk.

Every (phase, event) pair either has a row or raises IllegalMove; the rows that carry a
rule the edge depends on are pinned one by one; and Hypothesis drives one job through the
table against a model of everything the shell could do meanwhile (commits landing or
failing, placements answered late or never, returns from the right, a stale or a strange
worker, notices, timeouts, runs), checking at every step what must hold.
"""

from __future__ import annotations

from typing import Any

import pytest

from edge_agent import events as ev
from edge_agent.events import EVENTS, PHASES, IllegalMove, Life
from edge_agent.lifecycle import NEEDS_OUTLOOK, TABLE, transition
from edge_agent.rules import Declined, Outlook, Placement
from edge_agent.tally import Tally

NOW = 1_000.0
PLACED = Placement("w1", "campus/dc", "work/w1", "tok", b"")
OTHER = Placement("w2", "campus/dc", "work/w2", "tok", b"")
BUSY_HERE = Outlook("edge-1", True, NOW + 9.0, 3, 0, 4, 3, 3.0)  # late here: offer it
QUIET = Outlook("edge-1", True, NOW + 0.01, 0, 32, 4, 3, 3.0)  # on time here: run it
OFFLINE = BUSY_HERE._replace(offload=False)

SAMPLES: dict[type[Any], ev.Event] = {
    ev.Admit: ev.Admit(run_now=False),
    ev.Replayed: ev.Replayed("route", 0, 0, None),
    ev.Accepted: ev.Accepted(),
    ev.AcceptKnown: ev.AcceptKnown(),
    ev.Answered: ev.Answered(1, PLACED),
    ev.SendFailed: ev.SendFailed(1),
    ev.AttemptRecorded: ev.AttemptRecorded(1),
    ev.Returned: ev.Returned(1, "w1"),
    ev.WorkerLost: ev.WorkerLost(1, "gone"),
    ev.DeadLettered: ev.DeadLettered("killed its workers"),
    ev.Overdue: ev.Overdue(),
    ev.Start: ev.Start(),
    ev.RunCounted: ev.RunCounted(1),
    ev.RunDone: ev.RunDone("ok"),
    ev.ResultCommitted: ev.ResultCommitted(True),
}


def kinds(effects: tuple[ev.Effect, ...]) -> list[str]:
    return [type(effect).__name__ for effect in effects]


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("event_type", EVENTS, ids=lambda t: t.__name__)
def test_every_pair_has_a_row_or_raises(phase: ev.Phase, event_type: type[Any]) -> None:
    life = Life("j1", None, phase, attempt=1, asking=1, worker="w1")
    event = SAMPLES[event_type]
    if (phase, event_type) not in TABLE:
        with pytest.raises(IllegalMove, match=f"{event_type.__name__} in phase '{phase}'"):
            transition(life, event, NOW, QUIET)
        return
    moved, effects = transition(life, event, NOW, QUIET)
    assert moved.phase in PHASES
    assert moved.job_id == "j1"
    assert all(type(effect).__module__ == ev.__name__ for effect in effects)


OTHER_OUTLOOKS = (QUIET, BUSY_HERE, OFFLINE, Outlook("", False, 0.0, 0, 0, 1, 1, 1.0))


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize(
    "event_type", [t for t in EVENTS if t not in NEEDS_OUTLOOK], ids=lambda t: t.__name__
)
def test_a_move_the_shell_gives_no_outlook_does_not_depend_on_it(
    phase: ev.Phase, event_type: type[Any]
) -> None:
    if (phase, event_type) not in TABLE:
        return
    for life in (
        Life("j1", None, phase, attempt=1, asking=1, worker="w1"),
        Life("j1", NOW - 1.0, phase, attempt=2, asking=3, worker="w1", run_now=True),
        Life("j1", NOW + 1.0, phase, local_runs=5, early=True, ahead=PLACED, asking=1),
    ):
        moves = {transition(life, SAMPLES[event_type], NOW, o) for o in OTHER_OUTLOOKS}
        assert len(moves) == 1, moves


def admitting(**changes: Any) -> Life:
    return Life("j1", None, "admitting")._replace(**changes)


ROWS: list[tuple[str, Life, ev.Event, Outlook, str, list[str]]] = [
    # name, life, event, outlook, phase after, effects
    (
        "admit to run now",
        Life("j1", None),
        ev.Admit(True),
        QUIET,
        "admitting",
        ["CommitAcceptance"],
    ),
    (
        "admit, asking ahead",
        Life("j1", None),
        ev.Admit(False, "deadline", 0.5),
        BUSY_HERE,
        "admitting",
        ["CommitAcceptance", "Ask"],
    ),
    (
        "accepted, run counted with it",
        admitting(run_now=True),
        ev.Accepted(),
        QUIET,
        "running",
        ["Ack", "Launch"],
    ),
    (
        "accepted, late here: offered",
        admitting(),
        ev.Accepted(),
        BUSY_HERE,
        "offering",
        ["Ack", "Ask"],
    ),
    (
        "accepted, nobody to ask: queued",
        admitting(),
        ev.Accepted(),
        OFFLINE,
        "queued",
        ["Ack", "Enqueue"],
    ),
    (
        "accepted, expired meanwhile",
        admitting(run_now=True, deadline=NOW - 1),
        ev.Accepted(),
        QUIET,
        "finishing",
        ["Ack", "ConcludeHere"],
    ),
    (
        "accepted after its work went early",
        admitting(asking=1, ahead=PLACED, early=True),
        ev.Accepted(),
        QUIET,
        "offloaded",
        ["RecordAttempt", "Ack", "Rehandle"],
    ),
    (
        "accepted, placed during the commit, unsent",
        admitting(asking=1, ahead=PLACED),
        ev.Accepted(),
        QUIET,
        "offloaded",
        ["RecordAttempt", "Ack", "Send"],
    ),
    (
        "accepted, declined ahead",
        admitting(asking=1, ahead=Declined("no_capacity", "full")),
        ev.Accepted(),
        QUIET,
        "queued",
        ["Ack", "Enqueue"],
    ),
    (
        "accepted, answer still to come",
        admitting(asking=1),
        ev.Accepted(),
        QUIET,
        "offering",
        ["Ack"],
    ),
    (
        "placed ahead: sent before the commit",
        admitting(asking=1),
        ev.Answered(1, PLACED),
        QUIET,
        "admitting",
        ["Send", "Count"],
    ),
    (
        "placed ahead after the deadline: kept, not sent",
        admitting(asking=1, deadline=NOW - 0.01),
        ev.Answered(1, PLACED),
        QUIET,
        "admitting",
        [],
    ),
    (
        "accepted, kept placement past its deadline: expired, handed back",
        admitting(asking=1, ahead=PLACED, deadline=NOW - 0.01),
        ev.Accepted(),
        QUIET,
        "finishing",
        ["Ack", "Release", "ConcludeHere"],
    ),
    (
        "known: early work's returns discarded",
        admitting(asking=1, ahead=PLACED, early=True),
        ev.AcceptKnown(),
        QUIET,
        "concluded",
        ["DiscardHeld", "Forget"],
    ),
    (
        "known: ahead placement handed back",
        admitting(asking=1, ahead=PLACED),
        ev.AcceptKnown(),
        QUIET,
        "concluded",
        ["Release", "Forget"],
    ),
    (
        "known: ahead request given up",
        admitting(asking=1),
        ev.AcceptKnown(),
        QUIET,
        "concluded",
        ["CancelAsk", "Forget"],
    ),
    (
        "early return waits for the commit",
        admitting(asking=1, ahead=PLACED, early=True),
        ev.Returned(1, "w1"),
        QUIET,
        "admitting",
        ["Hold"],
    ),
    (
        "placed: recorded and sent",
        Life("j1", None, "offering", asking=1),
        ev.Answered(1, PLACED),
        QUIET,
        "offloaded",
        ["RecordAttempt", "Send"],
    ),
    (
        "placed after the deadline: handed back, not sent, expired",
        Life("j1", NOW - 0.01, "offering", asking=1),
        ev.Answered(1, PLACED),
        QUIET,
        "finishing",
        ["Release", "ConcludeHere"],
    ),
    (
        "answer for an old attempt: handed back",
        Life("j1", None, "offering", attempt=1, asking=2),
        ev.Answered(1, OTHER),
        QUIET,
        "offering",
        ["Release"],
    ),
    (
        "broker dead-letters it",
        Life("j1", None, "offering", asking=1),
        ev.Answered(1, Declined("dead_letter", "it kills workers")),
        QUIET,
        "finishing",
        ["Count", "ConcludeHere"],
    ),
    (
        "return taken, attempt on disk: forwarded",
        Life("j1", None, "offloaded", attempt=2, on_disk=2, worker="w1"),
        ev.Returned(2, "w1"),
        QUIET,
        "finishing",
        ["ConcludeReturn"],
    ),
    (
        "return from a stale attempt",
        Life("j1", None, "offloaded", attempt=2, worker="w1"),
        ev.Returned(1, "w1"),
        QUIET,
        "offloaded",
        ["Discard"],
    ),
    (
        "return from a stranger",
        Life("j1", None, "offloaded", attempt=1, worker="w1"),
        ev.Returned(1, "w2"),
        QUIET,
        "offloaded",
        ["Discard"],
    ),
    (
        "return while running here",
        Life("j1", None, "running", attempt=1, worker="w1"),
        ev.Returned(1, "w1"),
        QUIET,
        "running",
        ["Discard"],
    ),
    (
        "worker refused it unrun: runs here",
        Life("j1", None, "offloaded", attempt=1),
        ev.Returned(1, "w1", Declined("queue_full", "busy")),
        QUIET,
        "queued",
        ["Ack", "Count", "Enqueue"],
    ),
    (
        "worker lost: offered again",
        Life("j1", NOW + 5, "offloaded", attempt=1),
        ev.WorkerLost(1, "gone"),
        BUSY_HERE,
        "offering",
        ["Ack", "Count", "Ask"],
    ),
    (
        "worker lost at the last attempt: runs here",
        Life("j1", None, "offloaded", attempt=4),
        ev.WorkerLost(4, "gone"),
        BUSY_HERE,
        "queued",
        ["Ack", "Count", "Enqueue"],
    ),
    (
        "worker lost after the deadline: expired",
        Life("j1", NOW - 0.1, "offloaded", attempt=1),
        ev.WorkerLost(1, "gone"),
        BUSY_HERE,
        "finishing",
        ["Ack", "Count", "ConcludeHere"],
    ),
    (
        "stale notice",
        Life("j1", None, "offloaded", attempt=2),
        ev.WorkerLost(1, "gone"),
        QUIET,
        "offloaded",
        ["Ack", "Count"],
    ),
    (
        "overdue: rerouted",
        Life("j1", None, "offloaded", attempt=1, expires_at=NOW),
        ev.Overdue(),
        OFFLINE,
        "queued",
        ["Count", "Enqueue"],
    ),
    (
        "not overdue yet",
        Life("j1", None, "offloaded", attempt=1, expires_at=NOW + 1),
        ev.Overdue(),
        OFFLINE,
        "offloaded",
        [],
    ),
    (
        "slot free: run counted first",
        Life("j1", None, "queued"),
        ev.Start(),
        QUIET,
        "starting",
        ["CountRun"],
    ),
    (
        "slot free, but every run so far died",
        Life("j1", None, "queued", local_runs=3),
        ev.Start(),
        QUIET,
        "finishing",
        ["Count", "ConcludeHere"],
    ),
    (
        "run could not be counted: replays later",
        Life("j1", None, "starting"),
        ev.RunCounted(None),
        QUIET,
        "concluded",
        ["Forget"],
    ),
    (
        "committed a return: acked, published after its forward",
        Life("j1", None, "finishing", ack_return=True, forwarded=True),
        ev.ResultCommitted(True),
        QUIET,
        "concluded",
        ["Ack", "Publish", "Remember"],
    ),
    (
        "the disk had concluded it: resync",
        Life("j1", None, "finishing"),
        ev.ResultCommitted(False),
        QUIET,
        "concluded",
        ["Count", "Resync"],
    ),
    (
        "the result write failed",
        Life("j1", None, "finishing", ack_return=True),
        ev.ResultCommitted(None),
        QUIET,
        "concluded",
        ["Count"],
    ),
]


@pytest.mark.parametrize(
    ("life", "event", "outlook", "phase", "effects"),
    [row[1:] for row in ROWS],
    ids=[row[0] for row in ROWS],
)
def test_rule(life: Any, event: ev.Event, outlook: Outlook, phase: str, effects: list[str]) -> None:
    moved, done = transition(life, event, NOW, outlook)
    assert (moved.phase, kinds(done)) == (phase, effects)


def test_expiry_has_one_reason_text() -> None:
    before, _ = transition(Life("j1", NOW - 0.25, "queued"), ev.Start(), NOW, QUIET)
    lost = Life("j1", NOW - 0.25, "offloaded", attempt=1)
    _, effects = transition(lost, ev.WorkerLost(1, "the worker died"), NOW, QUIET)
    conclude = [e for e in effects if isinstance(e, ev.ConcludeHere)]
    assert conclude[0].reason == (
        "the deadline passed 250 ms ago, while it was offloaded (the worker died); not run"
    )
    _, effects = transition(Life("j1", NOW - 0.25, "queued"), ev.Start(), NOW, QUIET)
    assert [e.reason for e in effects if isinstance(e, ev.ConcludeHere)] == [
        "the deadline passed 250 ms ago, before the job could start; not run"
    ]
    assert before.phase == "finishing"


def test_a_placement_that_comes_after_the_deadline_goes_back_saying_why() -> None:
    # The worker would refuse the job on arrival (center_pool.intake: "expired"): the
    # edge neither seals nor sends it, and the broker frees the worker's room at once.
    moved, effects = transition(
        Life("j1", NOW - 0.04, "offering", asking=2), ev.Answered(2, PLACED), NOW, QUIET
    )
    assert ev.Release(2, "w1", "the job's deadline passed") in effects
    assert not any(isinstance(e, ev.Send) for e in effects)
    assert [(e.status, e.reason) for e in effects if isinstance(e, ev.ConcludeHere)] == [
        ("expired", "the deadline passed 40 ms ago, before the job could start; not run")
    ]
    assert (moved.asking, moved.phase) == (0, "finishing")


def test_a_stranger_is_told_apart_only_while_the_worker_is_known() -> None:
    restarted = Life("j1", None, "offloaded", attempt=1, worker=None)
    moved, effects = transition(restarted, ev.Returned(1, "w9"), NOW, QUIET)
    assert moved.phase == "finishing"
    assert kinds(effects) == ["ConcludeReturn"]
    known = restarted._replace(worker="w1")
    _, effects = transition(known, ev.Returned(1, "w9"), NOW, QUIET)
    assert effects == (ev.Discard(Tally.FENCED_RETURNS, "stranger"),)
