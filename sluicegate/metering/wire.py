"""What usage shipping puts on the wire: a node's records to the broker, one signed record
per line (``record.to_line``, the export's own line format), and a replica's
acknowledgement back to the node (:class:`UsageAck`).

A batch is read line by line, so one malformed or forged line is refused alone and the
rest of its message still counts. Pure: no clock, no transport.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sluicegate.metering.record import SignedUsage, from_line, to_line

CONTENT_TYPE = "application/x-ndjson"
MAX_LINE_BYTES = 16_384  # a record is well under 2 KB; anything this long is not one


def encode_batch(records: Iterable[SignedUsage]) -> bytes:
    """Records as one message: a line each, newline-terminated."""
    return b"".join(to_line(signed) + b"\n" for signed in records)


@dataclass(frozen=True, slots=True)
class BadLine:
    """A line of a batch that is not a signed usage record, and why (for the log)."""

    index: int
    reason: str


def decode_batch(payload: bytes) -> list[SignedUsage | BadLine]:
    """Each non-empty line of ``payload`` as a record, or why it is not one; never raises."""
    out: list[SignedUsage | BadLine] = []
    for index, line in enumerate(payload.split(b"\n")):
        if not line.strip():
            continue
        if len(line) > MAX_LINE_BYTES:
            out.append(BadLine(index, f"line of {len(line)} bytes; a record is under 16 KB"))
            continue
        try:
            out.append(from_line(line))
        except ValidationError as exc:
            first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": str(exc)}
            where = ".".join(str(p) for p in first["loc"]) or "line"
            out.append(BadLine(index, f"not a signed usage record: {where}: {first['msg']}"))
    return out


class Refused(BaseModel):
    """A record a replica would not take: its seq, a code and a sentence."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seq: int = Field(ge=0)  # 0: the line could not be read as a record at all
    code: str = Field(max_length=64)
    reason: str = Field(max_length=500)


class UsageAck(BaseModel):
    """Broker -> node, on ``topics.usage_acks(node)``: the seqs this replica now holds (new
    or held already: a node stops resending either), and those it refused (kept by the
    node, resent later, never dropped by it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: int = 1
    node: str = Field(max_length=64)
    broker: str = Field(max_length=64)
    held: list[int] = Field(default_factory=list)
    refused: list[Refused] = Field(default_factory=list)
