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
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from edge_agent import rules
from edge_agent.events import (
    PHASES,
    Accepted,
    AcceptKnown,
    Ack,
    Admit,
    Answered,
    Ask,
    AttemptRecorded,
    CancelAsk,
    CommitAcceptance,
    ConcludeHere,
    ConcludeReturn,
    Count,
    CountRun,
    DeadLettered,
    Discard,
    DiscardHeld,
    Effect,
    Effects,
    Enqueue,
    Event,
    Forget,
    Hold,
    IllegalMove,
    Launch,
    Life,
    Move,
    Overdue,
    Phase,
    Publish,
    RecordAttempt,
    Rehandle,
    Release,
    Remember,
    Replayed,
    ResultCommitted,
    Resync,
    Returned,
    Rule,
    RunCounted,
    RunDone,
    Send,
    SendFailed,
    Start,
    WorkerLost,
)
from edge_agent.rules import Declined, Outlook, Placement
from edge_agent.tally import Tally

NOT_WANTED = "the job was concluded meanwhile"


def transition(life: Life, event: Event, now: float, outlook: Outlook) -> Move:
    """The job's next life and the effects to carry out; raises IllegalMove when the table
    has no row for ``event`` in ``life.phase``."""
    rule = TABLE.get((life.phase, type(event)))
    if rule is None:
        raise IllegalMove(life, event)
    return rule(life, event, now, outlook)


def _stay(life: Life, *effects: Effect) -> Move:
    return life, effects


def _to(life: Life, phase: Phase, *effects: Effect, **changes: Any) -> Move:
    return replace(life, phase=phase, **changes), effects


# -- shared moves -------------------------------------------------------------------------------


def _expire(life: Life, reason: str, *before: Effect) -> Move:
    return _to(life, "finishing", *before, ConcludeHere("expired", "expired", reason))


def _dead_letter(life: Life, reason: str, *before: Effect) -> Move:
    conclude = ConcludeHere("failed", "dead_letter", reason)
    return _to(life, "finishing", *before, Count(Tally.DEAD_LETTERS), conclude)


def _run_here(life: Life, why: Declined | None, *before: Effect) -> Move:
    """Into the local queue; ``why`` it did not leave goes into its result."""
    return _to(life, "queued", *before, Enqueue(), declined=life.declined or why)


def _ask(life: Life, reason: str, now: float, o: Outlook, *before: Effect) -> Move:
    attempt = life.attempt + 1
    ask = Ask(attempt, reason, max(0.0, o.predicted_done - now))
    return _to(life, "offering", *before, ask, asking=attempt)


def _route(life: Life, now: float, o: Outlook, *before: Effect) -> Move:
    """An accepted job on its way: expired, offered when it would be late here (or the
    local queue is long), else into the local queue."""
    late = rules.expiry_reason(life.deadline, now)
    if late is not None:
        return _expire(life, late, *before)
    reason = rules.offer_reason(life.deadline, o)
    if reason is not None:
        return _ask(life, reason, now, o, *before)
    return _run_here(life, None, *before)


def _reroute(life: Life, why: Declined, now: float, o: Outlook, *before: Effect) -> Move:
    """An offloaded job whose attempt was lost: expired, offered again, or run here."""
    late = rules.expiry_reason(life.deadline, now, lost=why)
    if late is not None:
        return _expire(life, late, *before)
    reason = rules.retry_reason(life.attempt, life.deadline, o)
    if reason is not None:
        return _ask(life, reason, now, o, *before)
    return _run_here(life, why, *before)


def _placed(life: Life, placement: Placement, now: float, o: Outlook, *effects: Effect) -> Move:
    """The job is on ``placement``'s worker as attempt ``asking``."""
    attempt = life.asking
    expires = rules.offload_expiry(now, o.result_timeout_s, life.deadline)
    return _to(
        life,
        "offloaded",
        RecordAttempt(attempt, placement.worker_id),
        *effects,
        attempt=attempt,
        asking=0,
        worker=placement.worker_id,
        expires_at=expires,
        ahead=None,
        early=False,
    )


def _not_placed(life: Life, why: Declined, *before: Effect) -> Move:
    life = replace(life, asking=0, ahead=None)
    if why.code == "dead_letter":  # the broker will not place it again
        return _dead_letter(life, why.reason, *before)
    return _run_here(life, why, *before)


def _drop_ahead(life: Life, why: str) -> Effects:
    """Give up the placement asked for while the job was admitted."""
    if life.early:
        return (DiscardHeld(),)  # the worker has it; what it returns finds nothing to take
    if isinstance(life.ahead, Placement):
        return (Release(1, life.ahead.worker_id, why),)
    if life.asking and life.ahead is None:
        return (CancelAsk(life.asking),)  # the client hands back a placement that comes after
    return ()


# -- rules --------------------------------------------------------------------------------------


def _admit(life: Life, ev: Any, now: float, o: Outlook) -> Move:
    assert isinstance(ev, Admit)
    effects: list[Effect] = [CommitAcceptance(ev.run_now)]
    if ev.ask is not None:
        effects.append(Ask(1, ev.ask, ev.local_s))
    return _to(life, "admitting", *effects, run_now=ev.run_now, asking=1 if ev.ask else 0)


def _replayed(life: Life, ev: Any, now: float, o: Outlook) -> Move:
    assert isinstance(ev, Replayed)
    life = replace(life, attempt=ev.attempt, local_runs=ev.local_runs)
    if ev.plan == "await_return":  # on disk as offloaded as that attempt
        expires = rules.offload_expiry(now, o.result_timeout_s, life.deadline)
        return _to(life, "offloaded", worker=ev.worker, expires_at=expires, on_disk=ev.attempt)
    if ev.plan == "dead_letter":
        return _dead_letter(life, rules.dead_letter_reason(life.job_id, o.edge_id, ev.local_runs))
    return _route(life, now, o)


def _accepted(life: Life, ev: Any, now: float, o: Outlook) -> Move:
    if life.run_now:  # its run is counted already
        late = rules.expiry_reason(life.deadline, now)
        if late is not None:
            return _expire(replace(life, local_runs=1), late, Ack())
        return _to(life, "running", Ack(), Launch(), local_runs=1, run_now=False)
    if not life.asking:
        return _route(life, now, o, Ack())
    late = rules.expiry_reason(life.deadline, now)
    if late is not None:
        return _expire(life, late, Ack(), *_drop_ahead(life, "the job's deadline passed"))
    if life.early:
        assert isinstance(life.ahead, Placement)
        return _placed(life, life.ahead, now, o, Ack(), Rehandle())
    if isinstance(life.ahead, Placement):  # came during the commit, not sent then
        return _placed(life, life.ahead, now, o, Ack(), Send(1, life.ahead))
    if isinstance(life.ahead, Declined):
        return _not_placed(life, life.ahead, Ack())
    return _to(life, "offering", Ack())  # its answer is still to come


def _accept_known(life: Life, ev: Any, now: float, o: Outlook) -> Move:
    drop = _drop_ahead(life, "a repeat of a job this edge knows")
    return _to(life, "concluded", *drop, Forget(), run_now=False)


def _answered_ahead(life: Life, ev: Any, now: float, o: Outlook) -> Move:
    assert isinstance(ev, Answered)
    if ev.attempt != life.asking or life.ahead is not None:
        return _answered_late(life, ev, now, o)
    if isinstance(ev.answer, Placement):  # sent at once: the commit is off the job's path
        sent = Count(Tally.SENT_BEFORE_COMMIT)
        return _stay(replace(life, ahead=ev.answer, early=True), Send(1, ev.answer), sent)
    return _stay(replace(life, ahead=ev.answer))


def _answered(life: Life, ev: Any, now: float, o: Outlook) -> Move:
    assert isinstance(ev, Answered)
    if ev.attempt != life.asking:
        return _answered_late(life, ev, now, o)
    if isinstance(ev.answer, Placement):
        return _placed(life, ev.answer, now, o, Send(ev.attempt, ev.answer))
    return _not_placed(life, ev.answer)


def _answered_late(life: Life, ev: Any, now: float, o: Outlook) -> Move:
    """An answer nobody waits for: a placement in it is handed back at once."""
    assert isinstance(ev, Answered)
    if isinstance(ev.answer, Placement):
        return _stay(life, Release(ev.attempt, ev.answer.worker_id, NOT_WANTED))
    return _stay(life)


def _send_failed(life: Life, ev: Any, now: float, o: Outlook) -> Move:
    if life.phase == "admitting" and life.early:
        return _stay(replace(life, early=False))  # sent once the job is accepted
    return _stay(life)  # the attempt is void: the timeout reroutes the job


def _recorded(life: Life, ev: Any, now: float, o: Outlook) -> Move:
    assert isinstance(ev, AttemptRecorded)
    return _stay(replace(life, on_disk=max(life.on_disk, ev.attempt)))


def _held(life: Life, ev: Any, now: float, o: Outlook) -> Move:
    """A return or notice for a job whose work went out before it was accepted waits for
    the acceptance; any other for an admitting job is a stray."""
    if life.early and getattr(ev, "attempt", 1) == 1:
        return _stay(life, Hold())
    if isinstance(ev, Returned):
        return _stay(life, Discard(Tally.FENCED_RETURNS, "unknown"))
    return _stay(life, Ack(), Count(Tally.STALE_NOTICES))


def _returned(life: Life, ev: Any, now: float, o: Outlook) -> Move:
    """Fencing: a return concludes the job only for its current attempt, from the worker
    that attempt went to, while the job waits on it (or waits here, rerouted, not started:
    the outbox still holds it as offloaded as that attempt)."""
    assert isinstance(ev, Returned)
    verdict = _verdict(life, ev)
    if verdict is not None:
        return _stay(life, Discard(Tally.FENCED_RETURNS, verdict))
    if ev.not_run is not None:  # never ran there: run it here, no new offer
        count = (Ack(), Count(Tally.NOT_RUN_RETURNS))
        if life.phase == "queued":
            return _stay(replace(life, declined=life.declined or ev.not_run), *count)
        return _run_here(life, ev.not_run, *count)
    forward = life.on_disk == ev.attempt
    conclude = ConcludeReturn(ev.attempt, forward)
    return _to(life, "finishing", conclude, ack_return=True, forwarded=forward)


def _verdict(life: Life, ev: Returned) -> str | None:
    if life.phase == "concluded":
        return "unknown"  # concluded already, or never ours: a duplicate or a stray
    if ev.attempt != life.attempt or life.attempt == 0:
        return "stale"
    if life.worker is not None and ev.worker != life.worker:
        return "stranger"  # the attempt went to another worker
    if life.phase not in ("queued", "offloaded"):
        return "busy"  # placed anew, running here, or its result is being committed
    return None


def _worker_lost(life: Life, ev: Any, now: float, o: Outlook) -> Move:
    assert isinstance(ev, WorkerLost)
    if life.phase != "offloaded" or ev.attempt != life.attempt:
        return _stay(life, Ack(), Count(Tally.STALE_NOTICES))
    lost = Declined("worker_lost", ev.reason)
    return _reroute(life, lost, now, o, Ack(), Count(Tally.WORKERS_LOST))


def _dead_lettered(life: Life, ev: Any, now: float, o: Outlook) -> Move:
    assert isinstance(ev, DeadLettered)
    if life.phase not in ("queued", "offering", "offloaded"):
        return _stay(life, Ack(), Count(Tally.STALE_NOTICES))
    return _dead_letter(replace(life, asking=0), ev.reason, Ack())


def _overdue(life: Life, ev: Any, now: float, o: Outlook) -> Move:
    if (life.expires_at or 0.0) > now:
        return _stay(life)
    why = Declined("result_timeout", f"no result from the pool within {o.result_timeout_s} s")
    return _reroute(life, why, now, o, Count(Tally.OFFLOAD_TIMEOUTS))


def _start(life: Life, ev: Any, now: float, o: Outlook) -> Move:
    late = rules.expiry_reason(life.deadline, now)
    if late is not None:
        return _expire(life, late)
    if life.local_runs >= o.max_local_runs:  # each run so far ended with the agent dying
        reason = rules.dead_letter_reason(life.job_id, o.edge_id, life.local_runs)
        return _dead_letter(life, reason)
    return _to(life, "starting", CountRun())


def _counted(life: Life, ev: Any, now: float, o: Outlook) -> Move:
    assert isinstance(ev, RunCounted)
    if ev.runs is None:  # disk trouble: it replays after a restart
        return _to(life, "concluded", Forget())
    life = replace(life, local_runs=ev.runs)
    late = rules.expiry_reason(life.deadline, now)
    if late is not None:
        return _expire(life, late)
    return _to(life, "running", Launch())


def _run_done(life: Life, ev: Any, now: float, o: Outlook) -> Move:
    assert isinstance(ev, RunDone)
    status = ev.status
    assert status in ("ok", "rejected", "failed"), status
    return _to(life, "finishing", ConcludeHere(status, ev.code, ev.reason, ev.detail))  # type: ignore[arg-type]


def _committed(life: Life, ev: Any, now: float, o: Outlook) -> Move:
    assert isinstance(ev, ResultCommitted)
    if ev.stored is None:  # not committed: it replays (or is redelivered) later
        return _to(life, "concluded", Count(Tally.OUTBOX_ERRORS))
    ack = (Ack(),) if life.ack_return else ()
    if ev.stored:
        return _to(life, "concluded", *ack, Publish(sent=life.forwarded), Remember())
    # The outbox refused a result this agent thought it could take: trust the disk.
    return _to(life, "concluded", *ack, Count(Tally.LATE_RESULTS), Resync())


def _ignore(life: Life, ev: Any, now: float, o: Outlook) -> Move:
    return _stay(life)


def _discard_unknown(life: Life, ev: Any, now: float, o: Outlook) -> Move:
    if isinstance(ev, Returned):
        return _stay(life, Discard(Tally.FENCED_RETURNS, "unknown"))
    return _stay(life, Ack(), Count(Tally.STALE_NOTICES))


def _table() -> dict[tuple[Phase, type[Any]], Rule]:
    live: tuple[Phase, ...] = ("queued", "starting", "running", "offering", "offloaded")
    table: dict[tuple[Phase, type[Any]], Rule] = {
        ("new", Admit): _admit,
        ("new", Replayed): _replayed,
        ("admitting", Accepted): _accepted,
        ("admitting", AcceptKnown): _accept_known,
        ("admitting", Answered): _answered_ahead,
        ("offering", Answered): _answered,
        ("admitting", Returned): _held,
        ("admitting", WorkerLost): _held,
        ("admitting", DeadLettered): _held,
        ("offloaded", Overdue): _overdue,
        ("starting", RunCounted): _counted,
        ("running", RunDone): _run_done,
        ("finishing", ResultCommitted): _committed,
        ("concluded", Returned): _discard_unknown,
        ("concluded", WorkerLost): _discard_unknown,
        ("concluded", DeadLettered): _discard_unknown,
    }
    for phase in PHASES:
        if phase == "new":
            continue
        table[phase, AttemptRecorded] = _recorded
        table[phase, SendFailed] = _send_failed
        table.setdefault((phase, Answered), _answered_late)
        table[phase, Start] = _start if phase == "queued" else _ignore
    for phase in (*live, "finishing"):
        table[phase, Returned] = _returned
        table[phase, WorkerLost] = _worker_lost
        table[phase, DeadLettered] = _dead_lettered
    return table


TABLE = _table()
