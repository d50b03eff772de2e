"""Idefics3 / SmolVLM over the tracer's ops, and the SigLIP tower Gemma 3 shares.

The vision step (SigLIP): patches flattened on the host [N, P, 3*p*p] -> linear (the patch convolution's
weight seen as a matrix) + position embeddings -> pre-norm encoder blocks (bidirectional attention, gelu MLP)
-> post layer norm; then the connector: pixel shuffle (a fixed reordering of patch rows, done as a row gather)
and one projection into the text model's width. Outputs: the tower's hidden state [N, P, Dv] and the image
features [N, P / s^2, Dt].

The text step is poot_core's dense decoder (trace_dense_decoder) read under the checkpoint's text prefix; when
the step carries images, their features replace the embeddings of the image tokens (the splice op), and with
`groups` an image's tokens attend to each other both ways (Gemma 3; the group_attention op).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from poot_core import EMBED_ROWS, EMBED_VALUES, GROUPS, ModelConfig, StepShape, Tracer, Value, trace_dense_decoder
from poot_family_vision.config import VisionLanguageParams, VisionParams

VISION = "model.vision_model."
CONNECTOR = "model.connector.modality_projection.proj."


class TextTracer:
    """The family's tracer seen by the dense decoder: `model.X` weights are read as `<prefix>X` (the first of
    `prefixes` the checkpoint holds an embedding table under), and with
    `images` > 0 the token embeddings get the step inputs EMBED_VALUES [images, Dt] (the image features) spliced
    in at the flat rows EMBED_ROWS [images]; with `groups` every attention also reads the step input groups [R, T] (the
    image of each token, -1 for text)."""

    def __init__(self, t: Tracer, images: int = 0, prefixes: tuple[str, ...] = ("model.text_model.",),
                 groups: bool = False) -> None:
        self._t, self._images = t, images
        self._prefix = first_prefix(t, prefixes, "embed_tokens.weight")
        self._groups = t.input(GROUPS, (t.graph.shape.rows, t.graph.shape.tokens)) if groups else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)

    def _name(self, name: str) -> str:
        return self._prefix + name[len("model."):] if name.startswith("model.") else name

    def weight(self, name: str) -> Value:
        return self._t.weight(self._name(name))

    def has_weight(self, name: str) -> bool:
        return self._t.has_weight(self._name(name))

    def optional_weight(self, name: str) -> Value | None:
        return self._t.optional_weight(self._name(name))

    def embed(self, table: Value, tokens: Value, scale: float | None = None) -> Value:
        x = self._t.embed(table, tokens, scale)
        if not self._images:
            return x
        features = self._t.input(EMBED_VALUES, (self._images, x.shape[-1]), "f32")
        index = self._t.input(EMBED_ROWS, (self._images,))
        return self._t.splice(x, features, index)

    def attention(self, *args: Any, **kwargs: Any) -> Value:
        return self._t.attention(*args, groups=self._groups, **kwargs)


def first_prefix(t: Tracer, prefixes: tuple[str, ...], probe: str) -> str:
    """The first of `prefixes` under which the checkpoint has `probe` (the last one when none has: tracing then
    fails naming the weight it misses)."""
    return next((p for p in prefixes if t.has_weight(p + probe)), prefixes[-1])


def trace_text(cfg: ModelConfig, t: Tracer, images: int = 0, groups: bool = False, mrope: bool = False) -> None:
    """mrope: every rope is Qwen2.5-VL's M-RoPE over its own position inputs (qwen25vl.MropeText); without it a
    Qwen2.5-VL text model ropes by the plain positions, which M-RoPE equals for text alone."""
    p: VisionLanguageParams = cfg.params
    text: Any = TextTracer(t, images, p.text_prefixes, groups)
    if mrope and p.mrope_sections:
        from poot_family_vision.qwen25vl import MropeText

        text = MropeText(text, p.mrope_sections, p.text.head_dim)
    trace_dense_decoder(replace(cfg, params=p.text), text)  # type: ignore[arg-type]


def vision_shape(p: VisionParams, images: int) -> StepShape:
    return StepShape(images, p.patches, p.patches, hidden=True)


def trace_vision(p: VisionParams, t: Tracer, images: int) -> None:
    N, P, D = images, p.patches, p.hidden
    x = trace_siglip(p, t, images, VISION)
    # pixel shuffle: a gather of D-wide rows by `shuffle` [N * P], then s^2 rows side by side per token
    s2 = p.scale_factor**2
    rows = t.embed(t.reshape(x, (N * P, D)), t.input("shuffle", (N * P,)))
    joined = t.reshape(rows, (N, P // s2, D * s2))
    t.output(t.linear(joined, t.weight(CONNECTOR + "weight"), t.optional_weight(CONNECTOR + "bias")))


def trace_siglip(p: VisionParams, t: Tracer, images: int, prefix: str) -> Value:
    """The SigLIP tower under `prefix` over the step inputs patches [N, P, 3*p*p], patch_positions [N, P] and
    mask [N, P]; its last hidden state [N, P, Dv] is the step's first output, and returned."""
    N, P, D = images, p.patches, p.hidden
    pixels = t.input("patches", (N, P, 3 * p.patch * p.patch), "f32")
    positions = t.input("patch_positions", (N, P))
    mask = t.input("mask", (N, P))
    emb = prefix + "embeddings."
    conv = t.weight(emb + "patch_embedding.weight")  # [D, 3, p, p]
    x = t.linear(pixels, t.reshape(conv, (D, conv.shape[1] * p.patch * p.patch)),
                 t.optional_weight(emb + "patch_embedding.bias"))
    x = t.add(x, t.embed(t.weight(emb + "position_embedding.weight"), positions))
    for i in range(p.layers):
        x = _block(t, p, f"{prefix}encoder.layers.{i}.", x, mask, N, P)
    x = _norm(t, p, prefix + "post_layernorm", x)
    t.output(x)
    return x


def _norm(t: Tracer, p: VisionParams, stem: str, x: Value) -> Value:
    return t.layer_norm(x, t.weight(stem + ".weight"), t.optional_weight(stem + ".bias"), p.norm_eps)


def _block(t: Tracer, p: VisionParams, pre: str, x: Value, mask: Value, N: int, P: int) -> Value:
    def dense(name: str, h: Value) -> Value:
        return t.linear(h, t.weight(pre + name + ".weight"), t.optional_weight(pre + name + ".bias"))

    def heads(h: Value) -> Value:
        return t.reshape(h, (N, P, p.heads, p.head_dim))

    h = _norm(t, p, pre + "layer_norm1", x)
    q, k, v = (heads(dense(f"self_attn.{n}_proj", h)) for n in "qkv")
    o = t.encoder_attention(q, k, v, mask, scale=p.head_dim**-0.5)
    x = t.add(x, dense("self_attn.out_proj", t.reshape(o, (N, P, p.hidden))))
    h = _norm(t, p, pre + "layer_norm2", x)
    return t.add(x, dense("mlp.fc2", t.activation(dense("mlp.fc1", h), p.act)))


def shuffle_index(p: VisionParams, images: int) -> np.ndarray:
    """The source row of each output row of transformers' Idefics3 pixel_shuffle, over N * P flat rows."""
    side, s = p.image_size // p.patch, p.scale_factor
    grid = np.arange(p.patches).reshape(1, side, side, 1)
    # the same views and permutes as Idefics3Connector.pixel_shuffle, on patch numbers instead of features
    g = grid.reshape(1, side, side // s, s).transpose(0, 2, 1, 3)
    g = g.reshape(1, side // s, side // s, s * s).transpose(0, 2, 1, 3).reshape(-1)
    return (np.arange(images)[:, None] * p.patches + g[None, :]).reshape(-1).astype(np.int64)
