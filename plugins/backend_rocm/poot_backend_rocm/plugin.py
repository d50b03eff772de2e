"""Entry point: the `rocm` backend (alias `hip`), picked by automatic selection after CUDA, before Vulkan."""

from __future__ import annotations

from poot_core import BackendSpec, hookimpl, lazy_executor, quiet_probe


@quiet_probe
def probe() -> bool:
    """True when torch is a ROCm build and sees an AMD device. Never raises (a broken torch is absence)."""
    import torch

    return bool(torch.version.hip) and torch.cuda.is_available() and torch.cuda.device_count() > 0


@hookimpl
def poot_register_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            "rocm",
            lazy_executor("poot_backend_rocm.executor", "RocmExecutor"),
            probe=probe,
            priority=30,
            aliases=("hip",),
            description="AMD GPU: Triton kernels compiled for HIP, AMD tunings, HIP-graph decode",
        )
    ]
