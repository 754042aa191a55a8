"""The enrollment desk of the replica that holds the campus CA folder: ``POST /v1/enroll``.

It validates the request document, has the :class:`~sluicegate.enroll.authority.Authority`
decide (proof of the join token, expiry, scope, the certificate request), takes the token
in Redis so it is used once across all replicas (``SET NX`` until it expires), issues the
certificate with the signed policy in force, records the node for the officers, and audits
every issue and every refusal with its code. It answers each refusal with that code and a
sentence, and keeps serving: nothing a request holds can stop it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from pydantic import ValidationError

from broker import keys
from broker.decision_audit import DecisionAudit, encode
from sluicegate.enroll.authority import Authority, EnrollRequest
from sluicegate.errors import EnrollmentRefused, StoreUnavailable
from sluicegate.store import reached

log = logging.getLogger(__name__)

REFUSED = {  # HTTP status per refusal code
    "join.malformed": 400,
    "join.bad_proof": 403,
    "join.expired": 403,
    "join.wrong_scope": 403,
    "join.reused": 409,
}


class EnrollmentDesk:
    def __init__(
        self,
        authority: Authority | None,
        redis: aioredis.Redis,
        audit: DecisionAudit,
        envelope: Callable[[], bytes | None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._authority = authority
        self._redis = redis
        self._audit = audit
        self._envelope = envelope
        self._clock = clock
        self.issued = 0
        self.refused = 0

    async def enroll(self, body: bytes) -> tuple[int, dict[str, Any]]:
        """The HTTP status and JSON document answering one enrollment request."""
        authority = self._authority
        if authority is None:
            return 503, {
                "code": "join.unavailable",
                "error": "this broker replica does not serve enrollment: set [broker] ca_dir "
                "on the replica that holds the campus CA folder",
            }
        claims = None
        try:
            try:
                request = EnrollRequest.model_validate_json(body)
            except ValidationError as exc:
                reason = f"not an enrollment request: {exc}"
                raise EnrollmentRefused("join.malformed", reason) from None
            claims = request.claims
            now = self._clock()
            issued = authority.decide(request, now=now)
            envelope = self._envelope()
            if envelope is None:
                return 503, {"code": "no_policy", "error": "the broker holds no verified policy"}
            ttl_ms = max(1, int((claims.exp - now) * 1000))
            try:
                with reached("mark the join token used"):
                    first = await self._redis.set(
                        keys.join_token(claims.id), "1", nx=True, px=ttl_ms
                    )
            except StoreUnavailable as exc:
                return 503, {"code": "broker_unavailable", "error": f"Redis unavailable: {exc}"}
            if not first:
                raise EnrollmentRefused(
                    "join.reused",
                    f"join token {claims.id[:8]} for {claims.role} {claims.node!r} was used "
                    "already; a token enrolls one node once: ask the operator for a new one",
                )
        except EnrollmentRefused as exc:
            self.refused += 1
            record = {"code": exc.code, "reason": exc.reason}
            if claims is not None:
                record |= {"node": claims.node, "role": claims.role, "token": claims.id}
            subject = claims.node if claims is not None else "?"
            self._audit.add(subject, encode(record), "enroll.refused")
            log.warning("%s", exc)
            return REFUSED.get(exc.code, 403), {"code": exc.code, "error": exc.reason}
        authority.record(issued, now=now)
        self.issued += 1
        self._audit.add(claims.node, encode(issued.record()), "enroll.issued")
        log.info(
            "enrolled %s %s in %s (%s)", claims.role, claims.node, claims.zone, issued.key_text
        )
        return 200, authority.answer(issued, envelope).model_dump()
