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
from .matmul import GEMV_MAX_ROWS, dense_linear, gemv_tile
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
        a = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * x_stride + offs_k[None, :],
            mask=mmask[:, None] & kmask[None, :],
            other=0.0,
        )
        b = _dequant_gguf(rows, offs_k[:, None], nmask[None, :] & kmask[:, None], QTYPE)  # [BLOCK_K, BLOCK_N]
        if UPCAST:
            a = a.to(tl.float32)
        else:
            b = b.to(a.dtype)
        acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        o_ptr + offs_m[:, None].to(tl.int64) * o_stride + offs_n[None, :],
        acc.to(o_ptr.dtype.element_ty),
        mask=mmask[:, None] & nmask[None, :],
    )


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
    if m <= GEMV_MAX_ROWS:
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
    n,
    k,
    x_stride,
    qw_stride,
    qz_stride,
    s_stride,
    o_stride,
    ZERO_OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1).to(tl.int64)
    nmask = offs_n < n
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < k
        x = tl.load(x_ptr + row * x_stride + offs_k, mask=kmask, other=0.0).to(tl.float32)
        w = _dequant_gptq(
            qw_ptr, qz_ptr, s_ptr, g_ptr, offs_k[:, None], offs_n[None, :], kmask[:, None] & nmask[None, :],
            qw_stride, qz_stride, s_stride, ZERO_OFFSET,
        )  # fmt: skip
        acc += tl.sum(w * x[:, None], axis=0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * o_stride + offs_n, acc.to(o_ptr.dtype.element_ty), mask=nmask)


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
        a = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * x_stride + offs_k[None, :],
            mask=mmask[:, None] & kmask[None, :],
            other=0.0,
        )
        b = _dequant_gptq(
            qw_ptr, qz_ptr, s_ptr, g_ptr, offs_k[:, None], offs_n[None, :], kmask[:, None] & nmask[None, :],
            qw_stride, qz_stride, s_stride, ZERO_OFFSET,
        )  # fmt: skip
        if UPCAST:
            a = a.to(tl.float32)
        else:
            b = b.to(a.dtype)
        acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        o_ptr + offs_m[:, None].to(tl.int64) * o_stride + offs_n[None, :],
        acc.to(o_ptr.dtype.element_ty),
        mask=mmask[:, None] & nmask[None, :],
    )


def gptq_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    zero_offset: int = 1,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x @ W for a 4-bit GPTQ matrix W [k, n] (the checkpoint's in_features x out_features).

    qweight: int32 [k / 8, n], eight 4-bit values per word packed along k (value i in bits 4i..4i+3).
    qzeros: int32 [groups, n / 8], packed along n. scales: float16/bfloat16/float32 [groups, n].
    g_idx: int32/int64 [k], the group of each input row (act-order safe). Element value:
    (q - (zero + zero_offset)) * scale; zero_offset is 1 for checkpoints in the original GPTQ ("v1") format,
    0 for the "v2" format. x: [m, k] float; bias [n] or None. Returns [m, n] in x's dtype.
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
        tile = gemv_tile(n, m, tuning, tuning.qgemv, min_block=16)
        launch(_gptq_gemv_kernel, (cdiv(n, tile.block_n), m), tile, BLOCK_N=tile.block_n, BLOCK_K=64, **common)
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
            x, p["qweight"], p["qzeros"], p["scales"], p["g_idx"], bias, zero_offset=offset, out_dtype=out_dtype
        )
    raise Unsupported(Reason.QUANTIZATION, weight.kind, "Triton kernels compute gguf and 4-bit gptq layouts")
