"""The CPU's C norm and rope for a few tokens, against the torch ops they stand in for."""

from __future__ import annotations

import pytest
import torch

from poot_core.cpu import ops, small_ops
from poot_core.cpu.c_kernels import kernels

pytestmark = pytest.mark.skipif(kernels() is None, reason="no C compiler: the torch route is the only route")


@pytest.mark.parametrize("shape", [(1, 1, 576), (2, 3, 40), (1, 1, 7)])
def test_add_rms_norm_matches_torch(shape):
    g = torch.Generator().manual_seed(shape[-1])
    x, y = torch.randn(*shape, generator=g) * 3, torch.randn(*shape, generator=g)
    w = torch.randn(shape[-1], generator=g)
    total, norm = small_ops.add_rms_norm(x, y, w, 1e-5)
    assert torch.equal(total, x + y)
    assert torch.allclose(norm, ops.rms_norm(x + y, w, 1e-5), rtol=1e-5, atol=1e-6)
    same, alone = small_ops.add_rms_norm(x, None, w, 1e-5)
    assert same is x
    assert torch.allclose(alone, ops.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("dim,head_dim", [(64, 64), (32, 64)])  # whole heads, and partial rotation (phi, glm)
def test_rope_matches_torch(style, dim, head_dim):
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(2, 3, 5, head_dim, generator=g)
    positions = torch.tensor([[0, 1, 2], [700, 701, 702]])
    cos, sin = ops.rope_tables(positions, 10000.0, dim, {})
    ours = small_ops.rope(x, cos, sin, interleaved=style == "interleaved")
    assert torch.allclose(ours, ops.rope(x, cos, sin, style), rtol=1e-6, atol=1e-6)


def test_large_or_non_float32_inputs_are_left_to_torch():
    w = torch.ones(8)
    assert small_ops.add_rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), None, w, 1e-5) is None
    assert small_ops.add_rms_norm(torch.ones(small_ops.MAX_VALUES // 8 + 1, 8), None, w, 1e-5) is None
    x = torch.ones(1, 2, 2, 8).transpose(1, 2)
    cos, sin = ops.rope_tables(torch.tensor([[3, 4]]), 10000.0, 8, {})
    assert not x.is_contiguous() and small_ops.rope(x, cos, sin, interleaved=False) is None
