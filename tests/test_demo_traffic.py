"""Pure tier: the demo's traffic (``sluicegate.app.traffic``): what each kind of job is,
how an answer is judged right and told in words, and what the tally keeps of each result."""

from __future__ import annotations

import numpy as np

from sluicegate import wire
from sluicegate.app.traffic import KINDS, LABEL_EVERY, LABELS, PARTS, WAFERS, Sample, Tally, samples


def _result(
    *,
    status: wire.Status = "ok",
    kind: wire.NodeKind = "edge",
    node: str = "line-1-pc",
    zone: str = "campus/fab-north/line-1",
    outputs: wire.Outputs | None = None,
    offload: wire.Offload | None = None,
) -> wire.JobResult:
    return wire.JobResult(
        job_id="j1",
        status=status,
        code=None if status == "ok" else status,
        outputs=outputs,
        ran_on=wire.RanOn(kind=kind, node=node, zone=zone),
        offload=offload,
    )


def _found(*labels: str) -> wire.Outputs:
    return wire.Outputs(
        label=labels[0] if labels else None,
        scores={},
        detections=[wire.Detection(label=x, score=0.9, box=(0.1, 0.1, 0.2, 0.2)) for x in labels],
    )


def _read(*lines: str) -> wire.Outputs:
    texts = [
        wire.TextLine(text=t, score=0.99, box=(0.1, 0.1, 0.9, 0.3), quad=[(0.1, 0.1)] * 4)
        for t in lines
    ]
    return wire.Outputs(scores={}, texts=texts)


def test_each_kind_goes_to_its_model_with_its_class_and_deadline() -> None:
    assert [(k.model, k.data_class, k.deadline_ms) for k in KINDS] == [
        ("surface-det", "wafer-image", 200.0),
        ("surface-det", "part-image", 200.0),
        ("ocr-ppocrv4", "ocr-crop", 1000.0),
    ]
    pool = samples(np.random.default_rng(1), 24)
    kinds = [s.kind for s in pool]
    assert kinds.count(LABELS) == -(-24 // LABEL_EVERY)  # the first, then one in LABEL_EVERY
    assert kinds.count(WAFERS) > 0  # as the surfaces were drawn
    assert kinds.count(PARTS) > 0
    assert all(s.image[:2] == b"\xff\xd8" for s in pool)  # JPEG, as a camera sends it
    assert all(isinstance(s.truth, tuple) for s in pool if s.kind is LABELS)


def test_a_detection_is_right_when_the_kinds_of_defect_are_those_drawn() -> None:
    sample = Sample(PARTS, b"", frozenset({"scratch", "pit"}))
    assert sample.right(_found("pit", "scratch", "pit"))
    assert not sample.right(_found("pit"))
    assert not sample.right(_found("pit", "scratch", "stain"))
    assert sample.found(_found("pit", "scratch", "pit")) == "2 pit, 1 scratch"
    assert Sample(WAFERS, b"", frozenset()).found(_found()) == "no defect"


def test_a_label_is_right_when_every_line_is_read_spaces_ignored() -> None:
    sample = Sample(LABELS, b"", ("SN 7K4Q-20931", "P/N 436-9594"))
    assert sample.right(_read("SN7K4Q-20931", "P/N 436-9594"))
    assert not sample.right(_read("SN7K4Q-20931"))  # a line missed
    assert not sample.right(_read("P/N436-9594", "SN7K4Q-20931"))  # out of order
    assert not sample.right(_read("SN7K4Q-2093I", "P/N436-9594"))
    assert sample.found(_read("SN7K4Q-20931", "P/N436-9594")) == "SN7K4Q-20931 | P/N436-9594"
    assert sample.found(_read()) == "(no text)"


def test_the_tally_keeps_attainment_and_where_each_kind_ran() -> None:
    """And counts a wafer answered off-site: the one thing the policy must never let be."""
    tally = Tally()
    label = Sample(LABELS, b"", ("SN 7K4Q-20931",))
    wafer = Sample(WAFERS, b"", frozenset({"stain"}))
    tally.record("line-1-pc", label, _result(outputs=_read("SN7K4Q-20931")), 640.0)
    offsite = _result(kind="pool", node="cloud-cpu-1", zone="offsite/cloud-east")
    tally.record("line-1-pc", wafer, offsite.model_copy(update={"outputs": _found("pit")}), 90.0)
    tally.record("line-2-pc", wafer, _result(status="expired", node="line-2-pc"), 230.0)
    labels, defects = tally.by_kind["labels"], tally.by_kind["wafers"]
    assert (labels.answered, labels.in_time, labels.right, labels.local) == (1, 1, 1, 1)
    assert (defects.answered, defects.in_time, defects.ok, defects.right) == (2, 1, 1, 0)
    assert (defects.local, defects.offloaded) == (1, 1)
    assert tally.in_time == 2  # 640 ms is in time for a label, 230 ms is not for a wafer
    assert tally.wafer_offsite == 1  # the off-site answer for a campus-only image is counted
    assert tally.where == {"line-1-pc": 1, "cloud-cpu-1": 1, "line-2-pc": 1}
    newest, older = tally.recent["wafers"]
    assert (newest.status, newest.found, newest.right) == ("expired", "expired", False)
    assert (older.ran_on, older.local, older.found) == ("cloud-cpu-1", False, "1 pit")
    (read,) = tally.recent["labels"]
    assert (read.kind, read.found, read.right) == ("labels", "SN7K4Q-20931", True)
    assert not tally.recent["parts"]


def test_a_refusal_to_offload_is_counted_by_its_code() -> None:
    tally = Tally()
    kept = wire.Offload(requested=True, placed=False, code="no_faster_worker", reason="…")
    part = Sample(PARTS, b"", frozenset())
    tally.record("line-1-pc", part, _result(outputs=_found(), offload=kept), 50.0)
    assert tally.kept_local == {"no_faster_worker": 1}
    assert tally.by_kind["parts"].right == 1  # nothing drawn, nothing found
