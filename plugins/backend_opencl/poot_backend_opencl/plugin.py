"""The OpenCL backend's entry point: `opencl` (alias `cl`), chosen after CUDA, ROCm and Vulkan."""

from __future__ import annotations

from poot_core import BackendSpec, hookimpl, lazy_executor, quiet_probe


@quiet_probe
def probe() -> bool:
    """True when pyopencl is installed and finds an OpenCL device; never raises (absence of the package, the
    ICD loader or a driver all mean "no device")."""
    from poot_backend_opencl.kernels.runtime import opencl_devices

    return bool(opencl_devices())


@quiet_probe
def hardware_probe() -> bool:
    """True only for an OpenCL device that is not the CPU: automatic selection must not prefer a CPU OpenCL
    driver such as pocl over the CPU executor (name the backend to use one anyway)."""
    from poot_backend_opencl.kernels.runtime import is_cpu_device, opencl_devices

    return any(not is_cpu_device(d) for d in opencl_devices())


@hookimpl
def poot_backend_devices() -> list[str]:
    """One line per OpenCL device found (platform, device, kind, memory, limits), for `poot plugins`."""
    try:
        from poot_backend_opencl.kernels.runtime import describe, opencl_devices
    except ImportError as exc:
        return [f"(pyopencl is not importable: {exc})"]
    return [describe(d) for d in opencl_devices()]


@hookimpl
def poot_register_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            "opencl",
            lazy_executor("poot_backend_opencl.executor", "OpenCLExecutor"),
            probe=probe,
            auto_probe=hardware_probe,
            priority=10,
            aliases=("cl",),
            description="OpenCL C kernels through pyopencl on an OpenCL device",
        )
    ]
