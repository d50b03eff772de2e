"""poot-backend-cuda: runs traced graphs on an NVIDIA GPU with the Triton kernels of poot-kernels-triton.

Weights are uploaded as stored (16-bit stays 16-bit, GGUF and GPTQ stay packed); q/k/v and gate/up are
concatenated so one GEMV reads them; a decode step is captured once per shape as a CUDA graph and replayed.
"""

from poot_backend_cuda.plugin import probe

__all__ = ["probe"]
