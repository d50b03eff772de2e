"""Gated activations, residual add and argmax."""

from __future__ import annotations

from poot_core.errors import Reason, Unsupported

from .runtime import Batch, DeviceArray, grid_1d, pack_params, shader_source
from .shapes import check

_COMBINE = {
    "silu": "silu(a) * b",
    "gelu_tanh": "gelu_tanh(a) * b",
    "add": "a + b",
}


def _elementwise(batch: Batch, op: str, a: DeviceArray, b: DeviceArray, out: DeviceArray) -> None:
    check(f"{op}.b", b, a.shape)
    check(f"{op}.out", out, a.shape)
    source = (
        shader_source("elementwise") + f"\nfn combine(a: f32, b: f32) -> f32 {{ return {_COMBINE[op]}; }}\n"
    )
    pipeline = batch.runtime.pipeline("elementwise", source, op)
    batch.dispatch(pipeline, [a.buffer, b.buffer, out.buffer], pack_params(a.size), grid_1d(-(-a.size // 64)))


def gated_activation(batch: Batch, gate: DeviceArray, up: DeviceArray, out: DeviceArray, kind: str) -> None:
    """out = act(gate) * up elementwise; kind is "silu" (SwiGLU) or "gelu_tanh" (GeGLU, tanh form)."""
    if kind not in ("silu", "gelu_tanh"):
        raise Unsupported(
            Reason.OPERATION, f"activation:{kind}", "the Vulkan kernels have silu and gelu_tanh"
        )
    _elementwise(batch, kind, gate, up, out)


def add(batch: Batch, a: DeviceArray, b: DeviceArray, out: DeviceArray) -> None:
    """out = a + b elementwise (out must be a third buffer: wgpu refuses one bound both read and written)."""
    _elementwise(batch, "add", a, b, out)


def argmax(batch: Batch, logits: DeviceArray, ids: DeviceArray) -> None:
    """ids[r] = argmax(logits[r, :]) as u32, lowest index on ties; logits is [rows, vocab]."""
    rows, cols = (
        (1, logits.size) if len(logits.shape) == 1 else (logits.size // logits.shape[-1], logits.shape[-1])
    )
    check("argmax.ids", ids, (rows,), "u32")
    pipeline = batch.runtime.pipeline("argmax", shader_source("argmax"))
    batch.dispatch(pipeline, [logits.buffer, ids.buffer], pack_params(cols), (rows, 1, 1))
