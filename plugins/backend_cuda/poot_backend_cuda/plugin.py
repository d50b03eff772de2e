"""Entry point: the `cuda` backend (alias `ptx`), picked first by automatic selection when a GPU is there."""

from __future__ import annotations

from poot_core import BackendSpec, hookimpl


def probe() -> bool:
    """True when torch sees a CUDA device and is not a ROCm build. Never raises."""
    try:
        import torch

        return torch.version.hip is None and torch.cuda.is_available() and torch.cuda.device_count() > 0
    except Exception:  # a broken torch install is absence, not an error of the probe
        return False


def _open():  # noqa: ANN202 - imported lazily so discovery stays cheap
    from poot_backend_cuda.executor import CudaExecutor

    return CudaExecutor()


@hookimpl
def poot_register_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            "cuda",
            _open,
            probe=probe,
            priority=40,
            aliases=("ptx",),
            description="NVIDIA GPU: Triton kernels, CUDA-graph decode",
        )
    ]
