"""Refusals the device backends share at prepare time: a step of more than one row, and an op they have no
kernel for (the hybrid families' recurrent ops among them), each refused with its reason and named in the
message."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.graphs import trace
from poot_core import Driver, DriverOptions, Layout, ModelHandle, PackedWeight, Reason, StepShape, Unsupported


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


def assert_backend_refuses_by_name(executor, path: Path) -> None:
    """A backend without the hybrid families' recurrent ops refuses a hybrid checkpoint's first step when the
    driver is made (before any token runs), naming one of those ops, in both layouts it offers."""
    from poot_core.graph import passes

    handle = ModelHandle.load(path)
    layouts = [Layout.CONTIGUOUS] + ([Layout.PAGED] if "paged" in executor.capabilities().layouts else [])
    for layout in layouts:
        with pytest.raises(Unsupported) as refused:
            Driver(handle, executor, DriverOptions(capacity=32, kv_blocks=8)).serve(layout)
        assert refused.value.reason is Reason.OPERATION and refused.value.name in passes.HYBRID_OPS
        assert executor.name in str(refused.value)
