"""Refusals the device backends share at prepare time: a step of more than one row, and an op they have no
kernel for, each refused with its reason and named in the message."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.graphs import trace
from poot_core import ModelHandle, PackedWeight, Reason, StepShape, Unsupported


def check_rows_and_op_refused(executor, checkpoint: Path, op: str) -> None:
    """Prepares the checkpoint's step at rows=2, then at rows=1 with its fourth node's op renamed to `op`."""
    handle = ModelHandle.load(checkpoint)
    weights = executor.upload(handle.store())
    with pytest.raises(Unsupported) as err:
        executor.prepare(trace(handle, StepShape(2, 1, 64)), weights)
    assert err.value.reason is Reason.SHAPE and "rows=2" in str(err.value)
    graph = trace(handle, StepShape(1, 1, 64))
    node = graph.nodes[3]
    graph.nodes[3] = type(node)(op, node.inputs, node.output, node.shape)
    with pytest.raises(Unsupported) as err:
        executor.prepare(graph, weights)
    assert err.value.reason is Reason.OPERATION and op in str(err.value)


def check_gptq_upload_refused(executor) -> None:
    """Uploading a GPTQ 4-bit weight is refused as a quantization, naming the format and the tensor."""

    class Store:
        def names(self):
            return ["layer.weight"]

        def get(self, name):
            parts = {"qweight": torch.zeros(8, 64, dtype=torch.int32)}
            return PackedWeight("gptq", (64, 64), parts, {"bits": 4, "group_size": 32})

    with pytest.raises(Unsupported) as err:
        executor.upload(Store())
    assert err.value.reason is Reason.QUANTIZATION
    assert "gptq.4" in str(err.value) and "layer.weight" in str(err.value)
