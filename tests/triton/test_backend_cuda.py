"""The CUDA executor's registration, refusals and weight layout, on any machine.

Its numbers against the CPU executor (interpreted here without a GPU; compiled, with decode steps replayed from
CUDA graphs, on one) are checked in tests/conformance/test_executor_conformance.py.
"""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: E402, F401 - a test dependency: missing, it must fail, not skip

from helpers.backends import assert_absent_device_is_refused
from helpers.graphs import trace  # noqa: E402
from poot_backend_cuda.executor import CudaExecutor  # noqa: E402
from poot_backend_cuda.plugin import probe  # noqa: E402
from poot_core import (  # noqa: E402
    ModelHandle,
    Node,
    PackedWeight,
    Reason,
    StepShape,
    Unsupported,
    installed_backends,
)

HAS_GPU = probe()


def interpreted_executor() -> CudaExecutor:
    """The executor's binding on the CPU under TRITON_INTERPRET: same kernels, no CUDA graphs."""
    return CudaExecutor.on_interpreter()


# -- everywhere -------------------------------------------------------------------------------------------


def test_registered_with_alias_and_priority():
    spec = next(s for s in installed_backends() if s.name == "cuda")
    assert spec.aliases == ("ptx",) and spec.priority == 40 and spec.distribution == "poot-backend-cuda"
    assert spec.probe() == HAS_GPU


@pytest.mark.skipif(HAS_GPU, reason="checks the refusal on a machine without a GPU")
def test_absent_device_is_refused_by_name():
    assert_absent_device_is_refused("cuda", ("cuda", "ptx"), CudaExecutor)


@pytest.mark.skipif(HAS_GPU, reason="the interpreter path is for machines without a GPU")
def test_qkv_and_gate_up_are_concatenated_into_views(tiny_checkpoint):
    handle = ModelHandle.load(tiny_checkpoint("llama", torch.float32))
    ex = interpreted_executor()
    weights = ex.upload(handle.store())
    ex.prepare(trace(handle, StepShape(1, 1, 32)), weights)
    q = weights.tensors["model.layers.0.self_attn.q_proj.weight"]
    joined = weights.fused[tuple(f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")]
    assert q.untyped_storage().data_ptr() == joined.untyped_storage().data_ptr()
    assert any("gate_proj" in names[0] and "up_proj" in names[1] for names in weights.fused)


def test_prepare_refuses_what_the_kernels_cannot_run(tiny_checkpoint):
    handle = ModelHandle.load(tiny_checkpoint("llama", torch.float32))
    ex = interpreted_executor()
    weights = ex.upload(handle.store())
    graph = trace(handle, StepShape(1, 4, 32))
    node = next(n for n in graph.nodes if n.op == "gated")
    node.attrs["act"] = "gelu"  # erf gelu: no gated kernel for it
    with pytest.raises(Unsupported) as err:
        ex.prepare(graph, weights)
    assert err.value.reason is Reason.OPERATION and err.value.name == "gated:gelu"
    graph = trace(handle, StepShape(1, 4, 32))
    graph.nodes.append(Node("moe", (), "moe99", (1,)))
    with pytest.raises(Unsupported) as err:
        ex.prepare(graph, weights)
    assert err.value.reason is Reason.OPERATION and err.value.name == "moe"
    graph = trace(handle, StepShape(1, 4, 32))
    next(n for n in graph.nodes if n.op == "rope").attrs["style"] = "glm"
    with pytest.raises(Unsupported) as err:
        ex.prepare(graph, weights)
    assert err.value.name == "rope:glm"


def test_upload_refuses_layouts_and_sizes_before_copying():
    class Store:
        def __init__(self, weights):
            self.weights = weights

        def names(self):
            return list(self.weights)

        def get(self, name):
            return self.weights[name]

    ex = interpreted_executor()
    gptq5 = PackedWeight("gptq", (64, 64), {"qweight": torch.zeros(10, 64, dtype=torch.int32)}, {"bits": 5})
    with pytest.raises(Unsupported) as err:
        ex.upload(Store({"layer.weight": gptq5}))
    assert err.value.reason is Reason.QUANTIZATION and "layer.weight" in err.value.name
    ex.memory = lambda: {"total": 1 << 20, "free": 1 << 20}
    with pytest.raises(Unsupported) as err:
        ex.upload(Store({"big.weight": torch.zeros(1024, 1024, dtype=torch.bfloat16)}))
    assert err.value.reason is Reason.CAPACITY


def test_kv_cache_that_does_not_fit_is_refused_at_prepare(tiny_checkpoint):
    handle = ModelHandle.load(tiny_checkpoint("llama", torch.float32))
    ex = interpreted_executor()
    weights = ex.upload(handle.store())
    ex.memory = lambda: {"total": 1 << 30, "free": 1 << 30}  # less than the 1 GiB headroom plus any KV
    with pytest.raises(Unsupported) as err:
        ex.prepare(trace(handle, StepShape(1, 1, 32)), weights)
    assert err.value.reason is Reason.CAPACITY and "KV" in err.value.name
