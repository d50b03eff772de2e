"""poot-backend-opencl: OpenCL C kernels run through pyopencl on any OpenCL device."""

from __future__ import annotations

__all__: list[str] = []
