"""Hand-written ONNX graphs for the model build scripts (build_defect.py, build_detector.py).

The scripts write their graphs node by node with onnx.helper rather than through an
exporter, so the bytes depend only on the weights and the script: :class:`Graph` holds the
nodes and initializers in the order they are added, folds a batch norm into the convolution
before it (:func:`folded`), and :meth:`Graph.finish` checks the model and serialises it
deterministically at IR version 8 (what opset 17 needs; older runtimes still load it).
Dev only: it imports torch and onnx, which CI and the runtime never install.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from onnx import TensorProto, checker, helper, numpy_helper
from torch import nn

F32 = npt.NDArray[np.float32]


def folded(conv: nn.Conv2d, bn: nn.BatchNorm2d | None) -> tuple[F32, F32]:
    """The convolution's weight and bias with ``bn`` (if any) folded in."""
    if bn is None:
        return conv.weight.detach().numpy(), conv.bias.detach().numpy()
    scale = (bn.weight / torch.sqrt(bn.running_var + bn.eps)).detach()
    weight = (conv.weight.detach() * scale[:, None, None, None]).numpy()
    bias = (bn.bias.detach() - bn.running_mean * scale).numpy()
    return weight, bias


class Graph:
    """Nodes and initializers, in the order they are added."""

    def __init__(self) -> None:
        self.nodes: list[Any] = []
        self.inits: list[Any] = []

    def const(self, name: str, value: npt.ArrayLike, dtype: type = np.float32) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def node(self, op: str, inputs: list[str], outputs: list[str], **attrs: Any) -> None:
        self.nodes.append(helper.make_node(op, inputs, outputs, **attrs))

    def conv(
        self,
        name: str,
        src: str,
        conv: nn.Conv2d,
        bn: nn.BatchNorm2d | None = None,
        *,
        prefix: str | None = None,
        relu: str | None = None,
    ) -> str:
        """A convolution (``bn`` folded in) reading ``src`` and writing ``name``, its
        initializers named after ``prefix`` (default ``name``), then a ReLU writing
        ``relu`` if given; returns the last output's name."""
        weight, bias = folded(conv, bn)
        w = self.const(f"{prefix or name}.weight", weight)
        b = self.const(f"{prefix or name}.bias", bias)
        k, stride, pad = conv.kernel_size[0], conv.stride[0], conv.padding[0]
        self.node(
            "Conv",
            [src, w, b],
            [name],
            kernel_shape=[k, k],
            strides=[stride, stride],
            pads=[pad] * 4,
        )
        if relu is None:
            return name
        self.node("Relu", [name], [relu])
        return relu

    def finish(
        self,
        name: str,
        inputs: list[tuple[str, list[int | str]]],
        outputs: list[tuple[str, list[int | str]]],
        *,
        opset: int,
        producer: str,
        version: str,
        doc: str,
    ) -> bytes:
        """The checked model's bytes, float inputs and outputs of the given shapes."""
        graph = helper.make_graph(
            self.nodes,
            name,
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs],
            initializer=self.inits,
        )
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", opset)],
            producer_name=producer,
            producer_version=version,
            doc_string=doc,
        )
        model.ir_version = 8
        checker.check_model(model, full_check=True)
        return bytes(model.SerializeToString(deterministic=True))
