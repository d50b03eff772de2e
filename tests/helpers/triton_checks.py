"""What the Triton kernel tests measure results with: the relative error in float64, and the split-K counters
that every GEMV launch must leave at zero (tests/triton/conftest.py forces the GEMV tiles)."""

from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| (Frobenius norms), in float64."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def counters_are_zero() -> bool:
    """Whether every split-K counter buffer is back to zero (the last program of a tile resets its counter)."""
    from poot_kernels_triton import splitk

    return all(int(buf.abs().sum()) == 0 for buf in splitk._COUNTERS.values())
