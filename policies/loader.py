"""Reading policy files: bytes in, a ``Policy`` or one ``PolicyParseError`` out.

This is the only place policy text is parsed (TOML through ``tomllib``; the canonical JSON
form through ``json``). Any failure becomes a ``PolicyParseError`` naming the file, the line
(best effort) and the key, and saying what would be accepted. Input size is capped so parse
time and memory stay bounded. It must never return a partly validated policy or let a
third-party exception escape.
"""

from __future__ import annotations

import json
import re
import tomllib
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from policies.errors import PolicyParseError
from policies.model import Policy, policy_from_document
from policies.schema import (
    PATTERN_RE,
    ZONE_RE,
    Loc,
    PolicyDocument,
    semantic_problems,
)

MAX_POLICY_BYTES = 1 << 20

_FRIENDLY_PATTERNS = {
    ZONE_RE: "a zone like 'campus/fab-north/dc': 1-8 levels of a-z 0-9 . _ - joined by '/'",
    PATTERN_RE: "a zone pattern like 'campus/**' or 'campus/*/dc'",
    r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$": (
        "an id of 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
    ),
    r"^[a-z0-9][a-z0-9._-]{0,31}$": "a name of 1-32 lowercase letters, digits, '.', '_' or '-'",
    r"^[a-z][a-z0-9_]{0,31}$": "a metric name of lowercase letters, digits and '_'",
}


def format_loc(loc: Loc) -> str:
    """``classes.wafer-image.allow[2]`` for pydantic's ``('classes', 'wafer-image', ...)``."""
    out = ""
    for seg in loc:
        if isinstance(seg, int):
            out += f"[{seg}]"
        elif seg != "[key]":
            out += f".{seg}" if out else seg
    return out


def locate(text: str, loc: Loc) -> int | None:
    """Best-effort 1-based line of ``loc`` in TOML ``text``: follows the keys in order, and for
    an index into an array of tables (``[[subhealth]]``) skips to that table's header."""
    lines = text.splitlines()
    found: int | None = None
    start = 0
    segs = list(loc)
    for pos, seg in enumerate(segs):
        if not isinstance(seg, str) or seg == "[key]":
            continue
        quoted = re.escape(seg)
        key_re = re.compile(rf"(^|[\s.{{,\[])(\"{quoted}\"|'{quoted}'|{quoted})\s*[=.\]]")
        hit = next((i for i in range(start, len(lines)) if key_re.search(lines[i])), None)
        if hit is None:
            break
        found, start = hit + 1, hit
        nxt = segs[pos + 1] if pos + 1 < len(segs) else None
        if isinstance(nxt, int):
            header = re.compile(rf"^\s*\[\[\s*([\w.-]+\.)?{quoted}\s*\]\]")
            headers = [i for i in range(start, len(lines)) if header.match(lines[i])]
            if nxt < len(headers):
                found, start = headers[nxt] + 1, headers[nxt]
    return found


def _model_at(loc: Loc) -> type[BaseModel] | None:
    """The pydantic model that validates the mapping at ``loc`` (to list its accepted keys)."""
    current: Any = PolicyDocument
    for seg in loc:
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(str(seg))
            current = field.annotation if field is not None else None
        elif typing.get_origin(current) in (dict, list):
            current = typing.get_args(current)[-1]
        else:
            return None
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _describe(error: Any) -> str:
    kind = error["type"]
    loc = tuple(error["loc"])
    got = f"; got {error['input']!r:.60}"
    if kind == "missing":
        return f"required key {loc[-1]!r} is missing"
    if kind == "extra_forbidden":
        model = _model_at(loc[:-1])
        accepted = ", ".join(model.model_fields) if model is not None else "none"
        return f"unknown key {loc[-1]!r}; accepted keys here: {accepted}"
    if kind == "string_pattern_mismatch":
        pattern = error["ctx"]["pattern"]
        return f"expected {_FRIENDLY_PATTERNS.get(pattern, 'text matching ' + pattern)}{got}"
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"{message}{got}"


def _from_validation(exc: ValidationError, *, source: str, text: str | None) -> PolicyParseError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    loc = tuple(first["loc"])
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    line = locate(text, loc) if text is not None else None
    return PolicyParseError(_describe(first) + more, source=source, key=format_loc(loc), line=line)


def _document(raw: object, *, source: str, text: str | None) -> PolicyDocument:
    try:
        doc = PolicyDocument.model_validate(raw)
    except ValidationError as exc:
        raise _from_validation(exc, source=source, text=text) from exc
    problems = semantic_problems(doc)
    if problems:
        loc, message = problems[0]
        line = locate(text, loc) if text is not None else None
        raise PolicyParseError(message, source=source, key=format_loc(loc), line=line)
    return doc


def _check_size(data: bytes | str, source: str) -> None:
    if len(data) > MAX_POLICY_BYTES:
        raise PolicyParseError(
            f"too large ({len(data)} bytes); a policy file holds at most {MAX_POLICY_BYTES} bytes",
            source=source,
        )


def read_document(data: bytes | str, *, source: str = "<policy>") -> tuple[PolicyDocument, str]:
    """Validate TOML policy text; return the document and the text (for locating keys)."""
    _check_size(data, source)
    if isinstance(data, bytes):
        raw_bytes = data
        try:
            data = raw_bytes.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = raw_bytes.count(b"\n", 0, exc.start) + 1
            raise PolicyParseError(
                "not UTF-8 text; a policy file is UTF-8 TOML", source=source, line=line
            ) from exc
    try:
        raw = tomllib.loads(data)
    except tomllib.TOMLDecodeError as exc:
        match = re.search(r"\(at line (\d+), column \d+\)", str(exc))
        line = int(match.group(1)) if match else data.count("\n") + 1  # "at end of document"
        raise PolicyParseError(
            f"not valid TOML: {exc}; see https://toml.io/en/v1.0.0", source=source, line=line
        ) from exc
    except RecursionError as exc:
        raise PolicyParseError(
            "nested too deeply; a policy nests tables and arrays at most 4 levels", source=source
        ) from exc
    return _document(raw, source=source, text=data), data


def parse_policy(data: bytes | str, *, source: str = "<policy>") -> Policy:
    """Parse and validate a TOML policy file's content."""
    doc, _ = read_document(data, source=source)
    return policy_from_document(doc)


def load_policy(path: Path) -> Policy:
    """Read and validate the TOML policy file at ``path`` (signatures are checked elsewhere)."""
    return parse_policy(read_bytes(path), source=str(path))


def read_bytes(path: Path) -> bytes:
    try:
        with path.open("rb") as handle:
            return handle.read(MAX_POLICY_BYTES + 1)
    except OSError as exc:
        raise PolicyParseError(f"cannot read: {exc.strerror}", source=str(path)) from exc


def parse_canonical(data: bytes, *, source: str = "<canonical policy>") -> Policy:
    """Parse the canonical JSON form (as published on the policy topic)."""
    _check_size(data, source)
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise PolicyParseError(
            f"not canonical policy JSON: {exc}", source=source, key="(document)"
        ) from exc
    return policy_from_document(_document(raw, source=source, text=None))
