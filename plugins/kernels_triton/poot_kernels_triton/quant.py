"""x @ W^T with packed weights dequantized in registers: GGUF blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) and GPTQ.

GGUF weights are uint8 [n, bytes_per_row], each row a run of ggml blocks as the file stores them. Each
element of a tile finds its block, loads the bytes it needs and rebuilds its value; half-precision fields
are assembled from two bytes so no alignment of the row is assumed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from poot_core import PackedWeight
from poot_core.errors import Reason, Unsupported

from .launch import cdiv, check_dims, check_float, check_same_device, launch, require, unit_stride_last
from .matmul import GEMV_MAX_ROWS, dense_linear, gemm_store, gemm_x_tile, gemv_tile, launch_gemv
from .splitk import finish_split
from .tuning import tuning_for_device

# name -> (kernel code, elements per block, bytes per block)
GGUF_TYPES: dict[str, tuple[int, int, int]] = {
    "Q8_0": (0, 32, 34),
    "Q4_0": (1, 32, 18),
    "Q4_1": (2, 32, 20),
    "Q4_K": (3, 256, 144),
    "Q6_K": (4, 256, 210),
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
        sc_lo = _byte_at(base + 4 + sub, mask)  # scales[sub]
        sc_hi = _byte_at(base + 4 + (sub + 4) % 12, mask)  # scales[sub + 4]
        sc_prev = _byte_at(base + 4 + tl.where(sub >= 4, sub - 4, sub), mask)  # scales[sub - 4]
        scale = tl.where(sub < 4, sc_lo & 63, (sc_hi & 0xF) | ((sc_prev >> 6) << 4))
        minimum = tl.where(sub < 4, sc_hi & 63, (sc_hi >> 4) | ((sc_lo >> 6) << 4))
        d = _f16_at(base, mask)
        dmin = _f16_at(base + 2, mask)
        w = d * scale.to(tl.float32) * nib.to(tl.float32) - dmin * minimum.to(tl.float32)
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
def _small_int_f32(v):
    """float32 of int32 values in [0, 2^23): the bits of 2^23 + v as a float, less 2^23 (one logic op and one
    add, where a conversion instruction runs at a quarter of the rate)."""
    return (v | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


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
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = offs_m < m
    nmask = offs_n < n
    rows = w_ptr + offs_n[None, :].to(tl.int64) * w_stride
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < k
        a = gemm_x_tile(x_ptr, x_stride, offs_m, offs_k, mmask, kmask)
        b = _dequant_gguf(rows, offs_k[:, None], nmask[None, :] & kmask[:, None], QTYPE)  # [BLOCK_K, BLOCK_N]
        if UPCAST:
            a = a.to(tl.float32)
        else:
            b = b.to(a.dtype)
        acc = tl.dot(a, b, acc)
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


@triton.jit
def _dequant_gptq(
    qw_ptr, qz_ptr, s_ptr, g_ptr, kk, nn, mask, qw_stride, qz_stride, s_stride, ZERO_OFFSET: tl.constexpr
):
    """Elements W[kk, nn] (broadcast shapes) of a 4-bit GPTQ matrix, float32."""
    packed = tl.load(qw_ptr + (kk // 8).to(tl.int64) * qw_stride + nn, mask=mask, other=0)
    q = (packed >> ((kk % 8) * 4)) & 0xF
    g = tl.load(g_ptr + kk, mask=mask, other=0).to(tl.int64)
    zp = tl.load(qz_ptr + g * qz_stride + nn // 8, mask=mask, other=0)
    z = ((zp >> ((nn % 8) * 4)) & 0xF) + ZERO_OFFSET
    s = tl.load(s_ptr + g * s_stride + nn, mask=mask, other=0.0).to(tl.float32)
    return (q - z).to(tl.float32) * s


@triton.jit
def _gptq_gemv_kernel(
    x_ptr,
    qw_ptr,
    qz_ptr,
    s_ptr,
    g_ptr,
    b_ptr,
    o_ptr,
    part_ptr,
    lock_ptr,
    n,
    k,
    x_stride,
    qw_stride,
    qz_stride,
    s_stride,
    o_stride,
    group_words,
    k_per_split,
    n_tiles,
    split,
    ZERO_OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUPED: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KW: tl.constexpr,
):
    """Whole int32 words of qweight [k/8, n] per step ([BLOCK_KW, BLOCK_N], contiguous along n), unpacked to
    [BLOCK_KW, 8, BLOCK_N] in registers. GROUPED: g_idx is k // (8 * group_words) and a step never crosses a
    group, so the step's scales and zeros are one row each, applied once to the step's sums; otherwise
    (act-order) each input row's group comes from g_idx."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1).to(tl.int64)
    nmask = offs_n < n
    t = tl.arange(0, 8)
    zshift = (offs_n % 8) * 4
    w_start = tl.program_id(2) * k_per_split
    w_end = tl.minimum(k // 8, w_start + k_per_split)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for kw0 in range(w_start, w_end, BLOCK_KW):
        kws = kw0 + tl.arange(0, BLOCK_KW)
        kmask = kws < w_end
        words = tl.load(
            qw_ptr + kws[:, None].to(tl.int64) * qw_stride + offs_n[None, :],
            mask=kmask[:, None] & nmask[None, :],
            other=0,
            eviction_policy="evict_first",
        )
        kk = kws[:, None] * 8 + t[None, :]  # [BLOCK_KW, 8] input rows
        xv = tl.load(x_ptr + row * x_stride + kk, mask=kmask[:, None], other=0.0).to(tl.float32)
        q = (words[:, None, :] >> (4 * t)[None, :, None]) & 0xF  # [BLOCK_KW, 8, BLOCK_N]
        if GROUPED:
            g = kw0 // group_words
            s = tl.load(s_ptr + g * s_stride + offs_n, mask=nmask, other=0.0).to(tl.float32)
            zp = tl.load(qz_ptr + g * qz_stride + offs_n // 8, mask=nmask, other=0)
            z = (((zp >> zshift) & 0xF) + ZERO_OFFSET).to(tl.float32)
            dot = tl.sum(tl.sum(_small_int_f32(q) * xv[:, :, None], axis=1), axis=0)
            acc += s * (dot - z * tl.sum(tl.sum(xv, axis=1), axis=0))
        else:
            g = tl.load(g_ptr + kk, mask=kmask[:, None], other=0).to(tl.int64)[:, :, None]
            m3 = kmask[:, None, None] & nmask[None, None, :]
            s = tl.load(s_ptr + g * s_stride + offs_n[None, None, :], mask=m3, other=0.0).to(tl.float32)
            zp = tl.load(qz_ptr + g * qz_stride + (offs_n // 8)[None, None, :], mask=m3, other=0)
            z = ((zp >> zshift[None, None, :]) & 0xF) + ZERO_OFFSET
            w = (q - z).to(tl.float32) * s
            acc += tl.sum(tl.sum(w * xv[:, :, None], axis=1), axis=0)
    finish_split(acc, offs_n, nmask, b_ptr, o_ptr, o_stride, part_ptr, lock_ptr, n, n_tiles, split,
                 HAS_BIAS, SPLIT, BLOCK_N)  # fmt: skip


@triton.jit
def _gptq_gemm_kernel(
    x_ptr,
    qw_ptr,
    qz_ptr,
    s_ptr,
    g_ptr,
    b_ptr,
    o_ptr,
    m,
    n,
    k,
    x_stride,
    qw_stride,
    qz_stride,
    s_stride,
    o_stride,
    ZERO_OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = offs_m < m
    nmask = offs_n < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < k
        a = gemm_x_tile(x_ptr, x_stride, offs_m, offs_k, mmask, kmask)
        b = _dequant_gptq(
            qw_ptr, qz_ptr, s_ptr, g_ptr, offs_k[:, None], offs_n[None, :], kmask[:, None] & nmask[None, :],
            qw_stride, qz_stride, s_stride, ZERO_OFFSET,
        )  # fmt: skip
        if UPCAST:
            a = a.to(tl.float32)
        else:
            b = b.to(a.dtype)
        acc = tl.dot(a, b, acc)
    gemm_store(o_ptr, o_stride, b_ptr, acc, offs_m, offs_n, mmask, nmask, HAS_BIAS)


def gptq_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    zero_offset: int = 1,
    group_size: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x @ W for a 4-bit GPTQ matrix W [k, n] (the checkpoint's in_features x out_features).

    qweight: int32 [k / 8, n], eight 4-bit values per word packed along k (value i in bits 4i..4i+3).
    qzeros: int32 [groups, n / 8], packed along n. scales: float16/bfloat16/float32 [groups, n].
    g_idx: int32/int64 [k], the group of each input row (act-order safe). Element value:
    (q - (zero + zero_offset)) * scale; zero_offset is 1 for checkpoints in the original GPTQ ("v1") format,
    0 for the "v2" format. x: [m, k] float; bias [n] or None. Returns [m, n] in x's dtype.
    group_size: when given, the caller vouches that g_idx is k // group_size (no act-order; -1 or 0: one
    group), and the decode GEMV applies each group's scales once per step instead of per element.
    """
    check_dims("x", x, 2)
    check_float("x", x)
    for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        check_dims(name, t, 2)
    check_dims("g_idx", g_idx, 1)
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise Unsupported(Reason.QUANTIZATION, "gptq", "qweight and qzeros must be int32 (4-bit packing)")
    m, k = x.shape
    n = qweight.shape[1]
    require(qweight.shape[0] * 8 == k, f"qweight {tuple(qweight.shape)} does not pack k={k} 4-bit values")
    require(scales.shape[1] == n and qzeros.shape[1] * 8 == n, "scales/qzeros do not match qweight's width")
    require(qzeros.shape[0] == scales.shape[0], "qzeros and scales disagree on the group count")
    require(g_idx.shape == (k,), f"g_idx must be [{k}]")
    if group_size is not None and group_size > 0:
        require(group_size % 8 == 0 and k % group_size == 0, f"group size {group_size} does not divide k={k}")
        require(k // group_size == scales.shape[0], f"group size {group_size} disagrees with {scales.shape[0]} groups")
    check_same_device(x, qweight, qzeros, scales, g_idx)
    if bias is not None:
        require(bias.shape == (n,), f"bias must be [{n}]")
    x = unit_stride_last(x)
    qweight, qzeros, scales, g_idx = (t.contiguous() for t in (qweight, qzeros, scales, g_idx))
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    tuning = tuning_for_device(x.device)
    common = dict(
        x_ptr=x,
        qw_ptr=qweight,
        qz_ptr=qzeros,
        s_ptr=scales,
        g_ptr=g_idx,
        b_ptr=bias if bias is not None else x,
        o_ptr=out,
        n=n,
        k=k,
        x_stride=x.stride(0),
        qw_stride=qweight.stride(0),
        qz_stride=qzeros.stride(0),
        s_stride=scales.stride(0),
        o_stride=out.stride(0),
        ZERO_OFFSET=int(zero_offset),
        HAS_BIAS=bias is not None,
    )
    if m <= GEMV_MAX_ROWS:
        tile = gemv_tile(n, m, tuning, tuning.gptq_gemv, min_block=16, k=k, kind="gptq")
        words = k // 8
        block_kw = max(1, tile.block_k // 8)
        grouped = group_size is not None
        if grouped:
            group_words = (k if group_size <= 0 else group_size) // 8
            while group_words % block_kw:  # a step never crosses a group
                block_kw //= 2
        else:
            group_words = words
        launch_gemv(
            _gptq_gemv_kernel, tile, n, m, cdiv(words, block_kw), block_kw, x.device, tuning,
            group_words=group_words, GROUPED=grouped, BLOCK_N=tile.block_n, BLOCK_KW=block_kw, **common,
        )  # fmt: skip
    else:
        tile = tuning.qgemm
        launch(
            _gptq_gemm_kernel,
            (cdiv(m, tile.block_m), cdiv(n, tile.block_n)),
            tile,
            m=m,
            UPCAST=tuning.upcast_dot,
            BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n,
            BLOCK_K=tile.block_k,
            **common,
        )
    return out


def _words_view_ok(blocks: torch.Tensor) -> bool:
    """Whether uint8 blocks [n, bytes] can be read as int32 words (4-byte aligned rows and start)."""
    return blocks.stride(0) % 4 == 0 and blocks.shape[1] % 4 == 0 and blocks.storage_offset() % 4 == 0


def _plain_group_size(weight: PackedWeight) -> int | None:
    """The group size when the checkpoint says g_idx is plain k // group_size (no act-order), else None."""
    meta = weight.meta
    if meta.get("desc_act", True) or "group_size" not in meta:
        return None
    k = weight.shape[1]
    size = int(meta["group_size"])
    size = k if size <= 0 else size
    groups = weight.parts["scales"].shape[0]
    if size % 8 or k % size or k // size != groups:
        return None
    return size


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | PackedWeight,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [m, k] @ W^T for any weight this package computes with: dense [n, k], PackedWeight gguf or gptq.4.
    The output has x's dtype unless out_dtype names another."""
    if isinstance(weight, torch.Tensor):
        return dense_linear(x, weight, bias, out_dtype=out_dtype)
    if weight.layout == "gguf":
        return gguf_linear(x, weight.parts["blocks"], str(weight.meta.get("type")), bias, out_dtype=out_dtype)
    if weight.layout == "gptq" and int(weight.meta.get("bits", 0)) == 4:
        p = weight.parts
        offset = 0 if weight.meta.get("checkpoint_format") == "gptq_v2" else 1
        return gptq_linear(
            x, p["qweight"], p["qzeros"], p["scales"], p["g_idx"], bias,
            zero_offset=offset, group_size=_plain_group_size(weight), out_dtype=out_dtype,
        )  # fmt: skip
    raise Unsupported(Reason.QUANTIZATION, weight.kind, "Triton kernels compute gguf and 4-bit gptq layouts")
