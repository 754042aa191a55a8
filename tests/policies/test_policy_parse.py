"""Loading policy files: the example, the canonical form, and errors that say where and why."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from policy_testkit import EXAMPLE, base_doc, key, policy_of, to_toml

from policies.errors import PolicyParseError
from policies.loader import (
    MAX_POLICY_BYTES,
    _model_at,
    format_loc,
    load_policy,
    locate,
    parse_canonical,
    parse_policy,
    read_bytes,
)
from policies.schema import ClassDoc, PoolDoc, json_schema_text


def test_example_loads_with_its_zones_pools_and_rules() -> None:
    policy = load_policy(EXAMPLE)
    assert policy.campus == "acme-semi"
    assert policy.version == 1
    assert policy.signer_threshold == 2
    assert len(policy.signer_keys) == 3
    assert policy.worker_zone("cloud-gpu-1") == "offsite/cloud-east"
    assert policy.worker_zone("nobody") is None
    assert set(policy.classes) == {"wafer-image", "recipe-overlay", "ocr-crop"}
    assert policy.max_ttl_s == 60
    assert [r.name for r in policy.subhealth] == ["memory-bound", "overheating"]


def test_published_json_schema_is_in_sync_with_the_models() -> None:
    committed = (Path(__file__).parents[2] / "policies" / "policy.schema.json").read_text()
    assert committed == json_schema_text(), "regenerate: sluicegate policy schema > file"


def test_canonical_form_round_trips_and_ignores_layout() -> None:
    policy = load_policy(EXAMPLE)
    again = parse_canonical(policy.canonical)
    assert again.canonical == policy.canonical
    assert again.digest == policy.digest
    # The same content spelt differently (inline tables, other key order) has the same digest.
    doc = json.loads(policy.canonical)
    reordered = dict(reversed(list(doc.items())))
    assert parse_policy(to_toml(reordered)).digest == policy.digest


def test_a_local_date_is_midnight_utc_and_a_string_date_time_is_accepted() -> None:
    text = to_toml(base_doc()).replace('"expires" = "2030-01-01T00:00:00Z"', "expires = 2030-01-01")
    assert parse_policy(text).expires == parse_policy(to_toml(base_doc())).expires


def _mutated(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(base_doc())
    target: Any = doc
    for seg in path[:-1]:
        target = target[seg] if isinstance(target, list) else target.setdefault(seg, {})
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return doc


_DELETE = object()

BAD_DOCS = [
    (("format",), _DELETE, "format", "required key 'format' is missing"),
    (("format",), "sluicegate-policy/2", "format", "sluicegate-policy/1"),
    (("version",), 0, "version", "greater than or equal to 1"),
    (("version",), True, "version", "valid integer"),
    (("expires",), "2030-01-01T00:00:00", "expires", "needs a time zone"),
    (("expires",), "2030-01-01T00:00:00.5Z", "expires", "whole seconds"),
    (("expires",), "soon", "expires", "is not a date-time"),
    (("expires",), "1990-01-01T00:00:00Z", "expires", "between year 2000 and 9999"),
    (("expires",), 12, "expires", "expected a date-time"),
    (("zones", "Campus/North"), "x", "zones", "expected a zone like 'campus/fab-north/dc'"),
    (("pools", "north-dc", "zonee"), "x", "pools.north-dc.zonee", "accepted keys here: zone"),
    (
        ("pools", "bad id!"),
        {"zone": "x", "workers": {"w": key("w").public_text}},
        "pools",
        "an id of 1-64",
    ),
    (
        ("classes", "ocr-crop", "allow", 0),
        "campus/**/dc",
        "classes.ocr-crop.allow[0]",
        "not a rule",
    ),
    (("classes", "ocr-crop", "allow", 0), "a -> b -> c", "classes.ocr-crop.allow[0]", "not a rule"),
    (("classes", "ocr-crop", "deny"), ["Campus"], "classes.ocr-crop.deny[0]", "not a rule"),
    (("policy_signers", "keys", "officer-bob"), "rsa:abc", "officer-bob", "must start with"),
    (("policy_signers", "keys", "officer-bob"), "ed25519:AAAA", "officer-bob", "has 3"),
    (("policy_signers", "keys", "officer-bob"), "ed25519:a+b/", "officer-bob", "'+' and '/'"),
    (("policy_signers", "keys", "officer-bob"), "ed25519:ä", "officer-bob", "only A-Z"),
    (("policy_signers", "keys", "officer-bob"), "ed25519:A", "officer-bob", "not base64url"),
    (("policy_signers", "threshold"), 4, "policy_signers.threshold", "can never be met"),
    (("subhealth", 0, "when", 0, "op"), "=>", "subhealth[0].when[0].op", "'>='"),
    (("subhealth", 0, "when", 0, "metric"), "Util", "metric", "a metric name"),
    (("subhealth", 0, "name"), "Bad Name", "subhealth[0].name", "a name of 1-32"),
    (("subhealth", 0, "when", 0, "value"), float("nan"), "value", "finite"),
    (
        ("pools", "cloud", "workers"),
        {"north-gpu-1": key("north-gpu-1").public_text},
        "pools.cloud.workers.north-gpu-1",
        "already in pool",
    ),
    (("pools", "cloud", "workers"), ["cloud-gpu-1"], "pools.cloud.workers", "a table of worker"),
    (("apps", "inspect"), {"edges": ["nowhere"]}, "apps.inspect.edges[0]", "known edges"),
    (
        ("apps", "inspect"),
        {"edges": ["north-l1-pc"], "results": ["sluicegate/v1/x"]},
        "apps.inspect.results[0]",
        "protocol's own topics",
    ),
]


@pytest.mark.parametrize(("path", "value", "key", "expect"), BAD_DOCS)
def test_schema_errors_name_the_key_and_what_is_accepted(
    path: tuple[Any, ...], value: Any, key: str, expect: str
) -> None:
    doc = _mutated(path, value)
    text = to_toml(doc)
    with pytest.raises(PolicyParseError) as info:
        parse_policy(text, source="p.toml")
    message = str(info.value)
    assert message.startswith("p.toml"), message
    assert key in info.value.key, message
    assert expect in message, message


def test_errors_name_the_line_in_a_real_file() -> None:
    lines = EXAMPLE.read_text().splitlines()
    index = next(i for i, line in enumerate(lines) if "temperature_c" in line)
    lines[index] = lines[index].replace('op = ">="', 'op = "=>"')
    with pytest.raises(PolicyParseError) as info:
        parse_policy("\n".join(lines), source="campus.toml")
    assert info.value.line == index + 1
    assert str(info.value).startswith(f"campus.toml:{index + 1}: subhealth[1].when[0].op:")


def test_unknown_key_in_a_table_lists_the_accepted_keys() -> None:
    text = EXAMPLE.read_text().replace("max_skew_s = 5", "max_skew = 5")
    with pytest.raises(PolicyParseError, match="accepted keys here: max_ttl_s, max_skew_s"):
        parse_policy(text)


@pytest.mark.parametrize(
    ("data", "expect", "line"),
    [
        (b"a = 1\nb = \xff\n", "not UTF-8", 2),
        (b"format = 'x'\nversion = = 3\n", "not valid TOML", 2),
        (b"a = " + b"[" * 3000, "nested too deeply", None),
        (b"# " + b"x" * MAX_POLICY_BYTES, "at most", None),
        (b"", "required key", None),
    ],
)
def test_malformed_files_are_clean_errors(data: bytes, expect: str, line: int | None) -> None:
    with pytest.raises(PolicyParseError, match=expect) as info:
        parse_policy(data, source="f.toml")
    assert info.value.line == line


def test_canonical_parser_errors() -> None:
    with pytest.raises(PolicyParseError, match="not canonical policy JSON"):
        parse_canonical(b"{")
    with pytest.raises(PolicyParseError, match="required key 'format'"):
        parse_canonical(b"{}")
    doc = base_doc()
    doc["policy_signers"]["threshold"] = 5
    with pytest.raises(PolicyParseError, match="can never be met"):
        parse_canonical(json.dumps(doc).encode())


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(PolicyParseError, match="cannot read"):
        read_bytes(tmp_path / "missing.toml")


def test_format_and_locate_helpers() -> None:
    assert format_loc(("zones", "X", "[key]")) == "zones.X"
    assert format_loc(("subhealth", 2, "when")) == "subhealth[2].when"
    text = '[pools.a]\nzone = "x"\n[[subhealth]]\nname = "a"\n[[subhealth]]\nname = "b"\n'
    assert locate(text, ("pools", "a", "zone")) == 2
    assert locate(text, ("subhealth", 1, "name")) == 6
    assert locate(text, ("subhealth", 7, "name")) == 4  # fewer headers: nearest guess
    assert locate(text, ("nothing",)) is None


def test_model_at_walks_models_dicts_and_lists() -> None:
    assert _model_at(("pools", "x")) is PoolDoc
    assert _model_at(("classes", "c")) is ClassDoc
    assert _model_at(("zones", "z")) is None
    assert _model_at(("nope", "deeper")) is None


def test_policy_builder_helper_round_trips() -> None:
    assert policy_of(base_doc()).campus == "acme"
