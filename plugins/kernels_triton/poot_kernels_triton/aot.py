"""Ahead-of-time compilation of recorded launches for a chosen target, with no GPU present.

Record the launches of public functions with `record_launches()` under `use_tuning(tuning_for_target(...))`,
then `compile_launch(launch, target)` builds each one with triton.compile (cubin for CUDA, hsaco for HIP).
"""

from __future__ import annotations

from typing import Any

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from poot_core.errors import Reason, Unsupported

from .launch import Launch

_POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.uint8: "*u8",
    torch.int8: "*i8",
    torch.int32: "*i32",
    torch.int64: "*i64",
}


def _type_of(name: str, value: Any) -> str:
    if isinstance(value, torch.Tensor):
        if value.dtype not in _POINTER_TYPES:
            raise Unsupported(Reason.OPERATION, f"{name}:{value.dtype}", "no Triton pointer type for this dtype")
        return _POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise Unsupported(Reason.OPERATION, f"{name}:{type(value).__name__}", "argument has no Triton type")


def signature_of(launch: Launch) -> tuple[dict[str, str], dict[str, Any]]:
    """(signature, constexprs) of a recorded launch, in the form ASTSource takes."""
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    for param in launch.kernel.params:
        value = launch.args[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        else:
            signature[param.name] = _type_of(param.name, value)
    return signature, constexprs


def compile_launch(launch: Launch, target: GPUTarget) -> Any:
    """Compile one recorded launch for `target`, e.g. GPUTarget("cuda", 90, 32) or ("hip", "gfx942", 64)."""
    signature, constexprs = signature_of(launch)
    options: dict[str, Any] = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
    if target.backend == "hip":
        options.update(launch.extra)
    return compile(ASTSource(launch.kernel, signature, constexprs), target=target, options=options)
