"""Host side of the kernels in cl/: each function builds the bound launch(es) of one kernel call.

Shapes are in values; every activation is float32. Weights are read in their stored format: the format's
decode file (cl/fmt_<name>.cl) is compiled into the linear and embed kernels of that format.
"""

from __future__ import annotations

from typing import Any

from poot_core.errors import Reason, Unsupported

from .launch import Arr, DeviceWeight, Launch, Slot, rounded
from .runtime import Runtime

TILE = 8  # tokens per work-group of the linear kernel (cl/linear.cl)
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2, "relu": 3, "sigmoid": 4}
# format -> (values per block, bytes per block)
FORMATS: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2),
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "IQ4_NL": (32, 18), "IQ4_XS": (256, 136),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
}
_KERNEL_HELPERS = {"gemv": ("activate",)}  # cl/gemv.cl's gemv_gated applies an activation
_HELPERS = {"IQ4_NL": ("iq4_values",), "IQ4_XS": ("iq4_values",), "Q4_K": ("kscale",), "Q5_K": ("kscale",)}

Buffer = Arr | Slot
ELEMENTWISE = ("activate", "elementwise")


def row_bytes(fmt: str, cols: int) -> int:
    values, nbytes = FORMATS[fmt]
    return cols // values * nbytes


def format_sources(fmt: str, kernels: str = "linear") -> tuple[str, ...]:
    if fmt not in FORMATS:
        raise Unsupported(Reason.QUANTIZATION, fmt, f"the OpenCL kernels read {', '.join(FORMATS)}")
    return ("common", *_HELPERS.get(fmt, ()), *_KERNEL_HELPERS.get(kernels, ()), f"fmt_{fmt.lower()}", kernels)


def _k(rt: Runtime, sources: tuple[str, ...], name: str, **defines: Any) -> Any:
    return rt.kernel(sources, name, **defines)


def gemv_shape(rt: Runtime, w: DeviceWeight) -> tuple[int, int] | None:
    """(work-group size, rows a work-group) of cl/gemv.cl for one-token products of `w`, or None where it does
    not apply (a dense row not 16-byte aligned, read by cl/linear.cl instead). Dense rows take 64 work-items
    each (8 values a 16-byte load), GGUF rows 32 (a 32-value piece each); the group is what the device allows
    for the built kernel (its registers can lower the device's limit)."""
    dense = FORMATS[w.fmt][0] == 1
    if dense and (w.row_bytes % 16 or w.cols < 8):
        return None
    group = rt.limits.gemv_group
    while True:
        lanes = min(64 if dense else 32, group)
        kernel = _k(rt, format_sources(w.fmt, "gemv"), "gemv", GEMV_GROUP=group, GEMV_ROWS=group // lanes)
        allowed = kernel.get_work_group_info(rt.cl.kernel_work_group_info.WORK_GROUP_SIZE, rt.device)
        if allowed >= group or group <= 16:
            return group, group // lanes
        group //= 2


def linear(rt: Runtime, w: DeviceWeight, x: Arr, y: Arr, tokens: int, bias: Arr | None = None,
           gate: tuple[Arr, int, int] | None = None) -> Launch:
    """y[t, :] = W x[t] (+ bias); `gate` = (weights [tokens, experts], experts, e): an expert's product.
    One token: cl/gemv.cl where the layout allows; otherwise (and for several tokens) cl/linear.cl."""
    g, stride, col = gate if gate is not None else (rt.dummy, 0, -1)
    shape = gemv_shape(rt, w) if tokens == 1 else None
    if shape is not None:
        group, rows = shape
        kernel = _k(rt, format_sources(w.fmt, "gemv"), "gemv", GEMV_GROUP=group, GEMV_ROWS=rows)
        return Launch(rt, kernel, (-(-w.rows // rows) * group,), (group,),
                      [w, w.row_bytes, w.row0, x, w.cols, w.rows, y, 0, bias or rt.dummy, bias is not None, g, col])
    kernel = _k(rt, format_sources(w.fmt), "linear")
    group = rt.limits.group
    return Launch(rt, kernel, (w.rows * group, -(-tokens // TILE)), (group, 1),
                  [w, w.row_bytes, w.row0, x, 0, w.cols, tokens, y, 0, w.rows, bias or rt.dummy, bias is not None,
                   g, stride, col])


def fusable(rt: Runtime, ws: list[DeviceWeight]) -> bool:
    """Whether one-token products of `ws` (2 or 3 matrices of one x) can share one cl/gemv.cl launch: one
    format and width, each read by gemv."""
    first = ws[0]
    return (2 <= len(ws) <= 3 and all(w.fmt == first.fmt and w.cols == first.cols and w.row_bytes == first.row_bytes
                                      for w in ws) and gemv_shape(rt, first) is not None)


def linear_many(rt: Runtime, ws: list[DeviceWeight], x: Arr, ys: list[Arr], biases: list[Arr | None]) -> Launch:
    """One token's products of 2 or 3 matrices with the same x (q/k/v, gate/up) in one launch (cl/gemv.cl
    gemv3); each matrix stays in its own buffer and writes its own output. Check `fusable` first."""
    shape = gemv_shape(rt, ws[0])
    assert shape is not None and fusable(rt, ws)
    group, per = shape
    kernel = _k(rt, format_sources(ws[0].fmt, "gemv"), "gemv3", GEMV_GROUP=group, GEMV_ROWS=per)
    pad = 3 - len(ws)  # two matrices: the third range is empty
    rows = [w.rows for w in ws] + [0] * pad
    ws, ys, biases = [*ws, *[ws[0]] * pad], [*ys, *[ys[0]] * pad], [*biases, *[None] * pad]
    groups = sum(-(-r // per) for r in rows)
    mask = sum(1 << i for i, b in enumerate(biases) if b is not None)
    return Launch(rt, kernel, (groups * group,), (group,),
                  [*ws, ws[0].row_bytes, *(w.row0 for w in ws), x, ws[0].cols, *rows, *ys,
                   *(b or rt.dummy for b in biases), mask])


def gated_fusable(rt: Runtime, gate: DeviceWeight, up: DeviceWeight) -> bool:
    """Whether one token's gate and up products and their gated activation can be one cl/gemv.cl gemv_gated
    launch: one format and shape, read by gemv with at least two rows a work-group."""
    shape = gemv_shape(rt, gate) if fusable(rt, [gate, up]) and gate.rows == up.rows else None
    return shape is not None and shape[1] >= 2


def linear_gated(rt: Runtime, gate: DeviceWeight, up: DeviceWeight, x: Arr, y: Arr, act: str,
                 chosen: tuple[Arr, int] | None = None) -> Launch:
    """y = act(gate x) * up x for one token in one launch; `chosen` = (routing weights [1, experts], e): an
    expert's, 0 where the token did not choose it. Check `gated_fusable` first."""
    shape = gemv_shape(rt, gate)
    assert shape is not None and gated_fusable(rt, gate, up)
    group, per = shape
    g, col = chosen if chosen is not None else (rt.dummy, -1)
    kernel = _k(rt, format_sources(gate.fmt, "gemv"), "gemv_gated", GEMV_GROUP=group, GEMV_ROWS=per)
    return Launch(rt, kernel, (-(-gate.rows // (per // 2)) * group,), (group,),
                  [gate, up, gate.row_bytes, gate.row0, up.row0, x, gate.cols, gate.rows, y, ACTIVATIONS[act], g,
                   col])


def embed(rt: Runtime, w: DeviceWeight, ids: Arr, out: Arr, tokens: int, scale: float) -> Launch:
    group = rt.limits.group
    return Launch(rt, _k(rt, format_sources(w.fmt), "embed"), (tokens * group,), (group,),
                  [w, w.row_bytes, w.rows, w.cols, ids, out, scale])


NORM_REGISTERS = 32  # most values of a row one work-item of rms_norm keeps in registers


def rms_norm(rt: Runtime, x: Arr, w: Arr, out: Arr, tokens: int, width: int, eps: float, offset: float,
             residual: Arr | None = None, sum_out: Arr | None = None) -> Launch:
    group = rt.limits.gemv_group  # one work-group a row: the widest the products use
    values = -(-width // group)
    kernel = _k(rt, ("common", "norm"), "rms_norm", GROUP=group, NORM_VALS=values if values <= NORM_REGISTERS else 0)
    return Launch(rt, kernel, (tokens * group,), (group,),
                  [x, residual or rt.dummy, residual is not None, sum_out or rt.dummy, w, out, width, eps, offset])


def rope(rt: Runtime, x: Arr, out: Arr, positions: Arr, inv_freq: Arr, tokens: int, heads: int, head_dim: int,
         dim: int, neox: bool, factor: float, cache: Buffer | None = None) -> Launch:
    return Launch(rt, _k(rt, ("rope",), "rope"), (heads, tokens), None,
                  [x, out, positions, inv_freq, heads, head_dim, dim, neox, factor, cache or rt.dummy,
                   cache is not None])


def rope_qkv(rt: Runtime, q: Arr, q_out: Arr, k: Arr, k_out: Arr, v: Arr, k_cache: Buffer, v_cache: Buffer,
             positions: Arr, inv_freq: Arr, tokens: int, q_heads: int, kv_heads: int, head_dim: int, dim: int,
             neox: bool, factor: float) -> Launch:
    """An attention's q and k ropes and its k/v cache writes in one launch (cl/rope.cl rope_qkv); head_dim
    even."""
    return Launch(rt, _k(rt, ("rope",), "rope_qkv"), (head_dim // 2, q_heads + 2 * kv_heads, tokens), None,
                  [q, q_out, k, k_out, v, k_cache, v_cache, positions, inv_freq, q_heads, kv_heads, head_dim, dim,
                   neox, factor])


def kv_write(rt: Runtime, src: Arr, cache: Buffer, positions: Arr, tokens: int, width: int) -> Launch:
    return Launch(rt, _k(rt, ("rope",), "kv_write"), (rounded(width), tokens), None, [src, cache, positions, width])


def attention_dims(rt: Runtime, head_dim: int) -> int:
    """Values of a head each work-item of the attention kernel holds (a compile-time constant)."""
    return max(1, -(-head_dim // rt.limits.group))


def attention(rt: Runtime, q: Arr, k_cache: Buffer, v_cache: Buffer, positions: Arr, out: Arr, part: Arr,
              tokens: int, heads: int, kv_heads: int, head_dim: int, split_len: int, splits: int, scale: float,
              window: int, softcap: float) -> list[Launch]:
    group = rt.limits.group
    dims = attention_dims(rt, head_dim)
    vec4 = int(head_dim % 4 == 0)
    split = _k(rt, ("common", "attention"), "attention_split", DIMS=dims, VEC4=vec4)
    combine = _k(rt, ("common", "attention"), "attention_combine", DIMS=dims, VEC4=vec4)
    return [
        Launch(rt, split, (splits * group, heads, tokens), (group, 1, 1),
               [q, k_cache, v_cache, positions, part, heads, kv_heads, head_dim, split_len, splits, scale, window,
                softcap]),
        Launch(rt, combine, (tokens * heads * group,), (group,), [part, out, heads, head_dim, splits]),
    ]


def _elementwise(rt: Runtime, name: str, n: int, args: list[Any]) -> Launch:
    return Launch(rt, _k(rt, ELEMENTWISE, name), (rounded(n),), None, args)


def gated(rt: Runtime, gate: Arr, up: Arr, out: Arr, act: str) -> Launch:
    return _elementwise(rt, "gated", out.size, [gate, up, out, out.size, ACTIVATIONS[act]])


def activation(rt: Runtime, x: Arr, out: Arr, act: str) -> Launch:
    return _elementwise(rt, "activation", out.size, [x, out, out.size, ACTIVATIONS[act]])


def binary(rt: Runtime, name: str, a: Arr, b: Arr, out: Arr) -> Launch:
    return _elementwise(rt, name, out.size, [a, b, out, out.size])


def scale(rt: Runtime, x: Arr, out: Arr, factor: float) -> Launch:
    return _elementwise(rt, "scale", out.size, [x, out, out.size, factor])


def softcap(rt: Runtime, x: Arr, out: Arr, cap: float) -> Launch:
    return _elementwise(rt, "softcap", out.size, [x, out, out.size, cap])


def copy(rt: Runtime, src: Arr, out: Arr, count: int, src_offset: int = 0) -> Launch:
    return _elementwise(rt, "copy", count, [src, src_offset, out, count])


def argmax(rt: Runtime, x: Arr, ids: Arr, rows: int, n: int) -> Launch:
    group = rt.limits.gemv_group  # one work-group over a vocabulary's logits: the widest the products use
    return Launch(rt, _k(rt, ELEMENTWISE, "argmax", GROUP=group), (rows * group,), (group,), [x, ids, n])


def moe_route(rt: Runtime, logits: Arr, bias: Arr | None, weights: Arr, tokens: int, experts: int,
              a: dict[str, Any]) -> Launch:
    return Launch(rt, _k(rt, ("moe",), "moe_route", EXPERTS=experts), (tokens,), None,
                  [logits, bias or rt.dummy, bias is not None, weights, tokens, int(a["top_k"]),
                   a["scoring"] == "sigmoid", int(a.get("groups") or 1), int(a.get("topk_groups") or 1),
                   a.get("group_score") == "top2", bool(a["norm_topk"]), float(a["routed_scale"])])


ASSIGN, ADD, SIGMOID, UNIT = 1, 0, 2, 3


def moe_accumulate(rt: Runtime, weights: Arr, stride: int, col: int, y: Arr, out: Arr, width: int, tokens: int,
                   mode: int) -> Launch:
    return Launch(rt, _k(rt, ("moe",), "moe_accumulate", EXPERTS=1), (rounded(width), tokens), None,
                  [weights, stride, col, y, out, width, tokens, mode])


DENSE_FORMATS = ("f32", "bf16", "f16")
_ROUND16 = {"f32": 0, "bf16": 1, "f16": 2}


def _mla_sources(fmt: str) -> tuple[str, ...]:
    return ("common", f"fmt_{fmt}", "mla")


def mla_cache(rt: Runtime, kv: Arr, norm_w: Arr, cache: Buffer, positions: Arr, inv_freq: Arr, tokens: int,
              latent: int, rope_dim: int, eps: float, neox: bool, factor: float) -> Launch:
    """The step's latent rows (normed) and rope keys (rotated) into the latent cache (cl/mla.cl mla_cache)."""
    group = rt.limits.group
    return Launch(rt, _k(rt, _mla_sources("f32"), "mla_cache", ROUND16=0), (tokens * group,), (group,),
                  [kv, norm_w, cache, positions, inv_freq, latent, rope_dim, eps, neox, factor])


def mla_query(rt: Runtime, q: Arr, kv_b: DeviceWeight, out: Arr, positions: Arr, inv_freq: Arr, tokens: int,
              heads: int, nope: int, rope_dim: int, v_dim: int, latent: int, neox: bool, factor: float) -> Launch:
    """Each head's query in the latent cache's space (cl/mla.cl mla_query); kv_b dense (DENSE_FORMATS)."""
    kernel = _k(rt, _mla_sources(kv_b.fmt), "mla_query", ROUND16=_ROUND16[kv_b.fmt])
    return Launch(rt, kernel, (rounded(latent + rope_dim), heads, tokens), None,
                  [q, kv_b, kv_b.row_bytes, kv_b.row0, out, positions, inv_freq, heads, nope, rope_dim, v_dim,
                   latent, neox, factor])


def mla_out(rt: Runtime, o: Arr, kv_b: DeviceWeight, out: Arr, tokens: int, heads: int, nope: int, v_dim: int,
            latent: int, width: int) -> Launch:
    """The attention-weighted latent through kv_b's value rows (cl/mla.cl mla_out)."""
    kernel = _k(rt, _mla_sources(kv_b.fmt), "mla_out", ROUND16=_ROUND16[kv_b.fmt])
    return Launch(rt, kernel, (rounded(v_dim), heads, tokens), None,
                  [o, kv_b, kv_b.row_bytes, kv_b.row0, out, heads, nope, v_dim, latent, width])


def _mla_launch(rt: Runtime, name: str, size: tuple[int, int, int], args: list[Any]) -> Launch:
    return Launch(rt, _k(rt, _mla_sources("f32"), name, ROUND16=0), (rounded(size[0]), size[1], size[2]), None, args)


def mla_expanded(rt: Runtime, q: Arr, kv_b: DeviceWeight, cache: Buffer, positions: Arr, inv_freq: Arr,
                 scratch: dict[str, Arr], out: Arr, tokens: int, capacity: int, heads: int, nope: int,
                 rope_dim: int, v_dim: int, latent: int, hd: int, neox: bool, factor: float, split_len: int,
                 splits: int, scale: float) -> list[Launch]:
    """Latent attention through a kv_b of any format (cl/mla.cl, the expanded form): every cache row's latent
    through kv_b (cl/linear.cl), keys and values per head padded to `hd`, the attention kernels, the first v_dim
    of each head. `scratch`: rows [capacity, latent], expanded [capacity, heads * (nope + v_dim)], keys and
    values [capacity, heads, hd], query and o [tokens, heads, hd], part (the attention's)."""
    s = scratch
    width = latent + rope_dim
    return [
        _mla_launch(rt, "mla_latent_rows", (latent, capacity, 1), [cache, s["rows"], latent, width]),
        linear(rt, kv_b, s["rows"], s["expanded"], capacity),
        _mla_launch(rt, "mla_expanded_kv", (hd, heads, capacity),
                    [s["expanded"], cache, s["keys"], s["values"], heads, nope, rope_dim, v_dim, latent, hd]),
        _mla_launch(rt, "mla_expanded_query", (hd, heads, tokens),
                    [q, s["query"], positions, inv_freq, heads, nope, rope_dim, hd, neox, factor]),
        *attention(rt, s["query"], s["keys"], s["values"], positions, s["o"], s["part"], tokens, heads, heads, hd,
                   split_len, splits, scale, 0, 0.0),
        _mla_launch(rt, "mla_narrow", (v_dim, heads, tokens), [s["o"], out, heads, v_dim, hd]),
    ]
