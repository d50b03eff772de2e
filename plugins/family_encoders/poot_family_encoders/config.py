"""Encoder configuration read from a Hugging Face config.json (BERT, RoBERTa, XLM-RoBERTa)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from poot_core import CheckpointError, ModelConfig, Reason, Unsupported, require_key

ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
# RoBERTa-style models number positions from padding_idx + 1 (position padding_idx is the padding slot).
OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert")


@dataclass
class EncoderParams:
    layers: int
    hidden: int
    heads: int
    head_dim: int
    intermediate: int
    norm_eps: float
    act: str
    type_vocab: int
    # Added to 0, 1, 2, ... to get the stored position row of each token (read by Driver.encode).
    position_offset: int
    labels: int
    classifier: bool  # a sequence-classification checkpoint (cross-encoder)


def params_from_hf(hf: dict[str, Any]) -> EncoderParams:
    model_type = str(hf.get("model_type", "bert"))
    kind = hf.get("position_embedding_type", "absolute")
    if kind not in (None, "absolute"):
        raise Unsupported(Reason.OPERATION, f"position_embedding_type {kind}", f"{model_type} config")
    act_name = hf.get("hidden_act", "gelu")
    if act_name not in ACTIVATIONS:
        raise Unsupported(Reason.OPERATION, f"activation {act_name}", f"{model_type} config")
    hidden = int(require_key(hf, "hidden_size"))
    heads = int(require_key(hf, "num_attention_heads"))
    if heads < 1 or hidden % heads:
        raise CheckpointError("config.json", f"hidden_size {hidden} is not a multiple of {heads} heads")
    offset = int(hf.get("pad_token_id") or 0) + 1 if model_type in OFFSET_POSITIONS else 0
    archs = hf.get("architectures") or []
    classifier = any(isinstance(a, str) and a.endswith("ForSequenceClassification") for a in archs)
    labels = hf.get("num_labels") or len(hf.get("id2label") or {}) or 2
    return EncoderParams(
        layers=int(require_key(hf, "num_hidden_layers")),
        hidden=hidden,
        heads=heads,
        head_dim=hidden // heads,
        intermediate=int(require_key(hf, "intermediate_size")),
        norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
        act=ACTIVATIONS[act_name],
        type_vocab=int(hf.get("type_vocab_size", 2)),
        position_offset=offset,
        labels=int(labels),
        classifier=classifier,
    )


def model_config(family: str, hf: dict[str, Any]) -> ModelConfig:
    p = params_from_hf(hf)
    stored = int(hf.get("max_position_embeddings", 512))
    positions = stored - p.position_offset
    if positions < 1:
        raise CheckpointError("config.json", f"max_position_embeddings {stored} leaves no usable position")
    arch = (hf.get("architectures") or [hf.get("model_type", family)])[0]
    return ModelConfig(
        family=family,
        architecture=str(arch),
        vocab_size=int(require_key(hf, "vocab_size")),
        max_positions=positions,
        hidden_size=p.hidden,
        kind="encoder",
        params=p,
        raw=hf,
    )
