"""Prompt embeddings in the serving engine: prompt positions whose input embeddings are given instead of their
tokens' (a vision model's image features; the family splices them in, StepShape.embedded).

A request's embeddings are checked at submit; each step takes the given rows that fall inside its sequences'
chunks (a prompt may be prefilled over several steps, and a preempted sequence recomputes its rows from the
same request), padded to a bucket so the set of prepared programs stays small. Their placeholder tokens say
nothing of what they hold, so the digest of the embeddings joins the request's prefix-cache salt: only a
request with the same embeddings at the same positions shares those blocks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from poot_core.errors import Reason, RequestError, Unsupported


@dataclass
class PromptEmbeddings:
    """Prompt positions whose input embeddings are given instead of their tokens' (a vision model's image
    features: VisionLanguageModel.request makes them): rows int [N], strictly increasing positions of the
    prompt; values float32 [N, hidden]. The serving engine (Layout.PAGED) of a family that takes them
    (Family.prompt_embeddings) runs such a request."""

    rows: np.ndarray
    values: np.ndarray

    def digest(self) -> str:
        h = hashlib.sha256(np.ascontiguousarray(self.rows, dtype=np.int64).tobytes())
        h.update(np.ascontiguousarray(self.values, dtype=np.float32).tobytes())
        return h.hexdigest()


class ImagePrompts(Protocol):
    """A vision family's part in serving images (Family.image_prompts; `poot serve`): chat messages with image
    parts rendered with each image's placeholder tokens, and the images' features as the prompt embeddings of
    those tokens (the server calls `embeddings` on the engine's thread, which owns the executor)."""

    def render(self, text: Any, messages: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None) -> tuple[Any, list[Any]]:
        """(the rendered chat, as TextServices.render_chat_value gives it, and the images in order)."""
        ...

    def embeddings(self, prompt: list[int], images: list[Any]) -> PromptEmbeddings | None: ...


def checked(e: PromptEmbeddings, prompt_len: int, hidden: int, family: str, takes: bool) -> PromptEmbeddings:
    """The embeddings as int64 rows and float32 values, or a typed refusal naming what is wrong."""
    if not takes:
        raise Unsupported(Reason.OPERATION, f"prompt embeddings for {family}",
                          "this family's serving step does not splice given embeddings")
    rows = np.asarray(e.rows)
    values = np.asarray(e.values)
    if rows.ndim != 1 or not np.issubdtype(rows.dtype, np.integer):
        raise RequestError("prompt embedding rows must be one list of integer positions")
    if values.shape != (len(rows), hidden):
        raise RequestError(f"prompt embeddings of shape {values.shape}: {len(rows)} rows of {hidden} expected")
    if len(rows) and (rows[0] < 0 or rows[-1] >= prompt_len or np.any(np.diff(rows) <= 0)):
        raise RequestError(f"prompt embedding rows must increase and lie inside the prompt of {prompt_len}")
    values = values.astype(np.float32)
    if not np.all(np.isfinite(values)):
        raise RequestError("prompt embeddings hold a value that is not finite")
    return PromptEmbeddings(rows.astype(np.int64), values)


def salted(salt: str | None, e: PromptEmbeddings | None) -> str | None:
    """The prefix-cache salt of a request with these embeddings."""
    if e is None or not len(e.rows):
        return salt
    return f"{salt or ''}|embeddings:{e.digest()}"


Chunk = tuple[PromptEmbeddings | None, int, int]  # a sequence's embeddings, its first position in the step, count


def step_rows(chunks: Iterable[Chunk], bucket: Callable[[int], int]) -> tuple[np.ndarray, np.ndarray] | None:
    """(flat rows of the step, their values) of the given rows inside each chunk; None when there are none.
    Each chunk is (embeddings, the position its tokens start at, how many); chunks lie one after another in
    the step's row. Padded to `bucket(n)` entries by repeating the last one (the same row, the same values)."""
    rows, values = [], []
    offset = 0
    for e, start, count in chunks:
        if e is not None and len(e.rows):
            lo, hi = np.searchsorted(e.rows, [start, start + count])
            if hi > lo:
                rows.append(offset + e.rows[lo:hi] - start)
                values.append(e.values[lo:hi])
        offset += count
    if not rows:
        return None
    flat, vals = np.concatenate(rows), np.concatenate(values)
    pad = bucket(len(flat)) - len(flat)
    if pad:
        flat = np.concatenate([flat, np.repeat(flat[-1:], pad)])
        vals = np.concatenate([vals, np.repeat(vals[-1:], pad, axis=0)])
    return flat, vals


__all__ = ["ImagePrompts", "PromptEmbeddings", "checked", "salted", "step_rows"]
