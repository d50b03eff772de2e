#!/usr/bin/env bash
# Installs Mesa's software Vulkan driver (lavapipe) and the Vulkan loader so the WGSL kernels
# can run on a machine without a GPU. Idempotent: prints nothing when both are already present.
set -euo pipefail

packages=(mesa-vulkan-drivers libvulkan1)
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
    # Not fatal: without a Vulkan device the Vulkan tests skip (and say why); everything else still runs.
    echo "setup_lavapipe: cannot install ${missing[*]} without root; the Vulkan tests will skip" >&2
    exit 0
  fi
fi

echo "setup_lavapipe: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq >/dev/null
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
