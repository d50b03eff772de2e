"""poot-backend-rocm: runs traced graphs on an AMD GPU with the Triton kernels of poot-kernels-triton.

torch on ROCm calls the GPU "cuda" and Triton compiles the kernels for HIP, so the executor is the shared
`poot_kernels_triton.executor.TritonExecutor` with the AMD tuning of the device's architecture; this
package adds the probe, the table of AMD architectures and what each lacks (FP8 on CDNA2 and RDNA3).
"""

from poot_backend_rocm.arch import ARCHITECTURES, AmdArch, arch_info
from poot_backend_rocm.plugin import probe

__all__ = ["ARCHITECTURES", "AmdArch", "arch_info", "probe"]
