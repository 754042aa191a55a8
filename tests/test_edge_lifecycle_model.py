"""Pure-core tier: Hypothesis drives one job through the lifecycle table directly, against a
model of the world around it: the outbox's commits land (new, known) or fail, placements
are answered in any order or never, sends fail, workers return for the current attempt or
an old one or from a stranger, the broker sends notices, time passes, runs finish. No event
loop, no disk: thousands of examples in seconds.

What must hold at every step: no move the table does not allow for an event the shell
could send; work goes out only for an attempt that was asked for, at most once, and before
the acceptance commit only as attempt 1; the request is acked at most once; a job is
concluded at most once (one result committed); a compute slot is held exactly while the
job is counted or running here (or admitted to run at once). At the end, with every
outstanding operation completed and the workers answering, the job is concluded, and every
placement it was given was sent or handed back, and no message is left held unacked.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from edge_agent import events as ev
from edge_agent.events import Life
from edge_agent.lifecycle import transition
from edge_agent.rules import Declined, Outlook, Placement

START = 1_000.0


def _placement(worker: str) -> Placement:
    return Placement(worker, "campus/dc", f"work/{worker}", "tok", b"")


@dataclass
class World:
    """Everything outstanding around one job, as the shell would have it."""

    life: Life
    now: float = START
    offload: bool = True
    accept_pending: bool = False
    asks: set[int] = field(default_factory=set)  # attempts whose answer is to come
    records: set[int] = field(default_factory=set)  # RecordAttempt not yet landed
    count_pending: bool = False
    run_pending: bool = False
    commit_pending: bool = False
    queued: bool = False  # in the local queue (Enqueue seen, Start not yet)
    held: list[ev.Event] = field(default_factory=list)
    sent: Counter[int] = field(default_factory=Counter)
    given: dict[int, str] = field(default_factory=dict)  # attempt -> worker placed on
    released: set[int] = field(default_factory=set)
    voided: set[int] = field(default_factory=set)  # sends that failed after the commit
    fail_next_send: bool = False
    acks: int = 0
    conclusions: int = 0
    runs: int = 0
    was_admitting: bool = True

    def outlook(self) -> Outlook:
        late = self.now + (9.0 if self.offload else 0.001)
        return Outlook("edge-1", self.offload, late, 0, 32, 3, 2, 3.0)

    def apply(self, event: ev.Event) -> None:
        before = self.life
        self.life, effects = transition(self.life, event, self.now, self.outlook())
        for effect in effects:
            self.carry(effect, event, before)
        slot = self.life.phase in ("starting", "running") or (
            self.life.phase == "admitting" and self.life.run_now
        )
        assert self.life.holds_slot == slot, self.life

    def carry(self, effect: ev.Effect, event: ev.Event, before: Life) -> None:
        match effect:
            case ev.CommitAcceptance():
                self.accept_pending = True
            case ev.Ask(attempt=attempt):
                assert attempt not in self.asks, f"attempt {attempt} asked twice"
                self.asks.add(attempt)
            case ev.CancelAsk(attempt=attempt):
                self.asks.discard(attempt)
            case ev.Send(attempt=attempt):
                assert attempt in self.given, f"attempt {attempt} sent, never placed"
                assert not self.sent[attempt], f"attempt {attempt} sent twice"
                if self.life.phase == "admitting":
                    assert attempt == 1, "only a first attempt goes out before the commit"
                if self.fail_next_send:  # the shell hears at once, as an event
                    self.fail_next_send = False
                    if self.life.phase != "admitting":
                        self.voided.add(attempt)
                    self.apply(ev.SendFailed(attempt))
                else:
                    self.sent[attempt] += 1
            case ev.Release(attempt=attempt):
                self.released.add(attempt)
            case ev.RecordAttempt(attempt=attempt):
                self.records.add(attempt)
            case ev.Enqueue():
                self.queued = True
            case ev.CountRun():
                self.count_pending = True
            case ev.Launch():
                self.run_pending = True
                self.runs += 1
            case ev.ConcludeHere() | ev.ConcludeReturn():
                self.conclusions += 1
                assert self.conclusions == 1, "a job concluded twice"
                self.commit_pending = True
            case ev.Ack():
                if isinstance(event, ev.Accepted):
                    self.acks += 1
                    assert self.acks == 1, "the request acked twice"
            case ev.Hold():
                self.held.append(event)
            case ev.Rehandle():
                held, self.held = self.held, []
                for again in held:
                    self.apply(again)
            case ev.DiscardHeld():
                self.held = []
            case _:
                pass


EXTERNAL = ("return", "stale_return", "stranger", "lost", "dead", "overdue", "time", "broker")


@st.composite
def steps(draw: st.DrawFn) -> list[tuple[str, int]]:
    names = st.sampled_from(
        (
            "accept_new",
            "accept_known",
            "answer",
            "decline",
            "send_fails",
            "record",
            "start",
            "counted",
            "count_fails",
            "run_done",
            "committed",
            "commit_false",
            *EXTERNAL,
        )
    )
    return draw(st.lists(st.tuples(names, st.integers(0, 3)), max_size=40))


def step(world: World, name: str, pick: int) -> None:
    life = world.life
    if name in ("accept_new", "accept_known") and world.accept_pending:
        world.accept_pending = False
        world.apply(ev.Accepted() if name == "accept_new" else ev.AcceptKnown())
    elif name in ("answer", "decline") and world.asks:
        attempt = sorted(world.asks)[pick % len(world.asks)]
        world.asks.discard(attempt)
        if name == "answer":
            worker = f"w{attempt}"
            world.given[attempt] = worker
            world.apply(ev.Answered(attempt, _placement(worker)))
        else:
            world.apply(ev.Answered(attempt, Declined("no_capacity", "full")))
    elif name == "send_fails":
        world.fail_next_send = True
    elif name == "record" and world.records:
        attempt = min(world.records)
        world.records.discard(attempt)
        world.apply(ev.AttemptRecorded(attempt))
    elif name == "start" and world.queued and life.phase == "queued":
        world.queued = False
        world.apply(ev.Start())
    elif name in ("counted", "count_fails") and world.count_pending:
        world.count_pending = False
        runs = None if name == "count_fails" else life.local_runs + 1
        world.apply(ev.RunCounted(runs))
    elif name == "run_done" and world.run_pending:
        world.run_pending = False
        world.apply(ev.RunDone("ok"))
    elif name in ("committed", "commit_false") and world.commit_pending:
        world.commit_pending = False
        world.apply(ev.ResultCommitted(name == "committed"))
    elif name in EXTERNAL:
        external(world, name, pick)


def external(world: World, name: str, pick: int) -> None:
    life = world.life
    if life.phase == "new":
        return
    attempt = max(life.attempt, 1)
    if name == "return":
        world.apply(ev.Returned(attempt, world.given.get(attempt, "w1")))
    elif name == "stale_return":
        world.apply(ev.Returned(max(1, attempt - 1 - pick), "w1"))
    elif name == "stranger":
        world.apply(ev.Returned(attempt, "w-stranger"))
    elif name == "lost":
        world.apply(ev.WorkerLost(attempt, "gone"))
    elif name == "dead":
        world.apply(ev.DeadLettered("it kills its workers"))
    elif name == "overdue" and life.phase == "offloaded":
        world.apply(ev.Overdue())
    elif name == "time":
        world.now += (0.5, 2.0, 5.0, 20.0)[pick]
    elif name == "broker":
        world.offload = not world.offload


def finish(world: World) -> None:
    """Every outstanding operation completes; workers answer; time passes."""
    for _ in range(50):
        if world.life.phase == "concluded":
            return
        for name in ("accept_new", "answer", "record", "start", "counted", "run_done", "committed"):
            step(world, name, 0)
        world.fail_next_send = False
        if world.life.phase == "offloaded":
            world.apply(ev.Returned(world.life.attempt, world.given[world.life.attempt]))
    raise AssertionError(f"the job never concluded: {world.life}")


@settings(max_examples=3000, deadline=None, derandomize=True, database=None)
@given(
    admit=st.sampled_from(("run_now", "ask", "plain", "replay_route", "replay_offloaded")),
    deadline=st.sampled_from((None, START + 1.0, START + 30.0)),
    plan=steps(),
)
def test_one_job_through_the_table(
    admit: str, deadline: float | None, plan: list[tuple[str, int]]
) -> None:
    world = World(Life("j1", deadline))
    if admit.startswith("replay"):
        world.was_admitting = False
        kind = "await_return" if admit == "replay_offloaded" else "route"
        world.given[1] = "w1"
        world.sent[1] = 1  # before the restart
        world.apply(ev.Replayed(kind, 1, 0, "w1" if kind == "await_return" else None))
    else:
        world.apply(ev.Admit(admit == "run_now", "deadline" if admit == "ask" else None))
    for name, pick in plan:
        step(world, name, pick)
    finish(world)
    assert world.life.phase == "concluded"
    if world.was_admitting:
        assert world.acks <= 1
    unused = set(world.given) - set(world.sent) - world.released - world.voided
    assert not unused, f"placements neither sent nor handed back: {sorted(unused)}"
    assert not world.held, f"messages held and never taken or discarded: {world.held}"
