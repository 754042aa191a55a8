"""Sluicegate's compliance library: signed policy files, zone and data-class rules, signed
placement tokens and a tamper-evident audit log. Pure code: no network, no clock of its own
(every time-dependent call takes ``now``, seconds since the epoch). Redis backends live in
``policies.redis_stores``; the command line in ``policies.cli``.

    policy = load_policy(path)                                  # or parse_canonical(bytes)
    anchor = accept_policy(policy, bundle, now=now, anchor=previous_anchor)
    verdict = allowed(policy, "wafer-image", origin_zone, target_zone)
    token = mint(policy, broker_key, job_id=..., payload_sha256=..., data_class=...,
                 origin_zone=..., target_worker=..., now=now)
    claims = verify(token, policy, now=now, job_id=..., payload_sha256=..., worker_id=...)
    check_replay(cache, claims, policy, now=now)
"""

from __future__ import annotations

from policies.audit import AsyncAuditWriter, AuditRecord, AuditWriter, refusal_data, verify_chain
from policies.evaluate import allowed, explain
from policies.keys import SigningKey, load_signing_key
from policies.loader import load_policy, parse_canonical, parse_policy
from policies.model import Policy, Verdict
from policies.replay import MemoryReplayCache, acheck_replay, acheck_replays, check_replay
from policies.signing import (
    SignatureBundle,
    TrustAnchor,
    accept_policy,
    open_envelope,
    sign_policy,
    signed_envelope,
)
from policies.subhealth import is_subhealthy
from policies.tokens import PlacementClaims, mint, payload_digest, verify

__all__ = [
    "AsyncAuditWriter",
    "AuditRecord",
    "AuditWriter",
    "MemoryReplayCache",
    "PlacementClaims",
    "Policy",
    "SignatureBundle",
    "SigningKey",
    "TrustAnchor",
    "Verdict",
    "accept_policy",
    "acheck_replay",
    "acheck_replays",
    "allowed",
    "check_replay",
    "explain",
    "is_subhealthy",
    "load_policy",
    "load_signing_key",
    "mint",
    "open_envelope",
    "parse_canonical",
    "parse_policy",
    "payload_digest",
    "refusal_data",
    "sign_policy",
    "signed_envelope",
    "verify",
    "verify_chain",
]
