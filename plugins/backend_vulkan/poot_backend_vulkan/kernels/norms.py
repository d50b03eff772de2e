"""RMSNorm (optionally fused with the residual add) and LayerNorm."""

from __future__ import annotations

from poot_core.errors import Reason, Unsupported

from .runtime import Batch, DeviceArray, pack_params, shader_source
from .shapes import check


def _variant(batch: Batch, name: str, flag: str, enabled: bool):
    source = shader_source("reduce", name)
    if enabled:
        source = source.replace(f"//{flag} ", "")
    return batch.runtime.pipeline(name, source, flag if enabled else "")


def rms_norm(
    batch: Batch,
    x: DeviceArray,
    weight: DeviceArray,
    out: DeviceArray,
    *,
    eps: float,
    weight_offset: float = 0.0,
    residual: DeviceArray | None = None,
    residual_out: DeviceArray | None = None,
    residual_splits: int = 1,
) -> None:
    """out = h * rsqrt(mean(h^2) + eps) * (weight + weight_offset) per row of x[rows, cols].

    h = x, or h = x + residual when `residual` is given; then h is also written to `residual_out`
    (the running residual stream). Gemma's (1 + w) is weight_offset=1.0. residual_splits > 1: residual's
    buffer holds that many partial sums of it one after another (linear.gemv's partials), added here
    (rows of a multiple of 4 values only).
    """
    cols = weight.size
    rows = x.size // cols
    check("rms_norm.x", x, (rows, cols))
    check("rms_norm.out", out, (rows, cols))
    fused = residual is not None
    buffers = [x.buffer, weight.buffer, out.buffer]
    if fused:
        if residual_out is None:
            raise Unsupported(Reason.OPERATION, "rms_norm", "a fused residual needs residual_out")
        check("rms_norm.residual", residual, (rows, cols))
        check("rms_norm.residual_out", residual_out, (rows, cols))
        buffers += [residual.buffer, residual_out.buffer]
    if residual_splits > 1 and (not fused or cols % 4 or residual.buffer.size < 4 * residual_splits * x.size):
        raise Unsupported(Reason.SHAPE, "rms_norm residual_splits",
                          f"a residual of {residual_splits} x {x.size} values, rows of a multiple of 4")
    if cols % 4:
        pipeline = _variant(batch, "rms_norm", "FUSED", fused)
        params = pack_params(cols, float(eps), float(weight_offset))
    else:
        pipeline = _variant(batch, "rms_norm_wide", "FUSED", fused)
        params = pack_params(cols, float(eps), float(weight_offset), residual_splits, x.size // 4)
    batch.dispatch(pipeline, buffers, params, (rows, 1, 1))


def layer_norm(
    batch: Batch,
    x: DeviceArray,
    weight: DeviceArray,
    out: DeviceArray,
    *,
    eps: float,
    bias: DeviceArray | None = None,
) -> None:
    """out = (x - mean) * rsqrt(var + eps) * weight (+ bias) per row of x[rows, cols]."""
    cols = weight.size
    rows = x.size // cols
    check("layer_norm.x", x, (rows, cols))
    check("layer_norm.out", out, (rows, cols))
    buffers = [x.buffer, weight.buffer, out.buffer]
    if bias is not None:
        check("layer_norm.bias", bias, (cols,))
        buffers.append(bias.buffer)
    pipeline = _variant(batch, "layer_norm", "BIAS", bias is not None)
    batch.dispatch(pipeline, buffers, pack_params(cols, float(eps)), (rows, 1, 1))
