"""x @ W^T for a packed W, computed from the packed bytes, never from a float copy of the whole matrix.

Routes:
- the GGUF block types of C_TYPES (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, the K-quants, IQ4_XS): a C kernel,
  built once per machine with the system C compiler and cached, reads the memory-mapped blocks directly. For a
  few rows (decode) it computes y = sum_b d_b * (c_b . x_b) + m_b * sum(x_b) per output row in float32 (AVX-512
  or AVX2), decoding each block's codes once for all rows; for many rows (prefill) panels of 16 weight rows x
  512 values are dequantized, exactly, once each and met by every 6 rows of x in a register-tiled float32 FMA
  kernel (csrc/gemm.c). The embedding lookup (embed_rows) dequantizes only the picked rows through the same
  kernels.
- every other layout and type, or no C compiler: tiles of a few MB are dequantized by
  poot_core.checkpoint.quant.dequantize (vectorized torch) and multiplied with torch's matmul.
All routes multiply exactly dequantized weights with float32 accumulation; they differ only in summation order.
With LoadOptions(cpu_activations="q8") (GGUF only) the decode product of every type of Q8_TYPES (all of
C_TYPES) quantizes each row of x to 8 bits per 32 values and sums integer products (csrc/q8dot.c): llama.cpp's
arithmetic, not exact (about 1e-2 relative), and so do a serving step's rows (poot_gemm_q8: x quantized once,
each row's result bit for bit its decode result); prefill stays on the exact panels (faster here, see tiles).
Dense bf16/f16 weights (dense16_gemv, dense16_tiles) follow the same two routes from their exactly widened
values. Set POOT_CPU_KERNELS=0 to force the torch route. The C is csrc/quant32.c, kquant.c, kquant_low.c,
dense16.c, gather.c and q8dot.c, built by poot_core.cpu.c_kernels.

`fast=True` is an explicit, less exact option for the 4-bit GGUF types with an affine form (Q4_0, Q4_1, Q4_K):
their codes are re-laid once, losslessly, into torch's packed int4 CPU format (same 4 bits per weight) and the
product runs in torch's int4 kernel with bfloat16 activations and scales (about 1e-3 relative error). On the
2-core AVX-512 development machine that kernel is far slower than the C route (6 ms against 0.03 ms for a
1536 x 576 matrix-vector product), so it is not the default anywhere.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from poot_core.checkpoint.layouts import PackedWeight
from poot_core.checkpoint.quant import dequantize
from poot_core.checkpoint.quant import gguf_blocks as gb
from poot_core.cpu.c_kernels import kernels

TILE_BYTES = 4 << 20
# Up to this many input rows the fused kernel (which re-reads each weight row once per input row, from cache)
# beats dequantize-then-matmul.
# FUSED_MAX_ROWS bounds the C kernels' per-row accumulators too.
FUSED_MAX_ROWS = 4
# A step of up to this many rows (a decode step, a speculative verify step, a short prompt's last chunk) computes
# every row as a decode step does: its products take the decode kernels (dense16_gemv; few_rows_product in the
# executor, whose rows.c meets FUSED_MAX_ROWS rows a call) and its attention attend_few (c_attention.MAX_QUERIES).
# A verify step then gives each position the bits a decode step gives, so greedy speculation cannot part from
# plain decoding, and it reads the weights once for all its rows: on the CPU a verify of 9 tokens costs little
# more than one decode step.
DECODE_ROWS = 16


@dataclass(frozen=True)
class CKernel:
    """The C functions that compute from one GGUF block type, and the type id they take as first argument.

    Every pair has the same two signatures (declared in c_kernels.SIGNATURES):
      gemv(type, w, row_bytes, n, nb, x, m, y, threads): y[m, n] = x[m, nb * block] @ W^T for m <= FUSED_MAX_ROWS,
        read straight from the n rows of nb blocks, row_bytes apart;
      dequant(type, w, row_bytes, rows, nb, out, threads): out[rows, nb * block] = the exactly dequantized rows.
    """

    type_id: int
    gemv: str
    dequant: str
    # Where its one-row decode route sums in another order than its routes for 2-4 rows (more accumulators for
    # one row, or a one-row shortcut), a serving step gives each row a call of its own, so that a row's result
    # is a lone decode row's whatever shares the step: "always", "avx512f" (only in builds with AVX-512), "".
    one_row_route: str = ""
    # A C function of gemv's signature that takes any number of rows itself, each row's result the one gemv
    # gives it alone (a serving step's product, instead of csrc/rows.c's calls of `few` rows), or "".
    many: str = ""


# The registration point: one entry per GGUF block type with a C kernel (block sizes from gguf_blocks).
C_TYPES: dict[str, CKernel] = {
    "Q4_0": CKernel(0, "poot_gemv", "poot_dequant", many="poot_gemv_many"),
    "Q4_1": CKernel(1, "poot_gemv", "poot_dequant", many="poot_gemv_many"),
    "Q8_0": CKernel(2, "poot_gemv", "poot_dequant", many="poot_gemv_many"),
    "Q5_0": CKernel(6, "poot_gemv", "poot_dequant", many="poot_gemv_many"),
    "Q5_1": CKernel(7, "poot_gemv", "poot_dequant", many="poot_gemv_many"),
    "IQ4_NL": CKernel(8, "poot_gemv", "poot_dequant", many="poot_gemv_many"),
    "Q4_K": CKernel(3, "poot_gemv_k", "poot_dequant_k", "avx512f"),
    "Q5_K": CKernel(4, "poot_gemv_k", "poot_dequant_k", "avx512f"),
    "Q6_K": CKernel(5, "poot_gemv_k", "poot_dequant_k", "avx512f"),
    "Q2_K": CKernel(0, "poot_gemv_kl", "poot_dequant_kl", "always"),
    "Q3_K": CKernel(1, "poot_gemv_kl", "poot_dequant_kl", "always"),
    "IQ4_XS": CKernel(2, "poot_gemv_kl", "poot_dequant_kl", "always"),
}


# Decode products with 8-bit activations (LoadOptions(cpu_activations="q8"), marked on the weight as
# meta["cpu_activations"] == "q8"): csrc/q8dot.c's poot_gemv_q8 and its type ids. Every type of C_TYPES has one,
# so none keeps the exact route under q8; prefill (tiles) stays exact for all.
Q8_TYPES: dict[str, int] = {
    "Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q5_0": 3, "Q5_1": 4, "IQ4_NL": 5,
    "Q4_K": 6, "Q5_K": 7, "Q6_K": 8, "IQ4_XS": 9, "Q2_K": 10, "Q3_K": 11,
}


@dataclass(frozen=True)
class _Plan:
    """What a C product from one weight needs, worked out once per weight."""

    gemv: Callable[..., None]
    dequant: Callable[..., None]
    dequant_address: int
    type_id: int
    address: int
    row_bytes: int
    out_features: int
    blocks_per_row: int
    in_features: int
    gemv_type: int  # the type id gemv takes (type_id for the exact kernels, a Q8_TYPES id for poot_gemv_q8)
    rows: Callable[..., None]  # csrc/rows.c's poot_gemv_rows: gemv over any number of rows, `few` a call
    gemv_address: int
    few: int  # rows per gemv call in poot_gemv_rows: FUSED_MAX_ROWS, or 1 (see CKernel.one_row_route)
    many: Callable[..., None] | None  # CKernel.many, or poot_gemm_q8 where x is quantized to q8
    block: int  # values per block
    block_bytes: int
    panels: Callable[..., None]  # csrc/gemm.c's poot_gemm_panels (the exact prefill product)
    block_type: int  # the type's id in csrc/blocks.h (= Q8_TYPES): poot_gemm_panels' vector decoder

    def few_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """flat: float32 [m, in] contiguous. Beyond FUSED_MAX_ROWS rows (a batched serving step) the type's `many`
        kernel takes them all, or the decode kernel meets them `few` at a time over cache-sized chunks of W
        (csrc/rows.c); either way W is read from memory once and each row's result is the one a decode step of
        that row alone gives. Types whose lone row sums in another order (few == 1) give 2-4 rows a call
        each too."""
        m = flat.shape[0]
        y = torch.empty(m, self.out_features)
        grouped = m <= FUSED_MAX_ROWS and (m == 1 or self.few > 1)  # a lone row's bits from one gemv call
        if grouped or (m > FUSED_MAX_ROWS and self.many is not None):
            (self.gemv if grouped else self.many)(
                self.gemv_type, self.address, self.row_bytes, self.out_features, self.blocks_per_row,
                flat.data_ptr(), m, y.data_ptr(), torch.get_num_threads())
        else:
            self.rows(self.gemv_address, self.gemv_type, self.address, self.row_bytes, self.out_features,
                      self.blocks_per_row, flat.data_ptr(), m, self.in_features, self.few, y.data_ptr(),
                      torch.get_num_threads())
        return y

    def tiles(self, flat: torch.Tensor) -> torch.Tensor:
        """The product of many rows (prefill) in C: panels of W dequantized exactly and float32 FMA sums
        (poot_gemm_panels), under q8 too: there poot_gemm_q8 (x quantized once, the decode kernel's integer sums)
        measured slower on the AVX2 machine (it decodes each weight group once per 4 rows, the panels once per
        call), so it serves only serving steps' rows, which must give their decode bits."""
        flat = flat.contiguous()
        m, n = flat.shape[0], self.out_features
        out = torch.empty(m, n)
        self.panels(self.dequant_address, self.type_id, self.block_type, self.address, self.row_bytes, n,
                    self.blocks_per_row, self.block, self.block_bytes, flat.data_ptr(), m, out.data_ptr(),
                    torch.get_num_threads())
        return out


_plans: weakref.WeakKeyDictionary[PackedWeight, _Plan] = weakref.WeakKeyDictionary()


def _plan(w: PackedWeight, lib: ctypes.CDLL) -> _Plan:
    plan = _plans.get(w)
    if plan is None:
        blocks, kind = w.parts["blocks"], C_TYPES[w.meta["type"]]
        elements, size = gb.BLOCK_SIZES[w.meta["type"]]
        dequant = getattr(lib, kind.dequant)
        q8 = w.meta.get("cpu_activations") == "q8" and w.meta["type"] in Q8_TYPES
        gemv, gemv_type = (lib.poot_gemv_q8, Q8_TYPES[w.meta["type"]]) if q8 else (getattr(lib, kind.gemv),
                                                                                     kind.type_id)
        plan = _Plan(gemv, dequant, ctypes.cast(dequant, ctypes.c_void_p).value or 0,
                     kind.type_id, blocks.data_ptr(), blocks.stride(0), w.shape[0], w.shape[1] // elements,
                     w.shape[1], gemv_type, lib.poot_gemv_rows, ctypes.cast(gemv, ctypes.c_void_p).value or 0,
                     1 if not q8 and _own_row_calls(kind, lib) else FUSED_MAX_ROWS,
                     lib.poot_gemm_q8 if q8 else getattr(lib, kind.many) if kind.many else None,
                     elements, size, lib.poot_gemm_panels, Q8_TYPES[w.meta["type"]])
        _plans[w] = plan
    return plan


def _own_row_calls(kind: CKernel, lib: ctypes.CDLL) -> bool:
    """Whether this build's kernel for the type sums a lone row in another order than rows in groups."""
    from poot_core.cpu.c_kernels import features

    return kind.one_row_route == "always" or (kind.one_row_route != "" and kind.one_row_route in features(lib))


def _c_route(flat: torch.Tensor, w: PackedWeight, lib: ctypes.CDLL) -> torch.Tensor:
    plan = _plan(w, lib)
    return plan.few_rows(flat.contiguous()) if flat.shape[0] <= FUSED_MAX_ROWS else plan.tiles(flat)


def few_rows_product(w: PackedWeight, max_rows: int = FUSED_MAX_ROWS
                     ) -> Callable[..., torch.Tensor | None] | None:
    """For a weight the C kernel reads, a function of float32 x [..., in] giving x @ W^T with the per-call
    lookups and checks of packed_linear done once, here (they cost more than a small decode product). It
    returns None for more than max_rows rows, and the caller uses packed_linear. A serving step passes more
    than FUSED_MAX_ROWS (fusion.ROWWISE_MAX): its rows then get the decode kernel's arithmetic, whatever else
    shares the step. Its `lone` argument, for a step of more rows: the first `lone` rows (decode tokens) still
    get the decode kernel's arithmetic, the rest packed_linear's tiles."""
    if not uses_c_kernel(w):
        return None
    lib = kernels()
    assert lib is not None  # uses_c_kernel checked it
    plan = _plan(w, lib)

    def product(x: torch.Tensor, lone: int = 0) -> torch.Tensor | None:
        flat = x.reshape(-1, plan.in_features)
        if flat.dtype != torch.float32:
            return None
        if flat.shape[0] <= max_rows:
            return plan.few_rows(flat.contiguous()).reshape(*x.shape[:-1], plan.out_features)
        if lone <= 0:
            return None
        y = torch.empty(flat.shape[0], plan.out_features)
        y[:lone] = plan.few_rows(flat[:lone].contiguous())
        y[lone:] = _c_route(flat[lone:], w, lib)
        return y.reshape(*x.shape[:-1], plan.out_features)

    return product


def embed_rows(table: PackedWeight, tokens: torch.Tensor) -> torch.Tensor | None:
    """The rows `tokens` (int, any shape) of a packed table as float32 [tokens.numel(), in], dequantized by the C
    kernel straight from the blocks (the token embedding lookup); None where the C kernel does not read this
    table, and the caller dequantizes the picked rows with torch. IndexError for a token outside the table."""
    lib = kernels()
    if lib is None or not (table in _plans or uses_c_kernel(table)):
        return None
    plan = _plan(table, lib)
    index = tokens.reshape(-1).to(torch.int64).contiguous()
    count = index.numel()
    if count:
        low, high = (min(v := index.tolist()), max(v)) if count <= 16 else (int(index.min()), int(index.max()))
        if low < 0 or high >= plan.out_features:
            raise IndexError(f"token {low if low < 0 else high} is outside the embedding table of "
                             f"{plan.out_features} rows")
    out = torch.empty(count, plan.in_features)
    lib.poot_gather_rows(plan.dequant_address, plan.type_id, plan.address, plan.row_bytes, plan.blocks_per_row,
                         plan.in_features, index.data_ptr(), count, out.data_ptr(), torch.get_num_threads())
    return out


def dense16_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """float32 x [..., k] (at most DECODE_ROWS rows) @ W^T for a bf16/f16 W [n, k] with unit column stride,
    computed as the float32 product (weights widened exactly in registers; each row's result the one it gets
    alone); None where the C kernels are not available or the shapes do not fit, and the caller uses torch."""
    lib = kernels()
    flat = x.reshape(-1, x.shape[-1])
    if (lib is None or w.dim() != 2 or w.dtype not in (torch.bfloat16, torch.float16) or w.stride(1) != 1
            or flat.shape[0] > DECODE_ROWS or flat.dtype != torch.float32):
        return None
    flat = flat.contiguous()
    n, k = w.shape
    y = torch.empty(flat.shape[0], n)
    lib.poot_gemv16(w.data_ptr(), w.stride(0), n, k, flat.data_ptr(), flat.shape[0], y.data_ptr(),
                    int(w.dtype == torch.float16), torch.get_num_threads())
    return y.reshape(*x.shape[:-1], n)


def dense16_tiles(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """float32 x [..., k] @ W^T for a bf16/f16 W [n, k] as the float32 product: panels of W's rows widened
    exactly and float32 FMA sums in C (csrc/gemm.c), or without the C kernels tiles widened into a reused
    float32 buffer, each multiplied by torch's float32 matmul. None where W is not such a matrix.
    Also on a CPU with a native 16-bit product (AMX, AVX-512 BF16): oneDNN's would round x and the output to
    16 bits, and that rounding compounds over layers (a bf16 hybrid model's logits moved by 0.7 against the
    float32 reference), so the float32 route is kept for exactness."""
    if w.dim() != 2 or w.dtype not in (torch.bfloat16, torch.float16) or x.dtype != torch.float32:
        return None
    n, k = w.shape
    flat = x.reshape(-1, k)
    lib = kernels()
    if lib is not None and w.stride(1) == 1:
        flat = flat.contiguous()
        y = torch.empty(flat.shape[0], n)
        widen = ctypes.cast(lib.poot_widen16, ctypes.c_void_p).value or 0
        lib.poot_gemm_panels(widen, int(w.dtype == torch.float16), -1, w.data_ptr(), 2 * w.stride(0), n, k, 1, 2,
                             flat.data_ptr(), flat.shape[0], y.data_ptr(), torch.get_num_threads())
        return y.reshape(*x.shape[:-1], n)
    tile = min(n, tile_rows(k))
    buffer = torch.empty(tile, k)
    out = torch.empty(flat.shape[0], n)
    for start in range(0, n, tile):
        rows = min(tile, n - start)
        buffer[:rows].copy_(w[start : start + rows])
        out[:, start : start + rows] = flat @ buffer[:rows].T
    return out.reshape(*x.shape[:-1], n)


def tile_rows(in_features: int) -> int:
    """Output rows per torch tile: about TILE_BYTES of float32, a multiple of 16."""
    return max(16, (TILE_BYTES // (4 * max(in_features, 1))) // 16 * 16)


def _tiled(flat: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    in_features = w.shape[-1]
    out_features = w.shape[0] if len(w.shape) == 2 else int(torch.tensor(w.shape[:-1]).prod())
    out = torch.empty(flat.shape[0], out_features)
    tile = tile_rows(in_features)
    for start in range(0, out_features, tile):
        rows = slice(start, min(start + tile, out_features))
        out[:, rows] = flat @ dequantize(w, rows).T
    return out


def uses_c_kernel(w: PackedWeight) -> bool:
    blocks, kind = w.parts.get("blocks"), w.meta.get("type")
    if w.layout != "gguf" or len(w.shape) != 2 or kind not in C_TYPES or blocks is None:
        return False
    elements, size = gb.BLOCK_SIZES[kind]
    return (
        blocks.dim() == 2
        and blocks.stride(1) == 1
        and w.shape[1] % elements == 0
        and tuple(blocks.shape) == (w.shape[0], w.shape[1] // elements * size)
        and kernels() is not None
    )


INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
_INT4_CACHE: weakref.WeakKeyDictionary[PackedWeight, tuple[torch.Tensor, torch.Tensor]] = weakref.WeakKeyDictionary()


def _int4_codes_and_affine(w: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes int32 [out, in] in 0..15 and per-32 group scale, offset [out, in / 32] with value = code * s + o."""
    kind, out_f = w.meta["type"], w.shape[0]
    b = w.parts["blocks"].reshape(-1, gb.BLOCK_SIZES[kind][1])
    if kind == "Q4_K":
        codes = gb._k_nibbles(b[:, 16:144])
        scales, mins = gb._k4_scales(b[:, 4:16])
        s, o = gb._f16(b, 0) * scales.float(), -(gb._f16(b, 2) * mins.float())
    else:
        start = 2 if kind == "Q4_0" else 4
        codes = gb._nibbles(b[:, start : start + 16])
        s = gb._f16(b, 0)
        o = -8 * s if kind == "Q4_0" else gb._f16(b, 2)
    return codes.reshape(out_f, -1).to(torch.int32), s.reshape(out_f, -1), o.reshape(out_f, -1)


def _int4_packed(w: PackedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    cached = _INT4_CACHE.get(w)
    if cached is None:
        codes, s, o = _int4_codes_and_affine(w)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        # torch's int4 kernel computes (code - 8) * scale + zero.
        scales_zeros = torch.stack((s, o + 8 * s), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        cached = _INT4_CACHE[w] = (packed, scales_zeros)
    return cached


def packed_linear(
    x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None, *, fast: bool = False
) -> torch.Tensor:
    """x float32 [..., in] -> float32 [..., out]; fast=True trades exactness for speed where a route exists."""
    in_features = w.shape[-1]
    if fast and w.layout == "gguf" and w.meta.get("type") in INT4_TYPES and len(w.shape) == 2:
        packed, scales_zeros = _int4_packed(w)
        flat16 = x.reshape(-1, in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat16, packed, 32, scales_zeros).float()
    else:
        flat = x.reshape(-1, in_features).float()
        lib = kernels() if (w in _plans or uses_c_kernel(w)) else None
        y = _c_route(flat, w, lib) if lib is not None else _tiled(flat, w)
    if bias is not None:
        y += bias.float()
    return y.reshape(*x.shape[:-1], y.shape[-1])
