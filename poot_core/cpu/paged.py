"""The CPU executor's paged KV layout: attention of a flat step of tokens from many sequences over pools of
fixed-size blocks (StepShape.paging).

Decode tokens (runs of at most c_attention.MAX_QUERIES tokens of a sequence) attend in one C call that reads
the keys through the block tables (c_attention.attend_paged). For longer runs (prefill chunks), each
sequence's blocks are gathered into a contiguous cache of its own, the contiguous layout's kernels run on it
(ops.attention: flash attention for a chunk; mla.mla_attention), and the positions the step wrote are put
back into the sequence's blocks. A query's arithmetic is therefore the contiguous layout's, over the same keys
in the same order: it does not depend on the other sequences of the step, and a decode token gives bit for
bit the logits-path inputs a contiguous decode step gives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from poot_core.cpu import ops
from poot_core.graph import sequence_runs


@dataclass(frozen=True)
class StepPlan:
    """What the attention of every layer of one paged step shares, worked out once per step (plan())."""

    short: torch.Tensor | None  # the tokens of runs of at most MAX_QUERIES (decode), or None
    leading: int  # when those are exactly the step's first `leading` tokens (the scheduler puts decode first)
    long: list[tuple[int, int, int]]  # (slot, first token, end token) of the longer runs (prefill chunks)
    padding_from: int  # the tokens from here on are padding, and none before (0 when padding lies between)
    positions: torch.Tensor  # int64 [N]
    seqs: torch.Tensor  # int64 [N]
    tables: torch.Tensor  # int64 [S, M]
    # the tokens of the long runs, and the block and offset each one's key and value go to
    long_tokens: torch.Tensor | None
    long_slots: tuple[torch.Tensor, torch.Tensor] | None


def plan(e: dict[str, Any], positions: torch.Tensor, seq_index: torch.Tensor, tables: torch.Tensor,
         block_size: int) -> StepPlan:
    """The step's plan, kept in its environment `e` (the step's inputs are the same for every layer)."""
    found = e.get("paged:plan")
    if found is None:
        from poot_core.cpu.c_attention import MAX_QUERIES

        runs = list(sequence_runs(seq_index))
        short = [r for r in runs if r[2] - r[1] <= MAX_QUERIES]
        tokens = [t for _, t0, t1 in short for t in range(t0, t1)]
        leading = len(tokens) if tokens == list(range(len(tokens))) else 0
        real = sum(t1 - t0 for _, t0, t1 in runs)
        padding_from = real if all(t1 <= real for _, _, t1 in runs) else 0
        long = [r for r in runs if r[2] - r[1] > MAX_QUERIES]
        pos, seqs, tabs = (positions[0].to(torch.int64).contiguous(), seq_index.to(torch.int64).contiguous(),
                           tables.to(torch.int64).contiguous())
        long_tokens = slots = None
        if long:
            long_tokens = torch.cat([torch.arange(t0, t1) for _, t0, t1 in long])
            at = pos[long_tokens]
            slots = tabs[seqs[long_tokens], at // block_size], at % block_size
        found = e["paged:plan"] = StepPlan(torch.tensor(tokens) if tokens else None, leading, long, padding_from,
                                           pos, seqs, tabs, long_tokens, slots)
    return found


def _gather(pool: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """pool [blocks, H, B, D] -> the listed blocks as one contiguous cache [1, H, len(blocks) * B, D]."""
    picked = pool[blocks]  # [n, H, B, D]
    n, heads, size, dim = picked.shape
    return picked.transpose(0, 1).reshape(1, heads, n * size, dim)


def _scatter(pool: torch.Tensor, blocks: torch.Tensor, cache: torch.Tensor, local: torch.Tensor,
             block_size: int) -> None:
    """Put the positions `local` (of the gathered cache) back into their blocks of the pool."""
    at, offset = blocks[local // block_size], local % block_size
    pool[at, :, offset] = cache[0, :, local].transpose(0, 1)


def _blocks_of(table: torch.Tensor, first: int, end: int, block_size: int) -> tuple[torch.Tensor, int]:
    """The block ids holding positions [first.., end) of a sequence, whole blocks, and the first one's position."""
    lo = first // block_size
    return table[lo : (end + block_size - 1) // block_size], lo * block_size


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, step: StepPlan,
              k_pool: torch.Tensor, v_pool: torch.Tensor, scale: float, window: int | None,
              softcap: float | None) -> torch.Tensor:
    """q [1, N, Hq, D]; k, v [1, N, Hkv, D]; positions [1, N]; the step's plan (its seq_index [N] and tables
    [S, M]); pools [blocks, Hkv, B, D]. Returns [1, N, Hq, Dv], zeros for padding tokens."""
    from poot_core.cpu.c_attention import attend_paged

    block_size = k_pool.shape[2]
    runs = step.long
    if step.short is not None:  # decode tokens: through the tables, one C call
        if step.leading:
            n = step.leading
            few = attend_paged(q[0, :n], k[0, :n], v[0, :n], step.positions[:n], step.seqs[:n], step.tables, k_pool,
                               v_pool, scale, window, softcap)
            if few is not None and not runs and n == q.shape[1]:
                return few[None]  # a step of decode tokens only, no padding
        else:
            at = step.short
            few = attend_paged(q[0, at], k[0, at], v[0, at], step.positions[at], step.seqs[at], step.tables, k_pool,
                               v_pool, scale, window, softcap)
        if few is None:  # the kernel does not apply: every run through the contiguous kernels below
            runs = list(sequence_runs(step.seqs))
    out = torch.empty(*q.shape[:3], v.shape[-1])
    out[:, step.padding_from :] = 0.0
    if step.short is not None and few is not None:
        if step.leading:
            out[0, : step.leading] = few
        else:
            out[0, step.short] = few
    if runs and runs is step.long and step.long_tokens is not None and step.long_slots is not None:
        # prefill chunks: their keys and values into their blocks, then one C call reading the blocks
        from poot_core.cpu.c_attention import attend_paged_blocks

        blocks, offsets = step.long_slots
        k_pool[blocks, :, offsets] = k[0, step.long_tokens]
        v_pool[blocks, :, offsets] = v[0, step.long_tokens]
        done = attend_paged_blocks(q[0], step.positions, runs, step.tables, k_pool, v_pool, scale, window, softcap)
        if done is not None:
            out[0, step.long_tokens] = done[step.long_tokens]
            return out
    for slot, t0, t1 in runs:
        pos = positions[0, t0:t1]
        start, end = int(pos[0]), int(pos[-1]) + 1
        first = 0 if window is None else max(0, start - window + 1)  # keys before it are never read
        blocks, base = _blocks_of(step.tables[slot], first, end, block_size)
        kc, vc = _gather(k_pool, blocks), _gather(v_pool, blocks)
        local = pos - base
        out[:, t0:t1] = ops.attention(q[:, t0:t1], k[:, t0:t1], v[:, t0:t1], local[None], kc, vc, scale, window,
                                      softcap)
        _scatter(k_pool, blocks, kc, local, block_size)
        _scatter(v_pool, blocks, vc, local, block_size)
    return out


def group_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, groups: torch.Tensor,
                    step: StepPlan, k_pool: torch.Tensor, v_pool: torch.Tensor, scale: float, window: int | None,
                    softcap: float | None) -> torch.Tensor:
    """attention() where a sequence's run of tokens holding groups (groups [1, N], -1 for none: an image's
    tokens, whole in the run) also attend to each other both ways: the run's blocks gathered and the
    contiguous group attention run on them (cpu/group_attention.py), as the contiguous layout computes it."""
    from poot_core.cpu.group_attention import group_attention as contiguous

    out = attention(q, k, v, positions, step, k_pool, v_pool, scale, window, softcap)  # writes the K/V too
    block_size = k_pool.shape[2]
    for slot, t0, t1 in sequence_runs(step.seqs):
        g = groups[0, t0:t1]
        if not bool((g >= 0).any()):
            continue
        pos = positions[0, t0:t1]
        start, end = int(pos[0]), int(pos[-1]) + 1
        first = 0 if window is None else max(0, start - window + 1)
        blocks, base = _blocks_of(step.tables[slot], first, end, block_size)
        kc, vc = _gather(k_pool, blocks), _gather(v_pool, blocks)
        out[:, t0:t1] = contiguous(q[:, t0:t1], k[:, t0:t1], v[:, t0:t1], (pos - base)[None], kc, vc, g[None],
                                   scale, window, softcap)
    return out


def latent_attention(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, seq_index: torch.Tensor,
                     tables: torch.Tensor, pool: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     run: Callable[..., torch.Tensor], a: dict[str, Any]) -> torch.Tensor:
    """Latent attention (mla.mla_attention as `run`) of a paged step: q [1, N, H, dn + dr], kv [1, N, L + dr],
    pool [blocks, 1, B, L + dr], cos/sin [1, N, 1, dr / 2]. Returns [1, N, H, v_dim]."""
    block_size = pool.shape[2]
    out = torch.zeros(*q.shape[:3], a["v_dim"])
    for slot, t0, t1 in sequence_runs(seq_index):
        pos = positions[0, t0:t1]
        blocks, _ = _blocks_of(tables[slot], 0, int(pos[-1]) + 1, block_size)
        cache = _gather(pool, blocks)
        out[:, t0:t1] = run(q[:, t0:t1], kv[:, t0:t1], pos[None], cache, cos[:, t0:t1], sin[:, t0:t1])
        _scatter(pool, blocks, cache, pos, block_size)
    return out
