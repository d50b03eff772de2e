"""poot-family-hybrid's entry point: LFM2, Mamba2, Granite 4.0-H (dense and with routed experts), Bamba and
Qwen3-Next from Hugging Face checkpoints; LFM2, Mamba2, Granite 4.0-H (llama.cpp's granitehybrid) and Qwen3-Next
from GGUF files too."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from poot_core import (
    DerivedWeight,
    Family,
    GGUFKeys,
    GGUFNames,
    GGUFTensors,
    ModelConfig,
    Reason,
    StepShape,
    StoredWeights,
    Tracer,
    Unsupported,
    eos_ids,
    hookimpl,
)
from poot_family_hybrid.config import lfm2_params, mamba2_params, mamba_hybrid_params, model_config
from poot_family_hybrid.experts import granite_expert_weights
from poot_family_hybrid.gguf import (
    LFM2_NAMES,
    granite_derived_weights,
    granite_params_from_gguf,
    granite_tensor_name,
    lfm2_params_from_gguf,
    mamba2_derived_weights,
    mamba2_params_from_gguf,
    mamba2_tensor_name,
    vocab_and_positions,
)
from poot_family_hybrid.model import trace_lfm2, trace_mamba2, trace_mamba_hybrid
from poot_family_hybrid.qwen3next import qwen3next_derived_weights, qwen3next_params, trace_qwen3next
from poot_family_hybrid.qwen3next_gguf import qwen3next_gguf_derived, qwen3next_params_from_gguf, qwen3next_tensor_name

TensorNames = Callable[[str], str | None]
Derived = Callable[[ModelConfig, GGUFTensors], dict[str, DerivedWeight]]
HfDerived = Callable[[ModelConfig, StoredWeights], dict[str, DerivedWeight]]


class HybridDecoder(Family):
    """One hybrid family: how its config is read and how its step is written."""

    def __init__(self, name: str, model_type: str, architectures: tuple[str, ...],
                 params: Callable[[dict[str, Any]], Any], trace: Callable[[ModelConfig, Tracer], None],
                 gguf_params: Callable[[GGUFKeys, GGUFTensors], Any] | None = None,
                 gguf_names: GGUFNames | TensorNames | None = None, gguf_derived: Derived | None = None,
                 hf_derived: HfDerived | None = None) -> None:
        super().__init__(name, model_type, architectures)
        self._params, self._trace = params, trace
        self._gguf_params, self._gguf_names, self._gguf_derived = gguf_params, gguf_names, gguf_derived
        self._hf_derived = hf_derived

    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        return model_config(self.name, hf, self._params(hf))

    def config_from_gguf(self, metadata: dict[str, Any], path: Path, tensors: GGUFTensors) -> ModelConfig:
        if self._gguf_params is None:
            raise Unsupported(Reason.REGISTRY, f"{self.name} from a GGUF file", "not read from GGUF yet")
        arch = str(metadata.get("general.architecture", self.model_type))
        keys = GGUFKeys(metadata, path, arch, self.name)
        p = self._gguf_params(keys, tensors)
        vocab, positions = vocab_and_positions(metadata, keys)
        keys.refuse_unread()
        return ModelConfig(family=self.name, architecture=arch, vocab_size=vocab, max_positions=positions,
                           hidden_size=p.hidden, eos_ids=eos_ids(metadata.get("tokenizer.ggml.eos_token_id")),
                           bos_id=metadata.get("tokenizer.ggml.bos_token_id"), params=p, source_format="gguf",
                           raw=metadata)

    def gguf_tensor_name(self, config: ModelConfig, name: str) -> str | None:
        names = self._gguf_names
        if isinstance(names, GGUFNames):
            return names.map(name, self.name)
        assert names is not None  # config_from_gguf refused the file otherwise
        return names(name)

    def gguf_derived_weights(self, config: ModelConfig, tensors: GGUFTensors) -> dict[str, DerivedWeight]:
        return {} if self._gguf_derived is None else self._gguf_derived(config, tensors)

    def hf_derived_weights(self, config: ModelConfig, store: StoredWeights) -> dict[str, DerivedWeight]:
        return {} if self._hf_derived is None else self._hf_derived(config, store)

    def trace(self, config: ModelConfig, t: Tracer, shape: StepShape) -> None:
        self._trace(config, t)


class Qwen3NextDecoder(HybridDecoder):
    """Its GGUF names depend on the config: blocks after the model's own are multi-token prediction's."""

    def gguf_tensor_name(self, config: ModelConfig, name: str) -> str | None:
        return qwen3next_tensor_name(config, name)


FAMILIES = [
    HybridDecoder("lfm2", "lfm2", ("Lfm2ForCausalLM", "lfm2"), lfm2_params, trace_lfm2, lfm2_params_from_gguf,
                  LFM2_NAMES),
    HybridDecoder("mamba2", "mamba2", ("Mamba2ForCausalLM", "mamba2"), mamba2_params, trace_mamba2,
                  mamba2_params_from_gguf, mamba2_tensor_name, mamba2_derived_weights),
    HybridDecoder("granitemoehybrid", "granitemoehybrid",
                  ("GraniteMoeHybridForCausalLM", "granitemoehybrid", "granitehybrid"),
                  lambda hf: mamba_hybrid_params(hf, "granitemoehybrid"), trace_mamba_hybrid,
                  granite_params_from_gguf, granite_tensor_name, granite_derived_weights,
                  hf_derived=granite_expert_weights),
    HybridDecoder("bamba", "bamba", ("BambaForCausalLM", "bamba"), lambda hf: mamba_hybrid_params(hf, "bamba"),
                  trace_mamba_hybrid),
    Qwen3NextDecoder("qwen3next", "qwen3_next", ("Qwen3NextForCausalLM", "qwen3_next", "qwen3next"),
                     qwen3next_params, trace_qwen3next, qwen3next_params_from_gguf,
                     gguf_derived=qwen3next_gguf_derived, hf_derived=qwen3next_derived_weights),
]


@hookimpl
def poot_register_families() -> list[Family]:
    return list(FAMILIES)


__all__ = ["FAMILIES", "HybridDecoder", "Qwen3NextDecoder"]
