#!/usr/bin/env bash
# Installs pocl (a CPU OpenCL device, compiled through LLVM) and the OpenCL ICD loader so the OpenCL C kernels
# can run on a machine without a GPU. Idempotent: prints nothing when both are already present.
set -euo pipefail

packages=(pocl-opencl-icd ocl-icd-libopencl1)
missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done

if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo="sudo -n"
  else
    # Not fatal: without an OpenCL device the OpenCL tests skip (and say why); everything else still runs.
    echo "setup_pocl: cannot install ${missing[*]} without root; the OpenCL tests will skip" >&2
    exit 0
  fi
fi

echo "setup_pocl: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq >/dev/null
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
