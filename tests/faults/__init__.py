"""Fault injection for the reliability tests and ``bench/chaos.py``: a campus whose every
process can be SIGKILLed and restarted (:mod:`.rig`), a TCP proxy that cuts one link
(:mod:`.proxy`), an at-least-once app that counts raw result deliveries per job id and an
observer of the campus's own traffic (:mod:`.app`), the verdict "every accepted job ends in
exactly one result" (:mod:`.ledger`), and malformed requests to flood an edge with
(:mod:`.malformed`). None of it imports the roles' internals: it drives them as a plant
would, over MQTT and with signals, so it proves what a user would see.
"""

from __future__ import annotations

from tests.faults.ledger import Ledger, Verdict
from tests.faults.rig import Rig
from tests.faults.scenario import Outcome


def check_exactly_once(out: Outcome, rig: Rig, *, min_accepted: int) -> None:
    """Assert the invariant: every accepted job has at least one raw result and exactly one
    distinct result, and no result arrived for a job never submitted. A failure message
    carries the verdict and, for the first lost jobs, what the campus did with them."""
    verdict = out.verdict
    summary = verdict.explain()
    print(
        f"fault verdict: {summary}; {out.pending_at_fault} accepted jobs unanswered when the "
        f"fault struck; phases {out.seconds}"
    )
    assert verdict.accepted >= min_accepted, f"too few jobs accepted to prove anything: {summary}"
    assert out.pending_at_fault > 0 or not out.triggered, "the fault struck no job in flight"
    assert not verdict.lost, f"accepted jobs without a result: {summary}\n{out.diagnose(rig)}"
    assert not verdict.duplicated, f"jobs with more than one distinct result: {summary}"
    assert verdict.unexpected == 0, f"results for jobs never submitted: {summary}"


__all__ = ["Ledger", "Outcome", "Verdict", "check_exactly_once"]
