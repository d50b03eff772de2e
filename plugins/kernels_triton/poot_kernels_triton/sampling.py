"""Token choice on the device: greedy argmax, and temperature / top-k / top-p / min-p sampling.

Sampling never sorts the vocabulary. Each filter keeps the tokens whose scaled logit is at least a
threshold, so the kept set is {z >= max(thresholds)}. The top-k and top-p thresholds are found exactly by
a binary search over the 32-bit order-preserving integer key of the float logits (32 passes over the row).
The token is then drawn by inverse CDF in vocabulary order from one uniform number per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import check_dims, check_float, check_same_device, launch, require
from .tuning import Tile, tuning_for_device


@triton.jit
def _argmax_kernel(logits_ptr, out_ptr, vocab, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    best = tl.full([1], float("-inf"), tl.float32)
    best_i = tl.full([1], 0, tl.int64)
    best_v = tl.max(best, axis=0)
    best_idx = tl.max(best_i, axis=0)
    for v0 in range(0, vocab, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row * stride + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        # first index holding the block's maximum, so ties go to the lowest id like torch.argmax
        i = tl.min(tl.where(x == m, offs, vocab), axis=0).to(tl.int64)
        take = m > best_v
        best_idx = tl.where(take, i, best_idx)
        best_v = tl.where(take, m, best_v)
    tl.store(out_ptr + row, best_idx)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Argmax of each row. logits: [rows, vocab] float32/float16/bfloat16. Returns int64 [rows] (lowest id on
    ties; a row of all -inf gives 0)."""
    check_dims("logits", logits, 2)
    check_float("logits", logits)
    require(logits.stride(1) == 1, "logits need a contiguous last dimension")
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    tuning = tuning_for_device(logits.device)
    block = 256 if tuning.backend == "interpreter" else 2048
    launch(
        _argmax_kernel,
        (rows,),
        Tile(num_warps=min(8, tuning.row_warps), num_stages=1),
        logits_ptr=logits,
        out_ptr=out,
        vocab=vocab,
        stride=logits.stride(0),
        BLOCK=block,
    )
    return out


@triton.jit
def _key(z):
    """Order-preserving int32 key of float32 values (negative floats get their magnitude bits flipped)."""
    bits = z.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _load_scaled(logits_ptr, offs, vocab, inv_t):
    x = tl.load(logits_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    return x * inv_t


@triton.jit
def _mass_from(logits_ptr, vocab, inv_t, zmax, t_key, BLOCK: tl.constexpr):
    """(count, sum of exp(z - zmax)) over tokens whose key is >= t_key."""
    count = tl.sum(tl.zeros([1], tl.int32), axis=0)
    mass = tl.sum(tl.zeros([1], tl.float32), axis=0)
    for v0 in range(0, vocab, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        z = _load_scaled(logits_ptr, offs, vocab, inv_t)
        keep = (offs < vocab) & (_key(z) >= t_key)
        count += tl.sum(keep.to(tl.int32), axis=0)
        mass += tl.sum(tl.where(keep, tl.exp(z - zmax), 0.0), axis=0)
    return count, mass


@triton.jit
def _sample_kernel(
    logits_ptr,
    out_ptr,
    uniform_ptr,
    temp_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    vocab,
    stride,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride
    temperature = tl.load(temp_ptr + row).to(tl.float32)
    top_k = tl.load(top_k_ptr + row).to(tl.int32)
    top_p = tl.load(top_p_ptr + row).to(tl.float32)
    min_p = tl.load(min_p_ptr + row).to(tl.float32)
    u = tl.load(uniform_ptr + row).to(tl.float32)
    greedy = temperature <= 0.0
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, temperature))

    # pass 1: the largest scaled logit and its first index, and the smallest finite one (search bounds)
    zmax = tl.sum(tl.zeros([1], tl.float32), axis=0) + float("-inf")
    argmax = tl.sum(tl.zeros([1], tl.int64), axis=0)
    kmin = tl.sum(tl.zeros([1], tl.int32), axis=0) + 0x7FFFFFFF
    for v0 in range(0, vocab, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        z = _load_scaled(row_ptr, offs, vocab, inv_t)
        m = tl.max(z, axis=0)
        i = tl.min(tl.where(z == m, offs, vocab), axis=0).to(tl.int64)
        argmax = tl.where(m > zmax, i, argmax)
        zmax = tl.maximum(zmax, m)
        kmin = tl.minimum(kmin, tl.min(tl.where(offs < vocab, _key(z), 0x7FFFFFFF), axis=0))
    kmax = _key(zmax)

    # top-k: the largest key t with count(key >= t) >= top_k
    threshold = kmin
    if top_k > 0:
        if top_k < vocab:
            lo = kmin.to(tl.int64)
            hi = kmax.to(tl.int64)
            for _ in range(32):
                mid = lo + (hi - lo + 1) // 2
                c, _m = _mass_from(row_ptr, vocab, inv_t, zmax, mid.to(tl.int32), BLOCK)
                ok = c >= top_k
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid - 1)
            threshold = lo.to(tl.int32)

    # top-p over the top-k survivors: the largest key t with mass(key >= t) >= top_p * mass(survivors)
    if top_p < 1.0:
        _c, total = _mass_from(row_ptr, vocab, inv_t, zmax, threshold, BLOCK)
        lo = threshold.to(tl.int64)
        hi = kmax.to(tl.int64)
        for _ in range(32):
            mid = lo + (hi - lo + 1) // 2
            _c, mass = _mass_from(row_ptr, vocab, inv_t, zmax, mid.to(tl.int32), BLOCK)
            ok = mass >= top_p * total
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        threshold = lo.to(tl.int32)

    # min-p: probability at least min_p times the largest, i.e. z >= zmax + log(min_p)
    if min_p > 0.0:
        threshold = tl.maximum(threshold, _key(zmax + tl.log(min_p)))
    threshold = tl.minimum(threshold, kmax)  # the best token always survives

    # draw: first token in vocabulary order whose running kept mass exceeds u * kept mass
    _c, kept = _mass_from(row_ptr, vocab, inv_t, zmax, threshold, BLOCK)
    target = u * kept
    running = tl.sum(tl.zeros([1], tl.float32), axis=0)
    chosen = tl.sum(tl.zeros([1], tl.int64), axis=0) - 1
    last_kept = argmax
    for v0 in range(0, vocab, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        z = _load_scaled(row_ptr, offs, vocab, inv_t)
        keep = (offs < vocab) & (_key(z) >= threshold)
        p = tl.where(keep, tl.exp(z - zmax), 0.0)
        cum = running + tl.cumsum(p, axis=0)
        hit = keep & (cum > target)
        first = tl.min(tl.where(hit, offs, vocab), axis=0).to(tl.int64)
        chosen = tl.where((chosen < 0) & (first < vocab), first, chosen)
        last_kept = tl.maximum(last_kept, tl.max(tl.where(keep, offs, -1), axis=0).to(tl.int64))
        running = running + tl.sum(p, axis=0)
    # rounding can leave u * kept past the final running sum: take the last kept token then
    chosen = tl.where(chosen < 0, last_kept, chosen)
    tl.store(out_ptr + row, tl.where(greedy, argmax, chosen))


def _per_row(value: float | int | torch.Tensor, rows: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        require(value.shape == (rows,), f"per-row sampling parameter must be [{rows}], got {tuple(value.shape)}")
        return value.to(device=device, dtype=dtype).contiguous()
    return torch.full((rows,), value, dtype=dtype, device=device)


def sample(
    logits: torch.Tensor,
    uniform: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor = 0,
    top_p: float | torch.Tensor = 1.0,
    min_p: float | torch.Tensor = 0.0,
) -> torch.Tensor:
    """Draw one token per row, in the order temperature, top-k, top-p, min-p (as transformers applies them).

    logits: [rows, vocab] float32/float16/bfloat16. uniform: float32 [rows] in [0, 1), one draw per row
    (e.g. torch.rand on the device with the request's generator). Each setting is a number for every row
    or a [rows] tensor: temperature (<= 0 means greedy for that row), top_k (0 = off), top_p (1.0 = off),
    min_p (0.0 = off). Tokens tied at a threshold are all kept. Returns int64 [rows].
    """
    check_dims("logits", logits, 2)
    check_float("logits", logits)
    require(logits.stride(1) == 1, "logits need a contiguous last dimension")
    rows, vocab = logits.shape
    check_dims("uniform", uniform, 1)
    check_same_device(logits, uniform)
    require(uniform.shape == (rows,), f"uniform must be [{rows}]")
    for name, value, low, high in (("top_p", top_p, 0.0, 1.0), ("min_p", min_p, 0.0, 1.0)):
        if not isinstance(value, torch.Tensor):
            require(low <= value <= high, f"{name} must be in [{low}, {high}], got {value}")
    if not isinstance(top_k, torch.Tensor):
        require(top_k >= 0, f"top_k must be >= 0, got {top_k}")
    device = logits.device
    out = torch.empty(rows, dtype=torch.int64, device=device)
    tuning = tuning_for_device(device)
    block = 256 if tuning.backend == "interpreter" else 2048
    launch(
        _sample_kernel,
        (rows,),
        Tile(num_warps=min(8, tuning.row_warps), num_stages=1),
        logits_ptr=logits,
        out_ptr=out,
        uniform_ptr=uniform.to(torch.float32).contiguous(),
        temp_ptr=_per_row(temperature, rows, torch.float32, device),
        top_k_ptr=_per_row(top_k, rows, torch.int32, device),
        top_p_ptr=_per_row(top_p, rows, torch.float32, device),
        min_p_ptr=_per_row(min_p, rows, torch.float32, device),
        vocab=vocab,
        stride=logits.stride(0),
        BLOCK=block,
    )
    return out


@triton.jit
def _bitmask_kernel(logits_ptr, bits_ptr, rows_ptr, vocab, stride, words, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    word = tl.load(bits_ptr + i * words + offs // 32, mask=inside, other=-1)
    refused = ((word >> (offs % 32)) & 1) == 0
    row = tl.load(rows_ptr + i)
    ninf = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride + offs, ninf, mask=inside & refused)  # allowed tokens are not touched


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """In the logits [R, vocab], every token of row rows[i] whose bit is 0 in bitmask[i] (int32 [n, words], bit b
    of word w is token 32 w + b) set to -inf, in place; only refused tokens are written. rows: int64 [n] in
    0..R-1. Returns the logits."""
    check_dims("logits", logits, 2)
    check_float("logits", logits)
    require(logits.stride(1) == 1, "logits need a contiguous last dimension")
    check_dims("bitmask", bitmask, 2)
    require(bitmask.dtype == torch.int32 and bitmask.is_contiguous(), "bitmask must be contiguous int32")
    check_same_device(logits, bitmask)
    check_same_device(logits, rows)
    n, words = bitmask.shape
    vocab = logits.shape[1]
    require(rows.shape == (n,) and rows.dtype == torch.int64, f"rows must be int64 [{n}]")
    require(words * 32 >= vocab, f"bitmask of {words} words cannot cover a vocabulary of {vocab}")
    tuning = tuning_for_device(logits.device)
    block = 256 if tuning.backend == "interpreter" else 4096
    launch(
        _bitmask_kernel,
        (n, -(-vocab // block)),
        Tile(num_warps=min(8, tuning.row_warps), num_stages=1),
        logits_ptr=logits,
        bits_ptr=bitmask,
        rows_ptr=rows,
        vocab=vocab,
        stride=logits.stride(0),
        words=words,
        BLOCK=block,
    )
    return logits
