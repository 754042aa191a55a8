"""Errors of the edge agent's own making.

SluicegateError            (sluicegate.errors)
└── EdgeError
    └── OutboxError        the outbox file cannot be opened, read or written
"""

from __future__ import annotations

from sluicegate.errors import SluicegateError


class EdgeError(SluicegateError):
    """Base of the edge agent's errors."""


class OutboxError(EdgeError):
    """The on-disk outbox failed; the message names the file and what to check."""
