"""Errors shared by every Sluicegate role.

Each message names the bad value and what would have been accepted, so a person reading a
log line or a ``rejected`` result can act on it without reading the code.

    SluicegateError
    ├── ConfigError             bad configuration file or environment override
    ├── TransportError          the MQTT connection failed or was lost
    │   ├── PublishRefused      the broker refused a publish (its reason code)
    │   └── RequestTimeout      no answer arrived in time
    ├── ModelError
    │   ├── UnknownModelError   a job named a model this node does not have
    │   ├── ModelIntegrityError a model file does not match its manifest
    │   └── OutputError         a model's output cannot be read as its manifest says
    ├── ImageError              the payload is not an image we can safely decode
    │   └── ImageTooLargeError  the image declares more pixels than the limit
    ├── WireError               a message does not follow the wire contract
    ├── IdentityError           a certificate, key or identity claim cannot be trusted
    │   ├── EnrollmentRefused   a join token or enrollment request was refused (``code``)
    │   └── IdentityInUse       another process already serves this node's identity
    ├── BundleError             an offline install bundle cannot be built as asked
    └── LedgerError             a node's usage ledger cannot be opened or written

``policies.errors.PolicyError`` is the policy library's own root; :data:`EXPECTED` names both
roots, for the commands that turn any error raised on purpose into a message. One of its
errors is shared: :class:`StoreUnavailable` (Redis cannot be reached, or refused a command)
is what every Redis call of every role raises, the policy library's stores and, through
:mod:`sluicegate.store`, the broker's own.
"""

from __future__ import annotations

from policies.errors import PolicyError
from policies.errors import StoreUnavailable as StoreUnavailable


class SluicegateError(Exception):
    """Base of every error raised on purpose by Sluicegate."""


class ConfigError(SluicegateError):
    """A configuration file or override is invalid."""


class TransportError(SluicegateError):
    """The MQTT transport failed: not connected, connection lost, publish refused."""


class PublishRefused(TransportError):
    """The MQTT broker answered a publish with a failure reason code (``reason``: not
    authorized, topic name invalid, ...): it will refuse that message every time."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class RequestTimeout(TransportError):
    """A request got no answer within its timeout."""


class ModelError(SluicegateError):
    """Base for model loading and lookup problems."""


class UnknownModelError(ModelError):
    """A job asked for a model that is not loaded here."""


class ModelIntegrityError(ModelError):
    """A model file or manifest is missing, malformed, or its sha256 does not match."""


class OutputError(ModelError):
    """A model's output tensor has another shape than its manifest says, or holds NaN."""


class ImageError(SluicegateError):
    """The payload is not a decodable JPEG/PNG image."""


class ImageTooLargeError(ImageError):
    """The image header declares dimensions beyond the configured limit."""


class WireError(SluicegateError):
    """A message does not follow the public wire contract."""


class IdentityError(SluicegateError):
    """A certificate, key or identity cannot be used: wrong CA, expired, not this node."""


class EnrollmentRefused(IdentityError):
    """A join token or an enrollment request was refused; ``code`` says why, stably, and
    the text always carries it (``enrollment refused [code]: reason``), wherever it is
    printed; ``reason`` is the reason alone (what the broker sends back)."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"enrollment refused [{code}]: {reason}")
        self.code = code
        self.reason = reason


class IdentityInUse(IdentityError):
    """Another process already serves as this node: two would answer the same jobs."""


class BundleError(SluicegateError):
    """An offline install bundle cannot be built: bad target, or no wheel for a package."""


EXPECTED: tuple[type[Exception], ...] = (SluicegateError, PolicyError)


class LedgerError(SluicegateError):
    """A node's usage ledger (``sluicegate.metering.ledger``) cannot be opened or written."""
