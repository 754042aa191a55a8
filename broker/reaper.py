"""The broker's asyncio shell for placed jobs after the decision: worker deaths, fencing of
completions, dead letters, placements their edge hands back.

A worker's Last Will arrives through :meth:`Reaper.worker_gone`; silence is found by a sweep
every interval over the workers that hold jobs in flight campus-wide (``broker.inflight``),
so a restarted replica, or one that never placed those jobs, still finds them. For each
dead worker the atomic claim hands the jobs to exactly one replica, which asks
:func:`broker.core.recovery.after_death` what to do and tells each job's edge
(``topics.edge_notices``, QoS 1): place it again, or stop (dead letter). Each completion is
fenced by :func:`broker.core.recovery.judge_completion` against the job's record. Every outcome
is counted, written to the job's record and audited. The edge also re-offers a job whose
result does not come back in time, which covers a replica that dies between its claim and
its notices. A worker that holds jobs and makes no progress (frozen) is found by
:meth:`Reaper.watch_progress` and goes the same way. It never decides a placement.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from broker import keys
from broker.core.fleet import Fleet
from broker.core.recovery import (
    Cause,
    Current,
    Notify,
    after_death,
    judge_completion,
    worker_gone,
)
from broker.core.shadow import Shadow
from broker.decision_audit import DecisionAudit, encode
from broker.inflight import InflightStore
from broker.lua import check_cancelled
from broker.metrics import BrokerMetrics
from broker.reservations import RELEASE
from broker.store import BrokerStore
from sluicegate import topics, wire
from sluicegate.config import BrokerSettings
from sluicegate.errors import StoreUnavailable, TransportError
from sluicegate.transport import Message, Transport
from sluicegate.wire_pool import Completion, JobNotice, PlacementRelease

log = logging.getLogger(__name__)
STALL_CHECK_S = 0.02  # how often workers holding jobs are checked for progress

AUDIT_KINDS = {
    "worker_lost": "job.worker_lost",
    "dead_letter": "job.dead_letter",
    "stale": "completion.stale",
    "after_loss": "completion.after_loss",
}


def tell_edge(transport: Transport, topic: str, notice: JobNotice) -> None:
    """Publish ``notice`` on an edge's notices topic (QoS 1), or log why it was not."""
    try:
        transport.publish_nowait(
            Message(
                topic,
                wire.dump(notice),
                qos=1,
                content_type=wire.RESULT_CONTENT_TYPE,
                user_properties=(
                    (topics.PROP_JOB_ID, notice.job_id),
                    (topics.PROP_ATTEMPT, str(notice.attempt)),
                ),
            )
        )
    except TransportError as exc:
        log.error("job %s: notice to %s not sent: %s", notice.job_id, topic, exc)


class Reaper:
    """Finds dead workers, has their jobs placed again, fences completions."""

    def __init__(
        self,
        settings: BrokerSettings,
        transport: Transport,
        inflight: InflightStore,
        store: BrokerStore,
        fleet: Fleet,
        metrics: BrokerMetrics,
        audit: DecisionAudit,
        clock: Callable[[], float],
        *,
        stale_after_s: float,
        to_peer: Callable[[str, str, JobNotice], None] | None = None,
    ) -> None:
        """``to_peer(campus, edge, notice)``: a notice for the edge of a sister campus (a job
        it asked this campus to place), sent across (``broker.peers.Peers.notify``)."""
        self.settings = settings
        self._to_peer = to_peer
        self._transport = transport
        self._inflight = inflight
        self._store = store
        self._fleet = fleet
        self._metrics = metrics
        self._audit = audit
        self._clock = clock
        self.stale_after_s = stale_after_s  # silence that makes a worker dead
        self.sweep_s = min(settings.telemetry_interval_s, 1.0)
        self._gone: dict[str, Cause] = {}  # dead workers whose jobs are not claimed yet
        self._wake = asyncio.Event()
        self._started: float | None = None
        self.carried_over = (0, 0)  # (workers, jobs) in flight found in Redis at start

    async def watch_progress(self, views: Sequence[Fleet | Shadow]) -> None:
        """Every ``STALL_CHECK_S``, the workers holding jobs placed here are checked for
        progress (``Fleet.check_progress``: frozen, a hung driver), in ``views`` (the
        production fleet, and the shadow's). One with a job long
        overdue takes no new placement until its next completion or telemetry; one still
        silent past its next batch's time is out of placement in every view and its jobs
        in flight go back to their edges through the lost-worker path (placed again, or
        run on the line PC, the stale attempt fenced), long before its telemetry would go
        stale."""
        while True:
            await asyncio.sleep(STALL_CHECK_S)
            now = self._clock()
            found = self._fleet.check_progress(now)
            for worker_id in found.suspected:
                self._metrics.worker_suspicions.inc()
                log.debug("worker %s has a job overdue: no new placement there for now", worker_id)
            for worker_id in found.stalled:
                log.warning(
                    "worker %s completed nothing while holding %d job(s) placed here, long "
                    "past what their placements expected: out of placement until it shows a "
                    "sign of life, its jobs placed again",
                    worker_id,
                    self._fleet.reserved(worker_id),
                )
                for view in views:
                    view.mark_stalled(worker_id, now)
                self.worker_gone(worker_id, "stalled")

    # -- events (event loop, quick) ------------------------------------------------------------

    def worker_gone(self, worker_id: str, cause: Cause) -> None:
        """The worker is dead (its Last Will, or silence): claim its jobs soon."""
        self._gone.setdefault(worker_id, cause)
        self._wake.set()

    def completed(self, done: Completion) -> None:
        """A completion record: free the worker's slot now, fence it once the job's record
        is read (in the store's next pipeline)."""
        self._store.release_slot(done.worker_id, done.job_id)
        self._inflight.current(done.job_id, partial(self._judge, done))

    def _judge(self, done: Completion, current: Current | None) -> None:
        judged = judge_completion(current, attempt=done.attempt, worker_id=done.worker_id)
        if judged.drop:
            assert current is not None
            self._inflight.finish(done.job_id, current.attempt, done.worker_id)
        elif judged.unlist:
            self._inflight.unlist(done.job_id, done.worker_id)
        if judged.verdict in ("current", "unknown"):
            self._store.job_status(
                done.job_id, {"status": f"completed:{done.status}", "attempt": done.attempt}
            )
            return
        if judged.verdict == "stale":
            self._metrics.stale_completions.inc()
        record = {
            "job_id": done.job_id,
            "status": judged.verdict,
            "worker": done.worker_id,
            "attempt": done.attempt,
            "current_attempt": current.attempt if current is not None else None,
            "result": done.status,
            "reason": judged.reason,
        }
        log.warning("job %s: %s", done.job_id, judged.reason)
        self._audit.add(done.job_id, encode(record), AUDIT_KINDS[judged.verdict])
        self._store.job_status(done.job_id, {judged.verdict: record})

    # -- the loop ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Load what is in flight, then claim dead workers' jobs as they are found, for ever."""
        self._started = self._clock()
        try:
            await self._load()
        except StoreUnavailable as exc:  # Redis away: the sweep finds the same workers later
            log.warning("could not read the jobs in flight from Redis: %s", exc)
        swept = self._clock()
        loop = asyncio.get_running_loop()
        while True:
            # Not asyncio.wait_for: on Python 3.11 it can swallow a cancellation that comes
            # as the event is set (a Last Will during shutdown), and the task never ends.
            timer = loop.call_later(self.sweep_s, self._wake.set)
            try:
                await self._wake.wait()
            finally:
                timer.cancel()
            self._wake.clear()
            try:
                if self._clock() - swept >= self.sweep_s:
                    swept = self._clock()
                    await self._sweep(swept)
                await self._reap()
            except StoreUnavailable as exc:
                log.warning("recovery of lost workers' jobs waits for Redis: %s", exc)
            check_cancelled()

    async def _load(self) -> None:
        now_ms = int(self._clock() * 1000)
        workers = await self._inflight.watched(now_ms)
        jobs = sum(await self._inflight.jobs_on(workers))
        self.carried_over = (len(workers), jobs)
        if workers:
            log.info(
                "%d jobs in flight on %d workers (%s) found in Redis; watching those workers",
                jobs,
                len(workers),
                ", ".join(sorted(workers)[:20]),
            )

    async def _sweep(self, now: float) -> None:
        """Find silent workers: this replica's fleet, then every worker holding jobs."""
        for worker_id in self._fleet.expire(now, self.stale_after_s):
            self._gone.setdefault(worker_id, "silent")
        watched = [w for w in await self._inflight.watched(int(now * 1000)) if w not in self._gone]
        states = {w: self._fleet.state(w) for w in watched}
        # A worker known only from its retained capabilities has never been seen alive here.
        unseen = [w for w, s in states.items() if s is None or not s.samples]
        listed = dict(zip(unseen, await self._inflight.listed(unseen), strict=True))
        assert self._started is not None
        for worker_id, state in states.items():
            if worker_gone(
                online=state is not None and state.online,
                seen=state is not None and bool(state.samples),
                node_listed=listed.get(worker_id, True),
                watching_s=now - self._started,
                stale_after_s=self.stale_after_s,
            ):
                self._gone.setdefault(worker_id, "silent")

    async def _reap(self) -> None:
        if not self._gone:
            return
        gone, self._gone = self._gone, {}
        now = self._clock()
        try:
            claimed = await self._inflight.claim(sorted(gone), int(now * 1000))
        except StoreUnavailable:
            for worker_id, cause in gone.items():  # try again next time
                self._gone.setdefault(worker_id, cause)
            raise
        for worker_id, jobs in claimed.items():
            cause = gone[worker_id]
            self._metrics.worker_losses.labels(cause).inc()
            if jobs:
                log.warning(
                    "worker %s is lost (%s) holding %d job(s) in flight: %s",
                    worker_id,
                    cause,
                    len(jobs),
                    ", ".join(j.job_id for j in jobs[:20]),
                )
            for job in jobs:
                notify = after_death(
                    job,
                    worker_id,
                    cause=cause,
                    max_crashes=self.settings.max_worker_crashes,
                    now=now,
                )
                self._carry_out(notify, cause, now)

    def _carry_out(self, notify: Notify, cause: Cause, now: float) -> None:
        record = {
            "job_id": notify.job_id,
            "status": notify.kind,
            "edge": notify.edge_id,
            "worker": notify.worker_id,
            "attempt": notify.attempt,
            "crashes": notify.crashes,
            "cause": cause,
            "reason": notify.reason,
        }
        if notify.kind == "dead_letter":
            self._metrics.dead_letters.inc()
            self._inflight.dead_letter(notify.job_id, notify.reason, now)
            log.error("job %s: %s", notify.job_id, notify.reason)
        else:
            self._metrics.replacements.labels(cause).inc()
        self._store.job_status(notify.job_id, record)
        self._audit.add(notify.job_id, encode(record), AUDIT_KINDS[notify.kind])
        self._send(notify)

    def _send(self, notify: Notify) -> None:
        notice = JobNotice(
            job_id=notify.job_id,
            attempt=notify.attempt,
            kind=notify.kind,
            worker_id=notify.worker_id,
            crashes=notify.crashes,
            reason=notify.reason,
        )
        campus = topics.campus_of(notify.edge_id)
        if campus:  # a sister campus's job: its broker passes the notice on to its edge
            if self._to_peer is not None:
                self._to_peer(campus, topics.local_name(notify.edge_id), notice)
            return
        try:
            topic = topics.edge_notices(topics.check_id("edge id", notify.edge_id))
        except ValueError as exc:
            log.error(
                "job %s: no notice sent (%s); its edge re-offers it on its own timeout",
                notify.job_id,
                exc,
            )
            return
        tell_edge(self._transport, topic, notice)

    def release(self, rel: PlacementRelease, freed: Callable[[], None]) -> None:
        """An edge hands back a placement it will not use: the slot is free now, if it is
        the placement the job's record in Redis names (anything else changes nothing).
        Every replica hears it: Redis releases it once, and the replica whose view holds
        the reservation drops it there (then ``freed``)."""
        self._store.script(
            RELEASE,
            (
                keys.reservations(rel.worker_id),
                keys.inflight(rel.job_id),
                keys.inflight_on(rel.worker_id),
            ),
            (rel.job_id, rel.worker_id, rel.edge_id, rel.attempt, int(self._clock() * 1000)),
            partial(self._released, rel, freed),
        )

    def _released(self, rel: PlacementRelease, freed: Callable[[], None], reply: Any) -> None:
        if not reply:  # not the placement in flight: stale, or not this edge's
            log.warning(
                "ignored the release of job %s attempt %d on %s from %s: not the placement "
                "in flight",
                rel.job_id,
                rel.attempt,
                rel.worker_id,
                rel.edge_id,
            )
            return
        if self._fleet.reservation(rel.job_id) == rel.worker_id:
            self._fleet.release(rel.job_id)
            freed()
        if int(reply) != 1:  # another replica released it in Redis first
            return
        self._metrics.released.inc()
        record = {
            "job_id": rel.job_id,
            "status": "released",
            "edge": rel.edge_id,
            "worker": rel.worker_id,
            "attempt": rel.attempt,
            "reason": rel.reason,
        }
        self._audit.add(rel.job_id, encode(record), "placement.released")
        self._store.job_status(rel.job_id, {"status": "released", "released": record})
