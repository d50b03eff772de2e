#!/usr/bin/env bash
# Installs pocl (a CPU OpenCL device, compiled through LLVM) and the OpenCL ICD loader so the OpenCL C kernels
# can run on a machine without a GPU. Idempotent: prints nothing when both are already present.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
exec "$root/scripts/apt_install.sh" setup_pocl "the OpenCL tests will skip" pocl-opencl-icd ocl-icd-libopencl1
