"""The demo's traffic: what the vision apps of the two lines send, and what they have seen.

Three kinds of job, each to a shipped model with the data class and deadline a plant
would give it (:data:`KINDS`): surface images (:mod:`sluicegate.vision.synth_boxes`) to
the defect detector ``surface-det`` within 200 ms, as ``wafer-image`` (campus only) for
wafers and ``part-image`` (may go off-site) for machined metal parts; and serial-number
label crops (:mod:`sluicegate.vision.label_synth`) to the OCR pipeline ``ocr-ppocrv4``,
class ``ocr-crop`` (may go off-site), within 1 s. :func:`stream` sends them at a
steady rate per line and, part-way through, a 10x burst on line 1 in volleys, as a camera
station fires; :class:`Tally` keeps what came back: statuses, where each job ran, deadline
attainment per kind, whether the answer was right (the kinds of defect found are those
drawn; every printed line read, spaces ignored), where the time of each job that missed
its deadline went (:mod:`sluicegate.app.missed`), and the last answers for the live view.
The demo, ``bench/campus_burst.py`` and the campus tests all drive this one stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from sluicegate import wire
from sluicegate.app.campus import APP_OF_LINE, APPS, LINES, Campus
from sluicegate.app.missed import Misses, missed
from sluicegate.client import AsyncClient
from sluicegate.errors import SluicegateError
from sluicegate.vision.label_synth import generate_label
from sluicegate.vision.synth import encode_jpeg
from sluicegate.vision.synth_boxes import scene

BURST_LINE = "line-1-pc"
VOLLEY = 20
LABEL_EVERY = 16  # one image in this many is a label crop for OCR
SEED = 2026  # of the stream's images and of its draws among them


@dataclass(frozen=True)
class Kind:
    """A kind of job: the model it goes to, its data class and its deadline."""

    name: str
    model: str
    data_class: str
    deadline_ms: float


WAFERS = Kind("wafers", "surface-det", "wafer-image", 200.0)
PARTS = Kind("parts", "surface-det", "part-image", 200.0)
LABELS = Kind("labels", "ocr-ppocrv4", "ocr-crop", 1000.0)
KINDS = (WAFERS, PARTS, LABELS)


@dataclass(frozen=True)
class Sample:
    """One image as the camera sends it, and the truth to check the answer against."""

    kind: Kind
    image: bytes
    truth: frozenset[str] | tuple[str, ...]  # defect labels drawn, or the printed lines

    def found(self, outputs: wire.Outputs) -> str:
        """What the model found, in words: the defects, or the text read."""
        if self.kind is LABELS:
            return " | ".join(t.text for t in outputs.texts) or "(no text)"
        seen = Counter(d.label for d in outputs.detections)
        return ", ".join(f"{n} {label}" for label, n in sorted(seen.items())) or "no defect"

    def right(self, outputs: wire.Outputs) -> bool:
        if self.kind is LABELS:
            read = tuple(t.text.replace(" ", "") for t in outputs.texts)
            return read == tuple(line.replace(" ", "") for line in self.truth)
        return frozenset(d.label for d in outputs.detections) == self.truth


def samples(
    rng: np.random.Generator, count: int = 48, *, label_every: int = LABEL_EVERY
) -> list[Sample]:
    """``count`` images, one in ``label_every`` a label (0: none), the rest surface images
    (a wafer or a metal part, as drawn: about one in three a wafer)."""
    out = []
    for i in range(count):
        if label_every and i % label_every == 0:
            label = generate_label(rng)
            out.append(Sample(LABELS, encode_jpeg(label.image), label.lines))
            continue
        drawn = scene(rng, width=640, height=480)
        kind = WAFERS if drawn.surface == "wafer" else PARTS
        truth = frozenset(d.label for d in drawn.defects)
        out.append(Sample(kind, encode_jpeg(drawn.image), truth))
    return out


def stream_samples(label_every: int = LABEL_EVERY) -> list[Sample]:
    """The images :func:`stream` draws from, for the same ``label_every``."""
    return samples(np.random.default_rng(SEED), label_every=label_every)


@dataclass(frozen=True)
class Answer:
    """One result as the live view lists it."""

    line: str
    kind: str
    status: str
    ran_on: str  # the node
    local: bool
    found: str
    right: bool
    ms: float


@dataclass
class PerKind:
    """One kind of job's results: answered, in time, ok and right, where they ran, and
    where the missed ones' time went."""

    answered: int = 0
    in_time: int = 0
    ok: int = 0
    right: int = 0
    local: int = 0
    offloaded: int = 0
    misses: Misses = field(default_factory=Misses)


@dataclass
class Tally:
    """What the vision apps have seen so far."""

    submitted: Counter[str] = field(default_factory=Counter)  # by line
    statuses: Counter[str] = field(default_factory=Counter)
    where: Counter[str] = field(default_factory=Counter)  # node that ran the job
    kinds: Counter[str] = field(default_factory=Counter)  # edge / pool
    kept_local: Counter[str] = field(default_factory=Counter)  # offload refusal codes
    by_kind: dict[str, PerKind] = field(default_factory=lambda: {k.name: PerKind() for k in KINDS})
    in_time: int = 0
    wafer_offsite: int = 0
    unmatched: int = 0  # results that matched no waiting call (late or duplicate)
    latencies_ms: deque[float] = field(default_factory=lambda: deque(maxlen=20000))
    recent: dict[str, deque[Answer]] = field(  # the latest answers of each kind, newest first
        default_factory=lambda: {k.name: deque(maxlen=3) for k in KINDS}
    )
    errors: Counter[str] = field(default_factory=Counter)
    phase: str = "steady"
    burst_began: float | None = None  # when line 1's burst started (``time.monotonic``)

    @property
    def answered(self) -> int:
        return sum(self.statuses.values())

    def record(self, line: str, sample: Sample, result: wire.JobResult, ms: float) -> None:
        kind = self.by_kind[sample.kind.name]
        in_time = result.status == "ok" and ms <= sample.kind.deadline_ms
        local = result.ran_on.kind == "edge"
        self.statuses[result.status] += 1
        self.latencies_ms.append(ms)
        self.where[result.ran_on.node] += 1
        self.kinds[result.ran_on.kind] += 1
        self.in_time += in_time
        kind.answered += 1
        kind.in_time += in_time
        kind.local += local
        kind.offloaded += not local
        miss = missed(result, ms, sample.kind.deadline_ms)
        if miss is not None:
            kind.misses.add(miss)
        if sample.kind.data_class == "wafer-image" and result.ran_on.zone.startswith("offsite/"):
            self.wafer_offsite += 1
        if result.offload is not None and not result.offload.placed:
            self.kept_local[result.offload.code or "?"] += 1
        right = result.outputs is not None and sample.right(result.outputs)
        if result.outputs is not None:
            kind.ok += 1
            kind.right += right
        outputs = result.outputs
        found = sample.found(outputs) if outputs is not None else result.code or "?"
        where = result.ran_on.node
        self.recent[sample.kind.name].appendleft(
            Answer(line, sample.kind.name, result.status, where, local, found, right, ms)
        )


async def _one(client: AsyncClient, sample: Sample, tally: Tally) -> None:
    t0 = time.perf_counter()
    try:
        result = await client.infer(
            sample.image,
            model=sample.kind.model,
            deadline_ms=sample.kind.deadline_ms,
            data_class=sample.kind.data_class,
            timeout=60.0,
        )
    except SluicegateError as exc:
        tally.errors[type(exc).__name__] += 1
        return
    tally.record(client.edge, sample, result, (time.perf_counter() - t0) * 1000.0)


def app_client(campus: Campus, line: str) -> AsyncClient:
    """The vision app of ``line``: its own identity, results under its own prefix."""
    app = APP_OF_LINE[line]
    return AsyncClient(
        campus.mqtt(app), edge=line, response_topic=f"{APPS[app][1]}/{uuid.uuid4().hex[:8]}"
    )


async def stream(
    campus: Campus,
    rate: float,
    seconds: float,
    stop: asyncio.Event,
    tally: Tally,
    *,
    burst_at: float = 5.0,
    burst_for: float = 10.0,
    on_tick: Callable[[], None] = lambda: None,
    label_every: int = LABEL_EVERY,
    apps: Mapping[str, AsyncClient] | None = None,
) -> None:
    """Steady ``rate`` per line; for ``burst_for`` seconds from ``burst_at``, line 1 bursts to
    ten times that, its camera station firing in volleys of 20 images. Returns once every
    job sent has its result (or its call timed out); ``on_tick`` runs after each send.
    ``label_every``: one image in this many is a label (0: surface images only). ``apps``:
    each line's app client, connected, for a caller that talks to the edges meanwhile (an
    app's identity holds one connection); else the stream connects and closes its own."""
    rng = np.random.default_rng(SEED)
    pool = samples(rng, label_every=label_every)
    pending: set[asyncio.Task[None]] = set()
    clients = dict(apps) if apps is not None else {line: app_client(campus, line) for line in LINES}
    if apps is None:
        for c in clients.values():
            await c.connect()
    try:
        start = time.monotonic()
        due = dict.fromkeys(LINES, start)
        end = start + seconds if seconds > 0 else float("inf")
        while not stop.is_set() and time.monotonic() < end:
            now = time.monotonic()
            burst = burst_at <= now - start < burst_at + burst_for
            tally.phase = "10x burst on line 1" if burst else "steady"
            if burst and tally.burst_began is None:
                tally.burst_began = start + burst_at
            for line, client in clients.items():
                volley = VOLLEY if burst and line == BURST_LINE else 1
                line_rate = rate * (10.0 if burst and line == BURST_LINE else 1.0)
                while due[line] <= now:
                    for _ in range(volley):
                        sample = pool[int(rng.integers(len(pool)))]
                        task = asyncio.ensure_future(_one(client, sample, tally))
                        pending.add(task)
                        task.add_done_callback(pending.discard)
                        tally.submitted[line] += 1
                    due[line] += volley / line_rate
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, min(due.values()) - time.monotonic()))
            on_tick()
        if pending:
            await asyncio.wait(pending, timeout=70.0)
        tally.unmatched = sum(c.unmatched for c in clients.values())
        on_tick()
    finally:
        if apps is None:
            for c in clients.values():
                await c.close()
