"""Mixture of experts: routing on the device, and the weighted sum of the experts' outputs."""

from __future__ import annotations

from .runtime import Batch, DeviceArray, grid_1d, pack_params, shader_source
from .shapes import check

ASSIGN, SIGMOID, UNIT = 1, 2, 4  # accumulate() modes, combined with |
MAX_EXPERTS = 1024  # the routing shader marks chosen experts in 32 words of bits


def route(batch: Batch, logits: DeviceArray, weights: DeviceArray, top_k: int, norm: bool, scale: float) -> None:
    """weights[t, e] = the routing weight of expert e for token t (zero unless among the top_k by softmax score);
    logits and weights are [tokens, experts]."""
    tokens, experts = logits.shape
    check("route.weights", weights, (tokens, experts))
    pipeline = batch.runtime.pipeline("moe_route", shader_source("moe_route"))
    batch.dispatch(pipeline, [logits.buffer, weights.buffer], pack_params(experts, top_k, int(norm), float(scale)),
                   (tokens, 1, 1))


def accumulate(batch: Batch, weights: DeviceArray, column: int, y: DeviceArray, out: DeviceArray, mode: int) -> None:
    """out[t, :] (+)= w_t * y[t, :] with w_t = weights[t, column] (see moe_accumulate.wgsl for the modes);
    y and out are [tokens, width]."""
    tokens, width = y.shape
    check("accumulate.out", out, (tokens, width))
    stride = weights.shape[-1] if len(weights.shape) > 1 else 1
    pipeline = batch.runtime.pipeline("moe_accumulate", shader_source("moe_accumulate"))
    batch.dispatch(pipeline, [weights.buffer, y.buffer, out.buffer], pack_params(y.size, width, stride, column, mode),
                   grid_1d(-(-y.size // 64)))
