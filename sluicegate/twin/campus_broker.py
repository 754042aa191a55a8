"""The twin's campus broker: what ``broker/service.py`` does with an edge's placement
request, run on the replay's clock. Each request is decided by ``broker.core.batch``'s turn
(``decide_turn``, then ``settle``) against the replay's :class:`~broker.core.fleet.Fleet`
under the run's policy and parameters, or by a baseline strategy
(:mod:`sluicegate.twin.strategies`); one that finds no room waits in the broker's waiting
room (``broker.core.mlfq``, ``service_rules.answer_by``); one no worker here can take in time
may be asked of a sister campus (:mod:`sluicegate.twin.peering`). The answer reaches the
edge after the wait the trace measured for it. One replica: every placement it reserves is
granted. It models no sealing keys: a recorded worker holds the key the policy lists.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from broker.core import service_rules
from broker.core.batch import decide_turn, settle
from broker.core.demand import WANTED
from broker.core.fleet import Fleet
from broker.core.mlfq import MLFQ
from broker.core.mlfq import Waiting as WaitingJob
from broker.core.params import PlacementParams
from broker.core.peering import PeerRefused
from edge_agent import events as ev
from edge_agent.rules import Declined, Placement
from policies.evaluate import allowed
from policies.model import Policy
from sluicegate import topics
from sluicegate.twin import strategies
from sluicegate.twin.draws import Draws
from sluicegate.twin.nodes import (
    BROKER_MAX_WAIT_MS,
    EDGE_MAX_WAIT_MS,
    PLACEMENT_TIMEOUT_S,
    Change,
    Job,
    SimWorker,
    unsealed,
)
from sluicegate.twin.peering import PeerPlaced, Sisters
from sluicegate.wire_pool import PlacementRequest


class Schedule(Protocol):
    """The clock's one door: call ``fn(when, *args)`` at virtual time ``when``."""

    def __call__(self, when: float, fn: Callable[..., None], /, *args: Any) -> None: ...


@dataclass(eq=False, slots=True)
class Asked:
    """A placement request on its way through the twin's broker."""

    job: Job
    attempt: int
    request: PlacementRequest
    delay: float  # until the answer reaches the edge (the round trip the trace measured)
    late: bool  # the edge stops waiting first: it runs the job (broker_timeout)


class SimBroker:
    """The campus broker of one replay: its decisions, its waiting room, what it refused."""

    def __init__(
        self,
        at: Schedule,
        *,
        change: Change,
        policy: Policy,
        params: PlacementParams,
        draws: Draws,
        workers: dict[str, SimWorker],
        fleet: Fleet,
        sisters: Sisters | None,
        edge_event: Callable[[Job], Callable[..., None]],
    ) -> None:
        """``edge_event(job)``: the handler of events for the job's edge (its carrier's)."""
        self.at = at
        self.change = change
        self.policy = policy
        self.params = params
        self.draws = draws
        self.workers = workers
        self.fleet = fleet
        self.sisters = sisters
        self._edge_event = edge_event
        self.refusals: Counter[str] = Counter()
        self.placed_by_pool: Counter[str] = Counter()  # since the last tick (the signal's)
        # Refused for want of a worker since the last tick, by (data class, origin zone).
        self.turned_away: Counter[tuple[str, str]] = Counter()
        self._pool_of = {w: p.name for p in policy.pools for w in p.workers}
        self.violations = 0
        self.asked = 0  # placement requests the edges sent
        self._turn: Counter[str] = Counter()  # round-robin position per model
        wait_s = BROKER_MAX_WAIT_MS / 1000.0  # the broker's waiting room, as it sizes it
        self.room: MLFQ[Asked] = MLFQ(max(wait_s, 1e-3), max(wait_s / 10.0, 1e-4))

    def ask(self, now: float, job: Job, attempt: int, reason: str, local_s: float) -> None:
        """An edge asks for a placement: the broker decides at once, and its answer reaches
        the edge after the wait the trace measured for that edge (past the edge's placement
        timeout too, where a busy edge took the answer before its timer: the trace says
        which), or, where the edge gave up waiting (``broker_timeout``), never: the job
        stays, and the late placement is handed back."""
        self.asked += 1
        ms, late = self.draws.ask_ms(job.rec.edge, job.rec.at, job.own)
        delay = ms / 1000.0
        asked = Asked(job, attempt, job.request(reason, local_s), delay, late)
        if late:
            self.refusals["broker_timeout"] += 1
            why = f"no placement answer within {PLACEMENT_TIMEOUT_S * 1000:.0f} ms"
            answer = ev.Answered(attempt, Declined("broker_timeout", why))
            self.at(now + PLACEMENT_TIMEOUT_S, self._edge_event(job), job.job_id, answer)
        self._offer(now, asked)

    def _offer(self, now: float, asked: Asked) -> None:
        if self.change.strategy != "ours":
            self._offer_other(now, asked)
            return
        turn = decide_turn(
            self.fleet,
            (asked,),
            _request_of,
            self.policy,
            now=now,
            params=self.params,
            hold=self._hold,
            sealable=unsealed,
            forward=self._forward if self.sisters and self.policy.peers_out() else None,
        )
        granted = [True] * len(turn.placed)  # one replica: nobody takes a slot first
        settled = settle(self.fleet, turn.placed, granted, _request_of, now=now)
        for item, placed in settled.granted:
            self._placed(now, item, placed.worker_id, placed.predicted_ms)
        for refusal in (*turn.refused, *settled.refused):
            self._declined(now, refusal.item, refusal.code, refusal.reason)

    def _offer_other(self, now: float, asked: Asked) -> None:
        """A baseline strategy's choice (``sluicegate.twin.strategies``)."""
        rec, job = asked.job.rec, asked.job
        eligible = strategies.with_room(
            self.fleet,
            self.workers.values(),
            self.policy,
            model=rec.model,
            data_class=rec.data_class,
            origin=job.origin,
        )
        if not eligible:
            self._declined(now, asked, "no_worker", "no worker of the strategy has room")
            return
        worker = strategies.choose(self.change.strategy, eligible, self._turn, rec.model)
        self.fleet.reserve(worker.spec.id, job.job_id, now, rec.model)
        self._placed(now, asked, worker.spec.id, None)

    def _placed(self, now: float, asked: Asked, worker_id: str, predicted: float | None) -> None:
        job, worker = asked.job, self.workers[worker_id]
        self.placed_by_pool[self._pool_of.get(worker_id, "?")] += 1
        if not allowed(self.policy, job.rec.data_class, job.origin, worker.spec.zone).allowed:
            self.violations += 1
        if asked.late:  # the edge gave up first: it hands the placement back as it comes
            self.at(now + asked.delay, self._hand_back, job)
            return
        if job.cancelled == asked.attempt:  # the edge stopped waiting: handed back
            self.fleet.release(job.job_id)
            return
        placement = Placement(worker_id, worker.spec.zone, "", "", b"", predicted)
        self._answer(now, asked, placement)

    def _forward(self, asked: Asked, now: float) -> bool:
        """The broker asks a sister campus for a job it cannot take in time, as its
        forwarder does (:meth:`~sluicegate.twin.peering.Sisters.forward`)."""
        assert self.sisters is not None
        job = asked.job
        waited = now - job.waiting_since if job.waiting_since is not None else 0.0
        return self.sisters.forward(asked.request, now, waited, partial(self._relay, asked))

    def _relay(self, asked: Asked, now: float, answer: PeerPlaced | PeerRefused) -> None:
        """A sister campus's answer, relayed to the edge (a refusal or no answer in time:
        the edge runs the job); nothing hands back a placement the edge stopped waiting for."""
        assert self.sisters is not None
        if isinstance(answer, PeerRefused):
            self._declined(now, asked, answer.code, answer.reason)
            return
        if self.sisters.broke_agreement(asked.job.rec.data_class, answer.worker):
            self.violations += 1
        if asked.late or asked.job.cancelled == asked.attempt:
            return
        campus = topics.campus_of(answer.worker)
        placement = Placement(
            answer.worker, answer.zone, "", "", b"", answer.predicted_ms, campus=campus
        )
        self._answer(now, asked, placement)

    def _hand_back(self, now: float, job: Job) -> None:
        self.fleet.release(job.job_id)

    def _declined(self, now: float, asked: Asked, code: str, reason: str) -> None:
        self.refusals[code] += 1
        if code in WANTED:
            self.turned_away[asked.request.data_class, asked.request.origin_zone] += 1
        if asked.job.cancelled != asked.attempt and not asked.late:
            self._answer(now, asked, Declined(code, reason))

    def _answer(self, now: float, asked: Asked, answer: Placement | Declined) -> None:
        event = ev.Answered(asked.attempt, answer)
        self.at(now + asked.delay, self._edge_event(asked.job), asked.job.job_id, event)

    def _hold(self, asked: Asked, now: float) -> bool:
        """The broker's waiting room: a request that found no worker with room waits for
        one (``service_rules.answer_by``), in its multi-level-feedback order."""
        job = asked.job
        since = job.waiting_since if job.waiting_since is not None else now
        by = service_rules.answer_by(
            since,
            now,
            broker_max_wait_ms=BROKER_MAX_WAIT_MS,
            edge_max_wait_ms=EDGE_MAX_WAIT_MS,
            deadline_at=job.deadline,
        )
        if by is None or not self.room.push(
            WaitingJob(job.job_id, job.rec.priority, by, since, asked), now
        ):
            return False
        job.waiting_since = since
        self.at(by, self.room_look)
        return True

    def room_look(self, now: float) -> None:
        """Capacity may have freed, or a wait is over: those whose wait is over run on their
        edge (``no_capacity``); the others, in their turn, are decided again."""
        for gone in self.room.expired(now):
            waited = (now - (gone.item.job.waiting_since or now)) * 1000.0
            why = f"no allowed worker had room within {waited:.0f} ms; run locally"
            self._declined(now, gone.item, "no_capacity", why)
        ready = []
        while (turn := self.room.pop_ready(now)) is not None:
            ready.append(turn.item)
        for asked in ready:  # one look each: one still without room waits again
            self._offer(now, asked)


def _request_of(asked: Asked) -> PlacementRequest:
    return asked.request
