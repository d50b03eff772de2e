"""The CPU executor's multi-head latent attention (DeepSeek V2/V3).

The cache holds, per token, the normed latent [L] and the rotated rope key [dr], nothing else. With a dense
kv_b the per-head key and value projections are absorbed into the query and the output (q_nope @ W_k^T
scores against the latent directly; the attention-weighted latent goes through W_v afterwards), so the
cached latent is never expanded. A packed kv_b is applied to the cached latent through ops.linear instead
(the expanded form: same result, more work per step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from poot_core.checkpoint.layouts import PackedWeight, Weight
from poot_core.cpu import ops
from poot_core.graph import Node, Ref


def _attend(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, qpos: torch.Tensor, end: int, scale: float
) -> torch.Tensor:
    """query [H, T, E]; keys [Hk, S, E]; values [Hk, S, Dv], Hk 1 or H; causal by position -> [H, T, Dv]."""
    tokens = query.shape[1]
    mask = None if tokens == 1 else torch.arange(end)[None, :] <= qpos[:, None]
    return F.scaled_dot_product_attention(
        query[None], keys[None], values[None], attn_mask=mask, scale=scale, enable_gqa=keys.shape[0] != query.shape[0]
    )[0]


def mla_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    kv_norm: torch.Tensor,
    kv_b: Weight,
    cache: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    a: dict[str, Any],
) -> torch.Tensor:
    """q [R, T, H, dn + dr]; kv [R, T, L + dr]; cache [R, 1, C, L + dr]; cos, sin [R, T, 1, dr / 2]."""
    rows, tokens, heads, _ = q.shape
    dn, dr, dv = a["nope_dim"], a["rope_dim"], a["v_dim"]
    latent_dim = kv.shape[-1] - dr
    q_nope = q[..., :dn]
    q_rot = ops.rope(q[..., dn:], cos, sin, a["style"])  # [R, T, H, dr]
    latent = ops.rms_norm(kv[..., :latent_dim], kv_norm, a["eps"])  # [R, T, L]
    k_rot = ops.rope(kv[..., None, latent_dim:], cos, sin, a["style"])[:, :, 0]  # [R, T, dr]
    out = torch.empty(rows, tokens, heads, dv)
    for r in range(rows):
        start = int(positions[r, 0])
        end = start + tokens
        cache[r, 0, start:end, :latent_dim] = latent[r]
        cache[r, 0, start:end, latent_dim:] = k_rot[r]
        kept = cache[r, :, :end]  # [1, S, L + dr]
        qn = q_nope[r].transpose(0, 1)  # [H, T, dn]
        qr = q_rot[r].transpose(0, 1)  # [H, T, dr]
        if isinstance(kv_b, PackedWeight):
            expanded = ops.linear(kept[0, :, :latent_dim], kv_b).view(end, heads, dn + dv).transpose(0, 1)
            rot = kept[:, :, latent_dim:].expand(heads, end, dr)
            keys = torch.cat((expanded[..., :dn], rot), dim=-1)  # [H, S, dn + dr]
            o = _attend(torch.cat((qn, qr), dim=-1), keys, expanded[..., dn:], positions[r], end, a["scale"])
        else:
            w = kv_b.view(heads, dn + dv, latent_dim)
            w_k, w_v = w[:, :dn], w[:, dn:]  # [H, dn, L], [H, dv, L]
            q_lat = torch.matmul(qn.to(w.dtype), w_k).float()  # [H, T, L]
            o_lat = _attend(
                torch.cat((q_lat, qr), dim=-1), kept, kept[:, :, :latent_dim], positions[r], end, a["scale"]
            )  # [H, T, L]
            o = torch.matmul(o_lat.to(w.dtype), w_v.transpose(1, 2)).float()  # [H, T, dv]
        out[r] = o.transpose(0, 1)
    return out


def bind(node: Node, args: list[Callable[..., Any]], get: Callable[[Ref | None], Any]) -> Callable[..., torch.Tensor]:
    """The executor's binding: inputs (q, kv, positions, kv_norm, kv_b, cache), then (seq_index, block_tables)
    in a paged step."""
    a = node.attrs
    q, kv, pos, _, _, cache, *paged_inputs = args
    kv_norm = get(node.inputs[3]).float()  # a small vector, float32 once
    kv_b = get(node.inputs[4])
    # The same key as the executor's rope op: tables shared with any rope of the same settings in this step.
    key = f"rope:{node.inputs[2]}:{a['theta']}:{a['rope_dim']}:{sorted(a['scaling'].items())}"

    def run(e: dict[str, Any], s: dict[str, torch.Tensor]) -> torch.Tensor:
        tables = e.get(key)
        if tables is None:
            tables = e[key] = ops.rope_tables(pos(e, s), a["theta"], a["rope_dim"], a["scaling"])
        return mla_attention(q(e, s), kv(e, s), pos(e, s), kv_norm, kv_b, cache(e, s), tables[0], tables[1], a)

    if node.input(6) is None:
        return run
    from poot_core.cpu import paged

    seqs, block_tables = paged_inputs

    def one_sequence(qs: torch.Tensor, kvs: torch.Tensor, ps: torch.Tensor, c: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> torch.Tensor:
        return mla_attention(qs, kvs, ps, kv_norm, kv_b, c, cos, sin, a)

    def run_paged(e: dict[str, Any], s: dict[str, torch.Tensor]) -> torch.Tensor:
        tables = e.get(key)
        if tables is None:
            tables = e[key] = ops.rope_tables(pos(e, s), a["theta"], a["rope_dim"], a["scaling"])
        return paged.latent_attention(q(e, s), kv(e, s), pos(e, s), seqs(e, s), block_tables(e, s), cache(e, s),
                                      tables[0], tables[1], one_sequence, a)

    return run_paged
