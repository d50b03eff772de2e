"""The CPU executor's ops, in plain torch, float32 activations.

These are also the reference every other backend is compared with, so they favour clarity and exactness:
dense 16-bit weights are multiplied as the float32 product of their exact values (or, where the CPU has a
native 16-bit product, in their own dtype: oneDNN accumulates in float32), packed weights go
through poot_core.cpu.packed_linear, and everything between matmuls is float32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from poot_core.checkpoint.layouts import PackedWeight, Weight
from poot_core.rope import inverse_frequencies, rope_attention_factor


def linear(x: torch.Tensor, w: Weight, b: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(w, PackedWeight):
        from poot_core.cpu.packed_linear import packed_linear

        return packed_linear(x, w, None if b is None else b.float())
    if w.dtype == torch.float32:
        return F.linear(x, w, None if b is None else b.float())
    y = linear16(x, w)
    return y if b is None else y + b.float()


def linear16(x: torch.Tensor, w: torch.Tensor, x16: torch.Tensor | None = None) -> torch.Tensor:
    """float32 x @ W^T for a bf16/f16 W. A few rows (decode) go through the C kernel, which widens each weight
    exactly and sums in float32 at the 16-bit weights' memory cost; more rows (prefill) through float32 tiles of
    the widened weights; only a W those cannot take (not a 2-D matrix) through torch's 16-bit product on x
    rounded to W's dtype (`x16`, when the caller already has it)."""
    from poot_core.cpu.packed_linear import dense16_gemv, dense16_tiles

    y = dense16_gemv(x, w)
    if y is None:
        y = dense16_tiles(x, w)
    if y is not None:
        return y
    return F.linear(x.to(w.dtype) if x16 is None else x16, w).float()


def embed(table: Weight, tokens: torch.Tensor) -> torch.Tensor:
    flat = tokens.reshape(-1)
    if isinstance(table, PackedWeight):
        from poot_core.checkpoint.quant import dequantize
        from poot_core.cpu.packed_linear import embed_rows

        out = embed_rows(table, flat)
        if out is None:
            parts = {k: v[flat] for k, v in table.parts.items()}
            rows = PackedWeight(table.layout, (flat.numel(), table.shape[1]), parts, table.meta)
            out = dequantize(rows)
    else:
        out = table[flat].float()
    return out.reshape(*tokens.shape, -1)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """w is the float32 scale, with any (offset + w) already applied (see the executor's binding)."""
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), w.float(), None if b is None else b.float(), eps)


def rope_tables(positions: torch.Tensor, theta: float, dim: int,
                scaling: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [R, T, 1, dim/2] for the positions of one step (shared by every layer that uses them)."""
    items = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in scaling.items()))
    inv = inverse_frequencies(theta, dim, items)
    angles = positions.float()[..., None] * inv  # [R, T, dim/2]
    factor = rope_attention_factor(scaling)
    cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]
    return (cos, sin) if factor == 1.0 else (cos * factor, sin * factor)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """x [R, T, H, Dh]; rotates the first 2 * cos.shape[-1] features of each head."""
    dim = 2 * cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    if style == "neox":
        a, b = rot[..., : dim // 2], rot[..., dim // 2 :]
        out = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    else:  # interleaved pairs (0, 1), (2, 3), ...
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    return torch.cat((out, rest), dim=-1) if rest.numel() else out


def rope_step_table(cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """The rotation of one step in the form `rope_with` applies with the fewest ops: for neox the full-width
    cos and a signed sin, stacked; for interleaved pairs the complex exponential."""
    if style == "neox":
        return torch.stack((torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)))
    return torch.complex(cos, sin)


def rope_with(x: torch.Tensor, table: torch.Tensor, style: str) -> torch.Tensor:
    """The same rotation as `rope`, from a `rope_step_table`."""
    dim = table.shape[-1] * (1 if style == "neox" else 2)
    rot, rest = x[..., :dim], x[..., dim:]
    if style == "neox":
        half = dim // 2
        out = rot * table[0] + torch.cat((rot[..., half:], rot[..., :half]), dim=-1) * table[1]
    else:
        pairs = torch.view_as_complex(rot.reshape(*rot.shape[:-1], dim // 2, 2).contiguous())
        out = torch.view_as_real(pairs * table).flatten(-2)
    return torch.cat((out, rest), dim=-1) if rest.numel() else out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
              k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, window: int | None,
              softcap: float | None) -> torch.Tensor:
    """q [R, T, Hq, D]; k, v [R, T, Hkv, D]; caches [R, Hkv, C, D]; positions [R, T] consecutive per row."""
    from poot_core.cpu.c_attention import attend_blocks, attend_few

    rows, tokens, heads, _ = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    few = attend_few(q, k, v, positions, k_cache, v_cache, scale, window, softcap)  # decode: a C kernel
    if few is not None:
        return few
    starts = [int(p) for p in positions[:, 0]]
    for r, start in enumerate(starts):
        k_cache[r, :, start : start + tokens] = k[r].transpose(0, 1)
        v_cache[r, :, start : start + tokens] = v[r].transpose(0, 1)
    blocks = attend_blocks(q, positions, k_cache, v_cache, scale, window, softcap)  # prefill: a C kernel
    if blocks is not None:
        return blocks
    outs = []
    for r, start in enumerate(starts):
        end = start + tokens
        first = 0 if window is None else max(0, start - window + 1)
        keys, values = k_cache[r, :, first:end], v_cache[r, :, first:end]  # [Hkv, S, D]
        qr = q[r].transpose(0, 1)  # [Hq, T, D]
        # A single query sees every key kept (no mask); a chunk starting at 0 whose window covers it is plain
        # causal attention, which the kernel does without a mask and skipping the masked half.
        plain_causal = start == 0 and (window is None or window >= tokens)
        mask = None
        if softcap is not None or not (tokens == 1 or plain_causal):
            qpos = positions[r][:, None]  # [T, 1]
            kpos = torch.arange(first, end)[None, :]
            mask = kpos <= qpos
            if window is not None:
                mask = mask & (qpos - kpos < window)
        if softcap is None:
            o = F.scaled_dot_product_attention(qr[None], keys[None], values[None], attn_mask=mask,
                                               is_causal=plain_causal and tokens > 1, scale=scale,
                                               enable_gqa=group > 1)[0]
        else:
            keys_g = keys.repeat_interleave(group, 0)
            values_g = values.repeat_interleave(group, 0)
            scores = (qr @ keys_g.transpose(-1, -2)) * scale
            scores = torch.tanh(scores / softcap) * softcap
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            o = torch.softmax(scores, dim=-1) @ values_g
        outs.append(o.transpose(0, 1))  # [T, Hq, Dv]
    return outs[0][None] if rows == 1 else torch.stack(outs)


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Bidirectional attention; mask [R, T] is 1 for real tokens and 0 for padding keys."""
    allowed = mask.bool()[:, None, None, :]  # [R, 1, 1, T]
    group = q.shape[2] // k.shape[2]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=allowed, scale=scale, enable_gqa=group > 1)
    return o.transpose(1, 2)


def activation(x: torch.Tensor, act: str) -> torch.Tensor:
    if act == "silu":
        return F.silu(x)
    if act == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if act == "gelu":
        return F.gelu(x)
    if act == "relu":
        return F.relu(x)
    if act == "sigmoid":  # Qwen3-Next's attention output gate
        return torch.sigmoid(x)
    raise ValueError(f"activation {act}")


def gated(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    return activation(gate, act) * up


def logits(x: torch.Tensor, w: Weight, softcap: float | None,
           product: Callable[[torch.Tensor], torch.Tensor | None] | None = None) -> torch.Tensor:
    """x @ W^T (through `product` where it takes x: packed_linear.few_rows_product's decode rows), softcapped."""
    y = product(x) if product is not None else None
    if y is None:
        y = linear(x, w)
    if softcap is not None:
        y = torch.tanh(y / softcap) * softcap
    return y
