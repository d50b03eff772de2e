"""GPTQ and AWQ integer layouts: unpacking and dequantization.

GPTQ (AutoGPTQ / GPTQModel "v1" format): `qweight` int32 [in / (32 / bits), out] packs 32 / bits values of
consecutive input rows per word (value i in bits [i * bits, (i + 1) * bits)); `qzeros` int32 [groups, out / (32 /
bits)] packs the zero points the same way along the output dim; `scales` [groups, out]; `g_idx` int32 [in] the
group of every input row (a permutation of groups under desc_act). Element value: (q - (zero + 1)) * scale in the
v1 format, (q - zero) * scale in the "gptq_v2" format.

AWQ (the GEMM layout): `qweight` int32 [in, out / 8] packs eight 4-bit values along the output dim in the
interleaved order 0, 2, 4, 6, 1, 3, 5, 7 (nibble i holds column AWQ_ORDER[i]); `qzeros` int32 [groups, out / 8]
likewise; `scales` [groups, out]. Element value: (q - zero) * scale.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Column j of a packed group sits in nibble AWQ_NIBBLE_OF[j].
AWQ_NIBBLE_OF = tuple(AWQ_ORDER.index(j) for j in range(8))


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [r, c] holding 32 / bits values per word along dim 0 -> int32 [r * 32 / bits, c]."""
    per = 32 // bits
    shifts = (torch.arange(per, dtype=torch.int32) * bits).view(1, per, 1)
    out = (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return out.reshape(packed.shape[0] * per, packed.shape[1])


def unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [r, c] holding 32 / bits values per word along dim 1 -> int32 [r, c * 32 / bits]."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    out = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return out.reshape(packed.shape[0], packed.shape[1] * per)


def gptq_dequantize(parts: dict[str, torch.Tensor], meta: dict, rows: slice | None = None) -> torch.Tensor:
    """float32 [selected out rows, in] of a GPTQ matrix."""
    bits = int(meta["bits"])
    sel = rows if rows is not None else slice(None)
    q = unpack_rows(parts["qweight"][:, sel], bits)  # [in, n]
    zeros = unpack_cols(parts["qzeros"], bits)[:, sel]  # [groups, n]
    if meta.get("checkpoint_format") != "gptq_v2":
        zeros = zeros + 1
    scales = parts["scales"][:, sel].float()
    g = parts["g_idx"].long()
    w = (q - zeros[g]).float() * scales[g]
    return w.T.contiguous()


def awq_dequantize(parts: dict[str, torch.Tensor], meta: dict, rows: slice | None = None) -> torch.Tensor:
    """float32 [selected out rows, in] of an AWQ (GEMM layout) matrix."""
    group = int(meta["group_size"])
    order = torch.tensor(AWQ_NIBBLE_OF)

    def columns(packed: torch.Tensor) -> torch.Tensor:
        nib = unpack_cols(packed, 4).view(packed.shape[0], packed.shape[1], 8)
        return nib[:, :, order].reshape(packed.shape[0], -1)

    q, zeros = columns(parts["qweight"]), columns(parts["qzeros"])
    scales = parts["scales"].float()
    if rows is not None:
        q, zeros, scales = q[:, rows], zeros[:, rows], scales[:, rows]
    g = torch.arange(q.shape[0]) // group
    w = (q - zeros[g]).float() * scales[g]
    return w.T.contiguous()
