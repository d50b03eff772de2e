"""The attention op of a paged serving step (StepShape.paging) on the Triton executor.

A step is one row of N tokens from many sequences; each layer's KV state is a pool of blocks
[blocks, kv_heads, block_size, head_dim] (allocated from the graph's state specs like any other state), and
the op's extra inputs are seq_index [N] (-1 for padding) and block_tables [slots, max_blocks]. Every real
token's k/v is first written into its block (one kernel). Decode tokens (runs of one token of a sequence)
then attend through the tables in one launch of paged.paged_decode_attention, and the query tiles of the
prefill runs in one launch of paged.paged_prefill_attention, which also reads the keys through the tables.
The split between the two is made on the device (paged.prefill_tiles), so no step reads anything on the host;
a step of decode tokens only (Paging.decode) skips the split and is replayed as a CUDA graph (mixed steps run
eagerly: executor.prepare says why). Each token's arithmetic is the same whatever else shares its step.

Gemma 3's group attention (an image's tokens see each other both ways) takes the same route, with each query's
last visible key made on the device from the step's groups (images.device_limits).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from poot_core.graph import Node

from .images import device_limits
from .paged import paged_decode_attention, paged_prefill_attention, prefill_tile, prefill_tiles, write_paged_kv

if TYPE_CHECKING:
    from .program import Step


def bind_attention(node: Node, decode_only: bool, grouped: bool = False) -> Callable[[Step], None]:
    """decode_only (Paging.decode): one paged decode launch over every token, nothing read on the host.
    grouped (the group_attention op): a prefill run's tokens of one group (an image's, whole in the run) also see
    each other both ways, through the prefill kernel's last visible key per query (images.device_limits)."""
    names = [r.name for r in node.inputs]
    groups_name = names.pop(6) if grouped else None
    q_name, k_name, v_name, pos_name, kp_key, vp_key, seq_name, tab_name = names
    a = node.attrs
    scale, window, softcap = float(a["scale"]), a.get("window"), a.get("softcap")
    out_name, shape = node.output, node.shape

    def run(s: Step) -> None:
        q, k, v, pos = s.env[q_name][0], s.env[k_name][0], s.env[v_name][0], s.env[pos_name][0]
        seqs, tables = s.env[seq_name], s.env[tab_name]
        kp, vp = s.state[kp_key], s.state[vp_key]
        write_paged_kv(k, v, kp, vp, pos, seqs, tables)
        if decode_only:
            out = paged_decode_attention(q, kp, vp, pos, seqs, tables, scale=scale, window=window, softcap=softcap)
            s.env[out_name] = out.reshape(shape)
            return
        limits = None if groups_name is None else device_limits(s.env[groups_name][0], pos, seqs)
        s.env[out_name] = _device_split(s, q, kp, vp, pos, seqs, tables, scale, window, softcap,
                                        limits).reshape(shape)

    return run


def _device_split(s: Step, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, pos: torch.Tensor,
                  seqs: torch.Tensor, tables: torch.Tensor, scale: float, window: int | None,
                  softcap: float | None, limits: torch.Tensor | None) -> torch.Tensor:
    """A mixed step's attention with nothing read on the host: its decode tokens (one-token runs) through the
    paged decode kernel, its prefill runs' query tiles through the paged prefill kernel (with each query's last
    key, `limits`, under group attention); the split is made once per step on the device (paged.prefill_tiles)
    and shared by every layer."""
    key = ("paged tiles", q.shape[-1])
    split = s.cache.get(key)
    if split is None:
        split = s.cache[key] = prefill_tiles(seqs, pos, prefill_tile(q.device, q.shape[-1]).block_m,
                                             tables.shape[0])
    tiles, decode = split
    tokens = q.shape[0]
    # a spare last row takes the padding entries of the decode list; padding tokens' rows stay zero
    out = torch.zeros(tokens + 1, q.shape[1], vp.shape[-1], dtype=q.dtype, device=q.device)
    listed = decode >= 0
    at = decode.clamp(min=0)
    out[torch.where(listed, decode, tokens)] = paged_decode_attention(
        q[at], kp, vp, pos[at], torch.where(listed, seqs[at], -1), tables, scale=scale, window=window,
        softcap=softcap)  # fmt: skip
    out = out[:tokens]
    paged_prefill_attention(q, kp, vp, pos, seqs, tables, tiles, out, scale=scale, window=window, softcap=softcap,
                            limits=limits)
    return out


def few_tokens_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                         cache: dict, *, scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """A contiguous step of a few tokens a row (q [rows, tokens, heads, dim], their k/v already in the caches
    [rows, kv_heads, capacity, dim]) through the paged decode kernel: each row's cache is one block of the whole
    capacity, so every token attends to its row's keys 0 .. its position with nothing read on the host."""
    rows, tokens = q.shape[0], q.shape[1]
    index = cache.get("few_tokens")
    if index is None:  # the rows' one-block tables and each token's row, made once per step
        rows_of = torch.arange(rows, device=q.device)
        index = cache["few_tokens"] = (rows_of.repeat_interleave(tokens), rows_of[:, None].contiguous())
    seqs, tables = index
    out = paged_decode_attention(q.reshape(rows * tokens, q.shape[2], q.shape[3]), k_cache, v_cache,
                                 positions.reshape(-1), seqs, tables, scale=scale, window=window, softcap=softcap)
    return out.reshape(q.shape[0], tokens, q.shape[2], -1)


__all__ = ["bind_attention", "few_tokens_attention"]
