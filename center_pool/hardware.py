"""What a pool worker runs on: its ONNX Runtime execution providers and live device figures.

Providers come from ``onnxruntime.get_available_providers()``, narrowed to the configured
list. Device figures come from NVML (the ``pynvml`` module of ``nvidia-ml-py``, the ``gpu``
extra) when it is importable and reports a GPU: memory, utilisation, memory-bandwidth
pressure (NVML's memory-controller busy fraction) and temperature. Otherwise they come from
the host through psutil: CPU utilisation, RAM and, where the kernel exposes sensors, CPU
temperature. The device *class* (``nvidia-a100``, ``x86-cpu``...) is declared in the
configuration, never guessed. A figure the hardware does not report is None, never invented.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import psutil

from center_pool.errors import DeviceError, ProviderError
from sluicegate.vision.openvino_session import OPENVINO, openvino_devices

log = logging.getLogger(__name__)

MIB = 1024 * 1024
# Remote-inference endpoints, not hardware of this machine: never picked automatically.
NOT_LOCAL = frozenset({"AzureExecutionProvider"})
CPU_SENSORS = ("coretemp", "k10temp", "zenpower", "cpu_thermal", "cpu-thermal", "acpitz")


def select_providers(available: Sequence[str], wanted: Sequence[str] | None) -> list[str]:
    """The providers to use, in ONNX Runtime's priority order (or the configured order).

    ``wanted`` None means every local provider available here. A wanted provider that is not
    available is left out (and logged); none left is a :class:`ProviderError`.
    """
    if wanted is None:
        chosen = [p for p in available if p not in NOT_LOCAL]
    else:
        missing = [p for p in wanted if p not in available]
        if missing:
            log.warning(
                "execution provider(s) %s not available here; available: %s",
                ", ".join(missing),
                ", ".join(available),
            )
        chosen = [p for p in wanted if p in available]
    if not chosen:
        raise ProviderError(
            f"none of the configured execution providers {list(wanted or [])} is available "
            f"in this onnxruntime; available: {', '.join(available) or 'none'} "
            "(set [pool] providers to some of these, or install the runtime build you need)"
        )
    return chosen


def available_providers(wanted: Sequence[str] | None = None) -> list[str]:
    """ONNX Runtime's providers here, and OpenVINO's devices (``OpenVINO/CPU``, ...) when
    ``wanted`` names one (OpenVINO is an optional extra, loaded only when asked for)."""
    import onnxruntime

    found = list(onnxruntime.get_available_providers())
    if wanted is not None and any(p.startswith(OPENVINO) for p in wanted):
        found += [OPENVINO + d for d in openvino_devices()]
    return found


@dataclass(frozen=True, slots=True)
class Sample:
    """One reading of the device; fractions are 0..1, None where not reported."""

    utilisation: float
    memory_used_mb: float
    memory_total_mb: float
    memory_bandwidth: float | None
    temperature_c: float | None


class Probe(Protocol):
    name: str
    memory_total_mb: int

    def sample(self) -> Sample: ...

    def close(self) -> None: ...


def _fraction(percent: float) -> float:
    return min(1.0, max(0.0, float(percent) / 100.0))


class NvmlProbe:
    """One GPU through an NVML module object (``pynvml``; tests pass a fake)."""

    def __init__(self, nvml: Any, index: int = 0) -> None:
        self._nvml = nvml
        nvml.nvmlInit()
        count = int(nvml.nvmlDeviceGetCount())
        if not 0 <= index < count:
            nvml.nvmlShutdown()
            raise DeviceError(
                f"GPU index {index} is not present; NVML sees {count} GPU(s): "
                f"use [pool] device_index 0..{count - 1}"
            )
        self._closed = False
        self._handle = nvml.nvmlDeviceGetHandleByIndex(index)
        raw_name = nvml.nvmlDeviceGetName(self._handle)
        self.name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
        memory = nvml.nvmlDeviceGetMemoryInfo(self._handle)
        self.memory_total_mb = int(memory.total // MIB)
        self._last = Sample(0.0, memory.used / MIB, memory.total / MIB, None, None)

    def _optional(self, read: Callable[[], Any]) -> Any:
        try:
            return read()
        except self._nvml.NVMLError as exc:  # e.g. NOT_SUPPORTED on some boards
            log.debug("NVML reading unavailable: %s", exc)
            return None

    def sample(self) -> Sample:
        nvml, handle = self._nvml, self._handle
        memory = self._optional(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        rates = self._optional(lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
        temperature = self._optional(
            lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
        )
        last = self._last
        self._last = Sample(
            utilisation=_fraction(rates.gpu) if rates is not None else last.utilisation,
            memory_used_mb=memory.used / MIB if memory is not None else last.memory_used_mb,
            memory_total_mb=memory.total / MIB if memory is not None else last.memory_total_mb,
            memory_bandwidth=_fraction(rates.memory) if rates is not None else None,
            temperature_c=float(temperature) if temperature is not None else None,
        )
        return self._last

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._optional(self._nvml.nvmlShutdown)


def cpu_temperature(readings: dict[str, list[Any]]) -> float | None:
    """The hottest CPU sensor in a ``psutil.sensors_temperatures()`` reply, if any."""
    for chip in CPU_SENSORS:
        values = [float(r.current) for r in readings.get(chip, ()) if r.current is not None]
        if values:
            return max(values)
    return None


class HostProbe:
    """The host's CPU and RAM through psutil, for CPU workers and machines without NVML.
    Utilisation is this worker's own share of the host's cores since the last sample: the
    whole host's CPU counts every other process on it, so an idle worker on a busy machine
    looked full."""

    def __init__(self) -> None:
        self.name = "host cpu"
        self.memory_total_mb = int(psutil.virtual_memory().total // MIB)
        self._process = psutil.Process()
        self._cores = psutil.cpu_count() or 1
        self._process.cpu_percent(None)  # prime: the first reading is always 0

    def sample(self) -> Sample:
        memory = psutil.virtual_memory()
        sensors = getattr(psutil, "sensors_temperatures", None)
        temperature = None
        if sensors is not None:
            try:
                temperature = cpu_temperature(sensors())
            except OSError:
                temperature = None
        return Sample(
            utilisation=_fraction(self._process.cpu_percent(None) / self._cores),
            memory_used_mb=(memory.total - memory.available) / MIB,
            memory_total_mb=memory.total / MIB,
            memory_bandwidth=None,
            temperature_c=temperature,
        )

    def close(self) -> None:
        return None


def import_nvml() -> Any | None:
    """The ``pynvml`` module if ``nvidia-ml-py`` is installed, else None."""
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        return None


def open_probe(device_index: int = 0, *, nvml: Any | None = None) -> Probe:
    """NVML for GPU ``device_index`` when a GPU answers, else the host probe.

    ``nvml`` is the module object to use (default: import ``pynvml`` if installed).
    """
    module = nvml if nvml is not None else import_nvml()
    if module is None:
        return HostProbe()
    try:
        probe = NvmlProbe(module, device_index)
    except module.NVMLError as exc:  # no driver, no GPU: a CPU machine with the extra
        log.info("NVML present but no GPU answers (%s); reading the host instead", exc)
        return HostProbe()
    log.info(
        "reading GPU %d (%s, %d MiB) through NVML", device_index, probe.name, probe.memory_total_mb
    )
    return probe
