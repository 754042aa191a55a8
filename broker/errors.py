"""Errors of the campus broker.

The placement core refuses jobs with :class:`~broker.core.placement.Refused` values, never with
exceptions: a refusal is an answer, not a failure. Exceptions here are for a caller that
misuses the core (an unknown worker id, parameters out of range), and each message names
the bad value and what would be accepted.

    SluicegateError
    └── BrokerError
        ├── UnknownWorker    a reservation names a worker the fleet has never heard of
        └── InvalidParams    a core parameter is out of range
"""

from __future__ import annotations

from sluicegate.errors import SluicegateError


class BrokerError(SluicegateError):
    """Base of the broker's own errors."""


class UnknownWorker(BrokerError):
    """A call named a worker that sent neither capabilities nor telemetry."""


class InvalidParams(BrokerError):
    """A placement or fleet parameter is out of range."""
