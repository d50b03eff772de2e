"""A checkpoint's WeightStore -> device buffers, each weight kept in its stored layout.

Matrices (2-D) become row-chunked `DeviceWeight`s in their own format (f32, f16, bf16 bit patterns, GGUF
blocks). Vectors (norm scales, biases) become f32 `DeviceArray`s: the kernels read them as f32 and they are
a negligible share of the bytes (the CPU executor widens them the same way).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from poot_core import PackedWeight, Reason, Unsupported, weight_kind

from .kernels.runtime import DeviceArray, Runtime
from .kernels.weights import FORMATS, DeviceWeight, ExpertStack, row_range, upload_stack, upload_weight

DENSE_FORMATS = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
GGUF_TYPES = tuple(name for name in FORMATS if name not in DENSE_FORMATS.values())
WEIGHT_KINDS = frozenset(DENSE_FORMATS) | frozenset(f"gguf.{t}" for t in GGUF_TYPES)
# Matrices that read the same input, stored one after another in one buffer so that a one-token step
# reads them in one dispatch; each stays addressable alone as a row range of the concatenation.
CONCATENATED = (("q_proj.weight", "k_proj.weight", "v_proj.weight"), ("gate_proj.weight", "up_proj.weight"))
# A MoE layer's experts ("<prefix>experts.<e>.<suffix>"), stacked so that one dispatch reaches any chosen
# expert: gate and up of each expert side by side in one stack, down in another (Hugging Face's names and
# Mixtral's w1/w3/w2). Each expert's matrix stays addressable alone as a row range of its stack.
EXPERT_STACKS = (("gate_proj.weight", "up_proj.weight"), ("down_proj.weight",), ("w1.weight", "w3.weight"),
                 ("w2.weight",))
_EXPERT = re.compile(r"^(?P<prefix>.*experts\.)(?P<index>\d+)\.(?P<suffix>.+)$")


@dataclass
class DeviceWeights:
    """Every weight of a store on the device, by the store's names. `skipped` holds the weights this
    backend cannot place (say a 3-D expert stack) with the reason, so a graph that uses one is refused
    by name at prepare time instead of the whole upload failing."""

    matrices: dict[str, DeviceWeight] = field(default_factory=dict)
    vectors: dict[str, DeviceArray] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    # (part names in row order) -> their concatenation; matrices[part] is a row range of it
    concatenated: dict[tuple[str, ...], DeviceWeight] = field(default_factory=dict)
    # an expert's matrix -> (its stack, the expert, which part of the expert's rows)
    stacked: dict[str, tuple[ExpertStack, int, int]] = field(default_factory=dict)
    # GGUF's stacked experts: the gate tensor's name ("...experts.gate_exps.weight") -> (gate/up stack, down stack)
    expert_tensors: dict[str, tuple[ExpertStack, ExpertStack]] = field(default_factory=dict)

    def concatenation_of(self, name: str) -> tuple[tuple[str, ...], DeviceWeight] | None:
        for names, weight in self.concatenated.items():
            if name in names:
                return names, weight
        return None

    def nbytes(self) -> int:
        buffers = {id(c.buffer): c.buffer.size for w in self.matrices.values() for c in w.chunks}
        return sum(buffers.values()) + sum(v.buffer.size for v in self.vectors.values())


def _host_dense(w: torch.Tensor) -> tuple[np.ndarray, str]:
    fmt = DENSE_FORMATS[str(w.dtype).removeprefix("torch.")]
    w = w.detach().cpu().contiguous()
    if fmt == "bf16":  # numpy has no bfloat16: keep the 16-bit patterns as they are
        return w.view(torch.int16).numpy().view(np.uint16), fmt
    return w.numpy(), fmt


def _vector(runtime: Runtime, w: torch.Tensor) -> DeviceArray:
    return runtime.upload(w.detach().cpu().float().contiguous().numpy().reshape(-1))


def _host_matrix(name: str, w: Any) -> tuple[np.ndarray, str]:
    """A 2-D weight as host data in its stored format (bf16 as u16 patterns, GGUF as block bytes)."""
    kind = weight_kind(w)
    if isinstance(w, PackedWeight):
        gguf_type = w.meta.get("type")
        if w.layout != "gguf" or gguf_type not in GGUF_TYPES or "blocks" not in w.parts:
            raise Unsupported(
                Reason.QUANTIZATION,
                f"{kind} (tensor {name})",
                f"the vulkan backend computes from f32, f16, bf16 and GGUF {', '.join(GGUF_TYPES)}",
            )
        return w.parts["blocks"].detach().cpu().contiguous().numpy(), gguf_type
    return _host_dense(w)


def _groups(store: Any, names: list[str]) -> list[tuple[str, ...]]:
    """The CONCATENATED groups present in full: same prefix, 2-D, one format, one row length."""
    present = set(names)
    found = []
    for name in names:
        for suffixes in CONCATENATED:
            if not name.endswith(suffixes[0]):
                continue
            prefix = name[: -len(suffixes[0])]
            group = tuple(prefix + s for s in suffixes)
            if not all(n in present for n in group):
                continue
            ws = [store.get(n) for n in group]
            if any(len(w.shape) != 2 for w in ws) or len({weight_kind(w) for w in ws}) != 1:
                continue
            if len({int(w.shape[1]) for w in ws}) == 1:
                found.append(group)
    return found


def _expert_stacks(store: Any, names: list[str]) -> list[list[tuple[str, ...]]]:
    """The EXPERT_STACKS present in full: per stack, each expert's part names (experts 0..E-1, every part 2-D,
    one format and row length in the whole stack, the same rows for a part in every expert)."""
    experts: dict[str, set[int]] = {}
    for name in names:
        found = _EXPERT.match(name)
        if found:
            experts.setdefault(found["prefix"], set()).add(int(found["index"]))
    stacks = []
    present = set(names)
    for prefix, indices in experts.items():
        if indices != set(range(len(indices))):
            continue
        for suffixes in EXPERT_STACKS:
            members = [tuple(f"{prefix}{e}.{s}" for s in suffixes) for e in range(len(indices))]
            if not all(n in present for parts in members for n in parts):
                continue
            ws = [[store.get(n) for n in parts] for parts in members]
            flat = [w for parts in ws for w in parts]
            if any(len(w.shape) != 2 for w in flat) or len({(weight_kind(w), int(w.shape[1])) for w in flat}) != 1:
                continue
            if len({tuple(int(w.shape[0]) for w in parts) for parts in ws}) == 1:
                stacks.append(members)
    return stacks


def _expert_rows(name: str, w: Any) -> tuple[list[np.ndarray], str]:
    """A stacked [E, out, in] expert tensor as E host matrices in their stored format (GGUF blocks stack by rows)."""
    experts, rows = int(w.shape[0]), int(w.shape[1])
    if isinstance(w, PackedWeight):
        data, fmt = _host_matrix(name, PackedWeight(w.layout, (experts * rows, int(w.shape[2])), w.parts, w.meta))
    else:
        data, fmt = _host_dense(w.reshape(experts * rows, -1))
    data = data.reshape(experts * rows, -1)
    return [data[e * rows : (e + 1) * rows] for e in range(experts)], fmt


def _stacked_experts(runtime: Runtime, store: Any, names: list[str], out: DeviceWeights) -> set[str]:
    """GGUF's `ffn_{gate,up,down}_exps` ([E, out, in] each) as a gate/up stack and a down stack; returns the
    names placed. Left out (the program refuses them by name) when a kind is not one the kernels read."""
    placed: set[str] = set()
    for name in names:
        if not name.endswith("experts.gate_exps.weight"):
            continue
        trio = [name, name.replace("gate_exps", "up_exps"), name.replace("gate_exps", "down_exps")]
        ws = [store.get(n) for n in trio if n in names]
        if len(ws) != 3 or any(len(w.shape) != 3 for w in ws) or len({weight_kind(w) for w in ws}) != 1:
            continue
        try:
            (gate, fmt), (up, _), (down, _) = (_expert_rows(n, w) for n, w in zip(trio, ws, strict=True))
        except Unsupported:
            continue
        gate_up = upload_stack(runtime, [[g, u] for g, u in zip(gate, up, strict=True)], fmt, int(ws[0].shape[2]))
        down_stack = upload_stack(runtime, [[d] for d in down], fmt, int(ws[2].shape[2]))
        if gate_up is not None and down_stack is not None:
            out.expert_tensors[name] = (gate_up, down_stack)
            placed.update(trio)
    return placed


def upload_store(runtime: Runtime, store: Any) -> DeviceWeights:
    out = DeviceWeights()
    names = list(store.names())
    grouped: set[str] = _stacked_experts(runtime, store, names, out)
    for members in _expert_stacks(store, names):
        first = store.get(members[0][0])
        host = [[_host_matrix(n, store.get(n)) for n in parts] for parts in members]
        stack = upload_stack(runtime, [[data for data, _ in parts] for parts in host], host[0][0][1],
                             int(first.shape[1]))
        del host
        if stack is None:  # an expert larger than one binding: its matrices stay apart
            continue
        for e, parts in enumerate(members):
            at = e * stack.per_expert
            for part, (name, rows) in enumerate(zip(parts, stack.part_rows, strict=True)):
                out.matrices[name] = row_range(stack.weight, at, at + rows)
                out.stacked[name] = (stack, e, part)
                at += rows
            grouped.update(parts)
    for group in _groups(store, [n for n in names if n not in grouped]):
        parts = [_host_matrix(n, store.get(n)) for n in group]
        fmt = parts[0][1]
        rows = [int(store.get(n).shape[0]) for n in group]
        data = np.concatenate([p[0].reshape(r, -1) for p, r in zip(parts, rows, strict=True)])
        del parts
        whole = upload_weight(runtime, data, fmt, (sum(rows), int(store.get(group[0]).shape[1])))
        out.concatenated[group] = whole
        at = 0
        for name, r in zip(group, rows, strict=True):
            out.matrices[name] = row_range(whole, at, at + r)
            at += r
        grouped.update(group)
    for name in names:
        if name in grouped:
            continue
        w = store.get(name)
        kind = weight_kind(w)
        if isinstance(w, PackedWeight) and len(w.shape) != 2:
            out.skipped[name] = f"a {len(w.shape)}-D {kind} tensor {tuple(w.shape)}"
            continue
        if isinstance(w, PackedWeight):
            data, gguf_type = _host_matrix(name, w)
            out.matrices[name] = upload_weight(runtime, data, gguf_type, (w.shape[0], w.shape[1]))
            continue
        if kind not in DENSE_FORMATS:
            raise Unsupported(
                Reason.QUANTIZATION,
                f"{kind} (tensor {name})",
                "the vulkan backend computes from f32, f16 and bf16 dense weights",
            )
        if w.dim() == 1:
            out.vectors[name] = _vector(runtime, w)
        elif w.dim() == 2:
            data, fmt = _host_dense(w)
            out.matrices[name] = upload_weight(runtime, data, fmt, tuple(w.shape))
        else:
            out.skipped[name] = f"a {w.dim()}-D {kind} tensor {tuple(w.shape)}"
    return out
