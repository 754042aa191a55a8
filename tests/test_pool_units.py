"""Pure tier: the worker's intake steps, provider selection, NVML parsing (with a fake module:
no test pretends a GPU exists), host sensors and service-time bookkeeping."""

from __future__ import annotations

import types
from dataclasses import dataclass, replace
from typing import Any

import pytest

from center_pool import reporting
from center_pool.errors import DeviceError, ProviderError
from center_pool.hardware import (
    HostProbe,
    NvmlProbe,
    cpu_temperature,
    open_probe,
    select_providers,
)
from center_pool.intake import Limits, Work, WorkRefusal, admit_work, check_token, read_work
from policies import PlacementClaims
from sluicegate import topics
from sluicegate.config import PoolSettings
from tests.image_bytes import png_header_only
from tests.policies.policy_testkit import NOW
from tests.pool_kit import JPEG, POLICY, WORKER, WorkSpec, flip_bit, token

LIMITS = Limits(max_payload_bytes=1 << 20, max_pixels=4_000_000, max_side=4000)
MODELS = {"defect-v1": "ab" * 32}  # name -> the sha256 of the file served


def _read(spec: WorkSpec) -> Work | WorkRefusal:
    return read_work(spec.message(), limits=LIMITS, now=NOW, worker_id=WORKER)


def _spec(**kw: Any) -> WorkSpec:
    job = kw.pop("job_id", "job-1")
    payload = kw.get("payload", JPEG)
    kw.setdefault("token", token(job, payload, now=NOW))
    return WorkSpec(job_id=job, **kw)


def _through_token(spec: WorkSpec) -> tuple[Work, PlacementClaims]:
    work = _read(spec)
    assert isinstance(work, Work)
    claims = check_token(work, POLICY, now=NOW + 1, worker_id=WORKER)
    assert isinstance(claims, PlacementClaims), claims
    return work, claims


@pytest.mark.parametrize(
    ("spec", "drop_job_id", "code"),
    [
        (WorkSpec(job_id="j", token=""), False, "token.missing"),
        (WorkSpec(job_id="j", token=""), True, "token.missing"),
        (WorkSpec(job_id="j", token="x"), True, "bad_property"),
        (
            WorkSpec(job_id="j", token="x", payload=b"\0" * (LIMITS.max_payload_bytes + 1)),
            False,
            "payload_too_large",
        ),
        (WorkSpec(job_id="j", token="x", edge=""), False, "no_edge_id"),
        (WorkSpec(job_id="j", token="x", edge="-lead"), False, "no_edge_id"),
        (WorkSpec(job_id="j", token="x", edge_property="south-l1-pc"), False, "edge.id_mismatch"),
        (WorkSpec(job_id="j", token="x", edge_property="no/slash"), False, "edge.id_mismatch"),
        (WorkSpec(job_id="j", token="x", attempt="0"), False, "bad_property"),
        (WorkSpec(job_id="j", token="x", attempt="2.5"), False, "bad_property"),
        (WorkSpec(job_id="j", token="x", attempt="9" * 5000), False, "bad_property"),
    ],
)
def test_read_work_refuses_before_the_token_is_checked(
    spec: WorkSpec, drop_job_id: bool, code: str
) -> None:
    msg = spec.message()
    if drop_job_id:
        props = tuple((k, v) for k, v in msg.user_properties if k != "job-id")
        msg = replace(msg, user_properties=props)
    work = read_work(msg, limits=LIMITS, now=NOW, worker_id=WORKER)
    assert isinstance(work, WorkRefusal)
    assert (work.code, work.token_passed, work.received_at) == (code, False, NOW)


@pytest.mark.parametrize(
    ("edge", "named", "attempt", "returned_to"),
    [
        ("north-l1-pc", None, None, ("north-l1-pc", 1)),
        ("north-l1-pc", None, "3", ("north-l1-pc", 3)),
        ("north-l1-pc", "", "3", ("north-l1-pc", 3)),  # the edge-id property is optional
        # To the edge that sent it, never to the one its property names.
        ("north-l1-pc", "south-l1-pc", "2", ("north-l1-pc", 2)),
        ("", None, "2", (None, 2)),  # refused: nowhere to return it, only counted and audited
        ("-lead", None, "2", (None, 2)),
    ],
)
def test_a_refusal_goes_back_to_the_edge_that_sent_it_with_its_attempt(
    edge: str, named: str | None, attempt: str | None, returned_to: tuple[str | None, int]
) -> None:
    got = _read(WorkSpec(job_id="j", token="", edge=edge, edge_property=named, attempt=attempt))
    assert isinstance(got, WorkRefusal)
    assert (got.edge_id, got.attempt) == returned_to


def test_work_on_a_topic_that_names_no_edge_is_refused_saying_where_work_goes() -> None:
    got = _read(WorkSpec(job_id="j", token="x", edge=""))
    assert isinstance(got, WorkRefusal)
    assert "names no edge" in got.reason
    assert topics.pool_work("<zone>", WORKER, "<edge id>") in got.reason
    assert "edge agent" in got.reason


def test_an_edge_id_property_naming_another_edge_is_refused_naming_both() -> None:
    got = _read(WorkSpec(job_id="j", token="x", edge_property="south-l1-pc"))
    assert isinstance(got, WorkRefusal)
    assert (got.code, got.token_passed) == ("edge.id_mismatch", False)
    assert "'south-l1-pc'" in got.reason
    assert "'north-l1-pc'" in got.reason


def test_the_edge_is_read_from_the_work_topic() -> None:
    got = _read(WorkSpec(job_id="j", token="x", edge="north-l1-pc", edge_property=""))
    assert isinstance(got, Work)
    assert got.edge_id == "north-l1-pc"


@pytest.mark.parametrize(
    ("spec", "now", "code"),
    [
        (_spec(token=flip_bit(token("job-1", JPEG, now=NOW))), NOW, "token.bad_signature"),
        (
            _spec(payload=b"not an image", token=token("job-1", JPEG, now=NOW)),
            NOW,
            "token.payload_mismatch",
        ),
        (
            _spec(token=token("job-1", JPEG, now=NOW, worker="south-npu-1")),
            NOW,
            "token.wrong_target",
        ),
        (_spec(token=token("job-2", JPEG, now=NOW)), NOW, "token.wrong_job"),
        (_spec(), NOW + 60, "token.expired"),
        (_spec(token="AAAA"), NOW, "token.malformed"),
        # The origin is the sending edge's zone in the policy, whatever the message declares.
        (
            _spec(
                token=token("job-1", JPEG, now=NOW, origin="campus/fab-south/line-1"),
                origin_property="campus/fab-south/line-1",
            ),
            NOW,
            "token.wrong_origin",
        ),
        (_spec(edge="ghost-pc"), NOW, "edge.not_in_policy"),
    ],
)
def test_check_token_names_the_token_problem(spec: WorkSpec, now: float, code: str) -> None:
    work = _read(spec)
    assert isinstance(work, Work)
    verdict = check_token(work, POLICY, now=now, worker_id=WORKER)
    assert isinstance(verdict, WorkRefusal)
    assert verdict.code == code, verdict.reason
    assert WORKER in verdict.reason


def test_an_edge_the_policy_does_not_list_is_refused_before_its_token_is_read() -> None:
    work = _read(_spec(edge="ghost-pc", token="AAAA"))  # a token that would not parse
    assert isinstance(work, Work)
    verdict = check_token(work, POLICY, now=NOW, worker_id=WORKER)
    assert isinstance(verdict, WorkRefusal)
    assert (verdict.code, verdict.edge_id, verdict.token_passed) == (
        "edge.not_in_policy",
        "ghost-pc",
        False,
    )
    assert f"v{POLICY.version}" in verdict.reason


def test_a_false_origin_zone_property_does_not_change_the_origin_checked() -> None:
    work, claims = _through_token(_spec(origin_property="offsite/cloud-east"))
    entry = POLICY.edge("north-l1-pc")
    assert entry is not None
    assert claims.origin_zone == entry.zone == "campus/fab-north/line-1"
    assert work.prop(topics.PROP_ORIGIN_ZONE) == "offsite/cloud-east"


def test_a_non_image_with_a_valid_token_passes_the_token_and_fails_the_header() -> None:
    payload = b"%PDF-1.7 certainly not an image"
    work, claims = _through_token(_spec(payload=payload, token=token("job-1", payload, now=NOW)))
    item = admit_work(work, claims, models=MODELS, limits=LIMITS, now=NOW)
    assert isinstance(item, WorkRefusal)
    assert (item.code, item.token_passed) == ("bad_image", True)


@pytest.mark.parametrize(
    ("spec", "code"),
    [
        (_spec(model="defect-v9"), "unknown_model"),
        (_spec(model_sha256="cd" * 32), "model_version"),  # another file than this worker's
        (_spec(priority=12), "bad_property"),
        (_spec(deadline_at_ms=-5), "bad_property"),
        (_spec(deadline_at_ms=(NOW - 1) * 1000), "expired"),
        (_spec(content_type="text/plain"), "bad_content_type"),
        (_spec(content_type="image/png"), "bad_content_type"),
        (
            _spec(
                payload=png_header_only(9000, 9000),
                token=token("job-1", png_header_only(9000, 9000), now=NOW),
                content_type=None,
            ),
            "image_too_large",
        ),
    ],
)
def test_admit_work_after_the_token(spec: WorkSpec, code: str) -> None:
    work, claims = _through_token(spec)
    item = admit_work(work, claims, models=MODELS, limits=LIMITS, now=NOW)
    assert isinstance(item, WorkRefusal)
    assert item.code == code, item.reason
    assert item.status == ("expired" if code == "expired" else "rejected")


def test_admit_work_takes_class_and_origin_from_the_verified_claims() -> None:
    work, claims = _through_token(_spec(priority=0, deadline_at_ms=(NOW + 5) * 1000))
    item = admit_work(work, claims, models=MODELS, limits=LIMITS, now=NOW)
    assert not isinstance(item, WorkRefusal)
    assert (item.priority, item.deadline) == (0, NOW + 5)
    assert (item.data_class, item.origin_zone, item.edge_id, item.attempt) == (
        claims.data_class,
        claims.origin_zone,
        "north-l1-pc",
        1,
    )


def test_work_for_another_version_is_refused_naming_both_and_the_same_one_admitted() -> None:
    item = admit_work(
        *_through_token(_spec(model_sha256="cd" * 32)), models=MODELS, limits=LIMITS, now=NOW
    )
    assert isinstance(item, WorkRefusal)
    assert item.reason == (
        "this worker serves defect-v1 at sha256 abababababab…, the edge runs cdcdcdcdcdcd…: "
        "not run here"
    )
    same = admit_work(
        *_through_token(_spec(model_sha256="ab" * 32)), models=MODELS, limits=LIMITS, now=NOW
    )
    assert not isinstance(same, WorkRefusal)


def test_admit_work_keeps_the_attempt_of_the_work_message() -> None:
    work, claims = _through_token(_spec(attempt="4"))
    item = admit_work(work, claims, models=MODELS, limits=LIMITS, now=NOW)
    assert not isinstance(item, WorkRefusal)
    assert (item.edge_id, item.attempt) == ("north-l1-pc", 4)


@pytest.mark.parametrize(
    ("available", "wanted", "chosen"),
    [
        (
            ["CUDAExecutionProvider", "CPUExecutionProvider"],
            None,
            ["CUDAExecutionProvider", "CPUExecutionProvider"],
        ),
        (["AzureExecutionProvider", "CPUExecutionProvider"], None, ["CPUExecutionProvider"]),
        (
            ["CUDAExecutionProvider", "CPUExecutionProvider"],
            ["CPUExecutionProvider"],
            ["CPUExecutionProvider"],
        ),
        (
            ["CPUExecutionProvider"],
            ["CANNExecutionProvider", "CPUExecutionProvider"],
            ["CPUExecutionProvider"],
        ),
    ],
)
def test_select_providers(
    available: list[str], wanted: list[str] | None, chosen: list[str]
) -> None:
    assert select_providers(available, wanted) == chosen


def test_no_configured_provider_available_names_what_is() -> None:
    with pytest.raises(
        ProviderError, match=r"CANNExecutionProvider.*available: CPUExecutionProvider"
    ):
        select_providers(["CPUExecutionProvider"], ["CANNExecutionProvider"])


class _NVMLError(Exception):
    pass


@dataclass
class _Memory:
    total: int
    used: int


@dataclass
class _Rates:
    gpu: int
    memory: int


def fake_nvml(*, count: int = 1, temperature: bool = True, fail_init: bool = False) -> Any:
    """An object shaped like the ``pynvml`` module, reporting an 80 GiB board."""
    calls: list[str] = []

    def init() -> None:
        calls.append("init")
        if fail_init:
            raise _NVMLError("Driver Not Loaded")

    def temp(_handle: object, sensor: int) -> int:
        assert sensor == 0
        if not temperature:
            raise _NVMLError("Not Supported")
        return 67

    return types.SimpleNamespace(
        NVMLError=_NVMLError,
        NVML_TEMPERATURE_GPU=0,
        calls=calls,
        nvmlInit=init,
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: count,
        nvmlDeviceGetHandleByIndex=lambda i: ("handle", i),
        nvmlDeviceGetName=lambda _h: b"NVIDIA A100-SXM4-80GB",
        nvmlDeviceGetMemoryInfo=lambda _h: _Memory(80 * 1024**3, 20 * 1024**3),
        nvmlDeviceGetUtilizationRates=lambda _h: _Rates(gpu=70, memory=90),
        nvmlDeviceGetTemperature=temp,
    )


def test_nvml_readings_become_fractions_and_mib() -> None:
    probe = NvmlProbe(fake_nvml(), 0)
    assert (probe.name, probe.memory_total_mb) == ("NVIDIA A100-SXM4-80GB", 80 * 1024)
    sample = probe.sample()
    assert (sample.utilisation, sample.memory_bandwidth, sample.temperature_c) == (0.7, 0.9, 67.0)
    assert (sample.memory_used_mb, sample.memory_total_mb) == (20 * 1024, 80 * 1024)


def test_nvml_figure_a_board_does_not_report_is_none() -> None:
    assert NvmlProbe(fake_nvml(temperature=False), 0).sample().temperature_c is None


def test_nvml_without_a_gpu_falls_back_to_the_host() -> None:
    module = fake_nvml(fail_init=True)
    assert isinstance(open_probe(0, nvml=module), HostProbe)


def test_nvml_device_index_out_of_range_is_named() -> None:
    module = fake_nvml(count=2)
    with pytest.raises(
        DeviceError, match=r"GPU index 3 .* 2 GPU\(s\): use \[pool\] device_index 0\.\.1"
    ):
        open_probe(3, nvml=module)
    assert module.calls == ["init", "shutdown"]


def test_open_probe_uses_nvml_when_a_gpu_answers() -> None:
    module = fake_nvml()
    probe = open_probe(0, nvml=module)
    assert isinstance(probe, NvmlProbe)
    probe.close()
    probe.close()
    assert module.calls == ["init", "shutdown"]


def test_host_probe_reports_ram_and_a_fraction() -> None:
    sample = HostProbe().sample()
    assert 0.0 <= sample.utilisation <= 1.0
    assert 0 < sample.memory_used_mb <= sample.memory_total_mb
    assert sample.memory_bandwidth is None


@dataclass
class _Reading:
    current: float | None


def test_cpu_temperature_takes_the_hottest_known_sensor() -> None:
    assert cpu_temperature({"coretemp": [_Reading(41.0), _Reading(55.5)]}) == 55.5
    assert cpu_temperature({"nvme": [_Reading(30.0)]}) is None
    assert cpu_temperature({}) is None


def test_service_stats_amortise_a_batch_over_its_jobs() -> None:
    stats = reporting.ServiceStats(alpha=0.5)
    assert stats.batch_estimate_s("m") is None
    stats.observe("m", batch_ms=8.0, jobs=4)
    stats.observe("m", batch_ms=4.0, jobs=4)
    stats.observe("m", batch_ms=1.0, jobs=0)  # nothing ran: ignored
    load = stats.loads()["m"]
    assert (load.service_ms, load.completed) == (1.5, 8)
    assert stats.batch_estimate_s("m") == pytest.approx(0.006)
    with pytest.raises(ValueError, match="alpha"):
        reporting.ServiceStats(alpha=0)


def test_capacity_counts_queue_and_running_batches() -> None:
    settings = PoolSettings(queue_size=10, concurrency=2, max_batch=4)
    assert reporting.capacity(settings) == 18


def test_a_repeated_property_counts_once_the_first_time() -> None:
    msg = _spec().message()
    doubled = replace(msg, user_properties=(*msg.user_properties, ("job-id", "job-2")))
    work = read_work(doubled, limits=LIMITS, now=NOW, worker_id=WORKER)
    assert isinstance(work, Work)
    assert work.job_id == "job-1"


def test_the_backlog_weighs_each_job_by_its_own_model() -> None:
    """What the broker's wait rests on: two OCR jobs at 70 ms hold more work than four
    detector jobs at 2 ms; a model not measured yet, and a job whose model is not read
    yet, count at the mean of those measured."""
    stats = reporting.ServiceStats(alpha=1.0)
    assert stats.backlog_ms({"ocr": 3}, unknown=2) == 0.0  # nothing measured: nothing known
    stats.observe("ocr", 140.0, 2)  # 70 ms a job
    stats.observe("det", 16.0, 8)  # 2 ms a job, amortised over its batch
    assert stats.backlog_ms({"ocr": 2, "det": 4}) == 148.0
    assert stats.backlog_ms({"new": 1}, unknown=1) == 72.0
