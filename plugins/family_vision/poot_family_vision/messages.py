"""Images in OpenAI-style chat messages, as the models' processors prompt them.

Content parts: {"type": "text", "text": ...}, {"type": "image_url", "image_url": {"url": "data:..." or a
path}} (or "image_url": "..."), {"type": "image", "image": path | data URL | PIL image}. Image parts become
{"type": "image"} for the chat template, which writes a placeholder for each (`<image>` in Idefics3's,
`<start_of_image>` in Gemma 3's); every placeholder the template wrote is then expanded as the processor
does. Gemma 3: "\n\n<start_of_image>" + `<image_soft_token>` x tokens per image + "<end_of_image>\n\n".
Idefics3: an image not split is
`<fake_token_around_image><global-img>` + `<image>` x tokens per image + `<fake_token_around_image>`; a split
one has each tile as `<fake_token_around_image><row_R_col_C>` + image tokens, a line break after each row of
tiles, then a line break and the global image as above.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from PIL import Image

from poot_core import RequestError
from poot_family_vision.preprocess import load_image

IMAGE, AROUND, GLOBAL = "<image>", "<fake_token_around_image>", "<global-img>"


def _image_source(part: dict[str, Any]) -> Any:
    if part.get("type") == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise RequestError("an image_url part needs image_url.url (a data: URL or a file path)")
        return url
    source = part.get("image", part.get("url", part.get("path")))
    if source is None:
        raise RequestError("an image part needs its image (a path, a data: URL or a PIL image)")
    return source


def split_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Image.Image]]:
    """The messages with image parts as {"type": "image"}, and the images decoded, in order."""
    if not isinstance(messages, list):
        raise RequestError("messages must be a list")
    out, images = [], []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("image", "image_url"):
                images.append(load_image(_image_source(part)))
                parts.append({"type": "image"})
            elif kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            else:
                raise RequestError(f"unsupported message content part {kind!r}")
        out.append({**message, "content": parts})
    return out, images


def image_text(grid: tuple[int, int], tokens_per_image: int) -> str:
    """Idefics3Processor's replacement of one `<image>` for an image of (rows, cols) tiles ((0, 0): not split)."""
    rows, cols = grid
    whole = AROUND + GLOBAL + IMAGE * tokens_per_image + AROUND
    if rows == cols == 0:
        return whole
    tiles = "".join("".join(f"{AROUND}<row_{r + 1}_col_{c + 1}>" + IMAGE * tokens_per_image for c in range(cols))
                    + "\n" for r in range(rows))
    return tiles + "\n" + whole


def expand_images(rendered: Any, placeholder: str, texts: list[str]) -> Any:
    """The rendered chat with each `placeholder` the template wrote replaced by the next of `texts`, one per
    image; placeholders spelled inside messages stay as they are."""
    written = sum(piece.count(placeholder) for piece, from_message in rendered.segments if not from_message)
    if written != len(texts):
        raise RequestError(f"the chat template wrote {written} image placeholders for {len(texts)} images "
                           "(does this model's template take image parts?)")
    it = iter(texts)
    segments = tuple((piece if from_message else "".join(p + (next(it) if i < piece.count(placeholder) else "")
                                                          for i, p in enumerate(piece.split(placeholder))),
                      from_message)
                     for piece, from_message in rendered.segments)
    return replace(rendered, text="".join(p for p, _ in segments), segments=segments)
