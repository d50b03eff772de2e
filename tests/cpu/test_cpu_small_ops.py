"""The CPU's C norm and rope for a few tokens, against the torch ops they stand in for."""

from __future__ import annotations

import pytest
import torch

from poot_core.cpu import ops, small_ops
from poot_core.cpu.c_kernels import kernels

pytestmark = pytest.mark.skipif(kernels() is None, reason="no C compiler: the torch route is the only route")


@pytest.mark.parametrize("shape", [(1, 1, 576), (2, 3, 40), (1, 1, 7), (1, 300, 96)])  # the last: rows in threads
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
@pytest.mark.parametrize("tokens", [3, 40])
def test_rope_matches_torch(style, dim, head_dim, tokens):
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(2, tokens, 5, head_dim, generator=g)
    positions = torch.stack([torch.arange(tokens), 700 + torch.arange(tokens)])
    cos, sin = ops.rope_tables(positions, 10000.0, dim, {})
    ours = small_ops.rope(x, cos, sin, interleaved=style == "interleaved")
    assert torch.allclose(ours, ops.rope(x, cos, sin, style), rtol=1e-6, atol=1e-6)
    # q as a view into a joined q/k/v product: tokens lie apart
    joined = torch.randn(2, tokens, 5 * head_dim + 7, generator=g)
    q = joined[..., : 5 * head_dim].reshape(2, tokens, 5, head_dim)
    assert not q.is_contiguous()
    ours = small_ops.rope(q, cos, sin, interleaved=style == "interleaved")
    assert torch.allclose(ours, ops.rope(q, cos, sin, style), rtol=1e-6, atol=1e-6)


def test_large_or_non_float32_inputs_are_left_to_torch():
    w = torch.ones(8)
    assert small_ops.add_rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), None, w, 1e-5) is None
    assert small_ops.silu_mul(torch.ones(2, 8), torch.ones(2, 8, dtype=torch.bfloat16)) is None
    assert small_ops.silu_mul(torch.ones(8, 2).T, torch.ones(2, 8)) is None  # values of a row not contiguous
    x = torch.ones(1, 2, 2, 8).transpose(1, 2)  # heads of one token not side by side
    cos, sin = ops.rope_tables(torch.tensor([[3, 4]]), 10000.0, 8, {})
    assert small_ops.rope(x, cos, sin, interleaved=False) is None


@pytest.mark.parametrize("rows,n", [(1, 1536), (5, 37), (200, 64)])
def test_silu_mul_matches_torch_on_views_of_a_joined_product(rows, n):
    g = torch.Generator().manual_seed(rows)
    joined = torch.randn(1, rows, 2 * n, generator=g) * 6  # gate and up side by side, as the fused product gives
    gate, up = joined.split(n, dim=-1)
    ours = small_ops.silu_mul(gate, up)
    assert ours.shape == gate.shape
    assert torch.allclose(ours, ops.gated(gate, up, "silu"), rtol=1e-6, atol=1e-6)
