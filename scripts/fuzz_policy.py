#!/usr/bin/env python
"""Fuzz the policy parsers with many generated inputs: only clean errors, bounded time and memory.

Feeds ``parse_policy`` (TOML) and ``parse_canonical`` (JSON) a seeded mix of random bytes,
byte-level mutations of the example policy, TOML token soup, type-confused copies of the
example, deep nesting and near-limit sizes. Any exception other than ``PolicyParseError`` is a
failure: the input is written to ``--crash-dir`` and the exit status is 1. Prints the count,
a histogram of error kinds, the slowest input per generator and the peak RSS.

    .venv/bin/python scripts/fuzz_policy.py --count 100000
"""

from __future__ import annotations

import argparse
import random
import re
import resource
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policies.errors import PolicyParseError
from policies.loader import MAX_POLICY_BYTES, parse_canonical, parse_policy

EXAMPLE = Path(__file__).resolve().parents[1] / "policies" / "examples" / "two-fab-campus.toml"
SEED_TEXT = EXAMPLE.read_bytes()
SEED_JSON = parse_policy(SEED_TEXT).canonical
TOKENS = [
    b"[",
    b"]",
    b"[[",
    b"]]",
    b"{",
    b"}",
    b"=",
    b",",
    b".",
    b'"',
    b"'",
    b'"""',
    b"\n",
    b" ",
    b"#",
    b"\\u0000",
    b"format",
    b"version",
    b"zones",
    b"classes",
    b"pools",
    b"edges",
    b"allow",
    b"deny",
    b"policy_signers",
    b"threshold",
    b"keys",
    b"subhealth",
    b"when",
    b"tokens",
    b"expires",
    b"1979-05-27T07:32:00Z",
    b"2030-13-45",
    b"nan",
    b"inf",
    b"-0",
    b"1e400",
    b"0x7f",
    b"true",
    b'"campus/**"',
    b'"a -> b"',
    b'"ed25519:AAAA"',
    b"99999999999999999999999",
]
TYPE_SWAPS = [b"1", b"-1", b"1.5", b"true", b'"x"', b"[]", b"{}", b"[1, [2]]", b"2030-01-01"]


def gen_random_bytes(rng: random.Random) -> bytes:
    return rng.randbytes(rng.randint(0, 2048))


def gen_mutation(rng: random.Random) -> bytes:
    data = bytearray(SEED_TEXT)
    for _ in range(rng.randint(1, 8)):
        pos = rng.randrange(len(data) + 1)
        op = rng.randrange(5)
        if op == 0 and pos < len(data):
            data[pos] = rng.randrange(256)
        elif op == 1:
            data[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif op == 2:
            del data[pos : pos + rng.randint(1, 40)]
        elif op == 3:
            start = rng.randrange(len(data))
            data[pos:pos] = data[start : start + rng.randint(1, 200)]
        else:
            data[pos:pos] = rng.choice(TOKENS)
    return bytes(data)


def gen_token_soup(rng: random.Random) -> bytes:
    return b"".join(rng.choice(TOKENS) for _ in range(rng.randint(1, 120)))


def gen_type_swap(rng: random.Random) -> bytes:
    lines = SEED_TEXT.split(b"\n")
    for _ in range(rng.randint(1, 3)):
        index = rng.randrange(len(lines))
        if b" = " in lines[index]:
            key = lines[index].split(b" = ")[0]
            lines[index] = key + b" = " + rng.choice(TYPE_SWAPS)
    return b"\n".join(lines)


def gen_deep(rng: random.Random) -> bytes:
    depth = rng.choice([10, 100, 999, 1000, 5000, 50000])
    opener = rng.choice([b"[", b"{a=", b"[{x=["])
    return b"a = " + opener * depth


def gen_large(rng: random.Random) -> bytes:
    size = rng.choice([MAX_POLICY_BYTES - 10, MAX_POLICY_BYTES + 1, 200_000])
    filler = rng.choice([b"# comment\n", b'x = "' + b"y" * 1000 + b'"\n', b"\n"])
    return (filler * (size // len(filler) + 1))[:size]


def gen_json(rng: random.Random) -> bytes:
    data = bytearray(SEED_JSON)
    for _ in range(rng.randint(1, 6)):
        pos = rng.randrange(len(data))
        if rng.random() < 0.5:
            data[pos] = rng.choice(b'{}[]":,0123456789-eE.ntfl\\ ')
        else:
            del data[pos : pos + rng.randint(1, 12)]
    return bytes(data)


GENERATORS: dict[str, tuple[Callable[[random.Random], bytes], int, bool]] = {
    # name: (generator, weight, canonical JSON parser instead of TOML)
    "random-bytes": (gen_random_bytes, 200, False),
    "mutation": (gen_mutation, 350, False),
    "token-soup": (gen_token_soup, 150, False),
    "type-swap": (gen_type_swap, 150, False),
    "deep": (gen_deep, 10, False),
    "large": (gen_large, 2, False),
    "json": (gen_json, 138, True),
}


def kind_of(exc: PolicyParseError) -> str:
    """A coarse error kind: the message without location, quoted values and numbers."""
    text = str(exc)
    prefix = exc.source + (f":{exc.line}" if exc.line is not None else "")
    text = text.removeprefix(prefix).removeprefix(": ")
    if exc.key:
        text = text.removeprefix(exc.key).removeprefix(": ")
    text = text.split(";")[0].split(" (at ")[0].split(": line ")[0]
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", text)
    text = re.sub(r"\d+", "N", text)
    return text[:60]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=20260528)
    parser.add_argument("--crash-dir", type=Path, default=Path("runs/fuzz-policy"))
    args = parser.parse_args()

    rng = random.Random(args.seed)
    names = list(GENERATORS)
    weights = [GENERATORS[n][1] for n in names]
    kinds: Counter[str] = Counter()
    per_gen: Counter[str] = Counter()
    slowest: dict[str, tuple[float, int]] = {}
    accepted = crashes = 0
    started = time.perf_counter()
    for i in range(args.count):
        name = rng.choices(names, weights)[0]
        gen, _, is_json = GENERATORS[name]
        data = gen(rng)
        per_gen[name] += 1
        t0 = time.perf_counter()
        try:
            if is_json:
                parse_canonical(data, source="fuzz.json")
            else:
                parse_policy(data, source="fuzz.toml")
            accepted += 1
        except PolicyParseError as exc:
            kinds[kind_of(exc)] += 1
        except Exception:
            crashes += 1
            args.crash_dir.mkdir(parents=True, exist_ok=True)
            path = args.crash_dir / f"crash-{i}.bin"
            path.write_bytes(data)
            print(f"CRASH on input {i} ({name}), saved to {path}:", file=sys.stderr)
            traceback.print_exc()
        elapsed = time.perf_counter() - t0
        if elapsed > slowest.get(name, (0.0, 0))[0]:
            slowest[name] = (elapsed, len(data))
    total = time.perf_counter() - started
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    print(f"inputs: {args.count}  (seed {args.seed}, {total:.1f} s, {args.count / total:.0f}/s)")
    print(f"accepted as valid policies: {accepted}   clean errors: {sum(kinds.values())}")
    print(f"non-clean exceptions: {crashes}")
    print("\ninputs and slowest input per generator:")
    for name in names:
        worst, size = slowest.get(name, (0.0, 0))
        print(f"  {name:<13} {per_gen[name]:>7}   max {worst * 1000:8.2f} ms  ({size} bytes)")
    print(f"\nerror kinds ({len(kinds)}):")
    for kind, n in kinds.most_common():
        print(f"  {n:>7}  {kind}")
    worst_overall = max(slowest.values(), default=(0.0, 0))
    print(f"\nmax time per input: {worst_overall[0] * 1000:.2f} ms ({worst_overall[1]} bytes)")
    print(f"peak RSS: {peak_rss_mb:.1f} MiB")
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
