"""How a model is spread over the ranks of a Coordinator."""

from __future__ import annotations

from enum import StrEnum


class Placement(StrEnum):
    # Megatron split: every rank holds a slice of each layer's heads and MLP features; one all-reduce after the
    # attention output and one after the MLP down projection, the logits gathered from vocabulary slices
    TENSOR = "tensor"
    # layer pipeline: every rank holds a contiguous range of layers; the hidden state goes from rank to rank and
    # the last rank's logits (or token) to all
    PIPELINE = "pipeline"


__all__ = ["Placement"]
