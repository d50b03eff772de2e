"""The Triton executor under placed drivers (its all_reduce / all_gather handlers): two spawned ranks over gloo,
each running the Triton kernels in Triton's interpreter, against the one-process CPU driver: logits over a
chunked prefill and greedy tokens, tensor parallel and layer pipeline. Two decoder layers (one a stage) keep
the interpreter short; the GPU side (NCCL, a collective inside a captured CUDA graph) is
tests/triton/test_triton_placed_gpu.py."""

from __future__ import annotations

import placed_ranks
import pytest
import torch

from helpers import tiny
from poot_core.distributed import Coordinator

PROMPT = [(5 * i + 11) % 240 + 3 for i in range(12)]  # 2 prefill chunks of 8
NEW = 4


@pytest.mark.interpreter
def test_two_ranks_on_the_triton_executor_equal_one_cpu_process(tmp_path):
    path = tiny.build(tmp_path / "llama", "llama", layers=2)
    jobs = [(placement, str(path), placement, PROMPT, NEW) for placement in ("tensor", "pipeline")]
    results = Coordinator.spawn(2, placed_ranks.logits_and_tokens, jobs, "interpreter", timeout=600.0,
                                collective_timeout=120.0, threads=1)[0]
    logits, tokens = placed_ranks.single(str(path), PROMPT, NEW)
    for placement in ("tensor", "pipeline"):
        got = results[placement]
        assert not isinstance(got, str), got
        # the interpreter's float32 sums in another order than the CPU executor's: the same bound as its other tests
        assert tiny.rel_error(got[0], torch.from_numpy(logits)) <= 1e-4, placement
        assert got[1] == tokens, placement
