"""Errors raised by the center pool worker.

A work message that is refused is not an exception: it is answered with a ``rejected``
result, counted and (before its token passed) audited; these classes are for what stops a
worker from starting. Each message names the bad value and what would be accepted.

    SluicegateError                 (sluicegate.errors)
    └── PoolError
        ├── ProviderError           none of the configured execution providers is available
        ├── DeviceError             the configured accelerator cannot be read (NVML)
        └── AuditSetupError         no usable audit log or signing key for it
"""

from __future__ import annotations

from sluicegate.errors import SluicegateError


class PoolError(SluicegateError):
    """Base of every error raised on purpose by ``center_pool``."""


class ProviderError(PoolError):
    """The configured ONNX Runtime execution providers are not available on this machine."""


class DeviceError(PoolError):
    """The accelerator named in the configuration cannot be found or read."""


class AuditSetupError(PoolError):
    """The worker cannot open its audit log or load the key that signs it."""
