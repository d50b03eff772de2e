"""GGUF block types decoded with vectorized torch ops, written from ggml's published block layouts.

Every decoder takes a uint8 tensor [n_blocks, type_size] (one row per block) and returns float32
[n_blocks, block_size]. Scales are float16 in the file and widened to float32 before use, and the order of the
float operations follows ggml's own dequantization (scale * q + min, d * sc * q - dmin * m) so results agree
with the `gguf` package's reference to the last bit or within one rounding step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

QK_K = 256  # elements per K-quant super-block

# The non-linear 4-bit code book of IQ4_NL and IQ4_XS.
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

# name -> (elements per block, bytes per block)
BLOCK_SIZES: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q2_K": (QK_K, 84),
    "Q3_K": (QK_K, 110),
    "Q4_K": (QK_K, 144),
    "Q5_K": (QK_K, 176),
    "Q6_K": (QK_K, 210),
    "IQ4_NL": (32, 18),
    "IQ4_XS": (QK_K, 136),
}


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """float32 [n, 1] of the little-endian float16 stored at byte `at` of each block."""
    return b[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 2k] values: all low nibbles first, then all high nibbles (ggml's order)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _high_bits32(b: torch.Tensor, at: int) -> torch.Tensor:
    """The 32 single bits of a little-endian u32 at byte `at`, as uint8 [n, 32] (bit j for element j)."""
    raw = b[:, at : at + 4]
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((raw.unsqueeze(-1) >> shifts) & 1).reshape(-1, 32)


def q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = _nibbles(b[:, 2:18]).to(torch.int8) - 8
    return d * q.float()


def q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    return d * _nibbles(b[:, 4:20]).float() + m


def q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = (_nibbles(b[:, 6:22]) | (_high_bits32(b, 2) << 4)).to(torch.int8) - 16
    return d * q.float()


def q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[:, 8:24]) | (_high_bits32(b, 4) << 4)
    return d * q.float() + m


def q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    return d * b[:, 2:34].contiguous().view(torch.int8).float()


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """2-bit fields of K-quant `qs` [n, 64] -> [n, 256]: per 32-byte half, shifts 0, 2, 4, 6 in turn."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    return ((qs.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, QK_K)


def q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 0:16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (scales & 0x0F).float()).view(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).view(n, 16, 1)
    q = _crumbs(b[:, 16:80]).view(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, sc = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    d = _f16(b, 108)
    # 16 six-bit scales: low nibbles from bytes 0-7 (low then high half), top two bits from bytes 8-11.
    low = torch.cat((sc[:, 0:8] & 0x0F, sc[:, 0:8] >> 4), dim=-1)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 4, 1)
    high = ((sc[:, 8:12].unsqueeze(1) >> shifts) & 3).reshape(n, 16)
    scales = (low | (high << 4)).to(torch.int16) - 32
    dl = (d * scales.float()).view(n, 16, 1)
    ql = _crumbs(qs)
    # Bit k of hmask byte l belongs to element 32k + l; a clear bit means "subtract 4".
    hm = ((hmask.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1).reshape(n, QK_K)
    q = ql.to(torch.int16) - ((hm ^ 1).to(torch.int16) << 2)
    return (dl * q.view(n, 16, 16).float()).reshape(n, QK_K)


def _k4_scales(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and 8 six-bit mins packed in 12 bytes (Q4_K, Q5_K) -> two uint8 [n, 8]."""
    a, m, c = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scales = torch.cat((a & 63, (c & 0x0F) | ((a >> 6) << 4)), dim=-1)
    mins = torch.cat((m & 63, (c >> 4) | ((m >> 6) << 4)), dim=-1)
    return scales, mins


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K `qs` [n, 128] -> [n, 256]: each 32-byte chunk gives 32 low nibbles, then 32 high nibbles."""
    chunks = qs.reshape(-1, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
    return (chunks & 0x0F).reshape(-1, QK_K)


def _q45_k(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    scales, mins = _k4_scales(b[:, 4:16])
    dl = (d * scales.float()).view(n, 8, 1)
    ml = (dmin * mins.float()).view(n, 8, 1)
    return (dl * q.view(n, 8, 32).float() - ml).reshape(n, QK_K)


def q4_k(b: torch.Tensor) -> torch.Tensor:
    return _q45_k(b, _k_nibbles(b[:, 16:144]))


def q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qh = b[:, 16:48]
    # Bit k of qh byte l is the fifth bit of element 32k + l.
    high = ((qh.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1).reshape(n, QK_K)
    return _q45_k(b, _k_nibbles(b[:, 48:176]) | (high << 4))


def q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh, sc = b[:, 0:128], b[:, 128:192], b[:, 192:208]
    d = _f16(b, 208)
    # Per 128-element half: ql 64 bytes (low nibbles -> elements 0-63, high nibbles -> 64-127), qh 32 bytes
    # holding the top two bits of the four 32-element groups at shifts 0, 2, 4, 6.
    low = (ql.reshape(n, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)) & 0x0F
    low = low.reshape(n, 2, 4, 32)
    high = (qh.reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 3
    q = (low | (high << 4)).to(torch.int8) - 32
    scales = sc.contiguous().view(torch.int8).float()
    dl = (d * scales).view(n, 16, 1)
    return (dl * q.reshape(n, 16, 16).float()).reshape(n, QK_K)


def iq4_nl(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    table = torch.tensor(IQ4_VALUES, dtype=torch.float32)
    return d * table[_nibbles(b[:, 2:18]).long()]


def iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    scales_h = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    scales_l = b[:, 4:8]
    ib = torch.arange(8)
    low = (scales_l[:, ib // 2].to(torch.int32) >> (4 * (ib % 2))) & 0x0F
    high = (scales_h >> (2 * ib)) & 3
    dl = (d * ((low | (high << 4)) - 32).float()).view(n, 8, 1)
    q = _nibbles(b[:, 8:136].reshape(n * 8, 16)).reshape(n, 8, 32)
    table = torch.tensor(IQ4_VALUES, dtype=torch.float32)
    return (dl * table[q.long()]).reshape(n, QK_K)


DECODERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q4_0": q4_0,
    "Q4_1": q4_1,
    "Q5_0": q5_0,
    "Q5_1": q5_1,
    "Q8_0": q8_0,
    "Q2_K": q2_k,
    "Q3_K": q3_k,
    "Q4_K": q4_k,
    "Q5_K": q5_k,
    "Q6_K": q6_k,
    "IQ4_NL": iq4_nl,
    "IQ4_XS": iq4_xs,
}

# Dense types a GGUF file may hold inside a PackedWeight-free tensor; listed so dequantize() can widen them too.
DENSE_GGUF = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def dequantize_rows(blocks: torch.Tensor, type_name: str) -> torch.Tensor:
    """uint8 [rows, bytes_per_row] of one block type -> float32 [rows, elements_per_row]."""
    rows, row_bytes = blocks.shape
    if type_name in DENSE_GGUF:
        dense = DENSE_GGUF[type_name]
        columns = row_bytes // torch.empty((), dtype=dense).element_size()
        if blocks.numel() == 0:  # an empty matrix stays well-formed (views of empty bytes cannot change dtype)
            return torch.zeros(rows, columns)
        return blocks.contiguous().view(dense).float().reshape(rows, columns)
    block, size = BLOCK_SIZES[type_name]
    flat = blocks.reshape(rows * (row_bytes // size), size)  # explicit sizes: an empty matrix stays well-formed
    return DECODERS[type_name](flat).reshape(rows, row_bytes // size * block)
