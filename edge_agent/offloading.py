"""The jobs that leave this edge: offered to the campus broker as numbered attempts, sent to
workers, and taken back, or not, when a worker returns a result, the broker sends a notice,
or nothing comes back in time.

The agent keeps the job table, the local queue and every conclusion; this part only moves a
job between ``offering`` and ``offloaded`` and writes one thing to the outbox: the attempt,
as its work message is sent. A new job's first placement may be asked for ahead of its
offer (:meth:`Offloads.ask_ahead`, while the outbox commits its acceptance): the offer then
takes that answer instead of asking again, and a placement that comes before the commit
lands has its work sent at once, its return held until the offer takes the attempt.
Whenever a job will not leave (the broker declined, the worker refused the work unrun) it
goes back to the agent to run here; a lost worker or an overdue return sends it back to be
routed again (the next attempt, or here). A return is taken only for the job's current
attempt (fencing); anything else is discarded, counted and logged.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from edge_agent import ledger
from edge_agent.admission import Job
from edge_agent.ledger import Tracked
from edge_agent.offload import Declined, Placement, PlacementClient
from edge_agent.outbox import Outbox
from sluicegate.config import OffloadSettings
from sluicegate.transport import Message, Transport

log = logging.getLogger(__name__)
T = TypeVar("T")
Outcome = Placement | Declined


@dataclass(slots=True, eq=False)
class Asked:
    """A placement asked for ahead of the offer that will take it: the broker's answer for
    ``attempt`` of a job, on its way. ``sent`` once its work went out before the job's
    acceptance commit landed; ``taken`` once the offer took it or it was dropped."""

    reason: str
    attempt: int
    answer: asyncio.Future[Outcome]
    dropped: Callable[[Asked, str], None]  # not wanted after all, and why
    taken: bool = False
    sent: bool = False

    def drop(self, why: str) -> None:
        """Not wanted after all (``why``): the job proved a repeat, could not be stored, or
        its deadline passed before it was accepted."""
        if not self.taken:
            self.taken = True
            self.dropped(self, why)


@dataclass(frozen=True)
class Hooks:
    """What the offloading part asks of the agent that owns the jobs."""

    tracked: Callable[[str], Tracked | None]  # the job, if it is being tracked
    current: Callable[[Tracked, ledger.Phase], bool]  # still tracked, and in that phase
    run_here: Callable[[Tracked, Declined], None]  # into the local queue, with the reason
    reroute: Callable[[Tracked, Declined], None]  # route again: next attempt, or here
    take: Callable[[Tracked, bytes, str, int, Message], None]  # conclude with a return
    dead_letter: Callable[[Tracked, str], None]  # conclude failed/dead_letter with a reason
    settled: Callable[[], None]  # an offer ended: dispatch, update idleness


class Offloads:
    """Offers, attempts, returns, notices and timeouts of one edge's offloaded jobs."""

    def __init__(
        self,
        hooks: Hooks,
        client: PlacementClient | None,
        settings: OffloadSettings,
        transport: Transport,
        outbox: Outbox,
        clock: Callable[[], float],
        counters: Counter[str],
    ) -> None:
        self._hooks = hooks
        self._client = client
        self._settings = settings
        self._transport = transport
        self._outbox = outbox
        self._clock = clock
        self._counters = counters
        self._tasks: set[asyncio.Task[Any]] = set()
        # Sent early: returns and notices, with their handler, until the offer takes it.
        self._held: dict[str, list[tuple[Callable[[Message], None], Message]]] = {}
        self._killed = False
        self.offering = 0  # offers waiting for the broker now
        self.offloaded = 0  # work messages sent since start

    @property
    def available(self) -> bool:
        client = self._client
        return client is not None and self._settings.enabled and client.broker_available

    def retry_reason(self, tracked: Tracked) -> str | None:
        """Why to offer a job again after an attempt was lost, or None to run it here."""
        if not self.available or tracked.attempt >= self._settings.max_attempts:
            return None
        return "deadline" if tracked.job.deadline is not None else "queue"

    def ask_ahead(self, job: Job, reason: str, local_s: float) -> Asked:
        """Ask the broker now for the first attempt of a job not yet accepted; hand the
        result to :meth:`offer_asked` once the job is accepted, or :meth:`Asked.drop` it.
        A placement that comes while the outbox still commits the job has its work sent at
        once (:meth:`_send_early`): the commit is then off the job's path."""
        assert self._client is not None
        client = self._client
        answer = asyncio.ensure_future(client.place(job, reason, local_s, attempt=1))
        asked = Asked(reason, 1, answer, partial(self._dropped, client, job.job_id))
        answer.add_done_callback(partial(self._send_early, client, job, asked))
        return asked

    def _send_early(
        self, client: PlacementClient, job: Job, asked: Asked, answer: asyncio.Future[Outcome]
    ) -> None:
        """Send the work of a placement that came before its job was accepted. The request
        is acked only once the job is on disk, as ever; what the early send changes is what
        a crash or a refusal can leave: a worker running a job the edge never accepted, or
        one it knew already. Its return then finds no attempt to take and is discarded, and
        the worker's completion frees its slot. A return that comes before the acceptance is
        held, unacked, until the offer takes the attempt (:meth:`on_return`)."""
        if asked.taken or self._killed or answer.cancelled() or answer.exception() is not None:
            return
        placement = answer.result()
        if not isinstance(placement, Placement):
            return
        try:
            client.send(job, placement, attempt=asked.attempt)
        except Exception as exc:  # the offer sends it once the job is accepted
            log.warning("job %s: could not send attempt 1 early: %s", job.job_id, exc)
            return
        asked.sent = True
        self.offloaded += 1
        self._counters["sent_before_commit"] += 1
        self._held[job.job_id] = []

    def _hold(self, job_id: str, handle: Callable[[Message], None], msg: Message) -> bool:
        """Keep ``msg`` (unacked) for a job whose work went out before it was accepted, to
        be handled once the offer takes its attempt; False if the job is not such a one."""
        held = self._held.get(job_id)
        if held is None:
            return False
        held.append((handle, msg))
        return True

    def _discard_held(self, job_id: str) -> None:
        """Ack and drop what came for a job sent early that will not be taken."""
        for _handle, msg in self._held.pop(job_id, ()):
            self._counters["fenced_returns"] += 1
            self._transport.ack(msg)

    def _dropped(self, client: PlacementClient, job_id: str, asked: Asked, why: str) -> None:
        if asked.sent:  # the worker has the work: its return will find nothing to take
            self._discard_held(job_id)
            log.info("job %s: attempt 1 went out before the job was dropped (%s)", job_id, why)
            return
        if not asked.answer.done():
            asked.answer.cancel()  # the client hands back a placement that comes after
        elif not asked.answer.cancelled():
            outcome = asked.answer.result()
            if isinstance(outcome, Placement):
                client.release(job_id, outcome.worker_id, asked.attempt, why)

    def offer(self, tracked: Tracked, reason: str, local_s: float) -> None:
        """Ask the broker for the job's next attempt, in a task of its own."""
        assert self._client is not None
        attempt = tracked.attempt + 1
        ask = partial(self._client.place, tracked.job, reason, local_s, attempt=attempt)
        self._start_offer(tracked, reason, attempt, ask)

    def offer_asked(self, tracked: Tracked, asked: Asked) -> None:
        """Offer the job with the placement :meth:`ask_ahead` asked for: its answer (come
        or still to come) decides, as a fresh request's would."""
        assert asked.attempt == tracked.attempt + 1, (tracked.job.job_id, asked.attempt)
        asked.taken = True
        self._start_offer(tracked, asked.reason, asked.attempt, lambda: asked.answer, asked)

    def _start_offer(
        self,
        tracked: Tracked,
        reason: str,
        attempt: int,
        ask: Callable[[], Awaitable[Outcome]],
        asked: Asked | None = None,
    ) -> None:
        assert self._client is not None
        tracked.phase = "offering"
        self.offering += 1
        self._spawn(self._offer(self._client, tracked, reason, attempt, ask, asked))

    async def _offer(
        self,
        client: PlacementClient,
        tracked: Tracked,
        reason: str,
        attempt: int,
        ask: Callable[[], Awaitable[Outcome]],
        asked: Asked | None,
    ) -> None:
        job = tracked.job
        try:
            outcome = await ask()
            if isinstance(outcome, Placement):
                early = asked is not None and asked.sent
                declined = self._send(client, tracked, outcome, attempt, reason, early=early)
                if declined is None:
                    return
                outcome = declined
            if not self._hooks.current(tracked, "offering"):
                return  # concluded meanwhile
            if outcome.code == "dead_letter":  # the broker will not place it again
                self._dead_letter(tracked, outcome.reason)
                return
            log.info("job %s stays local: %s", job.job_id, outcome.reason)
            self._hooks.run_here(tracked, outcome)
        finally:
            self.offering -= 1
            self._hooks.settled()

    def _send(
        self,
        client: PlacementClient,
        tracked: Tracked,
        placement: Placement,
        attempt: int,
        reason: str,
        *,
        early: bool,
    ) -> Declined | None:
        """Send the work (unless it went out ``early``, before the job was accepted) and
        record the attempt on disk; None once sent (or moot).

        The record is not awaited before the send: the outbox applies writes in order, so
        a return that comes back first is still recorded after its attempt. A crash before
        the record lands only means the restarted agent places the job again under the
        same attempt number; whichever of the two results returns first concludes the job
        and the other is dropped as a repeat. Waiting for the disk here cost a thread
        round trip on every offloaded job."""
        job_id = tracked.job.job_id
        if not self._hooks.current(tracked, "offering"):
            if early:  # the worker has it; what it returns finds nothing to take
                self._discard_held(job_id)
            else:
                why = "the job was concluded meanwhile"
                client.release(job_id, placement.worker_id, attempt, why)
            return None
        self._outbox.offloaded(job_id, attempt).add_done_callback(
            partial(_recorded, tracked, attempt)
        )
        tracked.attempt = attempt
        tracked.worker = placement.worker_id
        tracked.phase = "offloaded"
        timeout = self._settings.result_timeout_s
        tracked.expires_at = ledger.offload_expiry(self._clock(), timeout, tracked.job.deadline)
        if early:
            for handle, msg in self._held.pop(job_id, ()):  # came before the job was accepted
                handle(msg)
        else:
            try:
                client.send(tracked.job, placement, attempt=attempt)
            except Exception as exc:  # the attempt is void: the timeout reroutes the job
                log.warning("job %s: could not send attempt %d: %s", job_id, attempt, exc)
                return None
            self.offloaded += 1
        log.info(
            "job %s attempt %d offloaded to %s (%s)", job_id, attempt, placement.worker_id, reason
        )
        return None

    # -- what comes back -------------------------------------------------------------------------

    def on_return(self, msg: Message) -> None:
        """A worker's result for a job this edge offloaded (manual ack: acked once it is
        committed, or at once when it is discarded)."""
        ret = ledger.read_return(msg)
        if isinstance(ret, str):
            self._counters["bad_returns"] += 1
            log.warning("discarded a return on %s: %s", msg.topic, ret)
            self._transport.ack(msg)
            return
        if self._hold(ret.job_id, self.on_return, msg):
            return
        tracked = self._hooks.tracked(ret.job_id)
        verdict = ledger.return_verdict(tracked, ret.attempt, ret.worker_id)
        if verdict != "accept" or tracked is None:
            self._counters["fenced_returns"] += 1
            log.info(
                "discarded the return of job %s attempt %d from %s (%s; current attempt %s)",
                ret.job_id,
                ret.attempt,
                ret.worker_id,
                verdict,
                tracked.attempt if tracked is not None else "none",
            )
            self._transport.ack(msg)
            return
        if ledger.not_run(ret.result):
            self._counters["not_run_returns"] += 1
            why = Declined(ret.result.code or "worker_refused", ret.result.reason or "refused")
            log.info("job %s was refused by %s: %s", ret.job_id, ret.worker_id, why.reason)
            self._transport.ack(msg)
            self._hooks.run_here(tracked, why)  # no new offer: run it here
            return
        self._hooks.take(tracked, ret.payload, ret.result.status, ret.attempt, msg)

    def on_notice(self, msg: Message) -> None:
        """The broker says a placed job's worker was lost, or the job is dead-lettered."""
        notice = ledger.read_notice(msg)
        if not isinstance(notice, str) and self._hold(notice.job_id, self.on_notice, msg):
            return
        self._transport.ack(msg)
        if isinstance(notice, str):
            self._counters["bad_notices"] += 1
            log.warning("discarded a notice on %s: %s", msg.topic, notice)
            return
        tracked = self._hooks.tracked(notice.job_id)
        if notice.kind == "dead_letter":
            if tracked is None or tracked.phase not in ledger.TAKES_DEAD_LETTER:
                self._counters["stale_notices"] += 1
                return
            self._dead_letter(tracked, notice.reason)
            return
        if (
            tracked is None
            or tracked.phase not in ledger.TAKES_WORKER_LOST
            or notice.attempt != tracked.attempt
        ):
            self._counters["stale_notices"] += 1
            return
        self._counters["workers_lost"] += 1
        log.info(
            "job %s attempt %d lost with worker %s", notice.job_id, notice.attempt, notice.worker_id
        )
        self._hooks.reroute(tracked, Declined("worker_lost", notice.reason))

    def _dead_letter(self, tracked: Tracked, reason: str) -> None:
        self._counters["dead_letters"] += 1
        self._hooks.dead_letter(tracked, reason)

    def check_overdue(self, jobs: Iterable[Tracked]) -> None:
        """Reroute offloaded jobs whose return is overdue (the broker, the worker or the
        message may be gone)."""
        now = self._clock()
        timeout = self._settings.result_timeout_s
        for tracked in list(jobs):
            if tracked.phase == "offloaded" and (tracked.expires_at or 0.0) <= now:
                self._counters["offload_timeouts"] += 1
                log.info(
                    "job %s attempt %d: no result within %.1f s; rerouting",
                    tracked.job.job_id,
                    tracked.attempt,
                    timeout,
                )
                why = Declined("result_timeout", f"no result from the pool within {timeout} s")
                self._hooks.reroute(tracked, why)

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def kill(self) -> None:
        self._killed = True
        self._held.clear()  # unacked: redelivered after the restart
        for task in list(self._tasks):
            task.cancel()


def _recorded(tracked: Tracked, attempt: int, fut: asyncio.Future[bool]) -> None:
    """Note an attempt that reached the disk (its return may then be forwarded before it is
    committed); log one that did not (the job is already on its way)."""
    if fut.cancelled():
        return
    exc = fut.exception()
    if exc is None and fut.result():
        tracked.on_disk = max(tracked.on_disk, attempt)
        return
    why = exc if exc is not None else "no pending job to record it on"
    log.warning("job %s: attempt %d not recorded on disk: %s", tracked.job.job_id, attempt, why)
