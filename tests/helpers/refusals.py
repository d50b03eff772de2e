"""Refusals the device backends share at prepare time: a step of more than one row, and an op they have no
kernel for, each refused with its reason and named in the message."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.graphs import trace
from poot_core import ModelHandle, Reason, StepShape, Unsupported


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
