"""RMSNorm (with the residual add before it), rope and silu(gate) * up in C.

At decode these ops touch a few KB, so torch's per-call cost (several small ops each, about 8-11 us per call
for SmolLM2) outweighs the arithmetic many times over; one C call costs about 2 us. At prefill one pass over
the rows on every core replaces several torch passes over memory. The arithmetic is the float32 arithmetic of
ops.rms_norm, ops.rope and ops.gated (the order of the sum of squares differs, and silu's exp is the
2-ulp exp16 of csrc/common.h). The C is csrc/small_ops.c. Each function returns None where it does not apply,
and the caller uses torch.
"""

from __future__ import annotations

import torch

from poot_core.cpu.c_kernels import kernels


def _fits(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x + y, rms_norm(x + y) * w) for float32 x, y [..., n] and a float32 scale w [n]; with y None the first
    value is x itself. None where the C route does not apply."""
    lib = kernels()
    if lib is None or not _fits(x, w) or (y is not None and (not _fits(y) or y.shape != x.shape)):
        return None
    n = x.shape[-1]
    total = torch.empty_like(x) if y is not None else x
    norm = torch.empty_like(x)
    lib.poot_add_rms_norm(x.data_ptr(), None if y is None else y.data_ptr(), w.data_ptr(), x.numel() // n, n, eps,
                          total.data_ptr(), norm.data_ptr(), torch.get_num_threads())
    return total, norm


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor | None:
    """x [R, T, H, Dh] rotated by cos, sin [R, T, 1, half] (as ops.rope_tables gives them); None where the C
    route does not apply."""
    lib = kernels()
    if lib is None or x.dim() != 4 or x.dtype != torch.float32 or not _fits(cos, sin):
        return None
    rows, tokens, heads, head_dim = x.shape
    # each token's heads lie together; tokens may lie apart (q or k inside a joined q/k/v product)
    if x.stride(3) != 1 or x.stride(2) != head_dim or (rows > 1 and x.stride(0) != tokens * x.stride(1)):
        return None
    half = cos.shape[-1]
    out = torch.empty(x.shape)
    lib.poot_rope(x.data_ptr(), x.stride(1), rows * tokens, heads, head_dim, half, cos.data_ptr(), sin.data_ptr(),
                  int(interleaved), out.data_ptr(), torch.get_num_threads())
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for float32 [..., n] tensors whose rows may lie apart (views into one joined gate/up
    product, each row's n values contiguous); None where the C route does not apply."""
    lib = kernels()
    if (lib is None or gate.dtype != torch.float32 or up.dtype != torch.float32 or gate.shape != up.shape
            or gate.dim() < 2):
        return None
    n = gate.shape[-1]
    g, u = gate.reshape(-1, n), up.reshape(-1, n)  # views where the leading dimensions allow it
    if g.stride(1) != 1 or u.stride(1) != 1:
        return None
    out = torch.empty(gate.shape)
    lib.poot_silu_mul(g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), g.shape[0], n, out.data_ptr(),
                      torch.get_num_threads())
    return out
