"""Intel's OpenVINO runtime as a second backend, behind the few calls the rest of the vision
layer makes of an ONNX Runtime session.

OpenVINO reads ONNX directly, from the very bytes the registry verified, and compiles the
graph for a device (``CPU`` here; ``GPU`` or ``NPU`` on Intel line PCs). It is an optional
extra (``pip install 'sluicegate[openvino]'``): the base install never imports it. Each
thread runs its own infer request (a compiled model is shared, a request is not), one
inference thread each unless told otherwise, like the ONNX Runtime sessions. The graph's
metadata (an OCR recogniser's character set) is read from OpenVINO's copy of it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from sluicegate.errors import ModelIntegrityError

__all__ = ["OPENVINO", "OpenVinoSession", "backend_of", "openvino_devices"]

OPENVINO = "OpenVINO/"  # a provider named OpenVINO/<device> is Intel's OpenVINO runtime


def backend_of(provider: str) -> str:
    """The runtime and device a provider name stands for: ``openvino/CPU``,
    ``onnxruntime/CUDAExecutionProvider``."""
    if provider.startswith(OPENVINO):
        return "openvino/" + provider.removeprefix(OPENVINO)
    return "onnxruntime/" + provider


def _openvino() -> Any:
    try:
        import openvino
    except ImportError as exc:
        raise ModelIntegrityError(
            "the openvino backend needs the openvino package: pip install 'sluicegate[openvino]'"
        ) from exc
    return openvino


def openvino_devices() -> list[str]:
    """The devices OpenVINO can run on here (``CPU``, ``GPU``, ``NPU``), or none."""
    try:
        ov = _openvino()
    except ModelIntegrityError:
        return []
    return [str(d) for d in ov.Core().available_devices]


@dataclass(frozen=True)
class _Port:
    name: str
    shape: list[int | str]


@dataclass
class _Meta:
    custom_metadata_map: dict[str, str] = field(default_factory=dict)


class OpenVinoSession:
    """A model compiled by OpenVINO for ``device``, answering as an ONNX Runtime session."""

    def __init__(self, blob: bytes, *, device: str = "CPU", threads: int = 1) -> None:
        ov = _openvino()
        core = ov.Core()
        devices = list(core.available_devices)
        if device not in devices:
            raise ModelIntegrityError(
                f"OpenVINO has no device {device!r} here; it has {', '.join(devices) or 'none'}"
            )
        model = core.read_model(blob)
        self._model = model
        # f32 throughout: a CPU with bf16 units would otherwise run in bf16, and answer
        # other than ONNX Runtime does by more than the scores can bear.
        config = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32"}
        self._compiled = core.compile_model(model, device, config)
        self.device = device
        self._local = threading.local()

    def run(
        self, output_names: Sequence[str] | None, feeds: dict[str, npt.NDArray[Any]]
    ) -> list[npt.NDArray[Any]]:
        request = getattr(self._local, "request", None)
        if request is None:
            request = self._local.request = self._compiled.create_infer_request()
        results = request.infer(feeds)
        by_name = {port.get_any_name(): np.asarray(value) for port, value in results.items()}
        names = output_names or [o.name for o in self.get_outputs()]
        return [by_name[name].copy() for name in names]

    def get_inputs(self) -> list[_Port]:
        return [_Port(p.get_any_name(), _shape(p)) for p in self._model.inputs]

    def get_outputs(self) -> list[_Port]:
        return [_Port(p.get_any_name(), _shape(p)) for p in self._model.outputs]

    def get_providers(self) -> list[str]:
        return [f"OpenVINO/{self.device}"]

    def get_modelmeta(self) -> _Meta:
        """The ONNX graph's metadata, as OpenVINO keeps it (under ``framework``)."""
        meta = _Meta()
        if self._model.has_rt_info(["framework"]):
            for key in self._model.get_rt_info()["framework"]:
                value = self._model.get_rt_info(["framework", key])
                meta.custom_metadata_map[str(key)] = value.astype(str)
        return meta


def _shape(port: Any) -> list[int | str]:
    return [d.get_length() if d.is_static else "?" for d in port.get_partial_shape()]
