"""Errors raised by the compliance library.

Every refusal has its own class and a stable ``reason`` code (``"token.replayed"``), so the
broker, edge and worker can count refusals by reason and write them into the audit log without
parsing messages. A message names the bad value and what would have been accepted.

    PolicyError                              policy.error
    ├── PolicyParseError                     policy.parse     file, line or key, expectation
    ├── KeyFileError                         key.invalid      bad key file or key text
    ├── PlacementDenied                      placement.denied mint refused: policy says no
    ├── PolicyRefused                        a signed policy was not accepted
    │   ├── PolicyDigestMismatch             policy.digest_mismatch   content changed
    │   ├── UnknownSigner                    policy.unknown_signer
    │   ├── BadSignature                     policy.bad_signature
    │   ├── ThresholdNotMet                  policy.threshold_not_met
    │   ├── PolicyRollback                   policy.rollback
    │   ├── PolicyVersionConflict            policy.version_conflict  same version, new body
    │   ├── PolicyExpired                    policy.expired           (freeze attack)
    │   ├── RotationNotAuthorised            policy.rotation_not_authorised
    │   └── VerdictRefused                   a rollout's twin verdict was not accepted
    │       ├── VerdictMissing               verdict.missing        the policy requires one
    │       ├── VerdictUnknownSigner         verdict.unknown_signer not a listed twin key
    │       ├── VerdictBadSignature          verdict.bad_signature
    │       ├── VerdictOtherCandidate        verdict.other_candidate  for another digest
    │       ├── VerdictWeakThresholds        verdict.weak_thresholds  looser than required
    │       ├── VerdictWeakConditions        verdict.weak_conditions  a smaller burst
    │       └── VerdictFailed                verdict.failed         the rehearsal failed
    ├── TokenError
    │   ├── TokenTooLarge                    token.too_large  (mint side)
    │   └── TokenRefused                     a placement token was not accepted
    │       ├── TokenMalformed               token.malformed
    │       ├── TokenUntrustedSigner         token.untrusted_signer
    │       ├── TokenBadSignature            token.bad_signature
    │       ├── TokenPolicyMismatch          token.policy_mismatch
    │       ├── TokenNotYetValid             token.not_yet_valid
    │       ├── TokenExpired                 token.expired
    │       ├── TokenLifetimeTooLong         token.lifetime_too_long
    │       ├── TokenWrongJob                token.wrong_job         (mix-and-match)
    │       ├── TokenPayloadMismatch         token.payload_mismatch
    │       ├── TokenWrongClass              token.wrong_class
    │       ├── TokenWrongOrigin             token.wrong_origin
    │       ├── TokenWrongTarget             token.wrong_target
    │       ├── TokenZoneDenied              token.zone_denied
    │       ├── TokenReplayed                token.replayed
    │       ├── ReplayCacheFull              token.replay_cache_full (fails closed)
    │       ├── TokenNotSealed               token.not_sealed        confidential, no key bound
    │       ├── TokenUnknownSealKey          token.unknown_seal_key  key not listed for worker
    │       └── SealRefused                  the sealed image was not accepted
    │           ├── SealRequired             seal.required     the token binds a key: clear
    │           ├── SealUnexpected           seal.unexpected   sealed, the token binds none
    │           ├── SealKeyNotHeld           seal.key_not_held this worker lacks that key
    │           └── SealOpenFailed           seal.open_failed  another placement's, or altered
    ├── AgreementRefused                     a peer campus's half of an agreement was not kept
    │   ├── AgreementWrongParties            agreement.wrong_parties  not to us, or not a peer
    │   ├── AgreementUnknownSigner           agreement.unknown_signer not an officer pinned
    │   ├── AgreementBadSignature            agreement.bad_signature  or a changed body
    │   ├── AgreementThresholdNotMet         agreement.threshold_not_met
    │   └── AgreementReplayed                agreement.replayed  older than the half held
    ├── StoreUnavailable                     store.unavailable   Redis cannot be reached
    └── AuditError                           audit.error
        ├── AuditChainBroken                 audit.chain_broken  names the first bad record
        ├── AuditUntrustedSigner             audit.untrusted_signer  signed by another key
        ├── AuditLogUnreadable               audit.log_unreadable  no such file, no access
        └── AuditConflict                    audit.conflict      another writer appended
"""

from __future__ import annotations

from typing import ClassVar


class PolicyError(Exception):
    """Base of every error raised on purpose by ``policies`` (a library of its own: it
    imports nothing of the rest of Sluicegate, whose commands catch it beside their own)."""

    reason: ClassVar[str] = "policy.error"


class PolicyParseError(PolicyError):
    """A policy, signature or anchor file is not valid; the message says where and why."""

    reason = "policy.parse"

    def __init__(self, message: str, *, source: str, key: str = "", line: int | None = None):
        where = source if line is None else f"{source}:{line}"
        if key:
            where = f"{where}: {key}"
        super().__init__(f"{where}: {message}")
        self.source = source
        self.key = key
        self.line = line


class KeyFileError(PolicyError):
    """A key file or ``ed25519:...`` key text cannot be used."""

    reason = "key.invalid"


class PlacementDenied(PolicyError):
    """The broker asked to mint a token for a placement the policy does not allow."""

    reason = "placement.denied"


class PolicyRefused(PolicyError):
    """A signed policy was not accepted."""

    reason = "policy.refused"


class PolicyDigestMismatch(PolicyRefused):
    reason = "policy.digest_mismatch"


class UnknownSigner(PolicyRefused):
    reason = "policy.unknown_signer"


class BadSignature(PolicyRefused):
    reason = "policy.bad_signature"


class ThresholdNotMet(PolicyRefused):
    reason = "policy.threshold_not_met"


class PolicyRollback(PolicyRefused):
    reason = "policy.rollback"


class PolicyVersionConflict(PolicyRefused):
    reason = "policy.version_conflict"


class PolicyExpired(PolicyRefused):
    reason = "policy.expired"


class RotationNotAuthorised(PolicyRefused):
    reason = "policy.rotation_not_authorised"


class VerdictRefused(PolicyRefused):
    """A change that needs a passing twin verdict did not come with an acceptable one."""

    reason = "verdict.refused"


class VerdictMissing(VerdictRefused):
    reason = "verdict.missing"


class VerdictUnknownSigner(VerdictRefused):
    reason = "verdict.unknown_signer"


class VerdictBadSignature(VerdictRefused):
    reason = "verdict.bad_signature"


class VerdictOtherCandidate(VerdictRefused):
    reason = "verdict.other_candidate"


class VerdictWeakThresholds(VerdictRefused):
    reason = "verdict.weak_thresholds"


class VerdictWeakConditions(VerdictRefused):
    reason = "verdict.weak_conditions"


class VerdictFailed(VerdictRefused):
    reason = "verdict.failed"


class TokenError(PolicyError):
    """Base for placement token problems."""

    reason = "token.error"


class TokenTooLarge(TokenError):
    """The names in a placement do not fit the 400-byte token budget."""

    reason = "token.too_large"


class TokenRefused(TokenError):
    """A placement token was not accepted by its verifier."""

    reason = "token.refused"


class TokenMalformed(TokenRefused):
    reason = "token.malformed"


class TokenUntrustedSigner(TokenRefused):
    reason = "token.untrusted_signer"


class TokenBadSignature(TokenRefused):
    reason = "token.bad_signature"


class TokenPolicyMismatch(TokenRefused):
    reason = "token.policy_mismatch"


class TokenNotYetValid(TokenRefused):
    reason = "token.not_yet_valid"


class TokenExpired(TokenRefused):
    reason = "token.expired"


class TokenLifetimeTooLong(TokenRefused):
    reason = "token.lifetime_too_long"


class TokenWrongJob(TokenRefused):
    reason = "token.wrong_job"


class TokenPayloadMismatch(TokenRefused):
    reason = "token.payload_mismatch"


class TokenWrongClass(TokenRefused):
    reason = "token.wrong_class"


class TokenWrongOrigin(TokenRefused):
    reason = "token.wrong_origin"


class TokenWrongTarget(TokenRefused):
    reason = "token.wrong_target"


class TokenZoneDenied(TokenRefused):
    reason = "token.zone_denied"


class TokenReplayed(TokenRefused):
    reason = "token.replayed"


class ReplayCacheFull(TokenRefused):
    reason = "token.replay_cache_full"


class TokenNotSealed(TokenRefused):
    """The policy marks the data class confidential and the token binds no sealing key."""

    reason = "token.not_sealed"


class TokenUnknownSealKey(TokenRefused):
    """The token binds a sealing key the policy does not list for its target worker."""

    reason = "token.unknown_seal_key"


class SealRefused(TokenRefused):
    """A work message whose sealing does not match its token."""

    reason = "seal.refused"


class SealRequired(SealRefused):
    reason = "seal.required"


class SealUnexpected(SealRefused):
    reason = "seal.unexpected"


class SealKeyNotHeld(SealRefused):
    reason = "seal.key_not_held"


class SealOpenFailed(SealRefused):
    reason = "seal.open_failed"


class AgreementRefused(PolicyError):
    """A sister campus's signed half of an agreement was not kept (``policies.agreement``)."""

    reason = "agreement.refused"


class AgreementWrongParties(AgreementRefused):
    reason = "agreement.wrong_parties"


class AgreementUnknownSigner(AgreementRefused):
    reason = "agreement.unknown_signer"


class AgreementBadSignature(AgreementRefused):
    reason = "agreement.bad_signature"


class AgreementThresholdNotMet(AgreementRefused):
    reason = "agreement.threshold_not_met"


class AgreementReplayed(AgreementRefused):
    reason = "agreement.replayed"


class StoreUnavailable(PolicyError):
    """The shared store (Redis) cannot be reached or refused the command: nothing was
    decided; the caller fails closed or tries again. Raised by this package's Redis stores
    and, for the broker's own Redis calls, by ``sluicegate.store``."""

    reason = "store.unavailable"


class AuditError(PolicyError):
    """Base for audit log problems."""

    reason = "audit.error"


class AuditChainBroken(AuditError):
    """Verification found the first record that breaks the chain."""

    reason = "audit.chain_broken"

    def __init__(self, message: str, *, index: int, problem: str):
        super().__init__(f"record {index}: {message}")
        self.index = index
        self.problem = problem


class AuditUntrustedSigner(AuditError):
    """A record is signed by a key the verifier was not told to trust: usually the log of
    another node, or the wrong ``--key``/``--policy``. The chain itself may be intact."""

    reason = "audit.untrusted_signer"

    def __init__(self, message: str, *, index: int, signer: bytes):
        super().__init__(f"record {index}: {message}")
        self.index = index
        self.signer = signer


class AuditLogUnreadable(AuditError):
    """The log itself cannot be read (no such file, no permission): nothing was verified."""

    reason = "audit.log_unreadable"


class AuditConflict(AuditError):
    """Another writer appended to the same log between our read of its head and our append."""

    reason = "audit.conflict"
