"""A verdict judges the change, not the campus (``policies.verdict.judge``): beside the
policy in force replayed on the same trace, a candidate may lose at most the margin's
points of deadline attainment overall, per line and per data class; a floor the policy in
force itself misses on that trace is judged against the policy in force; and each reason
says, in words, what the candidate moved."""

from __future__ import annotations

from policies.verdict import Figures, InForce, Moved, Thresholds, judge

GATE = Thresholds(min_attainment=0.95, max_queue_depth=64, max_drop_points=2.0)
IN_FORCE = InForce(
    attainment=0.97,
    by_line={"line-1-pc": 0.96, "line-2-pc": 0.99},
    by_class={"wafer-image": 0.98, "part-image": 0.96},
    peak_queue_depth={"line-1-pc": 20, "north-cpu-1": 70},
)


def figures(**changes: object) -> Figures:
    base = {
        "attainment": 0.97,
        "peak_queue_depth": {"line-1-pc": 20, "north-cpu-1": 40},
        "violations": 0,
        "by_line": dict(IN_FORCE.by_line),
        "by_class": dict(IN_FORCE.by_class),
        "in_force": IN_FORCE,
        "moved": [],
    }
    return Figures.model_validate({**base, **changes})


def test_no_change_passes() -> None:
    assert judge(figures(), GATE) == (True, [])


def test_a_line_that_loses_more_than_the_margin_fails_naming_what_moved() -> None:
    moved = [
        Moved(
            data_class="wafer-image",
            line="line-1-pc",
            before="north-cpu-1",
            after="line-1-pc",
            jobs=412,
        )
    ]
    passed, reasons = judge(
        figures(by_line={"line-1-pc": 0.90, "line-2-pc": 0.99}, moved=moved), GATE
    )
    assert not passed
    (reason,) = reasons
    assert "line line-1-pc" in reason
    assert "0.9600" in reason
    assert "0.9000" in reason
    assert (
        "412 wafer-image jobs from line-1-pc now wait on line-1-pc (they ran on north-cpu-1)"
        in reason
    )


def test_a_loss_within_the_margin_passes_per_line_and_class() -> None:
    small = figures(
        by_line={"line-1-pc": 0.945, "line-2-pc": 0.99},
        by_class={"wafer-image": 0.965, "part-image": 0.96},
    )
    assert judge(small, GATE) == (True, [])


def test_a_floor_the_policy_in_force_misses_is_judged_against_it() -> None:
    loaded = IN_FORCE.model_copy(update={"attainment": 0.63})
    same = figures(attainment=0.63, in_force=loaded)
    assert judge(same, GATE) == (True, [])  # no change at all passes on a loaded trace
    worse = figures(attainment=0.60, in_force=loaded)
    passed, reasons = judge(worse, GATE)
    assert not passed
    assert "0.6300 for the policy in force less the 2-point margin" in reasons[0]
    assert "misses the minimum 0.95" in reasons[0]
    # Without the policy in force beside it (a verdict signed before), the floor is absolute.
    old = figures(attainment=0.63, in_force=None, by_line=None, by_class=None, moved=None)
    assert not judge(old, GATE)[0]


def test_a_peak_is_allowed_up_to_what_the_policy_in_force_holds_there() -> None:
    assert judge(figures(peak_queue_depth={"north-cpu-1": 70}), GATE)[0]
    moved = [
        Moved(
            data_class="part-image",
            line="line-2-pc",
            before="line-2-pc",
            after="north-cpu-1",
            jobs=30,
        )
    ]
    passed, reasons = judge(figures(peak_queue_depth={"north-cpu-1": 90}, moved=moved), GATE)
    assert not passed
    assert reasons == [
        "north-cpu-1 would hold 90 jobs at its peak, more than the 70 allowed (70 under the "
        "policy in force); 30 part-image jobs from line-2-pc now wait on north-cpu-1 (they "
        "ran on line-2-pc)"
    ]


def test_a_verdict_without_a_margin_or_with_a_wider_one_is_weaker_than_a_gate_asking_one() -> None:
    assert Thresholds(max_drop_points=None).weaker_than(GATE) == [
        "max_drop_points none > required 2"
    ]
    assert Thresholds(max_drop_points=5.0).weaker_than(GATE) == ["max_drop_points 5 > required 2"]
    assert Thresholds(max_drop_points=1.0).weaker_than(GATE) == []
    assert Thresholds().weaker_than(Thresholds()) == []  # a gate asking no margin
