"""Split-K for GEMVs: several programs share one output tile, each reducing its own slice of k.

A decode GEMV whose output is narrow (4096 wide) has too few tiles to keep enough loads in flight on a large
GPU; splitting k multiplies the programs. Each program stores its float32 partial sums, then bumps a counter
for its tile; the program that arrives last adds the partials in a fixed order (so results do not depend on
arrival order), writes the output and puts the counter back to zero for the next launch. One kernel, no
memset, replay-safe inside a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import cdiv
from .tuning import Tile, Tuning

# counters per device, all zero between launches (the last program of each tile resets its own)
_COUNTERS: dict[torch.device, torch.Tensor] = {}
MAX_SPLIT = 64


def counters(device: torch.device, size: int) -> torch.Tensor | None:
    """A zeroed int32 buffer of at least `size` counters on `device`, kept for the process; None when a
    larger one is needed while a CUDA graph is being captured (no allocation may happen then)."""
    buf = _COUNTERS.get(device)
    if buf is not None and buf.numel() >= size:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    buf = torch.zeros(max(size, 1 << 16), dtype=torch.int32, device=device)
    _COUNTERS[device] = buf
    return buf


def choose_split(tile: Tile, tiles: int, steps: int, tuning: Tuning, programs: int = 0) -> int:
    """How many programs share each of `tiles` output tiles whose k loop has `steps` steps: the tile's own
    split_k when set, else enough to reach `programs` (default: the tuning's gemv_programs), at least one
    step each."""
    if tile.split_k:
        return max(1, min(tile.split_k, steps, MAX_SPLIT))
    programs = programs or tuning.gemv_programs
    if programs <= 0 or tiles >= programs:
        return 1
    return max(1, min(cdiv(programs, tiles), steps, MAX_SPLIT))


def steps_per_split(steps: int, split: int) -> int:
    """k steps each program takes (the last may take fewer); the split count actually used is
    cdiv(steps, steps_per_split), never a program with nothing to do."""
    return cdiv(steps, split)


@triton.jit
def finish_split(
    acc,
    offs_n,
    nmask,
    b_ptr,
    o_ptr,
    o_stride,
    part_ptr,
    lock_ptr,
    n,
    n_tiles,
    split,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Write acc (float32 [BLOCK_N], this program's share of output row program_id(1)) to the output, adding
    the bias; with SPLIT, through the partial buffer [split, rows, n] and the tile's counter."""
    row = tl.program_id(1).to(tl.int64)
    if SPLIT:
        rows = tl.num_programs(1)
        pid_k = tl.program_id(2)
        tl.store(part_ptr + (pid_k * rows + row) * n + offs_n, acc, mask=nmask)
        # every thread's partial is stored before the counter moves (the atomic is one thread's, releasing)
        tl.debug_barrier()
        lock = lock_ptr + row * n_tiles + tl.program_id(0)
        arrived = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
        if arrived == split - 1:
            # the partials 8 at a time, each 8 loaded together (one wait each, not one per partial), summed in
            # a fixed order
            total = tl.zeros([BLOCK_N], tl.float32)
            ss = tl.arange(0, 8)
            for s0 in range(0, split, 8):
                m2 = ((s0 + ss) < split)[:, None] & nmask[None, :]
                at = part_ptr + ((s0 + ss)[:, None] * rows + row) * n + offs_n[None, :]
                total += tl.sum(tl.load(at, mask=m2, other=0.0, cache_modifier=".cg"), axis=0)
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
            tl.store(o_ptr + row * o_stride + offs_n, total.to(o_ptr.dtype.element_ty), mask=nmask)
            tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
        tl.store(o_ptr + row * o_stride + offs_n, acc.to(o_ptr.dtype.element_ty), mask=nmask)


def split_buffers(
    split: int, rows: int, n: int, tiles: int, device: torch.device
) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
    """(split, partials, counters) for a launch: split drops to 1 when no counters can be had now."""
    if split <= 1:
        return 1, None, None
    locks = counters(device, rows * tiles)
    if locks is None:
        return 1, None, None
    return split, torch.empty((split, rows, n), dtype=torch.float32, device=device), locks
