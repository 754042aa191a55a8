"""What sister campuses say to each other over their bridge, as wire models validated once
here. The bridge speaks MQTT 3.1.1 (``sluicegate.mosquitto``), so no MQTT property crosses:
every message carries what it needs in its payload, signed by who speaks.

A campus's **summary** is what it offers one peer, every second, in the spirit of the IETF
CATS metric levels: per model and device class the raw figures (L0: free slots, queue time
p50/p99, service time, price), each category normalised to [0, 1] with 1 the best (L1:
capacity, delay, cost) and one score (L2). It is signed by one of the sending campus's
broker replicas (the keys the receiver's ``[peers]`` entry pins), numbered per replica
(``seq``) and valid ``ttl_s`` from ``at``: a receiver keeps only fresh, newer summaries.
It also says which version of the sender's half of the agreement is in force on its side
(0: none), so a withdrawal is heard within one summary.

A **probe** measures the link: a replica sends one with a random nonce (and, now and then,
padding), the peer's replica sends back an echo with the same nonce and no padding, and the
sender times the round trip on its own clock. Only the peer's bridge writes the peer's tree,
and the nonce cannot be guessed, so an echo needs no signature.
"""

from __future__ import annotations

from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from policies.canonical import canonical_json
from policies.keys import SigningKey, b64u_decode, b64u_encode, signature_valid
from sluicegate.errors import WireError
from sluicegate.transport import Message

SUMMARY_FORMAT: Literal["sluicegate-peer-summary/1"] = "sluicegate-peer-summary/1"
SUMMARY_DOMAIN = b"sluicegate-peer-summary/1\n"
MAX_OFFERS = 256


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


Unit = Field(ge=0.0, le=1.0, allow_inf_nan=False)


class Offer(_Wire):
    """One model on one device class: L0 raw figures, L1 per category, the L2 score."""

    model: str = Field(min_length=1, max_length=64)
    device_class: str = Field(min_length=1, max_length=32)
    free_slots: int = Field(ge=0, le=1_000_000)
    queue_p50_ms: float = Field(ge=0.0, le=3.6e6, allow_inf_nan=False)
    queue_p99_ms: float = Field(ge=0.0, le=3.6e6, allow_inf_nan=False)
    service_ms: float = Field(gt=0.0, le=3.6e6, allow_inf_nan=False)
    capacity: float = Unit
    delay: float = Unit
    cost: float = Unit
    score: float = Unit


class SummaryBody(_Wire):
    format: Literal["sluicegate-peer-summary/1"] = SUMMARY_FORMAT
    campus: str = Field(min_length=1, max_length=64)  # who offers
    peer: str = Field(min_length=1, max_length=64)  # to whom
    broker: str = Field(min_length=1, max_length=64)  # the replica that signed it
    seq: int = Field(ge=1)
    at: float = Field(gt=0.0, allow_inf_nan=False)  # the sender's clock, unix s
    ttl_s: float = Field(gt=0.0, le=60.0, allow_inf_nan=False)
    agreement_version: int = Field(ge=0)  # the sender's half in force; 0: none
    currency: str = Field(default="", max_length=16)
    device_second: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    offers: tuple[Offer, ...] = Field(default=(), max_length=MAX_OFFERS)

    def signed_bytes(self) -> bytes:
        """What the replica signs: the domain and the body's canonical JSON."""
        return SUMMARY_DOMAIN + canonical_json(self.model_dump(mode="json"))


class SignedSummary(_Wire):
    body: SummaryBody
    sig: str = Field(pattern=r"^[A-Za-z0-9_-]{86}$")

    def verifies(self, public: bytes) -> bool:
        return signature_valid(public, b64u_decode(self.sig), self.body.signed_bytes())


def sign_summary(body: SummaryBody, key: SigningKey) -> bytes:
    """The summary as it is published: the body and the replica's signature over it."""
    signed = SignedSummary(body=body, sig=b64u_encode(key.sign(body.signed_bytes())))
    return canonical_json(signed.model_dump(mode="json"))


M = TypeVar("M", bound=BaseModel)


def _parse(model: type[M], data: bytes, what: str) -> M:
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "the document"
        raise WireError(f"{what}: {where}: {first['msg']}") from exc


def parse_summary(data: bytes) -> SignedSummary:
    """A published summary, or WireError naming what is wrong (the signature is the
    receiver's to check: it alone knows the keys)."""
    return _parse(SignedSummary, data, "peer summary")


MAX_PAD = 1 << 20


class Probe(_Wire):
    """A link probe (``kind`` probe) or its echo: the nonce and the sender's clock back."""

    kind: Literal["probe", "echo"]
    broker: str = Field(min_length=1, max_length=64)  # who sent this message
    nonce: str = Field(pattern=r"^[0-9a-f]{32}$")
    sent_at: float = Field(gt=0.0, allow_inf_nan=False)  # the probing replica's clock
    pad: str = Field(default="", max_length=MAX_PAD)  # bytes that time the throughput


def parse_probe(data: bytes) -> Probe:
    return _parse(Probe, data, "peer probe")


# -- an MQTT v5 message across a 3.1.1 bridge ----------------------------------------------
# A job's work message (edge -> a peer's worker) and its result (worker -> edge) carry their
# meaning in MQTT v5 properties on campus. Across the bridge they travel as an envelope: a
# magic line, the properties as a JSON header of known length, then the payload unchanged.
# Unwrapped on arrival they are the same message again, read by the same code as on campus.

ENVELOPE_MAGIC = b"sluicegate-peer-envelope/1\n"
_HEADER_LEN = 4
MAX_HEADER = 16 * 1024


class EnvelopeHead(_Wire):
    """What a wrapped message keeps of its MQTT v5 properties (never a response topic:
    where a result goes is the receiver's to derive from the topic)."""

    props: tuple[tuple[str, str], ...] = Field(default=(), max_length=64)
    correlation: str = Field(default="", max_length=1024)  # base64url, "" for none
    content_type: str = Field(default="", max_length=256)


def wrap(msg: Message) -> Message:
    """``msg`` as it crosses a bridge: the same topic and QoS, its properties in the payload."""
    head = EnvelopeHead(
        props=tuple(msg.user_properties),
        correlation=b64u_encode(msg.correlation_data) if msg.correlation_data else "",
        content_type=msg.content_type or "",
    )
    text = canonical_json(head.model_dump(mode="json"))
    payload = ENVELOPE_MAGIC + len(text).to_bytes(_HEADER_LEN, "big") + text + msg.payload
    return Message(msg.topic, payload, qos=msg.qos)


def unwrap(msg: Message) -> Message:
    """The message a bridge carried, properties restored; WireError if it is not one."""
    data = msg.payload
    start = len(ENVELOPE_MAGIC) + _HEADER_LEN
    if not data.startswith(ENVELOPE_MAGIC) or len(data) < start:
        raise WireError(f"not a peer envelope: a message on {msg.topic!r} must start with it")
    size = int.from_bytes(data[len(ENVELOPE_MAGIC) : start], "big")
    if size > MAX_HEADER or start + size > len(data):
        raise WireError(f"peer envelope header of {size} bytes: at most {MAX_HEADER}, whole")
    head = _parse(EnvelopeHead, data[start : start + size], "peer envelope")
    try:
        correlation = b64u_decode(head.correlation) if head.correlation else None
    except ValueError as exc:
        raise WireError(f"peer envelope: correlation: {exc}") from exc
    return Message(
        msg.topic,
        data[start + size :],
        qos=msg.qos,
        correlation_data=correlation,
        content_type=head.content_type or None,
        user_properties=head.props,
        ack_handle=msg.ack_handle,
        dup=msg.dup,
    )
