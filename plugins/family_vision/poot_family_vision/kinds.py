"""What differs between the vision-language architectures at run time: how an image becomes the tower's
frames, what replaces the placeholder the chat template writes for it, the vision step and its own inputs, and
whether an image's tokens attend to each other both ways in the text model."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
from PIL import Image

from poot_core import ModelHandle, Reason, RequestError, Tracer, Unsupported
from poot_family_vision import gemma3
from poot_family_vision.config import VisionLanguageParams
from poot_family_vision.messages import IMAGE, image_text
from poot_family_vision.model import shuffle_index, trace_vision
from poot_family_vision.preprocess import ImageSettings, SquareSettings, frames, square_frames


class Idefics3Images:
    bidirectional = False
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


class Gemma3Images:
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


def images_of(handle: ModelHandle, params: VisionLanguageParams,
              pan_and_scan: bool = False) -> Idefics3Images | Gemma3Images:
    if params.kind == "gemma3":
        return Gemma3Images(handle, params, pan_and_scan=pan_and_scan)
    if pan_and_scan:
        raise Unsupported(Reason.OPERATION, "pan and scan", "Gemma 3's processor has it; Idefics3 splits images")
    return Idefics3Images(handle, params)
