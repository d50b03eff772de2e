"""Entry point: the `rocm` backend (alias `hip`), picked by automatic selection after CUDA, before Vulkan."""

from __future__ import annotations

from poot_core import BackendSpec, hookimpl


def probe() -> bool:
    """True when torch is a ROCm build and sees an AMD device. Never raises."""
    try:
        import torch

        return bool(torch.version.hip) and torch.cuda.is_available() and torch.cuda.device_count() > 0
    except Exception:  # a broken torch install is absence, not an error of the probe
        return False


def _open():  # noqa: ANN202 - imported lazily so discovery stays cheap
    from poot_backend_rocm.executor import RocmExecutor

    return RocmExecutor()


@hookimpl
def poot_register_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            "rocm",
            _open,
            probe=probe,
            priority=30,
            aliases=("hip",),
            description="AMD GPU: Triton kernels compiled for HIP, AMD tunings, HIP-graph decode",
        )
    ]
