"""Gated activations, residual add and argmax."""

from __future__ import annotations

from poot_core.errors import Reason, Unsupported

from .runtime import Batch, DeviceArray, grid_1d, pack_params, shader_source
from .shapes import check

_COMBINE = {
    "silu": "silu(a) * b",
    "gelu_tanh": "gelu_tanh(a) * b",
    "add": "a + b",
    "mul": "a * b",
}
# One-input expressions of `a` (b is bound to the same buffer and unused); {0} is a float constant.
_UNARY = {
    "silu": "silu(a)",
    "gelu_tanh": "gelu_tanh(a)",
    "relu": "max(a, 0.0)",
    "scale": "a * {0}",
    "softcap": "{0} * safe_tanh(a / {0})",
}


def _elementwise(
    batch: Batch, op: str, a: DeviceArray, b: DeviceArray, out: DeviceArray, expression: str | None = None
) -> None:
    check(f"{op}.b", b, a.shape)
    check(f"{op}.out", out, a.shape)
    expression = expression or _COMBINE[op]
    source = shader_source("activations", "elementwise")
    source += f"\nfn combine(a: f32, b: f32) -> f32 {{ return {expression}; }}\n"
    pipeline = batch.runtime.pipeline("elementwise", source, expression)
    batch.dispatch(pipeline, [a.buffer, b.buffer, out.buffer], pack_params(a.size), grid_1d(-(-a.size // 64)))


def gated_activation(batch: Batch, gate: DeviceArray, up: DeviceArray, out: DeviceArray, kind: str) -> None:
    """out = act(gate) * up elementwise; kind is "silu" (SwiGLU) or "gelu_tanh" (GeGLU, tanh form)."""
    if kind not in ("silu", "gelu_tanh"):
        raise Unsupported(Reason.OPERATION, f"activation:{kind}", "the Vulkan kernels have silu and gelu_tanh")
    _elementwise(batch, kind, gate, up, out)


def add(batch: Batch, a: DeviceArray, b: DeviceArray, out: DeviceArray) -> None:
    """out = a + b elementwise (out must be a third buffer: wgpu refuses one bound both read and written)."""
    _elementwise(batch, "add", a, b, out)


def mul(batch: Batch, a: DeviceArray, b: DeviceArray, out: DeviceArray) -> None:
    """out = a * b elementwise."""
    _elementwise(batch, "mul", a, b, out)


def unary(batch: Batch, kind: str, x: DeviceArray, out: DeviceArray, constant: float = 0.0) -> None:
    """out = f(x) elementwise: silu, gelu_tanh, relu, scale (x * constant), softcap (c * tanh(x / c))."""
    if kind not in _UNARY:
        raise Unsupported(Reason.OPERATION, f"activation:{kind}", f"the Vulkan kernels have {', '.join(_UNARY)}")
    expression = _UNARY[kind].format(f"({float(constant)!r})")
    _elementwise(batch, kind, x, x, out, expression)


def argmax(batch: Batch, logits: DeviceArray, ids: DeviceArray) -> None:
    """ids[r] = argmax(logits[r, :]) as u32, lowest index on ties; logits is [rows, vocab]."""
    rows, cols = (1, logits.size) if len(logits.shape) == 1 else (logits.size // logits.shape[-1], logits.shape[-1])
    check("argmax.ids", ids, (rows,), "u32")
    limit = int(batch.runtime.device.limits.get("max-compute-invocations-per-workgroup", 256))
    width = 1024 if limit >= 1024 else 256  # a power of two for the tree; 256 is WebGPU's guaranteed floor
    source = shader_source("argmax").replace("const WG: u32 = 64u;", f"const WG: u32 = {width}u;")
    pipeline = batch.runtime.pipeline("argmax", source, str(width))
    batch.dispatch(pipeline, [logits.buffer, ids.buffer], pack_params(cols), (rows, 1, 1))
