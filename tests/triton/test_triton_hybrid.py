"""The hybrid families end to end on the shared Triton executor, against the CPU executor on the same tiny random
float32 checkpoints: every position's logits of a chunked prefill, then greedy decode after it (logits of each
step and the tokens), the recurrent state living on the executor's device.

Without a GPU the executor runs under the Triton interpreter (eager steps); with one, on the GPU with decode steps
replayed as CUDA graphs (the recurrent state is put back after the capture's warm-up runs).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import triton  # noqa: F401 - a test dependency: missing, it must fail, not skip

from helpers import hybrid
from helpers.triton_mode import interpreted
from poot_core import Driver, DriverOptions, ModelHandle, StepShape, open_executor
from poot_kernels_triton.executor import TritonExecutor

# LFM2 (convolutions), Mamba2 (scan only), Granite 4.0-H (scan beside attention), Qwen3-Next (delta rule, gated
# attention); the interpreter is slow, so Bamba and the other Granite / Qwen3-Next variants are left to the CPU
# family tests (they differ in attention and MLP options, not in the recurrent ops)
ARCHS = ["lfm2", "mamba2", "granitemoehybrid", "qwen3next"]
# longer than the prefill chunk (6): two prefill steps, then decode steps (the interpreter is slow: kept short)
PROMPT = [(7 * i + 3) % 250 + 2 for i in range(11)]
CHUNK, STEPS, BOUND = 6, 3, 1e-4


def triton_executor() -> TritonExecutor:
    return TritonExecutor.on_interpreter() if interpreted() else TritonExecutor(0)


def driver(path: Path, executor: object, chunk: int = CHUNK) -> Driver:
    return Driver(ModelHandle.load(path), executor, DriverOptions(capacity=64, prefill_chunk=chunk))


def rel(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_then_greedy_decode_match_cpu(tmp_path_factory, arch):
    """On the Triton executor: every position's logits of a prefill in chunks, then greedy decode steps from the
    state it left on the device. Against one CPU prefill of the whole sequence: all logits within 1e-4, and
    each token the CPU's argmax after the tokens before it (so the tokens are the CPU's greedy ones). Two
    decoder layers, one recurrent and one attention layer (mamba2: two scans): the interpreter's cost is per
    kernel launch."""
    path = hybrid.build(tmp_path_factory.mktemp(arch), arch, torch.float32, layers=2)
    d = driver(path, triton_executor())
    rows = [d.logits(PROMPT)]
    tokens = [int(np.argmax(rows[-1][-1]))]
    for i in range(STEPS - 1):
        rows.append(d.executor.to_numpy(d.step(tokens[-1], len(PROMPT) + i))[0])
        tokens.append(int(np.argmax(rows[-1][-1])))
    ours = np.concatenate(rows)
    whole = driver(path, open_executor("cpu"), chunk=64).logits(PROMPT + tokens[:-1])
    assert ours.shape == whole.shape
    assert rel(ours, whole) <= BOUND
    assert tokens == [int(t) for t in np.argmax(whole[len(PROMPT) - 1 :], axis=-1)]


def test_recurrent_state_is_float32_on_the_executor(hybrid_checkpoint):
    """Recurrent state is kept in float32 beside bf16 KV (it sums the whole past), and counted as such."""
    handle = ModelHandle.load(hybrid_checkpoint("granitemoehybrid", torch.bfloat16))
    ex = triton_executor()
    d = Driver(handle, ex, DriverOptions(capacity=64, prefill_chunk=CHUNK))
    graph = d.program(StepShape(1, 1, 64)).graph
    state = ex.allocate_state(graph)
    kinds = {name: spec.kind for name, spec in graph.state.items()}
    assert {kinds[n] for n, buf in state.items() if buf.dtype == torch.float32} == {"conv", "ssm"}
    assert {kinds[n] for n, buf in state.items() if buf.dtype == torch.bfloat16} == {"k", "v"}
    expected = sum(buf.numel() * buf.element_size() for buf in state.values())
    assert ex.state_bytes(graph, torch.bfloat16) == expected
