"""Packed constraint masks applied to the CPU executor's logits in place (its mask_logits, executor.MaskOnDevice):
int32 words, bit b of word w allowing token 32 w + b, unpacked as the host path unpacks them."""

from __future__ import annotations

import numpy as np
import torch


def mask_logits(logits: torch.Tensor, bitmask: np.ndarray, rows: np.ndarray) -> torch.Tensor:
    """In the logits [1, R, vocab], every token of row rows[i] whose bit is 0 in bitmask[i] set to -inf, in
    place; returns the logits."""
    from poot_core.driver.token_masks import mask_host, unpack

    if logits.dtype == torch.float32 and logits.is_contiguous():  # the host path on the tensor's own memory
        mask_host(logits[0].numpy(), rows, bitmask)
        return logits
    allowed = torch.from_numpy(unpack(bitmask, logits.shape[-1]))
    with torch.inference_mode():  # the executors' outputs are inference tensors
        view = logits[0]
        index = torch.from_numpy(np.asarray(rows, dtype=np.int64) % view.shape[0])
        view[index] = view[index].masked_fill(~allowed, float("-inf"))
    return logits
