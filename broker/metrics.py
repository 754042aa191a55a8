"""The broker's Prometheus metrics: one registry per broker, named here and nowhere else.

Counters and histograms are updated by the shell as it works; gauges that describe the
fleet (queue depths, predicted demand per pool and its age, workers last seen) and the
policy in force are refreshed each time ``/metrics`` is scraped (``broker.exposition``), so
they are never stale; the audit chain's are set by ``broker.audit_check`` after each pass.
``docs/observability.md`` lists them all.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class BrokerMetrics:
    """Everything ``/metrics`` exposes."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "sluicegate_placement_decisions",
            "Placement decisions by outcome",
            ["outcome"],
            registry=r,
        )
        self.shadow = Counter(
            "sluicegate_shadow_decisions",
            "A shadow candidate's decisions by how they compare with production's",
            ["outcome"],
            registry=r,
        )
        self.refusals = Counter(
            "sluicegate_placement_refusals",
            "Placement refusals by reason code",
            ["code"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "sluicegate_placement_decision_seconds",
            "Time from a placement request's arrival to its reply being queued",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
            registry=r,
        )
        self.job_seconds = Histogram(
            "sluicegate_offloaded_job_seconds",
            "Service time of offloaded jobs as reported by the workers",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=r,
        )
        self.completions = Counter(
            "sluicegate_completions", "Completion records by status", ["status"], registry=r
        )
        self.telemetry = Counter(
            "sluicegate_broker_telemetry",
            "Edge telemetry samples by what became of them: read, coalesced (replaced by a "
            "newer one unread), shed (dropped unread under overload), ignored (a node the "
            "policy does not list as an edge, or about another node), malformed",
            ["outcome"],
            registry=r,
        )
        self.telemetry_backlog = Gauge(
            "sluicegate_broker_telemetry_backlog_seconds",
            "How long the oldest unread edge telemetry sample had waited at the last read",
            registry=r,
        )
        # By zone, not by edge: 5,000 line PCs made 15,000 series and a 267 ms scrape on
        # the event loop. Each edge's own figures are on its own /metrics.
        self.finished = Gauge(
            "sluicegate_edge_finished_jobs",
            "Jobs the edges of a policy zone answered ok since they started, summed, by "
            "where they ran (edge, pool), from their telemetry",
            ["zone", "ran_on"],
            registry=r,
        )
        self.edge_queued = Gauge(
            "sluicegate_edge_queued_jobs",
            "Jobs queued on the edges of a policy zone, summed, from their telemetry",
            ["zone"],
            registry=r,
        )
        self.offload_ratio = Gauge(
            "sluicegate_offload_ratio", "Share of jobs offloaded by the edges", registry=r
        )
        self.queue_depth = Gauge(
            "sluicegate_queue_depth",
            "Jobs queued per pool worker (kind pool), from its telemetry",
            ["node", "kind"],
            registry=r,
        )
        self.waiting = Gauge(
            "sluicegate_placement_waiting", "Placement requests waiting for room", registry=r
        )
        self.demand = Gauge(
            "sluicegate_pool_predicted_demand",
            "Predicted demand over capacity per pool: a scaling signal (>1: add workers)",
            ["pool"],
            registry=r,
        )
        self.announced = Gauge(
            "sluicegate_pool_announced_jobs_per_second",
            "Jobs/s the lines' announced work will send each pool, counted from the lead time "
            "before each window (part of the predicted demand)",
            ["pool"],
            registry=r,
        )
        self.desired_workers = Gauge(
            "sluicegate_pool_desired_workers",
            "Workers each pool needs for its predicted demand at the target utilisation",
            ["pool"],
            registry=r,
        )
        self.workers = Gauge("sluicegate_workers", "Workers by health state", ["state"], registry=r)
        # What became of placed jobs (this replica's share: sum over replicas for the campus).
        # Sister campuses (broker.peers): what was refused, and where each peer stands.
        self.peer_refused = Counter(
            "sluicegate_peer_refused",
            "Messages from sister campuses refused, by kind (half, summary, probe, ask) and reason",
            ["kind", "reason"],
            registry=r,
        )
        self.peer_in_force = Gauge(
            "sluicegate_peer_agreement_in_force",
            "1 while the agreement with the peer is in force here, else 0",
            ["peer"],
            registry=r,
        )
        self.peer_free_slots = Gauge(
            "sluicegate_peer_offered_free_slots",
            "Free slots the peer's latest fresh summary offers, over every model (0: stale)",
            ["peer"],
            registry=r,
        )
        self.peer_rtt = Gauge(
            "sluicegate_peer_link_rtt_seconds",
            "Round trip to the peer over the bridge, from probes (NaN: not known)",
            ["peer"],
            registry=r,
        )
        self.peer_asked = Counter(
            "sluicegate_peer_asked",
            "Jobs no worker here could take, asked of a sister campus, by how its answer ended "
            "(placed, refused, timeout)",
            ["peer", "outcome"],
            registry=r,
        )
        self.worker_losses = Counter(
            "sluicegate_worker_losses",
            "Worker deaths this replica acted on (claimed their jobs in flight), by cause",
            ["cause"],
            registry=r,
        )
        self.worker_suspicions = Counter(
            "sluicegate_worker_suspicions",
            "Workers taken out of placement for a job overdue (no completion long past its "
            "placement's prediction), until their next completion or telemetry",
            registry=r,
        )
        self.replacements = Counter(
            "sluicegate_replacements",
            "Jobs whose worker died, sent back to their edge to be placed again, by cause",
            ["reason"],
            registry=r,
        )
        self.dead_letters = Counter(
            "sluicegate_dead_letters",
            "Jobs dead-lettered after max_worker_crashes workers died holding them",
            registry=r,
        )
        self.released = Counter(
            "sluicegate_placements_released",
            "Placements an edge handed back unused (nothing sent to the worker): the slot "
            "freed at once instead of when its reservation expires",
            registry=r,
        )
        self.identity_refusals = Counter(
            "sluicegate_identity_refusals",
            "Messages refused because the policy does not list their sender as what it "
            "claims to be, by code (edge.not_in_policy, worker.not_in_policy, ...)",
            ["code"],
            registry=r,
        )
        self.stale_completions = Counter(
            "sluicegate_stale_completions",
            "Completions of an attempt older than the job's current one (or after its dead "
            "letter): discarded and audited",
            registry=r,
        )

        # Usage records from the nodes (broker.metering): this replica's share of the new
        # ones (every replica hears each record; the one whose insert stored it counts it).
        self.usage_records = Counter(
            "sluicegate_usage_records",
            "Usage records stored, by the line that owns the job, the pool that ran it "
            "('edge': the line PC itself) and event (ran, settled)",
            ["line", "pool", "event"],
            registry=r,
        )
        self.usage_device_seconds = Counter(
            "sluicegate_usage_device_seconds",
            "Device time recorded by attempts that ran (each job's share of its batch), by "
            "line and pool: billed and waste alike until settlements decide",
            ["line", "pool"],
            registry=r,
        )
        self.usage_jobs_billed = Counter(
            "sluicegate_usage_jobs_billed",
            "Jobs whose edge settled them (delivered one attempt's result), by line and pool",
            ["line", "pool"],
            registry=r,
        )
        self.usage_refusals = Counter(
            "sluicegate_usage_refusals",
            "Usage records refused (not stored, not acknowledged: the node keeps them), by "
            "code (usage.bad_signature, usage.not_in_policy, usage.id_mismatch, ...)",
            ["code"],
            registry=r,
        )
        self.usage_duplicates = Counter(
            "sluicegate_usage_duplicates",
            "Usage records received again (a resend, or another replica stored it first)",
            registry=r,
        )
        self.usage_conflicts = Counter(
            "sluicegate_usage_conflicts",
            "Usage records that differ from the one held for their node and seq: kept "
            "aside, never stored over it",
            ["node"],
            registry=r,
        )
        self.usage_chain_breaks = Counter(
            "sluicegate_usage_chain_breaks",
            "Links between a node's neighbouring usage records that do not match (a prev "
            "that is not the digest of the record before)",
            ["node"],
            registry=r,
        )
        self.usage_missing = Gauge(
            "sluicegate_usage_missing_records",
            "Records a node has numbered that the broker does not hold (gaps in its seq), "
            "as of its latest record stored",
            ["node"],
            registry=r,
        )
        self.usage_store_failures = Counter(
            "sluicegate_usage_store_failures",
            "Messages of usage records not stored because Redis failed (not acknowledged: "
            "their node sends them again)",
            registry=r,
        )

        # The fleet's freshness and the policy in force, refreshed at scrape time.
        self.signal_age = Gauge(
            "sluicegate_pool_signal_age_seconds",
            "Age of the newest worker telemetry each pool's demand signal is computed from "
            "(+Inf until one of its workers reports to this broker, e.g. after a restart)",
            ["pool"],
            registry=r,
        )
        self.worker_last_seen = Gauge(
            "sluicegate_worker_last_seen_timestamp_seconds",
            "When this broker last received the worker's telemetry (Unix time)",
            ["worker"],
            registry=r,
        )
        self.policy_version = Gauge(
            "sluicegate_policy_version", "Version of the policy in force (0: none)", registry=r
        )
        self.policy_expiry = Gauge(
            "sluicegate_policy_expiry_timestamp_seconds",
            "When the policy in force expires (Unix time; 0: no policy)",
            registry=r,
        )
        # The broker's own periodic check of its audit log (broker.audit_check).
        self.audit_verified_at = Gauge(
            "sluicegate_audit_verified_timestamp_seconds",
            "When the audit chain was last verified up to its head (Unix time; 0: never)",
            registry=r,
        )
        self.audit_failures = Counter(
            "sluicegate_audit_verify_failures",
            "Audit chain checks that found the chain broken or signed by an untrusted key",
            registry=r,
        )
        self.audit_records = Gauge(
            "sluicegate_audit_chain_records", "Records of the verified audit chain", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
