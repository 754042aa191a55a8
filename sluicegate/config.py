"""Configuration of every role: a TOML file, then environment overrides, then defaults.

Precedence, highest first: environment variables ``SLUICEGATE_<SECTION>__<KEY>`` (e.g.
``SLUICEGATE_MQTT__PORT=1884``), the TOML file given with ``--config``, the defaults below.
Validation happens once here; a bad value is a ConfigError naming the file, the key and
what would be accepted. Nothing else reads the environment for settings.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from sluicegate.errors import ConfigError
from sluicegate.metering.prices import PriceTable

ENV_PREFIX = "SLUICEGATE_"
MIB = 1024 * 1024


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MqttSettings(_Section):
    """How to reach the plant's MQTT broker."""

    host: str = "127.0.0.1"
    port: int = Field(1883, ge=1, le=65535)
    username: str | None = None
    password: SecretStr | None = None
    # TLS (secure by default, see docs/deployment.md): the campus CA that signed the MQTT
    # broker's certificate, and this node's client certificate and key, which Mosquitto
    # maps to its username (use_identity_as_username) and client id. The key is the node's
    # own Ed25519 identity key, the one its policy entry lists.
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    # Connect without TLS and client certificate: for debugging on a trusted machine only.
    # Without it a node refuses to start when no tls_ca_file is set.
    plaintext: bool = False
    keepalive_s: int = Field(30, ge=5, le=3600)
    reconnect_min_s: int = Field(1, ge=1, le=60)
    reconnect_max_s: int = Field(30, ge=1, le=600)
    session_expiry_s: int = Field(3600, ge=0, le=7 * 24 * 3600)


class EdgeSettings(_Section):
    """One line PC's edge agent."""

    id: str = "edge-1"
    zone: str = "campus/line-1"
    models_dir: Path | None = None
    # What runs the models, in order: ONNX Runtime providers, or "OpenVINO/<device>" first
    # for Intel's OpenVINO (an Intel line PC's GPU or NPU). None: ONNX Runtime on the CPU.
    providers: list[str] | None = None
    # How often the models folder is looked at for a new version to serve; 0: never.
    models_reload_s: float = Field(2.0, ge=0.0, le=3600.0)
    key_file: Path | None = None  # this edge's Ed25519 identity key (its policy entry's key)
    max_payload_bytes: int = Field(8 * MIB, ge=1024, le=256 * MIB)
    max_pixels: int = Field(40_000_000, ge=64 * 64)
    max_side: int = Field(10_000, ge=64)
    concurrency: int = Field(2, ge=1, le=64)
    queue_size: int = Field(256, ge=1, le=1_000_000)
    intra_op_threads: int = Field(1, ge=1, le=64)
    telemetry_interval_s: float = Field(1.0, gt=0.0, le=3600.0)
    # Publish a record of each concluded job with the telemetry, for the digital twin's
    # recorder (``sluicegate twin record``); off: nothing is kept or sent.
    trace_jobs: bool = True
    # Prometheus /metrics over HTTP: address and port (0: a free one, logged); off: none.
    # A port that cannot be bound is logged as an error and the agent serves on without.
    metrics_enabled: bool = True
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(9464, ge=0, le=65535)
    service_time_alpha: float = Field(0.2, gt=0.0, le=1.0)
    # The outbox: every accepted job on disk until its result is delivered. None: a file
    # named after the edge id in [offload] state_dir, else in ~/.local/state/sluicegate/.
    # "FULL" survives power loss; "NORMAL" survives a killed agent but may lose the last
    # commits on power loss.
    outbox_path: Path | None = None
    outbox_synchronous: Literal["FULL", "NORMAL"] = "FULL"
    # A job whose local runs were started this many times (each ended by the agent dying)
    # is answered failed/dead_letter instead of being run again.
    max_local_runs: int = Field(3, ge=1, le=100)
    # Delivered results are kept this long (a resubmission gets the same result), then only
    # their job ids, for tombstone_s and at most max_tombstones, to recognise resubmissions.
    result_retention_s: float = Field(600.0, ge=0.0)
    tombstone_s: float = Field(86_400.0, ge=0.0)
    max_tombstones: int = Field(100_000, ge=0, le=10_000_000)
    # A dead-lettered job keeps its image this long after its answer, so an operator may
    # release it for one retry (the console); then it is pruned like any other result.
    dead_letter_keep_s: float = Field(7 * 86_400.0, ge=0.0)
    # What this line PC's device is called in usage records and bills (as [pool]'s).
    device_class: str = Field("x86-cpu", min_length=1, max_length=64)
    # A signed usage record for each job run here, and for each offloaded job delivered
    # (which worker's attempt), in the outbox's file, committed with its result before the
    # result leaves, shipped to the broker; false: none.
    metering: bool = True
    usage_resend_s: float = Field(30.0, gt=0.0, le=3600.0)  # unacknowledged: sent again
    usage_retention_s: float = Field(7 * 86_400.0, ge=0.0)  # acknowledged: kept this long
    # Unused by an edge (its records ride the outbox's commits, outbox_synchronous): still
    # read so older configuration files load; a value other than outbox_synchronous is
    # logged at start.
    usage_synchronous: Literal["FULL", "NORMAL"] = "FULL"


class OffloadSettings(_Section):
    """When and how an edge agent moves jobs to the center pool."""

    enabled: bool = True
    # Ask for a placement when the local queue holds more than this many waiting jobs,
    # even if the deadline would still be met.
    queue_bound: int = Field(32, ge=0)
    # How long to wait for the broker's answer before running the job locally.
    placement_timeout_ms: float = Field(50.0, gt=0.0, le=10_000.0)
    # The policy this node starts from until the broker's retained one arrives, and where
    # the last accepted policy version is kept across restarts (rollback protection).
    policy_file: Path | None = None
    state_dir: Path | None = None
    # An offloaded job whose result has not come back this long after it was sent (or by its
    # deadline, if sooner) is offered again as the next attempt, or run here.
    result_timeout_s: float = Field(3.0, gt=0.0, le=3600.0)
    # Placement attempts per job before it runs here instead (the broker dead-letters a job
    # that kills its workers sooner: max_worker_crashes).
    max_attempts: int = Field(4, ge=1, le=1000)


class PoolSettings(_Section):
    """One center-pool worker."""

    id: str = "worker-1"
    zone: str = "campus/dc"
    device_class: str = "x86-cpu"
    models_dir: Path | None = None
    # How often the models folder is looked at for a new version to serve; 0: never.
    models_reload_s: float = Field(2.0, ge=0.0, le=3600.0)
    providers: list[str] | None = None  # None: every ONNX Runtime provider available here
    max_batch: int = Field(8, ge=1, le=1024)
    batch_window_ms: float = Field(2.0, ge=0.0, le=1000.0)
    # Batches in progress at once: two let one batch decode while the other runs.
    concurrency: int = Field(2, ge=1, le=64)
    queue_size: int = Field(512, ge=1)
    intra_op_threads: int = Field(1, ge=1, le=64)
    max_payload_bytes: int = Field(8 * MIB, ge=1024, le=256 * MIB)
    max_pixels: int = Field(40_000_000, ge=64 * 64)
    max_side: int = Field(10_000, ge=64)
    # The GPU whose figures NVML reports; run one worker per GPU with CUDA_VISIBLE_DEVICES
    # set to the same index, since NVML ignores that variable.
    device_index: int = Field(0, ge=0, le=255)
    telemetry_interval_s: float = Field(1.0, gt=0.0, le=3600.0)
    # Prometheus /metrics over HTTP: address and port (0: a free one, logged); off: none.
    # A port that cannot be bound is logged as an error and the worker serves on without.
    metrics_enabled: bool = True
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(9465, ge=0, le=65535)
    redis_url: str | None = None  # replay cache and audit stream; None: in memory / file
    key_file: Path | None = None  # this worker's Ed25519 key, signs its audit records
    audit_path: Path | None = None
    policy_file: Path | None = None
    state_dir: Path | None = None
    # A signed usage record for every attempt that ran, on disk (state_dir/usage.sqlite)
    # before its result leaves, shipped to the broker; false: none (the A/B bench's "off").
    metering: bool = True
    usage_resend_s: float = Field(30.0, gt=0.0, le=3600.0)  # unacknowledged: sent again
    usage_retention_s: float = Field(7 * 86_400.0, ge=0.0)  # acknowledged: kept this long
    # "NORMAL": a record is committed before its result leaves (a killed worker loses
    # none) and synced to the disk before it is shipped (a power loss loses only records
    # no broker has seen); "FULL" syncs before the result leaves (about 0.5 ms a batch).
    usage_synchronous: Literal["FULL", "NORMAL"] = "NORMAL"


READ_GAP_MS_MOST = 20.0  # the longest read gap a broker may be given


class BrokerSettings(_Section):
    """One campus broker replica."""

    id: str = "broker-1"
    redis_url: str = "redis://127.0.0.1:6379/0"
    http_host: str = "127.0.0.1"
    http_port: int = Field(8780, ge=0, le=65535)
    key_file: Path | None = None  # signs placement tokens and audit records
    policy_file: Path | None = None  # the signed policy it serves (with .sig beside it)
    # Placement parameters (TOML, the fields of PlacementParams; its twin verdict beside it
    # as <file>.verdict); none: derived from these settings. See broker.params_file.
    placement_file: Path | None = None
    # Shadow mode: a candidate policy (TOML, unsigned: it never acts) and/or placement file
    # deciding beside production on live traffic, compared, never acted on (GET /shadow).
    shadow_policy_file: Path | None = None
    shadow_placement_file: Path | None = None
    # The campus CA folder ('sluicegate ca init'): with it this replica serves enrollment
    # (POST /v1/enroll on its HTTP API). Keep it on one replica, readable by it alone.
    ca_dir: Path | None = None
    state_dir: Path | None = None
    models_dir: Path | None = None  # manifests: what each model requires
    telemetry_interval_s: float = Field(1.0, gt=0.0, le=3600.0)  # expected from nodes
    missed_intervals: int = Field(3, ge=1, le=100)  # silent this long: out of the fleet
    token_ttl_s: float = Field(10.0, gt=0.0, le=300.0)
    # Bind every placement to the chosen worker's sealing key when it has one the policy
    # lists, not only a confidential class's (which always is): every image sealed.
    seal_all: bool = False
    max_wait_ms: float = Field(50.0, ge=0.0, le=60_000.0)  # hold a job waiting for room
    # A job whose workers died holding it this many times is dead-lettered, not re-placed.
    max_worker_crashes: int = Field(3, ge=1, le=100)
    # A worker holding jobs that completes nothing for stall_factor times what their
    # placements expected (at least stall_floor_ms) takes no new placement until it does;
    # silent on past its next batch's time, its jobs are placed again (a frozen worker).
    stall_factor: float = Field(3.0, ge=1.0, le=1000.0)
    stall_floor_ms: float = Field(60.0, ge=1.0, le=3_600_000.0)
    # How long a placed job's in-flight record outlives its deadline (or its token, for a
    # job without one): the crash count must survive until the edge asks again.
    inflight_margin_s: float = Field(3600.0, ge=60.0, le=7 * 24 * 3600.0)
    # After a read that drained the MQTT socket, wait this long before watching it again:
    # thousands of edges' telemetry is read a few dozen messages to a wake-up rather than
    # one (docs/performance.md); a placement request waits at most this much longer.
    read_gap_ms: float = Field(2.0, ge=0.0, le=READ_GAP_MS_MOST)
    # How long before an announced window (sluicegate.schedule) its overflow counts in the
    # pools' demand signal: about the time a pool takes to add a worker.
    announce_lead_s: float = Field(120.0, ge=0.0, le=86_400.0)


class ConsoleSettings(_Section):
    """The broker's operator console and who may use its HTTP views (docs/console.md)."""

    # Viewers and operators (TOML, 'sluicegate console user|token'); none: the broker
    # keeps <state_dir>/console-users.toml, with an operator token made on first start.
    users_file: Path | None = None
    session_ttl_s: float = Field(8 * 3600.0, gt=0.0, le=30 * 86400.0)
    # Debugging only: anyone may view without a login (actions still need an operator).
    open: bool = False
    window_s: float = Field(60.0, ge=5.0, le=3600.0)  # what per-line and pool figures cover
    push_interval_s: float = Field(1.0, ge=0.1, le=60.0)  # live updates to open dashboards


class Settings(BaseSettings):
    """Everything a Sluicegate process can be told."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    mqtt: MqttSettings = MqttSettings()
    edge: EdgeSettings = EdgeSettings()
    offload: OffloadSettings = OffloadSettings()
    pool: PoolSettings = PoolSettings()
    broker: BrokerSettings = BrokerSettings()
    console: ConsoleSettings = ConsoleSettings()
    meter: PriceTable = PriceTable()  # 'sluicegate meter report --prices' (docs/metering.md)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The TOML file arrives as init kwargs (see load_settings); env must beat it.
        return env_settings, init_settings


def _describe(error: dict[str, Any]) -> str:
    key = ".".join(str(p) for p in error["loc"])
    value = error.get("input")
    shown = "" if isinstance(value, dict) else f" (got {value!r})"
    return f"{key}: {error['msg']}{shown}"


def load_settings(path: Path | None = None, **overrides: dict[str, Any]) -> Settings:
    """Read ``path`` (TOML) if given, apply env overrides, validate, return the settings.

    ``overrides`` are section dicts (``edge={"id": "x"}``) that sit between the file and
    the environment; the CLI uses them for its flags.
    """
    data: dict[str, Any] = {}
    where = "defaults"
    if path is not None:
        where = str(path)
        try:
            with path.open("rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    for section, values in overrides.items():
        data.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
    try:
        return Settings(**data)
    except ValidationError as exc:
        env = sorted(k for k in os.environ if k.startswith(ENV_PREFIX))
        lines = "; ".join(_describe(dict(e)) for e in exc.errors())
        hint = f" (environment overrides present: {', '.join(env)})" if env else ""
        raise ConfigError(f"invalid configuration in {where}: {lines}{hint}") from exc
