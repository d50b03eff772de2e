"""The Triton executor's step sizes and state bytes: the serving KV pool is sized with the bytes its state really
takes (the model's 16-bit type, not float32), and a GPU gets GPU-sized steps while the interpreter keeps the
core's CPU-sized ones. Runs in Triton's interpreter without a GPU, on the GPU with one."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401 - a test dependency: missing, it must fail, not skip

from helpers.triton_mode import interpreted
from poot_core import Driver, DriverOptions, Layout, ModelHandle, RunDefaults
from poot_kernels_triton.executor import TritonExecutor


def _executor() -> TritonExecutor:
    return TritonExecutor.on_interpreter() if interpreted() else TritonExecutor(0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pool_estimate_uses_the_bytes_the_state_takes(tiny_checkpoint, dtype):
    executor = _executor()
    driver = Driver(ModelHandle.load(tiny_checkpoint("llama", dtype)), executor,
                    DriverOptions(capacity=64, kv_blocks=12))
    engine = driver.serve(Layout.PAGED)
    graph = engine.driver._trace(engine._shape(1, 1))
    allocated = sum(t.numel() * t.element_size() for t in engine._state.values())
    assert executor.state_nbytes(graph, driver.weights) == allocated
    assert allocated == sum(torch.Size(s.shape).numel() for s in graph.state.values()) * dtype.itemsize


def test_gpu_steps_are_gpu_sized_and_the_interpreter_keeps_the_cpu_ones():
    gpu = TritonExecutor.run_defaults
    assert gpu.step_tokens >= 2048 and gpu.prefill_chunk >= 2048 and gpu.max_running >= 256
    if interpreted():
        assert _executor().capabilities().defaults == RunDefaults()
    else:
        assert _executor().capabilities().defaults == gpu
