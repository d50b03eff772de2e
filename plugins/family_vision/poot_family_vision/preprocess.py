"""Image input as transformers' image processors (the Pillow ones) compute it.

Idefics3 / SmolVLM: decode (Pillow, RGB),
resize the longest edge to size.longest_edge (Lanczos, the shorter edge rounded up to an even length); then,
with image splitting (the processor's default), resize both sides up to multiples of max_image_size and cut
that into max_image_size tiles, row by row, followed by the whole image resized to the square (the global
image); without splitting, or when the image fits one tile, the square alone. Each frame is rescaled by 1/255
and normalized by mean and std.

Gemma 3: one resize to size.height x size.width (bilinear unless `resample` says otherwise), rescale, normalize;
pan and scan (crops of very wide or tall images after the whole one) only when asked, with Gemma3Processor's
crop settings, as a call to that processor with do_pan_and_scan=True does (it is off by default, whatever
preprocessor_config.json says)."""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from poot_core import Reason, RequestError, Unsupported

MAX_IMAGE_SIZE = 4096  # transformers' bound on the resized longest edge


def processor_config(path: str | Path) -> dict[str, Any]:
    """A checkpoint directory's preprocessor_config.json ({} when absent). Every family here always resizes,
    rescales and normalizes, so a processor that turns one of them off is refused."""
    file = Path(path) / "preprocessor_config.json"
    raw: dict[str, Any] = json.loads(file.read_text()) if file.is_file() else {}
    for key in ("do_resize", "do_rescale", "do_normalize"):
        if raw.get(key) is False:
            raise Unsupported(Reason.OPERATION, f"{key} false", "images are always resized, rescaled, normalized")
    return raw


@dataclass(frozen=True)
class ImageSettings:
    longest_edge: int
    square: int  # max_image_size.longest_edge: the side of what the tower sees
    rescale: float = 1 / 255
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    split: bool = True

    @classmethod
    def from_dir(cls, path: str | Path, image_size: int) -> ImageSettings:
        """preprocessor_config.json of a checkpoint directory; absent, the tower's own size."""
        raw = processor_config(path)
        square = int((raw.get("max_image_size") or {}).get("longest_edge", image_size))
        if square != image_size:
            raise Unsupported(Reason.SHAPE, f"max_image_size {square}", f"the vision tower takes {image_size}")
        longest = int((raw.get("size") or {}).get("longest_edge", square))
        return cls(longest_edge=longest, square=square, rescale=float(raw.get("rescale_factor", 1 / 255)),
                   mean=tuple(raw.get("image_mean", (0.5,) * 3)), std=tuple(raw.get("image_std", (0.5,) * 3)),
                   split=bool(raw.get("do_image_splitting", True)))


@dataclass(frozen=True)
class SquareSettings:
    """Gemma 3's image processor: every image resized to height x width; with pan and scan, a very wide or tall
    image also gives crops side by side (each resized the same), after the whole image."""

    height: int
    width: int
    resample: int = int(Image.Resampling.BILINEAR)
    rescale: float = 1 / 255
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    # Gemma3Processor's pan-and-scan settings: off unless a call asks, and its own crop settings then (a call
    # to the processor overrides what preprocessor_config.json says with these defaults)
    pan_and_scan: bool = False
    min_crop: int = 256
    max_crops: int = 4
    min_ratio: float = 1.2

    @classmethod
    def from_dir(cls, path: str | Path, image_size: int) -> SquareSettings:
        raw = processor_config(path)
        size = raw.get("size") or {}
        height, width = int(size.get("height", image_size)), int(size.get("width", image_size))
        if (height, width) != (image_size, image_size):
            raise Unsupported(Reason.SHAPE, f"image size {height}x{width}", f"the vision tower takes {image_size}")
        return cls(height=height, width=width, resample=int(raw.get("resample", Image.Resampling.BILINEAR)),
                   rescale=float(raw.get("rescale_factor", 1 / 255)), mean=tuple(raw.get("image_mean", (0.5,) * 3)),
                   std=tuple(raw.get("image_std", (0.5,) * 3)))


def _crop_count(long: int, short: int, s: SquareSettings) -> int:
    """Crops along the long edge: near the aspect ratio, none narrower than min_crop, 2 to max_crops."""
    return min(s.max_crops, max(2, min(math.floor(long / s.min_crop), math.floor(long / short + 0.5))))


def pan_and_scan(image: Image.Image, s: SquareSettings) -> list[Image.Image]:
    """Gemma3ImageProcessor.pan_and_scan: the crops of an image whose aspect ratio reaches min_ratio, side by
    side along its long edge (none for other images)."""
    width, height = image.size
    if max(width, height) / min(width, height) < s.min_ratio:
        return []
    across, down = (_crop_count(width, height, s), 1) if width >= height else (1, _crop_count(height, width, s))
    crop_w, crop_h = math.ceil(width / across), math.ceil(height / down)
    if min(crop_w, crop_h) < s.min_crop:
        return []
    array = np.asarray(image)  # numpy slicing, as the processor crops: the last crop may be narrower
    return [Image.fromarray(array[r * crop_h : (r + 1) * crop_h, c * crop_w : (c + 1) * crop_w])
            for r in range(down) for c in range(across)]


def square_frames(image: Image.Image, settings: SquareSettings) -> list[np.ndarray]:
    """float32 [3, height, width] each: Gemma 3's pixel values of one image, then of its crops."""
    crops = pan_and_scan(image, settings) if settings.pan_and_scan else []
    return [normalized(i.resize((settings.width, settings.height), Image.Resampling(settings.resample)), settings)
            for i in [image, *crops]]


def load_image(source: Image.Image | str | Path | bytes) -> Image.Image:
    """A Pillow image, a file path, a `data:image/...;base64,` URL, or encoded bytes -> an RGB image.
    Anything unreadable is a RequestError before any work."""
    try:
        with warnings.catch_warnings():  # Pillow only warns below twice its bound: refused here all the same
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = _open(source)
        # the size is in the header: a small file that would decode to a huge image is refused before decoding
        if image.width * image.height > Image.MAX_IMAGE_PIXELS:
            raise RequestError(f"an image of {image.width} x {image.height} pixels is larger than the "
                               f"{Image.MAX_IMAGE_PIXELS} pixels images may have")
        image.load()
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise RequestError(f"an image larger than the {Image.MAX_IMAGE_PIXELS} pixels images may have") from exc
    except (OSError, UnidentifiedImageError, binascii.Error, ValueError) as exc:
        raise RequestError(f"unreadable image: {exc}") from exc
    return to_rgb(image)


def _open(source: Image.Image | str | Path | bytes) -> Image.Image:
    """The image `source` names, opened (its header read, its pixels not yet decoded)."""
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, bytes):
        return Image.open(io.BytesIO(source))
    if isinstance(source, str) and source.startswith("data:"):
        head, _, payload = source.partition(",")
        if not head.endswith(";base64"):
            raise RequestError("an image data: URL must be base64-encoded")
        return Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
    if isinstance(source, str | Path):
        if isinstance(source, str) and source.startswith(("http://", "https://")):
            raise RequestError("image URLs are not fetched; pass a file path or a data: URL")
        return Image.open(Path(source))
    raise RequestError(f"an image must be a path, data: URL, bytes or PIL image, got {type(source).__name__}")


def to_rgb(image: Image.Image) -> Image.Image:
    """transformers' convert_to_rgb: transparency composited onto white, then RGB."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def _longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """transformers' _resize_output_size_rescale_to_max_len then _scale_below_upper_bound."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    if max(height, width) > MAX_IMAGE_SIZE:
        raise RequestError(f"images resize to at most {MAX_IMAGE_SIZE} pixels a side")
    return height, width


def normalized(image: Image.Image | np.ndarray, settings: ImageSettings | SquareSettings) -> np.ndarray:
    """float32 [3, H, W] of an RGB image [H, W, 3], rescaled and normalized as the processor does. Bytes (every
    decoded image) go through a table of the 256 values each channel can take, computed by the same
    arithmetic, so the result is the same bits at a fraction of the time."""
    array = np.asarray(image)
    if array.dtype != np.uint8:
        return _normalized(array, settings)
    table = _normalized(np.arange(256, dtype=np.uint8)[:, None].repeat(3, axis=1)[None], settings)[:, 0, :]
    return np.stack([table[c][array[..., c]] for c in range(3)])


def _normalized(array: np.ndarray, settings: ImageSettings | SquareSettings) -> np.ndarray:
    # transformers rescales in float64 and rounds to float32 once, then normalizes in float32
    x = (np.asarray(array, dtype=np.float64).transpose(2, 0, 1) * settings.rescale).astype(np.float32)
    mean = np.asarray(settings.mean, dtype=np.float32)[:, None, None]
    std = np.asarray(settings.std, dtype=np.float32)[:, None, None]
    return ((x - mean) / std).astype(np.float32)


def _multiples(height: int, width: int, side: int) -> tuple[int, int]:
    """transformers' resize_for_vision_encoder: both sides up to multiples of `side`, the aspect kept first."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / side) * side
        height = math.ceil(int(width / aspect) / side) * side
    else:
        height = math.ceil(height / side) * side
        width = math.ceil(int(height * aspect) / side) * side
    return height, width


def frames(image: Image.Image, settings: ImageSettings) -> tuple[list[np.ndarray], tuple[int, int]]:
    """The processor's frames of one image, float32 [3, S, S] each, and its (rows, cols) of tiles ((0, 0):
    not split)."""
    h, w = _longest_edge_size(image.height, image.width, settings.longest_edge)
    image = image.resize((w, h), Image.Resampling.LANCZOS)
    S = settings.square
    if settings.split:
        h, w = _multiples(h, w, S)
        image = image.resize((w, h), Image.Resampling.LANCZOS)
        if h > S or w > S:
            rows, cols = (h - S) // S + 1, (w - S) // S + 1
            array = np.asarray(image)
            tiles = [array[r * S : (r + 1) * S, c * S : (c + 1) * S] for r in range(rows) for c in range(cols)]
            whole = image.resize((S, S), Image.Resampling.LANCZOS)
            return [normalized(t, settings) for t in tiles] + [normalized(whole, settings)], (rows, cols)
        return [normalized(image, settings)], (0, 0)  # one tile: already S x S
    return [normalized(image.resize((S, S), Image.Resampling.LANCZOS), settings)], (0, 0)


def pixel_values(image: Image.Image, settings: ImageSettings) -> np.ndarray:
    """float32 [frames, 3, S, S] as the processor's pixel_values for one image."""
    return np.stack(frames(image, settings)[0])


def patches(pixels: np.ndarray, patch: int) -> np.ndarray:
    """[N, 3, S, S] -> [N, (S/p)^2, 3*p*p], each patch flattened as the convolution's weight is (channel, row,
    column), patches in row-major order."""
    n, c, s, _ = pixels.shape
    g = s // patch
    x = pixels.reshape(n, c, g, patch, g, patch).transpose(0, 2, 4, 1, 3, 5)
    return np.ascontiguousarray(x.reshape(n, g * g, c * patch * patch), dtype=np.float32)
