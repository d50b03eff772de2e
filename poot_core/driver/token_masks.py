"""Constraint masks applied to a step's logits, one way for the Driver, the serving engine and speculation.

A mask is llguidance's packed bitmask: int32 words, bit b of word w allowing token 32 w + b. The masks of the
rows a step samples under a constraint are stacked into one int32 [n, words] array (vocab / 8 bytes a row) and
handed with the rows' indices to the executor's `mask_logits` (executor.MaskOnDevice), which sets the refused
tokens to -inf on the device, in place: only the packed words cross to the device, and a greedy row then takes
the device's argmax, so its logits never cross back. An executor without `mask_logits` gets the same masks
applied on the host, to the logits `to_numpy` reads (`unpack` and numpy); both give the same logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from poot_core.executor import Executor, Output, device_mask


def words(vocab: int) -> int:
    """int32 words of one row's packed mask over `vocab` tokens."""
    return -(-vocab // 32)


def unpack(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """bool [n, vocab]: the tokens each row of a packed int32 [n, words] mask allows."""
    little = np.ascontiguousarray(bitmask, dtype="<i4")  # bytes from the lowest: bit b of word w is bit 32 w + b
    bits = np.unpackbits(little.view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab].view(bool)


def mask_host(logits: np.ndarray, rows: np.ndarray, bitmask: np.ndarray) -> None:
    """In float32 logits [R, vocab] on the host, every token of row rows[i] whose bit is 0 in bitmask[i] set to
    -inf, in place (only those are written)."""
    refused = ~unpack(bitmask, logits.shape[-1])
    for i, row in enumerate(np.asarray(rows, dtype=np.int64) % logits.shape[0]):
        np.copyto(logits[row], -np.inf, where=refused[i])


@dataclass
class Masked:
    """A step's logits with the masks applied: on the device (`output` is the masked output) or on the host
    (`output` is the step's output as it came, the masked logits are in `host()`)."""

    executor: Executor
    output: Output
    on_device: bool
    _host: np.ndarray | None = None

    def host(self) -> np.ndarray:
        """float32 [R, vocab]: the masked logits of the output's rows, on the host."""
        if self._host is None:
            self._host = self.executor.to_numpy(self.output)[0]
        return self._host


class TokenMasks:
    """How one executor's logits are masked. `device` is the executor's mask_logits (None: the host path; tests
    set it to None to compare the two)."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.device = device_mask(executor)

    def apply(self, output: Output, rows: Sequence[int] | np.ndarray, bitmask: np.ndarray) -> Masked:
        """The logits output [1, R, vocab] with row rows[i] (0..R-1, or negative from the end) masked by
        bitmask[i] (int32 [n, words])."""
        rows = np.asarray(rows, dtype=np.int64)
        bitmask = np.ascontiguousarray(bitmask, dtype=np.int32)
        if self.device is not None:
            return Masked(self.executor, self.device(output, bitmask, rows), True)
        logits = self.executor.to_numpy(output)[0]
        if not logits.flags.writeable:
            logits = logits.copy()
        mask_host(logits, rows, bitmask)
        return Masked(self.executor, output, False, logits)
