"""Qwen2.5-VL's image input as transformers computes it, and the index tables its vision step and M-RoPE read.

The image processor (Qwen2VLImageProcessorPil): smart_resize to multiples of patch * merge (28) with the pixel
count within min/max pixels, a bicubic resize, rescale and normalize (CLIP's mean and std), then patches of
14 x 14 in merge-block order (each 2 x 2 block of patches one after another), each patch the image twice in
time (temporal_patch_size 2) flattened as the 3D convolution's weight is (channel, time, row, column).

The vision step runs over the patches of all images reordered by window (get_vision_window_index): each
window's patches lie together, so a window-attention layer is attention within consecutive segments, and a
full-attention layer within each image's segment. Both are run as encoder attention over the segments gathered
into padded rows (`segments`). The merger's rows come back to the processor's order by `reverse`.

The text model's positions (get_rope_index): text tokens count up by one; an image's tokens take (t, h, w) of
its merged grid from the position after the text before it; the text after an image continues from that
position + max(h, w).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from poot_core import Reason, RequestError, Unsupported
from poot_family_vision.preprocess import normalized, processor_config

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class QwenImageSettings:
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch: int = 14
    temporal: int = 2
    merge: int = 2
    resample: int = int(Image.Resampling.BICUBIC)
    rescale: float = 1 / 255
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD

    @classmethod
    def from_dir(cls, path: str | Path, patch: int, temporal: int, merge: int) -> QwenImageSettings:
        raw = processor_config(path)
        size = raw.get("size") or {}
        found = (int(raw.get("patch_size", patch)), int(raw.get("temporal_patch_size", temporal)),
                 int(raw.get("merge_size", merge)))
        if found != (patch, temporal, merge):
            raise Unsupported(Reason.SHAPE, f"image patches {found}",
                              f"the vision tower takes {(patch, temporal, merge)}")
        return cls(min_pixels=int(raw.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels),
                   max_pixels=int(raw.get("max_pixels") or size.get("longest_edge") or cls.max_pixels),
                   patch=patch, temporal=temporal, merge=merge,
                   resample=int(raw.get("resample", Image.Resampling.BICUBIC)),
                   rescale=float(raw.get("rescale_factor", 1 / 255)), mean=tuple(raw.get("image_mean", CLIP_MEAN)),
                   std=tuple(raw.get("image_std", CLIP_STD)))


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' smart_resize: both sides multiples of `factor`, the pixel count within the bounds."""
    if max(height, width) / min(height, width) > 200:
        raise RequestError(f"an image's aspect ratio must be below 200, got {max(height, width) / min(height, width)}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_patches(image: Image.Image, s: QwenImageSettings) -> tuple[np.ndarray, tuple[int, int, int]]:
    """float32 [h * w, 3 * temporal * patch^2] of one image and its grid (1, h, w) of patches."""
    height, width = smart_resize(image.height, image.width, s.patch * s.merge, s.min_pixels, s.max_pixels)
    x = normalized(image.resize((width, height), Image.Resampling(s.resample)), s)  # [3, H, W]
    gh, gw, m, p = height // s.patch, width // s.patch, s.merge, s.patch
    x = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # (bh, bw, mh, mw, C, ph, pw)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], s.temporal, p, p))
    return np.ascontiguousarray(x.reshape(gh * gw, 3 * s.temporal * p * p), dtype=np.float32), (1, gh, gw)


@dataclass
class Segments:
    """Attention within consecutive segments of L rows, run as padded rows: gather [S * W] (the source row of
    each padded slot), mask [S, W] (1 for a real row) and scatter [L] (each row's slot)."""

    gather: np.ndarray
    mask: np.ndarray
    scatter: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return self.mask.shape  # type: ignore[return-value]


def segments(lengths: list[int]) -> Segments:
    lengths = [n for n in lengths if n]
    width, total = max(lengths), sum(lengths)
    gather = np.zeros((len(lengths), width), np.int64)
    mask = np.zeros((len(lengths), width), np.int64)
    scatter = np.zeros(total, np.int64)
    start = 0
    for s, n in enumerate(lengths):
        gather[s, :n] = np.arange(start, start + n)
        mask[s, :n] = 1
        scatter[start : start + n] = s * width + np.arange(n)
        start += n
    return Segments(gather.reshape(-1), mask, scatter)


@dataclass
class VisionLayout:
    """The vision step's tables for a list of image grids: the patch order by window (`order`, over the
    processor's rows), the 2D rope positions in that order, the window and full-attention segments, and the
    merged rows' way back to the processor's order."""

    order: np.ndarray
    h_pos: np.ndarray
    w_pos: np.ndarray
    windows: Segments
    images: Segments
    reverse: np.ndarray


def vision_layout(grids: list[tuple[int, int, int]], merge: int, window: int, patch: int) -> VisionLayout:
    unit = merge * merge
    per_window = window // merge // patch  # merged tokens along a window's side
    window_index, window_lengths, h_all, w_all = [], [], [], []
    first = 0
    for t, h, w in grids:
        lh, lw = h // merge, w // merge
        index = np.arange(t * lh * lw).reshape(t, lh, lw)
        pad_h, pad_w = per_window - lh % per_window, per_window - lw % per_window
        padded = np.pad(index, ((0, 0), (0, pad_h), (0, pad_w)), constant_values=-100)
        nh, nw = (lh + pad_h) // per_window, (lw + pad_w) // per_window
        padded = padded.reshape(t, nh, per_window, nw, per_window).transpose(0, 1, 3, 2, 4)
        padded = padded.reshape(t, nh * nw, per_window * per_window)
        window_lengths += ((padded != -100).sum(-1).reshape(-1) * unit).tolist()
        flat = padded.reshape(-1)
        window_index.append(flat[flat != -100] + first)
        first += t * lh * lw
        hp = np.broadcast_to(np.arange(h)[:, None], (h, w)).reshape(lh, merge, lw, merge).transpose(0, 2, 1, 3)
        wp = np.broadcast_to(np.arange(w)[None, :], (h, w)).reshape(lh, merge, lw, merge).transpose(0, 2, 1, 3)
        h_all.append(np.tile(hp.reshape(-1), t))
        w_all.append(np.tile(wp.reshape(-1), t))
    units = np.concatenate(window_index)
    order = (units[:, None] * unit + np.arange(unit)[None, :]).reshape(-1)
    h_pos, w_pos = np.concatenate(h_all)[order], np.concatenate(w_all)[order]
    images = segments([t * h * w for t, h, w in grids])
    return VisionLayout(order.astype(np.int64), h_pos.astype(np.int64), w_pos.astype(np.int64),
                        segments(window_lengths), images, np.argsort(units).astype(np.int64))


def rope_positions(tokens: list[int], image_token_id: int, grids: list[tuple[int, int, int]],
                   merge: int) -> tuple[np.ndarray, int]:
    """([3, T] temporal / height / width positions of the prompt, the delta a later token's position adds to
    its index), as get_rope_index computes them for images (each run of image tokens one image, in order)."""
    is_image = np.asarray(tokens) == image_token_id
    out = np.zeros((3, len(tokens)), np.int64)
    position, i, image = 0, 0, 0
    while i < len(tokens):
        j = i
        while j < len(tokens) and is_image[j] == is_image[i]:
            j += 1
        if not is_image[i]:
            out[:, i:j] = position + np.arange(j - i)
            position += j - i
        else:
            if image >= len(grids):
                raise RequestError(f"the prompt has more runs of image tokens than the {len(grids)} images")
            t, h, w = grids[image]
            lh, lw = h // merge, w // merge
            if j - i != t * lh * lw:
                raise RequestError(f"image {image} has {j - i} image tokens; its grid needs {t * lh * lw}")
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(lh), np.arange(lw), indexing="ij")
            out[:, i:j] = np.stack([tt, hh, ww]).reshape(3, -1) + position
            position += max(lh, lw)
            image += 1
        i = j
    if image != len(grids):
        raise RequestError(f"the prompt has {image} runs of image tokens for {len(grids)} images")
    return out, int(out.max()) + 1 - len(tokens) if len(tokens) else 0
