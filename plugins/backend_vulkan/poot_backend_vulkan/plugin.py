"""The Vulkan backend's entry point: `vulkan` (alias `wgpu`), chosen after CUDA and ROCm."""

from __future__ import annotations

from poot_core import BackendSpec, hookimpl, lazy_executor, quiet_probe


@quiet_probe
def probe() -> bool:
    """True when wgpu is installed and finds a Vulkan adapter; never raises (absence of the package, the loader
    or a driver all mean "no device")."""
    from poot_backend_vulkan.kernels.runtime import vulkan_adapters

    return bool(vulkan_adapters())


@quiet_probe
def hardware_probe() -> bool:
    """True only for a Vulkan adapter that is real hardware: automatic selection must not prefer a software
    rasterizer such as lavapipe over the CPU executor (name the backend to use one anyway)."""
    from poot_backend_vulkan.kernels.runtime import vulkan_adapters

    return any(a.info.get("adapter_type") != "CPU" for a in vulkan_adapters())


@hookimpl
def poot_register_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            "vulkan",
            lazy_executor("poot_backend_vulkan.executor", "VulkanExecutor"),
            probe=probe,
            auto_probe=hardware_probe,
            priority=20,
            aliases=("wgpu",),
            description="WGSL compute shaders through wgpu on a Vulkan device",
        )
    ]
