"""Quantized weight layouts: dequantization, and the PackedWeight of a quantized safetensors layer.

GGUF block types are decoded by gguf_blocks (vectorized torch, written from ggml's block layouts); GPTQ and AWQ
by gptq; FP8 by fp8. `dequantize` is the reference every fast path (poot_core.cpu.packed_linear, the GPU
backends) is compared with; it decodes only the rows asked for, so callers can work tile by tile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from poot_core.checkpoint.layouts import PackedWeight
from poot_core.checkpoint.quant.fp8 import fp8_dequantize
from poot_core.checkpoint.quant.gguf_blocks import BLOCK_SIZES, DENSE_GGUF, dequantize_rows
from poot_core.checkpoint.quant.gptq import awq_dequantize, gptq_dequantize
from poot_core.errors import CheckpointError, Reason, Unsupported

GGUF_TYPES = frozenset(BLOCK_SIZES)
GPTQ_BITS = (2, 4, 8)
FP8_GRANULARITIES = ("tensor", "channel", "block")


def gguf_type_supported(type_name: str) -> bool:
    return type_name in GGUF_TYPES or type_name in DENSE_GGUF


def supported_kinds() -> set[str]:
    """Every PackedWeight.kind that dequantize (and so the CPU) can compute."""
    kinds = {f"gguf.{t}" for t in GGUF_TYPES}
    kinds |= {f"gptq.{b}" for b in GPTQ_BITS}
    kinds |= {"awq.4"} | {f"fp8.{g}" for g in FP8_GRANULARITIES}
    return kinds


def dequantize(w: PackedWeight, rows: slice | None = None) -> torch.Tensor:
    """float32 [selected rows, in] of a packed matrix (the full logical shape when rows is None).

    Rows count over the flattened leading dimensions, so a 3-D GGUF tensor (experts) is [experts * out, in].
    """
    if w.layout == "gguf":
        type_name = str(w.meta.get("type", ""))
        if not gguf_type_supported(type_name):
            raise Unsupported(Reason.QUANTIZATION, w.kind, "no decoder for this GGUF block type")
        blocks = w.parts["blocks"] if rows is None else w.parts["blocks"][rows]
        out = dequantize_rows(blocks, type_name)
        return out.reshape(w.shape) if rows is None and len(w.shape) != 2 else out
    if w.kind in supported_kinds():
        decode = {"gptq": gptq_dequantize, "awq": awq_dequantize, "fp8": fp8_dequantize}[w.layout]
        return decode(w.parts, w.meta, rows)
    raise Unsupported(Reason.QUANTIZATION, w.kind, "no decoder for this layout")


def _optional(get: Callable[[str], torch.Tensor], name: str) -> torch.Tensor | None:
    try:
        return get(name)
    except KeyError:
        return None


def _need(get: Callable[[str], torch.Tensor], name: str) -> torch.Tensor:
    t = _optional(get, name)
    if t is None:
        raise CheckpointError(name, "a quantized layer is missing this part")
    return t


def _check(ok: bool, prefix: str, message: str) -> None:
    if not ok:
        raise CheckpointError(prefix, message)


def packed_from_safetensors(
    get: Callable[[str], torch.Tensor], prefix: str, qconfig: dict[str, Any]
) -> PackedWeight | None:
    """The PackedWeight of linear layer `prefix` from its stored parts, or None when it is not quantized.

    get: stored tensor by full name (raises KeyError when absent). qconfig: config.json's quantization_config.
    """
    method = str(qconfig.get("quant_method", "")).lower()
    if method == "gptq":
        return _gptq(get, prefix, qconfig)
    if method == "awq":
        return _awq(get, prefix, qconfig)
    if method in ("fp8", "fbgemm_fp8", "compressed-tensors"):
        return _fp8(get, prefix, qconfig, method)
    raise Unsupported(Reason.QUANTIZATION, method or "unknown quant_method", f"layer {prefix}")


def _int_config(qconfig: dict[str, Any], key: str, default: int) -> int:
    value = qconfig.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise Unsupported(Reason.QUANTIZATION, f"{key}={value!r}", "quantization_config value is not an integer")
    return value


def _gptq(get: Callable[[str], torch.Tensor], prefix: str, qconfig: dict[str, Any]) -> PackedWeight | None:
    qweight = _optional(get, f"{prefix}.qweight")
    if qweight is None:
        return None
    bits = _int_config(qconfig, "bits", 4)
    if bits not in GPTQ_BITS:
        raise Unsupported(Reason.QUANTIZATION, f"gptq.{bits}", f"layer {prefix}: only 2, 4 and 8 bits are packed")
    fmt = str(qconfig.get("checkpoint_format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise Unsupported(Reason.QUANTIZATION, f"gptq checkpoint_format {fmt}", f"layer {prefix}")
    qzeros, scales = _need(get, f"{prefix}.qzeros"), _need(get, f"{prefix}.scales")
    per = 32 // bits
    _check(qweight.dtype == torch.int32 and qzeros.dtype == torch.int32, prefix, "qweight/qzeros are not int32")
    _check(qweight.dim() == 2 and qzeros.dim() == 2 and scales.dim() == 2, prefix, "gptq parts must be 2-D")
    in_f, out_f = qweight.shape[0] * per, qweight.shape[1]
    groups = scales.shape[0]
    _check(
        scales.shape[1] == out_f and tuple(qzeros.shape) == (groups, out_f // per) and out_f % per == 0,
        prefix,
        f"scales {tuple(scales.shape)} / qzeros {tuple(qzeros.shape)} disagree with qweight {tuple(qweight.shape)}",
    )
    group = _int_config(qconfig, "group_size", 128)
    g_idx = _optional(get, f"{prefix}.g_idx")
    if g_idx is None:  # no act-order: groups follow the input rows
        g_idx = torch.arange(in_f, dtype=torch.int32) // (group if group > 0 else in_f)
    _check(tuple(g_idx.shape) == (in_f,), prefix, f"g_idx has shape {tuple(g_idx.shape)}, expected ({in_f},)")
    _check(
        in_f == 0 or (int(g_idx.min()) >= 0 and int(g_idx.max()) < groups),
        prefix,
        f"g_idx names groups outside [0, {groups})",
    )
    meta = {
        "bits": bits,
        "group_size": group,
        "sym": bool(qconfig.get("sym", True)),
        "desc_act": bool(qconfig.get("desc_act", False)),
        "checkpoint_format": fmt,
    }
    parts = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}
    return PackedWeight("gptq", (out_f, in_f), parts, meta)


def _awq(get: Callable[[str], torch.Tensor], prefix: str, qconfig: dict[str, Any]) -> PackedWeight | None:
    qweight = _optional(get, f"{prefix}.qweight")
    if qweight is None:
        return None
    bits = _int_config(qconfig, "bits", qconfig.get("w_bit", 4))
    version = str(qconfig.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise Unsupported(Reason.QUANTIZATION, f"awq.{bits} {version}", f"layer {prefix}: only 4-bit GEMM is read")
    if qconfig.get("zero_point", True) is False:
        raise Unsupported(Reason.QUANTIZATION, "awq without zero point", f"layer {prefix}")
    qzeros, scales = _need(get, f"{prefix}.qzeros"), _need(get, f"{prefix}.scales")
    _check(qweight.dtype == torch.int32 and qzeros.dtype == torch.int32, prefix, "qweight/qzeros are not int32")
    _check(qweight.dim() == 2 and qzeros.dim() == 2 and scales.dim() == 2, prefix, "awq parts must be 2-D")
    in_f, out_f = qweight.shape[0], qweight.shape[1] * 8
    group = _int_config(qconfig, "group_size", qconfig.get("q_group_size", 128))
    group = in_f if group <= 0 else group
    groups = -(-in_f // group) if in_f else 0
    _check(
        tuple(scales.shape) == (groups, out_f) and tuple(qzeros.shape) == (groups, out_f // 8),
        prefix,
        f"scales {tuple(scales.shape)} / qzeros {tuple(qzeros.shape)} disagree with qweight "
        f"{tuple(qweight.shape)} and group size {group}",
    )
    meta = {"bits": 4, "group_size": group, "version": "gemm"}
    return PackedWeight("awq", (out_f, in_f), {"qweight": qweight, "qzeros": qzeros, "scales": scales}, meta)


def _fp8_block(qconfig: dict[str, Any], prefix: str) -> tuple[int, int]:
    block = qconfig.get("weight_block_size")
    for group in (qconfig.get("config_groups") or {}).values():
        if isinstance(group, dict) and isinstance(group.get("weights"), dict):
            block = group["weights"].get("block_structure") or block
    block = block or (128, 128)
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise Unsupported(Reason.QUANTIZATION, f"fp8 block {block!r}", f"layer {prefix}")
    return int(block[0]), int(block[1])


def _fp8(get: Callable[[str], torch.Tensor], prefix: str, qconfig: dict[str, Any], method: str) -> PackedWeight | None:
    if _optional(get, f"{prefix}.weight_packed") is not None:
        raise Unsupported(Reason.QUANTIZATION, "compressed-tensors pack-quantized", f"layer {prefix}")
    scale = _optional(get, f"{prefix}.weight_scale_inv")
    if scale is None:
        scale = _optional(get, f"{prefix}.weight_scale")
    weight = _optional(get, f"{prefix}.weight")
    if scale is None or weight is None:
        return None
    if weight.dtype != torch.float8_e4m3fn:
        if weight.dtype.is_floating_point:
            return None  # a dense layer that merely carries a scale (e.g. listed in `ignore`)
        raise Unsupported(Reason.QUANTIZATION, f"{method} weight of {weight.dtype}", f"layer {prefix}")
    _check(weight.dim() == 2, prefix, f"fp8 weight has shape {tuple(weight.shape)}")
    out_f, in_f = weight.shape
    if scale.numel() == 1:
        meta: dict[str, Any] = {"granularity": "tensor"}
    elif tuple(scale.shape) in ((out_f, 1), (out_f,)):
        meta = {"granularity": "channel"}
    else:
        br, bc = _fp8_block(qconfig, prefix)
        expect = (-(-out_f // br), -(-in_f // bc))
        _check(
            tuple(scale.shape) == expect,
            prefix,
            f"scale of shape {tuple(scale.shape)} fits no granularity (block {br}x{bc} needs {expect})",
        )
        meta = {"granularity": "block", "block": (br, bc)}
    return PackedWeight("fp8", (out_f, in_f), {"weight": weight, "scale": scale}, meta)
