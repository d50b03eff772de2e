"""x @ W^T for every packed layout, read in its planes form (relayout.py): a decode GEMV, a prefill GEMM and a
row dequantizer for embeddings. Values are rebuilt in registers; nothing dense is ever written.

The GEMV turns each field of a word into a float without a conversion instruction: shifted so that it lands
at bit P of an otherwise empty word (one shift serves two fields, one AND isolates it), the word read as a
float32 is the subnormal q * 2^(P-149), exact. x enters scaled by 2^(64 + PMAX - P), a power of two folded
into its bf16-to-float conversion, so every product is an ordinary float carrying q * x in one unit; FMA
units take subnormal inputs at full rate (nothing here flushes them). High bits (5-, 6- and 3-bit values)
sit in their own word where the same shift puts them just above the field: one more AND-OR. FP8 bytes
become the float whose exponent and mantissa bits they are (2^-120 times the value, exact for subnormal
bytes too). IQ4 codes index the 16-entry table. Group scales, zeros and minimums apply once per chunk to
the chunk's sums: scale * (sum(x*q) - zero * sum(x)) + min * sum(x).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import triton
import triton.language as tl

from poot_core import PackedWeight

from .launch import cdiv, check_dims, check_float, check_same_device, launch, require, unit_stride_last
from .matmul import GEMV_MAX_ROWS, GEMV_OVERRIDE, dot_tiles, gemm_store, gemm_tile, gemm_x_tile, launch_gemv
from .relayout import IQ4_VALUES
from .splitk import MAX_SPLIT, finish_split
from .tuning import Tile, Tuning, planes_tile, tuning_for_device


@triton.jit
def _shift_down(v, S: tl.constexpr):
    """v >> S for a constant S of either sign (a negative S shifts up by -S)."""
    if S > 0:
        out = v >> S
    elif S < 0:
        out = v << (-S)
    else:
        out = v
    return out


@triton.jit
def _field(w, h, E: tl.constexpr, LB: tl.constexpr, HB: tl.constexpr, FP8: tl.constexpr):
    """Field E of lo words w (its high bits from the matching hi words h, already shifted by row) as the
    subnormal float q * 2^(P - 149); FP8: the byte's bits as a float (its value * 2^-120)."""
    FPW: tl.constexpr = 32 // LB
    if FP8:
        S8: tl.constexpr = 8 * E - 20  # the byte's low 7 bits to bits 20..26, its sign to bit 31
        ws = _shift_down(w, S8)
        if E == 3:
            sign = w
        else:
            sign = w << (24 - 8 * E)
        return ((ws & 0x07F00000) | (sign & -2147483648)).to(tl.float32, bitcast=True)
    S: tl.constexpr = ((LB * E - (16 - LB)) // 8) * 8
    P: tl.constexpr = LB * E - S
    ws = _shift_down(w, S)
    bits = ws & (((1 << LB) - 1) << P)
    if HB > 0:
        if E == FPW - 1:  # the top field's high bits wrapped to the bottom of the hi word
            hs = h << (P + LB)
        else:
            hs = _shift_down(h, S)
        bits = bits | (hs & (((1 << HB) - 1) << (P + LB)))
    return bits.to(tl.float32, bitcast=True)


# IQ4's code book (relayout.IQ4_VALUES) as bytes in two int64s, for a lookup without a table: the eight
# negative entries plus 128, the eight positive ones as they are (every byte below 128)
_IQ4_LO = tl.constexpr(sum((v + 128) << (8 * i) for i, v in enumerate(IQ4_VALUES[:8])))
_IQ4_HI = tl.constexpr(sum(v << (8 * i) for i, v in enumerate(IQ4_VALUES[8:])))


@triton.jit
def iq4_value(nib):
    """IQ4_NL/IQ4_XS code book entry of 4-bit codes, float32."""
    table = tl.where(nib < 8, _IQ4_LO, _IQ4_HI)
    byte = (table >> ((nib % 8) * 8).to(tl.int64)) & 0xFF
    return (byte - tl.where(nib < 8, 128, 0)).to(tl.float32)


def _iq4_word(i: int) -> int:
    """Bytes 4i..4i+3 of IQ4's code book plus 128 as one int32 (for prmt)."""
    v = sum((IQ4_VALUES[4 * i + j] + 128) << (8 * j) for j in range(4))
    return v - (1 << 32) if v >= 1 << 31 else v


_IQ4_T0, _IQ4_T1, _IQ4_T2, _IQ4_T3 = (tl.constexpr(_iq4_word(i)) for i in range(4))


@triton.jit
def _prmt(a, b, sel):
    """PTX prmt.b32 (CUDA only): bytes of the pair (b:a) picked by the four selector nibbles of sel."""
    return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel], dtype=tl.int32,
                                     is_pure=True, pack=1)  # fmt: skip


@triton.jit
def _byte_to_bits_8(v, J: tl.constexpr):
    """Byte J of v alone at bits 8..15 of an empty word (CUDA prmt with immediate selectors)."""
    if J == 0:
        asm: tl.constexpr = "prmt.b32 $0, $1, 0, 0x4404;"
    elif J == 1:
        asm: tl.constexpr = "prmt.b32 $0, $1, 0, 0x4414;"
    elif J == 2:
        asm: tl.constexpr = "prmt.b32 $0, $1, 0, 0x4424;"
    else:
        asm: tl.constexpr = "prmt.b32 $0, $1, 0, 0x4434;"
    return tl.inline_asm_elementwise(asm, "=r,r", [v], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _iq4_bytes(w, E: tl.constexpr):
    """IQ4 code book entries plus 128 of fields E..E+3 of words w, one byte each (CUDA: three prmt, the way
    llama.cpp looks up 16-entry tables: the low and high halves, then per byte the half its code's top bit
    names)."""
    sel = w >> (4 * E)
    # prmt reads a selector nibble's top bit as "replicate the byte's sign": the table lookups take the low
    # three bits only (a code's top bit then picks the half in the last prmt)
    idx = sel & 0x7777
    lo = _prmt(tl.full(w.shape, _IQ4_T0, tl.int32), tl.full(w.shape, _IQ4_T1, tl.int32), idx)
    hi = _prmt(tl.full(w.shape, _IQ4_T2, tl.int32), tl.full(w.shape, _IQ4_T3, tl.int32), idx)
    return _prmt(lo, hi, ((sel & 0x8888) >> 1) | 0x3210)


@triton.jit
def _pow2(E: tl.constexpr):
    """2.0 ** E as a float32 scalar, E a constexpr in [-126, 127] (built from its bits; folded at compile time)."""
    return tl.full([1], (127 + E) << 23, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _dq_unit(LB: tl.constexpr, FP8: tl.constexpr):
    """sum(x * q) per unit of the accumulated products."""
    if FP8:
        return _pow2(56)  # bytes read as 2^-120 times their value, x scaled by 2^64
    PMAX: tl.constexpr = 20 if LB == 2 else (16 if LB == 4 else 8)
    return _pow2(149 - 64 - PMAX)  # fields read as q * 2^(P - 149), x scaled by 2^(64 + PMAX - P)


@triton.jit
def _group_params(sc_ptr, d_ptr, z_ptr, m_ptr, dm_ptr, g, offs_n, nmask, sc_stride, d_stride, z_stride, m_stride,
                  dm_stride, GROUP: tl.constexpr, SUPER: tl.constexpr, SC_INT: tl.constexpr, ZKIND: tl.constexpr,
                  ZC: tl.constexpr, ZB: tl.constexpr, ZOFF: tl.constexpr, MKIND: tl.constexpr, BR: tl.constexpr):
    """(scale, zero, min) of group g for columns offs_n (broadcast shapes), float32. The value of an element is
    scale * (q - zero) + min."""
    g = g.to(tl.int64)
    if BR == 1:
        s = tl.load(sc_ptr + g * sc_stride + offs_n, mask=nmask, other=0).to(tl.float32)
    else:
        s = tl.load(sc_ptr + g * sc_stride + offs_n // BR, mask=nmask, other=0).to(tl.float32)
    if SC_INT:
        sup = g * GROUP // SUPER
        s = s * tl.load(d_ptr + sup * d_stride + offs_n, mask=nmask, other=0).to(tl.float32)
    if ZKIND == 1:
        z = tl.zeros_like(s) + ZC
    elif ZKIND == 2:
        zw = tl.load(z_ptr + g * z_stride + offs_n * ZB // 32, mask=nmask, other=0)
        z = ((zw >> ((offs_n * ZB) % 32)) & ((1 << ZB) - 1)) + ZOFF
        z = z.to(tl.float32)
    elif ZKIND == 3:
        z = (tl.load(z_ptr + g * z_stride + offs_n, mask=nmask, other=0).to(tl.int32) + ZOFF).to(tl.float32)
    else:
        z = tl.zeros_like(s)
    if MKIND == 1:
        mn = tl.load(m_ptr + g * m_stride + offs_n, mask=nmask, other=0).to(tl.float32)
    elif MKIND == 2:
        sup = g * GROUP // SUPER
        mn = tl.load(m_ptr + g * m_stride + offs_n, mask=nmask, other=0).to(tl.float32)
        mn = -mn * tl.load(dm_ptr + sup * dm_stride + offs_n, mask=nmask, other=0).to(tl.float32)
    else:
        mn = tl.zeros_like(s)
    return s, z, mn


@triton.jit
def _planes_gemv_kernel(
    x_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, z_ptr, m_ptr, dm_ptr, perm_ptr, tab_ptr, b_ptr, o_ptr, part_ptr, lock_ptr,
    n, k, x_stride, lo_stride, hi_stride, sc_stride, d_stride, z_stride, m_stride, dm_stride, o_stride,
    k_per_split, n_tiles, split,
    LB: tl.constexpr, HB: tl.constexpr, GROUP: tl.constexpr, SUPER: tl.constexpr, SC_INT: tl.constexpr,
    ZKIND: tl.constexpr, ZC: tl.constexpr, ZB: tl.constexpr, ZOFF: tl.constexpr, MKIND: tl.constexpr,
    BR: tl.constexpr, TABLE: tl.constexpr, FP8: tl.constexpr, PERM: tl.constexpr, CHUNK: tl.constexpr,
    CPS: tl.constexpr, X_PAIRS: tl.constexpr, PRMT: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Output columns [BLOCK_N] of one row of x, over chunks [start, end) of k (CHUNK inputs each, CPS chunks a
    step). A chunk is [CHUNK / FPW, BLOCK_N] lo words, every output column's words contiguous across columns:
    each thread holds whole columns of the chunk, so the sums along k stay inside the thread. PRMT (CUDA):
    IQ4 codes looked up with byte permutes instead of loads from the table."""
    FPW: tl.constexpr = 32 // LB
    WPC: tl.constexpr = CHUNK // FPW  # lo words per chunk and column
    R: tl.constexpr = LB // HB if HB > 0 else 1  # lo words per hi word
    BYTES: tl.constexpr = TABLE and PRMT  # IQ4 entries + 128 as bytes, read like fields (see _iq4_bytes)
    SUMS: tl.constexpr = ZKIND > 0 or MKIND > 0 or BYTES  # zeros, minimums, the 128 need sum(x) per chunk
    PMAX: tl.constexpr = 20 if LB == 2 else (16 if LB == 4 else 8)  # the highest landing bit (see _field)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1).to(tl.int64)
    nmask = offs_n < n
    xrow = x_ptr + row * x_stride
    xpairs = xrow.to(tl.pointer_type(tl.int32), bitcast=True)
    rr = tl.arange(0, WPC)
    c_start = tl.program_id(2) * k_per_split
    c_end = tl.minimum(k // CHUNK, c_start + k_per_split)
    # [1, BLOCK_N]: the accumulator keeps the layout of the chunk sums (a 1-D one could differ and be moved
    # between threads every chunk)
    acc = tl.zeros([1, BLOCK_N], tl.float32)
    for c0 in range(c_start, c_end, CPS):
        for j in tl.static_range(CPS):
            c = c0 + j
            # (masks built as vectors: the interpreter mis-types a scalar mask combined with a tensor one)
            live = (rr * 0 + c) < c_end
            kw = c * WPC + rr  # lo word rows of this chunk
            m2 = live[:, None] & nmask[None, :]
            w = tl.load(lo_ptr + kw[:, None].to(tl.int64) * lo_stride + offs_n[None, :], mask=m2, other=0,
                        eviction_policy="evict_first")  # fmt: skip
            h = w
            if HB > 0:
                hw = tl.load(hi_ptr + (kw // R)[:, None].to(tl.int64) * hi_stride + offs_n[None, :], mask=m2,
                             other=0, eviction_policy="evict_first")  # fmt: skip
                h = hw >> ((kw % R) * HB)[:, None]
            # products summed along the chunk's rows and fields in registers (one FMA per value), then once
            # across rows. x is scaled by 2^xexp per field: 64 + PMAX - P with P the field's landing bit (see
            # _field), 64 for FP8 and IQ4 bytes, 0 for table loads; sum(x) comes back from the scaled values
            for e in tl.static_range(FPW):
                kk = c * CHUNK + rr * FPW + e
                if TABLE:
                    xexp = 64 if BYTES else 0
                else:
                    xexp = 64 if FP8 else 64 + PMAX - (LB * e - ((LB * e - (16 - LB)) // 8) * 8)
                if PERM:
                    xe = tl.load(xrow + tl.load(perm_ptr + kk, mask=live, other=0), mask=live, other=0.0)
                    xe = xe.to(tl.float32)[:, None] * _pow2(xexp)
                elif X_PAIRS:  # bf16 x read two at a time as int32, its exponent raised by XE as it widens
                    if e % 2 == 0:
                        pair = tl.load(xpairs + (kk // 2), mask=live, other=0)[:, None]
                        xe = ((pair << 16) + (xexp << 23)).to(tl.float32, bitcast=True)
                    else:
                        xe = ((pair & -65536) + (xexp << 23)).to(tl.float32, bitcast=True)
                else:
                    xe = tl.load(xrow + kk, mask=live, other=0.0).to(tl.float32)[:, None] * _pow2(xexp)
                if BYTES:
                    if e % 4 == 0:
                        entries = _iq4_bytes(w, e)
                    # byte e % 4 to bits 8..15 of an empty word: the subnormal (entry + 128) * 2^-141
                    prod = _byte_to_bits_8(entries, e % 4).to(tl.float32, bitcast=True) * xe
                elif TABLE:
                    prod = tl.load(tab_ptr + ((w >> (4 * e)) & 0xF)) * xe
                else:
                    prod = _field(w, h, e, LB, HB, FP8) * xe
                if e == 0:
                    t = prod
                    if SUMS:
                        xs = xe * _pow2(-xexp)
                else:
                    t += prod
                    if SUMS:
                        xs += xe * _pow2(-xexp)
            part = tl.sum(t, axis=0, keep_dims=True)
            if BYTES:
                part = part * _pow2(141 - 64) - 128.0 * tl.sum(xs)  # entries came in 128 higher
            elif not TABLE:
                part = part * _dq_unit(LB, FP8)
            if SUMS:
                xs = tl.sum(xs)  # a scalar: no layout to reconcile with the columns'
            else:
                xs = 0.0
            g = c * CHUNK // GROUP
            cmask = (nmask & ((offs_n * 0 + c) < c_end))[None, :]
            s, z, mn = _group_params(sc_ptr, d_ptr, z_ptr, m_ptr, dm_ptr, g, offs_n[None, :], cmask, sc_stride,
                                     d_stride, z_stride, m_stride, dm_stride, GROUP, SUPER, SC_INT, ZKIND, ZC, ZB,
                                     ZOFF, MKIND, BR)  # fmt: skip
            acc += s * (part - z * xs) + mn * xs
    finish_split(tl.sum(acc, axis=0), offs_n, nmask, b_ptr, o_ptr, o_stride, part_ptr, lock_ptr, n, n_tiles, split,
                 HAS_BIAS, SPLIT, BLOCK_N)  # fmt: skip


@triton.jit
def _planes_values(lo_ptr, hi_ptr, sc_ptr, d_ptr, z_ptr, m_ptr, dm_ptr, tab_ptr, kk, nn, mask, lo_stride, hi_stride,
                   sc_stride, d_stride, z_stride, m_stride, dm_stride, LB: tl.constexpr, HB: tl.constexpr,
                   GROUP: tl.constexpr, SUPER: tl.constexpr, SC_INT: tl.constexpr, ZKIND: tl.constexpr,
                   ZC: tl.constexpr, ZB: tl.constexpr, ZOFF: tl.constexpr, MKIND: tl.constexpr, BR: tl.constexpr,
                   TABLE: tl.constexpr, FP8: tl.constexpr):
    """Elements W[nn, kk] (broadcast shapes; kk in the planes' own row order), float32: one per lane."""
    FPW: tl.constexpr = 32 // LB
    kw = kk // FPW
    e = kk % FPW
    w = tl.load(lo_ptr + kw.to(tl.int64) * lo_stride + nn, mask=mask, other=0)
    q = (w >> (e * LB)) & ((1 << LB) - 1)
    if HB > 0:
        R: tl.constexpr = LB // HB
        hw = tl.load(hi_ptr + (kw // R).to(tl.int64) * hi_stride + nn, mask=mask, other=0)
        pos = (LB * (e + 1) + (kw % R) * HB) % 32
        q = q | (((hw >> pos) & ((1 << HB) - 1)) << LB)
    if TABLE:
        v = tl.load(tab_ptr + q, mask=mask, other=0.0)
    elif FP8:
        bits = ((q & 0x7F) << 20) | ((q & 0x80) << 24)
        v = bits.to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2^120
    else:
        v = q.to(tl.float32)
    s, z, mn = _group_params(sc_ptr, d_ptr, z_ptr, m_ptr, dm_ptr, kk // GROUP, nn, mask, sc_stride, d_stride,
                             z_stride, m_stride, dm_stride, GROUP, SUPER, SC_INT, ZKIND, ZC, ZB, ZOFF, MKIND,
                             BR)  # fmt: skip
    return s * (v - z) + mn


@triton.jit
def _planes_tile(lo_ptr, hi_ptr, sc_ptr, d_ptr, z_ptr, m_ptr, dm_ptr, tab_ptr, k0, k, offs_n, nmask, lo_stride,
                 hi_stride, sc_stride, d_stride, z_stride, m_stride, dm_stride, LB: tl.constexpr, HB: tl.constexpr,
                 GROUP: tl.constexpr, SUPER: tl.constexpr, SC_INT: tl.constexpr, ZKIND: tl.constexpr,
                 ZC: tl.constexpr, ZB: tl.constexpr, ZOFF: tl.constexpr, MKIND: tl.constexpr, BR: tl.constexpr,
                 TABLE: tl.constexpr, FP8: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """W^T[k0:k0+BLOCK_K, offs_n] as float32 (planes row order), from whole words: each lo word loaded once
    and split into its fields, each group's scale, zero and minimum loaded once and spread over its rows."""
    FPW: tl.constexpr = 32 // LB
    KW: tl.constexpr = BLOCK_K // FPW
    kw = k0 // FPW + tl.arange(0, KW)
    wmask = (kw < k // FPW)[:, None] & nmask[None, :]
    w = tl.load(lo_ptr + kw[:, None].to(tl.int64) * lo_stride + offs_n[None, :], mask=wmask, other=0)
    e = tl.arange(0, FPW)
    q = (w[:, None, :] >> (e * LB)[None, :, None]) & ((1 << LB) - 1)  # [KW, FPW, BLOCK_N]
    if HB > 0:
        R: tl.constexpr = LB // HB
        hw = tl.load(hi_ptr + (kw // R)[:, None].to(tl.int64) * hi_stride + offs_n[None, :], mask=wmask, other=0)
        pos = (LB * (e[None, :] + 1) + (kw % R)[:, None] * HB) % 32  # [KW, FPW] (relayout.hi_position)
        q = q | (((hw[:, None, :] >> pos[:, :, None]) & ((1 << HB) - 1)) << LB)
    q = tl.reshape(q, [BLOCK_K, BLOCK_N])
    if TABLE:
        v = iq4_value(q)  # shifts of two constants: a gather per element would go through the cache
    elif FP8:
        bits = ((q & 0x7F) << 20) | ((q & 0x80) << 24)
        v = bits.to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2^120
    else:
        v = q.to(tl.float32)
    # groups in the tile: BLOCK_K / GROUP of them, or one when a group spans several tiles
    GT: tl.constexpr = BLOCK_K // GROUP if BLOCK_K >= GROUP else 1
    g = (k0 + tl.arange(0, GT) * (BLOCK_K // GT)) // GROUP
    gmask = (g * GROUP < k)[:, None] & nmask[None, :]
    s, z, mn = _group_params(sc_ptr, d_ptr, z_ptr, m_ptr, dm_ptr, g[:, None], offs_n[None, :], gmask, sc_stride,
                             d_stride, z_stride, m_stride, dm_stride, GROUP, SUPER, SC_INT, ZKIND, ZC, ZB, ZOFF,
                             MKIND, BR)  # fmt: skip
    scale = tl.reshape(tl.broadcast_to(s[:, None, :], [GT, BLOCK_K // GT, BLOCK_N]), [BLOCK_K, BLOCK_N])
    offset = mn - s * z  # value = scale * q + (min - scale * zero)
    offset = tl.reshape(tl.broadcast_to(offset[:, None, :], [GT, BLOCK_K // GT, BLOCK_N]), [BLOCK_K, BLOCK_N])
    return scale * v + offset


@triton.jit
def _planes_gemm_kernel(
    x_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, z_ptr, m_ptr, dm_ptr, perm_ptr, tab_ptr, b_ptr, o_ptr,
    m, n, k, x_stride, lo_stride, hi_stride, sc_stride, d_stride, z_stride, m_stride, dm_stride, o_stride,
    LB: tl.constexpr, HB: tl.constexpr, GROUP: tl.constexpr, SUPER: tl.constexpr, SC_INT: tl.constexpr,
    ZKIND: tl.constexpr, ZC: tl.constexpr, ZB: tl.constexpr, ZOFF: tl.constexpr, MKIND: tl.constexpr,
    BR: tl.constexpr, TABLE: tl.constexpr, FP8: tl.constexpr, PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """A [BLOCK_M, BLOCK_N] output tile: per step a [BLOCK_K, BLOCK_N] weight tile rebuilt in registers from
    whole words (_planes_tile), in x's dtype, into tl.dot. PERM: input rows are read through perm (act-order).
    BLOCK_K is a multiple of the rows one hi word serves (32 for 2-bit fields) and k of BLOCK_K."""
    offs_m, offs_n, mmask, nmask = gemm_tile(m, n, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < k
        if PERM:
            src = tl.load(perm_ptr + offs_k, mask=kmask, other=0)
            a = gemm_x_tile(x_ptr, x_stride, offs_m, src, mmask, kmask)
        else:
            a = gemm_x_tile(x_ptr, x_stride, offs_m, offs_k, mmask, kmask)
        b = _planes_tile(lo_ptr, hi_ptr, sc_ptr, d_ptr, z_ptr, m_ptr, dm_ptr, tab_ptr, k0, k, offs_n, nmask,
                         lo_stride, hi_stride, sc_stride, d_stride, z_stride, m_stride, dm_stride, LB, HB, GROUP,
                         SUPER, SC_INT, ZKIND, ZC, ZB, ZOFF, MKIND, BR, TABLE, FP8, BLOCK_K, BLOCK_N)  # fmt: skip
        acc = dot_tiles(a, b, acc, UPCAST)
    gemm_store(o_ptr, o_stride, b_ptr, acc, offs_m, offs_n, mmask, nmask, HAS_BIAS)


@triton.jit
def _planes_rows_kernel(
    ids_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, z_ptr, m_ptr, dm_ptr, perm_ptr, tab_ptr, o_ptr,
    k, lo_stride, hi_stride, sc_stride, d_stride, z_stride, m_stride, dm_stride, o_stride,
    LB: tl.constexpr, HB: tl.constexpr, GROUP: tl.constexpr, SUPER: tl.constexpr, SC_INT: tl.constexpr,
    ZKIND: tl.constexpr, ZC: tl.constexpr, ZB: tl.constexpr, ZOFF: tl.constexpr, MKIND: tl.constexpr,
    BR: tl.constexpr, TABLE: tl.constexpr, FP8: tl.constexpr, PERM: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Row ids[program 0] of W (its input rows in their original order), float32, BLOCK_K at a time."""
    i = tl.program_id(0).to(tl.int64)
    col = tl.load(ids_ptr + i)
    offs = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = offs < k
    v = _planes_values(lo_ptr, hi_ptr, sc_ptr, d_ptr, z_ptr, m_ptr, dm_ptr, tab_ptr, offs, col, mask, lo_stride,
                       hi_stride, sc_stride, d_stride, z_stride, m_stride, dm_stride, LB, HB, GROUP, SUPER, SC_INT,
                       ZKIND, ZC, ZB, ZOFF, MKIND, BR, TABLE, FP8)  # fmt: skip
    if PERM:
        dst = tl.load(perm_ptr + offs, mask=mask, other=0)
    else:
        dst = offs
    tl.store(o_ptr + i * o_stride + dst, v, mask=mask)


# --- host side ---------------------------------------------------------------------------------------------

_PART_ARGS = ("lo", "hi", "sc", "d", "z", "m", "dm")


def _pointers(w: PackedWeight) -> dict[str, Any]:
    """Kernel arguments naming each part (a stand-in where a layout has none) and their row strides."""
    p = w.parts
    lo = p["lo"]
    args: dict[str, Any] = {}
    for name in _PART_ARGS:
        t = p.get(name, lo)
        args[f"{name}_ptr"] = t
        args[f"{name}_stride"] = t.stride(0)
    args["perm_ptr"] = p.get("perm", lo)
    args["tab_ptr"] = p.get("tab", lo)
    return args


def _constexprs(w: PackedWeight) -> dict[str, int]:
    m = w.meta
    return {
        "LB": int(m["lb"]), "HB": int(m["hb"]), "GROUP": int(m["group"]), "SUPER": int(m["super"]) or int(m["group"]),
        "SC_INT": int(m["sc_int"]), "ZKIND": int(m["zkind"]), "ZC": int(m["zc"]), "ZB": int(m["zb"]),
        "ZOFF": int(m["zoff"]), "MKIND": int(m["mkind"]), "BR": int(m["br"]), "TABLE": int(m["table"]),
        "FP8": int(m["fp8"]), "PERM": int(m["perm"]),
    }  # fmt: skip


def chunk_size(w: PackedWeight) -> int:
    """Inputs per GEMV chunk: the group, or a part of it of at most 16 lo words per column."""
    lb, group = int(w.meta["lb"]), int(w.meta["group"])
    chunk = min(group, 8 * (32 // lb))
    while group % chunk:
        chunk //= 2
    return chunk


def planes_gemv_tile(source: str, n: int, k: int, rows: int, tuning: Tuning) -> Tile:
    """The decode tile for one packed matrix: a benchmark's or test's override (GEMV_OVERRIDE[source], or
    ["planes"] for every layout), else the tuning's table (tuning.planes_tile), narrowed (fewer warps, the
    same columns per thread) while even the deepest split would leave fewer programs than the target keeps
    busy: a 4096-wide output in 512-column tiles is 8 tiles."""
    for key in (source, "planes"):
        if key in GEMV_OVERRIDE:
            return GEMV_OVERRIDE[key]
    tile = planes_tile(tuning, source, n, k)
    if tile.split_k:
        return tile
    block_n, warps = tile.block_n, tile.num_warps
    splits = min(MAX_SPLIT, max(1, k // max(1, tile.block_k)))
    while warps > 1 and cdiv(n, block_n) * rows * splits < tuning.decode_programs:
        block_n, warps = block_n // 2, warps // 2
    if block_n == tile.block_n:
        return tile
    return dataclasses.replace(tile, block_n=block_n, num_warps=warps, extra=dict(tile.extra))


def _check(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None) -> None:
    check_dims("x", x, 2)
    check_float("x", x)
    n, k = w.shape
    require(x.shape[1] == k, f"{w.meta.get('source')} weight is {tuple(w.shape)}, x has {x.shape[1]} columns")
    require(w.parts["lo"].shape[1] == n, f"planes of {n} columns hold {w.parts['lo'].shape[1]}")
    check_same_device(x, w.parts["lo"], *([bias] if bias is not None else []))
    if bias is not None:
        require(bias.shape == (n,), f"bias must be [{n}]")


def planes_linear(
    x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None, *, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x [m, k] @ W^T for a planes weight W [n, k]; float32 sums, output in x's dtype unless out_dtype."""
    _check(x, w, bias)
    x = unit_stride_last(x)
    n, k = w.shape
    m = x.shape[0]
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    tuning = tuning_for_device(x.device)
    common = dict(x_ptr=x, b_ptr=bias if bias is not None else x, o_ptr=out, n=n, k=k, x_stride=x.stride(0),
                  o_stride=out.stride(0), HAS_BIAS=bias is not None, **_pointers(w), **_constexprs(w))  # fmt: skip
    if m <= GEMV_MAX_ROWS:
        chunk = chunk_size(w)
        tile = planes_gemv_tile(str(w.meta.get("source")), n, k, m, tuning)
        # a step covers block_k // 8 lo words per column (block_k inputs at 4 bits; half as many bytes', twice
        # as many 2-bit ones), in at most 8 chunks
        lb = int(w.meta["lb"])
        cps = max(1, min(8, tile.block_k // 8 * (32 // lb) // chunk))
        pairs = x.dtype == torch.bfloat16 and not w.meta["perm"] and x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0
        prmt = tuning.backend == "cuda" and bool(w.meta["table"])
        launch_gemv(
            _planes_gemv_kernel, tile, n, m, cdiv(k // chunk, cps), cps, x.device, tuning,
            programs=tuning.planes_programs, CHUNK=chunk, CPS=cps, X_PAIRS=pairs, PRMT=prmt, BLOCK_N=tile.block_n,
            **common,
        )  # fmt: skip
    else:
        tile = tuning.planes_gemm
        lb, hb = int(w.meta["lb"]), int(w.meta["hb"])
        block_k = tile.block_k
        while block_k % ((32 // lb) * (lb // hb if hb else 1)):  # whole lo words, whole hi words
            block_k *= 2
        launch(
            _planes_gemm_kernel, (cdiv(m, tile.block_m), cdiv(n, tile.block_n)), tile, m=m,
            UPCAST=tuning.upcast_dot, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=block_k, **common,
        )  # fmt: skip
    return out


def planes_rows(w: PackedWeight, ids: torch.Tensor, tuning: Tuning | None = None) -> torch.Tensor:
    """float32 [len(ids), k]: rows `ids` of W (embedding lookups), dequantized on the device."""
    n, k = w.shape
    ids = ids.reshape(-1).contiguous()
    out = torch.empty((ids.numel(), k), dtype=torch.float32, device=ids.device)
    tuning = tuning or tuning_for_device(ids.device)
    block = min(1024, 1 << max(0, k - 1).bit_length())
    launch(
        _planes_rows_kernel, (ids.numel(), cdiv(k, block)), Tile(num_warps=4, num_stages=1), ids_ptr=ids, o_ptr=out,
        k=k, o_stride=out.stride(0), BLOCK_K=block, **_pointers(w), **_constexprs(w),
    )  # fmt: skip
    return out
