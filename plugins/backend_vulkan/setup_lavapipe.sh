#!/usr/bin/env bash
# Installs Mesa's software Vulkan driver (lavapipe) and the Vulkan loader so the WGSL kernels
# can run on a machine without a GPU. Idempotent: prints nothing when both are already present.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
exec "$root/scripts/apt_install.sh" setup_lavapipe "the Vulkan tests will skip" mesa-vulkan-drivers libvulkan1
