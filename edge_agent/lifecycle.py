"""One job's life on the edge as one table of rules (h11-style): ``TABLE[phase, event]`` is
the rule that moves a job in that phase on that event, and :func:`transition` applies it,
returning the job's new :class:`~edge_agent.events.Life` and the effects to carry out, in
order. Pure: no I/O, no asyncio, no clock (``now`` is an argument, and ``Outlook`` says
what routing needs to know about the edge at that moment).

    phase       the job is ...                                  on disk
    new         not yet seen (a request, or a row read back at start)
    admitting   having its acceptance committed (its run counted with it when it will
                run at once; its first placement possibly asked for meanwhile)
    queued      waiting for a local compute slot                queued (or offloaded: a
                                                                rerouted job until it starts)
    starting    having its local run counted before it runs     queued
    running     running here                                    queued
    offering    waiting for the broker's answer for ``asking``  queued / offloaded
    offloaded   on a worker as ``attempt``; awaiting its return offloaded
    finishing   having its result committed                     -> done
    concluded   out of memory: answered, or left on disk to replay after a restart

A pair with no row raises :class:`~edge_agent.events.IllegalMove`: the shell never sends
it, so it is a bug. Events that come for an attempt no longer current, for a job already
concluded, or in a phase that cannot take them have rows that discard them (fencing): stale
messages are expected, counted, and never move a job.

Whatever the rule, :func:`transition` keeps the job's clocks: how long it waited for the
broker's answers and how long its work was out on workers (:func:`waiting_on`), stamped on
its ``declined`` reason when it concludes here, so its result says where its time went.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast

from edge_agent import events as ev
from edge_agent import rules
from edge_agent.events import PHASES, Effect, Effects, Event, IllegalMove, Life, Move, Phase, Rule
from edge_agent.rules import Declined, Outlook, Placement
from edge_agent.tally import Tally

NOT_WANTED = "the job was concluded meanwhile"
PASSED = "the job's deadline passed"
Notice = ev.Returned | ev.WorkerLost | ev.DeadLettered  # what a worker or the broker says of a job
E = TypeVar("E", bound=Event)
# The events whose rules read the outlook; for the others the shell need not work it out
# (tests/test_edge_lifecycle.py holds that their moves do not depend on it).
NEEDS_OUTLOOK: frozenset[type[Event]] = frozenset(
    {ev.Replayed, ev.Accepted, ev.Answered, ev.Returned, ev.WorkerLost, ev.Overdue, ev.Start}
)


def transition(life: Life, event: Event, now: float, outlook: Outlook) -> Move:
    """The job's next life and the effects to carry out; raises IllegalMove when the table
    has no row for ``event`` in ``life.phase``."""
    rule = TABLE.get((life.phase, type(event)))
    if rule is None:
        raise IllegalMove(life, event)
    after, effects = rule(life, event, now, outlook)
    return _clocked(life, after, now), effects


ASKING, AWAY = 1, 2  # what a job waits on, when neither this edge's queue nor its run


def waiting_on(life: Life) -> int:
    """``ASKING``: the broker's answer (offering, or admitting with its answer to come);
    ``AWAY``: a worker (offloaded, or admitting with its work sent early); 0: neither."""
    phase = life.phase
    if phase == "offering":
        return ASKING
    if phase == "offloaded":
        return AWAY
    if phase == "admitting" and life.asking:
        if life.ahead is None:
            return ASKING
        return AWAY if life.early else 0
    return 0


def _clocked(before: Life, after: Life, now: float) -> Life:
    """``after`` with the time since ``before.since`` added to the wait it ended, its clock
    restarted if a wait began, and, as it concludes here, both totals on its reason."""
    was, waits = waiting_on(before), waiting_on(after)
    if was != waits:
        spent = now - before.since
        if was == ASKING:
            after = after._replace(asked_s=before.asked_s + spent)
        elif was == AWAY:
            after = after._replace(away_s=before.away_s + spent)
        if waits:
            after = after._replace(since=now)
    concludes = after.phase == "finishing" and before.phase != "finishing"
    if concludes and after.declined is not None:
        after = after._replace(declined=after.declined.timed(after.asked_s, after.away_s))
    return after


def _move(after: Life, *effects: Effect) -> Move:
    """The job's next life (``life._replace(...)``, its phase included) and the effects."""
    return after, effects


def _to(life: Life, phase: Phase, *effects: Effect) -> Move:
    return life._replace(phase=phase), effects


# -- shared moves -------------------------------------------------------------------------------


def _expire(life: Life, reason: str, *before: Effect) -> Move:
    return _to(life, "finishing", *before, ev.ConcludeHere("expired", "expired", reason))


def _dead_letter(life: Life, reason: str, *before: Effect) -> Move:
    conclude = ev.ConcludeHere("failed", "dead_letter", reason)
    return _to(life, "finishing", *before, ev.Count(Tally.DEAD_LETTERS), conclude)


def _run_here(life: Life, why: Declined | None, o: Outlook, *before: Effect) -> Move:
    """Into the local queue; ``why`` it did not leave goes into its result. Its predicted
    completion is kept from the first prediction made for it (the one an offer sent)."""
    predicted = life.predicted or o.predicted_done
    queued = life._replace(phase="queued", declined=life.declined or why, predicted=predicted)
    return _move(queued, *before, ev.Enqueue())


def _ask(life: Life, reason: str, now: float, o: Outlook, *before: Effect) -> Move:
    attempt = life.attempt + 1
    ask = ev.Ask(attempt, reason, max(0.0, o.predicted_done - now))
    predicted = life.predicted or o.predicted_done
    return _move(life._replace(phase="offering", asking=attempt, predicted=predicted), *before, ask)


def _route(life: Life, now: float, o: Outlook, *before: Effect) -> Move:
    """An accepted job on its way: expired, offered when it would be late here (or the
    local queue is long), else into the local queue."""
    late = rules.expiry_reason(life.deadline, now)
    if late is not None:
        return _expire(life, late, *before)
    reason = rules.offer_reason(life.deadline, o)
    if reason is not None:
        return _ask(life, reason, now, o, *before)
    return _run_here(life, None, o, *before)


def _reroute(life: Life, why: Declined, now: float, o: Outlook, *before: Effect) -> Move:
    """An offloaded job whose attempt was lost: expired, offered again, or run here."""
    late = rules.expiry_reason(life.deadline, now, lost=why)
    if late is not None:  # its result still says where it went and what came of it
        return _expire(life._replace(declined=life.declined or why), late, *before)
    reason = rules.retry_reason(life.attempt, life.deadline, o)
    if reason is not None:
        return _ask(life, reason, now, o, *before)
    return _run_here(life, why, o, *before)


def _placed(life: Life, placement: Placement, now: float, o: Outlook, *effects: Effect) -> Move:
    """The job is on ``placement``'s worker as attempt ``asking``."""
    attempt = life.asking
    expires = rules.offload_expiry(now, o.result_timeout_s, life.deadline)
    due = None if placement.predicted_ms is None else now + placement.predicted_ms / 1000.0
    rescue = rules.rescue_at(life.deadline, now, o.predicted_done, due)
    after = life._replace(
        phase="offloaded",
        attempt=attempt,
        asking=0,
        worker=placement.worker_id,
        expires_at=expires,
        rescue_at=rescue,
        ahead=None,
        early=False,
    )
    return _move(after, ev.RecordAttempt(attempt, placement.worker_id), *effects)


def _not_placed(life: Life, why: Declined, o: Outlook, *before: Effect) -> Move:
    life = life._replace(asking=0, ahead=None)
    if why.code == "dead_letter":  # the broker will not place it again
        return _dead_letter(life, why.reason, *before)
    return _run_here(life, why, o, *before)


def _drop_ahead(life: Life, why: str) -> Effects:
    """Give up the placement asked for while the job was admitted."""
    if life.early:
        return (ev.DiscardHeld(),)  # the worker has it; what it returns finds nothing to take
    if isinstance(life.ahead, Placement):
        return (ev.Release(1, life.ahead.worker_id, why),)
    if life.asking and life.ahead is None:
        return (ev.CancelAsk(life.asking),)  # the client hands back a placement that comes after
    return ()


# -- rules --------------------------------------------------------------------------------------


def _admit(life: Life, event: ev.Admit, now: float, o: Outlook) -> Move:
    effects: list[Effect] = [ev.CommitAcceptance(event.run_now)]
    if event.ask is not None:
        effects.append(ev.Ask(1, event.ask, event.local_s))
    asking = 1 if event.ask else 0
    predicted = now + event.local_s
    after = life._replace(
        phase="admitting", run_now=event.run_now, asking=asking, predicted=predicted
    )
    return _move(after, *effects)


def _replayed(life: Life, event: ev.Replayed, now: float, o: Outlook) -> Move:
    life = life._replace(attempt=event.attempt, local_runs=event.local_runs)
    if event.plan == "await_return":  # on disk as offloaded as that attempt
        expires = rules.offload_expiry(now, o.result_timeout_s, life.deadline)
        return _move(
            life._replace(
                phase="offloaded", worker=event.worker, expires_at=expires, on_disk=event.attempt
            )
        )
    if event.plan == "dead_letter":
        return _dead_letter(
            life, rules.dead_letter_reason(life.job_id, o.edge_id, event.local_runs)
        )
    return _route(life, now, o)


def _accepted(life: Life, event: ev.Accepted, now: float, o: Outlook) -> Move:
    if life.run_now:  # its run is counted already
        late = rules.expiry_reason(life.deadline, now)
        if late is not None:
            return _expire(life._replace(local_runs=1), late, ev.Ack())
        running = life._replace(phase="running", local_runs=1, run_now=False)
        return _move(running, ev.Ack(), ev.Launch())
    if not life.asking:
        return _route(life, now, o, ev.Ack())
    late = rules.expiry_reason(life.deadline, now)
    if late is not None:
        return _expire(life, late, ev.Ack(), *_drop_ahead(life, PASSED))
    if life.early:
        assert isinstance(life.ahead, Placement)
        return _placed(life, life.ahead, now, o, ev.Ack(), ev.Rehandle())
    if isinstance(life.ahead, Placement):  # came during the commit, not sent then
        return _placed(life, life.ahead, now, o, ev.Ack(), ev.Send(1, life.ahead))
    if isinstance(life.ahead, Declined):
        return _not_placed(life, life.ahead, o, ev.Ack())
    return _to(life, "offering", ev.Ack())  # its answer is still to come


def _accept_known(life: Life, event: ev.AcceptKnown, now: float, o: Outlook) -> Move:
    drop = _drop_ahead(life, "a repeat of a job this edge knows")
    return _move(life._replace(phase="concluded", run_now=False), *drop, ev.Forget())


def _answered_ahead(life: Life, event: ev.Answered, now: float, o: Outlook) -> Move:
    if event.attempt != life.asking or life.ahead is not None:
        return _answered_late(life, event, now, o)
    if isinstance(event.answer, Placement):  # sent at once: the commit is off the job's path
        # Past its deadline: kept unsent; the acceptance expires the job and hands it back.
        if rules.expiry_reason(life.deadline, now) is not None:
            return _move(life._replace(ahead=event.answer))
        sent = ev.Count(Tally.SENT_BEFORE_COMMIT)
        return _move(life._replace(ahead=event.answer, early=True), ev.Send(1, event.answer), sent)
    return _move(life._replace(ahead=event.answer))


def _answered(life: Life, event: ev.Answered, now: float, o: Outlook) -> Move:
    if event.attempt != life.asking:
        return _answered_late(life, event, now, o)
    if isinstance(event.answer, Placement):
        late = rules.expiry_reason(life.deadline, now)
        if late is not None:  # the worker would refuse it on arrival: neither sealed nor sent
            give_back = ev.Release(event.attempt, event.answer.worker_id, PASSED)
            return _expire(life._replace(asking=0), late, give_back)
        return _placed(life, event.answer, now, o, ev.Send(event.attempt, event.answer))
    return _not_placed(life, event.answer, o)


def _answered_late(life: Life, event: ev.Answered, now: float, o: Outlook) -> Move:
    """An answer nobody waits for: a placement in it is handed back at once."""
    if isinstance(event.answer, Placement):
        return _move(life, ev.Release(event.attempt, event.answer.worker_id, NOT_WANTED))
    return _move(life)


def _send_failed(life: Life, event: ev.SendFailed, now: float, o: Outlook) -> Move:
    if life.phase == "admitting" and life.early:
        return _move(life._replace(early=False))  # sent once the job is accepted
    return _move(life)  # the attempt is void: the timeout reroutes the job


def _recorded(life: Life, event: ev.AttemptRecorded, now: float, o: Outlook) -> Move:
    return _move(life._replace(on_disk=max(life.on_disk, event.attempt)))


def _held(life: Life, event: Notice, now: float, o: Outlook) -> Move:
    """A return or notice for a job whose work went out before it was accepted waits for
    the acceptance; any other for an admitting job is a stray."""
    attempt = 1 if isinstance(event, ev.DeadLettered) else event.attempt
    if life.early and attempt == 1:
        return _move(life, ev.Hold())
    if isinstance(event, ev.Returned):
        return _move(life, ev.Discard(Tally.FENCED_RETURNS, "unknown"))
    return _move(life, ev.Ack(), ev.Count(Tally.STALE_NOTICES))


def _returned(life: Life, event: ev.Returned, now: float, o: Outlook) -> Move:
    """Fencing: a return concludes the job only for its current attempt, from the worker
    that attempt went to, while the job waits on it (or waits here, rerouted, not started:
    the outbox still holds it as offloaded as that attempt)."""
    verdict = _verdict(life, event)
    if verdict is not None:
        return _move(life, ev.Discard(Tally.FENCED_RETURNS, verdict))
    if event.not_run is not None:  # never ran there: run it here, no new offer
        count = (ev.Ack(), ev.Count(Tally.NOT_RUN_RETURNS))
        if life.phase == "queued":
            return _move(life._replace(declined=life.declined or event.not_run), *count)
        return _run_here(life, event.not_run, o, *count)
    forward = life.on_disk == event.attempt
    conclude = ev.ConcludeReturn(event.attempt, forward)
    finishing = life._replace(phase="finishing", ack_return=True, forwarded=forward)
    return _move(finishing, conclude)


def _verdict(life: Life, event: ev.Returned) -> str | None:
    if life.phase == "concluded":
        return "unknown"  # concluded already, or never ours: a duplicate or a stray
    if event.attempt != life.attempt or life.attempt == 0:
        return "stale"
    if life.worker is not None and event.worker != life.worker:
        return "stranger"  # the attempt went to another worker
    if life.phase not in ("queued", "offloaded"):
        return "busy"  # placed anew, running here, or its result is being committed
    return None


def _worker_lost(life: Life, event: ev.WorkerLost, now: float, o: Outlook) -> Move:
    if life.phase != "offloaded" or event.attempt != life.attempt:
        return _move(life, ev.Ack(), ev.Count(Tally.STALE_NOTICES))
    lost = Declined("worker_lost", event.reason)
    return _reroute(life, lost, now, o, ev.Ack(), ev.Count(Tally.WORKERS_LOST))


def _dead_lettered(life: Life, event: ev.DeadLettered, now: float, o: Outlook) -> Move:
    if life.phase not in ("queued", "offering", "offloaded"):
        return _move(life, ev.Ack(), ev.Count(Tally.STALE_NOTICES))
    return _dead_letter(life._replace(asking=0), event.reason, ev.Ack())


def _overdue(life: Life, event: ev.Overdue, now: float, o: Outlook) -> Move:
    """The return waited for long enough: after ``result_timeout_s`` the attempt is lost
    and the job rerouted; before it, once only a run here can still meet the deadline, the
    job joins the local queue (the worker's return is still taken if it comes first)."""
    if (life.expires_at or 0.0) <= now:
        by_deadline = life.deadline is not None and life.expires_at == life.deadline
        waited = "by the job's deadline" if by_deadline else f"within {o.result_timeout_s} s"
        why = Declined("result_timeout", f"no result from {life.worker or 'the pool'} {waited}")
        return _reroute(life, why, now, o, ev.Count(Tally.OFFLOAD_TIMEOUTS))
    if life.rescue_at is None or life.rescue_at > now:
        return _move(life)
    why = Declined(
        "worker_silent",
        f"no result from {life.worker or 'the worker'} while a run here could still meet "
        "the deadline",
    )
    return _run_here(life._replace(rescue_at=None), why, o, ev.Count(Tally.OFFLOAD_RESCUES))


def _start(life: Life, event: ev.Start, now: float, o: Outlook) -> Move:
    late = rules.expiry_reason(life.deadline, now)
    if late is not None:
        return _expire(life, late)
    if life.local_runs >= o.max_local_runs:  # each run so far ended with the agent dying
        reason = rules.dead_letter_reason(life.job_id, o.edge_id, life.local_runs)
        return _dead_letter(life, reason)
    return _to(life, "starting", ev.CountRun())


def _counted(life: Life, event: ev.RunCounted, now: float, o: Outlook) -> Move:
    if event.runs is None:  # disk trouble: it replays after a restart
        return _to(life, "concluded", ev.Forget())
    life = life._replace(local_runs=event.runs)
    late = rules.expiry_reason(life.deadline, now)
    if late is not None:
        return _expire(life, late)
    return _to(life, "running", ev.Launch())


def _run_done(life: Life, event: ev.RunDone, now: float, o: Outlook) -> Move:
    conclude = ev.ConcludeHere(event.status, event.code, event.reason, event.detail, life.predicted)
    return _to(life, "finishing", conclude)


def _committed(life: Life, event: ev.ResultCommitted, now: float, o: Outlook) -> Move:
    if event.stored is None:  # not committed: it replays (or is redelivered) later
        return _to(life, "concluded", ev.Count(Tally.OUTBOX_ERRORS))
    ack = (ev.Ack(),) if life.ack_return else ()
    if event.stored:
        return _to(life, "concluded", *ack, ev.Publish(sent=life.forwarded), ev.Remember())
    # The outbox refused a result this agent thought it could take: trust the disk.
    return _to(life, "concluded", *ack, ev.Count(Tally.LATE_RESULTS), ev.Resync())


def _ignore(life: Life, event: Event, now: float, o: Outlook) -> Move:
    return _move(life)


def _discard_unknown(life: Life, event: Notice, now: float, o: Outlook) -> Move:
    if isinstance(event, ev.Returned):
        return _move(life, ev.Discard(Tally.FENCED_RETURNS, "unknown"))
    return _move(life, ev.Ack(), ev.Count(Tally.STALE_NOTICES))


def _row(
    table: dict[tuple[Phase, type[object]], Rule],
    phase: Phase,
    kind: type[E],
    rule: Callable[[Life, E, float, Outlook], Move],
) -> None:
    """Put ``rule`` in the table for ``kind`` in ``phase``: mypy checks here that the rule
    takes that event. :func:`transition` finds a rule by the event's exact type, so the
    table may hold it as a rule of any event."""
    table[phase, kind] = cast(Rule, rule)


def _table() -> dict[tuple[Phase, type[object]], Rule]:
    live: tuple[Phase, ...] = ("queued", "starting", "running", "offering", "offloaded")
    table: dict[tuple[Phase, type[object]], Rule] = {}
    _row(table, "new", ev.Admit, _admit)
    _row(table, "new", ev.Replayed, _replayed)
    _row(table, "admitting", ev.Accepted, _accepted)
    _row(table, "admitting", ev.AcceptKnown, _accept_known)
    _row(table, "admitting", ev.Answered, _answered_ahead)
    _row(table, "offering", ev.Answered, _answered)
    _row(table, "admitting", ev.Returned, _held)
    _row(table, "admitting", ev.WorkerLost, _held)
    _row(table, "admitting", ev.DeadLettered, _held)
    _row(table, "offloaded", ev.Overdue, _overdue)
    _row(table, "starting", ev.RunCounted, _counted)
    _row(table, "running", ev.RunDone, _run_done)
    _row(table, "finishing", ev.ResultCommitted, _committed)
    _row(table, "concluded", ev.Returned, _discard_unknown)
    _row(table, "concluded", ev.WorkerLost, _discard_unknown)
    _row(table, "concluded", ev.DeadLettered, _discard_unknown)
    for phase in PHASES:
        if phase == "new":
            continue
        _row(table, phase, ev.AttemptRecorded, _recorded)
        _row(table, phase, ev.SendFailed, _send_failed)
        if (phase, ev.Answered) not in table:
            _row(table, phase, ev.Answered, _answered_late)
        _row(table, phase, ev.Start, _start if phase == "queued" else _ignore)
    for phase in (*live, "finishing"):
        _row(table, phase, ev.Returned, _returned)
        _row(table, phase, ev.WorkerLost, _worker_lost)
        _row(table, phase, ev.DeadLettered, _dead_lettered)
    return table


TABLE = _table()
