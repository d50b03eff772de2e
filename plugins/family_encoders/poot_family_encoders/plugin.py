"""poot-family-encoders' entry point: the encoder families it serves."""

from __future__ import annotations

from typing import Any

from poot_core import Family, ModelConfig, StepShape, Tracer, hookimpl
from poot_family_encoders.config import model_config
from poot_family_encoders.model import trace_encoder, weight_prefix

# (weight stem, activation after it) applied to the first token's hidden state, per head style.
# BERT: the pooler (dense + tanh), then `classifier`. RoBERTa: classifier.dense + tanh, then out_proj.
BERT_HEAD = (("pooler.dense", "tanh"), ("classifier", None))
ROBERTA_HEAD = (("classifier.dense", "tanh"), ("classifier.out_proj", None))


class Encoder(Family):
    """One encoder family; instances differ by name and the names they serve."""

    def __init__(self, name: str, architectures: tuple[str, ...]) -> None:
        super().__init__(name, architectures=architectures)

    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        return model_config(self.name, hf)

    def trace(self, config: ModelConfig, t: Tracer, shape: StepShape) -> None:
        trace_encoder(config, t, shape)

    def classifier_steps(self, config: ModelConfig, names: set[str]) -> list[tuple[str, str | None, str | None]]:
        """The sequence-classification head as (weight, bias or None, activation or None) steps over the
        first token's final hidden state; [] when the checkpoint has no head."""
        pre = weight_prefix(names)
        for head in (BERT_HEAD, ROBERTA_HEAD):
            stems = [(pre + s if s.startswith("pooler") else s) for s, _ in head]
            if all(f"{s}.weight" in names for s in stems):
                return [
                    (f"{s}.weight", f"{s}.bias" if f"{s}.bias" in names else None, act)
                    for s, (_, act) in zip(stems, head, strict=True)
                ]
        return []


FAMILIES = [
    Encoder("bert", ("BertModel", "BertForSequenceClassification", "BertForMaskedLM", "bert")),
    Encoder("roberta", ("RobertaModel", "RobertaForSequenceClassification", "RobertaForMaskedLM", "roberta")),
    Encoder(
        "xlm-roberta",
        ("XLMRobertaModel", "XLMRobertaForSequenceClassification", "XLMRobertaForMaskedLM", "xlm-roberta"),
    ),
]


@hookimpl
def poot_register_families() -> list[Family]:
    return list(FAMILIES)


__all__ = ["FAMILIES", "Encoder"]
