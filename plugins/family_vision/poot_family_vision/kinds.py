"""What differs between the vision-language architectures at run time: how an image becomes the tower's
frames, what replaces the placeholder the chat template writes for it, the vision step and its own inputs, and
whether an image's tokens attend to each other both ways in the text model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
from PIL import Image

from poot_core import ModelHandle, Reason, RequestError, StepShape, Tracer, Unsupported
from poot_family_vision import gemma3, qwen25vl
from poot_family_vision.config import VisionLanguageParams
from poot_family_vision.messages import IMAGE, image_text
from poot_family_vision.model import shuffle_index, trace_vision, vision_shape
from poot_family_vision.preprocess import ImageSettings, SquareSettings, frames, patches, square_frames
from poot_family_vision.qwen25vl_input import QwenImageSettings, image_patches, rope_positions, vision_layout

# the vision step's shape, its trace, its inputs, and what the trace depends on beside the shape (the key of its
# prepared program, runtime.VisionLanguageModel._program)
VisionStep = tuple[StepShape, Callable[[Tracer], None], dict[str, np.ndarray], tuple[Any, ...]]


class SquareImages:
    """Kinds whose tower takes square frames of one size: frames [N, 3, S, S], positions as the text's."""

    bidirectional = False
    mrope = False
    params: VisionLanguageParams

    def trace(self, t: Tracer, images: int) -> None:
        raise NotImplementedError

    def inputs(self, images: int) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def vision_step(self, pixels: np.ndarray, layouts: Any = None) -> VisionStep:
        """The vision step's shape, its trace and its inputs for frames [N, 3, S, S]."""
        vp, n = self.params.vision, int(pixels.shape[0])
        inputs = {"patches": patches(pixels, vp.patch),
                  "patch_positions": np.broadcast_to(np.arange(vp.patches), (n, vp.patches)).astype(np.int64),
                  "mask": np.ones((n, vp.patches), dtype=np.int64)} | self.inputs(n)
        return vision_shape(vp, n), lambda t: self.trace(t, n), inputs, (n,)

    def prompt_inputs(self, tokens: list[int], layouts: Any) -> tuple[dict[str, np.ndarray], int]:
        """The text step's inputs beside tokens and positions, and the offset of later tokens' rope positions."""
        return {}, 0

    def rope_positions(self, tokens: list[int], layouts: Any) -> tuple[np.ndarray | None, int]:
        """The prompt's rope positions by section [sections, T] and the offset of later tokens' (None, 0: the
        rope turns by the token's index)."""
        return None, 0

    def step_inputs(self, position: int, delta: int) -> dict[str, np.ndarray]:
        return {}


class Idefics3Images(SquareImages):
    placeholder = IMAGE

    def __init__(self, handle: ModelHandle, params: VisionLanguageParams) -> None:
        self.params = params
        self.settings = ImageSettings.from_dir(handle.path, params.vision.image_size)

    def frames(self, image: Image.Image) -> tuple[list[np.ndarray], Any]:
        """The image's frames and its layout (rows, cols) of tiles."""
        return frames(image, self.settings)

    def text(self, layout: Any) -> str:
        return image_text(layout, self.params.vision.tokens_per_image)

    def trace(self, t: Tracer, images: int) -> None:
        trace_vision(self.params.vision, t, images)

    def inputs(self, images: int) -> dict[str, np.ndarray]:
        return {"shuffle": shuffle_index(self.params.vision, images)}


class Gemma3Images(SquareImages):
    bidirectional = True

    def __init__(self, handle: ModelHandle, params: VisionLanguageParams, settings: SquareSettings | None = None,
                 pan_and_scan: bool = False) -> None:
        self.params, self._handle = params, handle
        settings = settings or SquareSettings.from_dir(handle.path, params.vision.image_size)
        self.settings = replace(settings, pan_and_scan=pan_and_scan)

    def _token(self, token_id: int | None) -> str:
        name = None if token_id is None else self._handle.text().tokenizer.id_to_token(token_id)
        if name is None:
            raise RequestError(f"the tokenizer has no token {token_id}, which Gemma 3's image prompt needs")
        return name

    @property
    def placeholder(self) -> str:
        return self._token(self.params.boi_token_id)

    def frames(self, image: Image.Image) -> tuple[list[np.ndarray], Any]:
        """The image's frames (the whole image, then its pan-and-scan crops) and the number of crops."""
        done = square_frames(image, self.settings)
        return done, len(done) - 1

    def text(self, layout: Any) -> str:
        p = self.params
        return gemma3.image_text(self.placeholder, self._token(p.image_token_id), self._token(p.eoi_token_id),
                                 p.vision.tokens_per_image, crops=layout)

    def trace(self, t: Tracer, images: int) -> None:
        gemma3.trace_vision(self.params, t, images)

    def inputs(self, images: int) -> dict[str, np.ndarray]:
        return {"pool": gemma3.pool_index(self.params, images)}


class QwenImages:
    """Qwen2.5-VL: images of their own sizes as patches [L, 3 * 2 * 14 * 14] (the processor's pixel_values), the
    layout of each its grid (1, h, w) of patches; `<|image_pad|>` repeated once per merged token; M-RoPE."""

    bidirectional = False
    mrope = True

    def __init__(self, handle: ModelHandle, params: VisionLanguageParams,
                 settings: QwenImageSettings | None = None) -> None:
        self.params, self._handle = params, handle
        vp = params.vision
        self.settings = settings or QwenImageSettings.from_dir(handle.path, vp.patch, vp.temporal, vp.merge)

    @property
    def placeholder(self) -> str:
        name = self._handle.text().tokenizer.id_to_token(self.params.image_token_id)
        if name is None:
            raise RequestError(f"the tokenizer has no image token {self.params.image_token_id}")
        return name

    def frames(self, image: Image.Image) -> tuple[list[np.ndarray], Any]:
        """The image's patch rows (stacked: the processor's pixel_values) and its grid (1, h, w)."""
        rows, grid = image_patches(image, self.settings)
        return list(rows), grid

    def text(self, layout: Any) -> str:
        t, h, w = layout
        return self.placeholder * (t * h * w // self.params.vision.merge**2)

    def _grids(self, pixels: np.ndarray, layouts: Any) -> list[tuple[int, int, int]]:
        if layouts is None:
            raise RequestError("Qwen2.5-VL's pixel values need each image's grid (t, h, w) of patches")
        grids = [tuple(int(v) for v in g) for g in layouts]
        if sum(t * h * w for t, h, w in grids) != pixels.shape[0]:
            raise RequestError(f"{pixels.shape[0]} patches for grids {grids}")
        return grids  # type: ignore[return-value]

    def vision_step(self, pixels: np.ndarray, layouts: Any) -> VisionStep:
        vp = self.params.vision
        grids = self._grids(pixels, layouts)
        lay = vision_layout(grids, vp.merge, vp.window, vp.patch)
        rows = int(pixels.shape[0])
        h_mask, w_mask = qwen25vl.section_masks(vp.head_dim, (vp.head_dim // 4, vp.head_dim // 4))
        inputs = {"patches": np.ascontiguousarray(pixels[lay.order][None], dtype=np.float32),
                  "vision_h": lay.h_pos[None], "vision_w": lay.w_pos[None], "vision_mask_h": h_mask,
                  "vision_mask_w": w_mask, "reverse": lay.reverse}
        for kind, seg in (("window", lay.windows), ("image", lay.images)):
            inputs |= {f"{kind}_gather": seg.gather, f"{kind}_mask": seg.mask, f"{kind}_scatter": seg.scatter}

        def trace(t: Tracer) -> None:
            qwen25vl.trace_vision(vp, t, rows, lay.windows.shape, lay.images.shape)

        return qwen25vl.vision_shape(rows), trace, inputs, (rows, lay.windows.shape, lay.images.shape)

    def prompt_inputs(self, tokens: list[int], layouts: Any) -> tuple[dict[str, np.ndarray], int]:
        positions, delta = self.rope_positions(tokens, layouts)
        return qwen25vl.mrope_inputs(positions, self.params.mrope_sections, self.params.text.head_dim), delta

    def rope_positions(self, tokens: list[int], layouts: Any) -> tuple[np.ndarray, int]:
        grids = [tuple(int(v) for v in g) for g in (layouts or [])]
        return rope_positions(tokens, self.params.image_token_id, grids, self.params.vision.merge)

    def step_inputs(self, position: int, delta: int) -> dict[str, np.ndarray]:
        positions = np.full((3, 1), position + delta, np.int64)
        return qwen25vl.mrope_inputs(positions, self.params.mrope_sections, self.params.text.head_dim)


Kind = Idefics3Images | Gemma3Images | QwenImages


def images_of(handle: ModelHandle, params: VisionLanguageParams, pan_and_scan: bool = False) -> Kind:
    if params.kind == "gemma3":
        return Gemma3Images(handle, params, pan_and_scan=pan_and_scan)
    if params.kind == "qwen2_5_vl" and not pan_and_scan:
        return QwenImages(handle, params)
    if pan_and_scan:
        raise Unsupported(Reason.OPERATION, "pan and scan", "Gemma 3's processor has it; Idefics3 splits images")
    return Idefics3Images(handle, params)
