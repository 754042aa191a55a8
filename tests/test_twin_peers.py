"""Rehearsing an agreement with a sister campus before it is signed: adding a peer,
limiting it, withdrawing it, halves that do not mirror each other, each on a trace through
the production forwarding and peer placement code; the ``--peer`` file refused by name when
it is wrong; the command as an engineer runs it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from broker.core.fleet import Fleet
from broker.core.peering import summary_of
from policies.loader import load_policy
from sluicegate.app.pair import SOUTH
from sluicegate.app.twin_demo import demo_policy, demo_trace, write_sister
from sluicegate.twin import judge as tw_judge
from sluicegate.twin import trace
from sluicegate.twin.nodes import Change
from sluicegate.twin.rehearse import ChangeError, Rehearsal, build_change, rehearse
from sluicegate.twin.report import Summary
from sluicegate.twin.sim import Simulation
from sluicegate.twin.trace import policy_field
from tests.support import twin
from tests.test_twin_rehearse import judged

# The campus short of workers: the off-site one gone, the on-site one six times slower,
# under three times the recorded arrivals. Classes the agreement lists: parts and labels.
FLEET = 'remove = ["cloud-cpu-1"]\n[degrade]\nnorth-cpu-1 = 6.0\n'
SENT = ("part-image", "ocr-crop")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("twin-peers")
    trace.write(root / "demo.jsonl.gz", demo_trace(12.0, bursts=((3.0, 5.0),)))
    (root / "fleet.toml").write_text(FLEET)
    return root


def _short(folder: Path, policy: Path | None, peer: Path | None, cuts: list[str]) -> Change:
    """The campus short of workers under three times its arrivals, with ``policy``, a sister
    campus described by ``peer`` and its link ``cuts``."""
    return build_change(
        policy=policy,
        params=None,
        fleet=folder / "fleet.toml",
        burst=3,
        fail=[],
        strategy="ours",
        peers=[peer] if peer is not None else [],
        cuts=cuts,
    )


def _rehearse(folder: Path, policy: Path | None, peer: Path | None, **kw: object) -> Rehearsal:
    trace_file = kw.get("trace_file", folder / "demo.jsonl.gz")
    assert isinstance(trace_file, Path)
    return rehearse(trace_file, _short(folder, policy, peer, []))


def _peers_only(*files: Path) -> Change:
    """A change naming only sister campuses."""
    return build_change(
        policy=None, params=None, fleet=None, burst=1, fail=[], strategy="ours", peers=list(files)
    )


def _at_south(s: Summary, data_class: str) -> int:
    return sum(n for zone, n in s.zones.get(data_class, {}).items() if zone.endswith(f"@{SOUTH}"))


def test_adding_a_peer_carries_the_listed_classes_through_a_burst_and_nothing_else(
    folder: Path, tmp_path: Path
) -> None:
    policy, peer = write_sister(tmp_path)
    r = _rehearse(folder, policy, peer)
    before, after = r.judged.baseline, r.judged.candidate  # same conditions, with and without
    assert before.by_class["part-image"] < 0.5  # short of workers, most parts expire
    assert after.by_class["part-image"] >= 0.99
    assert after.attainment > before.attainment
    sister = after.peers[SOUTH]
    assert sister["placed"] > 0
    assert sister["images sent"] == sister["placed"]
    assert _at_south(after, "part-image") > 0
    assert _at_south(after, "wafer-image") == 0  # not in the agreement: never sent
    assert after.violations == 0
    assert before.peers[SOUTH].get("asked", 0) == 0  # the policy in force lists no peer
    assert "sister south-site: placed" in r.text
    assert "under the same conditions, the policy in force beside the candidate:" in r.text


def test_a_verdict_passes_classes_that_may_leave_and_fails_one_kept_on_site(
    folder: Path, tmp_path: Path
) -> None:
    # Part images and labels may leave the campus under the policy in force (the cloud takes
    # them): sending them to the sister campus is no breach, and the agreement passes.
    fair = _rehearse(folder, *write_sister(tmp_path / "fair"))
    assert judged(fair) == (True, [])
    # Wafer images may leave from none of its zones: an agreement that lists them fails,
    # naming the jobs that would run on the sister campus.
    wafers = _rehearse(folder, *write_sister(tmp_path / "wafers", sent=("wafer-image",)))
    assert _at_south(wafers.judged.candidate, "wafer-image") > 0
    passed, reasons = judged(wafers)
    assert not passed
    assert any(
        "wafer-image jobs would run in campus/fab-south/dc@south-site, off site" in r
        for r in reasons
    ), reasons


def test_a_limit_both_halves_sign_holds_the_peer_to_it(folder: Path, tmp_path: Path) -> None:
    limit = 20.0
    policy, peer = write_sister(tmp_path, max_jobs_per_s=limit)
    r = _rehearse(folder, policy, peer)
    sister = r.judged.candidate.peers[SOUTH]
    assert sister["refused peer_rate_limit"] > 0  # south's broker refused past its limit
    # Its bucket holds one second's worth: at most limit/s over the run, plus that second.
    assert sister["placed"] <= limit * (r.candidate.duration_s + 1.0)
    assert r.judged.candidate.refusals["peer_refused"] == sister["refused peer_rate_limit"]
    unlimited = _rehearse(folder, *write_sister(tmp_path / "free"))
    assert sister["placed"] < unlimited.judged.candidate.peers[SOUTH]["placed"]


def test_withdrawing_the_agreement_sends_nothing_more(folder: Path, tmp_path: Path) -> None:
    agreed, peer = write_sister(tmp_path)
    recorded = demo_trace(12.0, bursts=((3.0, 5.0),))
    text = agreed.read_text()
    header = recorded.header.model_copy(update={"policy": policy_field(text, source="agreed")})
    trace_file = tmp_path / "agreed.jsonl.gz"
    trace.write(trace_file, trace.Trace(header, recorded.jobs))
    withdrawn = tmp_path / "withdrawn.toml"
    withdrawn.write_text(demo_policy())  # the same campus, no [peers]
    r = _rehearse(folder, withdrawn, peer, trace_file=trace_file)
    assert r.judged.baseline.peers[SOUTH]["placed"] > 0  # the agreement as recorded
    assert r.judged.candidate.peers[SOUTH] == {}  # withdrawn: not one ask
    assert _at_south(r.judged.candidate, "part-image") == 0
    assert any(m.before is not None and SOUTH in m.before for m in r.judged.moves)


def test_halves_that_do_not_mirror_are_named_and_nothing_is_sent(
    folder: Path, tmp_path: Path
) -> None:
    policy, peer = write_sister(tmp_path, max_jobs_per_s=20.0, theirs_max_jobs_per_s=30.0)
    r = _rehearse(folder, policy, peer)
    assert r.judged.candidate.peers[SOUTH] == {}
    assert "warning: agreement with south-site:" in r.text
    assert "max_jobs_per_s: 20.0 vs 30.0" in r.text


def test_a_policy_naming_a_peer_no_file_describes_is_warned(folder: Path, tmp_path: Path) -> None:
    policy, _peer = write_sister(tmp_path)
    r = _rehearse(folder, policy, None)
    assert r.judged.candidate.peers == {}
    assert "warning: policy lists sister campus south-site but no --peer describes it" in r.text


def test_a_lent_worker_its_policy_lists_nowhere_is_warned(folder: Path, tmp_path: Path) -> None:
    policy, peer = write_sister(tmp_path)
    broken = tmp_path / "broken.toml"
    broken.write_text(peer.read_text().replace('id = "south-dc-1"', 'id = "south-dc-9"'))
    r = _rehearse(folder, policy, broken)
    assert "south-dc-9 of south-site is in no zone its agreement with demo-campus opens" in r.text
    assert r.judged.candidate.peers[SOUTH]["placed"] > 0  # south-dc-2 still takes work


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("rtt_ms = 10.0\nmb_per_s = 100.0\n", "name its policy"),
        ('policy = "south/policy.toml"\nmb_per_s = 100.0\n', "rtt_ms"),
        ('policy = "south/policy.toml"\nrtt_ms = -1.0\nmb_per_s = 1.0\n', "rtt_ms"),
        ('policy = "south/policy.toml"\nrtt_ms = 1.0\nmb_per_s = 1.0\nlatency = 3\n', "latency"),
        ('policy = "nope.toml"\nrtt_ms = 1.0\nmb_per_s = 1.0\n', "its policy"),
        ('policy = "south/policy.toml"\nrtt_ms = 1.0\nmb_per_s = 1.0\n', "list the workers"),
        ('trace = "nope.jsonl.gz"\nrtt_ms = 1.0\nmb_per_s = 1.0\n', "its trace"),
        ("rtt_ms = [", "not valid TOML"),
    ],
)
def test_a_wrong_peer_file_is_refused_by_name(tmp_path: Path, text: str, named: str) -> None:
    write_sister(tmp_path)
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    with pytest.raises(ChangeError) as caught:
        _peers_only(bad)
    assert str(bad) in str(caught.value)
    assert named in str(caught.value)


def test_two_files_for_one_sister_campus_are_refused(tmp_path: Path) -> None:
    _policy, peer = write_sister(tmp_path)
    with pytest.raises(ChangeError, match="one file per sister campus"):
        _peers_only(peer, peer)


def test_the_peers_workers_may_come_from_a_trace_it_recorded(tmp_path: Path) -> None:
    write_sister(tmp_path)
    south = demo_trace(1.0)
    trace.write(tmp_path / "south.jsonl.gz", south)
    (tmp_path / "from-trace.toml").write_text(
        'policy = "south/policy.toml"\ntrace = "south.jsonl.gz"\nrtt_ms = 8\nmb_per_s = 50\n'
    )
    change = _peers_only(tmp_path / "from-trace.toml")
    (spec,) = change.peers
    assert [w.id for w in spec.workers] == [w.id for w in south.header.workers]
    assert spec.rtt_s == pytest.approx(0.008)
    assert spec.bytes_per_s == pytest.approx(50e6)
    assert tw_judge.conditions_of(change)["sister campuses"].startswith(f"{SOUTH} (2 workers")


def test_a_summary_offers_nothing_without_our_half_in_force(tmp_path: Path) -> None:
    _policy, _peer = write_sister(tmp_path)
    south = load_policy(tmp_path / "south" / "policy.toml")
    fleet = Fleet(None, None, south)
    kept = summary_of(south, "demo-campus", fleet, None, broker="b", seq=1, at=10.0, interval_s=1.0)
    assert kept.agreement_version == 0
    assert kept.offers == ()
    assert kept.ttl_s == pytest.approx(3.0)
    assert kept.currency == "EUR"


def test_the_same_inputs_give_the_same_rehearsal(folder: Path, tmp_path: Path) -> None:
    policy, peer = write_sister(tmp_path)
    first, second = (_rehearse(folder, policy, peer) for _ in range(2))
    assert first.text == second.text
    assert first.judged == second.judged


def test_twin_run_with_a_peer_as_an_engineer_runs_it(folder: Path, tmp_path: Path) -> None:
    made = twin("synth", "--out", "x.jsonl.gz", "--seconds", "1", "--sister", "s", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert "south-site.toml: south-site for --peer" in made.stdout
    ran = twin(
        "run",
        "--trace",
        str(folder / "demo.jsonl.gz"),
        "--policy",
        "s/north/policy.toml",
        "--peer",
        "s/south-site.toml",
        "--fleet",
        str(folder / "fleet.toml"),
        "--burst",
        "3",
        cwd=tmp_path,
    )
    assert ran.returncode == 0, ran.stderr
    assert "sister south-site: placed" in ran.stdout
    wrong = twin("run", "--trace", str(folder / "demo.jsonl.gz"), "--peer", str(tmp_path / "x"))
    assert wrong.returncode != 0
    assert "sister campus" in wrong.stderr
    assert "cannot be read" in wrong.stderr


def test_a_cut_link_sends_the_jobs_out_there_back_and_nothing_crosses_until_it_is_mended(
    folder: Path, tmp_path: Path
) -> None:
    policy, peer = write_sister(tmp_path)
    # The link falls in the burst (3 s to 8 s), with a volley under way.
    change = _short(folder, policy, peer, [f"{SOUTH}@4.02+2"])
    assert tw_judge.conditions_of(change)["links cut"] == f"{SOUTH} at 4.02 s for 2 s"
    recorded, _digest = trace.read(folder / "demo.jsonl.gz")
    sim = Simulation(recorded, change)
    sim.start()
    sim.advance(sim.t0 + 4.02)
    out = sim.events.out_on(SOUTH)
    assert out  # jobs on south's workers as the link falls
    sim.advance(sim.t0 + 4.04)
    # The broker told their edges at once: none still waits on south (offered again, or
    # queued on its line PC), long before a result timeout or deadline would have moved it.
    phases = {j.job_id: sim.events.edges[j.rec.edge].core.table.get(j.job_id) for j in out}
    assert all(e is None or e.life.phase != "offloaded" for e in phases.values()), phases
    sim.advance(float("inf"))
    cut = sim.result()
    whole = Simulation(recorded, replace(change, cuts=())).run()
    # The jobs out there when the link fell were offered again or run on the line PC: their
    # images crossed, their results (held until the link came back) were not taken.
    there = [o for o in cut.outcomes if o.where and SOUTH in o.where]
    assert cut.peers[SOUTH]["images sent"] > len(there)
    sent_whole = whole.peers[SOUTH]["images sent"]
    assert sent_whole == len([o for o in whole.outcomes if o.where and SOUTH in o.where])
    # No result from south is taken while the link is down.
    left = [o.at + o.latency_ms / 1000.0 for o in there]
    assert not [t for t in left if 4.1 < t < 6.02]
    assert cut.peers[SOUTH]["placed"] < whole.peers[SOUTH]["placed"]  # no ask while down
    assert all(o.status in ("ok", "expired") for o in cut.outcomes)  # each job ends once
    assert len({o.job_id for o in cut.outcomes}) == len(cut.outcomes) == len(whole.outcomes)


def test_a_cut_names_a_described_sister_and_a_duration() -> None:
    for text, named in (("west@4+2", "no sister campus 'west'"), (f"{SOUTH}@4", "give campus")):
        with pytest.raises(ChangeError, match=named):
            build_change(
                policy=None,
                params=None,
                fleet=None,
                burst=1,
                fail=[],
                strategy="ours",
                cuts=[text],
            )
