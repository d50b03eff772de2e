"""Granite's routed experts as Hugging Face stores them: gate and up of every expert joined in one stacked
`block_sparse_moe.input_linear.weight` [E, 2F, D] beside `output_linear.weight` [E, D, F]. The moe op reads
one (gate, up, down) triple per expert: here they are zero-copy views of the stored tensors (each expert's
rows are contiguous in both)."""

from __future__ import annotations

import torch

from poot_core import CheckpointError, DerivedWeight, ModelConfig, Reason, StoredWeights, Unsupported, Weight
from poot_family_hybrid.config import MambaHybridParams

EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def expert_prefix(layer: int) -> str:
    return f"model.layers.{layer}.block_sparse_moe."


def granite_expert_weights(config: ModelConfig, store: StoredWeights) -> dict[str, DerivedWeight]:
    p: MambaHybridParams = config.params
    if not p.experts:
        return {}
    shapes = store.shapes()
    E, F, D = p.experts, p.expert_intermediate, p.hidden
    derived: dict[str, DerivedWeight] = {}
    for layer in range(len(p.layer_types)):
        pre = expert_prefix(layer)
        joined, down = pre + "input_linear.weight", pre + "output_linear.weight"
        for name, want in ((joined, (E, 2 * F, D)), (down, (E, D, F))):
            if name not in shapes:
                raise CheckpointError(name, "missing: the config has routed experts")
            if tuple(shapes[name]) != want:
                raise CheckpointError(name, f"shape {tuple(shapes[name])}, the config says {want}")
        for e in range(E):
            part = f"{pre}experts.{e}."
            derived[part + "gate_proj.weight"] = ((lambda n=joined, e=e: _rows(store, n, e, 0, F)), (F, D))
            derived[part + "up_proj.weight"] = ((lambda n=joined, e=e: _rows(store, n, e, F, 2 * F)), (F, D))
            derived[part + "down_proj.weight"] = ((lambda n=down, e=e: _rows(store, n, e, 0, D)), (D, F))
    return derived


def _rows(store: StoredWeights, name: str, expert: int, start: int, stop: int) -> Weight:
    w = store.get(name)
    if not isinstance(w, torch.Tensor):  # a PackedWeight: its blocks cannot be cut into experts' halves here
        raise Unsupported(Reason.QUANTIZATION, f"quantized joined experts {name}",
                          "Granite's stacked experts are read from float checkpoints")
    return w[expert, start:stop]
