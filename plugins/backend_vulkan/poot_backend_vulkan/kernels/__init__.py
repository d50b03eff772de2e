"""WGSL compute kernels of the Vulkan backend and the wgpu runtime they run on."""
