"""The CUDA executor: the shared Triton executor on an NVIDIA GPU, decode steps replayed as CUDA graphs."""

from __future__ import annotations

import torch

from poot_backend_cuda.plugin import probe
from poot_core import Reason, Unsupported
from poot_kernels_triton.executor import HEADROOM, TRITON_OPS, TritonExecutor

CUDA_OPS = TRITON_OPS

__all__ = ["CUDA_OPS", "HEADROOM", "CudaExecutor"]


class CudaExecutor(TritonExecutor):
    name = "cuda"

    def __init__(self, device: int | str | torch.device = 0) -> None:
        if not probe():
            raise Unsupported(Reason.BACKEND, "cuda", "torch sees no CUDA device on this machine")
        super().__init__(device)
