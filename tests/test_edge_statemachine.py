"""Hypothesis drives a real edge agent (real SQLite outbox file, memory transport with
persistent sessions) through submissions, resubmissions, crashes at any tick, restarts,
compute, worker returns (current, stale, repeated), lost workers, dead letters, timeouts,
a slow or quick campus broker and PUBACKs, in any order.

Invariants, at every step: no work goes out for a job the outbox has not committed but
its first attempt (its placement asked for, and answered, while the commit is under way;
the work is then sent at once, and what comes back waits for the commit), and no job
has more raw results at the app than the documented sources of repeats allow (one more per
crash that fell between publishing its result and recording the PUBACK, or between
forwarding a worker's result and committing it; one more per resubmission of a job already
concluded). After settling (restart if down, let the broker
ack, the workers answer the current attempts): every job the app submitted has exactly one
result after deduplication by job id, each ``ok`` or ``failed``/``dead_letter``, and the
edge holds nothing unfinished.

The edge's compute and the outbox's writer are stepped by the test (see tests/edge_kit.py),
the clock is fake and the search is derandomized, so every run explores the same cases.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import sqlite3
import tempfile
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.edge_kit import APP_TOPIC, EdgeRig


class EdgeLifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="sg-edge-sm-"))
        self.loop = asyncio.new_event_loop()
        self.rig = EdgeRig(
            self.loop, self.folder / "edge.db", offload=True, max_local_runs=2, hold_pubacks=True
        )
        self.rig.start()
        self.submitted: Counter[str] = Counter()
        self.windows: Counter[str] = Counter()  # crashes inside the publish/PUBACK window

    @property
    def up(self) -> bool:
        return self.rig.agent is not None

    # -- the app ----------------------------------------------------------------------------

    @rule(local=st.booleans())
    def submit_new(self, local: bool) -> None:
        job_id = f"j{len(self.submitted)}"
        assert self.rig.placement is not None
        if local:
            self.rig.placement.decline.add(job_id)  # the broker will refuse it: runs here
        self.submitted[job_id] += 1
        self.rig.submit(job_id, correlation=job_id.encode())

    @precondition(lambda self: self.submitted)
    @rule(data=st.data())
    def resubmit(self, data: st.DataObject) -> None:
        job_id = data.draw(st.sampled_from(sorted(self.submitted)))
        self.submitted[job_id] += 1
        self.rig.submit(job_id, correlation=job_id.encode())

    # -- time passing, compute, PUBACKs ----------------------------------------------------------

    @precondition(lambda self: self.up)
    @rule(n=st.integers(1, 6))
    def tick(self, n: int) -> None:
        for _ in range(n):
            self.rig.tick()

    @rule()
    def compute(self) -> None:
        self.rig.executor.run_all()

    @rule(online=st.booleans())
    def campus_broker(self, online: bool) -> None:
        """Offline, nothing is offered: jobs run here, the first ones at once."""
        assert self.rig.placement is not None
        self.rig.placement.broker_available = online

    @rule(slow=st.booleans())
    def campus_broker_pace(self, slow: bool) -> None:
        """Slow, placements wait to be answered: the acceptance commits come first."""
        assert self.rig.placement is not None
        self.rig.placement.slow = slow

    @rule()
    def campus_broker_answers(self) -> None:
        assert self.rig.placement is not None
        self.rig.placement.answer_all()

    @rule()
    def broker_acks(self) -> None:
        self.rig.broker.release_pubacks()

    @precondition(lambda self: self.up)
    @rule()
    def results_overdue(self) -> None:
        agent = self.rig.agent
        assert agent is not None
        self.rig.clock.now += 10.0
        self.rig.call(agent.check_offloaded)

    # -- crashes ----------------------------------------------------------------------------

    @precondition(lambda self: self.up)
    @rule(before_commit=st.booleans())
    def crash(self, before_commit: bool) -> None:
        """Writes not yet committed are lost, or (not ``before_commit``) land first."""
        self.rig.crash(before_commit=before_commit)  # the broker has all it will get from it
        published = {_job_id(m.payload) for m in self.rig.broker.log if m.topic == APP_TOPIC}
        # Done: published, PUBACK not recorded. Offloaded: a worker's result forwarded
        # before its commit. Either way the restarted edge sends the same result again.
        with contextlib.closing(sqlite3.connect(self.rig.db)) as db:
            rows = db.execute("SELECT job_id FROM jobs WHERE state IN ('done', 'offloaded')")
            done = {row[0] for row in rows}
        for job_id in published & done:
            self.windows[job_id] += 1

    @precondition(lambda self: not self.up)
    @rule()
    def restart(self) -> None:
        self.rig.start()

    # -- the pool and the broker -------------------------------------------------------------

    @precondition(lambda self: self.rig.placement is not None and self.rig.placement.sent)
    @rule(data=st.data(), twice=st.booleans())
    def worker_returns(self, data: st.DataObject, twice: bool) -> None:
        assert self.rig.placement is not None
        job_id, attempt = data.draw(st.sampled_from(self.rig.placement.sent))
        for _ in range(1 + twice):
            self.rig.give_back(job_id, attempt)

    @precondition(lambda self: self.rig.placement is not None and self.rig.placement.sent)
    @rule(data=st.data(), dead=st.booleans())
    def broker_notice(self, data: st.DataObject, dead: bool) -> None:
        assert self.rig.placement is not None
        job_id, attempt = data.draw(st.sampled_from(self.rig.placement.sent))
        self.rig.notify(job_id, attempt, "dead_letter" if dead else "worker_lost")

    # -- what must hold ------------------------------------------------------------------------

    @invariant()
    def only_a_first_attempt_goes_out_before_the_commit(self) -> None:
        assert self.rig.placement is not None
        later = [(job, attempt) for job, attempt in self.rig.placement.early if attempt != 1]
        assert later == [], f"work sent before its job was on disk: {later}"

    @invariant()
    def every_event_had_a_rule(self) -> None:
        agent = self.rig.agent
        assert agent is None or agent.counters["illegal_moves"] == 0

    @invariant()
    def no_unexplained_repeats(self) -> None:
        for job_id, raw in self.rig.per_job().items():
            assert job_id in self.submitted, f"a result for {job_id}, never submitted"
            allowed = 1 + self.windows[job_id] + self.submitted[job_id] - 1
            assert raw <= allowed, f"{job_id}: {raw} results, at most {allowed} explained"

    def teardown(self) -> None:
        try:
            self._settle_everything()
            results = self.rig.results()
            once = {r["job_id"]: r for r in results}  # what a client keeps: one per job id
            assert set(once) == set(self.submitted), (
                f"no result for {sorted(set(self.submitted) - set(once))}"
            )
            for result in results:
                assert result["status"] == "ok" or (result["status"], result["code"]) == (
                    "failed",
                    "dead_letter",
                ), result
            agent = self.rig.agent
            assert agent is not None
            assert agent.unfinished == 0
            assert self.rig.transport is not None
            assert self.rig.transport.unacked == []
        finally:
            self.rig.stop()
            self.loop.close()
            shutil.rmtree(self.folder, ignore_errors=True)

    def _settle_everything(self) -> None:
        """Restart if down; the broker acks, the workers answer the current attempts, overdue
        returns are rerouted, until every job has its result."""
        rig = self.rig
        if not self.up:
            rig.start()
        agent = rig.agent
        assert agent is not None
        assert rig.placement is not None
        rig.placement.slow = False
        for _ in range(30):
            rig.placement.answer_all()
            rig.broker.release_pubacks()
            rig.settle()
            answered = set(rig.per_job())
            latest = dict(rig.placement.sent)  # the last attempt sent for each job
            for job_id, attempt in latest.items():
                if job_id not in answered:
                    rig.give_back(job_id, attempt)
            rig.settle()
            rig.broker.release_pubacks()
            rig.settle()
            if agent.unfinished == 0 and agent.delivering == 0:
                return
            rig.clock.now += 10.0  # an attempt recorded but never sent: the timeout
            rig.call(agent.check_offloaded)
        raise AssertionError(f"{agent.unfinished} jobs never concluded")


def _job_id(payload: bytes) -> str:
    return str(json.loads(payload)["job_id"])


EdgeLifecycle.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEdgeLifecycle = EdgeLifecycle.TestCase
