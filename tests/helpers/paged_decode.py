"""A paged decode step built by hand for the hybrid families' recurrent ops: a few sequences at chosen positions
and state slots (not in slot order), padding after them, every state pool filled with random values first (a step
in the middle of serving), so a batched step can be checked against each sequence alone."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

# (token, position, state slot) of each sequence of the step: one at position 0 (its slot starts from zeros)
ROWS = [(17, 9, 4), (5, 0, 1), (88, 3, 2)]
WIDTH = 4  # one padding row after them
SLOTS = 6  # slots 0, 3 and 5 are nobody's: the step must leave them as they were (padding reads slot 0)


def fill_random(state: dict[str, Any], seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for name in sorted(state):
        t = state[name]
        t.copy_((torch.randn(t.shape, generator=g) * 0.5).to(t.dtype))


def decode_inputs(engine: Any, rows: list[tuple[int, int, int]], width: int) -> dict[str, np.ndarray]:
    """The engine's inputs of a decode step (token i in sequence slot i) of `rows`, padded to `width`; the
    sequence in state slot s owns KV blocks s * max_blocks onwards, whatever else shares its step."""
    paging = engine._shape(width, width, decode=True).paging
    tokens, positions = np.zeros((1, width), np.int64), np.zeros((1, width), np.int64)
    seq_index, slots = np.full(width, -1, np.int64), np.zeros(width, np.int64)
    tables = np.zeros((width, paging.max_blocks), np.int64)
    for i, (token, position, slot) in enumerate(rows):
        tokens[0, i], positions[0, i], seq_index[i], slots[i] = token, position, i, slot
        tables[i] = np.arange(paging.max_blocks) + slot * paging.max_blocks
    return {"tokens": tokens, "positions": positions, "seq_index": seq_index, "block_tables": tables,
            "logit_index": np.arange(width, dtype=np.int64), "state_slots": slots}


def run_decode(engine: Any, state: dict[str, Any], rows: list[tuple[int, int, int]], width: int) -> np.ndarray:
    """Logits [len(rows), vocab] of one decode step of `rows` over `state` (updated)."""
    shape = engine._shape(width, width, decode=True)
    out = engine.program(shape).run(state, decode_inputs(engine, rows, width))[0]
    return np.asarray(engine.driver.executor.to_numpy(out)).reshape(width, -1)[: len(rows)]


def recurrent_names(engine: Any) -> list[str]:
    graph = engine.driver._trace(engine._shape(1, 1, decode=True))
    return sorted(name for name, spec in graph.state.items() if spec.recurrent)
