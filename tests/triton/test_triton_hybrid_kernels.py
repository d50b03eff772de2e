"""The recurrent kernels of poot_kernels_triton.recurrent under the Triton interpreter, against the CPU executor's
handlers (poot_core.cpu.recurrent) on fresh random float32 inputs: outputs and the state each leaves behind.

Inputs are views into one joined projection (as the hybrid families slice them), the states start from random
values (a step in the middle of a sequence), and the multi-token steps span more than one of the kernels' chunks.
"""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401 - a test dependency: missing, it must fail, not skip

from helpers.triton_checks import rel_err
from poot_core.cpu import recurrent as cpu
from poot_kernels_triton import recurrent

pytestmark = pytest.mark.interpreter  # kernels on CPU tensors

BOUND = 2e-5  # float32 throughout; the chunked sums differ from the CPU's in order only
TOKENS = [1, 5, recurrent.CHUNK + 7]  # decode, one chunk, two chunks


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def views(rows: int, tokens: int, *widths: int) -> list[torch.Tensor]:
    """Random [rows, tokens, width] views side by side in one joined tensor (strided, last axis contiguous)."""
    joined = torch.randn(rows, tokens, sum(widths) + 3)
    out, start = [], 0
    for width in widths:
        out.append(joined[..., start : start + width])
        start += width
    return out


@pytest.mark.parametrize("tokens", [1, 2, 9, recurrent.CHUNK + 7])  # one launch; two token tiles, then the window
@pytest.mark.parametrize("kernel,bias,act", [(4, True, "silu"), (3, False, None), (1, True, None)])
def test_short_conv_matches_cpu(tokens: int, kernel: int, bias: bool, act: str | None) -> None:
    rows, channels = 2, 40
    (x,) = views(rows, tokens, channels)
    w = torch.randn(channels, kernel)
    b = torch.randn(channels) if bias else None
    window = torch.randn(rows, channels, kernel - 1)
    ref_window = window.clone()
    ref = cpu.short_conv(x, w, b, ref_window, act)
    out = recurrent.short_conv(x, w, b, window, silu=act == "silu")
    assert out.dtype == torch.float32 and rel_err(out, ref) <= BOUND
    assert torch.allclose(window, ref_window, rtol=0, atol=0)  # the last inputs, copied


def ssm_inputs(rows: int, tokens: int, heads: int, head_dim: int, groups: int, nstate: int) -> dict:
    x, dt, b, c = views(rows, tokens, heads * head_dim, heads, groups * nstate, groups * nstate)
    return dict(x=x.reshape(rows, tokens, heads, head_dim), dt=dt, b=b.reshape(rows, tokens, groups, nstate),
                c=c.reshape(rows, tokens, groups, nstate), a_log=torch.rand(heads) * 2 - 1, d=torch.randn(heads),
                dt_bias=torch.randn(heads) * 0.5, state=torch.randn(rows, heads, head_dim, nstate))


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("limit", [(0.0, float("inf")), (0.01, 0.5)])
def test_ssm_scan_matches_cpu(tokens: int, limit: tuple[float, float]) -> None:
    """8 heads of 24 values (a tile and a part) in 2 groups, a state of 12 (under one tile)."""
    a = ssm_inputs(2, tokens, 8, 24, 2, 12)
    ref_state = a["state"].clone()
    ref = cpu.ssm_scan(a["x"], a["dt"], a["a_log"], a["b"], a["c"], a["d"], a["dt_bias"], ref_state, 8, limit)
    out = recurrent.ssm_scan(a["x"], a["dt"], a["a_log"], a["b"], a["c"], a["d"], a["dt_bias"], a["state"], limit)
    assert rel_err(out, ref) <= BOUND
    assert rel_err(a["state"], ref_state) <= BOUND


@pytest.mark.parametrize("heads,head_dim,groups,nstate", [(8, 16, 2, 16), (6, 5, 6, 12), (4, 64, 2, 128)])
def test_ssm_step_tiles_match_cpu(heads: int, head_dim: int, groups: int, nstate: int) -> None:
    """The one-token step over state tiles of several heads a program (4 heads of 16 in each of 2 groups), of one
    row a program (groups of one head of 5), and of one head of 64 x 128 (the tile's cap)."""
    a = ssm_inputs(3, 1, heads, head_dim, groups, nstate)
    ref_state = a["state"].clone()
    limit = (0.01, 0.5)
    ref = cpu.ssm_scan(a["x"], a["dt"], a["a_log"], a["b"], a["c"], a["d"], a["dt_bias"], ref_state, 8, limit)
    out = recurrent.ssm_scan(a["x"], a["dt"], a["a_log"], a["b"], a["c"], a["d"], a["dt_bias"], a["state"], limit)
    assert rel_err(out, ref) <= BOUND
    assert rel_err(a["state"], ref_state) <= BOUND


def test_ssm_recurrence_over_several_tokens_equals_the_chunked_form() -> None:
    a = ssm_inputs(1, 11, 4, 16, 1, 16)
    other = a["state"].clone()
    args = (a["x"], a["dt"], a["a_log"], a["b"], a["c"], a["d"], a["dt_bias"])
    stepped = recurrent.ssm_scan(*args, a["state"], (0.0, float("inf")), chunked=False)
    chunked = recurrent.ssm_scan(*args, other, (0.0, float("inf")), chunked=True)
    assert rel_err(stepped, chunked) <= BOUND and rel_err(a["state"], other) <= BOUND


def delta_inputs(rows: int, tokens: int, k_heads: int, v_heads: int, k_dim: int, v_dim: int) -> dict:
    q, k, v, a, b = views(rows, tokens, k_heads * k_dim, k_heads * k_dim, v_heads * v_dim, v_heads, v_heads)
    return dict(q=q.reshape(rows, tokens, k_heads, k_dim), k=k.reshape(rows, tokens, k_heads, k_dim),
                v=v.reshape(rows, tokens, v_heads, v_dim), a=a, b=b, a_log=torch.rand(v_heads) * 2 - 1,
                dt_bias=torch.randn(v_heads) * 0.5, state=torch.randn(rows, v_heads, k_dim, v_dim) * 0.3)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("k_heads,v_heads,k_dim,v_dim", [(2, 4, 16, 8), (1, 1, 20, 24)])
def test_gated_delta_matches_cpu(tokens: int, k_heads: int, v_heads: int, k_dim: int, v_dim: int) -> None:
    a = delta_inputs(2, tokens, k_heads, v_heads, k_dim, v_dim)
    ref_state = a["state"].clone()
    ref = cpu.gated_delta(a["q"], a["k"], a["v"], a["a"], a["b"], a["a_log"], a["dt_bias"], ref_state, 8, 1e-6)
    out = recurrent.gated_delta(a["q"], a["k"], a["v"], a["a"], a["b"], a["a_log"], a["dt_bias"], a["state"], 1e-6)
    assert rel_err(out, ref) <= BOUND
    assert rel_err(a["state"], ref_state) <= BOUND


def test_delta_recurrence_over_several_tokens_equals_the_chunked_form() -> None:
    a = delta_inputs(1, 9, 2, 4, 16, 16)
    other = a["state"].clone()
    args = (a["q"], a["k"], a["v"], a["a"], a["b"], a["a_log"], a["dt_bias"])
    stepped = recurrent.gated_delta(*args, a["state"], 1e-6, chunked=False)
    chunked = recurrent.gated_delta(*args, other, 1e-6, chunked=True)
    assert rel_err(stepped, chunked) <= BOUND and rel_err(a["state"], other) <= BOUND


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("group", [24, 96])
def test_gated_rms_norm_matches_cpu(norm_first: bool, group: int) -> None:
    x, gate = views(3, 2, 96, 96)
    w = torch.randn(96)
    ref = cpu.gated_rms_norm(x, gate, w, 1e-5, group, norm_first)
    out = recurrent.gated_rms_norm(x.reshape(-1, 96), gate.reshape(-1, 96), w, 1e-5, group, norm_first)
    assert rel_err(out.reshape(ref.shape), ref) <= BOUND
