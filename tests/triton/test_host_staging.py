"""poot_kernels_triton.host.PinnedStage: arrays that cross to the GPU every step through one kept pinned buffer.
Each put gives the array's values on the device even when the next put rewrites the buffer before the device
has caught up (a long kernel queued ahead), across dtypes and growing sizes. On the CPU a put is the array."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from poot_kernels_triton.host import PinnedStage


def test_on_the_cpu_a_put_is_the_array():
    array = np.arange(6, dtype=np.int32).reshape(2, 3)
    out = PinnedStage(torch.device("cpu")).put(array)
    assert out.dtype == torch.int32 and out.tolist() == array.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_puts_behind_a_busy_stream_keep_their_values():
    device = torch.device("cuda")
    stage = PinnedStage(device)
    rng = np.random.default_rng(0)
    big = torch.randn(4096, 4096, device=device)
    sent, got = [], []
    for i in range(12):
        for _ in range(4):  # keep the stream busy so that the copies queue behind it
            big = big @ big
            big /= big.norm()
        array = rng.integers(-2**31, 2**31 - 1, size=(8 + 40 * i, 4008), dtype=np.int64)
        array = array.astype(np.int32 if i % 2 else np.int64)
        sent.append(array)
        got.append(stage.put(array))
    torch.cuda.synchronize()
    for array, out in zip(sent, got, strict=True):
        assert out.device.type == "cuda" and out.cpu().numpy().dtype == array.dtype
        np.testing.assert_array_equal(out.cpu().numpy(), array)
