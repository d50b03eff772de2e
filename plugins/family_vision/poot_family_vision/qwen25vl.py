"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration) over the tracer's ops.

The vision step, over the L patches of all images in window order (qwen25vl_input.vision_layout):
patches [1, L, 3*2*14*14] -> linear (the 3D patch convolution's weight seen as a matrix, no bias) -> blocks of
RMSNorm, attention (one qkv projection; the 2D rope; within windows, or within each image on the layers of
fullatt_block_indexes), RMSNorm, SwiGLU MLP with biases -> the hidden state [1, L, Dv] (transformers'
last_hidden_state, window order) -> the merger: RMSNorm, each 2 x 2 block of patches side by side [L/4, 4 Dv],
linear, gelu, linear into the text width, rows back to the processor's order -> image features [L/4, Dt].

The 2D rope rotates a head's features (rotate-half pairs) by the patch's row for the first quarter of the
frequencies' slots and by its column for the second, over head_dim/4 frequencies of theta 10000: two rope ops
(frequencies given as factors of the plain rope's) whose halves are picked by 0/1 masks. The text model is
Qwen2 (poot_core's dense decoder) with M-RoPE the same way: one rope per section of mrope_section (temporal,
height, width positions), each section's features picked by a mask; rotating by a position and multiplying by
1 or 0 is exact, so this is the reference's arithmetic. Attention itself keeps the token's index in the KV
state as its position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from poot_core import (
    HF_ACTIVATIONS,
    SECTION_POSITIONS,
    ModelConfig,
    Reason,
    StepShape,
    Tracer,
    Unsupported,
    Value,
    decoder_params_from_hf,
    require_key,
)
from poot_family_vision.config import VisionLanguageParams, language_config
from poot_family_vision.model import first_prefix

TEXT_PREFIXES = ("model.language_model.", "model.")
VISION_PREFIXES = ("model.visual.", "visual.")
SECTIONS = ("t", "h", "w")
IMAGE_TOKEN, VISION_START, VISION_END = 151_655, 151_652, 151_653  # transformers' Qwen2_5_VLConfig defaults


@dataclass
class QwenVisionParams:
    layers: int
    hidden: int
    heads: int
    intermediate: int
    act: str
    patch: int
    temporal: int
    merge: int
    window: int
    full_layers: tuple[int, ...]
    out_hidden: int
    theta: float = 10_000.0
    norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal * self.patch * self.patch


def qwen25vl_config(family: str, hf: dict[str, Any]) -> ModelConfig:
    vc = dict(require_key(hf, "vision_config", "config.json"))
    # released checkpoints keep the text model's fields at the top (transformers moves them into text_config)
    tc = dict(hf.get("text_config") or {k: v for k, v in hf.items() if k != "vision_config"})
    rope = dict(tc.get("rope_parameters") or tc.get("rope_scaling") or {})
    sections = tuple(int(s) for s in rope.pop("mrope_section", (16, 24, 24)))
    if rope.get("rope_type", rope.get("type")) in ("mrope", "default", None):
        rope["rope_type"] = "default"
        rope.pop("type", None)
    rope.setdefault("rope_theta", tc.get("rope_theta", 1_000_000.0))
    tc["rope_parameters"] = rope
    tc.pop("rope_scaling", None)
    tc.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
    text = decoder_params_from_hf(tc, "qwen2")
    if len(sections) != 3 or 2 * sum(sections) != text.head_dim or text.rotary_dim != text.head_dim:
        raise Unsupported(Reason.SHAPE, f"mrope_section {sections}",
                          f"three sections of head_dim/2 = {text.head_dim // 2}")
    act = vc.get("hidden_act", "silu")
    if act not in HF_ACTIVATIONS:
        raise Unsupported(Reason.OPERATION, f"vision activation {act}", "Qwen2.5-VL config")
    hidden, heads = int(vc.get("hidden_size", 3584)), int(vc.get("num_heads", 16))
    vrope = vc.get("rope_parameters") or {}
    vision = QwenVisionParams(
        layers=int(vc.get("depth", 32)), hidden=hidden, heads=heads,
        intermediate=int(vc.get("intermediate_size", 3420)),
        act=HF_ACTIVATIONS[act], patch=int(vc.get("patch_size", 14)), temporal=int(vc.get("temporal_patch_size", 2)),
        merge=int(vc.get("spatial_merge_size", 2)), window=int(vc.get("window_size", 112)),
        full_layers=tuple(int(i) for i in vc.get("fullatt_block_indexes", (7, 15, 23, 31))),
        out_hidden=int(vc.get("out_hidden_size", 3584)), theta=float(vrope.get("rope_theta", 10_000.0)))
    if hidden % heads or (hidden // heads) % 4 or int(vc.get("in_channels", 3)) != 3:
        raise Unsupported(Reason.SHAPE, f"vision heads of {hidden}/{heads}", "the 2D rope needs head_dim % 4 == 0")
    if vision.out_hidden != text.hidden:
        raise Unsupported(Reason.SHAPE, f"out_hidden_size {vision.out_hidden}", f"the text width is {text.hidden}")
    params = VisionLanguageParams(
        text=text, vision=vision, image_token_id=int(hf.get("image_token_id", IMAGE_TOKEN)),  # type: ignore[arg-type]
        kind="qwen2_5_vl", text_prefixes=TEXT_PREFIXES,
        boi_token_id=int(hf.get("vision_start_token_id", VISION_START)),
        eoi_token_id=int(hf.get("vision_end_token_id", VISION_END)), mrope_sections=sections)
    return language_config(family, hf, tc, params)


# --- rope by sections ---------------------------------------------------------------------------------
def section_masks(head_dim: int, sections: tuple[int, ...]) -> list[np.ndarray]:
    """float32 [head_dim] each: 1 where a feature's rotate-half frequency slot lies in the section."""
    slot = np.arange(head_dim) % (head_dim // 2)
    bounds = np.cumsum((0, *sections))
    return [((slot >= a) & (slot < b)).astype(np.float32) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def sectioned_rope(t: Tracer, x: Value, positions: list[Value], masks: list[Value], **rope: Any) -> Value:
    """sum over sections of rope(x, that section's positions) * its mask."""
    out = None
    for pos, mask in zip(positions, masks, strict=True):
        part = t.mul(t.rope(x, pos, **rope), mask)
        out = part if out is None else t.add(out, part)
    assert out is not None
    return out


class MropeText:
    """Wraps the text model's tracer: every rope becomes M-RoPE over the step inputs rope_t/rope_h/rope_w [R, T]
    with masks rope_mask_t/h/w [head_dim]."""

    def __init__(self, inner: Any, sections: tuple[int, ...], head_dim: int) -> None:
        self._inner = inner
        shape = inner.graph.shape
        self._positions = [inner.input(name, (shape.rows, shape.tokens)) for name in SECTION_POSITIONS]
        self._masks = [inner.input(f"rope_mask_{s}", (head_dim,), "f32") for s in SECTIONS]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def rope(self, x: Value, positions: Value, **rope: Any) -> Value:
        return sectioned_rope(self._inner, x, self._positions, self._masks, **rope)


def mrope_inputs(positions: np.ndarray, sections: tuple[int, ...], head_dim: int) -> dict[str, np.ndarray]:
    """The M-RoPE step inputs for positions [3, T] of one row."""
    return ({name: positions[i][None, :].astype(np.int64) for i, name in enumerate(SECTION_POSITIONS)}
            | mrope_masks(sections, head_dim))


def mrope_masks(sections: tuple[int, ...], head_dim: int) -> dict[str, np.ndarray]:
    """The step inputs that pick each section's features (fixed for a model)."""
    masks = section_masks(head_dim, sections)
    return {f"rope_mask_{s}": masks[i] for i, s in enumerate(SECTIONS)}


def vision_rope_scaling(p: QwenVisionParams) -> dict[str, Any]:
    """A rope over the whole head whose frequency slot j turns at the axial rope's frequency j mod head_dim/4
    (the plain rope's frequencies divided by these factors)."""
    d = p.head_dim
    plain = 1.0 / (p.theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    axial = 1.0 / (p.theta ** (torch.arange(0, d // 2, 2, dtype=torch.float) / (d // 2)))
    wanted = torch.cat([axial, axial])
    return {"rope_type": "freq_factors", "factors": tuple(float(f) for f in (plain / wanted).tolist())}


# --- the vision step ----------------------------------------------------------------------------------
def vision_shape(rows: int) -> StepShape:
    return StepShape(1, rows, rows, hidden=True)


def trace_vision(p: QwenVisionParams, t: Tracer, rows: int, windows: tuple[int, int], images: tuple[int, int]) -> None:
    """rows: patches of all images; windows, images: (segments, width) of the two attention kinds."""
    L, D = rows, p.hidden
    pre = first_prefix(t, VISION_PREFIXES, "patch_embed.proj.weight")
    x = t.linear(t.input("patches", (1, L, p.patch_dim), "f32"),
                 t.reshape(t.weight(pre + "patch_embed.proj.weight"), (D, p.patch_dim)))
    positions = [t.input("vision_h", (1, L)), t.input("vision_w", (1, L))]
    masks = [t.input(f"vision_mask_{s}", (p.head_dim,), "f32") for s in "hw"]
    rope = {"theta": p.theta, "dim": p.head_dim, "style": "neox", "scaling": vision_rope_scaling(p)}
    attend = {kind: (t.input(f"{kind}_gather", (n * w,)), t.input(f"{kind}_mask", (n, w)),
                     t.input(f"{kind}_scatter", (L,)), n, w)
              for kind, (n, w) in (("window", windows), ("image", images))}

    def dense(name: str, h: Value) -> Value:
        return t.linear(h, t.weight(name + ".weight"), t.optional_weight(name + ".bias"))

    def norm(name: str, h: Value) -> Value:
        return t.rms_norm(h, t.weight(name + ".weight"), p.norm_eps)

    for i in range(p.layers):
        b = f"{pre}blocks.{i}."
        qkv = dense(b + "attn.qkv", norm(b + "norm1", x))
        q, k, v = (t.reshape(t.slice(qkv, j * D, (j + 1) * D), (1, L, p.heads, p.head_dim)) for j in range(3))
        q, k = (sectioned_rope(t, y, positions, masks, **rope) for y in (q, k))
        gather, mask, scatter, n, w = attend["image" if i in p.full_layers else "window"]
        # each segment's rows gathered into a padded row [n, w] (padding masked as keys)
        qs, ks, vs = (t.reshape(t.embed(t.reshape(y, (L, D)), gather), (n, w, p.heads, p.head_dim)) for y in (q, k, v))
        o = t.encoder_attention(qs, ks, vs, mask, scale=p.head_dim**-0.5)
        o = t.reshape(t.embed(t.reshape(o, (n * w, D)), scatter), (1, L, D))
        x = t.add(x, dense(b + "attn.proj", o))
        h = norm(b + "norm2", x)
        x = t.add(x, dense(b + "mlp.down_proj", t.gated(dense(b + "mlp.gate_proj", h), dense(b + "mlp.up_proj", h),
                                                           p.act)))
    t.output(x)
    unit = p.merge * p.merge
    merged = t.reshape(norm(pre + "merger.ln_q", x), (1, L // unit, unit * D))
    merged = dense(pre + "merger.mlp.2", t.activation(dense(pre + "merger.mlp.0", merged), "gelu"))
    t.output(t.embed(t.reshape(merged, (L // unit, p.out_hidden)), t.input("reverse", (L // unit,))))
