"""Trusted metering: usage records signed by the node that ran each attempt, countersigned
by the broker, and the reports and offline checks built on them (``docs/metering.md``)."""
