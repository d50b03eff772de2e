"""Packed weights rearranged once, at upload, into the one layout the GPU kernels read: "planes".

GGUF blocks interleave scales with quants in runs of 18 to 210 bytes, GPTQ packs along the input dim and AWQ
along the output dim in a shuffled order. A decode GEMV wants each thread to load 16 aligned bytes that
hold the same input rows of several output columns, so one activation serves them all. So every packed
matrix [n, k] becomes the same bits regrouped (nothing is widened to floats):

- "lo": int32 [k * LB / 32, n]: the low LB bits (2, 4 or 8) of each value, 32 / LB consecutive input rows per
  word (field e at bits e * LB), output columns contiguous.
- "hi" (HB = 1 or 2 more bits, 5-, 6- and 3-bit types): int32 [k * HB / 32, n]. Word w serves the R = LB / HB
  lo words R*w .. R*w+R-1; the high bits of field e of lo word R*w+j sit at bit (LB*(e+1) + j*HB) mod 32, just
  above where the field sits in its lo word, so one shift lines up both (see planes.py).
- "sc": the scale of each group of GROUP input rows, [k / GROUP, ceil(n / BR)]: float (GPTQ, AWQ, Q4_0, FP8, ...)
  or a small integer (K-quant sub-block scales) multiplied by "d" [k / SUPER, n] (float16, per super-block).
- a zero point, constant (meta "zc": Q4_0 8, Q8_0 128 once its int8 is stored offset, Q6_K 32, ...) or per
  group ("z": GPTQ's packed int32 [k / GROUP, n * ZB / 32], or uint8 [k / GROUP, n]), or a per-group minimum
  ("m": float, Q4_1/Q5_1; or uint8 times "dm" [k / SUPER, n] float16, Q2_K/Q4_K/Q5_K).
- IQ4 codes index "tab" (the 16 float values of the code book); FP8 bytes are e4m3 as stored.
- "perm" int32 [k]: GPTQ act-order, input rows sorted by group (the kernels read x through it).

Value of element (k, n): scale * (q - zero), scale * q + min, or scale * table[q] / scale * fp8(q).
"""

from __future__ import annotations

from typing import Any

import torch

from poot_core import PackedWeight, Reason, Unsupported

LAYOUT = "planes"

# ggml's code book of IQ4_NL and IQ4_XS (kvalues_iq4nl)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# AWQ's GEMM packing: nibble i of a word holds column AWQ_ORDER[i] of its eight
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

# the meta every planes weight carries, with its defaults
DEFAULTS: dict[str, Any] = {
    "lb": 4, "hb": 0, "group": 32, "super": 0, "sc_int": 0, "zkind": 0, "zc": 0, "zb": 0, "zoff": 0,
    "mkind": 0, "br": 1, "table": 0, "fp8": 0, "perm": 0,
}  # fmt: skip


def is_planes(w: Any) -> bool:
    return isinstance(w, PackedWeight) and w.layout == LAYOUT


def source_kind(w: PackedWeight) -> str:
    """The stored layout a weight came from ("gguf.Q4_K", "gptq.4", ...): what users and errors name."""
    return str(w.meta.get("source", w.kind)) if is_planes(w) else w.kind


# --- bit packing ------------------------------------------------------------------------------------------


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) -> the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_lo(values: torch.Tensor, lb: int) -> torch.Tensor:
    """Integer values [k, n] below 2^lb -> int32 [k * lb / 32, n], 32 / lb consecutive rows per word."""
    per = 32 // lb
    k, n = values.shape
    v = values.to(torch.int64).reshape(k // per, per, n)
    shifts = (torch.arange(per, device=values.device, dtype=torch.int64) * lb).view(1, per, 1)
    return _to_int32((v << shifts).sum(dim=1))


def hi_position(lb: int, hb: int, j: int, e: int) -> int:
    """Bit of hi word holding the high bits of field e of the j-th lo word it serves."""
    return (lb * (e + 1) + j * hb) % 32


def pack_hi(values: torch.Tensor, lb: int, hb: int) -> torch.Tensor:
    """High parts [k, n] (below 2^hb) of values whose low lb bits go to pack_lo -> int32 [k * hb / 32, n]."""
    per, r = 32 // lb, lb // hb
    k, n = values.shape
    v = values.to(torch.int64).reshape(k // (per * r), r, per, n)
    pos = torch.tensor(
        [[hi_position(lb, hb, j, e) for e in range(per)] for j in range(r)], device=values.device, dtype=torch.int64
    )
    return _to_int32((v << pos.view(1, r, per, 1)).sum(dim=(1, 2)))


def unpack_lo(words: torch.Tensor, lb: int) -> torch.Tensor:
    """int32 [kw, n] -> int64 [kw * 32 / lb, n] (the inverse of pack_lo)."""
    per = 32 // lb
    shifts = (torch.arange(per, device=words.device, dtype=torch.int64) * lb).view(1, per, 1)
    v = (words.to(torch.int64).unsqueeze(1) >> shifts) & ((1 << lb) - 1)
    return v.reshape(words.shape[0] * per, words.shape[1])


def _planes(shape: tuple[int, int], source: str, parts: dict[str, torch.Tensor], **meta: Any) -> PackedWeight:
    full = {**DEFAULTS, **meta, "source": source}
    return PackedWeight(LAYOUT, shape, {k: v.contiguous() for k, v in parts.items()}, full)


# --- GGUF -------------------------------------------------------------------------------------------------


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """float16 [n, blocks] stored at byte `at` of every block of b [n, blocks, bytes]."""
    return b[:, :, at : at + 2].contiguous().view(torch.float16).squeeze(-1)


def _nibbles16(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32]: low nibbles are elements 0-15, high nibbles 16-31."""
    return torch.cat((qs & 0xF, qs >> 4), dim=-1)


def _bits32(b: torch.Tensor, at: int) -> torch.Tensor:
    """The 32 bits of the little-endian u32 at byte `at` of each block: [n, blocks, 32], bit j for element j."""
    raw = b[:, :, at : at + 4].to(torch.int64)
    word = raw[..., 0] | (raw[..., 1] << 8) | (raw[..., 2] << 16) | (raw[..., 3] << 24)
    return (word.unsqueeze(-1) >> torch.arange(32, device=b.device)) & 1


def _bit_planes(bytes_: torch.Tensor) -> torch.Tensor:
    """K-quant high-bit bytes [n, blocks, 32]: bit s of byte l is element 32*s + l -> [n, blocks, 256]."""
    s = torch.arange(8, device=bytes_.device, dtype=torch.uint8).view(1, 1, 8, 1)
    return ((bytes_.unsqueeze(2) >> s) & 1).reshape(*bytes_.shape[:2], 256)


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """K-quant 2-bit quants [n, blocks, 64] -> [n, blocks, 256]: per 32-byte half, shifts 0, 2, 4, 6 in turn."""
    s = torch.tensor([0, 2, 4, 6], device=qs.device, dtype=torch.uint8).view(1, 1, 1, 4, 1)
    return ((qs.reshape(*qs.shape[:2], 2, 1, 32) >> s) & 3).reshape(*qs.shape[:2], 256)


def _k4_scales(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 bytes of 6-bit scales and mins of Q4_K/Q5_K -> two uint8 [n, blocks, 8]."""
    a, m, c = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scales = torch.cat((a & 63, (c & 0xF) | ((a >> 6) << 4)), dim=-1)
    mins = torch.cat((m & 63, (c >> 4) | ((m >> 6) << 4)), dim=-1)
    return scales, mins


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K quants [n, blocks, 128] -> [n, blocks, 256]: per 32 bytes, 32 low nibbles then 32 high."""
    s = torch.tensor([0, 4], device=qs.device, dtype=torch.uint8).view(1, 1, 1, 2, 1)
    return ((qs.reshape(*qs.shape[:2], 4, 1, 32) >> s) & 0xF).reshape(*qs.shape[:2], 256)


def _rows_to_cols(t: torch.Tensor) -> torch.Tensor:
    """[n, blocks, per] -> [blocks * per, n]."""
    return t.reshape(t.shape[0], -1).t()


def _gguf_fields(t: str, b: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Integer fields of GGUF blocks b [n, blocks, bytes] as [k or groups, n] tensors, and the planes meta."""
    if t in ("Q4_0", "IQ4_NL"):
        q = _nibbles16(b[..., 2:18])
        meta = {"zc": 8, "zkind": 1} if t == "Q4_0" else {"table": 1}
        return {"q": q, "sc": _f16(b, 0).unsqueeze(-1)}, {"lb": 4, "group": 32, **meta}
    if t == "Q4_1":
        q = _nibbles16(b[..., 4:20])
        return {"q": q, "sc": _f16(b, 0).unsqueeze(-1), "m": _f16(b, 2).unsqueeze(-1)}, {"group": 32, "mkind": 1}
    if t == "Q5_0":
        q = _nibbles16(b[..., 6:22]).to(torch.int64) | (_bits32(b, 2) << 4)
        return {"q": q, "sc": _f16(b, 0).unsqueeze(-1)}, {"hb": 1, "group": 32, "zkind": 1, "zc": 16}
    if t == "Q5_1":
        q = _nibbles16(b[..., 8:24]).to(torch.int64) | (_bits32(b, 4) << 4)
        fields = {"q": q, "sc": _f16(b, 0).unsqueeze(-1), "m": _f16(b, 2).unsqueeze(-1)}
        return fields, {"hb": 1, "group": 32, "mkind": 1}
    if t == "Q8_0":
        q = b[..., 2:34] ^ 0x80  # int8 + 128, as unsigned
        return {"q": q, "sc": _f16(b, 0).unsqueeze(-1)}, {"lb": 8, "group": 32, "zkind": 1, "zc": 128}
    if t == "Q2_K":
        s = b[..., 0:16]
        fields = {"q": _crumbs(b[..., 16:80]), "sc": s & 0xF, "d": _f16(b, 80).unsqueeze(-1), "m": s >> 4,
                  "dm": _f16(b, 82).unsqueeze(-1)}  # fmt: skip
        return fields, {"lb": 2, "group": 16, "super": 256, "sc_int": 1, "mkind": 2}
    if t == "Q3_K":
        sc = b[..., 96:108]
        low = torch.cat((sc[..., 0:8] & 0xF, sc[..., 0:8] >> 4), dim=-1)
        shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).view(1, 1, 4, 1)
        high = ((sc[..., 8:12].unsqueeze(2) >> shifts) & 3).reshape(*b.shape[:2], 16)
        scales = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8)
        # a set hmask bit is the +4 of the 3-bit value: q3 = crumb | hbit << 2, value d * sc * (q3 - 4)
        q = _crumbs(b[..., 32:96]).to(torch.int64) | (_bit_planes(b[..., 0:32]).to(torch.int64) << 2)
        fields = {"q": q, "sc": scales, "d": _f16(b, 108).unsqueeze(-1)}
        return fields, {"lb": 2, "hb": 1, "group": 16, "super": 256, "sc_int": 1, "zkind": 1, "zc": 4}
    if t in ("Q4_K", "Q5_K"):
        scales, mins = _k4_scales(b[..., 4:16])
        if t == "Q4_K":
            q, hb = _k_nibbles(b[..., 16:144]).to(torch.int64), 0
        else:
            q, hb = _k_nibbles(b[..., 48:176]).to(torch.int64) | (_bit_planes(b[..., 16:48]).to(torch.int64) << 4), 1
        fields = {"q": q, "sc": scales, "d": _f16(b, 0).unsqueeze(-1), "m": mins, "dm": _f16(b, 2).unsqueeze(-1)}
        return fields, {"hb": hb, "group": 32, "super": 256, "sc_int": 1, "mkind": 2}
    if t == "Q6_K":
        n, nb = b.shape[:2]
        ql, qh = b[..., 0:128], b[..., 128:192]
        low = (ql.reshape(n, nb, 2, 1, 64) >> torch.tensor([0, 4], device=b.device, dtype=torch.uint8).view(
            1, 1, 1, 2, 1)) & 0xF  # fmt: skip
        high = (qh.reshape(n, nb, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).view(
            1, 1, 1, 4, 1)) & 3  # fmt: skip
        q = low.reshape(n, nb, 2, 4, 32).to(torch.int64) | (high.to(torch.int64) << 4)
        fields = {"q": q.reshape(n, nb, 256), "sc": b[..., 192:208].contiguous().view(torch.int8),
                  "d": _f16(b, 208).unsqueeze(-1)}  # fmt: skip
        return fields, {"hb": 2, "group": 16, "super": 256, "sc_int": 1, "zkind": 1, "zc": 32}
    if t == "IQ4_XS":
        n, nb = b.shape[:2]
        sh = b[..., 2].to(torch.int32) | (b[..., 3].to(torch.int32) << 8)
        ib = torch.arange(8, device=b.device)
        low = (b[..., 4:8][..., ib // 2].to(torch.int32) >> (4 * (ib % 2))) & 0xF
        high = (sh.unsqueeze(-1) >> (2 * ib)) & 3
        scales = ((low | (high << 4)) - 32).to(torch.int8)
        q = _nibbles16(b[..., 8:136].reshape(n, nb, 8, 16)).reshape(n, nb, 256)
        return {"q": q, "sc": scales, "d": _f16(b, 0).unsqueeze(-1)}, {"group": 32, "super": 256, "sc_int": 1,
                                                                     "table": 1}  # fmt: skip
    raise Unsupported(Reason.QUANTIZATION, f"gguf.{t}", "no planes layout for this GGUF block type")


GGUF_BLOCKS: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34), "Q2_K": (256, 84),
    "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "IQ4_NL": (32, 18),
    "IQ4_XS": (256, 136),
}  # fmt: skip


def _gguf_rows(t: str, blocks: torch.Tensor, k: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Planes parts of some rows of a GGUF matrix, and the meta."""
    elems, size = GGUF_BLOCKS[t]
    fields, meta = _gguf_fields(t, blocks.reshape(blocks.shape[0], k // elems, size))
    meta = {"lb": 4, **meta}
    lb, hb = meta["lb"], meta.get("hb", 0)
    q = _rows_to_cols(fields.pop("q").to(torch.int64))
    parts = {"lo": pack_lo(q & ((1 << lb) - 1), lb)}
    if hb:
        parts["hi"] = pack_hi(q >> lb, lb, hb)
    for name, v in fields.items():
        parts[name] = _rows_to_cols(v)
    return parts, meta


def from_gguf(w: PackedWeight, rows_at_once: int = 2048) -> PackedWeight:
    """GGUF blocks to planes, a few thousand rows at a time (the unpacked values are 8 bytes each)."""
    t = str(w.meta.get("type"))
    if t not in GGUF_BLOCKS:
        raise Unsupported(Reason.QUANTIZATION, f"gguf.{t}", f"GPU kernels know {sorted(GGUF_BLOCKS)}")
    elems, size = GGUF_BLOCKS[t]
    n, k = w.shape
    blocks = w.parts["blocks"]
    if k % elems or blocks.shape != (n, k // elems * size):
        raise Unsupported(Reason.SHAPE, f"gguf.{t} matrix {tuple(blocks.shape)}", f"rows of {k} values")
    pieces = [_gguf_rows(t, blocks[i : i + rows_at_once], k) for i in range(0, n, rows_at_once)]
    meta = pieces[0][1]
    parts = {name: torch.cat([p[name] for p, _ in pieces], dim=1) for name in pieces[0][0]}
    if meta.get("table"):
        parts["tab"] = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=blocks.device)
    return _planes((n, k), w.kind, parts, **meta)


# --- GPTQ, AWQ --------------------------------------------------------------------------------------------


def _unpack_bits(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 [rows, c] read as one little-endian bit stream per column along rows -> int64 [count, c] fields
    of `bits` bits (GPTQ's 3-bit packing: 32 values in 3 words; the same as unpack_lo for 2, 4, 8)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    start = torch.arange(count, device=words.device, dtype=torch.int64) * bits
    word, bit = start // 32, start % 32
    low = w[word] >> bit.view(-1, 1)
    nxt = w[torch.clamp(word + 1, max=w.shape[0] - 1)] << (32 - bit).view(-1, 1)
    return (low | torch.where((bit + bits > 32).view(-1, 1), nxt, 0)) & ((1 << bits) - 1)


def from_gptq(w: PackedWeight) -> PackedWeight:
    """GPTQ 2/3/4/8-bit. Act-order (a g_idx that is not k // group) sorts the input rows by group once."""
    bits = int(w.meta.get("bits", 4))
    if bits not in (2, 3, 4, 8):
        raise Unsupported(Reason.QUANTIZATION, f"gptq.{bits}", "GPU kernels compute 2, 3, 4 and 8-bit GPTQ")
    n, k = w.shape
    p = w.parts
    qweight, qzeros, scales = p["qweight"], p["qzeros"], p["scales"]
    g = p["g_idx"].to(torch.int64)
    groups = scales.shape[0]
    zoff = 0 if w.meta.get("checkpoint_format") == "gptq_v2" else 1
    source = f"gptq.{bits}"
    if k % 32:
        raise Unsupported(Reason.SHAPE, f"{source} with {k} inputs", "GPU kernels need k divisible by 32")
    plain = torch.arange(k, device=g.device) // max(1, -(-k // groups))
    group = k // groups if k % groups == 0 else 0
    sorted_rows = None
    if not (group and torch.equal(g, plain)):
        # act-order: rows sorted by group make every group contiguous again, if the groups are all one size
        if not (group and bool((torch.bincount(g, minlength=groups) == group).all())):
            raise Unsupported(Reason.QUANTIZATION, f"{source} with groups of unequal sizes", "GPU kernels")
        sorted_rows = torch.argsort(g, stable=True)
    if bits == 3:
        q = _unpack_bits(qweight, 3, k)
        zeros = _unpack_bits(qzeros.t().contiguous(), 3, n).t()
    else:
        q = unpack_lo(qweight, bits) if sorted_rows is not None else None
        zeros = None
    if sorted_rows is not None:
        q = q[sorted_rows]
    meta: dict[str, Any] = {"group": group, "zoff": zoff, "perm": int(sorted_rows is not None)}
    parts: dict[str, torch.Tensor] = {"sc": scales}
    if bits == 3:
        parts.update(lo=pack_lo(q & 3, 2), hi=pack_hi(q >> 2, 2, 1), z=zeros.to(torch.uint8))
        meta.update(lb=2, hb=1, zkind=3)
    else:
        parts["lo"] = pack_lo(q, bits) if q is not None else qweight
        parts["z"] = qzeros
        meta.update(lb=bits, zkind=2, zb=bits)
    if sorted_rows is not None:
        parts["perm"] = sorted_rows.to(torch.int32)
    return _planes((n, k), source, parts, **meta)


def from_awq(w: PackedWeight) -> PackedWeight:
    n, k = w.shape
    group = int(w.meta.get("group_size", 128))
    group = k if group <= 0 else group
    if k % group or group % 32:
        raise Unsupported(Reason.SHAPE, f"awq.4 with group {group} over {k} inputs", "whole groups of 32s")
    order = torch.tensor([AWQ_ORDER.index(j) for j in range(8)], device=w.parts["qweight"].device)

    def columns(packed: torch.Tensor) -> torch.Tensor:
        nib = unpack_lo(packed.t().contiguous(), 4).t().reshape(packed.shape[0], packed.shape[1], 8)
        return nib[:, :, order].reshape(packed.shape[0], -1)

    q = columns(w.parts["qweight"])  # [k, n]
    zeros = columns(w.parts["qzeros"]).to(torch.uint8)
    parts = {"lo": pack_lo(q, 4), "sc": w.parts["scales"], "z": zeros}
    return _planes((n, k), "awq.4", parts, lb=4, group=group, zkind=3)


# --- FP8 --------------------------------------------------------------------------------------------------


def from_fp8(w: PackedWeight) -> PackedWeight:
    n, k = w.shape
    weight, scale = w.parts["weight"], w.parts["scale"].float()
    if k % 32:
        raise Unsupported(Reason.SHAPE, f"{w.kind} with {k} inputs", "GPU kernels need k divisible by 32")
    lo = pack_lo(weight.contiguous().view(torch.uint8).t(), 8)
    granularity = w.meta["granularity"]
    if granularity == "tensor":
        sc, group, br = scale.reshape(1, 1).expand(1, n), k, 1
    elif granularity == "channel":
        sc, group, br = scale.reshape(1, n), k, 1
    else:
        br, bc = (int(v) for v in w.meta["block"])
        if k % bc or bc % 32:
            raise Unsupported(Reason.SHAPE, f"{w.kind} block {br}x{bc} over {k} inputs", "whole blocks of 32s")
        sc, group = scale.t(), bc
    return _planes((n, k), w.kind, {"lo": lo, "sc": sc}, lb=8, group=group, br=br, fp8=1)


def to_planes(w: PackedWeight) -> PackedWeight | None:
    """The planes form of a 2-D packed matrix, or None for weights kept as stored (3-D stacked experts)."""
    if len(w.shape) != 2:
        return None
    if w.layout == "gguf":
        return from_gguf(w)
    if w.layout == "gptq":
        return from_gptq(w)
    if w.layout == "awq":
        return from_awq(w)
    if w.layout == "fp8":
        return from_fp8(w)
    return None


# --- after upload: rows for embeddings, joined matrices --------------------------------------------------


COLUMN_PARTS = ("lo", "hi", "sc", "d", "z", "m", "dm")


def _width(name: str, meta: dict[str, Any], n: int) -> int | None:
    """Entries of a column part's last dim covering n output columns (None: n does not split evenly)."""
    per = int(meta["br"]) if name == "sc" else 1
    if name == "z" and int(meta["zkind"]) == 2:
        if n * int(meta["zb"]) % 32:
            return None
        return n * int(meta["zb"]) // 32
    return n // per if n % per == 0 else None


def join(parts: list[PackedWeight]) -> tuple[PackedWeight, list[PackedWeight]] | None:
    """Planes matrices with one layout and k stacked along n (q/k/v, gate/up): the joined weight and each
    original as a view into it, or None when they cannot share one kernel."""
    first = parts[0]
    same = {k: v for k, v in first.meta.items() if k != "source"}
    if any({k: v for k, v in p.meta.items() if k != "source"} != same or set(p.parts) != set(first.parts)
           or p.shape[1] != first.shape[1] for p in parts) or "perm" in first.parts:  # fmt: skip
        return None  # (act-order rows are sorted per matrix)
    widths = [{name: _width(name, same, p.shape[0]) for name in COLUMN_PARTS if name in p.parts} for p in parts]
    if any(w is None for ws in widths for w in ws.values()):
        return None
    joined_parts = {
        name: torch.cat([p.parts[name] for p in parts], dim=1) if name in COLUMN_PARTS else t
        for name, t in first.parts.items()
    }
    joined = PackedWeight(LAYOUT, (sum(p.shape[0] for p in parts), first.shape[1]), joined_parts, dict(first.meta))
    views, start = [], dict.fromkeys(widths[0], 0)
    for p, ws in zip(parts, widths, strict=True):
        view = dict(joined_parts)
        for name, width in ws.items():
            view[name] = joined_parts[name][:, start[name] : start[name] + width]
            start[name] += width
        views.append(PackedWeight(LAYOUT, p.shape, view, dict(p.meta)))
    return joined, views


def select_columns(w: PackedWeight, cols: torch.Tensor) -> PackedWeight:
    """The output rows `cols` of a planes matrix (embedding lookups), gathered on the device."""
    meta = w.meta
    if int(meta["br"]) != 1 or (int(meta["zkind"]) == 2):
        raise Unsupported(Reason.QUANTIZATION, f"{source_kind(w)} embedding", "per-column scales only")
    parts = {name: (t.index_select(1, cols) if name in COLUMN_PARTS else t) for name, t in w.parts.items()}
    return PackedWeight(LAYOUT, (int(cols.numel()), w.shape[1]), parts, dict(meta))
