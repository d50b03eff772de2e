"""A CPU step of up to DECODE_ROWS tokens (a speculative verify step) computes every position as a decode step
does: the logits of each position are bit for bit those of one-token steps, for SmolLM2 in bf16 (the 16-bit
product) and in its Q4_1 GGUF file (the packed decode kernel), so greedy speculation cannot part from plain
decoding at a near tie."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import smollm
from poot_core import Driver, DriverOptions, ModelHandle, open_executor
from poot_core.cpu.c_kernels import kernels
from poot_core.cpu.packed_linear import DECODE_ROWS

pytestmark = pytest.mark.skipif(kernels() is None, reason="no C compiler: the torch route is the only route")


@pytest.mark.parametrize("layout", ["bf16", "q4_1"])
def test_verify_sized_steps_give_the_bits_of_decode_steps(layout: str) -> None:
    path = smollm.safetensors_copy(torch.bfloat16) if layout == "bf16" else smollm.gguf_path()
    handle = ModelHandle.load(path)
    ids = handle.text().encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
                               "fibonacci(n - 2)\n\nprint(fibonacci(10))")
    ids = (ids * 3)[: 2 * DECODE_ROWS + 3]  # two full steps of DECODE_ROWS tokens, then a shorter one

    def logits(chunk: int) -> np.ndarray:
        options = DriverOptions(capacity=64, prefill_chunk=chunk)
        return Driver(handle, open_executor("cpu"), options).logits(ids)

    one_by_one = logits(1)  # every position a decode step
    for chunk in (DECODE_ROWS, 9):  # steps of 16 tokens; of 9 (a verify of 8 proposed tokens)
        np.testing.assert_array_equal(logits(chunk).view(np.uint32), one_by_one.view(np.uint32), err_msg=str(chunk))
    # Longer steps are prefill chunks: another order of sums (the prefill kernels), the same logits up to rounding.
    longer = logits(DECODE_ROWS + 1)
    assert not np.array_equal(longer, one_by_one)
    assert np.abs(longer - one_by_one).max() < 0.1 * np.abs(one_by_one).max()
