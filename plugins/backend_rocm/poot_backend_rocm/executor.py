"""The ROCm executor: the shared Triton executor with the AMD tuning of the device's architecture.

torch on ROCm exposes the AMD GPU as device "cuda" and Triton compiles the kernels for HIP, so nothing here
launches a kernel itself. What is AMD's own: the architecture table (tuning, what the hardware lacks) and
the refusal, at upload, of weights the architecture cannot compute with.
"""

from __future__ import annotations

import torch

from poot_backend_rocm.arch import AmdArch, arch_info
from poot_backend_rocm.plugin import probe
from poot_core import PackedWeight, Reason, Unsupported, Weight, weight_kind
from poot_kernels_triton import TUNINGS
from poot_kernels_triton.executor import TritonExecutor


def device_arch(device: int | str | torch.device = 0) -> str:
    """The architecture name the driver reports for a device, e.g. "gfx942:sramecc+:xnack-"."""
    return str(torch.cuda.get_device_properties(device).gcnArchName)


def is_fp8(w: Weight) -> bool:
    if isinstance(w, PackedWeight):
        return w.layout == "fp8"
    return "float8" in str(w.dtype)


class RocmExecutor(TritonExecutor):
    name = "rocm"
    notes = "Triton kernels compiled for HIP with AMD tunings; decode steps replayed as HIP graphs"

    def __init__(self, device: int | str | torch.device = 0, *, use_graphs: bool = True) -> None:
        if not probe():
            raise Unsupported(Reason.BACKEND, "rocm", "torch is not a ROCm build or sees no AMD GPU on this machine")
        self._setup(arch_info(device_arch(device)), device, use_graphs)

    @classmethod
    def for_arch(cls, arch: str, device: int | str | torch.device = "cpu", *, use_graphs: bool = False) -> RocmExecutor:
        """An executor for a named architecture on any torch device, with no probe: on the CPU under
        TRITON_INTERPRET it runs the ROCm binding with that architecture's tiles (the checks CI can do
        without an AMD GPU), and it records the launches an ahead-of-time build compiles."""
        ex = cls.__new__(cls)
        ex._setup(arch_info(arch), device, use_graphs)
        return ex

    def _setup(self, arch: AmdArch, device: int | str | torch.device, use_graphs: bool) -> None:
        self.arch = arch
        # hipGraphs run through torch.cuda.CUDAGraph on ROCm; `use_graphs=False` replays nothing (debugging)
        TritonExecutor.__init__(self, device, tuning=TUNINGS[arch.tuning], use_graphs=use_graphs)

    def check_weight(self, name: str, w: Weight) -> None:
        if is_fp8(w):
            kind = weight_kind(w)
            if not self.arch.fp8_formats:
                raise Unsupported(
                    Reason.QUANTIZATION,
                    f"{kind} (tensor {name}) on {self.arch.name}",
                    f"{self.arch.name} ({self.arch.family}) has no FP8 arithmetic; "
                    "use a 16-bit, GGUF or GPTQ checkpoint",
                )
            raise Unsupported(
                Reason.QUANTIZATION,
                f"{kind} (tensor {name}) on {self.arch.name}",
                f"{self.arch.name} computes FP8 as {'/'.join(self.arch.fp8_formats)}, but the shared Triton "
                "kernels have no FP8 matrix product yet (neither does the cuda backend)",
            )
        super().check_weight(name, w)


__all__ = ["RocmExecutor", "device_arch", "is_fp8"]
