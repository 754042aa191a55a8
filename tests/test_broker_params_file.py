"""The broker's placement parameters: from its settings or its placement file; under a policy
whose [rollout] requires verdicts, a new set only with a passing twin verdict for its own
digest by a twin key of that policy (missing, failing, for another digest or by another
key: refused, named, the set held before kept); the accepted set survives a restart; a
file that cannot be used stops the broker with its name. End to end: the twin's verdict
on a change that overloads a node is refused, the one on a harmless change lets it in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from broker.core.params import PlacementParams
from broker.params_file import ACCEPTED_FILE, choose_params, shadow_of, verdict_path
from policies.keys import SigningKey
from policies.verdict import Verdict
from sluicegate.config import BrokerSettings
from sluicegate.errors import ConfigError
from sluicegate.twin.rehearse import read_params
from tests.policies.policy_testkit import base_doc, key, policy_of
from tests.support import params_verdict, twin

TWIN = key("twin-1")
STRANGER = key("twin-9")
GATED = policy_of(
    base_doc(version=1)
    | {"rollout": {"twin_keys": {"twin-1": TWIN.public_text}, "require_verdict": True}}
)
UNGATED = policy_of(base_doc(version=1))
SLOW_CAMPUS = "link_latency_ms = [0.2, 400.0, 0.0]\nlink_mb_per_s = [1000.0, 0.5, 100000.0]\n"


def _settings(tmp: Path, placement: str | None = None, **kw: object) -> BrokerSettings:
    path = None
    if placement is not None:
        path = tmp / "placement.toml"
        path.write_text(placement)
    return BrokerSettings(state_dir=tmp / "state", placement_file=path, **kw)  # type: ignore[arg-type]


def _verdict(
    params: PlacementParams, *, signer: SigningKey = TWIN, attainment: float = 0.99
) -> Verdict:
    return params_verdict(params.digest(), signer, attainment=attainment)


def _tampered(verdict: Verdict) -> Verdict:
    body = verdict.body.model_copy(update={"issued_at": 1.0})
    return verdict.model_copy(update={"body": body})


def _with_verdict(settings: BrokerSettings, verdict: Verdict) -> None:
    assert settings.placement_file is not None
    verdict_path(settings.placement_file).write_text(verdict.model_dump_json())


def test_without_a_file_the_settings_parameters_run(tmp_path: Path) -> None:
    chosen = choose_params(_settings(tmp_path, telemetry_interval_s=0.5), GATED)
    assert chosen.refused is None
    assert chosen.source == "settings"
    assert chosen.params.stale_after_s == 1.5  # three telemetry intervals


def test_a_placement_file_sets_what_runs_and_what_the_twin_binds(tmp_path: Path) -> None:
    settings = _settings(tmp_path, SLOW_CAMPUS)
    chosen = choose_params(settings, UNGATED)  # no gate: taken as it is
    assert chosen.refused is None
    assert chosen.params.link_latency_ms == (0.2, 400.0, 0.0)
    assert chosen.params.top_k == PlacementParams().top_k  # left out: the default
    assert settings.placement_file is not None
    assert chosen.source == str(settings.placement_file)
    # The digest a verdict binds is the one the twin rehearses from the same file.
    assert chosen.params.digest() == read_params(settings.placement_file).digest()


def test_under_a_gate_a_new_set_needs_its_verdict(tmp_path: Path) -> None:
    settings = _settings(tmp_path, SLOW_CAMPUS)
    chosen = choose_params(settings, GATED)
    assert chosen.refused is not None
    assert chosen.refused.code == "verdict.missing"
    assert "needs a passing twin verdict" in chosen.refused.message
    assert chosen.params == PlacementParams.from_settings(settings)  # what it held: defaults
    assert chosen.source == "settings"
    candidate = read_params(tmp_path / "placement.toml")
    _with_verdict(settings, _verdict(candidate))
    chosen = choose_params(settings, GATED)
    assert chosen.refused is None
    assert chosen.params == candidate
    # Accepted once, the set survives a restart without its verdict.
    verdict_path(tmp_path / "placement.toml").unlink()
    again = choose_params(settings, GATED)
    assert again.refused is None
    assert again.params == candidate
    kept = json.loads((tmp_path / "state" / ACCEPTED_FILE).read_text())
    assert kept["digest"] == candidate.digest()


@pytest.mark.parametrize(
    ("make", "code", "words"),
    [
        (lambda p: _verdict(PlacementParams(top_k=5)), "verdict.other_candidate", "not params"),
        (lambda p: _tampered(_verdict(p)), "verdict.bad_signature", "does not verify"),
        (lambda p: _verdict(p, attainment=0.5), "verdict.failed", "attainment 0.5"),
    ],
)
def test_a_verdict_that_does_not_fit_is_refused_and_the_earlier_set_kept(
    tmp_path: Path, make: object, code: str, words: str
) -> None:
    first = _settings(tmp_path, "top_k = 4\n")
    _with_verdict(first, _verdict(read_params(tmp_path / "placement.toml")))
    assert choose_params(first, GATED).refused is None
    settings = _settings(tmp_path, SLOW_CAMPUS)
    candidate = read_params(tmp_path / "placement.toml")
    _with_verdict(settings, make(candidate))  # type: ignore[operator]
    chosen = choose_params(settings, GATED)
    assert chosen.refused is not None
    assert chosen.refused.code == code
    assert words in chosen.refused.message
    assert chosen.refused.digest == candidate.digest()
    assert chosen.params.top_k == 4  # the set accepted before
    assert chosen.source == "accepted earlier"


def test_a_verdict_by_a_key_the_policy_does_not_list_is_refused(tmp_path: Path) -> None:
    settings = _settings(tmp_path, SLOW_CAMPUS)
    verdict = _verdict(read_params(tmp_path / "placement.toml"), signer=STRANGER)
    stranger = verdict.model_copy(update={"key_id": "twin-9"})
    _with_verdict(settings, stranger)
    chosen = choose_params(settings, GATED)
    assert chosen.refused is not None
    assert chosen.refused.code == "verdict.unknown_signer"
    assert "twin-9" in chosen.refused.message


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("no_such = 1\n", "unknown no_such"),
        ("top_k = 0\n", "top_k"),
        ("link_latency_ms = [1.0, 2.0]\n", "needs 3 values"),
        ("top_k = 'many'\n", "top_k"),
        ("top_k = [\n", "not valid TOML"),
    ],
)
def test_a_placement_file_that_cannot_be_used_is_named(
    tmp_path: Path, text: str, words: str
) -> None:
    with pytest.raises(ConfigError, match=r"placement file .*placement\.toml") as caught:
        choose_params(_settings(tmp_path, text), UNGATED)
    assert words in str(caught.value)


def test_a_missing_file_and_an_edited_record_are_named(tmp_path: Path) -> None:
    missing = BrokerSettings(placement_file=tmp_path / "nowhere.toml")
    with pytest.raises(ConfigError, match=r"nowhere\.toml: cannot be read"):
        choose_params(missing, UNGATED)
    settings = _settings(tmp_path, "top_k = 4\n")
    choose_params(settings, UNGATED)
    record = tmp_path / "state" / ACCEPTED_FILE
    doc = json.loads(record.read_text())
    doc["params"]["top_k"] = 9
    record.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="digest does not match"):
        choose_params(settings, UNGATED)
    record.write_text("{")
    with pytest.raises(ConfigError, match="cannot be read"):
        choose_params(settings, UNGATED)


def test_the_twins_verdicts_gate_the_brokers_parameters(tmp_path: Path) -> None:
    made = twin(
        "synth", "--out", "t.jsonl.gz", "--seconds", "20", "--burst-every", "10", cwd=tmp_path
    )
    assert made.returncode == 0, made.stderr
    (tmp_path / "twin.key").write_bytes(TWIN.to_pem())
    sign = ("--trace", "t.jsonl.gz", "--burst", "2", "--key", "twin.key", "--key-id", "twin-1")
    settings = _settings(tmp_path, SLOW_CAMPUS)
    out = str(verdict_path(tmp_path / "placement.toml"))
    failed = twin("verdict", *sign, "--params", "placement.toml", "--out", out, cwd=tmp_path)
    assert failed.returncode == 1, failed.stderr
    assert "deadline attainment" in failed.stdout  # kept on its edge, the line is late
    refused = choose_params(settings, GATED).refused
    assert refused is not None
    assert refused.code == "verdict.failed"
    assert "deadline attainment" in refused.message
    harmless = _settings(tmp_path, "top_k = 5\n")
    passed = twin("verdict", *sign, "--params", "placement.toml", "--out", out, cwd=tmp_path)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    chosen = choose_params(harmless, GATED)
    assert chosen.refused is None
    assert chosen.params.top_k == 5


def test_a_shadow_candidate_is_read_from_its_files_and_bad_ones_are_named(
    tmp_path: Path,
) -> None:
    assert shadow_of(BrokerSettings()) is None
    (tmp_path / "params.toml").write_text(SLOW_CAMPUS)
    shadow = shadow_of(BrokerSettings(shadow_placement_file=tmp_path / "params.toml"))
    assert shadow is not None
    assert shadow.policy is None  # the policy in force decides for it
    assert shadow.params.link_latency_ms == (0.2, 400.0, 0.0)
    assert "the policy in force" in shadow.label
    (tmp_path / "bad.toml").write_text("campus = 3\n")
    with pytest.raises(ConfigError, match="shadow policy"):
        shadow_of(BrokerSettings(shadow_policy_file=tmp_path / "bad.toml"))
    (tmp_path / "params.toml").write_text("top_k = -1\n")
    with pytest.raises(ConfigError, match="top_k"):
        shadow_of(BrokerSettings(shadow_placement_file=tmp_path / "params.toml"))
