"""Benchmark: placement token mint and verify, and policy evaluation on a generated 200-zone
policy, each interleaved with its bare baseline in the same run (BENCHMARKS.md).

Subject vs baseline, alternating sample by sample (A, B, A, B ...):

- ``mint`` (policy check + layout + Ed25519 sign) vs a bare libsodium sign (PyNaCl's
  ``crypto_sign``, what ``policies.keys`` signs with) of a message as long as a token body;
- ``verify`` (decode, signature, policy version, time, job, hash, target, zone) vs a bare
  libsodium check (``crypto_sign_open``); plus ``verify + replay`` with the in-memory replay cache;
- ``allowed`` (memoised verdicts) vs a bare dict lookup with the same tuple keys, timed in
  batches of ``--batch`` queries; plus the uncached rule evaluation (``decide``).

Keys are generated at run time. Prints a table, then one ``RESULT {...}`` line.

    .venv/bin/python bench/bench_policy.py                  # defaults: < 1 minute on 2 cores
    .venv/bin/python bench/bench_policy.py --samples 50000 --zones 400
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nacl.bindings

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import stats
from policies.evaluate import allowed, decide
from policies.keys import SigningKey
from policies.loader import parse_policy
from policies.model import Policy
from policies.replay import MemoryReplayCache, check_replay
from policies.tokens import mint, verify

TARGET = {"mint_p50_us": 60.0, "verify_p50_us": 150.0, "eval_p50_us": 5.0}
NOW = 1_780_000_000.0


def generated_policy(zones: int, broker: SigningKey, signers: list[SigningKey]) -> Policy:
    """A campus of fabs with lines and a data centre each, plus off-site clouds: ``zones`` zones."""
    clouds = max(1, zones // 20)
    per_fab = 10  # 9 lines and a dc
    fabs = max(1, (zones - clouds) // per_fab)
    names: list[str] = []
    for f in range(fabs):
        names += [f"campus/fab-{f:02d}/line-{n:02d}" for n in range(per_fab - 1)]
        names.append(f"campus/fab-{f:02d}/dc")
    names += [f"offsite/cloud-{c:02d}" for c in range(clouds)]
    names += [f"campus/spare/z-{i:03d}" for i in range(zones - len(names))]
    worker_key = SigningKey.generate().public_text
    lines = [
        'format = "sluicegate-policy/1"',
        'campus = "bench"',
        "version = 7",
        "expires = 2030-01-01T00:00:00Z",
        "[policy_signers]",
        "threshold = 2",
        "keys = {" + ", ".join(f'o{i} = "{k.public_text}"' for i, k in enumerate(signers)) + "}",
        "[broker_signers.keys]",
        f'broker-1 = "{broker.public_text}"',
        "[zones]",
        *(f'"{z}" = ""' for z in names),
    ]
    for f in range(fabs):
        lines += [
            f"[pools.dc-{f:02d}]",
            f'zone = "campus/fab-{f:02d}/dc"',
            f'workers = {{ gpu-{f:02d}-a = "{worker_key}", gpu-{f:02d}-b = "{worker_key}" }}',
        ]
    for c in range(clouds):
        lines += [
            f"[pools.cloud-{c:02d}]",
            f'zone = "offsite/cloud-{c:02d}"',
            f'workers = {{ cl-{c:02d} = "{worker_key}" }}',
        ]
    own_fab = ", ".join(f'"campus/fab-{f:02d}/** -> campus/fab-{f:02d}/**"' for f in range(fabs))
    lines += [
        "[classes.wafer-image]",
        'allow = ["campus/**"]',
        'deny = ["offsite/**", "campus/spare/**"]',
        "[classes.recipe-overlay]",
        f"allow = [{own_fab}]",
        'deny = ["offsite/**"]',
        "[classes.ocr-crop]",
        'allow = ["campus/**", "campus/** -> offsite/*"]',
        "[classes.metrology]",
        'allow = ["campus/*/dc", "campus/fab-00/** -> offsite/cloud-00"]',
        'deny = ["campus/spare/**"]',
        "[tokens]",
        "max_ttl_s = 60",
    ]
    policy = parse_policy("\n".join(lines), source="generated")
    assert len(policy.zones) == zones, len(policy.zones)
    return policy


def interleave(
    a: Callable[[], object], b: Callable[[], object], samples: int, warmup: int, per_call: int = 1
) -> tuple[list[float], list[float]]:
    """Time ``a`` and ``b`` alternately; each sample in µs per operation."""
    clock = time.perf_counter_ns
    out_a: list[float] = []
    out_b: list[float] = []
    gc.collect()
    for i in range(warmup + samples):
        t0 = clock()
        a()
        t1 = clock()
        b()
        t2 = clock()
        if i >= warmup:
            out_a.append((t1 - t0) / 1000 / per_call)
            out_b.append((t2 - t1) / 1000 / per_call)
    return out_a, out_b


def summary(values: list[float]) -> dict[str, float]:
    return stats.summary(values, unit="us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=20_000, help="timed samples per pair")
    parser.add_argument("--warmup", type=int, default=1_000)
    parser.add_argument("--zones", type=int, default=200)
    parser.add_argument("--batch", type=int, default=100, help="evaluation queries per sample")
    args = parser.parse_args()

    broker = SigningKey.generate()
    policy = generated_policy(args.zones, broker, [SigningKey.generate() for _ in range(3)])
    rng = random.Random(7)
    payload = hashlib.sha256(os.urandom(100_000)).digest()
    job_id = "0f8e6c2a-4b1d-4e43-9a57-3c6d2e1b9f00"
    origin, worker = "campus/fab-01/line-03", "gpu-01-a"
    fields: dict[str, Any] = {
        "job_id": job_id,
        "payload_sha256": payload,
        "data_class": "wafer-image",
        "origin_zone": origin,
        "target_worker": worker,
    }
    token = mint(policy, broker, now=NOW, **fields)
    body = os.urandom(len(token) * 3 // 4 - 64)  # as long as a token's signed body
    secret, public = broker.secret, broker.public
    bare_sig = nacl.bindings.crypto_sign(body, secret)[:64]

    def do_mint() -> None:
        mint(policy, broker, now=NOW, **fields)

    def do_verify() -> None:
        verify(token, policy, now=NOW, job_id=job_id, payload_sha256=payload, worker_id=worker)

    cache = MemoryReplayCache(max_entries=args.samples * 2 + args.warmup * 2 + 10)
    fresh = [mint(policy, broker, now=NOW, **fields) for _ in range(args.samples + args.warmup)]
    fresh_iter = iter(fresh)

    def do_verify_replay() -> None:
        claims = verify(
            next(fresh_iter),
            policy,
            now=NOW,
            job_id=job_id,
            payload_sha256=payload,
            worker_id=worker,
        )
        check_replay(cache, claims, policy, now=NOW)

    zones = sorted(policy.zones)
    classes = sorted(policy.classes)
    queries = [(rng.choice(classes), rng.choice(zones), rng.choice(zones)) for _ in range(10_000)]
    table = {q: decide(policy, *q) for q in queries}
    for q in queries:
        allowed(policy, *q)  # warm the memo: the broker asks the same questions over and over
    windows = [queries[i : i + args.batch] for i in range(0, len(queries) - args.batch, args.batch)]
    cursor = {"a": 0, "b": 0, "c": 0}

    def batch(key: str) -> list[tuple[str, str, str]]:
        cursor[key] = (cursor[key] + 1) % len(windows)
        return windows[cursor[key]]

    def do_eval() -> None:
        for q in batch("a"):
            allowed(policy, q[0], q[1], q[2])

    def do_dict() -> None:
        for q in batch("b"):
            table.get((q[0], q[1], q[2]))

    def do_decide() -> None:
        for q in batch("c"):
            decide(policy, q[0], q[1], q[2])

    n, w = args.samples, args.warmup

    def bare_verify() -> None:
        nacl.bindings.crypto_sign_open(bare_sig + body, public)

    mint_s, sign_b = interleave(do_mint, lambda: nacl.bindings.crypto_sign(body, secret), n, w)
    verify_s, verify_b = interleave(do_verify, bare_verify, n, w)
    replay_s, verify_b2 = interleave(do_verify_replay, bare_verify, n, w)
    eval_n = max(200, n // 10)
    eval_s, dict_b = interleave(do_eval, do_dict, eval_n, w // 10, args.batch)
    decide_s, dict_b2 = interleave(do_decide, do_dict, eval_n, w // 10, args.batch)
    allowed_share = sum(v.allowed for v in table.values()) / len(table)

    rows = [
        ("mint", mint_s, "Ed25519 sign", sign_b, TARGET["mint_p50_us"]),
        ("verify", verify_s, "Ed25519 verify", verify_b, TARGET["verify_p50_us"]),
        ("verify + replay", replay_s, "Ed25519 verify", verify_b2, None),
        ("allowed (memo)", eval_s, "dict lookup", dict_b, TARGET["eval_p50_us"]),
        ("decide (no memo)", decide_s, "dict lookup", dict_b2, None),
    ]
    print(
        f"policy bench: {len(policy.zones)} zones, {len(classes)} classes, "
        f"token {len(token)} chars, "
        f"{n} samples (evaluation: {eval_n} x {args.batch} queries, {allowed_share:.0%} allowed), "
        f"nproc {os.cpu_count()}"
    )
    header = (
        f"{'subject':<18}{'p50 µs':>9}{'p99 µs':>9}  {'baseline':<16}{'p50 µs':>9}{'p99 µs':>9}"
    )
    print(header + f"{'ratio':>8}{'target':>9}  met")
    print("-" * (len(header) + 22))
    for name, subj, base_name, base, target in rows:
        s, b = summary(subj), summary(base)
        ok = "" if target is None else ("yes" if s["p50_us"] <= target else "NO")
        tgt = "" if target is None else f"≤{target:g}"
        print(
            f"{name:<18}{s['p50_us']:>9.2f}{s['p99_us']:>9.2f}  {base_name:<16}{b['p50_us']:>9.2f}"
            f"{b['p99_us']:>9.2f}{s['p50_us'] / b['p50_us']:>8.2f}{tgt:>9}  {ok}"
        )

    subject = {
        "mint": summary(mint_s),
        "verify": summary(verify_s),
        "verify_replay": summary(replay_s),
        "eval": summary(eval_s),
        "eval_uncached": summary(decide_s),
        "token_chars": len(token),
    }
    baseline = {
        "ed25519_sign": summary(sign_b),
        "ed25519_verify": summary(verify_b),
        "dict_lookup": summary(dict_b),
    }
    achieved = {
        "mint_p50_us": subject["mint"]["p50_us"],  # type: ignore[index]
        "verify_p50_us": subject["verify"]["p50_us"],  # type: ignore[index]
        "eval_p50_us": subject["eval"]["p50_us"],  # type: ignore[index]
    }
    result = {
        "bench": "policy",
        "subject": subject,
        "baseline": baseline,
        "ratio": {
            "mint_over_sign_p50": achieved["mint_p50_us"] / baseline["ed25519_sign"]["p50_us"],
            "verify_over_verify_p50": achieved["verify_p50_us"]
            / baseline["ed25519_verify"]["p50_us"],
            "eval_over_dict_p50": achieved["eval_p50_us"] / baseline["dict_lookup"]["p50_us"],
        },
        "target": TARGET,
        "met": stats.met(achieved, TARGET, most=TARGET),
        "measured": stats.require(
            {
                "mint": len(mint_s),
                "verify": len(verify_s),
                "verify + replay": len(replay_s),
                "evaluations": len(eval_s),
                "baseline signatures": len(sign_b),
                "baseline verifies": len(verify_b),
                "baseline lookups": len(dict_b),
            }
        ),
        "params": {
            "samples": n,
            "warmup": w,
            "zones": len(policy.zones),
            "batch": args.batch,
            "eval_samples": eval_n,
        },
        "machine": stats.machine("pynacl", "pydantic"),
    }
    print(stats.result_line(result))


if __name__ == "__main__":
    main()
