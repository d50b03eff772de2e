"""Gemma 3 (Gemma3ForConditionalGeneration) over the tracer's ops.

The vision step: the SigLIP tower (model.trace_siglip), then transformers' Gemma3MultiModalProjector: the
patches' side x side grid average-pooled by k x k to mm_tokens_per_image tokens (a row gather that puts each
token's k^2 patches side by side, their sum, / k^2), the soft-embedding RMS norm (Gemma's (1 + w), the tower's
eps) and the projection into the text width (the stored [Dv, Dt] matrix, read transposed as a derived weight).

The text step is the Gemma 3 text model (poot_core's dense decoder read as gemma3_text, as the llama family
reads Gemma3ForCausalLM) with the image features spliced in at the image soft tokens; in a step with images
every layer's attention is the group_attention op, where an image's tokens see each other both ways (still
within a sliding layer's window), as transformers' mask for token_type_ids does.

Checkpoints keep the parts under transformers 5's saved names (language_model.model., vision_tower.,
multi_modal_projector.), the released checkpoints' (vision_tower.vision_model.) or the in-memory ones
(model.language_model., ...): the first prefix that holds a part is read.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from poot_core import (
    DerivedWeight,
    ModelConfig,
    PackedWeight,
    Reason,
    StoredWeights,
    Tracer,
    Unsupported,
    decoder_params_from_hf,
    require_key,
)
from poot_family_vision.config import VisionLanguageParams, language_config, vision_params
from poot_family_vision.model import first_prefix, trace_siglip

TEXT_PREFIXES = ("model.language_model.", "language_model.model.")
VISION_PREFIXES = ("model.vision_tower.vision_model.", "model.vision_tower.", "vision_tower.vision_model.",
                   "vision_tower.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
PROJECTION = "multi_modal_projector.input_projection.weight"  # derived [Dt, Dv]: the stored matrix transposed
# transformers' Gemma3Config defaults
IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN, TOKENS_PER_IMAGE = 262_144, 255_999, 256_000, 256
# transformers' Gemma3TextConfig and SiglipVisionConfig defaults: released config.json files leave them out
TEXT_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                 "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                 "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
                 "query_pre_attn_scalar": 256, "sliding_window": 4096, "tie_word_embeddings": True}
ROPE_DEFAULTS = {"rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}  # global and sliding layers
VISION_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                   "image_size": 224, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6}


def gemma3_config(family: str, hf: dict[str, Any]) -> ModelConfig:
    tc = TEXT_DEFAULTS | dict(require_key(hf, "text_config", "config.json"))
    if "rope_parameters" not in tc:
        tc = ROPE_DEFAULTS | tc
    vc = VISION_DEFAULTS | dict(require_key(hf, "vision_config", "config.json"))
    text_type = str(tc.get("model_type", "gemma3_text"))
    if text_type != "gemma3_text":
        raise Unsupported(Reason.REGISTRY, f"{family} with a {text_type} text model", "Gemma 3 reads gemma3_text")
    if tc.get("use_bidirectional_attention"):
        raise Unsupported(Reason.OPERATION, "use_bidirectional_attention", "a Gemma 3 text model attends causally")
    tokens = int(hf.get("mm_tokens_per_image") or TOKENS_PER_IMAGE)
    side = int(require_key(vc, "image_size", "vision_config")) // int(require_key(vc, "patch_size", "vision_config"))
    per_side = math.isqrt(tokens)
    if per_side * per_side != tokens or side % per_side:
        raise Unsupported(Reason.SHAPE, f"mm_tokens_per_image {tokens}",
                          f"the average pooling needs a square number of tokens whose side divides {side} patches")
    params = VisionLanguageParams(
        text=decoder_params_from_hf(tc, "gemma3_text"), vision=vision_params(vc, side // per_side, "Gemma 3"),
        image_token_id=int(hf.get("image_token_index", hf.get("image_token_id", IMAGE_TOKEN))), kind="gemma3",
        text_prefixes=TEXT_PREFIXES, boi_token_id=int(hf.get("boi_token_index", BOI_TOKEN)),
        eoi_token_id=int(hf.get("eoi_token_index", EOI_TOKEN)))
    return language_config(family, hf, tc, params)


def projection_weight(config: ModelConfig, store: StoredWeights) -> dict[str, DerivedWeight]:
    """The projector's matrix as a linear reads it ([Dt, Dv]), transposed once when the vision step needs it."""
    shapes = store.shapes()
    stored = next((p + "mm_input_projection_weight" for p in PROJECTOR_PREFIXES
                   if p + "mm_input_projection_weight" in shapes), None)
    if stored is None:
        return {}  # tracing the vision step names the weight it misses

    def transposed() -> Any:
        w = store.get(stored)
        if isinstance(w, PackedWeight):
            raise Unsupported(Reason.QUANTIZATION, f"{stored} as {w.kind}", "the projector is read dense")
        return w.t().contiguous()

    dv, dt = shapes[stored]
    return {PROJECTION: (transposed, (dt, dv))}


def trace_vision(p: VisionLanguageParams, t: Tracer, images: int) -> None:
    v = p.vision
    N, P, D = images, v.patches, v.hidden
    x = trace_siglip(v, t, images, first_prefix(t, VISION_PREFIXES, "post_layernorm.weight"))
    k2, tokens = v.scale_factor**2, v.tokens_per_image
    rows = t.embed(t.reshape(x, (N * P, D)), t.input("pool", (N * P,)))  # [N * P, D], by pool_index
    joined = t.reshape(rows, (N, tokens, k2 * D))  # each token's k^2 patches side by side
    total = t.slice(joined, 0, D)
    for j in range(1, k2):
        total = t.add(total, t.slice(joined, j * D, (j + 1) * D))
    pooled = t.scale(total, 1.0 / k2)
    projector = first_prefix(t, PROJECTOR_PREFIXES, "mm_soft_emb_norm.weight")
    normed = t.rms_norm(pooled, t.weight(projector + "mm_soft_emb_norm.weight"), v.norm_eps, p.soft_norm_offset)
    t.output(t.linear(normed, t.weight(PROJECTION)))


def pool_index(p: VisionLanguageParams, images: int) -> np.ndarray:
    """The source row of each gathered row over N * P flat rows: tokens row by row over the pooled grid, and
    for each its k x k patches (AvgPool2d's window over the side x side grid the projector reshapes to)."""
    v = p.vision
    side, k = v.image_size // v.patch, v.scale_factor
    grid = np.arange(v.patches).reshape(side // k, k, side // k, k).transpose(0, 2, 1, 3).reshape(-1)
    return (np.arange(images)[:, None] * v.patches + grid[None, :]).reshape(-1).astype(np.int64)


def image_groups(tokens: list[int], image_token_id: int) -> np.ndarray:
    """[1, T]: the image each token belongs to (consecutive runs of image tokens numbered from 0), -1 for text;
    transformers' get_block_sequence_ids_for_mask."""
    is_image = np.asarray(tokens) == image_token_id
    starts = is_image & ~np.concatenate(([False], is_image[:-1]))
    return np.where(is_image, np.cumsum(starts) - 1, -1).astype(np.int64)[None, :]


def image_text(boi: str, soft: str, eoi: str, tokens: int, crops: int = 0) -> str:
    """Gemma3Processor's replacement of each start-of-image token the template wrote: the full image sequence,
    and with pan-and-scan crops, one more for each crop after a sentence that says so."""
    full = f"\n\n{boi}{soft * tokens}{eoi}\n\n"
    if not crops:
        return full
    return (f"Here is the original image {full} and here are some crops to help you see better "
            + " ".join([full] * crops))
