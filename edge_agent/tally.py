"""The names of the edge agent's event counters, one enumeration.

Each counts something that happened to a job or a message; telemetry publishes them as
``events`` (``sluicegate_edge_events_total{event=...}`` on the edge's /metrics). A value is
a plain string, so a counter keyed by a member is read back by its name.
"""

from __future__ import annotations

from enum import StrEnum


class Tally(StrEnum):
    ACCEPTED = "accepted"  # a request became a job, on disk
    DUPLICATES = "duplicates"  # a resubmission of a job id the edge knows
    REDELIVERED = "redelivered"  # the MQTT broker redelivered a request accepted before
    REPLAYED = "replayed"  # jobs read back from the outbox at start
    REPUBLISHED = "republished"  # results published again at start
    RESPONSE_TOPIC_NOT_ALLOWED = "response_topic_not_allowed"  # refused: the ACL would drop it
    OUTBOX_ERRORS = "outbox_errors"  # a write the outbox could not make
    LATE_RESULTS = "late_results"  # a result the outbox refused: the job was concluded already
    RESULTS_REFUSED = "results_refused"  # answers the MQTT broker refused (its ACL): not resent
    DEAD_LETTERS = "dead_letters"  # jobs concluded failed/dead_letter
    FENCED_RETURNS = "fenced_returns"  # a worker's return not for the job's current attempt
    BAD_RETURNS = "bad_returns"  # a return that could not be read
    NOT_RUN_RETURNS = "not_run_returns"  # a worker refused the work unrun: it runs here
    BAD_NOTICES = "bad_notices"  # a broker notice that could not be read
    STALE_NOTICES = "stale_notices"  # a notice for an attempt no longer current
    RETRIES = "retries"  # released dead letters run again as new jobs
    WORKERS_LOST = "workers_lost"  # the broker says the attempt's worker is gone
    OFFLOAD_TIMEOUTS = "offload_timeouts"  # no return within result_timeout_s
    OFFLOAD_RESCUES = "offload_rescues"  # no return yet, queued here to meet the deadline
    SENT_BEFORE_COMMIT = "sent_before_commit"  # attempt 1 sent while its acceptance committed
    ILLEGAL_MOVES = "illegal_moves"  # an event the lifecycle table has no row for (a bug)
    TRACE_DROPPED = "trace_dropped"  # job records past the bound between two telemetries
