"""Gated activations: silu(gate) * up and gelu_tanh(gate) * up (MLPs), sigmoid(gate) * up (gated attention's
output gate)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from poot_core.errors import Reason, Unsupported

from .launch import cdiv, check_dims, check_float, launch, require, unit_stride_last
from .tuning import Tile, tuning_for_device

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "sigmoid": 2}


@triton.jit
def _tanh(x):
    # vendor-neutral tanh: 2 * sigmoid(2x) - 1
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _gated_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    n,
    gate_stride,
    up_stride,
    out_stride,
    KIND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(gate_ptr + row * gate_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * up_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if KIND == 0:
        a = g * tl.sigmoid(g)
    elif KIND == 2:
        a = tl.sigmoid(g)
    else:
        a = 0.5 * g * (1.0 + _tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
    tl.store(out_ptr + row * out_stride + cols, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


def gated_activation(gate: torch.Tensor, up: torch.Tensor | None = None, *, kind: str = "silu") -> torch.Tensor:
    """act(gate) * up, with act "silu", "gelu_tanh" (gelu with the tanh approximation) or "sigmoid".

    gate, up: [rows, n] float32/float16/bfloat16. When `up` is None, `gate` is [rows, 2n] holding the gate
    in its first half and up in its second (a fused gate/up projection). Returns [rows, n] in gate's dtype.
    """
    if kind not in ACTIVATIONS:
        raise Unsupported(Reason.OPERATION, f"gated_activation:{kind}", f"known: {sorted(ACTIVATIONS)}")
    check_dims("gate", gate, 2)
    check_float("gate", gate)
    gate = unit_stride_last(gate)
    if up is None:
        require(gate.shape[1] % 2 == 0, f"fused gate/up width {gate.shape[1]} is odd")
        n = gate.shape[1] // 2
        gate, up = gate[:, :n], gate[:, n:]
    else:
        check_dims("up", up, 2)
        require(up.shape == gate.shape, f"up shape {tuple(up.shape)} != gate shape {tuple(gate.shape)}")
        up = unit_stride_last(up)
    rows, n = gate.shape
    out = torch.empty((rows, n), dtype=gate.dtype, device=gate.device)
    tuning = tuning_for_device(gate.device)
    block = 256 if tuning.backend == "interpreter" else 1024
    launch(
        _gated_kernel,
        (rows, cdiv(n, block)),
        Tile(num_warps=min(4, tuning.row_warps), num_stages=1),
        gate_ptr=gate,
        up_ptr=up,
        out_ptr=out,
        n=n,
        gate_stride=gate.stride(0),
        up_stride=up.stride(0),
        out_stride=out.stride(0),
        KIND=ACTIVATIONS[kind],
        BLOCK=block,
    )
    return out
