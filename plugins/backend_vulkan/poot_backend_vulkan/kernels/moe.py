"""Mixture of experts: routing on the device, the gathered products of the chosen experts, and the weighted
sum of the experts' outputs (the path that runs every expert, for steps of many tokens)."""

from __future__ import annotations

from poot_core.errors import Reason, Unsupported

from .runtime import MAX_GROUPS, Batch, DeviceArray, grid_1d, pack_params, shader_source
from .shapes import check
from .weights import ExpertStack

ASSIGN, SIGMOID, UNIT = 1, 2, 4  # accumulate() modes, combined with |
MAX_EXPERTS = 1024  # the routing shader marks chosen experts in 32 words of bits
ACTIVATIONS = ("silu", "gelu_tanh")


def route(
    batch: Batch,
    logits: DeviceArray,
    weights: DeviceArray,
    top_k: int,
    norm: bool,
    scale: float,
    ids: DeviceArray,
    chosen: DeviceArray,
) -> None:
    """weights[t, e] = the routing weight of expert e for token t (zero unless among the top_k by softmax score);
    ids[t, j] and chosen[t, j] = the j-th chosen expert of token t and its weight. logits and weights are
    [tokens, experts], ids (u32) and chosen [tokens, top_k]."""
    tokens, experts = logits.shape
    check("route.weights", weights, (tokens, experts))
    check("route.ids", ids, (tokens, top_k), "u32")
    check("route.chosen", chosen, (tokens, top_k))
    pipeline = batch.runtime.pipeline("moe_route", shader_source("moe_route"))
    batch.dispatch(pipeline, [logits.buffer, weights.buffer, ids.buffer, chosen.buffer],
                   pack_params(experts, top_k, int(norm), float(scale)), (tokens, 1, 1))


def _row_grid(rows: int, second: int) -> tuple[int, int, int]:
    gx = min(rows, MAX_GROUPS)
    if second > MAX_GROUPS:
        raise Unsupported(Reason.SHAPE, "moe", f"{second} slots exceed one dispatch")
    return gx, second, -(-rows // gx)


def _stack_pipeline(batch: Batch, kernel: str, stack: ExpertStack, act: str = "") -> object:
    source = shader_source(kernel, "activations", "bytes", *stack.weight.fmt.sources())
    if act:
        source = source.replace("ACTIVATION(", f"{act}(")
    return batch.runtime.pipeline(f"{kernel}:{stack.weight.fmt.name}", source, act)


def gate_up(batch: Batch, x: DeviceArray, stack: ExpertStack, ids: DeviceArray, h: DeviceArray, act: str) -> None:
    """h[s, :] = act(gate_e x_t) * (up_e x_t) for every slot s = t * top_k + j of ids [tokens, top_k], e = ids[s];
    `stack` holds each expert's gate then up rows. Only the chosen experts' rows are read."""
    if act not in ACTIVATIONS or len(stack.part_rows) != 2 or stack.part_rows[0] != stack.part_rows[1]:
        raise Unsupported(Reason.OPERATION, f"moe gate/up {act}", "gated silu/gelu_tanh over gate and up parts")
    tokens, top_k = ids.shape
    rows, cols = stack.part_rows[0], stack.weight.cols
    check("gate_up.x", x, (tokens, cols))
    check("gate_up.ids", ids, (tokens, top_k), "u32")
    check("gate_up.h", h, (tokens * top_k, rows))
    pipeline = _stack_pipeline(batch, "moe_gate_up", stack, act)
    for chunk, lo, hi in stack.chunk_experts():
        params = pack_params(rows, cols, top_k, lo, hi, stack.per_expert)
        batch.dispatch(pipeline, [chunk.buffer, x.buffer, ids.buffer, h.buffer], params,
                       _row_grid(rows, tokens * top_k))


def down(batch: Batch, h: DeviceArray, stack: ExpertStack, ids: DeviceArray, chosen: DeviceArray,
         out: DeviceArray) -> None:
    """out[t, :] = sum_j chosen[t, j] * down_e h[t * top_k + j] with e = ids[t, j]; only chosen experts are read."""
    tokens, top_k = ids.shape
    rows, cols = stack.weight.rows // stack.experts, stack.weight.cols
    if stack.part_rows != (rows,):
        raise Unsupported(Reason.SHAPE, "moe down", "a stack of one matrix per expert")
    check("down.h", h, (tokens * top_k, cols))
    check("down.chosen", chosen, (tokens, top_k))
    check("down.out", out, (tokens, rows))
    pipeline = _stack_pipeline(batch, "moe_down", stack)
    for index, (chunk, lo, hi) in enumerate(stack.chunk_experts()):
        params = pack_params(rows, cols, top_k, lo, hi, stack.per_expert, int(index == 0))
        batch.dispatch(pipeline, [chunk.buffer, h.buffer, ids.buffer, chosen.buffer, out.buffer], params,
                       _row_grid(rows, tokens))


def accumulate(batch: Batch, weights: DeviceArray, column: int, y: DeviceArray, out: DeviceArray, mode: int) -> None:
    """out[t, :] (+)= w_t * y[t, :] with w_t = weights[t, column] (see moe_accumulate.wgsl for the modes);
    y and out are [tokens, width]."""
    tokens, width = y.shape
    check("accumulate.out", out, (tokens, width))
    stride = weights.shape[-1] if len(weights.shape) > 1 else 1
    pipeline = batch.runtime.pipeline("moe_accumulate", shader_source("moe_accumulate"))
    batch.dispatch(pipeline, [weights.buffer, y.buffer, out.buffer], pack_params(y.size, width, stride, column, mode),
                   grid_1d(-(-y.size // 64)))
