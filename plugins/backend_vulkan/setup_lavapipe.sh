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

if [ "$(id -u)" -ne 0 ]; then
  echo "setup_lavapipe: need root to install ${missing[*]}" >&2
  exit 1
fi

echo "setup_lavapipe: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
