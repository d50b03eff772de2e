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
from poot_core.graph.ir import SECTION_POSITIONS


@dataclass
class PromptEmbeddings:
    """Prompt positions whose input embeddings are given instead of their tokens' (a vision model's image
    features: VisionLanguageModel.request makes them): rows int [N], strictly increasing positions of the
    prompt; values float32 [N, hidden]. The serving engine (Layout.PAGED) of a family that takes them
    (Family.prompt_embeddings) runs such a request. For a family whose rope turns by sections
    (Family.rope_sections: Qwen2.5-VL's M-RoPE), positions int [sections, len(prompt)] are every prompt token's
    rope positions, and a later token's are its index plus `offset` in every section."""

    rows: np.ndarray
    values: np.ndarray
    positions: np.ndarray | None = None
    offset: int = 0

    def digest(self) -> str:
        h = hashlib.sha256(np.ascontiguousarray(self.rows, dtype=np.int64).tobytes())
        h.update(np.ascontiguousarray(self.values, dtype=np.float32).tobytes())
        if self.positions is not None:
            h.update(np.ascontiguousarray(self.positions, dtype=np.int64).tobytes() + str(self.offset).encode())
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


def checked(e: PromptEmbeddings, prompt_len: int, hidden: int, family: str, takes: bool,
            sections: int = 0) -> PromptEmbeddings:
    """The embeddings as int64 rows and positions and float32 values, or a typed refusal naming what is wrong.
    sections: the family's (Family.rope_sections); with them, positions are required."""
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
    positions = e.positions
    if (positions is None) != (sections == 0):
        raise RequestError(f"{family} takes prompt embeddings with rope positions in {sections} sections"
                           if sections else f"{family} ropes by one position a token: give no positions")
    if positions is not None:
        positions = np.asarray(positions)
        if positions.shape != (sections, prompt_len) or not np.issubdtype(positions.dtype, np.integer):
            raise RequestError(f"rope positions of shape {positions.shape}: [{sections}, {prompt_len}] expected")
        if positions.min() < 0 or int(positions.max()) + max(int(e.offset), 0) >= 2**31:
            raise RequestError("rope positions must lie in [0, 2**31)")
        positions = positions.astype(np.int64)
    return PromptEmbeddings(rows.astype(np.int64), values, positions, int(e.offset))


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


def section_positions(chunks: Iterable[Chunk], sections: int, tokens: int) -> dict[str, np.ndarray]:
    """The step inputs of StepShape.sections ([1, tokens] each, padding 0): a prompt token's rope positions from
    its request's embeddings, any other token its position plus the request's offset (0 without embeddings) in
    every section."""
    out = np.zeros((sections, 1, tokens), np.int64)
    offset = 0
    for e, start, count in chunks:
        index = np.arange(start, start + count)
        if e is None or e.positions is None:
            out[:, 0, offset : offset + count] = index
        else:
            prompt = min(max(e.positions.shape[1] - start, 0), count)  # of these tokens, the prompt's
            out[:, 0, offset : offset + prompt] = e.positions[:, start : start + prompt]
            out[:, 0, offset + prompt : offset + count] = index[prompt:] + e.offset
        offset += count
    return {name: out[i] for i, name in enumerate(SECTION_POSITIONS[:sections])}


def spans(e: PromptEmbeddings) -> list[tuple[int, int]]:
    """The runs of consecutive rows, as [start, end) prompt positions (an image's tokens each)."""
    rows = e.rows
    if not len(rows):
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    return [(int(run[0]), int(run[-1]) + 1) for run in np.split(rows, breaks)]


def whole_spans(runs: list[tuple[int, int]], start: int, n: int, budget: int) -> int:
    """How many of n tokens from `start` a step runs so that no run of `runs` is split: cut before a run the
    step would enter and not finish, or take a run that starts at `start` whole (0 when it does not fit
    `budget`: a later step with more room takes it)."""
    end = start + n
    for a, b in runs:
        if a < end < b:
            if a > start:
                return a - start
            return b - start if b - start <= budget else 0
    return n


def step_groups(runs: Iterable[tuple[list[tuple[int, int]], int, int]], tokens: int) -> np.ndarray | None:
    """The step input of StepShape.grouped ([1, tokens]: a whole run's tokens its number, -1 for the others),
    from each sequence's whole runs (Sequence.whole), the position its tokens start at and how many; None when
    no sequence runs any of its runs."""
    out = np.full((1, tokens), -1, np.int64)
    offset, found = 0, False
    for whole, start, count in runs:
        for g, (a, b) in enumerate(whole):
            lo, hi = max(a, start), min(b, start + count)
            if lo < hi:
                out[0, offset + lo - start : offset + hi - start] = g
                found = True
        offset += count
    return out if found else None


__all__ = ["ImagePrompts", "PromptEmbeddings", "checked", "salted", "section_positions", "spans", "step_groups",
           "step_rows", "whole_spans"]
