"""Fleet state: every worker the broker has heard of, its reservations and learned service
times, kept in the shape the placement core needs.

The shell owns one :class:`Fleet` and feeds it events as they arrive, each with the
broker's clock reading ``now``::

    fleet = Fleet(FleetParams.from_settings(settings), requirements, policy)
    fleet.apply_capabilities(caps, now)     # retained .../capabilities
    fleet.apply_telemetry(telemetry, now)   # .../telemetry, every interval
    fleet.mark_offline(worker_id, now)      # .../status "offline" (its Last Will)
    fleet.check_progress(now)               # periodically: workers that stopped progressing
    fleet.mark_stalled(worker_id, now)      # ... one of them: out until a sign of life
    fleet.apply_completion(completion, now) # .../broker/completions: release + learn
    fleet.reserve(worker_id, job_id, now, model)  # right after a Placed decision
    fleet.release(job_id)                   # the job's Redis reservation ended or failed
    fleet.mark_full(worker_id, now)         # ... failed: other replicas filled the worker
    fleet.cordon(worker_id, True)           # an operator's drain or cordon (False: lifted)
    fleet.expire(now, timeout_s)            # periodically; decide() also calls it
    fleet.use_policy(policy)                # a newly accepted policy; decide() also syncs
    fleet.service.snapshot() / .restore()   # learned service times, to persist if wanted

and reads it for people: ``state``, ``states``, ``view`` (forecast, health, per-model
status), ``reserved``, ``headroom`` (a limit for the shared Redis reservation), ``models``.

Reservations are local: they make consecutive decisions see the jobs just placed before
the workers' telemetry shows them. A reservation stops counting as held (against the
worker's capacity) when the job completes, and altogether when the worker's next telemetry
(older than ``absorb_after_s``) arrives, since that sample already holds the job; so
nothing needs sweeping. As work ahead (``scoring.free_at_ms``) a placed job counts until
that telemetry even once completed: the clock has drained its work already, and
subtracting it again would count the worker's progress twice.

Mutable but pure: no clock, no I/O, no asyncio; deterministic for a given event sequence,
so the digital twin and the tests replay it exactly. It never decides a placement.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from broker.core import forecast as fc
from broker.core.index import PlacementIndex
from broker.core.params import FleetParams
from broker.core.scoring import STATUS_NAMES, Placement, needs_of
from broker.core.service_model import ServiceModel
from broker.core.state import Capabilities, TelemetrySample, WorkerState
from broker.errors import UnknownWorker
from policies.model import Policy
from policies.subhealth import HealthVerdict
from sluicegate.vision.manifest import Requirements
from sluicegate.wire_pool import Completion, WorkerCapabilities, WorkerTelemetry

__all__ = ["Fleet", "FleetParams", "Progress", "WorkerState", "WorkerView"]


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as the HTTP fleet endpoint shows it."""

    state: WorkerState
    reserved: int
    policy_zone: str | None  # None: the worker is in no pool of the policy
    forecast: fc.LoadForecast | None
    health: HealthVerdict
    statuses: Mapping[str, str]  # per loaded model: eligible, full, memory, provider, ...
    cordoned: bool = False  # an operator took it out of placement


@dataclass(frozen=True, slots=True)
class Progress:
    """What one look at the workers' progress found (:meth:`Fleet.check_progress`)."""

    suspected: tuple[str, ...] = ()
    stalled: tuple[str, ...] = ()


class Fleet:
    """Workers, reservations, learned service times and the placement index."""

    def __init__(
        self,
        params: FleetParams | None = None,
        requirements: Mapping[str, Requirements] | None = None,
        policy: Policy | None = None,
    ) -> None:
        self.params = params or FleetParams()
        self.service = ServiceModel(self.params.service_alpha, self.params.default_service_ms)
        self._needs = needs_of(requirements or {})
        self._states: dict[str, WorkerState] = {}
        self._reservations: dict[str, tuple[str, float]] = {}  # job id -> (worker, when)
        # worker -> job id -> (when, seconds it may take without a completion), held
        self._by_worker: dict[str, dict[str, tuple[float, float]]] = {}
        # worker -> job id -> (when, model), placed since its telemetry
        self._placed: dict[str, dict[str, tuple[float, str | None]]] = {}
        self._seen: list[tuple[float, str]] = []  # (last_seen, worker), a lazy min-heap
        self._models: dict[str, int] = {}  # model -> workers with capabilities that load it
        self._marked_full: set[str] = set()  # full by a shared reservation, until telemetry
        self._cordoned: set[str] = set()  # out of placement by an operator, until lifted
        self._done_at: dict[str, float] = {}  # worker -> its latest completion
        self._stalled: set[str] = set()  # offline for a stall, until a sign of life
        self._suspect: set[str] = set()  # a job overdue: no placement until a sign of life
        self._silence: dict[str, tuple[float, float]] = {}  # worker -> (longest lately, when)
        self.index = PlacementIndex(self.params, self._needs)
        self._policy: Policy | None = None
        if policy is not None:
            self.use_policy(policy)

    # -- policy and requirements ------------------------------------------------------------

    @property
    def policy(self) -> Policy | None:
        return self._policy

    def use_policy(self, policy: Policy) -> None:
        """Place under ``policy`` from now on (zones of workers, sub-health rules). Cheap
        when it is the policy already in use; otherwise the index is rebuilt, O(workers)."""
        if policy is self._policy:
            return
        same = self._policy is not None and self._policy.digest == policy.digest
        self._policy = policy
        if same:
            self.index.policy = policy
            self.index.routes.clear()
        else:
            self._rebuild()

    def set_requirements(self, requirements: Mapping[str, Requirements]) -> None:
        """Model requirements changed (manifests reloaded); rebuilds the index."""
        self._needs = needs_of(requirements)
        self._rebuild()

    def _rebuild(self) -> None:
        self.index.reset(self._policy, self._needs)
        for state in self._states.values():
            self._update(state)

    # -- events -----------------------------------------------------------------------------

    def _put(self, state: WorkerState) -> None:
        old = self._states.get(state.worker_id)
        if old is None or old.capabilities is not state.capabilities:
            self._count_models(old, -1)
            self._count_models(state, 1)
        self._states[state.worker_id] = state
        self._update(state)

    def _update(self, state: WorkerState) -> None:
        wid = state.worker_id
        placed = self.placed(wid)
        full = wid in self._marked_full or wid in self._suspect
        cordoned = wid in self._cordoned
        self.index.update(state, self.reserved(wid), full, placed, cordoned)

    def placed(self, worker_id: str) -> list[Placement]:
        """The jobs placed on the worker since its last telemetry, in order: when (ms) and
        their model (completed ones included: their work counts as drained by the clock)."""
        return [(when * 1000.0, model) for when, model in self._placed.get(worker_id, {}).values()]

    def apply_capabilities(self, caps: WorkerCapabilities, now: float) -> None:
        """A worker's (retained) capabilities. Does not make it online: a retained document
        outlives its worker; telemetry does that."""
        old = self._states.get(caps.worker_id) or WorkerState(caps.worker_id)
        self._put(
            WorkerState(
                old.worker_id, Capabilities.from_wire(caps), old.samples, old.online, old.last_seen
            )
        )

    def apply_telemetry(self, tel: WorkerTelemetry, now: float) -> None:
        """A telemetry sample: the worker is online and seen at ``now``. A sample whose
        timestamp is not after the previous one means the worker restarted (or its clock
        moved back): its history starts again from this sample."""
        old = self._states.get(tel.node) or WorkerState(tel.node)
        sample = TelemetrySample.from_wire(tel, now)
        if old.latest is not None and tel.ts <= old.latest.ts:
            old = WorkerState(old.worker_id, old.capabilities)
        self._absorb(tel.node, now - self.params.absorb_after_s)
        self._marked_full.discard(tel.node)
        state = old.with_sample(sample, self.params.history)
        device_class = state.capabilities.device_class if state.capabilities else tel.device_class
        for model, ms in sample.service_ms.items():
            self.service.report(model, device_class, ms)
        heapq.heappush(self._seen, (now, tel.node))
        self._stalled.discard(tel.node)
        self._suspect.discard(tel.node)
        self._put(state)

    def apply_completion(self, completion: Completion, now: float) -> None:
        """A job finished on a pool worker: it is no longer held there (its work stays
        counted as drained, until telemetry), and an ``ok`` job's service time teaches the
        model for (model, the worker's device class)."""
        self._learn_silence(completion.worker_id, now)
        held = self._reservations.pop(completion.job_id, None)
        if held is not None:
            jobs = self._by_worker.get(held[0], {})
            jobs.pop(completion.job_id, None)
            self.index.set_reserved(held[0], len(jobs))
        state = self._states.get(completion.worker_id)
        self._done_at[completion.worker_id] = now
        if completion.worker_id in self._suspect:
            self._suspect.discard(completion.worker_id)
            self.index.set_marked_full(
                completion.worker_id, completion.worker_id in self._marked_full
            )
        if state is not None and completion.worker_id in self._stalled:
            self._stalled.discard(completion.worker_id)  # it moves again: back in placement
            self._put(WorkerState(state.worker_id, state.capabilities, state.samples, True, now))
        caps = state.capabilities if state is not None else None
        if completion.status == "ok" and completion.kind == "pool" and caps is not None:
            self.service.observe(completion.model, caps.device_class, completion.service_ms)

    def mark_offline(self, worker_id: str, now: float) -> tuple[str, ...]:
        """The worker is gone (Last Will, or silent too long). Returns the job ids still
        reserved on it locally; they are released here, and the shell re-places them."""
        state = self._states.get(worker_id)
        self._marked_full.discard(worker_id)
        self._stalled.discard(worker_id)
        self._suspect.discard(worker_id)
        jobs = tuple(self._by_worker.pop(worker_id, {}))
        self._placed.pop(worker_id, None)
        for job_id in jobs:
            self._reservations.pop(job_id, None)
        if state is not None and (state.online or jobs):
            self._put(
                WorkerState(worker_id, state.capabilities, state.samples, False, state.last_seen)
            )
        return jobs

    def check_progress(self, now: float) -> Progress:
        """Watch the workers holding jobs placed here for progress (completions), in two
        steps; returns the workers found suspect and stalled this time (for the shell, a
        stalled worker's :meth:`mark_stalled` in every view, its jobs placed again).

        *Suspect*: a held job is overdue (no completion on its worker since it was placed,
        or since the worker's latest completion if later, for ``stall_factor`` times what
        its placement expected, at least ``stall_floor_s``, and ``stall_factor`` times the
        longest silence the worker showed lately while holding jobs: a worker whose
        batches are slower than predicted sets its own pace; and ``cold_start_s`` for the
        first completion of a worker that had been idle ``idle_after_s`` before its oldest
        held job came, or has never completed one). The worker takes no new
        placement until its next completion or telemetry: cheap to be wrong about.
        *Stalled*: silent that long past the time its next batch should take (its held
        jobs, up to its batch size, at the slowest of their models), times
        ``stall_factor``, and at least twice ``stall_floor_s``: frozen, hung, or so starved
        it might as well be. Only workers holding reservations are looked at."""
        suspected, stalled = [], []
        for worker_id, held in self._by_worker.items():
            if not held:
                continue
            state = self._states.get(worker_id)
            if state is None or not state.online:
                continue
            done = self._done_at.get(worker_id, 0.0)
            oldest = next(iter(held.values()))[0]
            usual = self.params.stall_factor * self.usual_silence(worker_id, now)
            if oldest - done > self.params.idle_after_s:  # starting cold: its first batch
                usual = max(usual, self.params.cold_start_s)
            if worker_id not in self._suspect:
                if any(
                    now - max(when, done) > max(allowed, usual) for when, allowed in held.values()
                ):
                    self._suspect.add(worker_id)
                    self.index.set_marked_full(worker_id, True)
                    suspected.append(worker_id)
                continue
            since = max(oldest, done)
            if now - since > max(self.stall_after(worker_id), usual):
                stalled.append(worker_id)
        return Progress(tuple(suspected), tuple(stalled))

    def _learn_silence(self, worker_id: str, now: float) -> None:
        """A completion ends the worker's silence while it held jobs: the longest such
        silence lately (halving every ``silence_half_life_s``) is what it normally shows
        (a batch's time, a slow model's, a busy machine's), and sets how long it may be
        silent before it is suspect."""
        jobs = self._by_worker.get(worker_id)
        if not jobs:
            return
        silence = now - max(next(iter(jobs.values()))[0], self._done_at.get(worker_id, 0.0))
        self._silence[worker_id] = (max(silence, self.usual_silence(worker_id, now)), now)

    def usual_silence(self, worker_id: str, now: float) -> float:
        """The longest silence the worker showed lately while holding jobs (decayed)."""
        longest, at = self._silence.get(worker_id, (0.0, now))
        return float(longest * 0.5 ** (max(0.0, now - at) / self.params.silence_half_life_s))

    def suspect(self, worker_id: str) -> bool:
        """Out of placement for an overdue job, until its next completion or telemetry."""
        return worker_id in self._suspect

    def stall_after(self, worker_id: str) -> float:
        """Seconds of silence, holding jobs, that make a worker stalled (see
        :meth:`check_progress`)."""
        p = self.params
        state = self._states.get(worker_id)
        held = self._by_worker.get(worker_id, {})
        floor = 2.0 * p.stall_floor_s
        if state is None or state.capabilities is None or not held:
            return floor
        caps, placed = state.capabilities, self._placed.get(worker_id, {})
        per_job = max(
            self.service.estimate(m, caps.device_class) if m else p.default_service_ms
            for m in (placed[j][1] if j in placed else None for j in held)
        )
        batch = min(len(held), max(1, caps.max_batch))
        return max(floor, p.stall_factor * per_job * batch / 1000.0)

    def _allowed(self, worker_id: str, model: str | None, predicted_ms: float | None) -> float:
        p = self.params
        if predicted_ms is None:
            state = self._states.get(worker_id)
            caps = state.capabilities if state is not None else None
            predicted_ms = (
                self.service.estimate(model, caps.device_class)
                if model is not None and caps is not None
                else p.default_service_ms
            )
        return max(p.stall_floor_s, p.stall_factor * predicted_ms / 1000.0)

    def mark_stalled(self, worker_id: str, now: float) -> tuple[str, ...]:
        """:meth:`mark_offline` for a worker that stopped progressing: the same, but its
        next completion, not only its next telemetry, puts it back in placement."""
        jobs = self.mark_offline(worker_id, now)
        if worker_id in self._states:
            self._stalled.add(worker_id)
        return jobs

    def expire(self, now: float, timeout_s: float) -> list[str]:
        """Take offline every worker silent for more than ``timeout_s``; returns their ids,
        longest silent first. O(1) when nobody expires (a heap of last-seen times)."""
        cutoff = now - timeout_s
        gone: list[str] = []
        seen = self._seen
        while seen and seen[0][0] < cutoff:
            when, worker_id = heapq.heappop(seen)
            state = self._states.get(worker_id)
            if state is not None and state.online and state.last_seen == when:
                self.mark_offline(worker_id, now)
                gone.append(worker_id)
        return gone

    def forget(self, worker_id: str) -> bool:
        """Drop a worker altogether (decommissioned)."""
        self.mark_offline(worker_id, 0.0)
        state = self._states.pop(worker_id, None)
        if state is None:
            return False
        self._count_models(state, -1)
        self.index.remove(worker_id)
        return True

    def _count_models(self, state: WorkerState | None, delta: int) -> None:
        if state is not None and state.capabilities is not None:
            for model in state.capabilities.models:
                left = self._models.get(model, 0) + delta
                if left:
                    self._models[model] = left
                else:
                    self._models.pop(model, None)

    # -- reservations -------------------------------------------------------------------------

    def reserve(
        self,
        worker_id: str,
        job_id: str,
        now: float,
        model: str | None = None,
        predicted_ms: float | None = None,
    ) -> None:
        """Count ``job_id`` (a job of ``model``; None: of the worker's mean job) on
        ``worker_id`` until it completes, is released, or shows up in the worker's
        telemetry. Idempotent; a job reserved elsewhere moves here. ``predicted_ms``: when
        the placement expects it done (None: its model's service time there), for
        :meth:`check_progress`."""
        if worker_id not in self._states:
            raise UnknownWorker(
                f"cannot reserve job {job_id!r} on unknown worker {worker_id!r}; "
                f"the fleet knows {len(self._states)} workers"
            )
        held = self._reservations.get(job_id)
        if held is not None:
            if held[0] == worker_id:
                return
            self.release(job_id)
        self._reservations[job_id] = (worker_id, now)
        jobs = self._by_worker.setdefault(worker_id, {})
        jobs[job_id] = (now, self._allowed(worker_id, model, predicted_ms))
        self._placed.setdefault(worker_id, {})[job_id] = (now, model)
        self.index.add_placed(worker_id, len(jobs), now * 1000.0, model)

    def release(self, job_id: str) -> bool:
        """Stop counting ``job_id`` (it did not go there after all, or comes back); False
        if it no longer counted anywhere."""
        held = self._reservations.pop(job_id, None)
        if held is None:
            return False
        worker_id = held[0]
        jobs = self._by_worker.get(worker_id, {})
        jobs.pop(job_id, None)
        self._placed.get(worker_id, {}).pop(job_id, None)
        self.index.set_placed(worker_id, len(jobs), self.placed(worker_id))
        return True

    def _absorb(self, worker_id: str, cutoff: float) -> None:
        jobs = self._by_worker.get(worker_id)
        if jobs:
            for job_id in [j for j, (when, _) in jobs.items() if when <= cutoff]:
                del jobs[job_id]
                self._reservations.pop(job_id, None)
        placed = self._placed.get(worker_id)
        if placed:
            for job_id in [j for j, (when, _) in placed.items() if when <= cutoff]:
                del placed[job_id]

    def reserved(self, worker_id: str) -> int:
        """Jobs reserved on the worker that its telemetry does not show yet."""
        return len(self._by_worker.get(worker_id, ()))

    def mark_full(self, worker_id: str, now: float) -> None:
        """The shared (Redis) reservation for this worker was refused: other replicas'
        jobs fill it. Count it full until its next telemetry sample."""
        if worker_id in self._states:
            self._marked_full.add(worker_id)
            self.index.set_marked_full(worker_id, True)

    def marked_full(self, worker_id: str) -> bool:
        return worker_id in self._marked_full

    def cordon(self, worker_id: str, cordoned: bool) -> None:
        """Take the worker out of placement (an operator's drain or cordon), or put it back.
        Jobs already placed there stay; a worker not heard of yet is cordoned once it is."""
        if cordoned:
            self._cordoned.add(worker_id)
        else:
            self._cordoned.discard(worker_id)
        self.index.set_cordoned(worker_id, cordoned)

    def cordoned(self, worker_id: str) -> bool:
        return worker_id in self._cordoned

    def headroom(self, worker_id: str) -> int:
        """Jobs the worker can still take: capacity minus queued, running and reserved (0
        when offline or unknown). The shell's atomic Redis reservation may use it as the
        limit it checks against."""
        state = self._states.get(worker_id)
        if state is None or not state.placeable or state.latest is None:
            return 0
        if worker_id in self._marked_full or worker_id in self._cordoned:
            return 0
        if worker_id in self._suspect:
            return 0
        s = state.latest
        return max(0, s.capacity - s.queue_depth - s.in_flight - self.reserved(worker_id))

    def reservation(self, job_id: str) -> str | None:
        """The worker ``job_id`` is reserved on, if it still counts."""
        held = self._reservations.get(job_id)
        return held[0] if held else None

    # -- reads --------------------------------------------------------------------------------

    def state(self, worker_id: str) -> WorkerState | None:
        return self._states.get(worker_id)

    def states(self) -> Iterator[WorkerState]:
        return iter(self._states.values())

    def models(self) -> list[str]:
        """Every model some worker with known capabilities has loaded, sorted."""
        return sorted(self._models)

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._states

    def view(self, worker_id: str) -> WorkerView | None:
        """A worker with its load forecast, health and per-model status, for people."""
        state = self._states.get(worker_id)
        slot = self.index.slots.get(worker_id)
        if state is None or slot is None:
            return None
        reserved = self.reserved(worker_id)
        return WorkerView(
            state=state,
            reserved=reserved,
            policy_zone=slot.zone,
            forecast=fc.forecast(state.samples, reserved, self.params) if state.samples else None,
            health=slot.health,
            statuses={m: STATUS_NAMES[st] for m, (_, st) in sorted(slot.statuses.items())},
            cordoned=worker_id in self._cordoned,
        )
