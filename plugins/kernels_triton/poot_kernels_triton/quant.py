"""x @ W^T with packed weights dequantized in registers.

Uploaded matrices are in the planes layout (relayout.py) and go through planes.py's kernels. GGUF blocks
still in the file's layout (stacked experts, and matrices handed to `linear` directly) are read here:
uint8 [n, bytes_per_row], each row a run of ggml blocks. Each element of a tile finds its block, loads the
bytes it needs and rebuilds its value; half-precision fields are assembled from two bytes so no alignment
of the row is assumed. GPTQ, AWQ and FP8 matrices handed to `linear` directly are rearranged on the fly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from poot_core import PackedWeight
from poot_core.errors import Reason, Unsupported

from .launch import cdiv, check_dims, check_float, check_same_device, launch, require, unit_stride_last
from .matmul import GEMV_MAX_ROWS, dense_linear, dot_tiles, gemm_store, gemm_tile, gemm_x_tile, gemv_tile, launch_gemv
from .planes import iq4_value, planes_linear, planes_rows
from .relayout import from_gptq, is_planes, to_planes
from .splitk import finish_split
from .tuning import tuning_for_device

# name -> (kernel code, elements per block, bytes per block)
GGUF_TYPES: dict[str, tuple[int, int, int]] = {
    "Q8_0": (0, 32, 34),
    "Q4_0": (1, 32, 18),
    "Q4_1": (2, 32, 20),
    "Q4_K": (3, 256, 144),
    "Q6_K": (4, 256, 210),
    "Q5_0": (5, 32, 22),
    "Q5_1": (6, 32, 24),
    "Q2_K": (7, 256, 84),
    "Q3_K": (8, 256, 110),
    "Q5_K": (9, 256, 176),
    "IQ4_NL": (10, 32, 18),
    "IQ4_XS": (11, 256, 136),
}



@triton.jit
def _f16_at(ptr, mask):
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte_at(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _k4_scale_min(base, sub, mask):
    """The 6-bit (scale, min) of sub-block sub (0..7) of a Q4_K/Q5_K block at base (its 12 scale bytes at 4)."""
    sc_lo = _byte_at(base + 4 + sub, mask)  # scales[sub]
    sc_hi = _byte_at(base + 4 + (sub + 4) % 12, mask)  # scales[sub + 4]
    sc_prev = _byte_at(base + 4 + tl.where(sub >= 4, sub - 4, sub), mask)  # scales[sub - 4]
    scale = tl.where(sub < 4, sc_lo & 63, (sc_hi & 0xF) | ((sc_prev >> 6) << 4))
    minimum = tl.where(sub < 4, sc_hi & 63, (sc_hi >> 4) | ((sc_lo >> 6) << 4))
    return scale.to(tl.float32), minimum.to(tl.float32)


@triton.jit
def _k_crumb(qs_ptr, j, mask):
    """2-bit quant of element j (0..255) of a Q2_K/Q3_K block whose 64 quant bytes start at qs_ptr."""
    half = j // 128
    shift = ((j % 128) // 32) * 2
    return (_byte_at(qs_ptr + half * 32 + j % 32, mask) >> shift) & 3


@triton.jit
def _dequant_gguf(row_ptr, kk, mask, QTYPE: tl.constexpr):
    """Values of elements kk of the rows at row_ptr (broadcast shapes), float32."""
    if QTYPE == 0:  # Q8_0: f16 d, int8 q[32]
        base = row_ptr + (kk // 32) * 34
        d = _f16_at(base, mask)
        q = tl.load(base + 2 + kk % 32, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = d * q
    elif QTYPE == 1:  # Q4_0: f16 d, 16 bytes: low nibbles are elements 0-15, high nibbles 16-31
        base = row_ptr + (kk // 32) * 18
        j = kk % 32
        byte = _byte_at(base + 2 + j % 16, mask)
        nib = tl.where(j < 16, byte & 0xF, byte >> 4)
        w = _f16_at(base, mask) * (nib - 8).to(tl.float32)
    elif QTYPE == 2:  # Q4_1: f16 d, f16 m, 16 bytes as Q4_0; value d * q + m
        base = row_ptr + (kk // 32) * 20
        j = kk % 32
        byte = _byte_at(base + 4 + j % 16, mask)
        nib = tl.where(j < 16, byte & 0xF, byte >> 4)
        w = _f16_at(base, mask) * nib.to(tl.float32) + _f16_at(base + 2, mask)
    elif QTYPE == 3:  # Q4_K: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        base = row_ptr + (kk // 256) * 144
        j = kk % 256
        chunk = j // 64
        within = j % 64
        sub = 2 * chunk + within // 32  # which of the 8 sub-blocks of 32
        byte = _byte_at(base + 16 + chunk * 32 + within % 32, mask)
        nib = tl.where(within < 32, byte & 0xF, byte >> 4)
        scale, minimum = _k4_scale_min(base, sub, mask)
        w = _f16_at(base, mask) * scale * nib.to(tl.float32) - _f16_at(base + 2, mask) * minimum
    elif QTYPE == 5 or QTYPE == 6:  # Q5_0 (f16 d, u32 qh, 16 bytes) / Q5_1 (f16 d, f16 m, u32 qh, 16 bytes)
        size: tl.constexpr = 22 if QTYPE == 5 else 24
        at: tl.constexpr = 2 if QTYPE == 5 else 4
        base = row_ptr + (kk // 32) * size
        j = kk % 32
        byte = _byte_at(base + at + 4 + j % 16, mask)
        nib = tl.where(j < 16, byte & 0xF, byte >> 4)
        q = nib | (((_byte_at(base + at + j // 8, mask) >> (j % 8)) & 1) << 4)
        if QTYPE == 5:
            w = _f16_at(base, mask) * (q - 16).to(tl.float32)
        else:
            w = _f16_at(base, mask) * q.to(tl.float32) + _f16_at(base + 2, mask)
    elif QTYPE == 7:  # Q2_K: 16 bytes of 4-bit scale|min, 64 bytes of 2-bit quants, f16 d, f16 dmin
        base = row_ptr + (kk // 256) * 84
        j = kk % 256
        sm = _byte_at(base + j // 16, mask)
        q = _k_crumb(base + 16, j, mask).to(tl.float32)
        w = _f16_at(base + 80, mask) * (sm & 0xF).to(tl.float32) * q - _f16_at(base + 82, mask) * (sm >> 4).to(
            tl.float32)  # fmt: skip
    elif QTYPE == 8:  # Q3_K: hmask[32], 2-bit quants[64], 12 bytes of 6-bit scales, f16 d
        base = row_ptr + (kk // 256) * 110
        j = kk % 256
        hm = (_byte_at(base + j % 32, mask) >> (j // 32)) & 1
        q = (_k_crumb(base + 32, j, mask) | (hm << 2)) - 4
        i = j // 16
        low = tl.where(i < 8, _byte_at(base + 96 + i % 8, mask) & 0xF, _byte_at(base + 96 + i % 8, mask) >> 4)
        high = (_byte_at(base + 104 + i % 4, mask) >> (2 * (i // 4))) & 3
        sc = (low | (high << 4)) - 32
        w = _f16_at(base + 108, mask) * sc.to(tl.float32) * q.to(tl.float32)
    elif QTYPE == 9:  # Q5_K: f16 d, f16 dmin, 12 scale bytes, qh[32], quants[128] as Q4_K
        base = row_ptr + (kk // 256) * 176
        j = kk % 256
        chunk = j // 64
        within = j % 64
        byte = _byte_at(base + 48 + chunk * 32 + within % 32, mask)
        nib = tl.where(within < 32, byte & 0xF, byte >> 4)
        q = nib | (((_byte_at(base + 16 + j % 32, mask) >> (j // 32)) & 1) << 4)
        scale, minimum = _k4_scale_min(base, j // 32, mask)
        w = _f16_at(base, mask) * scale * q.to(tl.float32) - _f16_at(base + 2, mask) * minimum
    elif QTYPE == 10:  # IQ4_NL: f16 d, 16 bytes of codes ordered as Q4_0's
        base = row_ptr + (kk // 32) * 18
        j = kk % 32
        byte = _byte_at(base + 2 + j % 16, mask)
        w = _f16_at(base, mask) * iq4_value(tl.where(j < 16, byte & 0xF, byte >> 4))
    elif QTYPE == 11:  # IQ4_XS: f16 d, u16 high scale bits, 4 bytes of low scale nibbles, 128 bytes of codes
        base = row_ptr + (kk // 256) * 136
        j = kk % 256
        ib = j // 32
        low = (_byte_at(base + 4 + ib // 2, mask) >> (4 * (ib % 2))) & 0xF
        high = ((_byte_at(base + 2, mask) | (_byte_at(base + 3, mask) << 8)) >> (2 * ib)) & 3
        ls = (low | (high << 4)) - 32
        byte = _byte_at(base + 8 + ib * 16 + j % 16, mask)
        code = tl.where(j % 32 < 16, byte & 0xF, byte >> 4)
        w = _f16_at(base, mask) * ls.to(tl.float32) * iq4_value(code)
    else:  # Q6_K: ql[128] low nibbles, qh[64] high 2-bit pairs, int8 scales[16], f16 d
        base = row_ptr + (kk // 256) * 210
        j = kk % 256
        half = j // 128
        r = j % 128
        quarter = r // 32
        lane = r % 32
        ql = _byte_at(base + half * 64 + lane + (quarter % 2) * 32, mask)
        low = tl.where(quarter < 2, ql & 0xF, ql >> 4)
        qh = _byte_at(base + 128 + half * 32 + lane, mask)
        q = (low | (((qh >> (2 * quarter)) & 3) << 4)) - 32
        sc = tl.load(base + 192 + half * 8 + lane // 16 + 2 * quarter, mask=mask, other=0)
        sc = sc.to(tl.int8, bitcast=True).to(tl.float32)
        w = _f16_at(base + 208, mask) * sc * q.to(tl.float32)
    return w


@triton.jit
def _gguf_gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    o_ptr,
    n,
    k,
    x_stride,
    w_stride,
    o_stride,
    QTYPE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1).to(tl.int64)
    nmask = offs_n < n
    rows = w_ptr + offs_n[:, None].to(tl.int64) * w_stride
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < k
        x = tl.load(x_ptr + row * x_stride + offs_k, mask=kmask, other=0.0).to(tl.float32)
        w = _dequant_gguf(rows, offs_k[None, :], nmask[:, None] & kmask[None, :], QTYPE)
        acc += tl.sum(w * x[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * o_stride + offs_n, acc.to(o_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _q4k_gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    o_ptr,
    part_ptr,
    lock_ptr,
    n,
    k,
    x_stride,
    w_stride,
    o_stride,
    k_per_split,
    n_tiles,
    split,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Q4_K rows read as int32 words (w_ptr: the blocks viewed as int32, w_stride in words). k is walked in
    chunks of 64 elements: a chunk is 8 words of nibbles (32 bytes: low nibbles are its first 32 elements,
    high nibbles the next 32) sharing two 6-bit scale/min pairs. Products with x are summed per sub-block
    first, then scaled once: sum(x * (d*sc*q - dmin*m)) = d*sc*sum(x*q) - dmin*m*sum(x)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1).to(tl.int64)
    nmask = offs_n < n
    rows = w_ptr + offs_n.to(tl.int64) * w_stride
    xrow = x_ptr + row * x_stride
    wi = tl.arange(0, 8)
    c_start = tl.program_id(2) * k_per_split
    c_end = tl.minimum(k // 64, c_start + k_per_split)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for c0 in range(c_start, c_end, BLOCK_C):
        cc = c0 + tl.arange(0, BLOCK_C)  # chunk index along the row
        cmask = cc < c_end
        block = (cc // 4) * 36  # first word of the chunk's 144-byte block
        part = cc % 4
        m2 = nmask[:, None] & cmask[None, :]
        at = rows[:, None] + block[None, :]
        words = tl.load(
            at[:, :, None] + (4 + part * 8)[None, :, None] + wi[None, None, :],
            mask=m2[:, :, None],
            other=0,
            eviction_policy="evict_first",
        )
        head = tl.load(at, mask=m2, other=0)  # f16 d | f16 dmin << 16
        s1 = tl.load(at + 1, mask=m2, other=0)  # scale bytes 0-3
        s2 = tl.load(at + 2, mask=m2, other=0)  # 4-7
        s3 = tl.load(at + 3, mask=m2, other=0)  # 8-11
        d = (head & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = ((head >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        # sub-blocks 2*part and 2*part+1 use bytes i and i+1 of each scale word, i = 2 * (part % 2)
        shift = ((part % 2) * 16)[None, :]
        low = (part < 2)[None, :]
        a0, a1 = (s1 >> shift) & 0xFF, (s1 >> (shift + 8)) & 0xFF
        b0, b1 = (s2 >> shift) & 0xFF, (s2 >> (shift + 8)) & 0xFF
        c0_, c1_ = (s3 >> shift) & 0xFF, (s3 >> (shift + 8)) & 0xFF
        sc0 = tl.where(low, a0 & 63, (c0_ & 0xF) | ((a0 >> 6) << 4)).to(tl.float32)
        sc1 = tl.where(low, a1 & 63, (c1_ & 0xF) | ((a1 >> 6) << 4)).to(tl.float32)
        mn0 = tl.where(low, b0 & 63, (c0_ >> 4) | ((b0 >> 6) << 4)).to(tl.float32)
        mn1 = tl.where(low, b1 & 63, (c1_ >> 4) | ((b1 >> 6) << 4)).to(tl.float32)
        # nibble e of word wi: byte e // 2, low (even e) or high; element 32 * (e % 2) + 4 * wi + e // 2.
        # (Measured on the H200: this gather of x, with int->float conversions, ran twice as fast as
        # contiguous x runs over a 4-D [BLOCK_N, BLOCK_C, 8, 4] nibble tile.)
        xat = xrow + cc[:, None].to(tl.int64) * 64 + 4 * wi[None, :]
        p_lo = tl.zeros([BLOCK_N, BLOCK_C, 8], tl.float32)
        p_hi = tl.zeros([BLOCK_N, BLOCK_C, 8], tl.float32)
        x_lo = tl.zeros([BLOCK_C, 8], tl.float32)
        x_hi = tl.zeros([BLOCK_C, 8], tl.float32)
        for e in tl.static_range(8):
            xe = tl.load(xat + (32 * (e % 2) + e // 2), mask=cmask[:, None], other=0.0).to(tl.float32)
            q = ((words >> (4 * e)) & 0xF).to(tl.float32)
            if e % 2 == 0:
                p_lo += q * xe[None, :, :]
                x_lo += xe
            else:
                p_hi += q * xe[None, :, :]
                x_hi += xe
        r_lo = tl.sum(p_lo, axis=2)
        r_hi = tl.sum(p_hi, axis=2)
        xs_lo = tl.sum(x_lo, axis=1)[None, :]
        xs_hi = tl.sum(x_hi, axis=1)[None, :]
        acc += tl.sum(d * (sc0 * r_lo + sc1 * r_hi) - dmin * (mn0 * xs_lo + mn1 * xs_hi), axis=1)
    finish_split(acc, offs_n, nmask, b_ptr, o_ptr, o_stride, part_ptr, lock_ptr, n, n_tiles, split,
                 HAS_BIAS, SPLIT, BLOCK_N)  # fmt: skip


@triton.jit
def _gguf_gemm_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    o_ptr,
    m,
    n,
    k,
    x_stride,
    w_stride,
    o_stride,
    QTYPE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m, offs_n, mmask, nmask = gemm_tile(m, n, BLOCK_M, BLOCK_N)
    rows = w_ptr + offs_n[None, :].to(tl.int64) * w_stride
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < k
        a = gemm_x_tile(x_ptr, x_stride, offs_m, offs_k, mmask, kmask)
        b = _dequant_gguf(rows, offs_k[:, None], nmask[None, :] & kmask[:, None], QTYPE)  # [BLOCK_K, BLOCK_N]
        acc = dot_tiles(a, b, acc, UPCAST)
    gemm_store(o_ptr, o_stride, b_ptr, acc, offs_m, offs_n, mmask, nmask, HAS_BIAS)


def gguf_linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    gguf_type: str,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x @ W^T where W is stored as GGUF blocks.

    x: [m, k] float32/float16/bfloat16. blocks: uint8 [n, bytes_per_row] with bytes_per_row =
    k / block_elements * block_bytes (Q8_0 32/34, Q4_0 32/18, Q4_1 32/20, Q4_K 256/144, Q6_K 256/210),
    the ggml block layouts. bias: [n] or None. Returns [m, n] in x's dtype, float32 accumulation.
    """
    if gguf_type not in GGUF_TYPES:
        raise Unsupported(Reason.QUANTIZATION, f"gguf.{gguf_type}", f"Triton kernels know {sorted(GGUF_TYPES)}")
    code, elems, nbytes = GGUF_TYPES[gguf_type]
    check_dims("x", x, 2)
    check_dims("blocks", blocks, 2)
    check_float("x", x)
    if blocks.dtype != torch.uint8:
        raise Unsupported(Reason.QUANTIZATION, f"gguf.{gguf_type}:{blocks.dtype}", "blocks must be uint8")
    m, k = x.shape
    n = blocks.shape[0]
    require(k % elems == 0, f"{gguf_type} needs k divisible by {elems}, got {k}")
    require(blocks.shape[1] == k // elems * nbytes, f"{gguf_type} row of {k} needs {k // elems * nbytes} bytes")
    check_same_device(x, blocks, *([bias] if bias is not None else []))
    if bias is not None:
        require(bias.shape == (n,), f"bias must be [{n}]")
    x = unit_stride_last(x)
    blocks = unit_stride_last(blocks)
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    tuning = tuning_for_device(x.device)
    common = dict(
        x_ptr=x,
        w_ptr=blocks,
        b_ptr=bias if bias is not None else x,
        o_ptr=out,
        n=n,
        k=k,
        x_stride=x.stride(0),
        w_stride=blocks.stride(0),
        o_stride=out.stride(0),
        QTYPE=code,
        HAS_BIAS=bias is not None,
    )
    if m <= GEMV_MAX_ROWS and gguf_type == "Q4_K" and _words_view_ok(blocks):
        tile = gemv_tile(n, m, tuning, tuning.q4k_gemv, k=k, kind="q4_k")
        chunks = max(1, tile.block_k // 64)
        common.update(w_ptr=blocks.view(torch.int32), w_stride=blocks.stride(0) // 4)
        del common["QTYPE"]
        launch_gemv(
            _q4k_gemv_kernel, tile, n, m, cdiv(k // 64, chunks), chunks, x.device, tuning,
            BLOCK_N=tile.block_n, BLOCK_C=chunks, **common,
        )  # fmt: skip
    elif m <= GEMV_MAX_ROWS:
        tile = gemv_tile(n, m, tuning, tuning.qgemv)
        grid = (cdiv(n, tile.block_n), m)
        launch(_gguf_gemv_kernel, grid, tile, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, **common)
    else:
        tile = tuning.qgemm
        grid = (cdiv(m, tile.block_m), cdiv(n, tile.block_n))
        launch(
            _gguf_gemm_kernel,
            grid,
            tile,
            m=m,
            UPCAST=tuning.upcast_dot,
            BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n,
            BLOCK_K=tile.block_k,
            **common,
        )
    return out


def gptq_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    zero_offset: int = 1,
    bits: int = 4,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x @ W for a GPTQ matrix W [k, n] (the checkpoint's in_features x out_features), through the planes
    kernels (rearranged on each call: an uploaded weight is rearranged once).

    qweight: int32 [k * bits / 32, n], 32 / bits values per word packed along k (value i in bits i*bits..).
    qzeros: int32 [groups, n * bits / 32], packed along n. scales: float16/bfloat16/float32 [groups, n].
    g_idx: int32/int64 [k], the group of each input row (act-order: any permutation of equal groups).
    Element value: (q - (zero + zero_offset)) * scale; zero_offset is 1 for checkpoints in the original GPTQ
    ("v1") format, 0 for "v2". x: [m, k] float; bias [n] or None. Returns [m, n] in x's dtype.
    """
    check_dims("x", x, 2)
    for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        check_dims(name, t, 2)
    check_dims("g_idx", g_idx, 1)
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise Unsupported(Reason.QUANTIZATION, "gptq", "qweight and qzeros must be int32")
    n, k = qweight.shape[1], x.shape[1]
    require(qweight.shape[0] * 32 == k * bits, f"qweight {tuple(qweight.shape)} does not pack k={k} {bits}-bit values")
    require(scales.shape[1] == n and qzeros.shape[1] * 32 == n * bits, "scales/qzeros do not match qweight's width")
    require(qzeros.shape[0] == scales.shape[0], "qzeros and scales disagree on the group count")
    require(g_idx.shape == (k,), f"g_idx must be [{k}]")
    meta = {"bits": bits, "checkpoint_format": "gptq" if zero_offset else "gptq_v2"}
    parts = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}
    return planes_linear(x, from_gptq(PackedWeight("gptq", (n, k), parts, meta)), bias, out_dtype=out_dtype)


def _words_view_ok(blocks: torch.Tensor) -> bool:
    """Whether uint8 blocks [n, bytes] can be read as int32 words (4-byte aligned rows and start)."""
    return blocks.stride(0) % 4 == 0 and blocks.shape[1] % 4 == 0 and blocks.storage_offset() % 4 == 0


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | PackedWeight,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [m, k] @ W^T for any weight this package computes with: dense [n, k], planes (every uploaded packed
    matrix), GGUF blocks as the file stores them, or GPTQ/AWQ/FP8 parts (rearranged on the fly). The output
    has x's dtype unless out_dtype names another."""
    if isinstance(weight, torch.Tensor):
        return dense_linear(x, weight, bias, out_dtype=out_dtype)
    if is_planes(weight):
        return planes_linear(x, weight, bias, out_dtype=out_dtype)
    if weight.layout == "gguf":
        return gguf_linear(x, weight.parts["blocks"], str(weight.meta.get("type")), bias, out_dtype=out_dtype)
    planes = to_planes(weight)
    if planes is None:
        raise Unsupported(Reason.QUANTIZATION, weight.kind, "Triton kernels compute 2-D gguf, gptq, awq and fp8")
    return planes_linear(x, planes, bias, out_dtype=out_dtype)


def embedding_rows(table: PackedWeight, tokens: torch.Tensor) -> torch.Tensor:
    """float32 [len(tokens), k]: the rows `tokens` of a packed table, dequantized on the device (graph safe)."""
    if is_planes(table):
        return planes_rows(table, tokens)
    if table.layout == "gguf" and len(table.shape) == 2:
        picked = table.parts["blocks"].index_select(0, tokens.reshape(-1))
        eye = torch.eye(table.shape[1], dtype=torch.float32, device=tokens.device)
        return gguf_linear(eye, picked, str(table.meta.get("type"))).t()  # identity @ rows^T
    raise Unsupported(Reason.QUANTIZATION, f"{table.kind} embedding", "planes or 2-D gguf tables only")
