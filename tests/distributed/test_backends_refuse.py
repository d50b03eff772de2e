"""The collective ops exist on the CPU and Triton executors: the Vulkan executor refuses a tensor-parallel step
by the op's name, before any work, and the Triton executor lists them."""

from __future__ import annotations

import pytest

from poot_core import ModelHandle, StepShape
from poot_core.driver.core import trace_step
from poot_core.errors import Reason, Unsupported
from poot_core.executor import Capabilities, require_ops
from poot_core.graph import passes
from poot_core.graph import tensor_parallel as tp


def test_vulkan_refuses_the_collectives_by_name_and_triton_has_them(tiny_checkpoint):
    from poot_backend_vulkan.program import VULKAN_OPS
    from poot_kernels_triton.executor import TRITON_OPS

    graph = trace_step(ModelHandle.load(tiny_checkpoint("llama")), StepShape(1, 1, 32))
    local, _ = tp.shard(graph, 0, 2, "g")
    assert passes.DISTRIBUTED_OPS <= local.ops()
    assert passes.DISTRIBUTED_OPS <= TRITON_OPS
    assert not passes.DISTRIBUTED_OPS & VULKAN_OPS
    with pytest.raises(Unsupported) as err:
        require_ops(local, Capabilities(VULKAN_OPS, frozenset()), "vulkan")
    assert err.value.reason is Reason.OPERATION and err.value.name in passes.DISTRIBUTED_OPS
