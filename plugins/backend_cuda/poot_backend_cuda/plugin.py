"""Entry point: the `cuda` backend (alias `ptx`), picked first by automatic selection when a GPU is there."""

from __future__ import annotations

from poot_core import BackendSpec, hookimpl, lazy_executor, quiet_probe


@quiet_probe
def probe() -> bool:
    """True when torch sees a CUDA device and is not a ROCm build. Never raises (a broken torch is absence)."""
    import torch

    return torch.version.hip is None and torch.cuda.is_available() and torch.cuda.device_count() > 0


@hookimpl
def poot_register_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            "cuda",
            lazy_executor("poot_backend_cuda.executor", "CudaExecutor"),
            probe=probe,
            priority=40,
            aliases=("ptx",),
            description="NVIDIA GPU: Triton kernels, CUDA-graph decode",
        )
    ]
