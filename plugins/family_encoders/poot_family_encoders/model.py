"""The BERT-style encoder written once over the tracer's ops (BERT, RoBERTa, XLM-RoBERTa).

Post-layer-norm blocks: x = LN(x + attention(x)); x = LN(x + mlp(x)). Attention is bidirectional over the
real tokens of each row (mask [R, T]: 1 real, 0 padding). The step outputs the final hidden state of every
position; pooling and classifier heads run on the host. Shapes: R rows, T tokens, D hidden, H heads.
"""

from __future__ import annotations

from poot_core import ModelConfig, Reason, StepShape, Tracer, Unsupported, Value
from poot_family_encoders.config import EncoderParams

# Where the encoder's weights live in the checkpoint: bare (BertModel saved alone, sentence-transformers)
# or under the base model's name inside a task model (BertForSequenceClassification -> "bert.").
PREFIXES = ("", "bert.", "roberta.", "model.")


def weight_prefix(names: set[str] | Tracer) -> str:
    for prefix in PREFIXES:
        key = prefix + "embeddings.word_embeddings.weight"
        if names.has_weight(key) if isinstance(names, Tracer) else key in names:
            return prefix
    raise KeyError("embeddings.word_embeddings.weight")



def trace_encoder(cfg: ModelConfig, t: Tracer, shape: StepShape) -> None:
    if not shape.hidden:
        raise Unsupported(
            Reason.SHAPE,
            f"{cfg.family} step {shape}",
            "an encoder gives hidden states only (prepare it with Driver.prepare_encode)",
        )
    p: EncoderParams = cfg.params
    R, T = shape.rows, shape.tokens
    tokens = t.input("tokens", (R, T))
    positions = t.input("positions", (R, T))
    token_types = t.input("token_types", (R, T))
    mask = t.input("mask", (R, T))
    pre = weight_prefix(t)
    emb = pre + "embeddings."
    x = t.embed(t.weight(emb + "word_embeddings.weight"), tokens)  # [R, T, D]
    x = t.add(x, t.embed(t.weight(emb + "position_embeddings.weight"), positions))
    types = t.optional_weight(emb + "token_type_embeddings.weight")
    if types is not None:
        x = t.add(x, t.embed(types, token_types))
    x = t.layer_norm(x, t.weight(emb + "LayerNorm.weight"), t.optional_weight(emb + "LayerNorm.bias"), p.norm_eps)
    for i in range(p.layers):
        x = _block(t, p, f"{pre}encoder.layer.{i}.", x, mask, R, T)
    t.output(x)


def _block(t: Tracer, p: EncoderParams, pre: str, x: Value, mask: Value, R: int, T: int) -> Value:
    def dense(name: str, h: Value) -> Value:
        return t.linear(h, t.weight(pre + name + ".weight"), t.optional_weight(pre + name + ".bias"))

    def norm(name: str, h: Value) -> Value:
        return t.layer_norm(h, t.weight(pre + name + ".weight"), t.optional_weight(pre + name + ".bias"), p.norm_eps)

    def heads(h: Value) -> Value:
        return t.reshape(h, (R, T, p.heads, p.head_dim))

    q = heads(dense("attention.self.query", x))
    k = heads(dense("attention.self.key", x))
    v = heads(dense("attention.self.value", x))
    o = t.encoder_attention(q, k, v, mask, scale=p.head_dim**-0.5)  # [R, T, H, Dh]
    o = dense("attention.output.dense", t.reshape(o, (R, T, p.hidden)))
    x = norm("attention.output.LayerNorm", t.add(x, o))
    h = t.activation(dense("intermediate.dense", x), p.act)
    return norm("output.LayerNorm", t.add(x, dense("output.dense", h)))
